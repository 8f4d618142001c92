"""Ramp limits (`Ramp.caps_w`) and the emergency cut's choice (`emergency_cut`), on their own and
in the controller's step."""

from __future__ import annotations

import math

import numpy as np
import pytest

from slurm_cdgpc.control.empc import ControllerSettings
from slurm_cdgpc.control.ramp import Ramp, ScheduledLimit, emergency_cut
from slurm_cdgpc.errors import InputError
from tests.unit.test_control_empc import _setup

INTERVAL_S = 30.0
NOW_S = 1000.0


def _caps(limits: list[float], rates: list[float], last: list[float], ahead=()) -> list[float]:
    ramp = Ramp(np.array(rates), np.array(last), tuple(ahead))
    return ramp.caps_w(np.array(limits), NOW_S, INTERVAL_S).tolist()


def test_the_plan_rises_no_faster_than_the_rate() -> None:
    # 1 kW drawn, 10 W/s: 300 W more this step, under a budget that would allow 1 kW more
    assert _caps([2000.0], [10.0], [1000.0]) == [1300.0]
    # ... and never above the limit in force
    assert _caps([1200.0], [10.0], [1000.0]) == [1200.0]


def test_no_rate_or_no_measurement_leaves_the_limit() -> None:
    assert _caps([2000.0], [math.inf], [1000.0]) == [2000.0]
    assert _caps([2000.0], [10.0], [math.nan]) == [2000.0]


def test_a_drop_scheduled_ahead_is_approached_at_the_rate_and_met_on_time() -> None:
    # 500 W from NOW + 95 s: this step ends at NOW + 30 s, 65 s before it, so it may plan at
    # most 500 W + 65 s × 10 W/s
    drop = ScheduledLimit(NOW_S + 95.0, 0, 500.0)
    assert _caps([2000.0], [10.0], [math.nan], [drop]) == [1150.0]
    # within this step: met now
    assert _caps([2000.0], [10.0], [math.nan], [ScheduledLimit(NOW_S + 29.0, 0, 500.0)]) == [500.0]
    # without a rate a scheduled drop waits for its time
    assert _caps([2000.0], [math.inf], [math.nan], [drop]) == [2000.0]
    # a domain's own drop caps that domain only
    rack = ScheduledLimit(NOW_S + 35.0, 1, 100.0)
    assert _caps([2000.0, 400.0], [10.0, 1.0], [math.nan] * 2, [rack]) == [2000.0, 105.0]


@pytest.mark.parametrize("jitter_s", [0.0, 4.0])
def test_the_steps_of_a_scheduled_drop_each_fall_by_no_more_than_the_rate(jitter_s: float) -> None:
    """Stepped forward with each plan drawing its cap, the power falls at most r times the time
    between steps, however they are spaced, and is at the new limit in the step that contains
    its time."""
    at_s = NOW_S + 200.0
    drawn, t = 2000.0, NOW_S
    seen = []
    rng = np.random.default_rng(0)
    while t < at_s + INTERVAL_S:
        ramp = Ramp(np.array([5.0]), np.array([drawn]), (ScheduledLimit(at_s, 0, 1000.0),))
        limit = 2000.0 if t < at_s else 1000.0
        cap = float(ramp.caps_w(np.array([limit]), t, INTERVAL_S)[0])
        seen.append((t, cap))
        step_s = INTERVAL_S + jitter_s * rng.uniform(-1.0, 1.0)
        if seen[:-1]:
            elapsed_s = t - seen[-2][0]
            assert cap >= drawn - 5.0 * elapsed_s - 1e-9  # never faster than the rate
        drawn, t = cap, t + step_s
    running_then = [cap for start, cap in seen if start <= at_s < start + INTERVAL_S]
    assert running_then == [1000.0]


def test_bad_ramps_are_refused() -> None:
    with pytest.raises(InputError, match="positive number of W/s"):
        Ramp(np.array([-5.0]), np.array([1.0]))
    with pytest.raises(InputError, match="one rate and one last power"):
        Ramp(np.array([5.0, 1.0]), np.array([1.0]))
    with pytest.raises(InputError, match="2 ramp rates for 1 limits"):
        Ramp(np.array([5.0, 1.0]), np.array([1.0, 1.0])).caps_w(np.array([1.0]), 0.0, 1.0)
    with pytest.raises(InputError, match="ramp must be a positive rate"):
        ControllerSettings(ramp_w_per_s=0.0)


def test_the_cut_takes_the_lowest_pressure_first_and_stops_when_enough_is_shed() -> None:
    empty_i, empty_f = np.zeros(0, dtype=np.int64), np.zeros(0)
    saving = np.array([100.0, 100.0, 100.0])
    order = np.array([2, 0, 1])  # job 2 has the lowest pressure
    cut = emergency_cut(np.array([150.0]), empty_i, empty_i, empty_f, saving, order)
    assert cut.tolist() == [True, False, True]
    # nothing over: nothing cut
    none = emergency_cut(np.array([0.0]), empty_i, empty_i, empty_f, saving, order)
    assert not none.any()
    # more than every job can shed: all of them
    all_ = emergency_cut(np.array([1000.0]), empty_i, empty_i, empty_f, saving, order)
    assert all_.all()


def test_the_cut_takes_only_jobs_under_the_domain_that_is_over() -> None:
    # rack 1 (index 1) over by 50 W: jobs 0 and 1 are under it, job 2 (lowest pressure) is not
    domain, row, share = np.array([1, 1]), np.array([0, 1]), np.array([1.0, 1.0])
    saving = np.array([80.0, 80.0, 80.0])
    cut = emergency_cut(np.array([0.0, 50.0]), domain, row, share, saving, np.array([2, 1, 0]))
    assert cut.tolist() == [False, True, False]
    # a job half under the rack sheds half its saving there
    cut = emergency_cut(
        np.array([0.0, 50.0]),
        domain,
        row,
        np.array([1.0, 0.5]),
        saving,
        np.array([1, 0, 2]),
    )
    assert cut.tolist() == [True, True, False]


def test_the_controller_plans_under_the_ramped_budget() -> None:
    settings = ControllerSettings(interval_s=INTERVAL_S)
    controller, estimator, jobs = _setup(8, settings)
    free = controller.step(estimator, jobs, NOW_S, 1e6)  # every job at its top clock
    drawn_w = 0.8 * free.predicted_power_w
    ramp = Ramp(np.array([1.0]), np.array([drawn_w]))
    controller, estimator, jobs = _setup(8, settings)
    capped = controller.step(estimator, jobs, NOW_S, 1e6, ramp=ramp)
    assert capped.budget_w == pytest.approx(drawn_w + INTERVAL_S)
    assert capped.predicted_power_w <= capped.budget_w
    assert capped.predicted_power_w < free.predicted_power_w


def test_the_cut_order_is_lowest_pressure_first_and_lowest_power_below_the_plan() -> None:
    controller, estimator, jobs = _setup(3)
    # 5,000 s of work at top clocks each: pressures 5/6 and 5/12; no deadline: 0.5
    jobs.deadline_s[:] = [NOW_S + 6000.0, NOW_S + 12000.0, np.nan]
    assert controller.cut_order(estimator, jobs, NOW_S, None).tolist() == [1, 2, 0]
    lowest = controller.lowest_power_w(estimator, jobs)
    top = controller.step(estimator, jobs, NOW_S, 1e6).job_power_w
    assert np.all(lowest < top) and np.all(lowest > 0)
