from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_cdgpc.control.discrete import (
    ClockGrid,
    _best_first,
    _descending,
    _fits_domains,
    _floor_index,
    discretise,
)
from slurm_cdgpc.control.dual import DomainSet, DualProblem, solve_domain_prices, solve_price
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.wire.board import ClockTable
from tests.unit.problems import build_problem

HBM = ClockTable(memory_mhz=(1593,), graphics_mhz={1593: tuple(range(1410, 209, -15))})
GDDR = ClockTable(  # A40-like: two working memory clocks and an idle one (405 MHz)
    memory_mhz=(7251, 5001, 405),
    graphics_mhz={
        7251: tuple(range(1740, 209, -15)),
        5001: tuple(range(1500, 209, -15)),
        405: tuple(range(645, 209, -15)),
    },
)


def _grid() -> ClockGrid:
    return ClockGrid.from_tables([("hbm", HBM), ("gddr", GDDR)], min_fraction=0.4)


def _fleet_problem(
    n: int, seed: int, fraction: float, held: float = 0.0
) -> tuple[DualProblem, np.ndarray]:
    """A problem whose bounds are exactly the grid's (as the controller builds it); the share
    ``held`` of its jobs held by their power limit at 0.7–1.0 of the top clock (``x_hi``)."""
    grid = _grid()
    base = build_problem(n=n, seed=seed, budget_fraction=fraction, gddr_share=0.3)
    types = (base.mem_mask > 0).astype(np.int64)
    g_top, m_top = grid.top_mhz(types)
    g_lo, m_lo = grid.bottom_mhz(types)
    rng = np.random.default_rng(seed)
    x_hi = np.where(rng.random(n) < held, rng.uniform(0.7, 1.0, n), 1.0)
    problem = DualProblem(
        base.family, base.gpus, base.power_theta, base.time_theta, base.weight, base.knee_x,
        base.mem_mask, g_lo / g_top, x_hi, m_lo / m_top, np.ones(n), base.budget_w,
    )  # fmt: skip
    return problem, types


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 400),
    seed=st.integers(0, 10_000),
    fraction=st.floats(0.0, 1.1),
    held=st.sampled_from([0.0, 0.3]),
)
def test_budget_is_never_exceeded_and_clocks_are_supported(
    n: int, seed: int, fraction: float, held: float
) -> None:
    grid = _grid()
    problem, types = _fleet_problem(n, seed, fraction, held)
    result = solve_price(problem, "newton")
    x, x_m = problem.best_response(result.price)
    plan = discretise(problem, grid, types, x[0], x_m[0])
    if result.status[0] != "infeasible":
        assert plan.job_power_w.sum() <= problem.budget_w[0] * (1 + 1e-12)
    for i in range(n):
        table = GDDR if types[i] else HBM
        table.check(int(plan.graphics_mhz[i]), int(plan.memory_mhz[i]))
        assert plan.graphics_mhz[i] >= 0.4 * (1740 if types[i] else 1410)


def test_greedy_fill_closes_the_gap_left_by_flooring() -> None:
    grid = _grid()
    problem, types = _fleet_problem(5000, 7, 0.45)
    result = solve_price(problem, "newton")
    x, x_m = problem.best_response(result.price)
    floored = discretise(problem, grid, types, x[0], x_m[0], max_rounds=0)
    filled = discretise(problem, grid, types, x[0], x_m[0])
    budget = problem.budget_w[0]
    floor_gap = (budget - floored.job_power_w.sum()) / budget
    fill_gap = (budget - filled.job_power_w.sum()) / budget
    assert floor_gap > 1e-3  # flooring alone leaves a visible share of the budget unused
    assert 0 <= fill_gap < 1e-4
    assert filled.upgrades > 0
    # every job stays within one level above its floor in this regime or climbs only by fill
    assert np.all(filled.graphics_mhz >= floored.graphics_mhz)


