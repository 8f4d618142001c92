"""A new job's prior from the jobs of its kind measured before it (`KindPrior`).

The controller's math: never reaches `store/`, `transport/`, `agent/`, `coordinator/` or `cli/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Models" (Kind prior); tests:
`tests/unit/test_model_kind_prior.py`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import NDArray

from slurm_cdgpc.model.rls import BoolArray, FloatArray

IntArray = NDArray[np.int64]

#: readings pooled per pass, whose terms stay in cache: 100,000 readings took 17 ms in one
#: pass (most of it faulting in fresh pages), 9 ms in passes of this many
_CHUNK: Final = 4096

#: readings a kind's pool needs before a new job starts from it
KIND_PRIOR_MIN_SAMPLES: Final = 20
#: readings a job's time model needs before its own join the pool (its scale is known then)
KIND_PRIOR_AFTER: Final = 2
#: what the pooled prior weighs against a job's own readings, in readings: its covariance is
#: the inverse of this many average samples' information (the power model's: at most this)
KIND_PRIOR_WEIGHT: Final = 10.0
#: σ, a power reading's own relative noise (the simulated GPU's): the pooled power model
#: weighs as (σ / r)² readings, r its fit's relative error per reading (`KindPrior.models`)
POWER_READING_NOISE: Final = 0.01


def job_kind(user: str, name: str, gpu_type: str) -> str:
    """The kind prior's key: the same user's jobs of one name on one GPU type."""
    return f"{user}\x1f{name}\x1f{gpu_type}"


@dataclass(frozen=True, eq=False)
class PooledModels:
    """Per new job: whether its kind's pool is ready, and the models to start from."""

    ready: BoolArray
    power_theta: FloatArray
    power_cov: FloatArray
    time_theta: FloatArray  # scale-free: T(1, 1) = 1; the first reading sets the scale
    time_cov: FloatArray


class KindPrior:
    """Least squares over every reading of every job of a kind, one fit per kind.

    A kind is the same work on the same GPU type: the caller's key (live, the user, Slurm's job
    name and the GPU type). A job's own models start from a fixed shape and see few clocks:
    most jobs run near their top clock or where their power limit holds them, so what a lower
    clock costs them stays the prior's guess. The jobs of a kind together run at many clocks.
    Power per GPU is pooled as read (relative errors); iteration time over the job's own
    predicted time at top clocks, so the pool learns the curve's shape, which a new job's first
    reading then scales. No forgetting: the pool is the kind's history. Pooling a GPU type's
    jobs of every kind does not work: its time curve decided nothing and its power curve
    counted each job at the type's mean (DESIGN.md, "Known gaps").
    """

    def __init__(self, power_params: int, initial_cov: float) -> None:
        self.k = k = power_params
        #: prior precision of every coefficient, as a new RLS estimator has it: directions no
        #: reading reaches (the memory column on HBM parts) keep the default covariance
        self.ridge = 1.0 / initial_cov
        self.kinds: dict[str, int] = {}
        self.layout = _Layout(k)
        #: per kind, every sum in one row (`_Layout`); the symmetric matrices as their upper
        #: triangles: φ_i φ_j is φ_j φ_i to the last bit, so the other half adds nothing
        self.sums = np.zeros((0, self.layout.width))
        self.samples = np.zeros(0, dtype=np.int64)

    def ids(self, kinds: Sequence[str]) -> IntArray:
        """Each kind's pool, added empty where new."""
        for kind in kinds:
            if kind not in self.kinds:
                self.kinds[kind] = len(self.kinds)
        grow = len(self.kinds) - self.samples.shape[0]
        if grow > 0:
            self.sums = np.concatenate([self.sums, np.zeros((grow, self.layout.width))])
            self.samples = np.concatenate([self.samples, np.zeros(grow, dtype=np.int64)])
        return np.array([self.kinds[k] for k in kinds], dtype=np.int64)

    def learn(
        self,
        kind: IntArray,
        phi_p: FloatArray,
        power_w: FloatArray,
        phi_t: FloatArray,
        time_rel: FloatArray,
    ) -> None:
        """Add one reading per row: pool ``kind``, power regressors and reading, time
        regressors and the iteration time over the job's own at top clocks.

        A pass lays the rows' terms out as `sums` has them, each term a contiguous run over
        the rows, and adds them in one ``np.add.at`` over a flat index (numpy's fast path):
        each sum takes its rows one at a time in their order, as a loop would, so the sums do
        not depend on how the readings are batched."""
        lay = self.layout
        for start in range(0, kind.shape[0], _CHUNK):
            rows = slice(start, start + _CHUNK)
            kind_c = kind[rows]
            p = np.ascontiguousarray(phi_p[rows].T)  # (k, n): one regressor per row
            t = np.ascontiguousarray(phi_t[rows].T)
            y = power_w[rows]
            terms = np.empty((lay.width, kind_c.shape[0]))
            np.multiply(p[lay.p_i], p[lay.p_j], out=terms[lay.power_gram])  # φφᵀ
            np.divide(terms[lay.power_gram], y**2, out=terms[lay.power_info])  # φφᵀ / y²
            np.divide(p, y, out=terms[lay.power_rhs])  # φ / y
            np.multiply(t[lay.t_i], t[lay.t_j], out=terms[lay.time_gram])
            np.multiply(t, time_rel[rows], out=terms[lay.time_rhs])
            flat = np.arange(lay.width)[:, None] + kind_c[None, :] * lay.width
            np.add.at(self.sums.reshape(-1), flat.reshape(-1), terms.reshape(-1))
        self.samples += np.bincount(kind, minlength=self.samples.shape[0])

    def models(self, kind: IntArray) -> PooledModels:
        """The pooled fits of ``kind``'s pools; ``ready`` where a pool holds
        `KIND_PRIOR_MIN_SAMPLES` readings and its fit keeps the clock coefficients ≥ 0
        (and the time model's top-clock time above 0)."""
        m, k = kind.shape[0], self.k
        ridge_p, ridge_t = self.ridge * np.eye(k), self.ridge * np.eye(3)
        # the power fit weighs readings by 1/y², far below the covariance's ridge: its own
        # only keeps directions no reading reaches solvable
        lay, sums = self.layout, self.sums[kind]
        power_info = _symmetric(sums[:, lay.power_info], lay.p_i, lay.p_j, k)
        power_gram = _symmetric(sums[:, lay.power_gram], lay.p_i, lay.p_j, k)
        time_gram = _symmetric(sums[:, lay.time_gram], lay.t_i, lay.t_j, 3)
        rhs_p = sums[:, lay.power_rhs]
        power_theta = _solve(power_info + 1e-12 * np.eye(k), rhs_p)
        time_theta = _solve(time_gram + ridge_t, sums[:, lay.time_rhs])
        samples = np.maximum(self.samples[kind], 1).astype(np.float64)
        n = samples[:, None, None]
        weight = np.minimum(
            KIND_PRIOR_WEIGHT,
            POWER_READING_NOISE**2 / _relative_misfit(power_theta, power_info, rhs_p, samples),
        )
        power_cov = _inverse(power_gram / n * weight[:, None, None] + ridge_p)
        time_cov = _inverse(time_gram / n * KIND_PRIOR_WEIGHT + ridge_t)
        # a coefficient a hair below 0 is round-off; a fit that needs one clearly below is
        # no shape to start from
        tol = 1e-9 * np.abs(time_theta).sum(axis=1, keepdims=True)
        ready = (
            (self.samples[kind] >= KIND_PRIOR_MIN_SAMPLES)
            & np.all(power_theta[:, : k - 1] >= 0.0, axis=1)
            & np.all(time_theta >= -tol, axis=1)
            & (time_theta.sum(axis=1) > 0.0)
        )
        time_theta = np.maximum(time_theta, 0.0)
        return PooledModels(ready.reshape(m), power_theta, power_cov, time_theta, time_cov)


