"""The head builds its clock grids from the boards its agents describe, not from the catalog:
a board the catalog lacks is controlled, a node may hold two kinds, a node with a MIG GPU is
left alone."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest

from slurm_cdgpc.gpu.board import spec_from_board
from slurm_cdgpc.wire.board import BoardDescription
from tests.unit.test_coordinator_daemon import A100, MakeCluster, make_cluster

__all__ = ["make_cluster"]  # the fixture, imported to be found

NVML = Path(__file__).resolve().parents[1] / "data" / "nvml"
ADA = NVML / "rtx-4000-sff-ada.board.json"  # recorded from a real nvidia-smi -q -x
MIG = NVML / "a100-sxm4-80gb-mig.board.json"


def _board(path: Path) -> BoardDescription:
    return BoardDescription.from_dict(json.loads(path.read_text()))


def _grid_clocks(grid: object, type_index: int) -> dict[int, list[int]]:
    g = grid
    out = {}
    for m in range(int(g.memory_count[type_index])):  # type: ignore[attr-defined]
        count = int(g.graphics_count[type_index, m])  # type: ignore[attr-defined]
        levels = g.graphics_mhz[type_index, m, :count]  # type: ignore[attr-defined]
        out[int(g.memory_mhz[type_index, m])] = sorted(levels.tolist(), reverse=True)  # type: ignore[attr-defined]
    return out


def test_a_board_absent_from_the_catalog_is_controlled_with_the_clocks_it_reported(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster(nodes=("n1",), gpu_type=f"{A100}:1,{ADA}:1")
    cluster.store.set_budget(5000.0, "root")
    cluster.tick()  # the reports name boards the head has never seen: it asks for them
    assert not cluster.last_requests()["n1"].describe
    cluster.tick()
    assert cluster.last_requests()["n1"].describe
    board = _board(ADA)
    ada = spec_from_board(board)
    assert ada.estimated and ada.name.endswith(board.digest()[:8])
    views = {g["index"]: g for g in cluster.head.nodes.gpu_views("n1")}
    assert views[0] == {
        "index": 0,
        "board": A100,
        "type": A100,
        "estimated": False,
        "controlled": True,
        "why": None,
    }
    assert (views[1]["type"], views[1]["estimated"], views[1]["controlled"]) == (
        ada.name,
        True,
        True,
    )
    # the head's grid for that GPU is exactly what its agent reported
    grid = cluster.head.grid
    assert _grid_clocks(grid, grid.type_index(ada.name)) == {
        m: list(board.clocks.graphics_for(m)) for m in board.clocks.memory_mhz
    }
    cluster.tick()  # no more asking once it knows
    assert not cluster.last_requests()["n1"].describe
    # a job on each kind: both get setpoints their boards list, and no GPU refuses one
    cluster.head.register_job("51", "alice", "n1", [0])
    cluster.head.register_job("52", "alice", "n1", [1])
    for _ in range(3):
        report = cluster.tick()
    points = {p.gpu: p for p in cluster.last_requests()["n1"].setpoints}
    assert set(points) == {0, 1}
    assert points[1].memory_mhz in board.clocks.memory_mhz  # a GDDR board: memory is a lever
    assert points[1].graphics_mhz in board.clocks.graphics_for(points[1].memory_mhz)
    assert cluster.gpu("n1", 1).locked is not None
    assert {v.job_id for v in report.jobs if v.controlled} == {"51", "52"}
    node = next(n for n in cluster.store.nodes() if n.name == "n1")
    a100_w = spec_from_board(cluster.gpu("n1", 0).describe()).power_limit.max_w
    assert node.worst_case_power_w == a100_w + board.power_limit.max_w
    assert node.gpu_type == ""  # two kinds: no one type for the node


def test_a_mig_gpu_is_not_controlled_and_says_why(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(nodes=("n1",), gpu_type=f"{A100}:1,{MIG}:1")
    cluster.tick()
    cluster.tick()
    views = {g["index"]: g for g in cluster.head.nodes.gpu_views("n1")}
    assert not views[0]["controlled"] and not views[1]["controlled"]
    assert "MIG mode is on" in str(views[1]["why"])
    # beside a MIG GPU, Slurm's index for a whole GPU is a GRES list position: no GPU's for sure
    assert "another GPU here is in MIG mode" in str(views[0]["why"])
    cluster.head.register_job("61", "alice", "n1", [1])
    report = cluster.tick()
    assert not next(v for v in report.jobs if v.job_id == "61").controlled
    assert all(p.gpu != 1 for p in cluster.last_requests()["n1"].setpoints)
    assert np.isfinite(report.uncontrolled_w) and report.uncontrolled_w > 0


def test_jobs_on_instances_of_one_mig_gpu_count_it_once_at_what_it_draws(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster(nodes=("n1",), gpu_type=f"{A100}:1,{MIG}:1")
    cluster.tick()
    cluster.tick()

    def read_w() -> float:  # the node's GPUs at their last readings: none is in a plan
        return sum(r.power_w or math.nan for r in cluster.head.nodes["n1"].reports)

    cluster.head.register_job("61", "alice", "n1", [1])
    first = cluster.tick()  # planned before a reading with the job on it: at the GPU's limit
    assert first.uncontrolled_w > 500.0
    alone = cluster.tick()
    cluster.head.register_job("62", "bob", "n1", [1])  # the Prolog names the same GPU
    for _ in range(3):
        both = cluster.tick()
    jobs = {v.job_id: v for v in both.jobs}
    assert set(jobs) == {"61", "62"} and not any(v.controlled for v in jobs.values())
    # once read with its jobs on it, the GPU counts once, at its reading, not at its 500 W limit
    assert alone.uncontrolled_w < 200.0
    assert both.uncontrolled_w == pytest.approx(read_w(), rel=0.05)
    assert cluster.gpu("n1", 1).locked is None


def test_a_lock_sent_before_the_board_was_described_as_mig_is_released(
    make_cluster: MakeCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "slurm_cdgpc.coordinator.locks")
    cluster = make_cluster(nodes=("n1",), gpu_type=f"{A100}:1,{MIG}:1")
    cluster.store.set_budget(5000.0, "root")
    cluster.tick()  # the first reports name the boards: asked for at the next exchange
    cluster.head.register_job("63", "alice", "n1", [1])
    cluster.tick()  # typed by its name until described: planned, and its setpoint sent
    assert cluster.gpu("n1", 1).locked is not None
    for _ in range(3):  # described as MIG: left alone, and the lock no plan would move released
        cluster.tick()
    assert cluster.gpu("n1", 1).locked is None
    assert "node n1: GPU 1 is not controlled: its lock is released" in caplog.text
    assert not next(v for v in cluster.tick().jobs if v.job_id == "63").controlled
    assert cluster.gpu("n1", 1).locked is None  # and it stays so


def test_mig_turned_off_is_seen_without_restarting_the_head(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(nodes=("n1",), gpu_type=f"{A100}:1,{MIG}:1")
    cluster.store.set_budget(5000.0, "root")
    for _ in range(2):
        cluster.tick()
    assert not any(g["controlled"] for g in cluster.head.nodes.gpu_views("n1"))
    cluster.gpu("n1", 1)._mig_mode = False  # an admin turned MIG off and reset the GPU
    cluster.head.register_job("64", "alice", "n1", [1])
    for _ in range(3):  # a board's digest leaves MIG mode out: the agent says it unasked
        report = cluster.tick()
    assert all(g["controlled"] for g in cluster.head.nodes.gpu_views("n1"))
    assert next(v for v in report.jobs if v.job_id == "64").controlled
    assert cluster.gpu("n1", 1).locked is not None
