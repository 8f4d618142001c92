"""From continuous clocks to the clocks a GPU accepts: `ClockGrid` and `discretise`.

The controller's math: never reaches `store/`, `transport/`, `agent/`, `coordinator/` or `cli/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Controller" (5, Clocks); tests:
`tests/unit/test_control_discrete.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from slurm_cdgpc.control.dual import DomainSet, DualProblem
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.families import FloatArray
from slurm_cdgpc.wire.board import ClockTable

IntArray = NDArray[np.int64]


@dataclass(frozen=True)
class ClockGrid:
    """The supported clocks of every GPU type in the fleet, padded into arrays.

    ``graphics_mhz[t, m, i]``: the i-th lowest graphics clock the controller may use on type t
    with its m-th lowest memory clock (padding: a huge value); ``memory_mhz[t, m]`` likewise.
    Clocks below ``min_fraction`` of a type's top graphics clock are left out: below the
    efficient range a GPU takes longer *and* draws more energy per iteration.
    """

    names: tuple[str, ...]
    graphics_mhz: IntArray  # (T, M, G)
    graphics_count: IntArray  # (T, M)
    memory_mhz: IntArray  # (T, M)
    memory_count: IntArray  # (T,)

    @staticmethod
    def from_tables(
        tables: Sequence[tuple[str, ClockTable]], min_fraction: float = 0.5
    ) -> ClockGrid:
        if not tables:
            raise InputError("a clock grid needs at least one GPU type")
        if not 0.0 <= min_fraction < 1.0:
            raise InputError(f"min_fraction must be in [0, 1), got {min_fraction}")
        per_type: list[list[np.ndarray]] = []
        mems: list[list[int]] = []
        for _, table in tables:
            top = max(table.graphics_for(m)[0] for m in table.memory_mhz)
            rows, mem_levels = [], []
            for m in sorted(table.memory_mhz):
                g = np.array(sorted(table.graphics_for(m)), dtype=np.int64)
                keep = g[g >= min_fraction * top]
                if keep.size:  # a memory clock with no efficient graphics clock is an idle state
                    rows.append(keep)
                    mem_levels.append(m)
            per_type.append(rows)
            mems.append(mem_levels)
        T = len(tables)
        M = max(len(m) for m in mems)
        G = max(r.size for rows in per_type for r in rows)
        pad = np.iinfo(np.int64).max // 4
        graphics = np.full((T, M, G), pad, dtype=np.int64)
        g_count = np.zeros((T, M), dtype=np.int64)
        memory = np.full((T, M), pad, dtype=np.int64)
        for t, rows in enumerate(per_type):
            memory[t, : len(mems[t])] = mems[t]
            for m, r in enumerate(rows):
                graphics[t, m, : r.size] = r
                g_count[t, m] = r.size
        m_count = np.array([len(m) for m in mems], dtype=np.int64)
        return ClockGrid(tuple(n for n, _ in tables), graphics, g_count, memory, m_count)

    def floored(self, min_fraction: float) -> ClockGrid:
        """The same grid without the clocks below ``min_fraction`` of each type's top clock."""
        if min_fraction <= 0.0:
            return self
        tables = []
        for t, name in enumerate(self.names):
            memory = [int(m) for m in self.memory_mhz[t, : self.memory_count[t]]]
            graphics = {  # ClockTable lists clocks descending
                m: tuple(int(g) for g in self.graphics_mhz[t, i, : self.graphics_count[t, i]])[::-1]
                for i, m in enumerate(memory)
            }
            table = ClockTable(memory_mhz=tuple(memory[::-1]), graphics_mhz=graphics)
            tables.append((name, table))
        return ClockGrid.from_tables(tables, min_fraction=min_fraction)

    def type_index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise InputError(f"GPU type {name!r} is not in the controller's clock grid") from None

    def top_mhz(self, types: IntArray) -> tuple[FloatArray, FloatArray]:
        """Top graphics and memory clock per job (the normalisation of x and x_m)."""
        every = np.arange(self.memory_count.size)
        m_top = self.memory_count - 1
        g_top = self.graphics_count[every, m_top] - 1
        graphics = self.graphics_mhz[every, m_top, g_top].astype(np.float64)
        return graphics[types], self.memory_mhz[every, m_top].astype(np.float64)[types]

    def bottom_mhz(self, types: IntArray) -> tuple[FloatArray, FloatArray]:
        """Lowest graphics clock the controller may use, and the lowest memory clock.

        The graphics floor is the highest of the per-memory-clock lowest levels, so that any
        continuous clock at or above it floors to a level at or below it whatever the memory
        clock (the budget argument of the floor step needs that).
        """
        lowest = np.where(
            np.arange(self.graphics_mhz.shape[1]) < self.memory_count[:, None],
            self.graphics_mhz[:, :, 0],
            0,
        ).max(axis=1)
        return lowest[types].astype(np.float64), self.memory_mhz[types, 0].astype(np.float64)


