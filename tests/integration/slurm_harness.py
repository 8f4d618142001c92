"""A real Slurm from tests/slurm/harness.sh (slurmctld, slurmd n1 and n2, munged) for tests that
need Slurm alone: no cdgpcd, no agents (the hooks find no head, spool, and exit 0).

`real_slurm` skips with the reason when Slurm cannot be installed or started, except under
``CI=true``, where that fails; it stops what it started, and cancels every job, on the way out.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.integration.munge_fixture import unavailable

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "tests" / "slurm" / "harness.sh"


@contextmanager
def real_slurm(lab: Path) -> Iterator[dict[str, str]]:
    """Slurm up, its state and logs in ``lab``; yields the environment to run clients in."""
    if os.geteuid() != 0:
        unavailable("a real Slurm is needed and needs root (mknod, SlurmUser=root)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CDGPC_", "SLURM_"))}
    harness_env = {**env, "CDGPC_SLURM_LAB": str(lab), "CDGPC_PYTHON": sys.executable}
    started = subprocess.run(
        ["bash", str(HARNESS), "start"],
        env=harness_env,
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        if started.returncode == 3:
            why = started.stderr.strip()[-300:]
            unavailable(f"a real Slurm is needed and cannot be installed here: {why}")
        if started.returncode != 0:
            pytest.fail(f"harness start failed:\n{started.stderr[-3000:]}")
        yield env
    finally:
        subprocess.run(["scancel", "--user=root"], check=False, capture_output=True)
        subprocess.run(
            ["bash", str(HARNESS), "stop"], env=harness_env, check=False, capture_output=True
        )
