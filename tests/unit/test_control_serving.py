"""Serving jobs: the lowest clock that keeps the latency objective, and the power they leave."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from slurm_cdgpc.control.discrete import ClockGrid
from slurm_cdgpc.control.empc import Decision, EconomicMPC, JobState, Measurements
from slurm_cdgpc.control.guard_rail import power_limits_w
from slurm_cdgpc.control.serving import give_way, serving_floor
from slurm_cdgpc.control.tenancy import Tenancy
from tests.unit.problems import A100, a100_estimator

TOP_MHZ = 1410.0
GRID = ClockGrid.from_tables([("A100", A100)], min_fraction=0.5)
NAN = float("nan")


def _floor(**kw: object) -> np.ndarray:
    args: dict[str, object] = {
        "objective_s": np.array([0.25]),
        "time_theta": np.array([[0.01, 0.0, 0.1]]),
        "measured_count": np.array([5]),
        "mem_term": np.zeros(1),
        "x_lo": np.array([0.5]),
        "x_hi": np.ones(1),
        "x_applied": None,
        "latency_s": None,
        "last_x": np.array([NAN]),
        "margin": 0.1,
        "step": 0.05,
    }
    args.update(kw)
    return serving_floor(**args).floor_x  # type: ignore[arg-type]


def test_the_floor_starts_from_the_model_and_follows_the_measured_latency() -> None:
    # no floor yet: the model's, 0.01/x + 0.1 ≤ 0.225 from x = 0.08: the job's lowest clock
    assert _floor() == pytest.approx([0.5])
    assert _floor(measured_count=np.array([0])) == pytest.approx([1.0])  # unmeasured: top
    last = {"last_x": np.array([0.9])}
    assert _floor(**last) == pytest.approx([0.9])  # no news: it stays
    # within target at its floor: one step down, whatever the model says
    seen = {"x_applied": np.array([0.9]), "latency_s": np.array([0.2]), **last}
    assert _floor(**seen) == pytest.approx([0.85])
    steep = np.array([[0.11, 0.0, 0.1]])  # 0.11/x + 0.1 ≤ 0.225 from x = 0.88
    assert _floor(time_theta=steep, **seen) == pytest.approx([0.85])
    # ... but measured above it (the plan before the last), it waits for news of the floor
    stale = {**seen, "x_applied": np.array([0.95])}
    assert _floor(**stale) == pytest.approx([0.9])
    # over target at 0.7: up at once, at least as latency ∝ 1/clock needs, 0.7 × 0.25 / 0.225
    over = {"x_applied": np.array([0.7]), "latency_s": np.array([0.25])}
    assert _floor(last_x=np.array([0.7]), **over) == pytest.approx([0.7 * 0.25 / 0.225])
    assert _floor(last_x=np.array([0.7]), time_theta=steep, **over) == pytest.approx(
        [0.7 * 0.25 / 0.225]  # not the model's 0.88
    )
    assert _floor(last_x=np.array([0.9]), **over) == pytest.approx([0.9])  # never down
    assert np.isnan(_floor(objective_s=np.array([NAN]))).all()  # not a serving job


def test_an_objective_missed_at_the_top_clock_is_reported() -> None:
    plan = serving_floor(
        np.array([0.25, 0.25]),
        np.array([[0.01, 0.0, 0.3], [0.01, 0.0, 0.1]]),
        np.array([5, 5]),
        np.zeros(2),
        np.full(2, 0.5),
        np.ones(2),
        np.array([1.0, 0.9]),
        np.array([0.31, 0.3]),
        np.array([1.0, 0.9]),
        0.1,
        0.05,
    )
    assert plan.unmet.tolist() == [True, False]  # the second can still go up
    assert plan.floor_x.tolist() == [1.0, 1.0]


def test_floors_give_way_most_power_first_until_the_rest_fit() -> None:
    floor_w = np.array([300.0, 500.0, 200.0])
    lowest_w = np.array([200.0, 250.0, 150.0])
    assert give_way(floor_w, lowest_w, 100.0).tolist() == [1]  # one objective, not two
    assert give_way(floor_w, lowest_w, 300.0).tolist() == [1, 0]
    assert sorted(give_way(floor_w, lowest_w, 1e4).tolist()) == [0, 1, 2]


def _power_w(x: np.ndarray) -> np.ndarray:
    return 80.0 + 220.0 * np.maximum(x, x**3 / 0.77**2) / (1 / 0.77**2)


def _truth_s(x: np.ndarray) -> np.ndarray:
    """Two training jobs (0.5 s an iteration at top, compute-bound) and a decode-heavy serving
    job whose p99 is nearly flat in the clock: 0.15 s + 0.03 s / x."""
    return np.array([0.5 / x[0], 0.5 / x[1], 0.15 + 0.03 / x[2]])


def _run(
    jobs: JobState, budget_w: float | list[float], steps: int
) -> tuple[list[np.ndarray], list[np.ndarray], Decision]:
    est, mpc = a100_estimator([1, 1, 1]), EconomicMPC(GRID)
    budgets = budget_w if isinstance(budget_w, list) else [budget_w] * steps
    clocks, latencies, measured = [], [], None
    for k in range(steps):
        d = mpc.step(est, jobs, 30.0 * k, budgets[k], measured=measured)
        x = d.graphics_mhz / TOP_MHZ
        seen = _truth_s(x)
        clocks.append(d.graphics_mhz)
        latencies.append(seen)
        measured = Measurements(
            graphics_mhz=d.graphics_mhz.astype(np.float64),
            memory_mhz=np.full(3, 1593.0),
            power_w=_power_w(x),
            iteration_s=seen,
            planned_power_w=d.planned_power_w,
        )
    return clocks, latencies, d


def _jobs(objective_s: float) -> JobState:
    return JobState(
        gpu_type=np.zeros(3, dtype=np.int64),
        remaining_iterations=np.array([4000.0, 4000.0, NAN]),
        deadline_s=np.array([3000.0, 3000.0, NAN]),
        objective_s=np.array([NAN, NAN, objective_s]),
    )


def test_a_serving_job_comes_down_to_its_floor_and_keeps_its_objective() -> None:
    """Under a budget that binds, the serving job walks down from its top clock, never
    missing its 250 ms objective, to where its decode-bound latency allows; the power it
    leaves goes to the training jobs."""
    clocks, latencies, _ = _run(_jobs(0.25), budget_w=700.0, steps=25)
    serving = np.array([c[2] for c in clocks])
    assert serving[0] == TOP_MHZ  # unmeasured: top
    assert serving[-1] <= 0.65 * TOP_MHZ  # down where 0.15 + 0.03/x stays well within
    assert max(lat[2] for lat in latencies) <= 0.25
    assert np.all(np.diff(serving) >= -0.05 * TOP_MHZ - 15)  # one step an interval at most
    training = np.array([c[0] for c in clocks])
    assert training[-1] > training[0]  # the serving job's power went to them


def test_a_tight_objective_keeps_its_clock_and_a_missed_one_is_reported() -> None:
    clocks, latencies, _ = _run(_jobs(0.2), budget_w=700.0, steps=15)
    assert max(lat[2] for lat in latencies) <= 0.2
    assert clocks[-1][2] >= 0.6 * TOP_MHZ  # 0.15 + 0.03/x ≤ 0.18 needs x ≥ 1
    _, _, d = _run(_jobs(0.1), budget_w=700.0, steps=2)
    assert d.serving is not None and d.serving.unmet.tolist() == [False, False, True]


def test_floors_give_way_when_the_budget_cannot_hold_them() -> None:
    # measured, then a budget the training jobs at their lowest clocks and the serving job
    # at its (top) floor do not fit in
    clocks, _, d = _run(_jobs(0.25), budget_w=[900.0] * 4 + [480.0], steps=5)
    assert d.serving is not None and d.serving.gave_way.tolist() == [False, False, True]
    assert d.graphics_mhz[2] < clocks[-2][2]
    assert d.predicted_power_w <= d.effective_budget_w * (1 + 1e-9)


def test_a_serving_tenant_holds_its_gpu_at_least_at_its_floor() -> None:
    """A serving job sharing a GPU with a training job: the GPU's clock is at least the
    serving floor, and above it when the training tenant's pressure pays for it."""
    jobs = replace(_jobs(0.25), tenancy=Tenancy.of_gpus([["a0"], ["a1"], ["a1"]]))
    clocks, latencies, _ = _run(jobs, budget_w=700.0, steps=15)
    assert all(c[1] == c[2] for c in clocks)
    assert max(lat[2] for lat in latencies) <= 0.25


def test_a_serving_jobs_draw_teaches_no_offset_and_meets_no_guard_rail() -> None:
    """A serving job draws what its load asks, not what its plan said: its burst is no model
    error, and a power limit at a quiet interval's plan would clip the next burst."""
    est, mpc = a100_estimator([1, 1, 1]), EconomicMPC(GRID)
    jobs = _jobs(0.25)
    measured = None
    for k in range(4):  # settled models, drawing as planned
        d = mpc.step(est, jobs, 30.0 * k, 700.0, measured=measured)
        x = d.graphics_mhz / TOP_MHZ
        drawn = _power_w(x)
        if k == 3:
            drawn[2] *= 2.0  # the serving job's burst
        measured = Measurements(
            d.graphics_mhz.astype(np.float64),
            np.full(3, 1593.0),
            drawn,
            _truth_s(x),
            planned_power_w=d.planned_power_w,
        )
    before = mpc.offset
    mpc.step(est, jobs, 120.0, 700.0, measured=measured)
    assert abs(mpc.offset - before) < 0.01
    limits = power_limits_w([150.0, 150.0], [1, 1], 0.1, [100.0] * 2, [400.0] * 2, [False, True])
    assert limits is not None and limits.tolist() == pytest.approx([165.0, 400.0])
