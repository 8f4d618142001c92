"""The power-limit guard rail: each controlled GPU's power limit, set under its planned clocks.

The head (`slurm_cdgpc.coordinator.jobs.RunningJobs.setpoints`) and the closed loop
(`slurm_cdgpc.sim.closed_loop`) take it from here. The controller's math: never reaches `store/`,
`transport/`, `agent/`, `coordinator/` or `cli/` (`tests/unit/test_import_graph.py`). Design:
DESIGN.md, "Boards" (The power-limit guard rail); tests: `tests/faults/test_guard_rail.py`.
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
    free: npt.ArrayLike | None = None,
    held: npt.ArrayLike | None = None,
) -> FloatArray | None:
    """Per job, the power limit of each of its GPUs (W); None when the rail is off (margin 0)
    and no job is ``held``.

    For job j on g_j GPUs with planned power P_j (all its GPUs, `Decision.job_power_w`) and
    margin m, L_j = clip(P_j / g_j · (1 + m), L_min, L_default): never above the board's default
    limit (the rail only tightens what the board boots with), never below its minimum, and the
    board's default for a job whose planned power is not finite. The clocks are the lever; the
    limit only catches a model that under-predicts, within the firmware's ~1 s averaging window
    instead of the next interval. The agent clips it again into the board it actually has.

    Jobs ``free`` of it (serving jobs) keep the board's default: their draw follows their
    load, not the plan, and a limit at a quiet interval's plan would clip the next burst and
    miss the objective the floor was chosen for.

    Jobs ``held`` (`Decision.held`: not yet measured, counted at a share of their limit) get
    L_j = P_j / g_j, margin or not, rail on or off: the plan counts them at exactly that."""
    if not margin >= 0:
        raise InputError(f"the power-limit margin must be at least 0, got {margin}")
    hold = None if held is None else np.asarray(held, dtype=bool)
    if margin == 0 and (hold is None or not hold.any()):
        return None
    power = np.asarray(job_power_w, dtype=np.float64)
    lo = np.broadcast_to(np.asarray(min_w, dtype=np.float64), power.shape)
    hi = np.broadcast_to(np.asarray(default_w, dtype=np.float64), power.shape)
    # L_j = clip(P_j / g_j · (1 + m), L_min, L_default); a held job's without the margin
    planned = power / np.maximum(np.asarray(gpus, dtype=np.float64), 1.0)
    per_gpu = planned * (1.0 + margin) if margin > 0 else np.full(power.shape, np.inf)
    if hold is not None:
        per_gpu = np.where(hold, planned, per_gpu)
    per_gpu = np.where(np.isfinite(per_gpu), per_gpu, hi)
    if free is not None:
        per_gpu = np.where(np.asarray(free, dtype=bool), hi, per_gpu)
    return np.clip(per_gpu, lo, np.maximum(lo, hi))
