"""Jobs on simulated GPUs through a launch directory (what the demo's replayer drives)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.gpu.catalog import catalog_spec
from slurm_cdgpc.gpu.simulated import ManualClock
from slurm_cdgpc.gpu.workloads import (
    AcceleratedClock,
    JobRunner,
    Launch,
    SharedSimulatedGpu,
    simulated_node,
    write_atomically,
)


def _node(clock: ManualClock, count: int = 4) -> list[SharedSimulatedGpu]:
    spec = catalog_spec("A100-SXM4-80GB")
    lock = threading.RLock()
    return [SharedSimulatedGpu(spec, index=i, time_source=clock, lock=lock) for i in range(count)]


def test_a_launched_job_runs_reports_progress_and_exits(tmp_path: Path) -> None:
    clock = ManualClock()
    gpus = _node(clock)
    reports: list[tuple[str, int, int]] = []
    runner = JobRunner(
        gpus, tmp_path, lambda j, step, total: reports.append((j, step, total)) or True
    )
    launch = Launch("1001", (1, 2), "resnet50", iterations=1000, iteration_time_s=0.5)
    write_atomically(tmp_path / "1001.json", launch.to_dict())
    runner.poll()
    assert gpus[1].workload is not None and gpus[2].workload is not None
    assert gpus[0].workload is None and gpus[3].workload is None
    # the trace's pace at top clocks, less what the default power limit takes (resnet50 on an
    # A100 is a little power-capped at 1410 MHz)
    assert 0.5 <= (gpus[1].true_iteration_time_s or 0.0) < 0.55
    clock.advance(100.0)
    runner.poll()
    assert reports[-1] == ("1001", int(100.0 / (gpus[1].true_iteration_time_s or 1.0)), 1000)
    # a lower clock on one GPU paces the whole job
    gpus[2].set_locked_clocks(705)
    clock.advance(100.0)
    runner.poll()
    slow = gpus[2].iterations_done
    assert reports[-1] == ("1001", int(slow), 1000) and slow < gpus[1].iterations_done
    assert not (tmp_path / "1001.exit").exists()
    clock.advance(1000.0)
    runner.poll()
    assert gpus[2].iterations_done >= 1000
    assert reports[-1] == ("1001", 1000, 1000)
    assert json.loads((tmp_path / "1001.exit").read_text())["job_id"] == "1001"
    assert gpus[1].workload is None and gpus[2].workload is None  # idle: the job ended
    assert runner.running == {}
    (tmp_path / "1001.json").unlink()
    runner.poll()
    assert "1001" not in runner._jobs


def test_removing_a_running_job_idles_its_gpus_and_a_bad_launch_is_refused(
    tmp_path: Path,
) -> None:
    clock = ManualClock()
    gpus = _node(clock, 2)
    runner = JobRunner(gpus, tmp_path, lambda *_: True)
    write_atomically(tmp_path / "7.json", Launch("7", (0,), "bert", 10**6).to_dict())
    write_atomically(tmp_path / "8.json", Launch("8", (0,), "bert", 10).to_dict())  # GPU taken
    write_atomically(tmp_path / "9.json", {"job_id": "9", "gpus": [5], "workload": "bert"})
    runner.poll()
    assert list(runner.running) == ["7"]
    (tmp_path / "7.json").unlink()
    runner.poll()
    assert runner.running == {} and gpus[0].workload is None


def test_launch_files_are_checked() -> None:
    with pytest.raises(InputError, match="malformed launch file"):
        Launch.from_dict({"job_id": "1", "gpus": [0]})
    with pytest.raises(InputError, match="iteration time must be positive"):
        Launch.from_dict(
            {"job_id": "1", "gpus": [0], "workload": "bert", "iterations": 5, "iteration_time_s": 0}
        )


def test_accelerated_clock_and_plain_nodes() -> None:
    wall = ManualClock(100.0)
    fast = AcceleratedClock(60.0, base=wall)
    wall.advance(2.0)
    assert fast() == pytest.approx(100.0 + 120.0)
    with pytest.raises(InputError):
        AcceleratedClock(0.0)
    # without the demo's variables a simulated node is the plain backend, as before
    plain = simulated_node("A40", 2, seed=1, report=lambda *_: True, env={})
    assert not any(isinstance(g, SharedSimulatedGpu) for g in plain)
    with pytest.raises(InputError, match="CDGPC_SIMULATED_SPEED"):
        simulated_node("A40", 2, seed=1, report=lambda *_: True, env={"CDGPC_SIMULATED_SPEED": "x"})
