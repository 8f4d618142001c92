"""A new job's prior from the jobs of its kind measured before it (`KindPrior`).

The controller's math: never reaches `store/`, `transport/`, `agent/`, `coordinator/` or `cli/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Models" (Kind prior); tests:
`tests/unit/test_model_kind_prior.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import NDArray

from slurm_cdgpc.model.rls import BoolArray, FloatArray

IntArray = NDArray[np.int64]

#: readings a kind's pool needs before a new job starts from it
KIND_PRIOR_MIN_SAMPLES: Final = 20
#: readings a job's time model needs before its own join the pool (its scale is known then)
KIND_PRIOR_AFTER: Final = 2
#: what the pooled prior weighs against a job's own readings, in readings: its covariance is
#: the inverse of this many average samples' information
KIND_PRIOR_WEIGHT: Final = 10.0


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
        self.k = power_params
        #: prior precision of every coefficient, as a new RLS estimator has it: directions no
        #: reading reaches (the memory column on HBM parts) keep the default covariance
        self.ridge = 1.0 / initial_cov
        self.kinds: dict[str, int] = {}
        self.power_info = np.zeros((0, self.k, self.k))  # Σ φφᵀ / y²
        self.power_rhs = np.zeros((0, self.k))  # Σ φ / y
        self.power_gram = np.zeros((0, self.k, self.k))  # Σ φφᵀ: what the covariance uses
        self.time_gram = np.zeros((0, 3, 3))
        self.time_rhs = np.zeros((0, 3))
        self.samples = np.zeros(0, dtype=np.int64)

    def ids(self, kinds: Sequence[str]) -> IntArray:
        """Each kind's pool, added empty where new."""
        for kind in kinds:
            if kind not in self.kinds:
                self.kinds[kind] = len(self.kinds)
        grow = len(self.kinds) - self.samples.shape[0]
        if grow > 0:
            k = self.k
            self.power_info = np.concatenate([self.power_info, np.zeros((grow, k, k))])
            self.power_rhs = np.concatenate([self.power_rhs, np.zeros((grow, k))])
            self.power_gram = np.concatenate([self.power_gram, np.zeros((grow, k, k))])
            self.time_gram = np.concatenate([self.time_gram, np.zeros((grow, 3, 3))])
            self.time_rhs = np.concatenate([self.time_rhs, np.zeros((grow, 3))])
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
        regressors and the iteration time over the job's own at top clocks."""
        if not kind.size:
            return
        outer = phi_p[:, :, None] * phi_p[:, None, :]
        _add_at(self.power_info, kind, outer / power_w[:, None, None] ** 2)
        _add_at(self.power_rhs, kind, phi_p / power_w[:, None])
        _add_at(self.power_gram, kind, outer)
        _add_at(self.time_gram, kind, phi_t[:, :, None] * phi_t[:, None, :])
        _add_at(self.time_rhs, kind, phi_t * time_rel[:, None])
        np.add.at(self.samples, kind, 1)

    def models(self, kind: IntArray) -> PooledModels:
        """The pooled fits of ``kind``'s pools; ``ready`` where a pool holds
        `KIND_PRIOR_MIN_SAMPLES` readings and its fit keeps the clock coefficients ≥ 0
        (and the time model's top-clock time above 0)."""
        m, k = kind.shape[0], self.k
        ridge_p, ridge_t = self.ridge * np.eye(k), self.ridge * np.eye(3)
        # the power fit weighs readings by 1/y², far below the covariance's ridge: its own
        # only keeps directions no reading reaches solvable
        power_theta = _solve(self.power_info[kind] + 1e-12 * np.eye(k), self.power_rhs[kind])
        time_theta = _solve(self.time_gram[kind] + ridge_t, self.time_rhs[kind])
        n = np.maximum(self.samples[kind], 1).astype(np.float64)[:, None, None]
        power_cov = _inverse(self.power_gram[kind] / n * KIND_PRIOR_WEIGHT + ridge_p)
        time_cov = _inverse(self.time_gram[kind] / n * KIND_PRIOR_WEIGHT + ridge_t)
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


def _add_at(total: FloatArray, kind: IntArray, rows: FloatArray) -> None:
    """``np.add.at(total, kind, rows)`` through one flat index, numpy's fast path (the pools'
    sums went from 48 to about 24 ms of a controller step at 100,000 jobs); each entry still
    takes its rows one at a time in their order, so the sums are the same to the last bit."""
    assert total.flags.c_contiguous
    width = total[0].size
    flat = (kind[:, None] * width + np.arange(width)).reshape(-1)
    np.add.at(total.reshape(-1), flat, rows.reshape(-1))


def _solve(a: FloatArray, b: FloatArray) -> FloatArray:
    """x with a x = b, for a stack of (k, k) systems and (k,) right-hand sides."""
    return np.asarray(np.linalg.solve(a, b[..., None])[..., 0], dtype=np.float64)


def _inverse(a: FloatArray) -> FloatArray:
    return np.asarray(np.linalg.inv(a), dtype=np.float64)