def _relative_misfit(
    theta: FloatArray, info: FloatArray, rhs: FloatArray, samples: FloatArray
) -> FloatArray:
    """(M,) r², the pooled power fit's mean squared relative error per reading, from the
    sums alone: Σ (1 − φᵀθ/y)² = n − 2 θᵀ Σ φ/y + θᵀ (Σ φφᵀ/y²) θ, over n − k (floored)."""
    info_theta = np.einsum("nij,nj->ni", info, theta)
    squares = samples - 2.0 * np.einsum("ni,ni->n", theta, rhs)
    squares += np.einsum("ni,ni->n", theta, info_theta)
    dof = np.maximum(samples - theta.shape[1], 1.0)
    return np.maximum(squares / dof, 1e-12)  # type: ignore[no-any-return]


class _Layout:
    """Where each sum lies in a row of `KindPrior.sums`: power's Σ φφᵀ and Σ φφᵀ / y²
    (upper triangles), Σ φ / y, time's Σ φφᵀ (upper triangle) and Σ φ T/T_top."""

    def __init__(self, k: int) -> None:
        self.p_i, self.p_j = np.triu_indices(k)
        self.t_i, self.t_j = np.triu_indices(3)
        ends = np.cumsum([0, len(self.p_i), len(self.p_i), k, len(self.t_i), 3])
        self.power_gram, self.power_info, self.power_rhs, self.time_gram, self.time_rhs = (
            slice(int(a), int(b)) for a, b in itertools.pairwise(ends)
        )
        self.width = int(ends[-1])


def _symmetric(upper: FloatArray, i: IntArray, j: IntArray, k: int) -> FloatArray:
    """The (m, k, k) symmetric matrices whose upper triangles (rows i, columns j) are ``upper``."""
    full = np.empty((upper.shape[0], k, k))
    full[:, i, j] = upper
    full[:, j, i] = upper
    return full


def _solve(a: FloatArray, b: FloatArray) -> FloatArray:
    """x with a x = b, for a stack of (k, k) systems and (k,) right-hand sides."""
    return np.asarray(np.linalg.solve(a, b[..., None])[..., 0], dtype=np.float64)


def _inverse(a: FloatArray) -> FloatArray:
    return np.asarray(np.linalg.inv(a), dtype=np.float64)