def test_floor_never_exceeds_the_continuous_clock() -> None:
    grid = _grid()
    problem, types = _fleet_problem(300, 3, 0.5)
    result = solve_price(problem, "newton")
    x, x_m = problem.best_response(result.price)
    plan = discretise(problem, grid, types, x[0], x_m[0], max_rounds=0)
    assert np.all(plan.x <= x[0] + 1e-12)


def test_idle_memory_clocks_are_not_offered_and_the_floor_holds_at_the_bottom() -> None:
    # the A40's 405 MHz memory clock only allows graphics clocks below the efficient range: a
    # graphics floor taken from it (645 MHz) would sit below the 7251 MHz list's lowest level, and
    # a clock between the two would floor *up*, over the budget
    grid = _grid()
    gddr = np.array([1], dtype=np.int64)
    assert 405 not in grid.memory_mhz[1]
    lowest = grid.bottom_mhz(gddr)[0][0]
    assert lowest == min(c for c in GDDR.graphics_for(7251) if c >= 0.4 * 1740)
    assert lowest >= min(c for c in GDDR.graphics_for(5001) if c >= 0.4 * 1740)


def test_min_fraction_drops_inefficient_low_clocks() -> None:
    grid = ClockGrid.from_tables([("hbm", HBM)], min_fraction=0.6)
    lowest = grid.bottom_mhz(np.array([0]))[0][0]
    assert lowest == min(c for c in HBM.graphics_for() if c >= 0.6 * 1410)


def test_unknown_type_and_bad_fraction_are_refused() -> None:
    grid = _grid()
    with pytest.raises(InputError, match="'B200' is not in the controller's clock grid"):
        grid.type_index("B200")
    with pytest.raises(InputError, match="min_fraction"):
        ClockGrid.from_tables([("hbm", HBM)], min_fraction=1.5)


