from __future__ import annotations

import numpy as np
import pytest

from slurm_cdgpc.control.discrete import ClockGrid
from slurm_cdgpc.control.dual import StepStatus
from slurm_cdgpc.control.empc import (
    ControllerSettings,
    EconomicMPC,
    JobState,
    Measurements,
    QueueState,
)
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.estimator import JobEstimator
from tests.unit.problems import A100, a100_estimator


def _setup(
    n: int, settings: ControllerSettings | None = None, measured: bool = True
) -> tuple[EconomicMPC, JobEstimator, JobState]:
    grid = ClockGrid.from_tables([("A100", A100)], min_fraction=0.5)
    est = a100_estimator([4] * n)
    if measured:  # one interval at the top clock drawing 300 W per GPU: the model is known
        one = np.ones(n)
        est.observe(one, one, np.full(n, 300.0), np.full(n, 0.5))
    jobs = JobState(
        gpu_type=np.zeros(n, dtype=np.int64),
        remaining_iterations=np.full(n, 10_000.0),
        deadline_s=np.full(n, np.nan),
    )
    return EconomicMPC(grid, settings), est, jobs


@pytest.mark.parametrize(("floor", "far"), [(False, 0.125), (True, 0.25)])
def test_weights_are_deadline_pressure_floored_at_a_job_without_deadline(
    floor: bool, far: float
) -> None:
    mpc, est, _ = _setup(4, ControllerSettings(default_pressure=0.25, pressure_floor=floor))
    jobs = JobState(
        gpu_type=np.zeros(4, dtype=np.int64),
        remaining_iterations=np.array([1000.0, 1000.0, np.nan, 1000.0]),
        deadline_s=np.array([1000.0, 4000.0, 2000.0, np.nan]),
    )
    w = mpc.weights(est, jobs, now_s=0.0)[0]
    t_top = est.predict_iteration_s(np.ones(4), np.ones(4))
    # w T(top) = R T / slack: 1000 × 0.5 s over 1000 s = 0.5; over 4000 s = 0.125, which
    # the floor raises to the pressure of a job without a deadline
    np.testing.assert_allclose(w * t_top, [0.5, far, 1.0, 0.25])
    # unknown remaining work: pressure 1 at top clocks (the third job)


def test_unknown_work_is_bounded_by_the_time_limit_and_never_pressed_above_one() -> None:
    mpc, est, _ = _setup(4, ControllerSettings(pressure_floor=False))
    hour = 3600.0
    jobs = JobState(
        gpu_type=np.zeros(4, dtype=np.int64),
        remaining_iterations=np.full(4, np.nan),
        deadline_s=np.array([100 * hour, 2 * hour, 0.5 * hour, 100 * hour]),
        time_limit_s=np.array([4 * hour, 4 * hour, 4 * hour, np.nan]),
        start_s=np.array([-hour, -hour, -hour, -hour]),
    )
    est.work_top_s[:] = 0.5 * hour  # an hour in, at half speed on average
    w = mpc.weights(est, jobs, now_s=0.0)[0] * est.predict_iteration_s(np.ones(4), np.ones(4))
    # at most min(4 h − 0.5 h, start + 4 h − now = 3 h) = 3 h of work left at top clocks:
    # 3 h over 100 h; over 2 h it would be 1.5, capped at 1; no time limit: pressure 1
    np.testing.assert_allclose(w, [0.03, 1.0, 1.0, 1.0])
    off = EconomicMPC(
        mpc.grid, ControllerSettings(work_from_time_limit=False, pressure_floor=False)
    )
    w_off = off.weights(est, jobs, now_s=0.0)[0] * est.predict_iteration_s(np.ones(4), np.ones(4))
    np.testing.assert_allclose(w_off, [1.0, 1.0, 1.0, 1.0])


def test_work_accrues_at_the_modelled_speed_while_the_gpus_are_busy() -> None:
    mpc, est, jobs = _setup(3)
    applied = np.array([1410.0, 705.0, 1410.0])
    measured = Measurements(
        graphics_mhz=applied,
        memory_mhz=np.full(3, 1593.0),
        power_w=np.array([300.0, 200.0, 61.0]),  # the third job's GPUs sit idle
        iteration_s=np.full(3, np.nan),
    )
    mpc.step(est, jobs, now_s=0.0, budget_w=1e6, measured=measured)
    assert est.work_top_s.tolist() == [0.0, 0.0, 0.0]  # the first step has no interval behind it
    mpc.step(est, jobs, now_s=30.0, budget_w=1e6, measured=measured)
    x = applied / 1410.0
    speed = est.predict_iteration_s(np.ones(3), np.ones(3)) / est.predict_iteration_s(x, np.ones(3))
    np.testing.assert_allclose(est.work_top_s, [30.0, 30.0 * speed[1], 0.0])
    assert 0 < speed[1] < 1
    mpc.step(est, jobs, now_s=1030.0, budget_w=1e6, measured=measured)  # a head away 1000 s
    assert est.work_top_s[0] == pytest.approx(30.0 + 2 * mpc.settings.interval_s)


