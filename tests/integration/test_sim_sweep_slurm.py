"""``cdgpc-admin simulate --sweep --backend slurm --wait`` on a real Slurm (tests/slurm/harness.sh):
every cell runs as a task of one job array on the harness's nodes, and the table is the local one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.slurm_harness import real_slurm

pytestmark = [pytest.mark.slurm, pytest.mark.live]

TRACE = Path(__file__).resolve().parents[1] / "data" / "sim" / "synthetic40.csv"
ADMIN = [sys.executable, "-c", "from slurm_cdgpc.cli.main import main; main()"]
#: 2 budgets × 2 policies, six jobs each, five-minute intervals: a fraction of a second a cell
SWEEP = [
    "simulate", "--trace", str(TRACE), "--limit-jobs", "6", "--interval", "300s",
    "--budget", "0.45,0.6", "--policy", "cdgpc,uniform-clock", "--json",
]  # fmt: skip
TIMING = {"controller_ms_p50", "wall_s"}


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with real_slurm(tmp_path_factory.mktemp("slurm") / "lab") as env:
        yield env


def _untimed(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in c.items() if k not in TIMING} for c in cells]


def test_a_sweep_runs_as_a_job_array_and_prints_the_local_table(
    slurm_env: dict[str, str], tmp_path: Path
) -> None:
    outdir = tmp_path / "on-slurm"
    done = subprocess.run(
        [*ADMIN, *SWEEP, "--sweep", str(outdir), "--backend", "slurm", "--wait"],
        env=slurm_env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    logs = "\n".join(p.read_text() for p in (outdir / "slurm").glob("*.out"))
    assert done.returncode == 0, done.stderr + logs
    report = json.loads(done.stdout)
    assert report["missing"] == [] and len(report["cells"]) == 4
    job_id = json.loads((outdir / "slurm" / "array.json").read_text())["job_id"]
    assert f"submitted job array {job_id}: 4 tasks for 4 cells" in done.stderr
    # one array task per cell, each its own process on a Slurm node
    for task in range(4):
        assert "ran 1 of 1 cells" in (outdir / "slurm" / f"{job_id}_{task}.out").read_text()
    local = subprocess.run(
        [*ADMIN, *SWEEP, "--sweep", str(tmp_path / "local"), "--workers", "1"],
        env=slurm_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert local.returncode == 0, local.stderr
    expected = json.loads(local.stdout)
    assert _untimed(report["cells"]) == _untimed(expected["cells"])
    assert report["rows"] == expected["rows"]
    # run again: every cell is on disk, so nothing is submitted and the table comes back
    again = subprocess.run(
        [*ADMIN, *SWEEP, "--sweep", str(outdir), "--backend", "slurm", "--wait"],
        env=slurm_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert again.returncode == 0, again.stderr
    assert "submitted" not in again.stderr
    assert json.loads(again.stdout)["rows"] == expected["rows"]
