"""``bench controller``: one control step at cluster scale, and whether its answer is right.

A synthetic heterogeneous fleet (`slurm_cdgpc.sim.closed_loop`) runs on the calibrated simulated
GPUs; after a short warm-up every measured step is the full control path the head runs each
interval: the RLS update of both models of every job, the dual solve, the discretisation. The
plant's own time is not counted. Then, on the last step's problem:

- ``modes_agree``: the paper's projected gradient (step 1/L), bisection and Newton reach the
  same price within 1e-6 relative;
- ``reference_gap_pct``: our continuous objective against cvxpy's on min(N, 2000) jobs, at the
  budget our full solution gives those jobs (by the decomposition both must land on one price).
"""

from __future__ import annotations

import resource
import time
from dataclasses import replace
from typing import Any

import numpy as np

from slurm_cdgpc.control.dual import MODES, DualProblem, solve_price
from slurm_cdgpc.control.reference import solve_reference
from slurm_cdgpc.control.tuning import shipped
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.sim.closed_loop import ClosedLoop, synthetic_fleet

#: the tolerance at which the three dual modes are compared (relative to the budget)
AGREEMENT_TOL = 1e-10
REFERENCE_JOBS = 2000


#: jobs whose total is unknown, as `sim.reporting.REALISTIC` has them (steps and time limit)
SILENT_SHARE = 0.8


def bench_controller(
    jobs: int,
    seed: int = 0,
    steps: int = 20,
    warmup: int = 3,
    budget_fraction: float = 0.6,
    mode: str = "newton",
    family: str = "bent",
) -> dict[str, Any]:
    if jobs < 1 or steps < 1 or warmup < 0:
        raise InputError("jobs and steps must be at least 1, warmup at least 0")
    if not 0.0 < budget_fraction <= 1.0:
        raise InputError(f"budget fraction must be in (0, 1], got {budget_fraction}")
    rng = np.random.default_rng(seed)
    fleet = synthetic_fleet(jobs, rng)
    budget_w = budget_fraction * fleet.max_power_w()
    # the shipped rules, the drain included: jobs wait and a GPU is free
    tuning = shipped()
    settings = replace(tuning.controller, mode=mode)
    estimator = replace(tuning.estimator, family=family)
    # most jobs say no total (the automatic hook's steps only): the time-limit rule runs too
    loop = ClosedLoop(fleet, rng, settings, estimator, queued=True, silent_share=SILENT_SHARE)

    step_ms, evaluations, errors = [], [], []
    for k in range(warmup + steps):
        record = loop.step(budget_w)
        if k >= warmup:
            step_ms.append(1e3 * record.step_s)
            evaluations.append(record.dual_evaluations)
            errors.append(record.plan_error_pct)

    f = loop.fleet
    problem = loop.controller.problem(
        loop.estimator, loop.job_state(), loop.t_s, budget_w, queue=loop.queue()
    )
    agreement = _modes_agree(problem)
    reference = _reference_gap(problem, rng)
    return {
        "jobs": jobs,
        "gpus": int(f.gpus.sum()),
        "mode": mode,
        "model_family": family,
        "steps": steps,
        "step_ms_p50": round(float(np.percentile(step_ms, 50)), 2),
        "step_ms_p99": round(float(np.percentile(step_ms, 99)), 2),
        "dual_iterations_p50": float(np.percentile(evaluations, 50)),
        "budget_error_pct": float(np.median(errors)),
        "budget_error_pct_min": float(np.min(errors)),
        "budget_error_pct_max": float(np.max(errors)),
        **agreement,
        **reference,
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def _modes_agree(problem: DualProblem) -> dict[str, Any]:
    prices, iterations, millis = {}, {}, {}
    for m in MODES:
        t0 = time.perf_counter()
        result = solve_price(problem, m, tol=AGREEMENT_TOL)
        millis[m] = round(1e3 * (time.perf_counter() - t0), 1)
        prices[m] = result.price
        iterations[m] = result.evaluations
    base = prices["newton"]
    finite = np.isfinite(base) & (base > 0)
    spread = max(
        float(np.max(np.abs(p[finite] - base[finite]) / base[finite])) if finite.any() else 0.0
        for p in prices.values()
    )
    same_status = all(np.array_equal(np.isfinite(p), np.isfinite(base)) for p in prices.values())
    return {
        "modes_agree": bool(same_status and spread <= 1e-6),
        "modes_price_spread_rel": spread,
        "modes_iterations": iterations,
        "modes_ms": millis,
    }


def _reference_gap(problem: DualProblem, rng: np.random.Generator) -> dict[str, Any]:
    n = problem.gpus.shape[0]
    result = solve_price(problem, "newton", tol=AGREEMENT_TOL)
    x_full, xm_full = problem.best_response(result.price[:1])
    rows = np.sort(rng.choice(n, size=min(n, REFERENCE_JOBS), replace=False))
    share = float(np.sum(problem.power_w(x_full[0], xm_full[0])[rows]))
    sub = DualProblem(
        problem.family, problem.gpus[rows], problem.power_theta[rows], problem.time_theta[rows],
        problem.weight[:1, rows], problem.knee_x[rows], problem.mem_mask[rows],
        problem.x_lo[rows], problem.x_hi[rows], problem.xm_lo[rows], problem.xm_hi[rows],
        np.array([share]),
    )  # fmt: skip
    ours_price = solve_price(sub, "newton", tol=AGREEMENT_TOL).price
    x, x_m = sub.best_response(ours_price)
    ours = float(sub.objective(x, x_m)[0])
    ref = solve_reference(sub)
    return {
        "reference_jobs": int(rows.size),
        "reference_gap_pct": 100.0 * (ours - ref.objective) / abs(ref.objective),
        "reference_ms": round(1e3 * ref.solve_s, 1),
        "reference_solver": ref.solver,
    }
