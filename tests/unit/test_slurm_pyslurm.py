"""The optional pyslurm source of running jobs, against a stand-in with pyslurm's job API.

PyPI's pyslurm builds only against Slurm 25.11's libslurm, which neither Debian 12 (22.05) nor
Debian 13 (24.11) ships, so the real module cannot be installed where these tests run. The
stand-in reproduces the documented shapes (``Jobs.load()`` a dict of jobs; per job the
attributes read, and ``get_resource_layout_per_node()`` with pyslurm's parsed ``gres``); the
reconcile path after it is the one the real Slurm tests exercise through squeue.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from slurm_cdgpc.slurm.pyslurm_jobs import read_jobs
from slurm_cdgpc.slurm.squeue import SqueueError, running_jobs


class _Job:
    def __init__(self, job_id: int, state: str, layout: dict[str, Any], **over: Any) -> None:
        self.id = job_id
        self.state = state
        self.user_name = "alice"
        self.allocated_nodes = "n[1-2]"
        self.comment = "deadline=+2h iters=10"
        self.submit_time = 1_800_000_000
        self.start_time = 1_800_000_060
        self.time_limit = 120
        self.deadline = 0
        self.array_id = 0
        self._layout = layout
        self.__dict__.update(over)

    def get_resource_layout_per_node(self) -> dict[str, Any]:
        return self._layout


def _pyslurm(*jobs: _Job, fail: bool = False) -> types.ModuleType:
    module = types.ModuleType("pyslurm")

    class Jobs(dict[int, _Job]):
        @classmethod
        def load(cls) -> Jobs:
            if fail:
                raise RuntimeError("slurm_load_jobs: Unable to contact slurm controller")
            return cls({j.id: j for j in jobs})

    module.Jobs = Jobs  # type: ignore[attr-defined]
    return module


def test_jobs_running_on_gpus_read_as_squeue_reads_them() -> None:
    layout = {
        "n1": {"cpus": "0-1", "gres": {"gpu:a100": {"count": "2", "indexes": "0-1"}}},
        "n2": {"cpus": "0", "gres": {"gpu": {"count": "1", "indexes": "3"}, "mps": 100}},
    }
    jobs = running_jobs(
        read_jobs(
            _pyslurm(
                _Job(7, "RUNNING", layout),
                _Job(8, "PENDING", {}),
                _Job(9, "COMPLETING", {"n1": {"gres": {}}}, array_id=5),
            )
        )
    )
    assert sorted(jobs) == ["7", "9"]
    job = jobs["7"]
    assert job.gpus == {"n1": (0, 1), "n2": (3,)}
    assert (job.user, job.state, job.nodes) == ("alice", "RUNNING", "n[1-2]")
    assert (job.submit_s, job.start_s, job.time_limit_s, job.deadline_s) == (
        1_800_000_000.0,
        1_800_000_060.0,
        7200.0,
        None,
    )
    assert jobs["9"].gpus == {} and jobs["9"].array_job_id == "5"


def test_an_unreadable_job_is_skipped_and_a_failed_load_is_a_soft_error() -> None:
    broken = _Job(3, "RUNNING", {"n1": {"gres": {"gpu": {"indexes": "x-y"}}}})
    good = _Job(4, "RUNNING", {"n1": {"gres": {"gpu": {"count": "1", "indexes": "0"}}}})
    assert list(running_jobs(read_jobs(_pyslurm(broken, good)))) == ["4"]
    with pytest.raises(SqueueError, match="Unable to contact"):
        read_jobs(_pyslurm(fail=True))
