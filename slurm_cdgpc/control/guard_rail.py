"""The power-limit guard rail: each controlled GPU's power limit, set under its planned clocks.

The clocks are the lever; the limit only catches a model that under-predicts, within the
firmware's ~1 s instead of the next interval. Per job j on g_j GPUs with planned power P_j (all
its GPUs, `Decision.job_power_w`) and margin m:

    L_j = clip(P_j / g_j · (1 + m), L_min, L_default)

never above the board's default limit (the rail only tightens what the board boots with) and
never below its minimum. The head (`slurm_cdgpc.coordinator.jobs.RunningJobs.setpoints`) and the
closed loop (`slurm_cdgpc.sim.closed_loop`) both take it from here; the agent clips it again into
the board it actually has.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.families import FloatArray


def power_limits_w(
    job_power_w: npt.ArrayLike,
    gpus: npt.ArrayLike,
    margin: float,
    min_w: npt.ArrayLike,
    default_w: npt.ArrayLike,
) -> FloatArray | None:
    """Per job, the power limit of each of its GPUs (W); None when the rail is off (margin 0).

    A job whose planned power is not finite gets its board's default limit."""
    if not margin >= 0:
        raise InputError(f"the power-limit margin must be at least 0, got {margin}")
    if margin == 0:
        return None
    power = np.asarray(job_power_w, dtype=np.float64)
    lo = np.broadcast_to(np.asarray(min_w, dtype=np.float64), power.shape)
    hi = np.broadcast_to(np.asarray(default_w, dtype=np.float64), power.shape)
    # L_j = clip(P_j / g_j · (1 + m), L_min, L_default)
    per_gpu = power / np.maximum(np.asarray(gpus, dtype=np.float64), 1.0) * (1.0 + margin)
    per_gpu = np.where(np.isfinite(per_gpu), per_gpu, hi)
    return np.clip(per_gpu, lo, np.maximum(lo, hi))
