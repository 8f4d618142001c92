"""``bench guard-rail``: what the power-limit guard rail buys and costs in the closed loop.

The head's controller (shipped settings) drives a synthetic fleet on the calibrated plant
(`slurm_cdgpc.sim.closed_loop`) under a budget that binds. At interval ``step_at`` every job's
power jumps by ``bias`` (its models are that much low until RLS and the offset catch up). Each
margin (None: the rail off) runs the same seed twice, with and without the jump:

- ``worst_over_pct``: the worst interval's true power over the budget, % of the budget, from the
  jump on. The plant is steady within an interval and holds a limit as a 1 s average (as the
  firmware does), so an interval's mean is also its worst second, but for the ≤ 1 s after a
  change (`slurm_cdgpc.gpu.simulated`);
- ``over_s``: how long the power stayed above the budget from the jump on (whole intervals);
- ``clock_pct`` and ``speed_pct``: the steady-state cost without the jump, the GPU-weighted
  mean applied clock and job speed (top-clock iteration time over the actual one), % of the
  rail-off run's, over the intervals after ``warmup``; ``capped_pct``: share of jobs the
  limit held below their lock there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from slurm_cdgpc.config import ControlConfig
from slurm_cdgpc.control.tuning import Tuning, shipped
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.sim.closed_loop import ClosedLoop, synthetic_fleet


def _run(
    seed: int,
    jobs: int,
    intervals: int,
    budget_fraction: float,
    margin: float,
    bias: float,
    step_at: int,
) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    fleet = synthetic_fleet(jobs, rng)
    budget_w = budget_fraction * fleet.max_power_w()
    # the shipped controller with the rail at this margin, as cdgpcd builds it
    tuning = Tuning.from_config(ControlConfig(power_limit_margin=margin))
    loop = ClosedLoop(fleet, rng, tuning.controller, tuning.estimator, power_limit_margin=margin)
    over: list[float] = []
    clock: list[float] = []
    speed: list[float] = []
    capped: list[float] = []
    for k in range(intervals):
        if k == step_at:
            loop.power_scale = 1.0 + bias
        f = loop.fleet
        record = loop.step(budget_w)
        truth = loop.last_truth
        assert truth is not None
        over.append(record.error_pct)
        plant = f.plant()  # the jobs of this interval (finished ones leave after it)
        top = plant.step(plant.max_graphics_mhz)
        weight = f.gpus / f.gpus.sum()
        clock.append(float(np.sum(weight * truth.applied_mhz / plant.max_graphics_mhz)))
        speed.append(float(np.sum(weight * top.iteration_time_s / truth.iteration_time_s)))
        capped.append(float(np.mean(truth.power_capped)))
    return {"over": over, "clock": clock, "speed": speed, "capped": capped}


def bench_guard_rail(
    seed: int = 0,
    jobs: int = 120,
    intervals: int = 60,
    budget_fraction: float = 0.7,
    bias: float = 0.10,
    step_at: int = 20,
    warmup: int = 5,
    margins: Sequence[float | None] = (None, 0.02, 0.05, 0.10),
) -> dict[str, Any]:
    if not 0 <= warmup < step_at < intervals:
        raise InputError("need 0 <= warmup < step_at < intervals")
    interval_s = shipped().controller.interval_s
    base = _run(seed, jobs, intervals, budget_fraction, 0.0, 0.0, intervals)
    rows = []
    for margin in margins:
        m = 0.0 if margin is None else margin
        jumped = _run(seed, jobs, intervals, budget_fraction, m, bias, step_at)
        steady = _run(seed, jobs, intervals, budget_fraction, m, 0.0, intervals)
        after = np.asarray(jumped["over"][step_at:])
        window = slice(warmup, intervals)
        rows.append(
            {
                "margin": margin,
                "worst_over_pct": round(float(after.max()), 3),
                "over_s": float(np.sum(after > 0) * interval_s),
                "clock_pct": round(
                    100 * float(np.mean(steady["clock"][window]) / np.mean(base["clock"][window])),
                    3,
                ),
                "speed_pct": round(
                    100 * float(np.mean(steady["speed"][window]) / np.mean(base["speed"][window])),
                    3,
                ),
                "capped_pct": round(100 * float(np.mean(steady["capped"][window])), 2),
                "steady_worst_over_pct": round(float(np.max(steady["over"][window])), 3),
            }
        )
    return {
        "seed": seed,
        "jobs": jobs,
        "intervals": intervals,
        "interval_s": interval_s,
        "budget_fraction": budget_fraction,
        "bias": bias,
        "step_at": step_at,
        "rows": rows,
    }
