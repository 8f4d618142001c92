"""Random but realistic controller problems for unit tests."""

from __future__ import annotations

import numpy as np

from slurm_cdgpc.control.dual import DualProblem
from slurm_cdgpc.model.estimator import JobEstimator, JobStatics
from slurm_cdgpc.model.families import power_family
from slurm_cdgpc.wire.board import ClockTable


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


#: an A100-80GB's clocks, as its board lists them (one memory clock, 15 MHz steps)
A100 = ClockTable(memory_mhz=(1593,), graphics_mhz={1593: tuple(range(1410, 209, -15))})


def a100_estimator(gpus: list[int], iteration_s: float | list[float] = 0.5) -> JobEstimator:
    """An estimator of ``len(gpus)`` jobs on A100s (top 1,410 MHz, knee 1,085 MHz, 60 W idle,
    400 W limit), each on its number of GPUs, its time model's prior at ``iteration_s``."""
    n = len(gpus)
    est = JobEstimator()
    est.add_jobs(
        JobStatics(
            gpus=np.array(gpus, dtype=np.int64),
            graphics_max_mhz=np.full(n, 1410.0),
            memory_max_mhz=np.full(n, 1593.0),
            knee_mhz=np.full(n, 1085.0),
            mem_mask=np.zeros(n),
            idle_power_w=np.full(n, 60.0),
            power_limit_w=np.full(n, 400.0),
        ),
        iteration_s=np.broadcast_to(np.asarray(iteration_s, dtype=np.float64), (n,)).copy(),
    )
    return est
