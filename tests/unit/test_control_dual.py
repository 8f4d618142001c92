from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from slurm_cdgpc.control.dual import (
    MODES,
    DomainSet,
    DualProblem,
    StepStatus,
    _grouped,
    _nan_to_zero,
    solve_domain_prices,
    solve_price,
)
from slurm_cdgpc.control.reference import solve_reference
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.families import FAMILIES, power_family
from tests.unit.problems import build_problem


def _two_job_problem(weights: tuple[float, float], budget_w: float) -> DualProblem:
    """Two single-GPU jobs, P = 200 x (no idle term), T = 1/x: optimum known in closed form."""
    one = np.ones(2)
    return DualProblem(
        family=power_family("linear"),
        gpus=one,
        power_theta=np.array([[200.0, 0.0, 0.0], [200.0, 0.0, 0.0]]),
        time_theta=np.array([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]),
        weight=np.array([weights]),
        knee_x=one,
        mem_mask=np.zeros(2),
        x_lo=np.full(2, 0.1),
        x_hi=one,
        xm_lo=one,
        xm_hi=one,
        budget_w=np.array([budget_w]),
    )


@pytest.mark.parametrize("mode", MODES)
def test_tiny_problem_matches_its_analytic_optimum(mode: str) -> None:
    # KKT: w_n/x_n² = 200 λ and 200 (x_1 + x_2) = B
    #   →  x_n = B √w_n / (200 Σ √w),  λ = w_n / (200 x_n²)
    w = (1.0, 4.0)
    budget = 240.0
    problem = _two_job_problem(w, budget)
    result = solve_price(problem, mode, tol=1e-10)
    x, _ = problem.best_response(result.price)
    sqrt_w = np.sqrt(w)
    expected_x = budget * sqrt_w / (200.0 * sqrt_w.sum())
    np.testing.assert_allclose(x[0], expected_x, rtol=1e-8)
    assert result.price[0] == pytest.approx(w[0] / (200.0 * expected_x[0] ** 2), rel=1e-8)
    assert result.status == (StepStatus.BINDING,)


def test_modes_reach_the_same_price_on_the_feasible_side() -> None:
    problem = build_problem(n=3000, budget_fraction=[0.2, 0.45, 0.8])
    prices = {}
    for mode in MODES:
        result = solve_price(problem, mode, tol=1e-9)
        G = problem.gradient(result.price)
        assert np.all(G <= 0), mode
        assert np.all(-1e-9 * problem.budget_w <= G), mode
        prices[mode] = result.price
    np.testing.assert_allclose(prices["bisection"], prices["newton"], rtol=1e-6)
    np.testing.assert_allclose(prices["gradient"], prices["newton"], rtol=1e-6)


def test_newton_needs_far_fewer_evaluations_than_the_paper_step() -> None:
    problem = build_problem(n=2000)
    newton = solve_price(problem, "newton", tol=1e-6)
    gradient = solve_price(problem, "gradient", tol=1e-6)
    assert newton.evaluations <= 12
    assert gradient.evaluations > 5 * newton.evaluations


def test_warm_start_converges_faster() -> None:
    problem = build_problem(n=2000)
    cold = solve_price(problem, "gradient", tol=1e-6)
    warm = solve_price(problem, "gradient", tol=1e-6, warm_price=cold.price * 1.0001)
    assert warm.evaluations < cold.evaluations / 2


def test_slack_budget_runs_everything_at_top_clocks() -> None:
    problem = build_problem(budget_fraction=1.2)
    result = solve_price(problem, "newton")
    assert result.status == (StepStatus.SLACK,)
    assert result.price[0] == 0.0
    x, x_m = problem.best_response(result.price)
    np.testing.assert_array_equal(x[0], problem.x_hi)
    np.testing.assert_array_equal(x_m[0], problem.xm_hi)


def test_infeasible_budget_is_flagged_with_every_job_at_minimum() -> None:
    problem = build_problem(budget_fraction=-0.1)
    result = solve_price(problem, "bisection")
    assert result.status == (StepStatus.INFEASIBLE,)
    x, x_m = problem.best_response(result.price)
    np.testing.assert_array_equal(x[0], problem.x_lo)
    np.testing.assert_array_equal(x_m[0], problem.xm_lo)