@dataclass(frozen=True)
class DiscretePlan:
    graphics_mhz: IntArray
    memory_mhz: IntArray
    x: FloatArray  # normalised clocks actually planned
    x_m: FloatArray
    job_power_w: FloatArray  # predicted g P per job at the planned clocks
    upgrades: int  # one-level upgrades the greedy fill took


def _floor_index(table: IntArray, counts: IntArray, key: IntArray, mhz: FloatArray) -> IntArray:
    """Per job, the index of the highest level ≤ mhz (0 if none) in row ``key`` of ``table``.

    The levels are whole MHz, so a level is ≤ mhz exactly when it is ≤ ⌊mhz⌋: one lookup per
    job in a table of every row's index at every whole MHz from one below its lowest level
    (``lo``) to the highest.
    """
    real = table[np.arange(table.shape[1]) < counts[:, None]]
    lo, hi = int(real.min()) - 1, int(real.max())
    every_mhz = np.arange(lo, hi + 1)
    below = np.stack(
        [
            np.searchsorted(table[k, : counts[k]], every_mhz, side="right")
            for k in range(counts.size)
        ]
    )
    index = np.clip(below - 1, 0, counts[:, None] - 1)
    # NaN as a search takes it: above every level
    f = np.maximum(np.fmin(np.floor(mhz * (1 + 1e-12)), hi), lo).astype(np.int64)
    found: IntArray = index[key, f - lo]
    return found


