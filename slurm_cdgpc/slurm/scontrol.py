"""``scontrol show job -o ID``: the times the Prolog's environment lacks (submit, limit, deadline),
and the GPUs the PrologSlurmctld's lacks; ``scontrol update JobId=ID AdminComment=...``.

Bounded by a timeout; any failure gives None (the update: a one-line `SoftError`). Absolute
path, standard library only: Slurm runs the hooks with no ``PATH``, and only `slurm/` runs Slurm's
commands (`tests/unit/test_import_graph.py`). Design: DESIGN.md, "The Prolog and Epilog" and
"Admission at job start"; tests: `tests/unit/test_slurm_hooks.py`, `tests/unit/test_admission.py`.
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

from slurm_cdgpc.errors import SoftError, one_line

logger = logging.getLogger(__name__)

SCONTROL: Final = Path("/usr/bin/scontrol")
DEFAULT_TIMEOUT_S: Final = 0.5
_FIELD: Final = r"(?:^|\s){}=(\S+)"
#: a GPU request or allocation in a TRES field: ``gres:gpu:2``, ``gres:gpu:h100:2``,
#: ``gres/gpu:2`` (23.02 on), ``gres/gpu=2`` (``TRES=``, allocated)
_GPU_TRES: Final = re.compile(r"gres[:/]gpu(?::[A-Za-z0-9_.-]+)?[:=]([0-9]{1,7})(?=,|$)")
#: the longest AdminComment written (Slurm keeps more; one line in `scontrol show job` is enough)
MAX_ADMIN_COMMENT: Final = 400
_LIMIT: Final = re.compile(r"(?:(?P<d>[0-9]+)-)?(?:(?P<h>[0-9]+):)?(?P<m>[0-9]+):(?P<s>[0-9]+)")


@dataclass(frozen=True)
class JobTimes:
    """Seconds since the epoch (None: unknown / not set); the limit in seconds (None: none);
    and the job's name (``JobName``; None: not shown)."""

    submit_s: float | None = None
    start_s: float | None = None
    time_limit_s: float | None = None
    deadline_s: float | None = None
    name: str | None = None


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
        name=_field(text, "JobName") or None,
    )


def gpu_count(text: str) -> int | None:
    """The GPUs of the job in one ``scontrol show job -o`` line, in all its nodes: allocated
    (``TRES=...,gres/gpu=N``, where accounting tracks GPUs), else asked per job
    (``TresPerJob``), else per node times ``NumNodes``; None: it asks for none."""
    for key, per_node in (("TRES", False), ("TresPerJob", False), ("TresPerNode", True)):
        value = _field(text, key)
        counts = [] if value is None else [int(m) for m in _GPU_TRES.findall(value)]
        if counts:
            nodes_text = _field(text, "NumNodes") or "1"
            nodes = int(m[0]) if (m := re.match(r"[0-9]+", nodes_text)) else 1
            return sum(counts) * (nodes if per_node else 1)
    return None


def show_job(
    job_id: str, *, scontrol: Path = SCONTROL, timeout_s: float = DEFAULT_TIMEOUT_S
) -> str | None:
    """``scontrol show job -o ID``'s line, or None (scontrol missing, slow, or failing)."""
    return _scontrol(["show", "job", "-o", job_id], scontrol, timeout_s, job_id)


def set_admin_comment(
    job_id: str, text: str, *, scontrol: Path = SCONTROL, timeout_s: float = DEFAULT_TIMEOUT_S
) -> None:
    """``scontrol update JobId=ID AdminComment=TEXT`` (one line, clipped), as the Slurm user or
    root; a one-line `SoftError` when it fails."""
    comment = one_line(text, MAX_ADMIN_COMMENT)
    try:
        result = subprocess.run(
            [str(scontrol), "update", f"JobId={job_id}", f"AdminComment={comment}"],
            capture_output=True,
            timeout=timeout_s,
            env=_environment(),
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SoftError(f"scontrol update failed: {one_line(str(e))}") from e
    if result.returncode != 0:
        said = one_line(result.stderr.decode("utf-8", "replace"), 200)
        raise SoftError(f"scontrol update exited {result.returncode}: {said}")


def _environment() -> dict[str, str]:
    # no PATH (absolute program); SLURM_CONF as slurmd or slurmctld gave it to the hook
    return {"LC_ALL": "C", **{k: v for k, v in os.environ.items() if k == "SLURM_CONF"}}


def _scontrol(args: list[str], scontrol: Path, timeout_s: float, job_id: str) -> str | None:
    try:
        result = subprocess.run(
            [str(scontrol), *args],
            capture_output=True,
            timeout=timeout_s,
            env=_environment(),
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.info("job %s: scontrol %s failed: %s", job_id, " ".join(args[:2]), e)
        return None
    if result.returncode != 0:
        logger.info("job %s: scontrol %s exited %d", job_id, " ".join(args[:2]), result.returncode)
        return None
    return result.stdout.decode("utf-8", "replace")


def job_times(
    job_id: str, *, scontrol: Path = SCONTROL, timeout_s: float = DEFAULT_TIMEOUT_S
) -> JobTimes | None:
    """The job's times from slurmctld, or None (scontrol missing, slow, or failing).

    The slurmd Prolog gets the comment but not the submit time (a relative ``deadline=+6h``
    counts from it), the time limit or ``sbatch --deadline``; on None the caller falls back to
    "now"."""
    text = show_job(job_id, scontrol=scontrol, timeout_s=timeout_s)
    return None if text is None else parse_show_job(text)