def test_jobs_without_deadline_get_the_default_pressure_and_late_jobs_are_capped() -> None:
    settings = ControllerSettings(default_pressure=0.25, max_pressure=50.0, triage=False)
    mpc, est, _ = _setup(2, settings)
    jobs = JobState(
        gpu_type=np.zeros(2, dtype=np.int64),
        remaining_iterations=np.array([1e6, 1e6]),
        deadline_s=np.array([np.nan, -10.0]),
    )
    w = mpc.weights(est, jobs, now_s=0.0)[0]
    t_top = est.predict_iteration_s(np.ones(2), np.ones(2))
    np.testing.assert_allclose(w * t_top, [0.25, 50.0])


def test_urgent_jobs_get_higher_clocks() -> None:
    mpc, est, jobs = _setup(4)
    # 5000 s of work at top clocks: pressure 0.83 against the far jobs' floor of 0.5
    jobs = JobState(jobs.gpu_type, jobs.remaining_iterations, np.array([6e3, 6e3, 1e6, 1e6]))
    budget = 4 * 4 * 250.0
    d = mpc.step(est, jobs, now_s=0.0, budget_w=budget)
    assert d.status is StepStatus.BINDING
    assert d.graphics_mhz[0] == d.graphics_mhz[1] > d.graphics_mhz[2] == d.graphics_mhz[3]
    assert d.predicted_power_w <= d.effective_budget_w
    assert -0.5 < d.budget_error_pct <= 0


@pytest.mark.parametrize("per_job", [False, True])
def test_offset_correction_absorbs_a_persistent_model_error(per_job: bool) -> None:
    # the exploration margin is off: this test isolates the offset estimate
    settings = ControllerSettings(
        offset_gain=0.3,
        exploration_sigmas=0.0,
        guard_band=0.003,
        guard_per_sqrt_job=0.0,
        offset_per_job=per_job,
    )
    mpc, est, jobs = _setup(10, settings, measured=False)
    budget = 10 * 4 * 260.0
    d = mpc.step(est, jobs, now_s=0.0, budget_w=budget)
    for k in range(1, 40):
        # an adversarial plant: always 2 % above whatever the (learning) model predicts
        x, x_m = est.normalise(d.graphics_mhz.astype(float), d.memory_mhz.astype(float))
        drawn_w = 1.02 * est.predict_power_w(x, x_m)
        measured = Measurements(
            graphics_mhz=d.graphics_mhz.astype(float),
            memory_mhz=d.memory_mhz.astype(float),
            power_w=drawn_w,
            iteration_s=np.full(10, 0.5),
            planned_power_w=d.planned_power_w,
        )
        true_w = float(np.sum(est.statics.gpus * drawn_w))
        d = mpc.step(est, jobs, now_s=60.0 * k, budget_w=budget, measured=measured)
    # with the offset, the true draw settles on the budget less the guard band
    assert abs(true_w - budget * (1 - 0.003)) / budget < 2e-3
    assert d.offset == pytest.approx(0.02, abs=2e-3)


