from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_cdgpc.control.discrete import ClockGrid, discretise
from slurm_cdgpc.control.dual import DualProblem, solve_price
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


def _fleet_problem(n: int, seed: int, fraction: float) -> tuple[DualProblem, np.ndarray]:
    """A problem whose bounds are exactly the grid's (as the controller builds it)."""
    grid = _grid()
    base = build_problem(n=n, seed=seed, budget_fraction=fraction, gddr_share=0.3)
    types = (base.mem_mask > 0).astype(np.int64)
    g_top, m_top = grid.top_mhz(types)
    g_lo, m_lo = grid.bottom_mhz(types)
    problem = DualProblem(
        base.family, base.gpus, base.power_theta, base.time_theta, base.weight, base.knee_x,
        base.mem_mask, g_lo / g_top, np.ones(n), m_lo / m_top, np.ones(n), base.budget_w,
    )  # fmt: skip
    return problem, types


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 400),
    seed=st.integers(0, 10_000),
    fraction=st.floats(0.0, 1.1),
)
def test_budget_is_never_exceeded_and_clocks_are_supported(
    n: int, seed: int, fraction: float
) -> None:
    grid = _grid()
    problem, types = _fleet_problem(n, seed, fraction)
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
