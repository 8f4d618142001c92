"""How far the cluster's draw has run over its whole plan (`Overdraw`): what sizes the guard band.

The plan expects the cluster to draw Σ P_plan (1 + δ) + P_uncontrolled. What it drew instead
differs for every reason the plan could not see: models off, jobs not yet measured, serving
jobs following their load, tenants that came or went, jobs that started since, the power
outside the plan moving. The guard band must cover the part that lands over the plan; the
c/√N rule guesses it from the job count, this measures it. The controller sizes its band on it
with ``guard_tail`` above 0 (`ControllerSettings`, 0.005 by default), together with each job's
own offset (``offset_per_job``), without which it let the head go far over on bursts of large
jobs (DESIGN.md, "Controller", Budget).

The controller's math: never reaches `store/`, `transport/`, `agent/`, `coordinator/` or `cli/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Controller" (2, Budget); tests:
`tests/unit/test_control_overdraw.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from slurm_cdgpc.errors import InputError


@dataclass(frozen=True)
class ClusterDraw:
    """One interval of the cluster against the plan in force over it."""

    #: what every GPU under the budget drew over the interval, W (jobs that ended or started
    #: within it included)
    drawn_w: float
    #: what that plan expected them to draw (`Decision.expected_w`)
    expected_w: float
    #: the budget it was planned under (`Decision.budget_w`)
    budget_w: float


class Overdraw:
    """The last ``window`` intervals' over-draw, each as a share of the budget it was planned
    under: (drawn − expected) / B, where ``expected`` is the whole plan's expectation.

    `quantile` is a quantile of them once ``min_intervals`` are known (None before): the guard
    band that keeps the intervals over it by more than a margin to a share of them.
    """

    def __init__(self, window: int = 1000, min_intervals: int = 100) -> None:
        if window < 1 or not 1 <= min_intervals <= window:
            raise InputError(f"over-draw window {window} with minimum {min_intervals} is not valid")
        self.window = window
        self.min_intervals = min_intervals
        self._over = np.zeros(window)
        self._count = 0

    def observe(self, draw: ClusterDraw) -> None:
        """One interval (a reading that is not a number, or no budget, teaches nothing)."""
        if not (math.isfinite(draw.drawn_w) and math.isfinite(draw.expected_w)):
            return
        if not (math.isfinite(draw.budget_w) and draw.budget_w > 0):
            return
        over = (draw.drawn_w - draw.expected_w) / draw.budget_w
        self._over[self._count % self.window] = over
        self._count += 1

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile of the window's over-draw; None until ``min_intervals`` are known."""
        n = min(self._count, self.window)
        if n < self.min_intervals:
            return None
        return float(np.quantile(self._over[:n], q))
