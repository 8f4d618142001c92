"""Slurm job arrays for batch work that outgrows one machine: ``sbatch --array`` and ``squeue``.

Unlike the hooks, these run from an admin's shell: ``sbatch`` and ``squeue`` come from ``PATH``,
and the job inherits the caller's environment. Standard library only; `slurm/` alone runs Slurm's
commands (`tests/unit/test_import_graph.py`). Tests: `tests/unit/test_sim_sweep.py`,
`tests/integration/test_sim_sweep_slurm.py`.
"""

from __future__ import annotations

import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from slurm_cdgpc.errors import FatalError, SoftError, one_line
from slurm_cdgpc.wire.names import JOB_ID

SBATCH: Final = "sbatch"
SQUEUE: Final = "squeue"
DEFAULT_TIMEOUT_S: Final = 60.0
#: states after which a job (an array element) runs no more
FINISHED_STATES: Final = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)
#: consecutive failed polls `wait_for_array` tolerates (a busy slurmctld times out now and then)
MAX_POLL_FAILURES: Final = 5


class SbatchError(FatalError):
    """``sbatch`` could not run or refused the job; the message is its first line of error."""


class ArrayPollError(SoftError):
    """``squeue`` could not say whether a job array still runs."""


def array_script(
    commands: Sequence[Sequence[str]], *, job_name: str, output: Path, comment: str = ""
) -> str:
    """A batch script whose array task ``i`` execs ``commands[i]`` (``output``: ``%A_%a`` etc.)."""
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={shlex.quote(job_name)}",
        f"#SBATCH --output={shlex.quote(str(output))}",
        "#SBATCH --ntasks=1",
    ]
    lines += [f"# {line}" for line in comment.splitlines()]
    lines += ["set -eu", 'case "${SLURM_ARRAY_TASK_ID:?not a job array task}" in']
    lines += [f"{i}) exec {shlex.join(command)} ;;" for i, command in enumerate(commands)]
    lines += ['*) echo "no array task $SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;', "esac", ""]
    return "\n".join(lines)


def submit_array(
    script: Path,
    tasks: int,
    *,
    sbatch_args: Sequence[str] = (),
    sbatch: str = SBATCH,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> str:
    """Submit ``script`` as the array ``0..tasks-1``; the job id (``sbatch --parsable``)."""
    if tasks < 1:
        raise SbatchError(f"a job array needs at least one task, got {tasks}")
    command = [sbatch, "--parsable", f"--array=0-{tasks - 1}", *sbatch_args, str(script)]
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SbatchError(f"{sbatch} failed: {e}") from e
    if result.returncode != 0:
        raise SbatchError(
            f"{sbatch} exited {result.returncode}: {one_line(result.stderr, keep='first')}"
        )
    job_id = result.stdout.strip().split(";")[0]  # --parsable: ID or ID;CLUSTER
    if not JOB_ID.fullmatch(job_id):
        raise SbatchError(f"{sbatch} printed {result.stdout.strip()[:80]!r}, not a job id")
    return job_id


def array_active(
    job_id: str, *, squeue: str = SQUEUE, timeout_s: float = DEFAULT_TIMEOUT_S
) -> bool:
    """Whether any task of the array ``job_id`` is pending or running (False once it is gone)."""
    command = [squeue, "--noheader", "--array", f"--jobs={job_id}", "--states=all", "--format=%T"]
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ArrayPollError(f"{squeue} failed: {e}") from e
    if result.returncode != 0:
        if "invalid job id" in result.stderr.lower():
            return False  # purged from slurmctld's memory: long finished
        raise ArrayPollError(
            f"{squeue} exited {result.returncode}: {one_line(result.stderr, keep='first')}"
        )
    states = {line.strip() for line in result.stdout.splitlines() if line.strip()}
    return bool(states - FINISHED_STATES)


def wait_for_array(
    job_id: str,
    *,
    poll_s: float = 5.0,
    active: Callable[[str], bool] = array_active,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Return once no task of ``job_id`` is pending or running."""
    failures = 0
    while True:
        try:
            if not active(job_id):
                return
            failures = 0
        except ArrayPollError:
            failures += 1
            if failures >= MAX_POLL_FAILURES:
                raise
        sleep(poll_s)
