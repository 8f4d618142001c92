"""Fractional-GPU jobs sharing one GPU in the simulator: how fast each tenant runs, calibrated
on Gavel's measured co-located pairs.

**The model** (`throughput_factors`): the k ≥ 2 tenants of a GPU together achieve a combined
normalized throughput C = Σ_i x_i / x_i,alone (1: as good as time-slicing; 2 for a pair: no
interference). Each job draws one C (`draw_pair_throughput`); a shared GPU's C is its tenants'
mean, and tenant i runs at s_i = min(1, C · m_i / Σ_j m_j) of its alone speed, m its gpu_milli.
A tenant alone on its GPU runs at 1.

**The calibration** (`PAIR_THROUGHPUT_QUANTILES`): Gavel (Narayanan et al., OSDI'20, MIT),
commit ``c4fa40097339e9608ab71fd64c8bdea96a5e4a4c``, ``scheduler/simulation_throughputs.json``
(`GAVEL_FILE`), worker type ``v100`` (for single-GPU jobs identical to
``v100_unconsolidated``): the 26 single-GPU job types (keys ending ``, 1)``) and their 351
measured pairs with each other. The 26 self-pairs are kept: two copies of one model on a GPU
are as real a co-location as any (the profiler stores the two copies' mean). A pair (a, b)
gives C = this / alone_a + other / alone_b. The file stores each pair twice, mirrored; the
ordered entries are used (636 once failed pairs are dropped), which weighs a pair as often as
two independently drawn job types form it (a self-pair once, any other pair twice).

Oddities: 21 pairs are ``[0.0, 0.0]``, the mark of Gavel's profiler for a pair that failed to
run (``scripts/profiling/measure_throughput.py``; 16 of the 21 hold ResNet-50 at batch 128):
dropped, since in the simulator packing by gpu_milli decides what fits, and C = 0 would stall
its tenants; 330 pairs remain. No member ever runs faster than alone, and members at exactly
their alone throughput are common (both in 14 pairs, C = 2: small ResNet-18 and Recommendation
models; one in 55): the file looks capped at the alone throughput, and those pairs are kept as
they are. No NaN, infinite or negative values. The sibling ``physical_cluster_throughputs.json``
is not used: 19 of its v100 alone throughputs differ while its pairs do not (Recommendation
alone about 10× higher), so its alone and pair values are not one profile.

The 636 values of C: min 0.3468, p10 0.6836, median 1.3712, p90 1.8024, max 2.0, mean 1.3134;
138 (21.7 %) are below 1, co-location worse than time-slicing. A member's slowdown,
this / alone, has median 0.6785 (0.0911 to 1). Recompute with `pair_throughput_quantiles`.

Design: DESIGN.md, "Simulator"; tests: `tests/unit/test_sim_colocation.py`.
"""

from __future__ import annotations

import json
import os
from typing import Final

import numpy as np
import numpy.typing as npt

from slurm_cdgpc.errors import InputError, one_line

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: Gavel's throughputs, under the third-party data directory ($CDGPC_DATA_DIR)
GAVEL_FILE: Final = "gavel-colocation/scheduler/simulation_throughputs.json"
WORKER_TYPE: Final = "v100"
#: C at the 0, 5, …, 100 % quantiles of Gavel's v100 pairs (`pair_throughput_quantiles`)
PAIR_THROUGHPUT_QUANTILES: Final[tuple[float, ...]] = (
    0.3468, 0.5471, 0.6836, 0.7705, 0.906, 1.1445, 1.2086, 1.2531, 1.2859, 1.339, 1.3712,
    1.3991, 1.4323, 1.4841, 1.5336, 1.5779, 1.646, 1.714, 1.8024, 1.9544, 2.0,
)  # fmt: skip
_LEVELS: Final = np.arange(len(PAIR_THROUGHPUT_QUANTILES)) / (len(PAIR_THROUGHPUT_QUANTILES) - 1)


def _slowdowns(path: str | os.PathLike[str]) -> FloatArray:
    """(this / alone_a, other / alone_b) for every ordered pair (a, b) of single-GPU jobs that
    ran together, one row each."""
    try:
        with open(path) as f:
            table = json.load(f)[WORKER_TYPE]
        single = sorted(key for key in table if key.endswith(", 1)"))
        alone = np.array([table[a]["null"] for a in single], dtype=np.float64)
        pair = np.array([[table[a][b] for b in single] for a in single], dtype=np.float64)
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise InputError(f"{path}: not Gavel's throughputs file ({one_line(e)})") from None
    if pair.shape != (alone.size, alone.size, 2) or alone.size == 0:
        raise InputError(f"{path}: no {WORKER_TYPE} pairs of single-GPU jobs")
    if not (np.all(alone > 0) and np.all(np.isfinite(pair)) and np.all(pair >= 0)):
        raise InputError(f"{path}: a throughput that is not a finite number ≥ 0 (alone > 0)")
    ran = ~np.all(pair == 0, axis=-1)  # [0, 0]: the pair failed to run
    this = pair[..., 0] / alone[:, None]
    other = pair[..., 1] / alone[None, :]
    return np.stack([this[ran], other[ran]], axis=-1)


def pair_throughput_quantiles(path: str | os.PathLike[str]) -> tuple[float, ...]:
    """`PAIR_THROUGHPUT_QUANTILES` recomputed from Gavel's file at ``path``."""
    combined = _slowdowns(path).sum(axis=1)  # C = this / alone_a + other / alone_b
    return tuple(np.round(np.quantile(combined, _LEVELS), 4).tolist())


def draw_pair_throughput(n: int, rng: np.random.Generator) -> FloatArray:
    """``n`` draws of C: the inverse of the quantiles' piecewise-linear CDF at u ~ U[0, 1)."""
    return np.interp(rng.random(n), _LEVELS, PAIR_THROUGHPUT_QUANTILES)


def throughput_factors(
    milli: IntArray | FloatArray, gpu: IntArray, combined: FloatArray
) -> FloatArray:
    """Each tenant's speed over its speed alone: row i runs on GPU ``gpu[i]`` with ``milli[i]``
    thousandths of it and drew C = ``combined[i]``.

    s_i = 1 alone on its GPU, else min(1, mean_{j on g} C_j · m_i / Σ_{j on g} m_j).
    """
    m = np.asarray(milli, dtype=np.float64)
    if not m.shape == np.shape(gpu) == np.shape(combined) or m.ndim != 1:
        raise InputError("milli, gpu and combined must be 1-D arrays of one length")
    if np.any(m <= 0):
        raise InputError("every tenant needs a gpu_milli > 0")
    _, slot, tenants = np.unique(gpu, return_inverse=True, return_counts=True)
    share = m / np.bincount(slot, weights=m)[slot]  # m_i / Σ_j m_j
    mean_c = (np.bincount(slot, weights=combined) / tenants)[slot]
    return np.where(tenants[slot] > 1, np.minimum(1.0, mean_c * share), 1.0)
