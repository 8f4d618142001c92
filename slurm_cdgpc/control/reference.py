"""The same continuous problem, stated for cvxpy: the reference our dual solvers must match.

Slow (a generic interior-point solve), which is the point of the decomposition: for small
instances, tests and `bench controller` only. The controller's math: never reaches `store/`,
`transport/`, `agent/`, `coordinator/` or `cli/` (`tests/unit/test_import_graph.py`). Design:
DESIGN.md, "Controller" (3, Price); tests: `tests/unit/test_control_dual.py`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import cvxpy as cp
import numpy as np
import scipy.sparse

from slurm_cdgpc.control.dual import DomainSet, DualProblem
from slurm_cdgpc.errors import SolverError
from slurm_cdgpc.model.families import BentPower, CubicPower, FloatArray, LinearPower


@dataclass(frozen=True)
class ReferenceSolution:
    x: FloatArray
    x_m: FloatArray
    objective: float
    solve_s: float
    solver: str


def _core_power(problem: DualProblem, x: cp.Variable) -> cp.Expression:
    a = problem.core_theta
    fam = problem.family
    if isinstance(fam, LinearPower):
        return cp.multiply(a[:, 0], x)
    if isinstance(fam, BentPower):
        return cp.multiply(a[:, 0], cp.maximum(x, cp.multiply(1.0 / problem.knee_x**2, x**3)))
    if isinstance(fam, CubicPower):
        return cp.multiply(a[:, 0], x) + cp.multiply(a[:, 1], x**3)
    raise SolverError(f"no cvxpy form for model family {fam.name!r}")


def solve_reference(
    problem: DualProblem, step: int = 0, domains: DomainSet | None = None
) -> ReferenceSolution:
    """Solve horizon step ``step`` of ``problem`` with cvxpy (Clarabel):

        minimise   Σ_n w_n (b_c/x_n + b_m m_n/x_m,n + b_e)
        subject to Σ_n g_n P_n(x_n, x_m,n) ≤ B,   x_lo ≤ x ≤ x_hi,   x_m,lo ≤ x_m ≤ x_m,hi

    and, with ``domains``, Σ_n s_dn g_n P_n ≤ B_d for every domain d (the cluster's row is B).

    P is convex in the clocks for every family (non-negative clock coefficients), so the problem
    is DCP and any conic solver gives the global optimum.
    """
    n = problem.gpus.shape[0]
    w = problem.weight[step]
    b = problem.time_theta
    mask = problem.mem_mask > 0
    x = cp.Variable(n)
    x_m = cp.Variable(n)
    time_terms = cp.multiply(w * b[:, 0], cp.inv_pos(x)) + cp.multiply(
        w * b[:, 1] * mask, cp.inv_pos(x_m)
    )
    power = cp.multiply(
        problem.gpus,
        _core_power(problem, x)
        + cp.multiply(problem.power_theta[:, -2] * mask, x_m)
        + problem.power_theta[:, -1],
    )
    constraints = [
        cp.sum(power) <= problem.budget_w[step],
        *_domain_constraints(power, domains),
        x >= problem.x_lo,
        x <= problem.x_hi,
        x_m >= problem.xm_lo,
        x_m <= problem.xm_hi,
    ]
    prob = cp.Problem(cp.Minimize(cp.sum(time_terms) + float(np.sum(w * b[:, 2]))), constraints)
    t0 = time.perf_counter()
    try:
        prob.solve(solver=cp.CLARABEL)
    except cp.error.SolverError as e:
        raise SolverError(f"reference solver failed: {e}") from e
    elapsed = time.perf_counter() - t0
    if prob.status not in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE) or x.value is None:
        raise SolverError(f"reference solver ended with status {prob.status}")
    xv = np.clip(np.asarray(x.value, dtype=np.float64), problem.x_lo, problem.x_hi)
    xmv = np.clip(np.asarray(x_m.value, dtype=np.float64), problem.xm_lo, problem.xm_hi)
    return ReferenceSolution(
        x=xv, x_m=xmv, objective=float(prob.value), solve_s=elapsed, solver="CLARABEL"
    )


def _domain_constraints(power: cp.Expression, domains: DomainSet | None) -> list[cp.Constraint]:
    if domains is None:
        return []
    share = scipy.sparse.csr_matrix(
        (domains.share, (domains.domain, domains.job_row)), shape=(domains.size, domains.jobs)
    )
    return [share @ power <= domains.budget_w]