def test_lipschitz_bound_holds() -> None:
    problem = build_problem(n=1000)
    L = problem.lipschitz()[0]
    star = solve_price(problem, "newton").price[0]
    rng = np.random.default_rng(3)
    for _ in range(50):
        a, b = star * rng.uniform(0.05, 5.0, 2)
        diff = abs(problem.gradient(np.array([a]))[0] - problem.gradient(np.array([b]))[0])
        assert diff <= L * abs(a - b) * (1 + 1e-9)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_closed_form_slope_matches_finite_differences(family: str) -> None:
    problem = build_problem(n=400, family=family)
    lam = solve_price(problem, "newton").price
    _, slope = problem.gradient_slope(lam)
    h = lam * 1e-6
    numeric = (problem.gradient(lam + h) - problem.gradient(lam - h)) / (2 * h)
    np.testing.assert_allclose(slope, numeric, rtol=2e-2)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_matches_the_cvxpy_reference(family: str) -> None:
    problem = build_problem(n=300, family=family, seed=5)
    result = solve_price(problem, "newton", tol=1e-9)
    x, x_m = problem.best_response(result.price)
    ours = problem.objective(x, x_m)[0]
    ref = solve_reference(problem)
    assert abs(ours - ref.objective) / ref.objective < 1e-6
    np.testing.assert_allclose(x[0], ref.x, atol=1e-4)


def test_bad_mode_and_tolerance_are_refused() -> None:
    problem = build_problem(n=10)
    with pytest.raises(InputError, match="unknown dual mode 'fast'"):
        solve_price(problem, "fast")
    with pytest.raises(InputError, match="tolerance must be positive"):
        solve_price(problem, "newton", tol=0.0)


def test_a_margin_re_solve_keeps_the_groups_and_answers_as_a_fresh_solve() -> None:
    """The re-solve with the exploration margin replaces only the budgets: it groups the jobs
    no second time (`_grouped`), and answers as a solve on copies of the membership does."""
    problem = build_problem(n=3000, seed=4, budget_fraction=0.3)
    n = 3000
    rack = np.arange(n) % 6
    split = np.arange(n) % 40 == 0  # half on the next rack of their row
    other = 3 * (rack // 3) + (rack + 1) % 3
    job = np.concatenate([np.arange(n), np.flatnonzero(split), np.arange(n)])
    dom = np.concatenate([2 + rack, 2 + other[split], rack // 3])
    share = np.concatenate([np.where(split, 0.5, 1.0), np.full(split.sum(), 0.5), np.ones(n)])
    top = np.bincount(dom, weights=share * problem.power_w(problem.x_hi, problem.xm_hi)[job])
    parent = np.array([-1, -1, 0, 0, 0, 1, 1, 1])
    cluster_w = float(problem.budget_w[0])
    limit = np.array([0.9, 0.9, 0.5, 0.6, 0.7, 0.5, 0.6, 0.7]) * top
    domains = DomainSet.nested(n, cluster_w, dom, job, share, limit, parent)
    first = solve_domain_prices(problem, domains)
    assert np.count_nonzero(first.price[1:] > 0) >= 2  # racks bind as well
    budget_w = domains.budget_w.copy()
    budget_w[0] *= 0.98
    copied = DomainSet(
        domains.domain.copy(), domains.job_row.copy(), domains.share.copy(), budget_w,
        domains.depth.copy(), n, domains.parent.copy(),
    )  # fmt: skip
    held = replace(problem, budget_w=budget_w[:1])
    fresh = solve_domain_prices(held, copied, warm_price=first.price)
    margin = replace(domains, budget_w=budget_w)
    assert _grouped(margin) is _grouped(domains)  # kept: the re-solve below reuses them
    again = solve_domain_prices(held, margin, warm_price=first.price)
    assert again.status[0] is StepStatus.BINDING
    np.testing.assert_array_equal(again.price, fresh.price)
    np.testing.assert_array_equal(again.roots, fresh.roots)


def test_nan_to_zero_is_numpys_nan_to_num() -> None:
    a = np.array([[1.5, np.nan, np.inf, -np.inf, -2.0, 0.0, 1e308]])
    np.testing.assert_array_equal(_nan_to_zero(a), np.nan_to_num(a))
    assert _nan_to_zero(a).shape == a.shape
