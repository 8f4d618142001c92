"""The power-limit guard rail: each controlled GPU's power limit, set under its planned clocks.

The head (`slurm_cdgpc.coordinator.jobs.RunningJobs.setpoints`) and the closed loop
(`slurm_cdgpc.sim.closed_loop`) take it from here. The controller's math: never reaches `store/`,
`transport/`, `agent/`, `coordinator/` or `cli/` (`tests/unit/test_import_graph.py`). Design:
DESIGN.md, "Boards" (The power-limit guard rail); tests: `tests/faults/test_guard_rail.py`.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from slurm_cdgpc.control.tenancy import Tenancy
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.estimator import JobEstimator
from slurm_cdgpc.model.families import FloatArray

#: η of a lever's gain (`limit_gain`): the share of the last interval's ratio it takes
LIMIT_GAIN_RATE: Final = 0.5
#: where a lever's gain stays: a reading of a job that ended or started within the interval
#: says little about the firmware
LIMIT_GAIN_RANGE: Final = (0.25, 1.5)
#: a lever GPU planned at its top clock is held this much above what its plan counts there,
#: not freed: a model learned under limits says least about the top clock
LEVER_TOP_MARGIN: Final = 0.05


def limit_gain(gain: npt.ArrayLike, drawn_w: npt.ArrayLike, limit_w: npt.ArrayLike) -> FloatArray:
    """Each job's lever gain after an interval: ρ ← ρ + η (P / L − ρ) where its GPUs drew P
    (mean per GPU) held at the limit L that was their setpoint (finite ``limit_w``: MIG mode,
    where the firmware said the limit held the clock), within `LIMIT_GAIN_RANGE`; the others
    keep theirs.

    A power limit holds the firmware's window, not the interval: a job that computes in bursts
    has its busy peaks held at L and draws well under L on the mean (a BERT-like job under a
    155 W limit draws 118 W in the plant). The limit that draws a planned mean P* is then P*/ρ
    (`power_limits_w`): an integral loop on the lever's gain, which settles where the GPU draws
    what the plan counts (ρ = P / L)."""
    rho = np.asarray(gain, dtype=np.float64).copy()
    drawn = np.asarray(drawn_w, dtype=np.float64)
    limit = np.asarray(limit_w, dtype=np.float64)
    seen = np.isfinite(drawn) & np.isfinite(limit) & (limit > 0)
    if seen.any():
        ratio = drawn[seen] / limit[seen]
        rho[seen] = np.clip(rho[seen] + LIMIT_GAIN_RATE * (ratio - rho[seen]), *LIMIT_GAIN_RANGE)
    return rho


def lever_state(
    estimator: JobEstimator, tenancy: Tenancy | None
) -> tuple[FloatArray, npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """Per job, what `power_limits_w` takes of a lever GPU (one in MIG mode) that holds it:
    the gain (the lowest of its GPU's tenants': they read one GPU at one limit), whether any
    tenant of its GPU is counted (no power reading yet), and whether every one is."""
    counted = estimator.power.count == 0
    if tenancy is None:
        return estimator.limit_gain, counted, counted
    return (
        tenancy.lowest(estimator.limit_gain),
        tenancy.any_tenant(counted),
        ~tenancy.any_tenant(~counted),
    )


def power_limits_w(
    job_power_w: npt.ArrayLike,
    gpus: npt.ArrayLike,
    margin: float,
    min_w: npt.ArrayLike,
    default_w: npt.ArrayLike,
    free: npt.ArrayLike | None = None,
    held: npt.ArrayLike | None = None,
    lever: npt.ArrayLike | None = None,
    top: npt.ArrayLike | None = None,
    gain: npt.ArrayLike | None = None,
    counted: npt.ArrayLike | None = None,
    unmodelled: npt.ArrayLike | None = None,
) -> FloatArray | None:
    """Per job, the power limit of each of its GPUs (W); None when the rail is off (margin 0)
    and no job is ``held`` or on a ``lever`` GPU.

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
    L_j = P_j / g_j, margin or not, rail on or off: the plan counts them at exactly that.

    Jobs on GPUs whose clocks cannot be locked (``lever``: MIG mode) have the limit as their
    setpoint: L_j = P_j / (g_j ρ_j), ρ_j its lever's ``gain`` (`limit_gain`; 1 when not
    given), the firmware running the highest clock within it. Planned at their ``top`` clock
    they are held `LEVER_TOP_MARGIN` above that (a model learned under limits says least about
    the top clock; a locked GPU there draws whatever its job asks), and one with a tenant
    ``counted`` (no power reading yet, counted at a share of its limit) at its count. A GPU
    whose every tenant is counted (``unmodelled``) planned below its top clock is the
    fallback's (nothing fits): a count says nothing of its draw there, and it goes to the
    board's minimum, as a locked one goes to its lowest clock."""
    if not margin >= 0:
        raise InputError(f"the power-limit margin must be at least 0, got {margin}")
    hold = None if held is None else np.asarray(held, dtype=bool)
    by_limit = None if lever is None else np.asarray(lever, dtype=bool)
    lowest = headroom = None
    if by_limit is not None and by_limit.any():
        none = np.zeros(by_limit.shape, dtype=bool)
        at_top = none if top is None else np.asarray(top, dtype=bool)
        new = none if counted is None else np.asarray(counted, dtype=bool)
        unknown = none if unmodelled is None else np.asarray(unmodelled, dtype=bool)
        serving = none if free is None else np.asarray(free, dtype=bool)
        lowest = by_limit & unknown & ~at_top & ~serving
        capped = by_limit & ~lowest
        hold = capped if hold is None else hold | capped
        free = serving
        headroom = by_limit & at_top & ~new  # measured, at its top clock
    elif margin == 0 and (hold is None or not hold.any()):
        return None
    power = np.asarray(job_power_w, dtype=np.float64)
    lo = np.broadcast_to(np.asarray(min_w, dtype=np.float64), power.shape)
    hi = np.broadcast_to(np.asarray(default_w, dtype=np.float64), power.shape)
    # L_j = clip(P_j / g_j · (1 + m), L_min, L_default); a held job's without the margin
    planned = power / np.maximum(np.asarray(gpus, dtype=np.float64), 1.0)
    per_gpu = planned * (1.0 + margin) if margin > 0 else np.full(power.shape, np.inf)
    if hold is not None:
        held_w = planned
        if by_limit is not None and gain is not None:  # a lever's limit draws ρ of itself
            rho = np.broadcast_to(np.asarray(gain, dtype=np.float64), power.shape)
            held_w = np.where(by_limit, planned / rho, planned)
        if headroom is not None:
            held_w = np.where(headroom, held_w * (1.0 + LEVER_TOP_MARGIN), held_w)
        per_gpu = np.where(hold, held_w, per_gpu)
    per_gpu = np.where(np.isfinite(per_gpu), per_gpu, hi)
    if free is not None:
        per_gpu = np.where(np.asarray(free, dtype=bool), hi, per_gpu)
    if lowest is not None:
        per_gpu = np.where(lowest, lo, per_gpu)
    return np.clip(per_gpu, lo, np.maximum(lo, hi))
