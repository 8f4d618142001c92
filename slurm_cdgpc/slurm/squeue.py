"""Running jobs from ``squeue --json`` (Slurm 22.05+), for the head's reconcile.

The shapes differ between versions and are read defensively: 22.05 gives ``job_state:
"RUNNING"`` and plain integers (``job_id``, ``start_time``, ``time_limit`` in minutes); 23.02+
give ``job_state: ["RUNNING"]`` and numbers as ``{"set": true, "infinite": false, "number": N}``.
A job that cannot be read is skipped with a log line, never an exception. The head calls
`running_jobs` every few intervals and finishes registered jobs that Slurm no longer runs (an
Epilog that never reached it); see the lead's notes.
"""

from __future__ import annotations

import json
import logging
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from slurm_cdgpc.errors import SoftError

logger = logging.getLogger(__name__)

SQUEUE: Final = Path("/usr/bin/squeue")
DEFAULT_TIMEOUT_S: Final = 10.0


class SqueueError(SoftError):
    """``squeue --json`` could not run or printed something that is not its JSON."""


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    user: str
    state: str
    nodes: str
    comment: str
    start_s: float | None
    time_limit_s: float | None
    array_job_id: str | None


def _number(value: object) -> float | None:
    """22.05: a plain number; 23.02+: {"set", "infinite", "number"}; unset/infinite → None."""
    if isinstance(value, Mapping):
        if not value.get("set", True) or value.get("infinite", False):
            return None
        value = value.get("number")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _state(value: object) -> str:
    if isinstance(value, list):
        return str(value[0]) if value else ""
    return str(value) if value is not None else ""


def parse_job(d: Mapping[str, Any]) -> SlurmJob | None:
    job_id = _number(d.get("job_id"))
    if job_id is None or job_id <= 0:
        return None
    array = _number(d.get("array_job_id"))
    limit_min = _number(d.get("time_limit"))
    start = _number(d.get("start_time"))
    return SlurmJob(
        job_id=str(int(job_id)),
        user=str(d.get("user_name") or ""),
        state=_state(d.get("job_state")),
        nodes=str(d.get("nodes") or ""),
        comment=str(d.get("comment") or ""),
        start_s=start if start else None,
        time_limit_s=None if limit_min is None else limit_min * 60.0,
        array_job_id=str(int(array)) if array else None,
    )


def parse_squeue_json(text: str | bytes) -> list[SlurmJob]:
    """Every readable job in ``squeue --json`` output."""
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise SqueueError(f"squeue --json printed something that is not JSON: {e}") from None
    jobs = data.get("jobs") if isinstance(data, dict) else None
    if not isinstance(jobs, list):
        raise SqueueError("squeue --json: no 'jobs' list in its output")
    out = []
    for item in jobs:
        job = parse_job(item) if isinstance(item, Mapping) else None
        if job is None:
            logger.info("squeue --json: skipped a job entry that cannot be read")
            continue
        out.append(job)
    return out


def running_jobs(
    *, squeue: Path = SQUEUE, timeout_s: float = DEFAULT_TIMEOUT_S
) -> dict[str, SlurmJob]:
    """Jobs Slurm runs now (RUNNING, COMPLETING, CONFIGURING), by raw job id."""
    try:
        result = subprocess.run(
            [str(squeue), "--json"],
            capture_output=True,
            timeout=timeout_s,
            env={"LC_ALL": "C"},
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SqueueError(f"squeue --json failed: {e}") from e
    if result.returncode != 0:
        message = " ".join(result.stderr.decode("utf-8", "replace").split())[:300]
        raise SqueueError(f"squeue --json exited {result.returncode}: {message}")
    active = {"RUNNING", "COMPLETING", "CONFIGURING"}
    return {j.job_id: j for j in parse_squeue_json(result.stdout) if j.state in active}