def discretise(
    problem: DualProblem,
    grid: ClockGrid,
    types: IntArray,
    x: FloatArray,
    x_m: FloatArray,
    max_rounds: int = 8,
    domains: DomainSet | None = None,
    fixed: NDArray[np.bool_] | None = None,
    held_at_limit: bool = True,
) -> DiscretePlan:
    """Floor the step-0 continuous clocks to supported levels, then fill the budget greedily.

    1. Floor every job's clocks to the highest supported level at or below the continuous
       optimum. Power is increasing in the clock, so the plan stays within budget.
    2. Greedy fill: rank one-level upgrades by marginal benefit over marginal cost,
       w (T(x) − T(x⁺)) / (g (P(x⁺) − P(x))), and take them in that order while the leftover
       budget lasts; repeat for up to ``max_rounds`` rounds (a job may climb more than one level).
       With ``domains``, an upgrade is taken only where every domain above the job has room for
       its share of it after every better-ranked upgrade in that domain (`_fits_domains`).
       Jobs whose clock is ``fixed`` (a serving job at its floor) are never upgraded.

    ``held_at_limit``: above a job's ``x_hi`` (the clock where its power limit binds,
    `EconomicMPC._bounded`) the firmware holds it at that clock, so a lock above buys no speed
    and draws no more power. A job then climbs at most to the first level at or above its
    ``x_hi``, and every level is evaluated at min(level, x_hi): the plan counts a job held by
    its limit at what it draws there, not at what its model says an unheld job would draw at
    the lock. False: levels are evaluated as they are, up to the top.

    Vectorised over jobs; the per-type loops run over a handful of GPU types.
    """
    g_top, m_top = grid.top_mhz(types)
    w = problem.weight[0]
    budget = float(problem.budget_w[0])
    # 1. floor: memory first, then graphics within that memory clock's list
    im = _floor_index(grid.memory_mhz, grid.memory_count, types, x_m * m_top)
    T, M, G = grid.graphics_mhz.shape
    row = types * M + im
    ig = _floor_index(
        grid.graphics_mhz.reshape(T * M, G), grid.graphics_count.reshape(T * M), row, x * g_top
    )
    n_g = grid.graphics_count.reshape(T * M)[row]
    # each job's graphics levels in the flat grid: first[n] + ig; the memory clock stays put
    levels, first = grid.graphics_mhz.reshape(-1), row * G
    xmf = grid.memory_mhz[types, im] / m_top
    xf = levels[first + ig] / g_top
    x_hi = problem.x_hi if held_at_limit else np.full(types.shape[0], np.inf)
    runs_at = np.minimum(xf, x_hi)  # where each job runs: its lock, or where its limit holds it
    power = problem.power_w(runs_at, xmf)
    time = problem.time_s(runs_at, xmf)
    leftover = budget - power.sum()
    upgrades = 0
    # each job's upgrade by one level (none: cost +inf), computed again only for the jobs that
    # climbed: the others' cost and ratio stay what they were
    n = ig.size

    def climbs(at: IntArray | slice) -> NDArray[np.bool_]:
        """Whether the jobs ``at`` have a level above theirs that buys anything: not past the
        top, and not past the first level at or above their ``x_hi``."""
        below_hi = levels[first[at] + ig[at]] / g_top[at] < x_hi[at] - _SAME_X
        climbing: NDArray[np.bool_] = (ig[at] + 1 < n_g[at]) & below_hi
        return climbing

    can = climbs(slice(None))
    if fixed is not None:
        can &= ~fixed
    d_power, ratio, time_up = np.empty(n), np.empty(n), np.empty(n)

    def upgrade(at: IntArray | slice) -> None:
        """Cost, ratio and time of the next level of the jobs ``at`` (a slice: every job)."""
        sub = problem if isinstance(at, slice) else problem.rows(at)
        xu = levels[first[at] + np.where(can[at], ig[at] + 1, ig[at])] / g_top[at]
        xu = np.minimum(xu, x_hi[at])
        cost = np.where(can[at], sub.power_w(xu, xmf[at]) - power[at], np.inf)
        t_up = sub.time_s(xu, xmf[at])
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio[at] = np.where(cost > 0, w[at] * (time[at] - t_up) / cost, np.inf)
        d_power[at], time_up[at] = cost, t_up

    upgrade(slice(None))
    # 2. greedy fill, one graphics level per job per round
    for _ in range(max_rounds):
        if not can.any() or leftover <= 0:
            break
        cand = np.flatnonzero(can & (d_power <= leftover))
        if cand.size == 0:
            break
        order = _best_first(cand, ratio[cand], d_power, leftover)
        spent = np.cumsum(d_power[order])
        take = order[np.flatnonzero(spent <= leftover)]
        if domains is not None and take.size:
            room = domains.budget_w - domains.totals(power)
            take = take[np.flatnonzero(_fits_domains(domains, take, d_power, room))]
            if take.size == 0:
                break  # every upgrade left waits on a full domain: another round is the same
        if take.size == 0:
            break
        leftover -= float(d_power[take].sum())
        ig[take] += 1
        power[take] += d_power[take]
        time[take] = time_up[take]
        upgrades += int(take.size)
        can[take] = climbs(take)
        upgrade(take if take.size * _FEW < n else slice(None))
    graphics = levels[first + ig]
    xf = graphics / g_top
    return DiscretePlan(
        graphics_mhz=graphics,
        memory_mhz=grid.memory_mhz[types, im],
        x=xf,
        x_m=xmf,
        job_power_w=problem.power_w(np.minimum(xf, x_hi), xmf),
        upgrades=upgrades,
    )


