"""Random but realistic controller problems for unit tests."""

from __future__ import annotations

import numpy as np

from slurm_cdgpc.control.dual import DualProblem
from slurm_cdgpc.model.families import power_family


def build_problem(
    n: int = 500,
    family: str = "bent",
    seed: int = 0,
    budget_fraction: float | list[float] = 0.45,
    gddr_share: float = 0.2,
) -> DualProblem:
    """N jobs on a mix of HBM and GDDR GPUs; budget at a fraction between min and max power."""
    rng = np.random.default_rng(seed)
    fam = power_family(family)
    g = rng.integers(1, 9, n).astype(float)
    a = rng.uniform(100, 250, n)
    gddr = rng.random(n) < gddr_share
    a_m = np.where(gddr, rng.uniform(10, 40, n), 0.0)
    a_e = rng.uniform(40, 80, n)
    core = a[:, None] if fam.core_params == 1 else np.stack([0.6 * a, 0.4 * a], axis=1)
    power_theta = np.column_stack([core, a_m, a_e])
    time_theta = np.column_stack(
        [
            rng.uniform(0.05, 1, n),
            np.where(gddr, rng.uniform(0.01, 0.2, n), 0.0),
            rng.uniform(0, 0.1, n),
        ]
    )
    fractions = np.atleast_1d(np.asarray(budget_fraction, dtype=float))
    weight = rng.uniform(0.1, 10, (1, n)).repeat(fractions.size, axis=0)
    knee = np.full(n, 0.77)
    x_lo, x_hi = np.full(n, 0.4), np.ones(n)
    xm_lo = np.where(gddr, 0.6, 1.0)
    mem = gddr.astype(float)

    def make(budget: np.ndarray) -> DualProblem:
        return DualProblem(
            fam,
            g,
            power_theta,
            time_theta,
            weight,
            knee,
            mem,
            x_lo,
            x_hi,
            xm_lo,
            np.ones(n),
            budget,
        )

    probe = make(np.zeros(fractions.size))
    p_max = probe.power_w(np.ones(n), np.ones(n)).sum()
    p_min = probe.power_w(x_lo, xm_lo).sum()
    return make(p_min + fractions * (p_max - p_min))