def _racked(problem: DualProblem, seed: int) -> DomainSet:
    """The jobs dealt in blocks over 4 rows of 3 racks, every 50th half on the next rack; each
    rack limited to 0.6–0.8 of its power at top clocks, each row to 0.7 of its own."""
    rng = np.random.default_rng(seed)
    n, rows, racks = problem.gpus.shape[0], 4, 12
    rack = np.arange(n) * racks // n
    split = np.flatnonzero(np.arange(n) % 50 == 0)
    job = np.concatenate([np.arange(n), split])
    on = np.concatenate([rack, (rack[split] + 1) % racks])
    share = np.ones(job.size)
    share[split] = share[n:] = 0.5
    # each rack's row too, a job's shares summed per row
    key, at = np.unique((on // 3) * n + job, return_inverse=True)
    row_share = np.minimum(np.bincount(at, weights=share), 1.0)
    dom = np.concatenate([rows + on, key // n])
    job = np.concatenate([job, key % n])
    share = np.concatenate([share, row_share])
    top = np.bincount(dom, weights=share * problem.power_w(problem.x_hi, problem.xm_hi)[job])
    budget = np.concatenate([0.7 * top[:rows], rng.uniform(0.6, 0.8, racks) * top[rows:]])
    parent = np.concatenate([np.full(rows, -1), np.repeat(np.arange(rows), 3)])
    cluster_w = float(problem.budget_w[0])
    return DomainSet.nested(n, cluster_w, dom, job, share, budget, parent)


def _reference_plan(
    problem: DualProblem,
    grid: ClockGrid,
    types: np.ndarray,
    x: np.ndarray,
    x_m: np.ndarray,
    domains: DomainSet | None,
) -> tuple[np.ndarray, np.ndarray]:
    """`discretise` as first written: each job's floor searched in its own list, and in every
    round of the fill every job evaluated and every candidate ranked."""

    def floor(levels: np.ndarray, mhz: float) -> int:
        return int(np.clip(np.searchsorted(levels, mhz * (1 + 1e-12), "right") - 1, 0, None))

    g_top, m_top = grid.top_mhz(types)
    mem = [grid.memory_mhz[t, : grid.memory_count[t]] for t in types]
    im = np.array([floor(m, v) for m, v in zip(mem, x_m * m_top, strict=True)])
    n_g = grid.graphics_count[types, im]
    ig = np.array(
        [
            floor(grid.graphics_mhz[t, i, :c], v)
            for t, i, c, v in zip(types, im, n_g, x * g_top, strict=True)
        ]
    )

    def lock(ig: np.ndarray) -> np.ndarray:
        return grid.graphics_mhz[types, im, ig] / g_top

    def clocks(ig: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # a job runs at most at the clock its power limit allows, whatever its lock
        return np.minimum(lock(ig), problem.x_hi), grid.memory_mhz[types, im] / m_top

    power, time = problem.power_w(*clocks(ig)), problem.time_s(*clocks(ig))
    leftover = float(problem.budget_w[0]) - power.sum()
    for _ in range(8):
        can = (ig + 1 < n_g) & (lock(ig) < problem.x_hi)
        if not can.any() or leftover <= 0:
            break
        up = clocks(np.where(can, ig + 1, ig))
        d_power = np.where(can, problem.power_w(*up) - power, np.inf)
        time_up = problem.time_s(*up)
        cand = np.flatnonzero(can & (d_power <= leftover))
        gain = (problem.weight[0] * (time - time_up))[cand]
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(d_power[cand] > 0, gain / d_power[cand], np.inf)
        order = cand[np.argsort(-ratio, kind="stable")]
        take = order[np.cumsum(d_power[order]) <= leftover]
        if domains is not None and take.size:
            room = domains.budget_w - domains.totals(power)
            take = take[_fits_domains(domains, take, d_power, room)]
        if take.size == 0:
            break
        leftover -= float(d_power[take].sum())
        ig[take] += 1
        power[take] += d_power[take]
        time[take] = time_up[take]
    return grid.graphics_mhz[types, im, ig], grid.memory_mhz[types, im]


@pytest.mark.parametrize(
    ("seed", "racked", "held"), [(0, True, 0.0), (1, True, 0.3), (2, False, 0.0), (3, False, 0.3)]
)
def test_the_fill_takes_what_ranking_every_job_every_round_takes(
    seed: int, racked: bool, held: float
) -> None:
    """The fill evaluates again only the jobs that climbed and ranks only as far as the
    leftover reaches: the clocks are those of the plain way, bit for bit."""
    grid = _grid()
    problem, types = _fleet_problem(20_000, seed, 0.5, held)
    domains = _racked(problem, seed) if racked else None
    if domains is None:
        x, x_m = problem.best_response(solve_price(problem).price)
    else:
        result = solve_domain_prices(problem, domains)
        x, x_m = problem.best_response(result.job_price(domains)[None, :])
    plan = discretise(problem, grid, types, x[0], x_m[0], domains=domains)
    graphics, memory = _reference_plan(problem, grid, types, x[0], x_m[0], domains)
    assert plan.upgrades > 0
    np.testing.assert_array_equal(plan.graphics_mhz, graphics)
    np.testing.assert_array_equal(plan.memory_mhz, memory)


def test_a_job_held_by_its_power_limit_is_locked_one_level_past_it_and_counted_there() -> None:
    """Above the clock its power limit allows (x_hi) the firmware holds a job there: the fill
    takes it to the first level at or above x_hi, no higher, and the plan counts it at x_hi,
    not at what its model says an unheld job would draw at the lock."""
    grid = _grid()
    problem, types = _fleet_problem(400, 5, 1.1, held=0.5)  # room for every job at top
    x, x_m = problem.best_response(solve_price(problem).price)
    plan = discretise(problem, grid, types, x[0], x_m[0])
    g_top = grid.top_mhz(types)[0]
    held = problem.x_hi < 1.0
    assert 100 < held.sum() < 300
    for i in np.flatnonzero(held):
        table = GDDR if types[i] else HBM
        levels = np.array(sorted(table.graphics_for(int(plan.memory_mhz[i]))))
        first = levels[levels >= problem.x_hi[i] * g_top[i] - 1e-6].min()
        assert plan.graphics_mhz[i] == first
    assert np.all(plan.graphics_mhz[~held] == g_top[~held])
    at = np.minimum(plan.x, problem.x_hi)
    np.testing.assert_allclose(plan.job_power_w, problem.power_w(at, plan.x_m))
    unheld_w = problem.power_w(plan.x, plan.x_m)
    assert np.all(plan.job_power_w[held] < unheld_w[held])


def test_floor_index_is_each_rows_own_search() -> None:
    grid = _grid()
    T, M, G = grid.graphics_mhz.shape
    rng = np.random.default_rng(5)
    for table, counts in (
        (grid.graphics_mhz.reshape(T * M, G), grid.graphics_count.reshape(T * M)),
        (grid.memory_mhz, grid.memory_count),
    ):
        key = rng.integers(0, counts.size, 4000)  # with the rows of no level (HBM's padding)
        level = table[key, rng.integers(0, np.maximum(counts[key], 1))].astype(float)
        offset = rng.choice([0.0, 1e-9, -1e-9, -1e-12, -0.5, 0.5, -1.0, -400.0], key.size)
        mhz = np.where(counts[key] > 0, level, 1000.0) * (1 + offset) + offset
        mhz[:6] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e300]
        expected = [
            np.clip(np.searchsorted(table[k, : counts[k]], v * (1 + 1e-12), "right") - 1, 0, c - 1)
            for k, v, c in zip(key, mhz, counts[key], strict=True)
        ]
        np.testing.assert_array_equal(_floor_index(table, counts, key, mhz), expected)


def test_descending_is_the_stable_sort_of_the_negated_values() -> None:
    rng = np.random.default_rng(2)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 1.0, 0.0, -0.0, np.inf, 2.0, -np.inf])
    for values in (
        rng.random(5000),
        rng.integers(0, 30, 5000).astype(float),  # ties everywhere
        special,
        np.array([1.0, np.nan, 2.0, np.nan, 1.0]),
        np.zeros(0),
    ):
        np.testing.assert_array_equal(_descending(values), np.argsort(-values, kind="stable"))


@pytest.mark.parametrize("best", [1000, 4096, 16384, 65536, 100_000])
@pytest.mark.parametrize("more", [-3, 0, 3])
def test_best_first_ranks_as_far_as_a_full_ranking_takes(best: int, more: int) -> None:
    """Whether the leftover pays for a few less, exactly or a few more than the best 4096,
    16384 or 65536 upgrades (with those tied to the last), the upgrades taken in order are
    those of a full stable sort."""
    rng = np.random.default_rng(3)
    n = 100_000
    cand = np.sort(rng.choice(2 * n, n, replace=False))
    d_power = np.zeros(2 * n)
    d_power[cand] = rng.uniform(1.0, 10.0, n)
    ratio = np.round(rng.lognormal(size=n), 2)  # many ties
    free = rng.random(n) < 0.001  # an upgrade that costs nothing ranks first
    d_power[cand[free]], ratio[free] = 0.0, np.inf
    full = cand[np.argsort(-ratio, kind="stable")]
    tied = int(np.count_nonzero(ratio >= np.sort(ratio)[n - best]))
    paid = min(tied + more, n)
    leftover = float(np.cumsum(d_power[full])[paid - 1]) + 0.5

    def taken(order: np.ndarray) -> np.ndarray:
        return order[np.cumsum(d_power[order]) <= leftover]

    assert taken(full).size == paid
    np.testing.assert_array_equal(taken(_best_first(cand, ratio, d_power, leftover)), taken(full))
