"""Evidence the fault, security, fuzz and soak tests leave behind for ``cdgpc-admin bench faults``.

A test that proves a figure (a worst overshoot, a count of refused forgeries, a takeover time)
asserts it *and* records it here, so that the summary a person reads is the one the suite just
checked. Every pytest process appends JSON lines to its own file in ``$CDGPC_EVIDENCE_DIR``
(default ``build/evidence`` under the working directory); the summary keeps the newest record
for each ``(kind, name)``, so a partial rerun refreshes only what it ran.

Kinds and the fields each carries (all numbers plain floats or ints):

- ``fault``: ``injected`` and ``survived`` (0/1), ``worst_overshoot_pct`` (of the budget),
  ``overshoot_s`` (longest stretch above budget + guard band), ``lease_s``,
  ``registrations_sent`` / ``registrations_stored``, ``gpus_left_locked``.
- ``attack``: ``tried`` / ``refused`` / ``state_changed`` for one attack class on one endpoint.
- ``fuzz``: ``cases`` / ``unhandled`` for one fuzz target.
- ``soak``: ``nodes``, ``gpus``, ``sim_minutes``, ``rss_start_mb`` / ``rss_end_mb``, ...
- ``takeover``: ``kills`` and ``takeover_s`` (a list: one per kill).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Final

EVIDENCE_DIR_ENV: Final = "CDGPC_EVIDENCE_DIR"
DEFAULT_EVIDENCE_DIR: Final = Path("build/evidence")
KINDS: Final = frozenset({"fault", "attack", "fuzz", "soak", "takeover"})


def evidence_dir() -> Path:
    return Path(os.environ.get(EVIDENCE_DIR_ENV, str(DEFAULT_EVIDENCE_DIR)))


def record(kind: str, name: str, **fields: float | int | str | list[float]) -> None:
    """Append one record of ``kind`` named ``name`` (e.g. ``fault``, ``head-sigkill``)."""
    if kind not in KINDS:
        raise ValueError(f"unknown evidence kind {kind!r}; one of {sorted(KINDS)}")
    directory = evidence_dir()
    directory.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"kind": kind, "name": name, "t_s": time.time(), **fields})
    with (directory / f"{os.getpid()}.jsonl").open("a", encoding="utf-8") as out:
        out.write(line + "\n")
