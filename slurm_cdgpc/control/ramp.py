"""Ramp limits (`Ramp`) and the emergency cut's choice of jobs (`emergency_cut`): the two rules
about how fast the cluster's power may move. Ramp limits are soft (the plan of one step bounded
by where the power was and where a scheduled limit will be); a limit in force is hard, and a
measured excess over it is cut at once, before the controller re-plans.
The controller's math: never reaches `store/`, `transport/`, `agent/`, `coordinator/` or `cli/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Ramp limits and the emergency cut";
tests: `tests/unit/test_control_ramp.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.families import FloatArray

IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]


@dataclass(frozen=True)
class ScheduledLimit:
    """A limit that takes effect later: at ``at_s``, ``limit_w`` for the cluster (``index`` 0)
    or for power domain ``index`` − 1 (`DomainLimits`' order)."""

    at_s: float
    index: int
    limit_w: float


@dataclass(frozen=True)
class Ramp:
    """What the ramp rule needs for one step: per limit (the cluster's budget first, then each
    power domain in `DomainLimits`' order) its ramp rate in W/s (``inf``: none) and what its
    GPUs drew over the last interval (NaN: not measured yet), and the limits scheduled after now.
    """

    rate_w_per_s: FloatArray
    last_w: FloatArray
    ahead: Sequence[ScheduledLimit] = ()

    def __post_init__(self) -> None:
        if self.rate_w_per_s.shape != self.last_w.shape or self.rate_w_per_s.ndim != 1:
            raise InputError("a ramp needs one rate and one last power per limit")
        if np.any(~(self.rate_w_per_s > 0)):
            raise InputError("every ramp rate must be a positive number of W/s (inf: none)")

    def caps_w(self, limit_w: FloatArray, now_s: float, interval_s: float) -> FloatArray:
        """Each limit for this step's plan, the ramp applied (never above the limit in force):

        - up: at most what it drew over the last interval plus one interval at its rate, so a
          budget raised, or a burst of jobs starting, moves the plan up no faster than the rate;
        - ahead: a lower limit L scheduled at ``t`` must hold in the step that is running at
          ``t``, and the power may fall at the rate only, so this step (now to now + Δt) plans
          at most L + r · max(t − now − Δt, 0): L itself once ``t`` falls within it, and each
          step before it at most r times the time between their starts above the next. A
          scheduled drop is met on time, approached at the rate however the steps are spaced.

        A plan falls no faster than the limits make it: with no energy term, every job already
        runs as fast as the caps let it, and nothing draws power to hold the plan up when jobs
        end. A limit that drops now, by more than the rate allows, is met at once (the limit is
        hard), and the measured excess is the emergency cut's (`emergency_cut`)."""
        if limit_w.shape != self.rate_w_per_s.shape:
            raise InputError(f"{self.rate_w_per_s.size} ramp rates for {limit_w.size} limits")
        caps = limit_w.astype(np.float64)
        rate = self.rate_w_per_s
        ramped = np.isfinite(rate) & np.isfinite(self.last_w)
        caps[ramped] = np.minimum(caps[ramped], self.last_w[ramped] + rate[ramped] * interval_s)
        for change in self.ahead:
            ahead_s = change.at_s - now_s
            if ahead_s < 0 or not 0 <= change.index < caps.size:
                continue  # in force already (the limit itself), or a domain no longer planned
            early_s = max(ahead_s - interval_s, 0.0)
            room_w = 0.0 if early_s == 0 else float(rate[change.index]) * early_s
            caps[change.index] = min(caps[change.index], change.limit_w + room_w)
        return caps


def emergency_cut(
    excess_w: FloatArray,
    domain: IntArray,
    job_row: IntArray,
    share: FloatArray,
    saving_w: FloatArray,
    order: IntArray,
) -> BoolArray:
    """The jobs to send to their lowest clocks at once: ``excess_w`` (1+D,) is what the cluster
    (index 0) and each power domain drew over its limit, ``(domain, job_row, share)`` each job's
    place under them (domain indices 1-based, as ``excess_w``'s; every job is under the cluster
    with share 1 without a triple), ``saving_w`` (N,) what each job would shed at its lowest
    clocks, ``order`` the jobs by priority, the first cut first (lowest deadline pressure first).

    A job is cut when it sheds power under a limit still over; cutting stops once no limit is
    over. Every job under a limit that its jobs cannot bring back at their lowest clocks is cut
    (that limit then needs more than clocks: its excess stays, and the caller says so)."""
    n = saving_w.size
    left = excess_w.astype(np.float64).copy()
    cut = np.zeros(n, dtype=bool)
    members: list[list[tuple[int, float]]] = [[(0, 1.0)] for _ in range(n)]
    for d, row, s in zip(domain.tolist(), job_row.tolist(), share.tolist(), strict=True):
        members[row].append((d, s))
    for row in order.tolist():
        if not np.any(left > 0):
            break
        if saving_w[row] <= 0 or not any(left[d] > 0 for d, _ in members[row]):
            continue
        cut[row] = True
        for d, s in members[row]:
            left[d] -= s * saving_w[row]
    return cut
