"""Nested power domains in the controller: one price per domain (`solve_domain_prices`), the
greedy fill within every domain, and `EconomicMPC.step` with `DomainLimits`."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from slurm_cdgpc.control.discrete import ClockGrid, discretise
from slurm_cdgpc.control.domains import DomainLimits
from slurm_cdgpc.control.dual import (
    MODES,
    DomainSet,
    DualProblem,
    StepStatus,
    solve_domain_prices,
    solve_price,
)
from slurm_cdgpc.control.empc import EconomicMPC, JobState
from slurm_cdgpc.control.reference import solve_reference
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.gpu.catalog import CATALOG
from slurm_cdgpc.model.estimator import EstimatorSettings, JobEstimator, JobStatics
from tests.unit.problems import build_problem

TOL = 1e-6


def _max_w(p: DualProblem) -> np.ndarray:
    return p.power_w(p.x_hi, p.xm_hi)


def _racks(p: DualProblem, rows: int, racks_per_row: int, limit: float, span: int = 0):
    """Jobs dealt round-robin over rows × racks_per_row racks; the first ``span`` jobs run half on
    their rack and half on the next one of the same row. Every rack's limit is ``limit`` of its
    jobs' power at top clocks, every row's 0.9 of its racks' limits summed."""
    n = p.gpus.shape[0]
    racks = rows * racks_per_row
    rack = np.arange(n) % racks
    dom, row, share = [], [], []
    for j in range(n):
        r = int(rack[j])
        if j < span:
            other = (r // racks_per_row) * racks_per_row + (r + 1) % racks_per_row
            dom += [rows + r, rows + other]
            row += [j, j]
            share += [0.5, 0.5]
        else:
            dom.append(rows + r)
            row.append(j)
            share.append(1.0)
        dom.append(r // racks_per_row)  # its row
        row.append(j)
        share.append(1.0)
    dom_a = np.array(dom, dtype=np.int64)
    row_a = np.array(row, dtype=np.int64)
    share_a = np.array(share)
    top = np.bincount(dom_a, weights=share_a * _max_w(p)[row_a], minlength=rows + racks)
    budget = top.copy()
    budget[rows:] *= limit
    for r in range(rows):
        budget[r] = 0.9 * budget[rows + r * racks_per_row : rows + (r + 1) * racks_per_row].sum()
    parent = np.concatenate([np.full(rows, -1), np.repeat(np.arange(rows), racks_per_row)])
    return DomainSet.nested(n, float(p.budget_w[0]), dom_a, row_a, share_a, budget, parent)


def _check_kkt(p: DualProblem, d: DomainSet, price: np.ndarray) -> np.ndarray:
    G = d.gradients(p, price)
    assert np.all(1e-9 * d.budget_w >= G), "a domain is over its budget"
    tight = price > 0
    assert np.all(G[tight] >= -TOL * d.budget_w[tight] * 1.0001), "a priced domain is not tight"
    return G


def test_a_rack_limit_binds_while_the_cluster_budget_does_not() -> None:
    p = build_problem(n=200, budget_fraction=2.0)  # the cluster: far above every job at top
    n = 200
    dom = np.zeros(n // 2, dtype=np.int64)
    rows = np.arange(n // 2, dtype=np.int64)
    rack_top = _max_w(p)[: n // 2].sum()
    d = DomainSet.nested(
        n,
        float(p.budget_w[0]),
        dom,
        rows,
        np.ones(n // 2),
        np.array([0.6 * rack_top]),
        np.array([-1]),
    )
    result = solve_domain_prices(p, d, "newton", TOL)
    assert result.status == (StepStatus.SLACK, StepStatus.BINDING)
    G = _check_kkt(p, d, result.price)
    assert G[0] < 0
    x, _ = p.best_response(result.job_price(d)[None, :])
    # the rack's jobs slow down; the others keep their top clocks
    assert np.all(x[0, n // 2 :] == p.x_hi[n // 2 :])
    assert np.mean(x[0, : n // 2]) < 0.9


@pytest.mark.parametrize("limit", [0.5, 0.8])
def test_modes_agree_on_every_price_of_three_levels(limit: float) -> None:
    p = build_problem(n=240, budget_fraction=0.6, seed=3)
    d = _racks(p, rows=2, racks_per_row=3, limit=limit, span=30)
    prices = {}
    for mode in MODES:
        r = solve_domain_prices(p, d, mode, TOL)
        _check_kkt(p, d, r.price)
        prices[mode] = r.price
    ref = prices["newton"]
    assert (ref > 0).sum() >= 2  # the cluster and at least one domain bind
    for mode in ("bisection", "gradient"):
        # equal prices wherever one binds; the window of G (tol·B) bounds how far they may be
        assert np.allclose(prices[mode], ref, rtol=1e-4, atol=1e-9 * ref.max()), mode


def test_a_domain_with_no_job_keeps_a_zero_price_in_every_mode() -> None:
    p = build_problem(n=100, budget_fraction=0.5, seed=4)
    d = _racks(p, rows=1, racks_per_row=2, limit=0.7)
    empty = DomainSet.nested(
        100,
        float(p.budget_w[0]),
        d.domain[d.depth[d.domain] > 0] - 1,
        d.job_row[d.depth[d.domain] > 0],
        d.share[d.depth[d.domain] > 0],
        np.concatenate([d.budget_w[1:], [1e3]]),
        np.concatenate([d.parent[1:] - 1, [-1]]).clip(-1),
    )
    prices = [solve_domain_prices(p, empty, mode, TOL).price for mode in MODES]
    assert all(price[-1] == 0.0 for price in prices)
    assert np.allclose(prices[2], prices[0], rtol=1e-4)


def test_newton_takes_few_evaluations_and_a_warm_start_fewer() -> None:
    p = build_problem(n=400, budget_fraction=0.6, seed=5)
    d = _racks(p, rows=2, racks_per_row=4, limit=0.6, span=40)
    cold = solve_domain_prices(p, d, "newton", TOL)
    warm = solve_domain_prices(p, d, "newton", TOL, warm_price=cold.price * 1.01)
    assert cold.evaluations < 200
    assert warm.evaluations < cold.evaluations


@pytest.mark.parametrize("change", [1.0, 0.97, 1.03])
def test_a_warm_newton_solve_prices_every_domain_at_once(change: float) -> None:
    """The next step's solve (warm, budgets moved by ``change``) settles in a few evaluations
    with no sweep, split jobs included, at the prices the sweeps reach from cold."""
    p = build_problem(n=400, budget_fraction=0.6, seed=5)
    d = _racks(p, rows=2, racks_per_row=4, limit=0.6, span=40)
    # the cluster, one row and three racks (two with split jobs) bind
    budget = d.budget_w.copy()
    budget[[3, 4, 8]] *= [0.8, 0.85, 0.8]
    budget[2] *= 0.95
    budget[0] = 0.98 * (budget[1] + budget[2])
    d, p = replace(d, budget_w=budget), replace(p, budget_w=budget[:1])
    last = solve_domain_prices(p, d, "newton", TOL)
    moved = replace(d, budget_w=d.budget_w * change)
    moved_p = replace(p, budget_w=p.budget_w * change)
    warm = solve_domain_prices(moved_p, moved, "newton", 1e-9, warm_price=last.price)
    swept = solve_domain_prices(moved_p, moved, "bisection", 1e-9)
    assert warm.sweeps == 0
    assert warm.evaluations <= 6
    G = moved.gradients(moved_p, warm.price)
    assert np.all(G <= 0)
    binding = warm.price > 0
    assert binding[0] and binding.sum() >= 4
    assert np.all(G[binding] >= -1e-9 * moved.budget_w[binding])
    assert np.array_equal(binding, swept.price > 0)
    assert np.allclose(warm.price, swept.price, rtol=1e-5, atol=1e-9 * warm.price.max())


def test_newton_agrees_with_the_sweeps_on_jobs_off_the_usual_paths() -> None:
    """Jobs with GPUs under a row but in none of its racks, and a job under a rack whose row
    lists it with a smaller share: every membership counts as it is given."""
    p = build_problem(n=200, budget_fraction=0.6, seed=8)
    d = _racks(p, rows=2, racks_per_row=2, limit=0.6, span=20)
    rack = d.depth[d.domain] == 2
    drop = rack & (d.job_row >= 180)  # the last 20 jobs: under their row alone
    share = np.where(~rack & (d.job_row == 100), 0.5, d.share)  # job 100: half under its row
    odd = replace(d, domain=d.domain[~drop], job_row=d.job_row[~drop], share=share[~drop])
    last = solve_domain_prices(p, odd, "newton", 1e-9)
    warm = solve_domain_prices(p, odd, "newton", 1e-9, warm_price=last.price * 1.02)
    swept = solve_domain_prices(p, odd, "bisection", 1e-9)
    assert warm.sweeps == 0
    assert np.allclose(warm.price, swept.price, rtol=1e-5, atol=1e-9 * warm.price.max())
    assert np.all(odd.gradients(p, warm.price) <= 0)


@pytest.mark.parametrize("family", ["bent", "linear"])
def test_matches_the_cvxpy_reference_with_domains(family: str) -> None:
    p = build_problem(n=60, family=family, budget_fraction=0.6, seed=7)
    d = _racks(p, rows=2, racks_per_row=2, limit=0.75, span=10)
    r = solve_domain_prices(p, d, "newton", 1e-9)
    assert all(s is not StepStatus.INFEASIBLE for s in r.status)
    x, xm = p.best_response(r.job_price(d)[None, :])
    ours = float(p.objective(x, xm)[0])
    ref = solve_reference(p, domains=d)
    assert ours == pytest.approx(ref.objective, rel=1e-4)


def test_without_domains_below_the_cluster_it_is_the_one_price_solve() -> None:
    p = build_problem(n=300, budget_fraction=0.5, seed=2)
    empty = np.zeros(0, dtype=np.int64)
    d = DomainSet.nested(300, float(p.budget_w[0]), empty, empty, np.zeros(0), np.zeros(0), empty)
    nested = solve_domain_prices(p, d, "newton", TOL)
    flat = solve_price(p, "newton", TOL)
    assert nested.price[0] == pytest.approx(flat.price[0], rel=1e-3)


def test_a_domain_that_cannot_fit_sends_its_jobs_to_their_lowest_clocks_only() -> None:
    p = build_problem(n=100, budget_fraction=0.9)
    lowest = p.power_w(p.x_lo, p.xm_lo)[:10].sum()
    d = DomainSet.nested(
        100,
        float(p.budget_w[0]),
        np.zeros(10, dtype=np.int64),
        np.arange(10, dtype=np.int64),
        np.ones(10),
        np.array([0.5 * lowest]),
        np.array([-1]),
    )
    r = solve_domain_prices(p, d, "newton", TOL)
    assert r.status[1] is StepStatus.INFEASIBLE
    x, _ = p.best_response(r.job_price(d)[None, :])
    assert np.all(x[0, :10] == p.x_lo[:10])
    assert np.all(x[0, 10:] > p.x_lo[10:])


def test_the_greedy_fill_never_overspends_a_domain() -> None:
    grid = ClockGrid.from_tables([("A100", CATALOG["A100-SXM4-80GB"].clocks)], min_fraction=0.0)
    rng = np.random.default_rng(0)
    for seed in range(5):
        p = build_problem(n=150, budget_fraction=0.7, seed=seed, gddr_share=0.0)
        p = replace(p, x_lo=np.full(150, 0.3))
        d = _racks(p, rows=1, racks_per_row=3, limit=0.55, span=20)
        r = solve_domain_prices(p, d, "newton", TOL)
        x, xm = p.best_response(r.job_price(d)[None, :])
        plan = discretise(p, grid, np.zeros(150, dtype=np.int64), x[0], xm[0], 8, d)
        assert np.all(d.totals(plan.job_power_w) <= d.budget_w * (1 + 1e-12))
        assert plan.upgrades > 0 or rng is None


def test_domain_limits_refuse_what_they_cannot_mean() -> None:
    f, i = np.zeros(0), np.zeros(0, dtype=np.int64)
    with pytest.raises(InputError, match="positive number of watts"):
        DomainLimits(("r1",), np.array([-5.0]), np.zeros(1), i, i, f)
    with pytest.raises(InputError, match=r"share of a power domain must be in \(0, 1\]"):
        DomainLimits(
            ("r1",),
            np.ones(1),
            np.zeros(1),
            np.zeros(1, np.int64),
            np.zeros(1, np.int64),
            np.array([1.5]),
        )
    with pytest.raises(InputError, match="parent must come before it"):
        DomainLimits(("r1", "r2"), np.ones(2), np.zeros(2), i, i, f, parent=np.array([1, -1]))
    with pytest.raises(InputError, match="names no known domain"):
        DomainLimits(
            ("r1",), np.ones(1), np.zeros(1), np.array([3]), np.zeros(1, np.int64), np.ones(1)
        )


def _controller_jobs(n: int) -> tuple[EconomicMPC, JobEstimator, JobState]:
    spec = CATALOG["A100-SXM4-80GB"]
    grid = ClockGrid.from_tables([(spec.name, spec.clocks)], min_fraction=0.0)
    mpc = EconomicMPC(grid)
    est = JobEstimator(EstimatorSettings())
    est.add_jobs(JobStatics.of([spec], np.zeros(n, dtype=np.intp), np.full(n, 8, dtype=np.int64)))
    # a few intervals of measurements at several clocks teach each model
    rng = np.random.default_rng(1)
    for _ in range(6):
        f = rng.uniform(0.6, 1.0, n)
        x, xm = f, np.ones(n)
        power = 90 + 310 * f**2.2 + rng.normal(0, 1, n)
        time_s = 0.2 / f + 0.05
        est.observe(x, xm, power, time_s)
    jobs = JobState(np.zeros(n, dtype=np.int64), np.full(n, 1e5), np.full(n, 1e5))
    return mpc, est, jobs


def test_the_controller_holds_a_rack_limit_the_cluster_budget_does_not_bind() -> None:
    n = 40
    mpc, est, jobs = _controller_jobs(n)
    top_w = 8 * 400.0 * n
    rack = np.arange(n // 2, dtype=np.int64)
    limit_w = 0.7 * 8 * 400.0 * n / 2
    domains = DomainLimits(
        ("rack1",),
        np.array([limit_w]),
        np.array([0.0]),
        np.zeros(n // 2, np.int64),
        rack,
        np.ones(n // 2),
    )
    flat = EconomicMPC(mpc.grid).step(est, jobs, 0.0, 2.0 * top_w)
    d = mpc.step(est, jobs, 0.0, 2.0 * top_w, domains=domains)
    assert d.status is StepStatus.SLACK  # the cluster does not bind
    assert d.domain_price[0] > 0
    assert d.domain_planned_w[0] <= limit_w
    assert d.domain_planned_w[0] == pytest.approx(d.job_power_w[: n // 2].sum())
    assert np.all(d.graphics_mhz[: n // 2] < flat.graphics_mhz[: n // 2])
    assert np.all(d.graphics_mhz[n // 2 :] == flat.graphics_mhz[n // 2 :])
