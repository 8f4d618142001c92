"""The head builds its clock grids from the boards its agents describe, not from the catalog:
a board the catalog lacks is controlled, a node may hold two kinds, a GPU in MIG mode is
controlled through its power limit and the whole GPUs beside it are left alone."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from slurm_cdgpc.coordinator.jobs import GpuRef
from slurm_cdgpc.coordinator.locks import lowest_setpoints
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
        "lever": "clocks",
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


def test_a_mig_gpu_is_controlled_through_its_power_limit(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(nodes=("n1",), gpu_type=f"{A100}:1,{MIG}:1")
    cluster.tick()
    cluster.tick()
    views = {g["index"]: g for g in cluster.head.nodes.gpu_views("n1")}
    assert views[1]["controlled"] and views[1]["lever"] == "power limit" and not views[1]["why"]
    # beside a MIG GPU, Slurm's index for a whole GPU is a GRES list position: no GPU's for sure
    assert not views[0]["controlled"] and views[0]["lever"] is None
    assert "another GPU here is in MIG mode" in str(views[0]["why"])
    mig = cluster.gpu("n1", 1)
    mig.attach("bert")
    cluster.head.register_job("61", "alice", "n1", [1])
    cluster.store.set_budget(5000.0, "root")
    for _ in range(4):  # the budget does not bind: its top clock, at its default limit
        report = cluster.tick()
    assert next(v for v in report.jobs if v.job_id == "61").controlled
    [point] = cluster.last_requests()["n1"].setpoints
    assert (point.gpu, point.power_limit_w) == (1, mig.spec.power_limit.default_w)
    assert mig.locked is None
    free_w = report.measured_power_w  # what it would draw counted, not controlled
    for budget_w in (300.0, 400.0):
        cluster.store.set_budget(budget_w, "root")
        reports = [cluster.tick() for _ in range(60)]
        [point] = cluster.last_requests()["n1"].setpoints
        assert point.power_limit_w is not None and point.power_limit_w < budget_w
        assert mig.locked is None and mig.power_limit_set_w == point.power_limit_w
        # the node (the whole GPU idle, outside the plan, and the MIG GPU) holds the budget
        drawn = np.array([r.measured_power_w for r in reports[10:]])
        over = int(np.sum(drawn > budget_w))
        print(  # the figures DESIGN.md gives ("Boards"): pytest -rP shows them
            f"MIG A100 under {budget_w:.0f} W: mean {drawn.mean():.1f} W, {over} of "
            f"{drawn.size} intervals over, worst {100 * (drawn.max() / budget_w - 1):+.2f} % "
            f"(counted, not controlled: {free_w:.1f} W)"
        )
        assert drawn.max() <= budget_w * 1.01, drawn  # over by noise, if at all
        assert budget_w * 0.94 <= drawn.mean() < budget_w < free_w
        # it learns from the clock the firmware ran: the limit is its own, not another's
        assert not any("n1:1" in limiter for limiter in reports[-1].limited)
        view = next(v for v in reports[-1].jobs if v.job_id == "61")
        assert view.model_readings > 40 and view.graphics_mhz < mig.spec.max_graphics_mhz
    cluster.head.deregister_job("61")
    for _ in range(2):
        cluster.tick()
    assert mig.power_limit_set_w is None and mig.locked is None


def test_jobs_on_instances_of_one_mig_gpu_are_its_tenants(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(nodes=("n1",), gpu_type=f"{A100}:1,{MIG}:1")
    cluster.store.set_budget(300.0, "root")
    cluster.tick()
    cluster.tick()
    mig = cluster.gpu("n1", 1)
    cluster.head.register_job("61", "alice", "n1", [1])
    cluster.head.register_job("62", "bob", "n1", [1])  # the Prolog names the same GPU
    for _ in range(4):
        report = cluster.tick()
    jobs = {v.job_id: v for v in report.jobs}
    assert set(jobs) == {"61", "62"} and all(v.controlled for v in jobs.values())
    [point] = cluster.last_requests()["n1"].setpoints  # one setpoint for the GPU, both named
    assert {point.job_id, *point.tenants} == {"61", "62"} and point.power_limit_w is not None
    assert mig.power_limit_set_w == point.power_limit_w and mig.locked is None
    agent = cluster.agents["n1"]
    agent.release_job(point.job_id)  # the first tenant's Epilog: the other keeps the limit
    assert mig.power_limit_set_w == point.power_limit_w
    agent.release_job(point.tenants[0])  # the last tenant's: the default limit back
    assert mig.power_limit_set_w is None


def test_a_clock_sent_before_the_board_was_described_as_mig_gives_way_to_a_limit(
    make_cluster: MakeCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "slurm_cdgpc.coordinator")
    cluster = make_cluster(nodes=("n1",), gpu_type=f"{A100}:1,{MIG}:1")
    cluster.store.set_budget(5000.0, "root")
    cluster.tick()  # the first reports name the boards: asked for at the next exchange
    cluster.head.register_job("63", "alice", "n1", [1])
    cluster.tick()  # typed by its name until described: planned, and a clock sent
    [point] = cluster.last_requests()["n1"].setpoints
    assert point.power_limit_w is None
    assert "MIG mode is on" in caplog.text  # the agent knows its board: refused, not locked
    mig = cluster.gpu("n1", 1)
    assert mig.locked is None
    for _ in range(3):  # described as MIG: its setpoint is a limit, and the job is planned
        report = cluster.tick()
    assert next(v for v in report.jobs if v.job_id == "63").controlled
    [point] = cluster.last_requests()["n1"].setpoints
    assert point.power_limit_w is not None and mig.power_limit_set_w == point.power_limit_w
    assert mig.locked is None
    assert "GPU 1: MIG mode is on: controlled through its power limit" in caplog.text


def test_mig_turned_off_is_seen_without_restarting_the_head(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(nodes=("n1",), gpu_type=f"{A100}:1,{MIG}:1")
    cluster.store.set_budget(5000.0, "root")
    for _ in range(2):
        cluster.tick()
    views = cluster.head.nodes.gpu_views("n1")
    assert [g["lever"] for g in views] == [None, "power limit"]
    cluster.head.register_job("64", "alice", "n1", [1])
    for _ in range(3):
        cluster.tick()
    assert cluster.gpu("n1", 1).power_limit_set_w is not None
    cluster.gpu("n1", 1)._mig_mode = False  # an admin turned MIG off and reset the GPU
    for _ in range(3):  # a board's digest leaves MIG mode out: the agent says it unasked
        report = cluster.tick()
    assert [g["lever"] for g in cluster.head.nodes.gpu_views("n1")] == ["clocks", "clocks"]
    assert next(v for v in report.jobs if v.job_id == "64").controlled
    assert cluster.gpu("n1", 1).locked is not None


def test_an_emergency_cut_sends_a_mig_gpu_to_its_lowest_power_limit(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster(nodes=("n1",), gpu_type=f"{A100}:1,{MIG}:1")
    cluster.tick()
    cluster.tick()
    ref = GpuRef("n1", 1)
    head = cluster.head
    [point] = lowest_setpoints(
        "61", [ref], head.nodes.gpu_type, head.grid, head.specs, head.nodes.limit_only
    ).values()
    mig = cluster.gpu("n1", 1)
    assert point.power_limit_w == mig.spec.power_limit.min_w
    # a whole GPU's lowest setpoint is its lowest clock alone
    [point] = lowest_setpoints("61", [ref], head.nodes.gpu_type, head.grid, head.specs).values()
    assert point.power_limit_w is None
