"""Serving jobs (`serving_floor`): the lowest clock that keeps a latency objective, with a margin.

A serving job declares an objective, a latency at a percentile (``slo=p99:250ms``), and reports
its measured latency at that percentile; the head's time model of the job learns that latency
against the clock (its "iteration" is a request at the percentile). It has no deadline: it gets
no pressure, and its clock range collapses to one level, its floor, so the power it does not
need goes to the training jobs' deadlines. Each interval, with target τ = (1 − margin) × the
objective, from its last floor x_f (the top clock, or the model's floor x̂ once it is measured,
for a job that has none):

- a latency p over τ, measured at clock x_a: up at once, to the highest of x_f, x_a · p / τ
  (exact where latency scales with 1/clock, the most a latency ever needs) and one step above
  x_a;
- within τ, measured at x_f or below: one step down. Measured above x_f, it says nothing of
  x_f yet: the clock a plan sets is read at the next exchange and its latency reported at the
  one after, two intervals later, and stepping down on older news made the clock swing
  between two descents, one for odd intervals and one for even;
- no latency in the interval: x_f;
- snapped up to a supported clock.

x̂ is the lowest clock at which the learnt latency b_c/x + b_m/x_m + b_e is at most τ.

The measurement leads, not the model: fitted on the few clocks the job has run at, with its
start-up's slow requests among them, the model cannot tell a decode-bound latency (flat in
the clock) from a compute-bound one, and trusting it either stops the descent or sends the
clock up for nothing. The model keeps the job's floor when its reports stop, and after a
restart of the head (the models are stored).

An objective missed at the top clock is reported (`ServingPlan.unmet`), never dropped. When the
budget cannot hold every serving floor with every other job at its lowest clock, floors give
way, those that cost the most power over their lowest clock first, until the rest fit: the
fewest objectives missed (`give_way`). The controller's math: never reaches `store/`,
`transport/`, `agent/`, `coordinator/` or `cli/` (`tests/unit/test_import_graph.py`). Design:
DESIGN.md, "Serving jobs"; tests: `tests/unit/test_control_serving.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from slurm_cdgpc.model.families import FloatArray
from slurm_cdgpc.model.rls import BoolArray

IntArray = NDArray[np.int64]


@dataclass(frozen=True)
class ServingPlan:
    """Per job (N,): its floor, normalised (NaN: not a serving job), whether its objective
    was missed at the top clock in the interval just measured, and whether its floor gave way
    to the budget (`give_way`)."""

    floor_x: FloatArray
    unmet: BoolArray
    gave_way: BoolArray

    @property
    def serving(self) -> BoolArray:
        served: BoolArray = np.isfinite(self.floor_x)
        return served


def serving_floor(
    objective_s: FloatArray,
    time_theta: FloatArray,
    measured_count: NDArray[np.integer],
    mem_term: FloatArray,
    x_lo: FloatArray,
    x_hi: FloatArray,
    x_applied: FloatArray | None,
    latency_s: FloatArray | None,
    last_x: FloatArray,
    margin: float,
    step: float,
) -> ServingPlan:
    """The floors (`ServingPlan`) before snapping to supported clocks.

    ``objective_s``: (N,) each job's objective, NaN for jobs that do not serve; ``time_theta``
    (N, 3) and ``measured_count`` (N,): the time models and how many latencies each has seen;
    ``mem_term``: b_m / x_m at the memory clock the job runs (0 on HBM parts); ``x_lo``,
    ``x_hi``: the job's clock range; ``x_applied``, ``latency_s``: the clock each ran at and
    the latency it reported in the last interval (NaN: none); ``last_x``: each job's last
    floor (NaN: none yet).
    """
    serving = np.isfinite(objective_s)
    target = (1.0 - margin) * objective_s
    b_c, b_e = time_theta[:, 0], time_theta[:, 2]
    room = target - mem_term - b_e
    with np.errstate(divide="ignore", invalid="ignore"):
        model = np.where((room > 0) & (measured_count > 0), b_c / room, x_hi)
    last = np.where(np.isfinite(last_x), last_x, np.nan_to_num(model, nan=np.inf))
    floor = np.clip(last, x_lo, x_hi)
    unmet = np.zeros(objective_s.shape, dtype=bool)
    if x_applied is not None and latency_s is not None:
        seen = serving & np.isfinite(x_applied) & np.isfinite(latency_s) & (latency_s > 0)
        x_a = np.where(seen, x_applied, x_hi)
        p = np.where(seen, latency_s, 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            over = seen & (p > target)
            up = np.maximum(x_a * p / np.where(target > 0, target, np.nan), x_a + step)
        # at the floor: within a percent, as a board reads back the clock it was locked at
        current = seen & ~over & (x_a <= floor * 1.01)
        chosen = np.where(over, np.maximum(floor, up), np.where(current, floor - step, floor))
        floor = np.clip(np.nan_to_num(chosen, nan=np.inf), x_lo, x_hi)
        unmet = seen & (p > objective_s) & (x_a >= x_hi * (1.0 - 1e-9))
    return ServingPlan(np.where(serving, floor, np.nan), unmet, np.zeros(serving.shape, bool))


def give_way(floor_w: FloatArray, lowest_w: FloatArray, excess_w: float) -> IntArray:
    """The serving jobs whose floors give way for the budget to hold, by the stated rule: most
    power over their lowest clock first, until ``excess_w`` is covered (all, if it cannot
    be). ``floor_w``, ``lowest_w``: (S,) each serving job's power at its floor and at its
    lowest clock. Returns indices into them."""
    saving = np.maximum(floor_w - lowest_w, 0.0)
    order = np.argsort(-saving, kind="stable")
    covered = np.cumsum(saving[order])
    count = int(np.searchsorted(covered, excess_w, side="left")) + 1
    taken: IntArray = order[: min(count, order.size)].astype(np.int64)
    return taken[saving[taken] > 0]
