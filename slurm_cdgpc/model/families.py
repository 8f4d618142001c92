"""Model families: how a job's per-GPU power and iteration time depend on its clocks.

The controller's math: never reaches `store/`, `transport/`, `agent/`, `coordinator/` or `cli/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Models"; tests:
`tests/unit/test_model_families.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np
from numpy.typing import NDArray

from slurm_cdgpc.errors import InputError

FloatArray = NDArray[np.float64]

# The time model is shared by all families: φ_T = [1/x, m/x_m, 1].
TIME_PARAMS = 3


def time_regressors(x: FloatArray, x_m: FloatArray, mem_mask: FloatArray) -> FloatArray:
    """φ_T = [1/x, mask/x_m, 1], shape (..., 3)."""
    # written column by column: np.stack took 1.4 against 0.3 ms at 100,000 jobs
    phi = np.empty((*np.broadcast_shapes(np.shape(x), np.shape(x_m), np.shape(mem_mask)), 3))
    np.divide(1.0, x, out=phi[..., 0])
    np.divide(mem_mask, x_m, out=phi[..., 1])
    phi[..., 2] = 1.0
    return phi


class PowerFamily(ABC):
    """A core-clock basis for the power model, with what the controller needs from it.

    Clocks enter normalised, x = f / f_max (core) and x_m = f_m / f_m,max (memory), which keeps
    the RLS covariance well conditioned. Per GPU, P = Σ_j a_j h_j(x) + a_m x_m + a_e (the family
    chooses the core basis h_j); for every family T = b_c / x + b_m / x_m + b_e
    (`time_regressors`). Every family is linear in its parameters, so RLS fits it, and convex
    and increasing in the core clock, so the controller's per-job subproblem keeps a closed
    form. On HBM parts (one memory clock) the memory columns are masked to zero, so a_m and b_m
    stay at their prior and the memory clock is fixed at its only value.
    """

    name: ClassVar[str]
    core_params: ClassVar[int]

    @property
    def n_params(self) -> int:
        """Core coefficients, then a_m, then a_e."""
        return self.core_params + 2

    @abstractmethod
    def basis(self, x: FloatArray, knee_x: FloatArray) -> FloatArray:
        """h_j(x), shape (..., core_params)."""

    @abstractmethod
    def marginal(self, a: FloatArray, x: FloatArray, knee_x: FloatArray) -> FloatArray:
        """m(x) = dP/dx = Σ_j a_j h_j'(x)."""

    @abstractmethod
    def marginal_slope(self, a: FloatArray, x: FloatArray, knee_x: FloatArray) -> FloatArray:
        """m'(x) = d²P/dx² (≥ 0: the basis is convex)."""

    @abstractmethod
    def stationary(self, s: FloatArray, a: FloatArray, knee_x: FloatArray) -> FloatArray:
        """Unclipped x > 0 solving s / x² = m(x), i.e. the minimiser of s/x + P(x).

        ``s = w b_c / (λ g)`` (≥ 0); ``a`` holds the core coefficients, shape (..., core_params).
        Returns +inf where m ≡ 0 (power does not depend on the clock).
        """

    def regressors(
        self, x: FloatArray, x_m: FloatArray, mem_mask: FloatArray, knee_x: FloatArray
    ) -> FloatArray:
        """φ_P = [h(x), mask·x_m, 1], shape (..., n_params)."""
        core, c = self.basis(x, knee_x), self.core_params
        phi = np.empty((*core.shape[:-1], c + 2))  # column by column, as `time_regressors`
        phi[..., :c] = core
        np.multiply(mem_mask, x_m, out=phi[..., c])
        phi[..., c + 1] = 1.0
        return phi

    def power(
        self,
        theta: FloatArray,
        x: FloatArray,
        x_m: FloatArray,
        mem_mask: FloatArray,
        knee_x: FloatArray,
    ) -> FloatArray:
        """P = φ_P · θ per GPU (summed term by term: no regressor matrix is built)."""
        c = self.core_params
        core = self.basis(x, knee_x)
        total = core[..., 0] * theta[..., 0]
        for j in range(1, c):
            total = total + core[..., j] * theta[..., j]
        return np.asarray(total + theta[..., c] * (mem_mask * x_m) + theta[..., c + 1])

    def clock_at_power(
        self,
        theta: FloatArray,
        power_w: FloatArray,
        x_m: FloatArray,
        mem_mask: FloatArray,
        knee_x: FloatArray,
        x_lo: FloatArray,
        x_hi: FloatArray,
    ) -> FloatArray:
        """The highest x in [x_lo, x_hi] with P(x) ≤ ``power_w`` (x_lo if none, x_hi if all).

        P is convex and increasing in x, so Newton started at x_hi walks down monotonically onto
        the root: x ← x − (P(x) − target) / P'(x) while P(x) > target.
        """
        x = x_hi.copy()
        core = theta[:, : self.core_params]
        for _ in range(12):
            excess = self.power(theta, x, x_m, mem_mask, knee_x) - power_w
            slope = self.marginal(core, x, knee_x)
            with np.errstate(divide="ignore", invalid="ignore"):
                step = np.where((excess > 0) & (slope > 0), excess / slope, 0.0)
            x = np.maximum(x - step, x_lo)
        return x


