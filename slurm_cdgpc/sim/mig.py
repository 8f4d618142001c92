"""GPUs in MIG mode in the simulator (``simulate --mig``): what slice a job gets and how fast it
runs there, calibrated on MISO's measured A100 slices.

**The model.** Every GPU of the fleet is in MIG mode. A job that asks for part of a GPU
(`Trace.gpu_milli` below 1000) gets the smallest A100 profile with at least its share, in
sevenths of the GPU (`MIG_PROFILES`: 1g, 2g, 3g, 4g, 7g; `slice_milli`), and its GPU's tenants
are the jobs on its instances; a whole-GPU job holds one 7g instance per GPU. Instances do not
slow each other (they share no SMs or memory slices), but a job on a slice runs at a fraction r
of its speed on the whole GPU, drawn per job from MISO's measured ratios for its profile
(`draw_slice_speed`; 7g: 1). Its draw above idle is r times its whole-GPU draw above idle at the
GPU's clock (its energy per unit of work is its own), as `slurm_cdgpc.sim.sharing` charges a
co-located tenant. Clocks are the GPU's and cannot be locked: every policy's clock setpoint is
ignored and only its power limit acts (`Simulator`, the head's MIG GPUs: DESIGN.md, "Boards").
Which instances fit together is not checked beyond their sevenths (A100 places 4g and 3g apart,
for one), and a slice's memory is not: the trace asks for compute.

**The calibration** (`SLICE_SPEED_QUANTILES`): MISO (Li et al., SoCC'22, MIT), commit
``39b1ee69d73c876c2d2bfca7858806890b27c834``, ``mps/models/logs/mig/<slice>_<model>_train<batch>
.json`` (`MISO_DIR`): per-iteration wall times per epoch of BERT, CycleGAN, DeepSpeech2, ResNet and
a Transformer on an A100-40GB's 1g.5gb … 7g.40gb. Per (model, batch) the median iteration time
(each epoch's first, a warm-up, left out) on 7g over that on the slice is one ratio: 10 on 1g,
16 on 2g, 20 on 3g and 4g (medians 0.232, 0.404, 0.558, 0.622; 3g's largest is 1.0035, noise
around 1, clipped to 1 when drawn). Recompute with `slice_speed_quantiles`.

Design: DESIGN.md, "Simulator" (MIG); tests: `tests/unit/test_sim_mig.py`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt

from slurm_cdgpc.errors import InputError, one_line
from slurm_cdgpc.sim.traces import WHOLE_GPU

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: MISO's per-slice training logs, under the third-party data directory ($CDGPC_DATA_DIR)
MISO_DIR: Final = "miso-a100-mig/mps/models/logs/mig"
#: the A100's compute profiles, in sevenths of the GPU
MIG_PROFILES: Final = (1, 2, 3, 4, 7)
#: the ratio r (7g iteration time over the slice's) at the 0, 10, …, 100 % quantiles of MISO's
#: (model, batch) pairs, per profile (`slice_speed_quantiles`)
SLICE_SPEED_QUANTILES: Final[dict[int, tuple[float, ...]]] = {
    1: (0.077, 0.0904, 0.1487, 0.1749, 0.2061, 0.2318, 0.2535, 0.2882, 0.3487, 0.469, 0.5787),
    2: (0.2753, 0.3032, 0.3161, 0.3272, 0.3421, 0.4042, 0.4605, 0.6027, 0.6486, 0.7176, 0.8927),
    3: (0.3999, 0.4923, 0.516, 0.5217, 0.5415, 0.5576, 0.6371, 0.7438, 0.84, 0.8591, 1.0035),
    4: (0.5519, 0.5736, 0.5861, 0.5917, 0.6092, 0.6218, 0.7116, 0.8035, 0.9282, 0.9497, 0.9642),
}
_LEVELS: Final = np.linspace(0.0, 1.0, 11)
_LOG: Final = re.compile(r"(\d)g\.\d+gb_(\w+)_train(\d+)\.json")


def slice_sevenths(milli: npt.ArrayLike) -> IntArray:
    """The profile each job gets, in sevenths: the smallest with at least ``milli`` thousandths
    (7 for a whole-GPU job, ``milli`` ≥ 1000)."""
    m = np.asarray(milli, dtype=np.int64)
    if np.any(m <= 0):
        raise InputError("every job needs a gpu_milli > 0")
    need = np.ceil(np.minimum(m, WHOLE_GPU) * 7 / WHOLE_GPU - 1e-9).astype(np.int64)
    profiles = np.array(MIG_PROFILES, dtype=np.int64)
    return profiles[np.searchsorted(profiles, need)]


def slice_milli(milli: npt.ArrayLike) -> IntArray:
    """``milli`` rounded up to its profile's thousandths, ⌊k · 1000 / 7⌋ (whole GPUs: 1000), so
    that instances fill a GPU by sevenths: 142, 285, 428, 571, 1000."""
    m = np.asarray(milli, dtype=np.int64)
    k = slice_sevenths(m)
    return np.where(m >= WHOLE_GPU, m, np.where(k == 7, WHOLE_GPU, k * WHOLE_GPU // 7))


def draw_slice_speed(sevenths: npt.ArrayLike, rng: np.random.Generator) -> FloatArray:
    """Per job, its speed on its profile over its speed on the whole GPU: the inverse of its
    profile's quantiles' piecewise-linear CDF at u ~ U[0, 1) (one u per job, drawn for every job
    so a job's draw does not depend on the others' profiles), at most 1; 7g runs at 1."""
    k = np.asarray(sevenths, dtype=np.int64)
    u = rng.random(k.shape)
    out = np.ones(k.shape)
    for profile, quantiles in SLICE_SPEED_QUANTILES.items():
        on = k == profile
        out[on] = np.minimum(np.interp(u[on], _LEVELS, quantiles), 1.0)
    return out


def slice_speed_quantiles(path: str | os.PathLike[str]) -> dict[int, tuple[float, ...]]:
    """`SLICE_SPEED_QUANTILES` recomputed from MISO's logs under ``path`` (`MISO_DIR`)."""
    median: dict[tuple[int, str, int], float] = {}
    for log in sorted(Path(path).glob("*.json")):
        match = _LOG.fullmatch(log.name)
        if match is None:
            continue
        try:
            epochs = json.loads(log.read_text(encoding="utf-8"))
            times = [float(t) for epoch in epochs.values() for t in epoch[1:]]
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise InputError(one_line(f"{log}: not a MISO iteration log: {e}")) from e
        if times:
            profile, model, batch = int(match[1]), match[2], int(match[3])
            median[(profile, model, batch)] = float(np.median(times))
    out: dict[int, tuple[float, ...]] = {}
    for profile in MIG_PROFILES[:-1]:
        ratios = [
            median[(7, model, batch)] / t
            for (k, model, batch), t in median.items()
            if k == profile and (7, model, batch) in median
        ]
        if not ratios:
            raise InputError(f"{path}: no {profile}g log with a 7g log of the same job")
        out[profile] = tuple(np.round(np.quantile(ratios, _LEVELS), 4).tolist())
    return out
