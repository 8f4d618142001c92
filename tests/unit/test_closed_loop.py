"""Golden closed-loop runs: simulated GPUs (calibrated plant) + RLS + economic MPC."""

from __future__ import annotations

import numpy as np
import pytest

from slurm_cdgpc.control.dual import StepStatus
from slurm_cdgpc.model.estimator import EstimatorSettings
from slurm_cdgpc.sim.closed_loop import ClosedLoop, IntervalRecord, synthetic_fleet


def _run(
    seed: int, family: str = "bent", jobs: int = 120, intervals: int = 50
) -> list[IntervalRecord]:
    rng = np.random.default_rng(seed)
    fleet = synthetic_fleet(jobs, rng)
    p_max = fleet.max_power_w()
    loop = ClosedLoop(fleet, rng, estimator_settings=EstimatorSettings(family=family))
    # the admin lowers the budget half-way through
    return [loop.step((0.7 if k < intervals // 2 else 0.58) * p_max) for k in range(intervals)]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_power_holds_within_one_percent_of_the_budget_where_it_binds(seed: int) -> None:
    records = _run(seed)
    change = len(records) // 2
    # settled intervals: past a 5-interval warm-up from a cold start (the paper scored steps
    # 20-119) and past the four after the budget drop, where the controller deliberately
    # lands low while its models learn the new clocks (the exploration margin: with the
    # pressure floor, jobs far from their deadlines ran well above the new clocks, and on
    # seed 1 the plan four intervals on holds back 1.4 % for the jobs it moves down)
    settled = [
        r
        for k, r in enumerate(records)
        if k >= 5 and not change <= k < change + 4 and r.status is StepStatus.BINDING
    ]
    assert len(settled) >= 40
    errors = np.array([r.error_pct for r in settled])
    assert np.all(np.abs(errors) < 1.0), errors
    assert np.mean(np.abs(errors)) < 0.6
    # never over the budget by more than 1 %, the cold start and the budget drop included
    assert max(r.error_pct for r in records) < 1.0


def test_cold_start_is_safe() -> None:
    # nothing is known about any job in the first interval: every one is counted at its limit
    first = _run(4, intervals=2)[0]
    assert first.power_w <= first.budget_w


def test_same_seed_same_run() -> None:
    a = [(r.power_w, r.price) for r in _run(5, intervals=8)]
    b = [(r.power_w, r.price) for r in _run(5, intervals=8)]
    assert a == b


def test_bent_model_predicts_the_plant_better_than_the_linear_one() -> None:
    def prediction_error(family: str) -> float:
        recs = _run(6, family=family, intervals=30)[5:]
        return float(np.mean([abs(r.predicted_w - r.power_w) / r.power_w for r in recs]))

    assert prediction_error("bent") < prediction_error("linear")
