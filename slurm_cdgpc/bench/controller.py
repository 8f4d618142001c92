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
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from slurm_cdgpc.control.domains import DomainLimits
from slurm_cdgpc.control.dual import (
    MODES,
    DomainResult,
    DomainSet,
    DualProblem,
    DualResult,
    solve_domain_prices,
    solve_price,
)
from slurm_cdgpc.control.reference import solve_reference
from slurm_cdgpc.control.tuning import shipped
from slurm_cdgpc.errors import InputError, SolverError, one_line
from slurm_cdgpc.model.families import FloatArray
from slurm_cdgpc.sim.closed_loop import NODE_GPUS, ClosedLoop, Fleet, synthetic_fleet

IntArray = NDArray[np.int64]

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
    topology: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """``topology``: (rows, racks per row) of power domains over the jobs' nodes
    (`RackedFleet`), each rack limited to 0.55–0.8 of its power at top clocks (drawn per rack)
    and each row to 0.7 of its own; None: the cluster alone."""
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
    racked = None if topology is None else RackedFleet(fleet, *topology, rng)
    loop = ClosedLoop(
        fleet,
        rng,
        settings,
        estimator,
        queued=True,
        silent_share=SILENT_SHARE,
        domains=None if racked is None else racked.limits,
    )

    step_ms, evaluations, errors = [], [], []
    for k in range(warmup + steps):
        record = loop.step(budget_w)
        if k >= warmup:
            step_ms.append(1e3 * record.step_s)
            evaluations.append(record.dual_evaluations)
            errors.append(record.plan_error_pct)

    f = loop.fleet
    domains = None if racked is None else racked.limits(loop)
    problem, nested = loop.controller.nested(
        loop.estimator, loop.job_state(), loop.t_s, budget_w, queue=loop.queue(), domains=domains
    )
    if nested is None:
        agreement = _modes_agree(lambda m: solve_price(problem, m, tol=AGREEMENT_TOL))
        reference = _reference_gap(problem, rng)
    else:
        agreement = _modes_agree(
            lambda m: _total_prices(
                solve_domain_prices(problem, nested, m, tol=AGREEMENT_TOL), nested
            )
        )
        reference = _domain_reference_gap(problem, nested, rng)
    return {
        "jobs": jobs,
        "gpus": int(f.gpus.sum()),
        "mode": mode,
        "model_family": family,
        "steps": steps,
        "domains": 0 if racked is None else len(racked.names),
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


def _modes_agree(solve: Callable[[str], DualResult | DomainResult]) -> dict[str, Any]:
    """Every mode's price (one, or one per domain) against Newton's."""
    prices, iterations, millis, failed = {}, {}, {}, {}
    for m in MODES:
        t0 = time.perf_counter()
        try:
            result = solve(m)
        except SolverError as e:  # the paper's step may not get there: say so, keep the rest
            failed[m] = one_line(e)
            continue
        finally:
            millis[m] = round(1e3 * (time.perf_counter() - t0), 1)
        prices[m] = result.price
        iterations[m] = result.evaluations
    if failed:
        return {"modes_agree": False, "modes_failed": failed, "modes_ms": millis}
    base = prices["newton"]
    finite = np.isfinite(base) & (base > 0)
    spread = max(
        float(np.max(np.abs(p[finite] - base[finite]) / base[finite])) if finite.any() else 0.0
        for p in prices.values()
    )
    same_status = all(np.array_equal(np.isfinite(p), np.isfinite(base)) for p in prices.values())
    same_binding = all(np.array_equal(p > 0, base > 0) for p in prices.values())
    return {
        "modes_agree": bool(same_status and same_binding and spread <= 1e-6),
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


class RackedFleet:
    """Power domains over the loop's packed placement (`ClosedLoop.queue`): ``rows`` rows of
    ``racks_per_row`` racks, the nodes dealt to racks in consecutive blocks; a rack's limit is
    0.55–0.8 of its jobs' power at top clocks (drawn once), a row's 0.7 of its own."""

    def __init__(
        self, fleet: Fleet, rows: int, racks_per_row: int, rng: np.random.Generator
    ) -> None:
        if rows < 1 or racks_per_row < 1:
            raise InputError("a topology needs at least one row of at least one rack")
        self.rows, self.racks = rows, rows * racks_per_row
        self.names = tuple(f"row{r}" for r in range(rows)) + tuple(
            f"rack{k}" for k in range(self.racks)
        )
        self.parent = np.concatenate(
            [np.full(rows, -1), np.repeat(np.arange(rows), racks_per_row)]
        ).astype(np.int64)
        nodes = int(-(-int(fleet.gpus.sum()) // NODE_GPUS)) + 1
        self.per_rack = -(-nodes // self.racks)
        rack_of = np.minimum(np.arange(nodes + 1) // self.per_rack, self.racks - 1)
        self.rack_of = rack_of
        top = fleet.plant().step(
            np.asarray([s.max_graphics_mhz for s in fleet.specs])[fleet.gpu_type]
        )
        rack_max = self._totals(fleet.gpus, fleet.gpus * top.power_w)[self.rows :]
        rack_limit = rng.uniform(0.55, 0.8, self.racks) * rack_max
        row_max = np.bincount(self.parent[self.rows :], weights=rack_max, minlength=rows)
        limit = np.concatenate([0.7 * row_max, rack_limit])
        self.limit_w = np.where(limit > 0, limit, 1.0)

    def _triples(self, gpus: IntArray) -> tuple[IntArray, IntArray, FloatArray]:
        """(domain, job row, share) for jobs laid end to end on 8-GPU nodes, in order."""
        start = np.concatenate([[0], np.cumsum(gpus)[:-1]])
        first = start // NODE_GPUS
        spans = (start + gpus - 1) // NODE_GPUS - first + 1
        rows = np.repeat(np.arange(spans.size), spans)
        nth = np.arange(rows.size) - np.repeat(np.cumsum(spans) - spans, spans)
        node = np.repeat(first, spans) + nth
        lo = np.maximum(start[rows], node * NODE_GPUS)
        hi = np.minimum(start[rows] + gpus[rows], (node + 1) * NODE_GPUS)
        share = (hi - lo) / gpus[rows]
        rack = self.rack_of[node]
        # a job's share of each rack (and row) it has GPUs under: pairs summed per (domain, job)
        dom = np.concatenate([self.rows + rack, self.parent[self.rows + rack]])
        job = np.concatenate([rows, rows])
        key, at = np.unique(dom * gpus.size + job, return_inverse=True)
        summed = np.bincount(at, weights=np.concatenate([share, share]))
        return key // gpus.size, key % gpus.size, np.minimum(summed, 1.0)

    def _totals(self, gpus: IntArray, job_w: FloatArray) -> FloatArray:
        dom, row, share = self._triples(gpus)
        totals = np.bincount(dom, weights=share * job_w[row], minlength=len(self.names))
        return totals.astype(np.float64)

    def limits(self, loop: ClosedLoop) -> DomainLimits:
        dom, row, share = self._triples(loop.fleet.gpus)
        return DomainLimits(
            self.names,
            self.limit_w,
            np.zeros(len(self.names)),
            dom.astype(np.int64),
            row.astype(np.int64),
            share,
            parent=self.parent,
        )


def _total_prices(result: DomainResult, nested: DomainSet) -> DomainResult:
    """The prices as each domain's jobs see them, π_d = λ_d + π_parent: a domain's own price
    is the small difference of two large ones where its parent's binds too, so it is
    compared relative to the price its jobs pay."""
    total = result.price.copy()
    for d in range(1, total.size):  # parents come first
        total[d] = total[d] + total[nested.parent[d]]
    return replace(result, price=total)


def _domain_reference_gap(
    problem: DualProblem, nested: DomainSet, rng: np.random.Generator
) -> dict[str, Any]:
    """cvxpy on a sample of the jobs, each domain's budget what our solution gives the sample
    there: with the same prices our answer is optimal for the sample, so the two must agree."""
    n = problem.gpus.shape[0]
    full = solve_domain_prices(problem, nested, "newton", tol=AGREEMENT_TOL)
    x_full, xm_full = problem.best_response(full.job_price(nested)[None, :])
    power = problem.power_w(x_full[0], xm_full[0])
    rows = np.sort(rng.choice(n, size=min(n, REFERENCE_JOBS), replace=False))
    new_row = np.full(n, -1, dtype=np.int64)
    new_row[rows] = np.arange(rows.size)
    keep = new_row[nested.job_row] >= 0
    dom, job, share = nested.domain[keep], new_row[nested.job_row[keep]], nested.share[keep]
    budget = np.bincount(dom, weights=share * power[nested.job_row[keep]], minlength=nested.size)
    used = np.unique(dom)
    remap = np.full(nested.size, -1, dtype=np.int64)
    remap[used] = np.arange(used.size)
    parent = nested.parent[used]
    sub_nested = DomainSet(
        remap[dom],
        job,
        share,
        budget[used].astype(np.float64),
        nested.depth[used],
        int(rows.size),
        np.where(parent < 0, -1, remap[parent]),
    )
    sub = problem.rows(rows, np.array([budget[0]]))
    ours_price = solve_domain_prices(sub, sub_nested, "newton", tol=AGREEMENT_TOL)
    x, x_m = sub.best_response(ours_price.job_price(sub_nested)[None, :])
    ours = float(sub.objective(x, x_m)[0])
    ref = solve_reference(sub, domains=sub_nested)
    return {
        "domains_binding": int(np.count_nonzero(full.price[1:] > 0)),
        "reference_jobs": int(rows.size),
        "reference_domains": int(used.size),
        "reference_gap_pct": 100.0 * (ours - ref.objective) / abs(ref.objective),
        "reference_ms": round(1e3 * ref.solve_s, 1),
        "reference_solver": ref.solver,
    }
