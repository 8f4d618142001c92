"""The drain's input from a real Slurm (tests/slurm/harness.sh: nodes n1 and n2, four GPUs
each): a job pending for GPUs behind a running one reads as waiting, from ``squeue --json``."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import pytest

from slurm_cdgpc.slurm.squeue import SlurmJob, read_jobs
from tests.integration.slurm_harness import real_slurm

pytestmark = [pytest.mark.slurm, pytest.mark.live]


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with real_slurm(tmp_path_factory.mktemp("slurm") / "lab") as env:
        yield env


def _sbatch(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        ["sbatch", "--parsable", "--output=/dev/null", *args, "--wrap", "sleep 120"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout.strip().split(";")[0]


def _until(what: str, ready: object, timeout_s: float = 30.0) -> list[SlurmJob]:
    deadline = time.monotonic() + timeout_s
    while True:
        jobs = read_jobs()
        if ready(jobs):  # type: ignore[operator]
            return jobs
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: squeue shows {jobs}")
        time.sleep(0.5)


def test_a_job_pending_for_gpus_reads_as_waiting(slurm_env: dict[str, str]) -> None:
    big = _sbatch(slurm_env, "-N2", "--gres=gpu:4", "--comment=deadline=+2h")
    _until(
        "the job holding every GPU runs", lambda js: any(j.job_id == big and j.active for j in js)
    )
    behind = _sbatch(slurm_env, "-N1", "--gres=gpu:2")
    held = _sbatch(slurm_env, "-N1", "--gres=gpu:1", "--hold")
    jobs = _until(
        "the job behind it is pending for resources",
        lambda js: any(j.job_id == behind and j.reason not in ("", "None") for j in js),
        timeout_s=90.0,
    )
    by_id = {j.job_id: j for j in jobs}
    assert by_id[big].active and not by_id[big].waits_for_gpus
    assert by_id[behind].state == "PENDING" and by_id[behind].wants_gpus
    assert by_id[behind].waits_for_gpus, by_id[behind]
    assert not by_id[held].waits_for_gpus  # held by its user: not waiting for GPUs
    subprocess.run(["scancel", big, behind, held], env=slurm_env, check=False)
