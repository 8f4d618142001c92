"""The figures the fault, security, fuzz and soak tests proved, summarised for a person.

Those tests assert a figure and append it as one JSON line to ``$CDGPC_EVIDENCE_DIR`` (default
``build/evidence``), one file per pytest process (``tests/evidence.py`` writes them). This module
reads every ``*.jsonl`` there, keeps the newest record (by ``t_s``) for each ``(kind, name)`` so a
partial rerun refreshes only what it ran, and adds them up per kind. A kind that no test
recorded is listed under ``absent`` and its section is null: nothing is ever estimated.

Attack records are named ``<class>:<endpoint>`` (``forged:head POST /v1/budget``); the class
is what comes before the first colon. ``accepted`` is the record's own count when it has one,
else ``tried - refused``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final, TypeGuard

from slurm_cdgpc.errors import InputError

EVIDENCE_DIR_ENV: Final = "CDGPC_EVIDENCE_DIR"
DEFAULT_EVIDENCE_DIR: Final = Path("build/evidence")
KINDS: Final = ("fault", "attack", "fuzz", "soak", "takeover")
HINT: Final = "run `pytest -m 'faults or security'` first"

Record = dict[str, Any]


class EvidenceError(InputError):
    """No evidence to summarise (or none that can be read)."""


def evidence_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get(EVIDENCE_DIR_ENV) or DEFAULT_EVIDENCE_DIR)


def load_evidence(directory: Path) -> tuple[dict[tuple[str, str], Record], int]:
    """The newest record per ``(kind, name)``, and how many lines could not be read.

    A line cut short (a test killed mid-write) or of an unknown kind is skipped and counted, not
    fatal: the rest of the evidence still stands.
    """
    files = sorted(directory.glob("*.jsonl")) if directory.is_dir() else []
    if not files:
        raise EvidenceError(f"no evidence in {directory}: {HINT}")
    newest: dict[tuple[str, str], Record] = {}
    unreadable = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise EvidenceError(f"cannot read {path}: {e.strerror or e}") from e
        for line in text.splitlines():
            if not line.strip():
                continue
            record = _parse(line)
            if record is None:
                unreadable += 1
                continue
            key = (record["kind"], record["name"])
            if key not in newest or record["t_s"] >= newest[key]["t_s"]:
                newest[key] = record
    if not newest:
        raise EvidenceError(f"no readable evidence in {directory}: {HINT}")
    return newest, unreadable


def _parse(line: str) -> Record | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if (
        not isinstance(record, dict)
        or record.get("kind") not in KINDS
        or not isinstance(record.get("name"), str)
        or not _is_number(record.get("t_s"))
    ):
        return None
    return record


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _field(record: Record, field: str) -> float:
    """A count in a record; 0 when the record does not carry it."""
    value = record.get(field)
    return float(value) if _is_number(value) else 0.0


def _numbers(records: Iterable[Record], field: str) -> list[float]:
    return [r[field] for r in records if _is_number(r.get(field))]


def _total(records: list[Record], field: str) -> float | None:
    """The sum of ``field`` over the records that carry it; None when none does."""
    values = _numbers(records, field)
    return _plain(sum(values)) if values else None


def _plain(value: float) -> float:
    """Counts stay integers in the JSON."""
    return int(value) if float(value).is_integer() else float(value)


def summarise(newest: Mapping[tuple[str, str], Record]) -> dict[str, Any]:
    by_kind: dict[str, list[Record]] = {kind: [] for kind in KINDS}
    for (kind, _), record in sorted(newest.items()):
        by_kind[kind].append(record)
    return {
        "records": len(newest),
        "absent": [kind for kind in KINDS if not by_kind[kind]],
        "faults": _faults(by_kind["fault"]),
        "attacks": _attacks(by_kind["attack"]),
        "fuzz": _fuzz(by_kind["fuzz"]),
        "soak": _soak(by_kind["soak"]),
        "takeover": _takeover(by_kind["takeover"]),
    }


def summarise_dir(directory: Path) -> dict[str, Any]:
    newest, unreadable = load_evidence(directory)
    return {"evidence_dir": str(directory), "unreadable_lines": unreadable, **summarise(newest)}


def _faults(records: list[Record]) -> dict[str, Any] | None:
    if not records:
        return None
    with_overshoot = [r for r in records if _is_number(r.get("worst_overshoot_pct"))]
    worst = max(with_overshoot, key=lambda r: r["worst_overshoot_pct"], default=None)
    longest = _numbers(records, "overshoot_s")
    return {
        "tests": len(records),
        "injected": _total(records, "injected"),
        "survived": _total(records, "survived"),
        "not_survived": sorted(
            r["name"] for r in records if _is_number(r.get("survived")) and not r["survived"]
        ),
        "worst_overshoot_pct": None if worst is None else worst["worst_overshoot_pct"],
        "worst_overshoot_s": None if worst is None else worst.get("overshoot_s"),
        "worst_overshoot_in": None if worst is None else worst["name"],
        "longest_overshoot_s": max(longest) if longest else None,
        "registrations_sent": _total(records, "registrations_sent"),
        "registrations_stored": _total(records, "registrations_stored"),
        "gpus_left_locked": _total(records, "gpus_left_locked"),
    }


def _attacks(records: list[Record]) -> dict[str, Any] | None:
    if not records:
        return None
    classes: dict[str, dict[str, float]] = {}
    for r in records:
        cls = r["name"].split(":", 1)[0]
        tried, refused = _field(r, "tried"), _field(r, "refused")
        accepted = _field(r, "accepted") if _is_number(r.get("accepted")) else tried - refused
        changed = _field(r, "state_changed")
        entry = classes.setdefault(
            cls, {"records": 0, "tried": 0, "refused": 0, "accepted": 0, "state_changed": 0}
        )
        entry["records"] += 1
        entry["tried"] += tried
        entry["refused"] += refused
        entry["accepted"] += accepted
        entry["state_changed"] += 1 if changed else 0
    totals = {
        field: _plain(sum(c[field] for c in classes.values()))
        for field in ("tried", "refused", "accepted", "state_changed")
    }
    accepted_in = sorted(
        r["name"]
        for r in records
        if (r["accepted"] if _is_number(r.get("accepted")) else 0) > 0
        or (
            _is_number(r.get("tried"))
            and _is_number(r.get("refused"))
            and r["refused"] < r["tried"]
        )
    )
    return {
        **totals,
        "classes": {
            cls: {k: _plain(v) for k, v in entry.items()} for cls, entry in sorted(classes.items())
        },
        "accepted_in": accepted_in,
    }


def _fuzz(records: list[Record]) -> dict[str, Any] | None:
    if not records:
        return None
    return {
        "cases": _total(records, "cases"),
        "unhandled": _total(records, "unhandled"),
        "targets": {
            r["name"]: {"cases": r.get("cases"), "unhandled": r.get("unhandled")} for r in records
        },
    }


_SOAK_FIELDS: Final = ("nodes", "gpus", "sim_minutes", "rss_start_mb", "rss_end_mb")


def _soak(records: list[Record]) -> dict[str, Any] | None:
    if not records:
        return None
    runs = {}
    for r in records:
        run = {field: r.get(field) for field in _SOAK_FIELDS}
        known = _is_number(r.get("rss_start_mb")) and _is_number(r.get("rss_end_mb"))
        run["rss_growth_mb"] = (
            _field(r, "rss_end_mb") - _field(r, "rss_start_mb") if known else None
        )
        runs[r["name"]] = run
    return {"runs": runs}


def _takeover(records: list[Record]) -> dict[str, Any] | None:
    if not records:
        return None
    times = [
        float(t)
        for r in records
        if isinstance(r.get("takeover_s"), list)
        for t in r["takeover_s"]
        if _is_number(t)
    ]
    return {
        "kills": _total(records, "kills"),
        "count": len(times),
        "p50_s": statistics.median(times) if times else None,
        "max_s": max(times) if times else None,
    }


def _show(value: object) -> str:
    if value is None:
        return "absent"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def render_text(summary: Mapping[str, Any]) -> str:
    """A few lines for a person; ``--json`` gives everything."""
    lines = [f"evidence: {summary['evidence_dir']} ({summary['records']} records)"]
    faults = summary["faults"]
    if faults is not None:
        lines.append(
            f"faults: {_show(faults['survived'])} survived of {_show(faults['injected'])} injected;"
            f" worst overshoot {_show(faults['worst_overshoot_pct'])} % of the budget for"
            f" {_show(faults['worst_overshoot_s'])} s ({_show(faults['worst_overshoot_in'])});"
            f" registrations {_show(faults['registrations_stored'])} stored of"
            f" {_show(faults['registrations_sent'])} sent"
        )
    attacks = summary["attacks"]
    if attacks is not None:
        lines.append(
            f"attacks: {_show(attacks['refused'])} refused of {_show(attacks['tried'])} tried,"
            f" {_show(attacks['accepted'])} accepted, state changed {attacks['state_changed']}x"
        )
        for cls, entry in attacks["classes"].items():
            lines.append(
                f"  {cls}: {entry['refused']}/{entry['tried']} refused,"
                f" {entry['accepted']} accepted"
            )
        for name in attacks["accepted_in"]:
            lines.append(f"  ACCEPTED: {name}")
    fuzz = summary["fuzz"]
    if fuzz is not None:
        lines.append(
            f"fuzz: {_show(fuzz['cases'])} cases over {len(fuzz['targets'])} targets,"
            f" {_show(fuzz['unhandled'])} unhandled"
        )
    soak = summary["soak"]
    if soak is not None:
        for name, run in soak["runs"].items():
            lines.append(
                f"soak {name}: RSS {_show(run['rss_start_mb'])} -> {_show(run['rss_end_mb'])} MB"
            )
    takeover = summary["takeover"]
    if takeover is not None:
        lines.append(
            f"takeover: {takeover['count']} times, p50 {_show(takeover['p50_s'])} s,"
            f" max {_show(takeover['max_s'])} s"
        )
    if summary["absent"]:
        lines.append(f"absent: {', '.join(summary['absent'])}")
    return "\n".join(lines)
