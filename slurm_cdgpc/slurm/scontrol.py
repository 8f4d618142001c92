"""``scontrol show job -o ID``: the times the Prolog's environment lacks (submit, limit, deadline).

Bounded by a timeout; any failure gives None. Absolute path, standard library only: Slurm runs the
hooks with no ``PATH``, and only `slurm/` runs Slurm's commands (`tests/unit/test_import_graph.py`).
Design: DESIGN.md, "The Prolog and Epilog"; test: `tests/unit/test_slurm_hooks.py`.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Final

logger = logging.getLogger(__name__)

SCONTROL: Final = Path("/usr/bin/scontrol")
DEFAULT_TIMEOUT_S: Final = 0.5
_FIELD: Final = r"(?:^|\s){}=(\S+)"
_LIMIT: Final = re.compile(r"(?:(?P<d>[0-9]+)-)?(?:(?P<h>[0-9]+):)?(?P<m>[0-9]+):(?P<s>[0-9]+)")


@dataclass(frozen=True)
class JobTimes:
    """Seconds since the epoch (None: unknown / not set); the limit in seconds (None: none)."""

    submit_s: float | None = None
    start_s: float | None = None
    time_limit_s: float | None = None
    deadline_s: float | None = None


def _field(text: str, key: str) -> str | None:
    match = re.search(_FIELD.format(re.escape(key)), text)
    return None if match is None else match[1]


def parse_time(value: str | None) -> float | None:
    """``2026-11-29T10:00:00`` (scontrol's local time) → epoch seconds; Unknown/None/N/A → None."""
    if not value:
        return None
    try:
        return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def parse_time_limit(value: str | None) -> float | None:
    """``1-02:03:04``, ``02:03:04``, ``03:04`` → seconds; UNLIMITED, Partition_Limit → None."""
    if not value:
        return None
    match = _LIMIT.fullmatch(value)
    if match is None:
        return None
    days, hours = int(match["d"] or 0), int(match["h"] or 0)
    return float(((days * 24 + hours) * 60 + int(match["m"])) * 60 + int(match["s"]))


def parse_show_job(text: str) -> JobTimes:
    """The times in one ``scontrol show job -o`` line."""
    return JobTimes(
        submit_s=parse_time(_field(text, "SubmitTime")),
        start_s=parse_time(_field(text, "StartTime")),
        time_limit_s=parse_time_limit(_field(text, "TimeLimit")),
        deadline_s=parse_time(_field(text, "Deadline")),
    )


def job_times(
    job_id: str, *, scontrol: Path = SCONTROL, timeout_s: float = DEFAULT_TIMEOUT_S
) -> JobTimes | None:
    """The job's times from slurmctld, or None (scontrol missing, slow, or failing).

    The slurmd Prolog gets the comment but not the submit time (a relative ``deadline=+6h``
    counts from it), the time limit or ``sbatch --deadline``; on None the caller falls back to
    "now"."""
    try:
        result = subprocess.run(
            [str(scontrol), "show", "job", "-o", job_id],
            capture_output=True,
            timeout=timeout_s,
            # no PATH (absolute program); SLURM_CONF as slurmd gave it to the hook
            env={"LC_ALL": "C", **{k: v for k, v in os.environ.items() if k == "SLURM_CONF"}},
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.info("job %s: scontrol show job failed: %s", job_id, e)
        return None
    if result.returncode != 0:
        logger.info("job %s: scontrol show job exited %d", job_id, result.returncode)
        return None
    return parse_show_job(result.stdout.decode("utf-8", "replace"))
