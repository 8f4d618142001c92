from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from slurm_cdgpc.control.discrete import ClockGrid
from slurm_cdgpc.control.empc import ControllerSettings, EconomicMPC
from slurm_cdgpc.control.tenancy import cotenant_key
from slurm_cdgpc.coordinator.jobs import GpuRef, GpuSample, JobInfo, RunningJobs, jobs_on
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.gpu.catalog import CATALOG
from slurm_cdgpc.gpu.device import ThrottleReason
from slurm_cdgpc.model.estimator import EstimatorSettings, JobEstimator
from slurm_cdgpc.model.kind_prior import job_kind

TYPES = ("A100-SXM4-80GB", "A40")


def _table() -> RunningJobs:
    grid = ClockGrid.from_tables([(t, CATALOG[t].clocks) for t in TYPES])
    return RunningJobs(grid, JobEstimator(), CATALOG)


def _job(
    job_id: str,
    *gpus: tuple[str, int],
    gpu_type: str = "A100-SXM4-80GB",
    deadline_s: float | None = None,
    iterations_total: int | None = None,
) -> JobInfo:
    refs = tuple(GpuRef(node, index) for node, index in gpus)
    return JobInfo(job_id, refs, gpu_type, deadline_s, iterations_total)


def test_rows_follow_jobs_in_and_out() -> None:
    table = _table()
    table.add([_job("1", ("n1", 0)), _job("2", ("n1", 1), ("n2", 0)), _job("3", ("n2", 1))])
    assert len(table) == 3 and len(table.estimator) == 3
    table.estimator.power.theta[:, -1] = [10.0, 20.0, 30.0]  # mark the rows
    removed = table.remove(["2", "unknown"])
    assert [j.job_id for j in removed] == ["2"]
    assert [j.job_id for j in table.jobs] == ["1", "3"]
    np.testing.assert_array_equal(table.estimator.power.theta[:, -1], [10.0, 30.0])
    np.testing.assert_array_equal(table.estimator.statics.gpus, [1, 1])


def test_registering_twice_changes_nothing_and_a_gpu_has_one_type() -> None:
    table = _table()
    table.add([_job("1", ("n1", 0), ("n1", 1))])
    table.add([_job("1", ("n1", 0), ("n1", 1))])
    assert len(table) == 1
    with pytest.raises(InputError, match=r"GPU n1:1 runs a job that says it is a A100"):
        table.add([_job("2", ("n1", 1), gpu_type="A40")])
    with pytest.raises(InputError, match="unknown GPU type"):
        table.add([_job("3", ("n3", 0), gpu_type="B300")])
    assert len(table) == 1 and len(table.estimator) == 1


def test_jobs_on_one_gpu_are_its_tenants_with_one_setpoint_per_gpu() -> None:
    """Shards of GPU n1:1: jobs 1 and 2 are its tenants (and job 1's n1:0 joins the group);
    each GPU gets one setpoint at the group's clock, naming the other tenants, and the guard
    rail sums the tenants' shares of the GPU."""
    table = _table()
    table.add(
        [
            _job("1", ("n1", 0), ("n1", 1), deadline_s=3600.0, iterations_total=10**6),
            _job("2", ("n1", 1)),
            _job("3", ("n2", 0)),
        ]
    )
    on = jobs_on((j.job_id, j.gpus) for j in table.jobs)
    assert {ref: ids for ref, ids in on.items() if len(ids) > 1} == {GpuRef("n1", 1): ["1", "2"]}
    tenancy = table.job_state().tenancy
    assert tenancy is not None
    assert tenancy.group.tolist() == [0, 0, 1] and tenancy.gpus.tolist() == [2.0, 1.0]
    one = np.ones(3)
    table.estimator.observe(one, one, np.full(3, 300.0), np.full(3, 0.5))  # models known
    mpc = EconomicMPC(table.grid)
    decision = mpc.step(table.estimator, table.job_state(), now_s=0.0, budget_w=500.0)
    assert decision.graphics_mhz[0] == decision.graphics_mhz[1] < 1410  # the budget binds
    per_node = table.setpoints(decision, power_limit_margin=0.1)
    n1 = per_node["n1"]
    assert [(s.gpu, s.job_id, s.tenants) for s in n1] == [(0, "1", ()), (1, "1", ("2",))]
    assert {s.graphics_mhz for s in n1} == {int(decision.graphics_mhz[0])}
    # every GPU of the group at one clock: each planned at the group's power over its GPUs
    gpu_w = (decision.job_power_w[0] + decision.job_power_w[1]) / 2
    assert n1[0].power_limit_w == n1[1].power_limit_w == pytest.approx(gpu_w * 1.1, abs=1e-3)
    assert decision.predicted_power_w == pytest.approx(decision.job_power_w.sum())


def test_a_new_job_counted_at_a_share_of_its_limit_gets_that_limit_on_its_gpus() -> None:
    """Job 1 is measured; job 2 (two GPUs) is new and counted at 0.6 of its 400 W limit:
    each of its GPUs gets 240 W, job 1's GPU no limit (the rail is off)."""
    table = _table()
    table.add([_job("1", ("n1", 0)), _job("2", ("n1", 1), ("n2", 0))])
    table.estimator.observe(np.ones(2), np.ones(2), np.array([300.0, np.nan]), np.full(2, 0.5))
    held = ControllerSettings(new_job_power_share=0.6, new_job_power_quantile=1.0)
    mpc = EconomicMPC(table.grid, held)
    decision = mpc.step(table.estimator, table.job_state(), now_s=0.0, budget_w=1e6)
    per_node = table.setpoints(decision)
    limits = {(node, s.gpu): s.power_limit_w for node, sps in per_node.items() for s in sps}
    assert limits == {("n1", 0): None, ("n1", 1): 240.0, ("n2", 0): 240.0}