@pytest.mark.parametrize("per_job", [False, True])
def test_a_small_jobs_miss_scales_the_plan_by_its_share_with_offsets_per_job(
    per_job: bool,
) -> None:
    # a settled 4-GPU job draws 30 % under its model; a 64-GPU job beside it has no reading
    settings = ControllerSettings(offset_gain=0.3, exploration_sigmas=0.0, offset_per_job=per_job)
    grid = ClockGrid.from_tables([("A100", A100)], min_fraction=0.5)
    mpc, est = EconomicMPC(grid, settings), a100_estimator([4, 64])
    jobs = JobState(np.zeros(2, dtype=np.int64), np.full(2, 1e4), np.full(2, np.nan))
    d = mpc.step(est, jobs, now_s=0.0, budget_w=30_000.0)
    for k in range(1, 20):
        x, x_m = est.normalise(d.graphics_mhz.astype(float), d.memory_mhz.astype(float))
        drawn_w = np.where([True, False], 0.7 * est.predict_power_w(x, x_m), np.nan)
        measured = Measurements(
            graphics_mhz=d.graphics_mhz.astype(float),
            memory_mhz=d.memory_mhz.astype(float),
            power_w=drawn_w,
            iteration_s=np.array([0.5, np.nan]),
            planned_power_w=d.planned_power_w,
        )
        d = mpc.step(est, jobs, now_s=30.0 * k, budget_w=30_000.0, measured=measured)
    if per_job:
        # its own offset has learned the miss, the plan's counts it for its share (4 GPUs
        # against 64 counted at their 400 W limit), and the new job's for the share of the
        # plan the settled one speaks for
        assert est.offset[0] == pytest.approx(-0.3, abs=0.02)
        assert np.isnan(est.offset[1])
        share = mpc.offset_prior / est.offset[0]
        assert 0.005 < share < 0.06
        assert d.offset == pytest.approx(est.offset[0] * share * (2 - share), rel=0.05)
    else:  # one offset, learned from the settled job alone, scales the whole plan
        assert d.offset == pytest.approx(-0.3, abs=0.02)


def test_unmeasured_jobs_run_at_top_clock_counted_at_their_limit() -> None:
    mpc, est, jobs = _setup(3, measured=False)
    d = mpc.step(est, jobs, now_s=0.0, budget_w=3 * 4 * 500.0)
    assert np.all(d.graphics_mhz == 1410)
    np.testing.assert_allclose(d.job_power_w, 4 * 400.0)  # g × TDP, whatever the clock


