"""Metric definitions on hand-built replays."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.sim.cluster import SimulationResult
from slurm_cdgpc.sim.metrics import compute_metrics, slowdown

NAN = np.nan


def _result(
    finish: list[float],
    power: list[float],
    demand: list[float],
    policy: str = "p",
) -> SimulationResult:
    # four jobs: submit 0, 0, 100, 100; durations 100, 200, 100, 50;
    # deadlines 150 (feasible), 150 (infeasible: 0 + 200 > 150), none, 120 (infeasible)
    return SimulationResult(
        policy=policy,
        fleet="1x8:A100-SXM4-80GB",
        fleet_gpus=8,
        budget_w=1000.0,
        interval_s=60.0,
        submit_s=np.array([0.0, 0.0, 100.0, 100.0]),
        duration_s=np.array([100.0, 200.0, 100.0, 50.0]),
        deadline_s=np.array([150.0, 150.0, NAN, 120.0]),
        num_gpu=np.array([1, 1, 1, 1]),
        start_s=np.array([0.0, 0.0, 100.0, 100.0]),
        finish_s=np.array(finish),
        rejected=np.zeros(4, dtype=bool),
        t_s=np.arange(len(power)) * 60.0,
        power_w=np.array(power),
        demand_w=np.array(demand),
        controller_s=np.array([0.001, 0.003, 0.002, 0.004][: len(power)]),
        energy_j=3.6e6,
        wall_s=0.0,
    )


def test_deadline_metrics_by_hand() -> None:
    reference = _result([100.0, 200.0, 200.0, 150.0], [900.0] * 4, [900.0] * 4, "max-clock")
    # job 0 now misses (150 < 160): induced; job 1 missed in the reference too; job 3 misses
    # in both; job 2 has no deadline
    mine = _result([160.0, 210.0, 400.0, 160.0], [900.0] * 4, [900.0] * 4)
    m = compute_metrics(mine, reference)
    assert (m.deadline_jobs, m.violations, m.violations_induced) == (3, 3, 1)
    assert m.dvr == pytest.approx(1.0)
    assert m.dvr_induced == pytest.approx(1 / 3)
    assert (m.feasible_jobs, m.violations_feasible) == (1, 1)
    assert m.mean_jct_s == pytest.approx((160 + 210 + 300 + 60) / 4)
    assert m.makespan_s == pytest.approx(400.0)
    assert m.energy_kwh == pytest.approx(1.0)
    assert m.controller_ms_p50 == pytest.approx(2.5)
    assert compute_metrics(mine).violations_induced is None


def test_power_metrics_count_only_binding_intervals() -> None:
    # budget 1000 W; intervals: binding 980 (2 %), binding 1030 (3 %, over by > 1 %),
    # binding 1005 (0.5 %, within tolerance), not binding 500 (ignored by the MAE)
    r = _result(
        [100.0, 200.0, 200.0, 150.0], [980.0, 1030.0, 1005.0, 500.0], [1500, 1500, 1500, 900]
    )
    m = compute_metrics(r)
    assert m.binding_intervals == 3
    assert m.power_mae_pct == pytest.approx((2.0 + 3.0 + 0.5) / 3)
    assert m.over_budget_intervals_pct == pytest.approx(25.0)
    assert m.max_overshoot_pct == pytest.approx(3.0)


def test_never_binding_has_no_mae_and_negative_overshoot() -> None:
    r = _result([100.0, 200.0, 200.0, 150.0], [500.0, 600.0], [700.0, 800.0])
    m = compute_metrics(r)
    assert m.power_mae_pct is None
    assert m.max_overshoot_pct == pytest.approx(-40.0)


def test_unfinished_deadline_job_is_a_violation_and_slowdown_skips_it() -> None:
    r = _result([100.0, NAN, 200.0, 150.0], [900.0], [900.0])
    m = compute_metrics(r)
    assert m.finished == 3
    assert m.violations == 2  # job 1 never finished, job 3 late (150 > 120)
    np.testing.assert_allclose(slowdown(r), [1.0, 1.0, 1.0])


def test_reference_of_another_trace_is_refused() -> None:
    r = _result([100.0, 200.0, 200.0, 150.0], [900.0], [900.0])
    other = SimulationResult(**{**r.__dict__, "submit_s": np.zeros(3)})
    with pytest.raises(InputError):
        compute_metrics(r, other)


def test_deadline_outcomes_are_reported_per_job_class() -> None:
    r = replace(
        _result([100.0, 300.0, 200.0, 160.0], [1000.0], [1200.0]),
        job_type=np.array(["strict", "soft", "best-effort", "strict"]),
    )
    ref = replace(
        _result([100.0, 140.0, 200.0, 110.0], [1000.0], [1200.0], policy="max-clock"),
        job_type=r.job_type,
    )
    by_type = compute_metrics(r, ref).by_job_type
    # job 0 meets 150; job 3 (strict) misses 120 at 160 but met it at max clocks: induced;
    # job 1 (soft) misses 150 at 300 and met it at 140: induced; job 2 has no deadline
    assert by_type == {
        "best-effort": {"jobs": 1, "deadline_jobs": 0, "violations": 0, "violations_induced": 0},
        "soft": {"jobs": 1, "deadline_jobs": 1, "violations": 1, "violations_induced": 1},
        "strict": {"jobs": 2, "deadline_jobs": 2, "violations": 1, "violations_induced": 1},
    }
    assert (
        compute_metrics(_result([100.0, 300.0, 200.0, 160.0], [1000.0], [1200.0])).by_job_type == {}
    )
