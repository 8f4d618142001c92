"""How much of its Slurm time limit a job's work takes, learned from the jobs that ended.

The controller's math: never reaches `store/`, `transport/`, `agent/`, `coordinator/` or `cli/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Controller" (1, Weights: work from the
time limit) and "Progress"; tests: `tests/unit/test_control_empc.py`.
"""

from __future__ import annotations

import numpy as np

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.families import FloatArray


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