def test_measurements_average_power_and_take_the_slowest_clock() -> None:
    table = _table()
    table.add([_job("7", ("n1", 0), ("n2", 3)), _job("8", ("n2", 4))])
    samples = [
        GpuSample(GpuRef("n1", 0), 300.0, 1410, 1593),
        GpuSample(GpuRef("n2", 3), 280.0, 1350, 1593, int(ThrottleReason.SW_POWER_CAP)),
        GpuSample(GpuRef("n2", 4), float("nan"), 1410, 1593),  # garbage is not trusted
        GpuSample(GpuRef("n9", 0), 999.0, 1410, 1593),  # not a job's GPU
    ]
    m = table.measurements(samples)
    assert m.power_w[0] == pytest.approx(290.0)
    assert m.graphics_mhz[0] == 1350
    assert m.power_capped is not None and m.power_capped.tolist() == [True, False]
    assert np.isnan(m.power_w[1]) and np.isnan(m.graphics_mhz[1])


def test_a_jobs_co_tenants_are_those_its_sampled_gpus_held() -> None:
    """Jobs 1 and 2 share n1:0, job 3 is alone on n1:1, job 4's GPU was not sampled (its
    lock changed within the interval): keys name each job's company over the interval."""
    table = _table()
    table.add(
        [_job("1", ("n1", 0)), _job("2", ("n1", 0)), _job("3", ("n1", 1)), _job("4", ("n1", 2))]
    )
    samples = [
        GpuSample(GpuRef("n1", 0), 300.0, 1410, 1593, tenants=("1", "2")),
        GpuSample(GpuRef("n1", 1), 250.0, 1410, 1593, tenants=("3",)),
    ]
    m = table.measurements(samples)
    assert m.cotenants is not None
    assert m.cotenants.tolist() == [cotenant_key(["2"]), cotenant_key(["1"]), 0, -1]


def test_iteration_time_and_remaining_work_come_from_progress() -> None:
    table = _table()
    table.add([_job("5", ("n1", 0), deadline_s=5000.0, iterations_total=1000)])
    table.record_progress("5", 100, 10.0)
    assert np.isnan(table.measurements([]).iteration_s[0])  # one report: no rate yet
    table.record_progress("5", 300, 70.0)
    table.record_progress("5", 250, 80.0)  # stale: a late duplicate of an older report
    assert table.measurements([]).iteration_s[0] == pytest.approx(60.0 / 200)
    state = table.job_state()
    assert state.remaining_iterations[0] == 700 and state.deadline_s[0] == 5000.0


def test_a_decision_becomes_per_node_setpoints_with_one_clock_per_job() -> None:
    table = _table()
    table.add([_job("1", ("n1", 0), ("n2", 0)), _job("2", ("n2", 1), gpu_type="A40")])
    mpc = EconomicMPC(table.grid)
    decision = mpc.step(table.estimator, table.job_state(), now_s=0.0, budget_w=1e6)
    per_node = table.setpoints(decision)
    assert sorted(per_node) == ["n1", "n2"]
    n2 = {s.gpu: s for s in per_node["n2"]}
    assert per_node["n1"][0].graphics_mhz == n2[0].graphics_mhz == 1410
    assert n2[0].memory_mhz is None  # HBM: no memory lock
    assert n2[1].job_id == "2" and n2[1].memory_mhz == 7251 and n2[1].graphics_mhz == 1740


@pytest.mark.parametrize(
    ("reason", "held"),
    [
        (ThrottleReason.HW_POWER_BRAKE, True),  # a rack's power brake
        (ThrottleReason.HW_SLOWDOWN, True),
        (ThrottleReason.SW_THERMAL, True),
        (ThrottleReason.GPU_IDLE, False),  # idle is not a limiter
        (ThrottleReason.NONE, False),
    ],
)
def test_any_limiter_below_the_lock_counts_the_job_at_the_clock_it_ran(
    reason: ThrottleReason, held: bool
) -> None:
    table = _table()
    table.add([_job("7", ("n1", 0))])
    m = table.measurements([GpuSample(GpuRef("n1", 0), 150.0, 705, 1593, int(reason))])
    assert m.power_capped is not None and m.power_capped.tolist() == [held]


def test_a_jobs_kind_reaches_the_kind_prior_unless_it_serves_or_shares() -> None:
    grid = ClockGrid.from_tables([(t, CATALOG[t].clocks) for t in TYPES])
    table = RunningJobs(grid, JobEstimator(EstimatorSettings(kind_prior=True)), CATALOG)
    kind = job_kind("alice", "train", "A100-SXM4-80GB")
    table.add(
        [
            replace(_job("1", ("n1", 0)), kind=kind),
            replace(_job("2", ("n1", 1)), kind=kind),
            replace(_job("3", ("n1", 2)), kind=kind, objective_s=0.25),  # serves
            replace(_job("4", ("n1", 3))),  # no name known
        ]
    )
    table.add([replace(_job("5", ("n1", 0)), kind=kind)])  # joins job 1's GPU
    np.testing.assert_array_equal(table.estimator.kind, [0, 0, -1, -1, -1])
