"""A job not yet measured, counted at a share of its power limit and held there
(`ControllerSettings.new_job_power_share`, `Decision.held`, `guard_rail.power_limits_w`), the
share fixed or learned from first readings (`new_job_power_quantile`, `NewJobShare`)."""

from __future__ import annotations

import numpy as np
import pytest

from slurm_cdgpc.control.discrete import ClockGrid
from slurm_cdgpc.control.empc import (
    ControllerSettings,
    Decision,
    EconomicMPC,
    JobState,
    Measurements,
)
from slurm_cdgpc.control.guard_rail import power_limits_w
from slurm_cdgpc.control.limits import NewJobShare
from slurm_cdgpc.control.tenancy import Tenancy
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.estimator import JobEstimator
from tests.unit.problems import A100, a100_estimator

GRID = ClockGrid.from_tables([("A100", A100)], min_fraction=0.5)


def _measured_and_new() -> JobEstimator:
    """Job 0 measured for three intervals at 300 W at top clock; job 1 just started."""
    est = a100_estimator([1])
    for x in (1.0, 0.8, 0.6):
        est.observe(
            np.full(1, x), np.ones(1), np.full(1, 300.0 * (0.4 + 0.6 * x**3)), np.full(1, 0.5 / x)
        )
    est.add_jobs(a100_estimator([2]).statics, iteration_s=np.full(1, 0.5))
    return est


def _jobs(objective_s: list[float] | None = None, tenancy: Tenancy | None = None) -> JobState:
    return JobState(
        gpu_type=np.zeros(2, dtype=np.int64),
        remaining_iterations=np.full(2, 1000.0),
        deadline_s=np.full(2, 3600.0),
        objective_s=None if objective_s is None else np.array(objective_s),
        tenancy=tenancy,
    )


def _mpc(share: float) -> EconomicMPC:
    return EconomicMPC(
        GRID, ControllerSettings(new_job_power_share=share, new_job_power_quantile=1.0)
    )


def test_a_new_job_is_counted_at_its_share_and_held_there() -> None:
    est = _measured_and_new()
    d = _mpc(0.6).step(est, _jobs(), 0.0, 1e4)
    assert d.held is not None and d.held.tolist() == [False, True]
    assert d.job_power_w[1] == pytest.approx(2 * 0.6 * 400.0)  # both its GPUs, at the share
    assert np.isnan(d.planned_power_w[1])  # no model yet: nothing for the offset to learn
    limits = power_limits_w(d.job_power_w, [1, 2], 0.0, [100.0] * 2, [400.0] * 2, held=d.held)
    assert limits is not None and limits.tolist() == pytest.approx([400.0, 240.0])


def test_the_whole_limit_holds_nothing_and_plans_as_before() -> None:
    d = _mpc(1.0).step(_measured_and_new(), _jobs(), 0.0, 1e4)
    assert d.held is None
    assert d.job_power_w[1] == pytest.approx(2 * 400.0)
    assert power_limits_w(d.job_power_w, [1, 2], 0.0, [100.0] * 2, [400.0] * 2) is None


def test_the_share_frees_budget_for_the_measured_jobs() -> None:
    """Under a budget that binds, the room the newcomer is not counted at goes to job 0."""
    budget_w = 300.0 + 2 * 400.0 * 0.6
    whole = _mpc(1.0).step(_measured_and_new(), _jobs(), 0.0, budget_w)
    share = _mpc(0.6).step(_measured_and_new(), _jobs(), 0.0, budget_w)
    assert share.graphics_mhz[0] > whole.graphics_mhz[0]
    assert share.predicted_power_w <= budget_w


def test_a_serving_job_and_its_tenants_keep_their_default_limits() -> None:
    serving = _mpc(0.6).step(_measured_and_new(), _jobs([np.inf, 0.25]), 0.0, 1e4)
    assert serving.held is None
    assert serving.job_power_w[1] == pytest.approx(800.0)
    est = a100_estimator([1])
    est.observe(np.ones(1), np.ones(1), np.full(1, 250.0), np.full(1, 0.5))
    est.add_jobs(a100_estimator([1]).statics, iteration_s=np.full(1, 0.5))
    tenancy = Tenancy.of_gpus([["a0"], ["a0"]])
    shared = _mpc(0.6).step(est, _jobs([0.25, np.inf], tenancy), 0.0, 1e4)
    assert shared.held is None  # the newcomer's GPU serves: counted at the whole limit
    assert shared.job_power_w.sum() == pytest.approx(400.0)


def test_a_new_tenant_holds_its_whole_gpu_at_the_share() -> None:
    est = a100_estimator([1])
    est.observe(np.ones(1), np.ones(1), np.full(1, 250.0), np.full(1, 0.5))
    est.add_jobs(a100_estimator([1]).statics, iteration_s=np.full(1, 0.5))
    tenancy = Tenancy.of_gpus([["a0"], ["a0"]])
    d = _mpc(0.6).step(est, _jobs(tenancy=tenancy), 0.0, 1e4)
    assert d.held is not None and d.held.tolist() == [False, True]
    gpu_w = tenancy.gpu_power_w(d.job_power_w)
    assert gpu_w.tolist() == pytest.approx([240.0, 240.0])  # one GPU, counted once
    held = tenancy.any_tenant(d.held)
    limits = power_limits_w(gpu_w[:1], [1], 0.0, [100.0], [400.0], held=held[:1])
    assert limits is not None and limits.tolist() == pytest.approx([240.0])