def _fits_domains(
    domains: DomainSet, order: IntArray, d_power: FloatArray, room_w: FloatArray
) -> NDArray[np.bool_]:
    """Which upgrades of ``order`` (best first) every domain above them has room for, counting
    in each domain its share of every upgrade ranked before: a conservative prefix rule, so
    no domain is ever overspent."""
    rank = np.full(domains.jobs, -1, dtype=np.int64)
    rank[order] = np.arange(order.size)
    # index arrays, not masks, pick the entries: a mask of mixed density compresses slowly
    sel = np.flatnonzero(rank[domains.job_row] >= 0)
    dom, row = domains.domain[sel], domains.job_row[sel]
    cost = domains.share[sel] * d_power[row]
    # a domain with room for every upgrade asked of it needs no order: only the others sort
    asked = np.bincount(dom, weights=cost, minlength=domains.size)
    tight = np.flatnonzero((asked > room_w)[dom])
    dom, row, cost = dom[tight], row[tight], cost[tight]
    # per domain, in rank order: one sort of a key unique per (domain, job)
    by = np.argsort(dom * order.size + rank[row])
    dom, row, cost = dom[by], row[by], cost[by]
    cum = np.cumsum(cost)
    starts = np.searchsorted(dom, dom, side="left")
    before = np.where(starts > 0, cum[starts - 1], 0.0)
    within = (cum - before) <= room_w[dom]
    # a job fits where it fits in every domain above it
    short = np.bincount(row, weights=~within, minlength=domains.jobs)
    fits: NDArray[np.bool_] = short[order] == 0
    return fits


#: normalised clocks this close are the same level (whole MHz over a top clock of thousands)
_SAME_X = 1e-9
#: the jobs that climbed are evaluated alone while fewer than 1/_FEW of all: beyond, gathering
#: their rows costs more than evaluating every job
_FEW = 8
#: candidates ranked in full only when the best ones ranked first do not use up the leftover
_RANK_FIRST = 4096


def _best_first(
    cand: IntArray, ratio: FloatArray, d_power: FloatArray, leftover: float
) -> IntArray:
    """``cand`` by ratio, best first (ties in index order): the order a full stable sort
    gives, over as many as the leftover can take. The best `_RANK_FIRST` (and any tied with
    the last of them) are ranked first; where those fit together, the best 4, 16, ... times
    as many, until their upgrades in order cost more than the leftover (summed in that order,
    as the greedy fill spends them): every upgrade ranked after them costs > 0 (a finite ratio
    needs a cost > 0), so none of those is taken either."""
    best = _RANK_FIRST
    while cand.size > best:
        edge = np.partition(ratio, cand.size - best)[cand.size - best]
        top = np.flatnonzero(ratio >= edge)
        head: IntArray = cand[top][_descending(ratio[top])]
        if np.cumsum(d_power[head])[-1] > leftover:
            return head
        best *= 4
    ranked: IntArray = cand[_descending(ratio)]
    return ranked


def _descending(values: FloatArray) -> IntArray:
    """``np.argsort(-values, kind="stable")`` from the default sort, several times faster: the
    two differ only in the order of equal values, which is put back to index order."""
    if np.isnan(values).any():  # the stable sort puts NaNs last in index order
        return np.argsort(-values, kind="stable")
    order = np.argsort(-values)
    ranked = values[order]
    tied = ranked[1:] == ranked[:-1]
    if tied.any():
        after = np.concatenate(([False], tied))  # equal to the value before it
        run = np.cumsum(~after)  # each run of equal values, numbered
        at = np.flatnonzero(after | np.concatenate((tied, [False])))
        # each run's positions keep their place; the run's indices go into ascending order
        order[at] = order[at][np.argsort(run[at] * values.size + order[at])]
    return order