def test_infeasible_budget_is_flagged_not_raised() -> None:
    mpc, est, jobs = _setup(5)
    d = mpc.step(est, jobs, now_s=0.0, budget_w=100.0)
    assert d.status is StepStatus.INFEASIBLE
    assert np.all(d.graphics_mhz == mpc.grid.bottom_mhz(jobs.gpu_type)[0])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "magic"}, "unknown dual mode"),
        ({"guard_per_sqrt_job": -0.1}, "guard per"),
        ({"min_clock_fraction": 1.0}, "clock floor"),
        ({"drain_pressure": -1.0}, "drain pressure"),
        ({"interval_s": -1.0}, "interval"),
        ({"guard_band": 0.9}, "guard band"),
        ({"offset_gain": 2.0}, "offset gain"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InputError, match=message):
        ControllerSettings(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("budget", [0.0, -5.0, float("nan")])
def test_bad_budget_is_refused(budget: float) -> None:
    mpc, est, jobs = _setup(2)
    with pytest.raises(InputError, match="positive number of watts"):
        mpc.step(est, jobs, now_s=0.0, budget_w=budget)


def test_exploration_margin_is_zero_in_place_and_grows_with_the_move() -> None:
    mpc, est, _ = _setup(4)
    rng = np.random.default_rng(0)
    one = np.ones(4)
    for _ in range(10):  # the jobs have only ever run near their top clock
        x = rng.uniform(0.95, 1.0, 4)
        est.observe(x, one, 100 + 250 * x * (1 + 0.01 * rng.standard_normal(4)), 0.5 / x)
    here = np.full(4, 0.97)
    assert mpc.exploration_margin_w(est, here, one, here, one) == 0.0
    near = mpc.exploration_margin_w(est, np.full(4, 0.9), one, here, one)
    far = mpc.exploration_margin_w(est, np.full(4, 0.6), one, here, one)
    assert 0.0 < near < far


def test_exploration_margin_never_makes_a_binding_step_infeasible() -> None:
    settings = ControllerSettings(exploration_sigmas=1e6)  # an absurd margin
    mpc, est, jobs = _setup(6, settings)
    rng = np.random.default_rng(1)
    one = np.ones(6)
    for _ in range(10):  # noisy measurements near the top clock: σ̂ > 0, P tight there only
        x = rng.uniform(0.95, 1.0, 6)
        est.observe(x, one, 100 + 250 * x * (1 + 0.01 * rng.standard_normal(6)), 0.5 / x)
    budget = 7800.0  # between the jobs' power at their lowest (≈ 7.4 kW) and top (≈ 8.3 kW)
    measured = Measurements(
        graphics_mhz=np.full(6, 1380.0),
        memory_mhz=np.full(6, 1593.0),
        power_w=np.full(6, 345.0),
        iteration_s=np.full(6, 0.51),
    )
    assert mpc.exploration_margin_w(est, np.full(6, 0.7), one, np.full(6, 0.98), one) > budget
    d = mpc.step(est, jobs, now_s=0.0, budget_w=budget, measured=measured)
    assert d.status is StepStatus.BINDING
    assert d.predicted_power_w <= budget


def _two_jobs_one_second_per_iteration() -> tuple[EconomicMPC, JobEstimator]:
    mpc, est, _ = _setup(2, measured=False)
    one = np.ones(2)
    est.observe(one, one, np.full(2, 300.0), np.ones(2))  # 1 s per iteration
    return mpc, est


def test_triage_weights_hopeless_jobs_like_jobs_without_deadline() -> None:
    mpc, est = _two_jobs_one_second_per_iteration()
    t_top = est.predict_iteration_s(np.ones(2), np.ones(2))
    # job 0: 1000 iterations in 100 s: hopeless even at top clocks; job 1: 50 in 100 s
    jobs = JobState(np.zeros(2, dtype=np.int64), np.array([1000.0, 50.0]), np.array([100.0, 100.0]))
    w = mpc.weights(est, jobs, 0.0)[0]
    assert w[0] == pytest.approx(mpc.settings.default_pressure / t_top[0])
    assert w[1] * t_top[1] == pytest.approx(50.0 / 100.0)
    mpc = EconomicMPC(mpc.grid, ControllerSettings(triage=False))
    assert mpc.weights(est, jobs, 0.0)[0, 0] * t_top[0] == pytest.approx(1000.0 / 100.0)


def test_drain_presses_the_jobs_of_the_node_that_empties_first_while_the_queue_is_stuck() -> None:
    mpc, est, _ = _setup(3, measured=False)
    est.observe(np.ones(3), np.ones(3), np.full(3, 300.0), np.ones(3))  # 1 s per iteration
    t_top = est.predict_iteration_s(np.ones(3), np.ones(3))
    # no deadlines; node 0 holds job 0 (ends in 100 s) and job 1 (ends in 300 s): it empties in
    # 300 s; node 1 is all job 2's, which ends in 1000 s; node 2 is empty
    jobs = JobState(
        np.zeros(3, dtype=np.int64), np.array([100.0, 300.0, 1000.0]), np.full(3, np.nan)
    )
    nodes = np.array([[1, 0, 0], [2, 0, 0], [0, 8, 0]])
    base = mpc.settings.default_pressure

    def pressure(queue: QueueState | None) -> np.ndarray:
        return np.asarray(mpc.weights(est, jobs, 0.0, queue)[0] * t_top)

    stuck = QueueState.from_matrix(True, nodes, np.array([5, 0, 8]))
    np.testing.assert_allclose(pressure(None), [base] * 3, rtol=1e-6)  # the head cannot see
    idle = QueueState.from_matrix(False, nodes, np.array([5, 0, 8]))
    np.testing.assert_allclose(pressure(idle), [base] * 3, rtol=1e-6)  # nothing waits
    # jobs wait although GPUs are free: both jobs of node 0 are pressed
    np.testing.assert_allclose(pressure(stuck), [1.0, 1.0, base], rtol=1e-6)
    full = QueueState.from_matrix(True, nodes, np.zeros(3, dtype=np.int64))
    np.testing.assert_allclose(pressure(full), [base] * 3, rtol=1e-6)  # waits for any GPU
    mpc = EconomicMPC(mpc.grid, ControllerSettings(drain_pressure=0.0))  # off
    np.testing.assert_allclose(pressure(stuck), [base] * 3, rtol=1e-6)


def test_clock_floor_gives_way_only_when_nothing_above_it_fits() -> None:
    mpc, est, jobs = _setup(4)  # 4 jobs × 4 GPUs at 300 W at the top clock
    floor_mhz = mpc.floor_grid.bottom_mhz(jobs.gpu_type)[0][0]
    assert floor_mhz >= 0.6 * 1410 > mpc.grid.bottom_mhz(jobs.gpu_type)[0][0]
    roomy = mpc.step(est, jobs, now_s=0.0, budget_w=16 * 250.0)
    assert roomy.graphics_mhz.min() >= floor_mhz
    # a budget between every job at the floor and every job at the grid's lowest clock
    x_floor = floor_mhz / 1410.0
    x_low = mpc.grid.bottom_mhz(jobs.gpu_type)[0][0] / 1410.0
    one = np.ones(4)
    at_floor_w = float(np.sum(4 * est.predict_power_w(one * x_floor, one)))
    at_low_w = float(np.sum(4 * est.predict_power_w(one * x_low, one)))
    budget_w = 0.5 * (at_floor_w + at_low_w) / (1 - mpc.settings.guard_for(4))
    tight = mpc.step(est, jobs, now_s=0.0, budget_w=budget_w)
    assert tight.status is StepStatus.BINDING
    assert tight.graphics_mhz.max() < floor_mhz
    assert tight.predicted_power_w <= tight.effective_budget_w
    mpc = EconomicMPC(mpc.grid, ControllerSettings(floor_fallback=False))
    held = mpc.step(est, jobs, now_s=0.0, budget_w=budget_w)
    assert held.status is StepStatus.INFEASIBLE and held.graphics_mhz.min() >= floor_mhz


def test_guard_band_grows_on_small_clusters() -> None:
    s = ControllerSettings(guard_band=0.002, guard_per_sqrt_job=0.03)
    assert s.guard_for(1) == pytest.approx(0.03)
    assert s.guard_for(100) == pytest.approx(0.003)
    assert s.guard_for(10**6) == pytest.approx(0.002)
    assert ControllerSettings(guard_per_sqrt_job=0.0).guard_for(1) == s.guard_band


def test_the_controller_takes_one_budget_the_one_in_force() -> None:
    # the per-step problems decouple, so a horizon never changed the applied clocks and was
    # removed (DESIGN.md, "No horizon")
    mpc, est, jobs = _setup(3)
    with pytest.raises(TypeError):
        ControllerSettings(horizon=4)  # type: ignore[call-arg]
    assert mpc.weights(est, jobs, 0.0).shape == (1, 3)


def test_the_limit_share_is_learned_from_ended_jobs_and_a_job_past_it_gets_its_whole_limit() -> (
    None
):
    mpc, est, _ = _setup(2, ControllerSettings(pressure_floor=False))
    hour = 3600.0
    assert mpc.limit_share.share == 1.0
    # 19 ended jobs are not enough; the 20th is: they used 0.3 to 0.6 of their limits
    used = np.linspace(0.3, 0.6, 20)
    mpc.jobs_ended(used[:19] * hour, np.full(19, hour))
    assert mpc.limit_share.share == 1.0
    mpc.jobs_ended(used[19:] * hour, np.full(1, hour))
    mpc.jobs_ended(np.array([5.0]), np.array([np.nan]))  # no limit: not counted
    assert mpc.limit_share.share == pytest.approx(np.quantile(used, 0.9))
    share = mpc.limit_share.share
    jobs = JobState(
        gpu_type=np.zeros(2, dtype=np.int64),
        remaining_iterations=np.full(2, np.nan),
        deadline_s=np.full(2, 100 * hour),
        time_limit_s=np.full(2, 10 * hour),
        start_s=np.full(2, -hour),
    )
    est.work_top_s[:] = [hour, 7 * hour]  # the second has outlived the learned share
    w = mpc.weights(est, jobs, now_s=0.0)[0] * est.predict_iteration_s(np.ones(2), np.ones(2))
    np.testing.assert_allclose(w, [(share * 10 - 1) / 100, (10 - 7) / 100])
    with pytest.raises(InputError, match="limit share quantile"):
        ControllerSettings(limit_share_quantile=0.0)


def test_a_held_pooled_jobs_offset_fades_instead_of_standing() -> None:
    # three jobs that all learned δ_n = −0.3; the firmware then holds the first two at their
    # limit, and the third runs free, drawing 10 % under its plan
    settings = ControllerSettings(offset_gain=0.3, exploration_sigmas=0.0, offset_per_job=True)
    mpc, est, jobs = _setup(3, settings)
    est.offset[:] = -0.3
    # the first started from its kind's pool: its offset may have been learned where its
    # weak model was planned far from its readings; the second's model is its own
    est.pooled[:] = [True, False, False]
    d = mpc.step(est, jobs, now_s=0.0, budget_w=3 * 4 * 260.0)
    for k in range(1, 10):
        measured = Measurements(
            graphics_mhz=d.graphics_mhz.astype(float),
            memory_mhz=d.memory_mhz.astype(float),
            power_w=0.9 * d.job_power_w / est.statics.gpus,
            iteration_s=np.full(3, 0.5),
            planned_power_w=d.job_power_w,  # as if settled: each job's plan is compared
            power_capped=np.array([True, True, False]),
        )
        d = mpc.step(est, jobs, now_s=30.0 * k, budget_w=3 * 4 * 260.0, measured=measured)
    # nine held intervals: the pooled job's offset decays at the gain, the other's stands,
    # the free job's learns its miss
    assert est.offset[0] == pytest.approx(-0.3 * 0.7**9)
    assert est.offset[1] == -0.3
    assert est.offset[2] == pytest.approx(-0.1, abs=0.01)