def test_the_plans_own_hold_sets_no_ceiling_on_the_clock() -> None:
    """The firmware held the newcomer at its share: that says nothing of its board's limit, so
    once measured it may run above the clock the hold allowed."""
    est = _measured_and_new()
    mpc = _mpc(0.6)
    d = mpc.step(est, _jobs(), 0.0, 1e4)
    held_mhz = 1095.0  # where 240 W per GPU held it
    measured = Measurements(
        graphics_mhz=np.array([float(d.graphics_mhz[0]), held_mhz]),
        memory_mhz=np.full(2, 1593.0),
        power_w=np.array([300.0, 240.0]),
        iteration_s=np.array([0.5, 0.6]),
        planned_power_w=d.planned_power_w,
        power_capped=np.array([False, True]),
    )
    after = mpc.step(est, _jobs(), 60.0, 1e4, measured=measured)
    assert np.isinf(est.limit_x[1])
    assert after.held is None  # measured now: its limit comes back
    assert after.graphics_mhz[1] > held_mhz


def test_a_share_outside_zero_to_one_is_refused() -> None:
    for share in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(InputError, match="new job's power share"):
            ControllerSettings(new_job_power_share=share)


def test_the_rail_keeps_its_margin_for_the_others() -> None:
    limits = power_limits_w(
        [200.0, 480.0], [1, 2], 0.1, [100.0] * 2, [400.0] * 2, held=[False, True]
    )
    assert limits is not None and limits.tolist() == pytest.approx([220.0, 240.0])


def test_the_learned_share_is_the_quantile_of_first_readings() -> None:
    """20 first readings give the quantile; then the tracker follows the readings and settles at
    the drawn quantile; of a job a limit held down it knows only that it reached the share."""
    share = NewJobShare(1.0, 0.9)
    share.observe(["A100"] * 19, np.linspace(0.4, 0.6, 19), np.zeros(19, dtype=bool))
    assert share.of(["A100", "H100"]).tolist() == [1.0, 1.0]  # too few yet: the whole limit
    share.observe(["A100"], np.array([0.5]), np.array([False]))
    first = np.quantile(np.append(np.linspace(0.4, 0.6, 19), 0.5), 0.9)
    assert share.of(["A100", "H100"]).tolist() == pytest.approx([first, 1.0])
    rng = np.random.default_rng(0)
    for y in rng.uniform(0.3, 0.7, 4000).tolist():  # true 0.9 quantile: 0.66
        share.observe(["A100"], np.array([y]), np.array([False]))
    assert float(share.of(["A100"])[0]) == pytest.approx(0.66, abs=0.03)
    for y in rng.uniform(0.3, 0.9, 4000).tolist():  # a limit at 0.6 holds the upper half down
        share.observe(["A100"], np.array([min(y, 0.6)]), np.array([y > 0.6]))
    assert float(share.of(["A100"])[0]) > 0.6  # more than 1 − q reach it: it rises past them


def test_a_capped_first_reading_counts_as_the_whole_limit() -> None:
    share = NewJobShare(1.0, 0.9)
    share.observe(["A100"] * 20, np.full(20, 0.5), np.array([True] * 3 + [False] * 17))
    assert share.of(["A100"]).tolist() == [1.0]  # 3 of 20 capped: the 0.9 quantile is above them


def test_quantile_one_learns_nothing() -> None:
    share = NewJobShare(0.6, 1.0)
    share.observe(["A100"] * 40, np.full(40, 0.2), np.zeros(40, dtype=bool))
    assert share.of(["A100"]).tolist() == [0.6]


def _twenty_new() -> tuple[EconomicMPC, JobEstimator, JobState]:
    mpc = EconomicMPC(GRID, ControllerSettings(new_job_power_quantile=0.9))
    est = a100_estimator([1] * 20)
    jobs = JobState(
        gpu_type=np.zeros(20, dtype=np.int64),
        remaining_iterations=np.full(20, 1000.0),
        deadline_s=np.full(20, 3600.0),
    )
    return mpc, est, jobs


def _read(d: Decision, mhz: float, power_w: float) -> Measurements:
    n = d.graphics_mhz.size
    return Measurements(
        graphics_mhz=np.full(n, mhz),
        memory_mhz=np.full(n, 1593.0),
        power_w=np.full(n, power_w),
        iteration_s=np.full(n, 0.5),
        planned_power_w=d.planned_power_w,
        power_capped=np.zeros(n, dtype=bool),
    )


def test_new_jobs_are_counted_at_what_the_first_ones_drew() -> None:
    mpc, est, jobs = _twenty_new()
    d = mpc.step(est, jobs, 0.0, 1e5)
    assert d.held is None  # nothing learned yet: counted at their limits, nothing held
    top = float(GRID.top_mhz(np.zeros(1, dtype=np.int64))[0][0])
    mpc.step(est, jobs, 60.0, 1e5, measured=_read(d, top, 200.0))
    est.add_jobs(a100_estimator([2]).statics, iteration_s=np.full(1, 0.5))
    more = JobState(
        gpu_type=np.zeros(21, dtype=np.int64),
        remaining_iterations=np.full(21, 1000.0),
        deadline_s=np.full(21, 3600.0),
    )
    after = mpc.step(est, more, 120.0, 1e5)
    assert after.job_power_w[20] == pytest.approx(2 * 0.5 * 400.0)
    assert after.held is None  # a learned share is a prior: nothing held


def test_a_first_reading_below_the_top_clock_teaches_nothing() -> None:
    """Planned below its top clock (a budget that does not fit), a job draws less than it
    would when counted: its reading says nothing of the share."""
    mpc, est, jobs = _twenty_new()
    d = mpc.step(est, jobs, 0.0, 1e5)
    mpc.step(est, jobs, 60.0, 1e5, measured=_read(d, 1005.0, 120.0))
    assert mpc.new_job_share(jobs).tolist() == [1.0] * 20


def test_a_quantile_outside_zero_to_one_is_refused() -> None:
    for q in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(InputError, match="new-job power quantile"):
            ControllerSettings(new_job_power_quantile=q)