class LinearPower(PowerFamily):
    """h(x) = x: the paper's published model."""

    name = "linear"
    core_params = 1

    def basis(self, x: FloatArray, knee_x: FloatArray) -> FloatArray:
        return x[..., None]

    def marginal(self, a: FloatArray, x: FloatArray, knee_x: FloatArray) -> FloatArray:
        return np.broadcast_to(a[..., 0], x.shape).copy()

    def marginal_slope(self, a: FloatArray, x: FloatArray, knee_x: FloatArray) -> FloatArray:
        return np.zeros_like(x)

    def stationary(self, s: FloatArray, a: FloatArray, knee_x: FloatArray) -> FloatArray:
        # s/x² = a  →  x = sqrt(s/a)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(a[..., 0] > 0, np.sqrt(s / a[..., 0]), np.inf)


class BentPower(PowerFamily):
    """h(x) = max(x, x³/k²), k the GPU type's voltage-floor knee (normalised): measured GPU power
    falls steeply with the clock above the knee and slowly below it. Three parameters, like
    `LinearPower`."""

    name = "bent"
    core_params = 1

    def basis(self, x: FloatArray, knee_x: FloatArray) -> FloatArray:
        # h(x) = max(x, x³/k²): linear below the knee, cubic above, continuous at k
        # (products, not powers: numpy's x**3 is a general pow, and slower)
        return np.maximum(x, x * x * x / (knee_x * knee_x))[..., None]

    def marginal(self, a: FloatArray, x: FloatArray, knee_x: FloatArray) -> FloatArray:
        return a[..., 0] * np.where(x > knee_x, 3.0 * (x * x) / (knee_x * knee_x), 1.0)

    def marginal_slope(self, a: FloatArray, x: FloatArray, knee_x: FloatArray) -> FloatArray:
        # at the knee m jumps from a to 3a: a job parked there does not move with λ (slope ∞)
        return a[..., 0] * np.where(
            x == knee_x, np.inf, np.where(x > knee_x, 6.0 * x / knee_x**2, 0.0)
        )

    def stationary(self, s: FloatArray, a: FloatArray, knee_x: FloatArray) -> FloatArray:
        # below the knee s/x² = a → x = sqrt(s/a); above it s/x² = 3a x²/k² → x = (s k²/3a)^¼;
        # h' jumps from 1 to 3 at k, so when neither branch is self-consistent the answer is k.
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where(a[..., 0] > 0, s / a[..., 0], np.inf)
            below = np.sqrt(r)
            above = np.sqrt(np.sqrt(r * knee_x**2 / 3.0))
        return np.where(below <= knee_x, below, np.maximum(above, knee_x))


class CubicPower(PowerFamily):
    """h(x) ∈ {x, x³}: one more parameter, no knee needed."""

    name = "cubic"
    core_params = 2

    def basis(self, x: FloatArray, knee_x: FloatArray) -> FloatArray:
        return np.stack([x, x * x * x], axis=-1)

    def marginal(self, a: FloatArray, x: FloatArray, knee_x: FloatArray) -> FloatArray:
        return a[..., 0] + 3.0 * a[..., 1] * x**2

    def marginal_slope(self, a: FloatArray, x: FloatArray, knee_x: FloatArray) -> FloatArray:
        return 6.0 * a[..., 1] * x

    def stationary(self, s: FloatArray, a: FloatArray, knee_x: FloatArray) -> FloatArray:
        # s/x² = a1 + 3 a3 x²  →  3 a3 y² + a1 y − s = 0 with y = x²
        a1, a3 = a[..., 0], a[..., 1]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            disc = np.sqrt(a1**2 + 12.0 * a3 * s)
            # (−a1 + disc)/(6 a3) written as 2s/(a1 + disc) to stay exact when a3 → 0
            y = 2.0 * s / (a1 + disc)
            return np.where((a1 > 0) | (a3 > 0), np.sqrt(y), np.inf)


FAMILIES: dict[str, type[PowerFamily]] = {
    cls.name: cls for cls in (LinearPower, BentPower, CubicPower)
}


def power_family(name: str) -> PowerFamily:
    """The power family called ``name``; a one-line error lists the known ones."""
    try:
        return FAMILIES[name]()
    except KeyError:
        raise InputError(
            f"unknown model family {name!r} (known: {', '.join(sorted(FAMILIES))})"
        ) from None
