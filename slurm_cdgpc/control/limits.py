"""What the controller learns from jobs as they come and go: how much of its Slurm time limit a
job's work takes (`LimitShare`), and how much of its power limit a new job draws (`NewJobShare`).

The controller's math: never reaches `store/`, `transport/`, `agent/`, `coordinator/` or `cli/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Controller" (1, Weights: work from the
time limit; 2, Budget: a job not yet measured) and "Progress"; tests:
`tests/unit/test_control_empc.py`, `tests/unit/test_control_new_jobs.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.families import FloatArray
from slurm_cdgpc.model.rls import BoolArray


class LimitShare:
    """The ``quantile`` of the last ``window`` ended jobs' work over their time limit.

    A job that says no total needs at most its limit at top clocks; the controller sharpens that
    bound to `share`, a bound that held for ``quantile`` of the ended jobs (their work at top
    clocks over their limit). Until ``min_jobs`` have ended the share is 1, and the controller
    gives a job that has outlived it its whole limit.
    """

    def __init__(self, quantile: float, min_jobs: int = 20, window: int = 2000) -> None:
        if not 0.0 < quantile <= 1.0:
            raise InputError(f"the limit share quantile must be in (0, 1], got {quantile}")
        self.quantile = quantile
        self.min_jobs = min_jobs
        self.window = window
        self._shares = np.zeros(0)
        self.share = 1.0

    def observe(self, work_top_s: FloatArray, time_limit_s: FloatArray) -> None:
        """Jobs that ended, with the work they did (seconds at top clocks) and their limits
        (NaN: none, and not counted)."""
        known = np.isfinite(time_limit_s) & (time_limit_s > 0) & np.isfinite(work_top_s)
        if not known.any():
            return
        shares = np.clip(work_top_s[known] / time_limit_s[known], 0.0, 1.0)
        self._shares = np.concatenate([self._shares, shares])[-self.window :]
        if self.quantile < 1.0 and self._shares.size >= self.min_jobs:
            self.share = float(np.quantile(self._shares, self.quantile))


class NewJobShare:
    """Per kind of job (its GPU type, alone or joining co-tenants), the share of its power
    limit at which a job not yet measured is counted.

    A new job's power is unknown until its first reading; counted at its whole limit it books
    power it rarely draws, and on fleets of short jobs that budget goes unused. The share
    starts at ``initial`` (1: the whole limit). With ``quantile`` q below 1 the share is learned
    from each job's first reading y (its GPUs' power over their limit, at its top clock):
    after ``min_jobs`` readings of a kind it is their q quantile, and from then on each reading
    moves it by ``step`` · (1{y ≥ s} − (1 − q)), the stochastic-approximation quantile
    tracker, so that it follows a fleet whose jobs change. A reading held down by a power limit
    (the guard rail's, or the board's) counts as reaching the share: all it says is that the
    job would draw more. A learned share is a prior, as a power model is: the plan counts a
    new job at it and the offset, the emergency cut and the next reading correct it; about
    1 − q of new jobs draw more than they are counted at for their first interval.

    A fixed share below 1 (``quantile`` 1) is instead held (`holds`): the job's GPUs get that
    power limit until its first reading, so the count is a bound the firmware keeps.
    """

    def __init__(
        self, initial: float, quantile: float, min_jobs: int = 20, step: float = 0.02
    ) -> None:
        if not 0.0 < initial <= 1.0:
            raise InputError(f"a new job's power share must be in (0, 1], got {initial}")
        if not 0.0 < quantile <= 1.0:
            raise InputError(f"the new-job power quantile must be in (0, 1], got {quantile}")
        self.initial = initial
        self.quantile = quantile
        self.min_jobs = min_jobs
        self.step = step
        self._share: dict[str, float] = {}
        self._first: dict[str, list[float]] = {}

    @property
    def learning(self) -> bool:
        return self.quantile < 1.0

    @property
    def holds(self) -> bool:
        """Whether a new job is held at its share by a power limit: a fixed share below 1."""
        return self.initial < 1.0 and not self.learning

    def learned(self) -> dict[str, float]:
        """The share of each kind learned so far (none before ``min_jobs`` readings)."""
        return dict(self._share)

    def of(self, kinds: Sequence[str]) -> FloatArray:
        """(N,) the share of each job's kind."""
        return np.array([self._share.get(k, self.initial) for k in kinds], dtype=np.float64)

    def observe(self, kinds: Sequence[str], read: FloatArray, capped: BoolArray) -> None:
        """First readings: per job its kind, its power over its limit, and whether a power
        limit held it down (then it would have drawn more than it read)."""
        if not self.learning:
            return
        q = self.quantile
        for kind, y, held in zip(kinds, read.tolist(), capped.tolist(), strict=True):
            if not math.isfinite(y):
                continue
            first = self._first.get(kind)
            if first is not None or kind not in self._share:
                first = self._first.setdefault(kind, [])
                first.append(1.0 if held else min(y, 1.0))
                if len(first) >= self.min_jobs:
                    self._share[kind] = float(np.quantile(first, q))
                    del self._first[kind]
                continue
            s = self._share[kind]
            reached = held or y >= s
            s += self.step * ((1.0 if reached else 0.0) - (1.0 - q))
            self._share[kind] = min(max(s, self.step), 1.0)
