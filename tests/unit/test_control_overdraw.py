"""The guard band sized on the whole plan's measured over-draw (`Overdraw`, `cluster_guard`)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from slurm_cdgpc.control.discrete import ClockGrid
from slurm_cdgpc.control.empc import ControllerSettings, EconomicMPC, JobState, Measurements
from slurm_cdgpc.control.overdraw import ClusterDraw, Overdraw
from slurm_cdgpc.control.ramp import Ramp
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.estimator import JobEstimator
from tests.unit.problems import A100, a100_estimator

BUDGET_W = 10_000.0


def _draws(overdraw: Overdraw, shares: list[float]) -> None:
    for share in shares:
        overdraw.observe(ClusterDraw(BUDGET_W * (0.9 + share), BUDGET_W * 0.9, BUDGET_W))


def test_the_quantile_waits_for_its_minimum_then_follows_its_window() -> None:
    overdraw = Overdraw(window=200, min_intervals=100)
    _draws(overdraw, [0.001] * 99)
    assert overdraw.quantile(0.99) is None
    _draws(overdraw, [0.001])
    assert overdraw.quantile(0.99) == pytest.approx(0.001)
    _draws(overdraw, [0.03] * 10)  # a tail of 10 in 110
    q = overdraw.quantile(0.95)
    assert q is not None and q == pytest.approx(0.03)
    _draws(overdraw, [0.001] * 200)  # the window forgets it
    assert overdraw.quantile(0.99) == pytest.approx(0.001)


def test_a_reading_that_is_not_a_number_or_no_budget_teaches_nothing() -> None:
    overdraw = Overdraw(window=10, min_intervals=1)
    overdraw.observe(ClusterDraw(math.nan, 100.0, BUDGET_W))
    overdraw.observe(ClusterDraw(100.0, math.nan, BUDGET_W))
    overdraw.observe(ClusterDraw(100.0, 90.0, 0.0))
    overdraw.observe(ClusterDraw(100.0, 90.0, math.inf))
    assert overdraw.quantile(0.5) is None
    with pytest.raises(InputError, match="window"):
        Overdraw(window=10, min_intervals=11)


def _mpc(**settings: float) -> EconomicMPC:
    """The controller with the tail rule on (`guard_tail` p = 0.005), unless ``settings`` say."""
    grid = ClockGrid.from_tables([("A100", A100)], min_fraction=0.5)
    settings = {"guard_tail": 0.005, **settings}
    return EconomicMPC(grid, ControllerSettings(**settings))  # type: ignore[arg-type]


def _measured_jobs(n: int) -> tuple[JobEstimator, JobState]:
    """``n`` 4-GPU jobs without deadlines, measured once at the top clock at 300 W a GPU."""
    est = a100_estimator([4] * n)
    one = np.ones(n)
    est.observe(one, one, np.full(n, 300.0), np.full(n, 0.5))
    return est, JobState(np.zeros(n, dtype=np.int64), np.full(n, 1e4), np.full(n, np.nan))


def test_the_guard_band_falls_to_what_the_plans_missed_by_never_above_c_over_root_n() -> None:
    s = ControllerSettings()
    assert s.guard_tail == 0.005 and s.offset_per_job  # shipped on, the two together
    mpc = _mpc()
    assert mpc.cluster_guard(9) == pytest.approx(s.guard_for(9)) == pytest.approx(0.01)
    # plans that land within 0.4 % of what they expected: ε = max(ε₀, Q − margin) = ε₀
    _draws(mpc.overdraw, list(np.linspace(-0.004, 0.004, 200)))
    assert mpc.cluster_guard(9) == pytest.approx(s.guard_band)
    # a tail of 2 % over-draws in one interval of 50: Q(0.995) − 1 % = 1 %, at most c/√N
    tailed = _mpc()
    _draws(tailed.overdraw, ([0.0] * 49 + [0.02]) * 4)
    assert tailed.cluster_guard(4) == pytest.approx(0.01)
    assert tailed.cluster_guard(100) == pytest.approx(s.guard_for(100))
    # off: c/√N whatever was measured
    off = _mpc(guard_tail=0.0)
    _draws(off.overdraw, [0.0] * 200)
    assert off.cluster_guard(9) == pytest.approx(0.01)
    with pytest.raises(InputError, match="guard tail"):
        ControllerSettings(guard_tail=1.0)


def test_the_controller_learns_the_over_draw_from_its_measurements_and_plans_with_it() -> None:
    n = 9
    est, jobs = _measured_jobs(n)
    mpc = _mpc(exploration_sigmas=0.0)
    budget_w = n * 4 * 250.0
    d = mpc.step(est, jobs, now_s=0.0, budget_w=budget_w, uncontrolled_w=500.0)
    # the whole plan's expectation: its jobs as the offset says plans turn out, and the rest
    assert d.expected_w == pytest.approx(d.predicted_power_w * (1 + d.offset) + 500.0)
    first_effective = d.effective_budget_w
    for k in range(1, 120):
        measured = Measurements(
            graphics_mhz=d.graphics_mhz.astype(float),
            memory_mhz=d.memory_mhz.astype(float),
            power_w=np.full(n, np.nan),  # the models learn nothing: only the guard moves
            iteration_s=np.full(n, np.nan),
            cluster=ClusterDraw(d.expected_w, d.expected_w, d.budget_w),  # as planned
        )
        d = mpc.step(est, jobs, 30.0 * k, budget_w, uncontrolled_w=500.0, measured=measured)
    s = mpc.settings
    assert mpc.cluster_guard(n) == pytest.approx(s.guard_band)
    # B_eff = (B − P_u − ε B) / (1 + δ): ε fell from c/√9 = 1 % to ε₀
    gained = (s.guard_for(n) - s.guard_band) * budget_w
    assert d.effective_budget_w - first_effective == pytest.approx(gained, rel=1e-6)


def test_the_decision_says_the_guard_band_it_held_back() -> None:
    n = 4
    est, jobs = _measured_jobs(n)
    d = _mpc().step(est, jobs, now_s=0.0, budget_w=n * 4 * 250.0)
    assert d.guard_band == pytest.approx(ControllerSettings().guard_for(n)) == pytest.approx(0.015)


def test_a_guard_band_that_shrinks_does_not_outrun_the_ramp() -> None:
    """The ramp counts a plan held under its cap by the guard band as at the cap; when the
    band shrinks (the over-draw is now measured), the step after may still rise by one
    interval at the rate, not by the band's share of the power as well."""
    n, rate_w_per_s, interval_s = 8, 1.0, 30.0
    est, jobs = _measured_jobs(n)
    mpc = _mpc(exploration_sigmas=0.0, interval_s=interval_s)
    free = mpc.step(est, jobs, 0.0, 1e6)  # every job at its top clock
    first = mpc.step(
        est,
        jobs,
        interval_s,
        1e6,
        ramp=Ramp(np.array([rate_w_per_s]), np.array([0.7 * free.predicted_power_w])),
    )
    assert first.guard_band == pytest.approx(0.03 / math.sqrt(n))
    _draws(mpc.overdraw, [0.0] * 100)  # measured now: the band falls to ε₀
    second = mpc.step(
        est, jobs, 2 * interval_s, 1e6, ramp=Ramp(np.array([rate_w_per_s]), np.array([np.nan]))
    )
    assert second.guard_band == pytest.approx(0.002)
    rise_w = second.predicted_power_w - first.predicted_power_w
    assert 0 < rise_w <= rate_w_per_s * interval_s * (1 + 1e-9)
