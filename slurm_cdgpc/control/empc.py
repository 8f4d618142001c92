"""The economic MPC: `EconomicMPC.step` gives every running job its clocks, once an interval.

Every rule is a field of `ControllerSettings`, whose defaults are `config.ControlConfig`'s. The
controller's math: never reaches `store/`, `transport/`, `agent/`, `coordinator/` or `cli/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Controller"; tests:
`tests/unit/test_control_empc.py`, `tests/unit/test_one_brain.py`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np
from numpy.typing import NDArray

from slurm_cdgpc.config import ControlConfig
from slurm_cdgpc.control.discrete import ClockGrid, DiscretePlan, discretise
from slurm_cdgpc.control.domains import DomainLimits
from slurm_cdgpc.control.dual import (
    MODES,
    DomainResult,
    DomainSet,
    DualProblem,
    DualResult,
    StepStatus,
    solve_domain_prices,
    solve_price,
)
from slurm_cdgpc.control.guard_rail import limit_gain
from slurm_cdgpc.control.limits import LimitShare, NewJobShare
from slurm_cdgpc.control.overdraw import ClusterDraw, Overdraw
from slurm_cdgpc.control.ramp import Ramp
from slurm_cdgpc.control.serving import ServingPlan, give_way, serving_floor
from slurm_cdgpc.control.tenancy import Interference, Tenancy
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.estimator import JobEstimator
from slurm_cdgpc.model.families import FloatArray
from slurm_cdgpc.model.rls import BoolArray, RlsUpdate

IntArray = NDArray[np.int64]
_SHIPPED = ControlConfig()


@dataclass(frozen=True)
class ControllerSettings:
    """The controller's every rule; the defaults are the shipped ``[control]`` section."""

    mode: str = _SHIPPED.dual_mode
    tol: float = 1e-6
    #: the dual's window for the power domains below the cluster (`solve_domain_prices`)
    domain_tol: float = 1e-3
    interval_s: float = _SHIPPED.interval_s
    #: ε₀: fraction of the budget held back for a hard cap (paper §5.4: 0.2–0.5 %)
    guard_band: float = _SHIPPED.guard_band
    #: c: the guard band grows to c/√N for N controlled jobs (one job's model error is a large
    #: share of a small cluster's sum); 0 keeps it at ε₀
    guard_per_sqrt_job: float = _SHIPPED.guard_per_sqrt_job
    #: p: once the whole plan's over-draw is measured (`Overdraw`), the cluster's guard band is
    #: at most its 1 − p quantile less the emergency margin (never under ε₀): then about p of
    #: intervals over-draw by more than the margin. c/√N is a guess from the job count, this
    #: what the plans missed by; 0 (shipped: through the head it let bursts go far over,
    #: DESIGN.md "Controller") keeps c/√N. The power domains keep c/√N
    guard_tail: float = _SHIPPED.guard_tail
    #: η: gain of the offset estimate
    offset_gain: float = _SHIPPED.offset_gain
    #: each settled job learns its own offset δ_n from its own misses, and the plan is scaled
    #: by δ = Σ w_n δ_n / Σ w_n, w_n the job's power in the last plan (a job not planned yet:
    #: at its top clock, where it runs until measured); a job without an offset yet
    #: counts at the known offsets weighed over the whole plan (`EconomicMPC.job_offsets`).
    #: Off: one δ learned from the settled jobs' plans together, applied to every plan
    offset_per_job: bool = _SHIPPED.offset_per_job
    #: deadline pressure of jobs without a deadline (1 = "just on time at top clocks")
    default_pressure: float = _SHIPPED.default_pressure
    #: a job with a deadline weighs at least as much as one without (``default_pressure``):
    #: a far deadline does not free its GPUs sooner, and the queue behind waits on them. Off:
    #: a job with more slack than its work at top clocks needs weighs less than one with none
    pressure_floor: bool = _SHIPPED.pressure_floor
    #: pressure cap for jobs at or past their deadline (their slack is floored at Δt)
    max_pressure: float = 1e3
    greedy_rounds: int = 8
    #: measured intervals before a job's plan counts towards the offset estimate
    settle_intervals: int = 3
    #: κ of the exploration margin (`EconomicMPC.exploration_margin_w`); 0 turns it off
    exploration_sigmas: float = _SHIPPED.exploration_sigmas
    #: lowest core clock chosen, as a fraction of the top clock: below it a GPU takes longer
    #: and spends more energy per iteration
    min_clock_fraction: float = _SHIPPED.min_clock_fraction
    #: when every job at the floor exceeds the budget, go below it (to the lowest supported
    #: clock) for that interval rather than miss the budget
    floor_fallback: bool = _SHIPPED.floor_fallback
    #: a job its power limit holds below its lock (``x_hi``: where the limit was seen to bind,
    #: or where its model says it would) runs there whatever its lock: it is locked at most one
    #: level above that clock and counted at it, not at what its model says an unheld job would
    #: draw at the lock (`discretise`). Off: the fill may lock it higher and count it there.
    #: Off too with the guard rail on (`Tuning.from_config`): the rail sets every limit from
    #: the plan, so a clock it held a job at is no ceiling for the next plan
    held_at_limit: bool = _SHIPPED.held_at_limit
    #: a job predicted to miss even at top clocks (R · T_top > D − t) gets the pressure of a
    #: job without a deadline: the power goes to jobs it can still save
    triage: bool = _SHIPPED.triage
    #: while jobs wait although GPUs are free, the jobs of the node predicted to empty first
    #: get at least this pressure (needs a `QueueState`; 0 turns it off)
    drain_pressure: float = _SHIPPED.drain_pressure
    #: a job with a time limit but no known total work needs at most its time limit at top
    #: clocks, less the work done (`JobEstimator.work_top_s`); its pressure is that over its
    #: slack, at most 1 (the bound is loose: the job must not outweigh one that says its work)
    work_from_time_limit: bool = _SHIPPED.work_from_time_limit
    #: ... sharpened to this quantile of the share of their limit that ended jobs' work took
    #: (`LimitShare`); 1 keeps the whole limit
    limit_share_quantile: float = _SHIPPED.limit_share_quantile
    #: how fast the cluster's planned power may move, in W/s (`Ramp`; inf: as fast as the
    #: budget lets it); each power domain's own rate comes with the topology
    ramp_w_per_s: float = _SHIPPED.ramp
    #: the emergency cut: a limit whose measured power is over it by more than this share (or
    #: its guard band, if more) sends its lowest-pressure jobs to their lowest clocks at once,
    #: before the next plan (`emergency_cut`; the head's exchange round)
    emergency: bool = _SHIPPED.emergency
    emergency_margin: float = _SHIPPED.emergency_margin
    #: serving jobs: the latency target is (1 − margin) × the objective, and the floor comes
    #: down at most ``serving_step`` of the top clock an interval (`serving_floor`)
    serving_margin: float = _SHIPPED.serving_margin
    serving_step: float = _SHIPPED.serving_step
    #: a job whose power model has no reading yet is counted at this share of its power limit
    #: and, when the share is not learned (``new_job_power_quantile`` 1), held there by a power
    #: limit (`Decision.held`) instead of at its whole limit; 1: the whole limit, nothing held.
    #: Serving jobs, and jobs sharing a GPU with one, keep their default limits and so are
    #: counted at them
    new_job_power_share: float = _SHIPPED.new_job_power_share
    #: ... learned per GPU type (and apart for jobs joining co-tenants) as this quantile of
    #: new jobs' first readings (`NewJobShare`), starting from ``new_job_power_share``, and
    #: counted without a hold; 1: not learned
    new_job_power_quantile: float = _SHIPPED.new_job_power_quantile
    #: a job whose sample was taken among other co-tenants than its last learned one
    #: (`Measurements.cotenants`) re-anchors its time model's scale on it (`Rls.expect_step`)
    #: instead of rejecting it as an outlier
    reanchor_tenants: bool = _SHIPPED.reanchor_tenants
    #: a tenant's predicted iteration time follows its co-tenants' number: a plan that puts it
    #: among more or fewer than its time model learned among scales the model by what such
    #: changes did to the tenants that went through one (`Interference`)
    interference: bool = _SHIPPED.interference

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"unknown dual mode {self.mode!r} (known: {', '.join(MODES)})")
        if self.interval_s <= 0:
            raise InputError(f"control interval must be positive, got {self.interval_s}")
        if not 0.0 <= self.guard_band < 0.5:
            raise InputError(f"guard band must be in [0, 0.5), got {self.guard_band}")
        if not 0.0 <= self.guard_per_sqrt_job < 0.5:
            raise InputError(f"guard per √job must be in [0, 0.5), got {self.guard_per_sqrt_job}")
        if not 0.0 <= self.guard_tail < 1.0:
            raise InputError(f"guard tail must be in [0, 1), got {self.guard_tail}")
        if not 0.0 <= self.offset_gain <= 1.0:
            raise InputError(f"offset gain must be in [0, 1], got {self.offset_gain}")
        if not 0.0 <= self.min_clock_fraction < 1.0:
            raise InputError(f"clock floor must be in [0, 1), got {self.min_clock_fraction}")
        if not 0.0 < self.limit_share_quantile <= 1.0:
            q = self.limit_share_quantile
            raise InputError(f"limit share quantile must be in (0, 1], got {q}")
        if self.drain_pressure < 0 or self.exploration_sigmas < 0:
            raise InputError("drain pressure and exploration sigmas must not be negative")
        if not 0.0 <= self.emergency_margin < 1.0:
            raise InputError(f"emergency margin must be in [0, 1), got {self.emergency_margin}")
        if not (0.0 <= self.serving_margin < 1.0 and 0.0 < self.serving_step <= 1.0):
            raise InputError("serving margin must be in [0, 1) and serving step in (0, 1]")
        if not 0.0 < self.new_job_power_share <= 1.0:
            share = self.new_job_power_share
            raise InputError(f"a new job's power share must be in (0, 1], got {share}")
        if not 0.0 < self.new_job_power_quantile <= 1.0:
            q = self.new_job_power_quantile
            raise InputError(f"the new-job power quantile must be in (0, 1], got {q}")
        if not self.ramp_w_per_s > 0:
            raise InputError(f"ramp must be a positive rate in W/s, got {self.ramp_w_per_s}")

    def guard_for(self, jobs: int) -> float:
        """ε = max(ε₀, c/√N)."""
        return max(self.guard_band, self.guard_per_sqrt_job / math.sqrt(max(jobs, 1)))


@dataclass(frozen=True)
class QueueState:
    """What the scheduler shows beyond the running jobs (the drain's input).

    Placement is sparse: one (job row, node) pair for each node a job has GPUs on, so that
    100,000 jobs on 50,000 nodes cost pairs, not a jobs × nodes matrix.
    """

    #: jobs wait for GPUs now
    waiting: bool
    #: the pairs: controlled job rows (as the estimator's) and the nodes they run on
    job_row: IntArray
    job_node: IntArray
    #: (nodes,): GPUs with no job on each node
    free_gpus: IntArray

    @classmethod
    def from_matrix(cls, waiting: bool, job_nodes: IntArray, free_gpus: IntArray) -> QueueState:
        """From a (jobs, nodes) matrix of GPUs per job and node."""
        rows, nodes = np.nonzero(job_nodes)
        return cls(waiting, rows.astype(np.int64), nodes.astype(np.int64), free_gpus)


@dataclass(frozen=True)
class JobState:
    """The controller's view of the running jobs, aligned with the estimator's rows."""

    gpu_type: IntArray  # index into the controller's ClockGrid
    remaining_iterations: FloatArray  # R_n; NaN when the job never said
    deadline_s: FloatArray  # D_n (absolute, same clock as ``now_s``); NaN when none
    #: Slurm's time limit L_n and the job's start (same clock as ``now_s``); NaN when unknown
    time_limit_s: FloatArray | None = None
    start_s: FloatArray | None = None
    #: jobs that share GPUs, one clock per group (`Tenancy`); None: no GPU is shared
    tenancy: Tenancy | None = None
    #: serving jobs' latency objective in seconds, at their percentile (NaN: not serving;
    #: None: none serves); a serving job's `Measurements.iteration_s` is that latency
    objective_s: FloatArray | None = None

    def serving(self) -> BoolArray:
        n = self.gpu_type.shape[0]
        if self.objective_s is None:
            return np.zeros(n, dtype=bool)
        served: BoolArray = np.isfinite(self.objective_s)
        return served

    def remaining_top_s(
        self, work_top_s: FloatArray, now_s: float, share: float = 1.0
    ) -> FloatArray:
        """Bound on the work left, in seconds at top clocks, of jobs that did not say theirs:
        min(s L − done, start + L − now), ≥ 0 (Slurm ends the job at its limit), with s the
        share of its limit a job's work takes (`LimitShare`; 1 for a job past s L); NaN for
        jobs that said, or that have no time limit."""
        n = self.remaining_iterations.shape[0]
        if self.time_limit_s is None or self.start_s is None:
            return np.full(n, np.nan)
        work_s = share * self.time_limit_s
        work_s = np.where(work_top_s < work_s, work_s, self.time_limit_s)
        left = np.minimum(work_s - work_top_s, self.start_s + self.time_limit_s - now_s)
        unknown = ~np.isfinite(self.remaining_iterations) & (self.time_limit_s > 0)
        return np.where(unknown, np.maximum(left, 0.0), np.nan)


@dataclass(frozen=True)
class Measurements:
    """What the last interval showed, per job (NaN = not measured)."""

    graphics_mhz: FloatArray  # applied clocks (the GPU may run below the requested one)
    memory_mhz: FloatArray
    power_w: FloatArray  # mean power per GPU
    iteration_s: FloatArray  # mean seconds per iteration
    #: the last decision's `Decision.planned_power_w` for these rows (NaN: not planned)
    planned_power_w: FloatArray | None = None
    #: the firmware held the job's clock below the lock to stay within its power limit
    #: (NVML's SW_POWER_CAP clocks-event reason on any of its GPUs)
    power_capped: BoolArray | None = None
    #: the whole cluster against the plan in force over the interval: what sizes the guard
    #: band (`Overdraw`; None: not known, or no budget)
    cluster: ClusterDraw | None = None
    #: per job, which co-tenants shared its GPUs while it was measured: 0 none, any other
    #: key one set of them (`cotenant_key`), -1 not known; a job's speed steps when they
    #: change (None: no job is known to share)
    cotenants: IntArray | None = None
    #: ... and how many they were (-1: not known; None: not counted)
    cotenant_count: IntArray | None = None
    #: per job, the power limit its GPUs held as their setpoint over the interval (MIG mode),
    #: where below the board's default; NaN otherwise (None: no such job)
    lever_limit_w: FloatArray | None = None


@dataclass(frozen=True)
class Decision:
    status: StepStatus
    price: float
    graphics_mhz: IntArray
    memory_mhz: IntArray
    job_power_w: FloatArray  # predicted per job at the planned clocks (unknown jobs: g × TDP)
    #: `job_power_w` where it is a model's prediction, NaN for jobs counted at their limit;
    #: hand it back with the next interval's `Measurements` for the offset estimate
    planned_power_w: FloatArray
    predicted_power_w: float
    budget_w: float
    effective_budget_w: float
    offset: float  # δ, the relative miss of recent plans
    dual_evaluations: int
    upgrades: int
    solve_s: float
    learn: tuple[RlsUpdate, RlsUpdate] | None
    #: per power domain below the cluster (`DomainLimits`' order): its price (0: its limit
    #: does not bind, +inf: it does not fit even at the lowest clocks) and the planned power
    #: of the jobs under it, Σ share × job power; empty without domains
    domain_price: FloatArray = field(default_factory=lambda: np.zeros(0))
    domain_planned_w: FloatArray = field(default_factory=lambda: np.zeros(0))
    #: the serving jobs' floors (snapped to supported clocks), missed and given-way
    #: objectives (`ServingPlan`); None when no job serves
    serving: ServingPlan | None = None
    #: jobs not yet measured that the plan counts at a share of their limit (`NewJobShare`):
    #: their GPUs' power limits must hold them at their `job_power_w` (None: no job is held)
    held: BoolArray | None = None
    #: what the cluster should draw under this plan, W: the plan as the offset says plans turn
    #: out, and the power outside it; hand it back in `Measurements.cluster` (`ClusterDraw`)
    #: with what the cluster drew while it was in force
    expected_w: float = math.nan
    #: ε, the share of the budget the cluster's plan held back (`EconomicMPC.cluster_guard`)
    guard_band: float = math.nan

    @property
    def budget_error_pct(self) -> float:
        """Planned power against the effective budget (negative = under)."""
        return 100.0 * (self.predicted_power_w - self.effective_budget_w) / self.effective_budget_w


class EconomicMPC:
    """The head's controller: `step` once per interval.

    ``grid`` holds every clock the controller may ever set; the clock floor
    (``settings.min_clock_fraction``) is applied on top of it, once, here: the settings are
    fixed at construction (another tuning is another controller).
    """

    def __init__(self, grid: ClockGrid, settings: ControllerSettings | None = None) -> None:
        self.settings = settings or ControllerSettings()
        self.grid = grid
        self.floor_grid = grid.floored(self.settings.min_clock_fraction)
        self.offset = 0.0  # δ
        #: what a job without an offset of its own counts at (`job_offsets`)
        self.offset_prior = 0.0
        self._last_price: FloatArray | None = None
        self._last_roots: FloatArray | None = None  # the domains' (`DomainResult.roots`)
        self._last_step_s: float | None = None
        #: what the last ramped step put in force, per limit (`_in_force_w`)
        self._ramp_from: FloatArray | None = None
        #: ... and the cluster's part before the guard band: its plan's expected draw and cap
        self._ramp_total: tuple[float, float] | None = None
        self.limit_share = LimitShare(self.settings.limit_share_quantile)
        self.new_share = NewJobShare(
            self.settings.new_job_power_share, self.settings.new_job_power_quantile
        )
        self.overdraw = Overdraw()
        self.interference = Interference()
        #: the cluster's guard band the last plan held back
        self._guard = self.settings.guard_for(0)

    def use_grid(self, grid: ClockGrid) -> None:
        """A grid with more GPU types (a board an agent described); the types already known
        must keep their rows."""
        if grid.names[: len(self.grid.names)] != self.grid.names:
            raise InputError("a new clock grid must keep the known GPU types in their order")
        self.grid = grid
        self.floor_grid = grid.floored(self.settings.min_clock_fraction)

    def step(
        self,
        estimator: JobEstimator,
        jobs: JobState,
        now_s: float,
        budget_w: float,
        uncontrolled_w: float = 0.0,
        measured: Measurements | None = None,
        queue: QueueState | None = None,
        domains: DomainLimits | None = None,
        ramp: Ramp | None = None,
    ) -> Decision:
        """One interval's clocks for every job in ``jobs``, within the budget and every power
        domain's limit (``domains``; DESIGN.md, "Power domains"), each capped by its ramp
        (``ramp``: `Ramp.caps_w`; the decision's ``budget_w`` is the capped budget):

        1. learn: RLS update of every job's power and iteration-time model from ``measured``,
           of the gain of each lever GPU (MIG mode: `guard_rail.limit_gain`), and of what a
           change in the number of co-tenants does to a tenant's time (`Interference`; the
           plan scales such a tenant's model by it until its own sample comes);
        2. offset: δ ← (1−η) δ + η (Σ P_meas − Σ P_plan) / Σ P_plan over the settled jobs' plans
           (`offset_per_job`: each job's own, weighed in step 4, `job_offsets`);
        3. weights: w_n = R_n / max(D_n − t, Δt), so w_n T_n(f) is the job's deadline pressure,
           then the rules: triage, the drain, the pressure of jobs without a deadline;
        4. budget: B_eff = (B − P_uncontrolled − ε B) / (1 + δ), ε = max(ε₀, c/√N); an
           unmeasured job runs at its top clock counted at a share of its power limit
           (`new_job_share`: learned, or its whole limit until learned);
        5. price: `solve_price`, re-solved once with the exploration margin held back;
        6. clocks: floor to supported levels at or above the clock floor (below it when nothing
           above fits, with ``floor_fallback``) and greedy fill (`discretise`).
        """
        s = self.settings
        t0 = time.perf_counter()
        learn = None
        x_a = xm_a = None
        if measured is not None:
            x_a, xm_a = estimator.normalise(measured.graphics_mhz, measured.memory_mhz)
            if measured.cluster is not None:
                self.overdraw.observe(measured.cluster)
            if measured.planned_power_w is not None:
                # a shared GPU's readings once, split as the plan that was measured split them:
                # a tenant that came or left since changes today's split, not that reading's
                drawn = estimator.statics.gpus * measured.power_w * estimator.share
                # a serving job draws what its load asks, not what its plan said: no model error
                compared = np.isfinite(drawn) & np.isfinite(measured.planned_power_w)
                compared &= ~jobs.serving()
                # a job held down by the firmware drew less than planned for a reason that
                # leaves with the next budget change; the clock clamp, not δ, handles it
                held = (
                    np.zeros_like(compared)
                    if measured.power_capped is None
                    else measured.power_capped
                )
                both = compared & ~held
                if s.offset_per_job:  # each job's own miss; the plan's δ: `_weigh_offsets`
                    own = np.flatnonzero(compared & (measured.planned_power_w > 0))
                    miss_n = drawn[own] / measured.planned_power_w[own] - 1.0
                    start = self.job_offsets(estimator)[own]
                    # held, its miss says nothing of its model; a pooled job's model starts
                    # weak in its kind's shape and may be planned far from its readings, so
                    # an offset it learned there fades while it is held instead of standing
                    fade = held[own] & estimator.pooled[own]
                    keep = ~held[own] | fade
                    miss_n = np.where(fade, 0.0, miss_n)[keep]
                    own, start = own[keep], start[keep]
                    estimator.offset[own] = start + s.offset_gain * (miss_n - start)
                elif (planned_w := float(np.sum(measured.planned_power_w[both]))) > 0:
                    miss = float(np.sum(drawn[both])) / planned_w - 1.0
                    self.offset = (1 - s.offset_gain) * self.offset + s.offset_gain * miss
            capped = measured.power_capped
            if self.new_share.learning:
                self._learn_new_share(estimator, jobs, x_a, measured)
            elif self.new_share.holds and capped is not None:
                # a job without a reading was held by the plan's own limit (`held`), not its
                # board's: the clock that limit allowed is no ceiling once it is lifted
                capped = capped & (estimator.power.count > 0)
            tenants = s.reanchor_tenants or s.interference
            learn = estimator.observe(
                x_a,
                xm_a,
                measured.power_w,
                measured.iteration_s,
                power_capped=capped,
                cotenants=measured.cotenants if tenants else None,
                cotenant_count=measured.cotenant_count if s.interference else None,
                reanchor=s.reanchor_tenants,
            )
            if s.interference:
                self.interference.learn(*estimator.cotenant_steps)
            if measured.lever_limit_w is not None:
                estimator.limit_gain = limit_gain(
                    estimator.limit_gain, measured.power_w, measured.lever_limit_w
                )
            if self._last_step_s is not None:
                # the interval just measured; a long gap (a head that was away) counts as one
                dt_s = min(max(now_s - self._last_step_s, 0.0), 2.0 * s.interval_s)
                estimator.accrue_work(x_a, xm_a, measured.power_w, dt_s)
        self._last_step_s = now_s
        estimator.time_scale = self._time_scale(estimator, jobs)
        if ramp is not None:
            budget_w, domains = self._ramped(ramp, now_s, budget_w, domains, len(estimator))

        seen = None if measured is None or x_a is None else (x_a, measured.iteration_s)
        problem, grid, nested, serving = self._problem(
            estimator, jobs, now_s, budget_w, uncontrolled_w, queue, domains, seen
        )
        if serving is not None:  # where the next step's floors start from
            estimator.floor_x = np.where(serving.serving, serving.floor_x, np.nan)
        tenancy = jobs.tenancy
        result = self._solve(problem, nested)
        x, x_m = self._respond(problem, nested, result)
        binding = result.status[0] is StepStatus.BINDING
        if s.exploration_sigmas > 0 and x_a is not None and xm_a is not None and binding:
            job_x, job_xm = (x[0], x_m[0]) if tenancy is None else _per_job(tenancy, x, x_m)
            margin_w = self.exploration_margin_w(estimator, job_x, job_xm, x_a, xm_a, tenancy)
            if margin_w > 0:
                # never more than the room above every job's lowest clock: a margin must not
                # turn a binding step into an infeasible one (held back from the cluster's
                # budget: the domains keep their guard bands)
                room_w = -problem.gradient(np.full(problem.horizon, np.inf))
                held_w = np.minimum(margin_w, np.maximum(room_w, 0.0) * (1.0 - 1e-6))
                problem = replace(problem, budget_w=problem.budget_w - held_w)
                if nested is not None:
                    budgets = nested.budget_w.copy()
                    budgets[0] = problem.budget_w[0]
                    nested = replace(nested, budget_w=budgets)
                # the next step starts from the prices applied with domains, and from the
                # first solve's price without (as the one-price controller always has)
                result = self._solve(
                    problem, nested, warm=result.price, remember=nested is not None
                )
                x, x_m = self._respond(problem, nested, result)
        if result.status[0] is StepStatus.INFEASIBLE:
            # nothing fits: unknown jobs too go to their lowest clock (still counted at the limit)
            x, x_m = problem.x_lo[None, :], problem.xm_lo[None, :]
        types = jobs.gpu_type if tenancy is None else jobs.gpu_type[tenancy.first()]
        fixed = None
        if serving is not None:  # serving jobs at their floors, alone or with serving tenants
            fixed = serving.serving & ~serving.gave_way
            if tenancy is not None:
                free = np.bincount(tenancy.group, ~fixed, tenancy.size)
                fixed = free == 0
        plan = discretise(
            problem, grid, types, x[0], x_m[0], s.greedy_rounds, nested, fixed, s.held_at_limit
        )
        domain_planned_w = None if nested is None else nested.totals(plan.job_power_w)[1:]
        share = (
            np.ones(len(estimator))
            if tenancy is None
            else tenancy.attribution(estimator.statics.gpus)
        )
        estimator.same_share = np.where(share == estimator.share, estimator.same_share + 1, 0)
        estimator.share = share
        if tenancy is not None:  # every tenant at its GPUs' clocks, charged its share
            g = tenancy.group
            plan = replace(
                plan,
                graphics_mhz=plan.graphics_mhz[g],
                memory_mhz=plan.memory_mhz[g],
                x=plan.x[g],
                x_m=plan.x_m[g],
                job_power_w=tenancy.job_power_w(plan.job_power_w),
            )
        # the offset learns only from settled models: a young job's error is RLS's to fix, and
        # counting it twice (model and offset) overshoots once the model has caught up; so is
        # the error of a model whose GPU has gained or lost a tenant
        settled = (estimator.power.count >= s.settle_intervals) & (
            estimator.same_share >= s.settle_intervals
        )
        planned = np.where(settled, plan.job_power_w, np.nan)
        decision = self._decide(planned, problem, result, plan, learn, t0, budget_w)
        # what the cluster should draw if plans turn out as the offset says they do
        if s.offset_per_job:  # each job's plan as its own offset says it turns out
            expected_w = float(np.sum(plan.job_power_w * (1.0 + self.job_offsets(estimator))))
            estimator.planned_w = plan.job_power_w.copy()
        else:
            expected_w = decision.predicted_power_w * (1.0 + self.offset)
        expected_w += uncontrolled_w
        decision = replace(decision, expected_w=expected_w, guard_band=self._guard)
        if serving is not None:
            decision = replace(decision, serving=serving)
        held = self.held(estimator, jobs)
        if held.any():
            decision = replace(decision, held=held)
        if domain_planned_w is not None:
            decision = replace(
                decision, domain_price=result.price[1:], domain_planned_w=domain_planned_w
            )
        if ramp is not None:
            self._ramp_from = self._in_force_w(decision, domains)
        return decision

    def _time_scale(self, estimator: JobEstimator, jobs: JobState) -> FloatArray:
        """(N,) the factor on each job's time model in this plan (`interference`): 1 but for
        a tenant the plan puts among more or fewer co-tenants than its model learned among,
        and never for a serving job (its "iteration" is its latency, learned as measured)."""
        n = len(estimator)
        if not self.settings.interference:
            return np.ones(n)
        _check_groups(jobs, n)
        if jobs.tenancy is None:  # every job alone
            planned = np.zeros(n, dtype=np.int64)
        else:
            planned = jobs.tenancy.cotenant_counts()
        scale = self.interference.scale(estimator.cotenant_count, planned)
        return np.where(jobs.serving(), 1.0, scale)

    def job_offsets(self, estimator: JobEstimator) -> FloatArray:
        """δ_n of every job (`offset_per_job`): its own where it has one, else the known
        offsets weighed over the whole plan, Σ_known w_n δ_n / Σ_all w_n (w_n: the job's power
        in the last plan, or at its top clock before it has one): the jobs that taught them
        speak for their share of the plan only, so one small job's miss hardly moves a big new
        job, while a fleet whose settled jobs all miss alike passes nearly all of it on. A
        job's first miss starts from it."""
        return np.where(np.isfinite(estimator.offset), estimator.offset, self.offset_prior)

    def _weigh_offsets(self, estimator: JobEstimator, problem: DualProblem) -> None:
        """δ = Σ w_n δ_n / Σ w_n and the prior of `job_offsets` (`offset_per_job`), w_n the
        job's power in the last plan, or at its top clock in ``problem`` before it has one: a
        miss counts for the share of the plan its job is (with every job known and its plan
        as the last, exactly the one offset's Σ P_meas / Σ P_plan − 1)."""
        weight_w = estimator.planned_w
        unplanned = ~np.isfinite(weight_w)
        if unplanned.any():
            top_w = problem.power_w(problem.x_hi, problem.xm_hi)
            weight_w = np.where(unplanned, top_w, weight_w)
        total_w = float(np.sum(weight_w))
        known = np.isfinite(estimator.offset)
        learned_w = float(np.sum(weight_w[known] * estimator.offset[known]))
        self.offset_prior = learned_w / total_w if total_w > 0 else 0.0
        offsets_w = float(np.sum(weight_w * self.job_offsets(estimator)))
        self.offset = offsets_w / total_w if total_w > 0 else 0.0

    def cluster_guard(self, jobs: int) -> float:
        """The cluster's guard band for ``jobs`` controlled jobs: ε = max(ε₀, c/√N), or
        max(ε₀, min(c/√N, Q₁₋ₚ − m)) once the whole plan's over-draw is measured (`Overdraw`;
        Q₁₋ₚ its 1 − p quantile, m the emergency margin)."""
        s = self.settings
        guard = s.guard_for(jobs)
        tail = None if s.guard_tail <= 0 else self.overdraw.quantile(1.0 - s.guard_tail)
        if tail is not None:
            guard = max(s.guard_band, min(guard, tail - s.emergency_margin))
        return guard

    def _ramped(
        self,
        ramp: Ramp,
        now_s: float,
        budget_w: float,
        domains: DomainLimits | None,
        jobs: int,
    ) -> tuple[float, DomainLimits | None]:
        """The budget and the domains' limits capped by their ramps (`Ramp.caps_w`), each
        ramp from the power the last plan put in force (`_in_force_w`) where there was one:
        what was measured describes the interval before it, and ramping from that would let
        every other step jump by the last plan's change as well. The cluster's is counted at
        the cap this step's guard band would hold it under (for ``jobs`` jobs): a band that
        shrank must not add its share of the power to the ramp's step."""
        limits_w = np.concatenate(([budget_w], np.zeros(0) if domains is None else domains.limit_w))
        last = self._ramp_from
        if last is not None and last.shape == ramp.last_w.shape:
            if self._ramp_total is not None:
                total_w, cap_w = self._ramp_total
                last = last.copy()
                last[0] = min(total_w / (1.0 - self.cluster_guard(jobs)), cap_w)
            ramp = replace(ramp, last_w=np.where(np.isfinite(last), last, ramp.last_w))
        caps_w = ramp.caps_w(limits_w, now_s, self.settings.interval_s)
        if domains is not None:
            domains = replace(domains, limit_w=caps_w[1:])
        return float(caps_w[0]), domains

    def _in_force_w(self, decision: Decision, domains: DomainLimits | None) -> FloatArray:
        """(1+D,) the power the decision puts in force under the cluster and each domain: the
        plan, as the offset says plans turn out, and the power outside it (the cluster's:
        `Decision.expected_w`); a plan held under its cap by the guard band counts as at the
        cap (else each ramped step would lose the guard band's share of the power)."""
        s = self.settings
        self._ramp_total = (decision.expected_w, decision.budget_w)
        drawn = [min(decision.expected_w / (1.0 - self._guard), decision.budget_w)]
        if domains is not None:
            guard = np.array([s.guard_for(int(k)) for k in domains.jobs()])
            planned = decision.domain_planned_w * (1.0 + self.offset) + domains.uncontrolled_w
            drawn.extend(np.minimum(planned / (1.0 - guard), domains.limit_w).tolist())
        return np.array(drawn)

    def cut_order(
        self, estimator: JobEstimator, jobs: JobState, now_s: float, queue: QueueState | None
    ) -> IntArray:
        """The jobs by deadline pressure at top clocks (after the rules: `weights`), lowest
        first: the order in which the emergency cut takes them (`emergency_cut`). Serving jobs
        come last: a training job's deadline is hours away, a serving job's objective is
        missed at once."""
        pressure = self.weights(estimator, jobs, now_s, queue)[0] * _top_iteration_s(estimator)
        pressure = np.where(jobs.serving(), np.inf, pressure)
        return np.argsort(pressure, kind="stable").astype(np.int64)

    def _learn_new_share(
        self,
        estimator: JobEstimator,
        jobs: JobState,
        x_a: FloatArray,
        measured: Measurements,
    ) -> None:
        """Teach `new_share` this step's first readings: jobs without a power reading until
        now, not serving (a serving job draws what its load asks), that ran at their top
        clock, or were held down by a power limit (then all their reading says is that they
        would draw more). Below their top clock they draw less than they will when counted."""
        first = (estimator.power.count == 0) & np.isfinite(measured.power_w) & ~jobs.serving()
        if not first.any():
            return
        st = estimator.statics
        x_top = self.grid.top_mhz(jobs.gpu_type)[0] / st.graphics_max_mhz
        read = measured.power_w / st.power_limit_w
        capped = (
            np.zeros(len(estimator), dtype=bool)
            if measured.power_capped is None
            else np.asarray(measured.power_capped, dtype=bool)
        )
        # within 2 % of the top clock: a board's reported clock dithers under its lock
        top = np.nan_to_num(x_a, nan=0.0) >= 0.98 * x_top
        rows = np.flatnonzero(first & (capped | top))
        if rows.size:
            kinds = self._share_kinds(jobs)
            self.new_share.observe([kinds[r] for r in rows], read[rows], capped[rows])

    def _share_kinds(self, jobs: JobState) -> list[str]:
        """(N,) what `new_share` learns apart: each job's GPU type, and whether it joins
        co-tenants (its GPU's reading is theirs and its own together)."""
        names = [self.grid.names[t] for t in jobs.gpu_type.tolist()]
        if jobs.tenancy is None:
            return names
        crowded = (jobs.tenancy.tenants()[jobs.tenancy.group] > 1).tolist()
        return [f"{n} shared" if c else n for n, c in zip(names, crowded, strict=True)]

    def new_job_share(self, jobs: JobState) -> FloatArray:
        """(N,) the share of its power limit each job is counted at until it is measured (a
        serving job, and a job sharing a GPU with one, at its whole limit: their draw follows
        their load)."""
        serving = jobs.serving()
        if jobs.tenancy is not None:
            serving = jobs.tenancy.any_tenant(serving)
        return np.where(serving, 1.0, self.new_share.of(self._share_kinds(jobs)))

    def held(self, estimator: JobEstimator, jobs: JobState) -> BoolArray:
        """(N,) the jobs counted at a fixed share of their limit below 1 and held there by a
        power limit: no power reading yet, and not counted at their whole limit
        (`new_job_share`). A learned share is a prior, as a model is, and holds nothing."""
        held: BoolArray = estimator.power.count == 0
        if not self.new_share.holds or not held.any():
            return np.zeros(len(estimator), dtype=bool)
        return held & (self.new_job_share(jobs) < 1.0)

    def lowest_power_w(self, estimator: JobEstimator, jobs: JobState) -> FloatArray:
        """(N,) each job's predicted power at its lowest supported clocks, all its GPUs (its
        model's prior while unmeasured)."""
        st = estimator.statics
        g_lo, m_lo = self.grid.bottom_mhz(jobs.gpu_type)
        per_gpu_w = estimator.predict_power_w(g_lo / st.graphics_max_mhz, m_lo / st.memory_max_mhz)
        return np.minimum(per_gpu_w, st.power_limit_w) * st.gpus

    def _solve(
        self,
        problem: DualProblem,
        nested: DomainSet | None,
        warm: FloatArray | None = None,
        remember: bool = True,
    ) -> DualResult | DomainResult:
        """The price (one, or one per domain), warm-started from the last step's; the next
        step starts from it if ``remember`` (the first solve of a step, not the margin's)."""
        s = self.settings
        if warm is None:
            warm = self._last_price
        if nested is None:
            if warm is not None and warm.shape != problem.budget_w.shape:
                warm = None
            result: DualResult | DomainResult = solve_price(problem, s.mode, s.tol, warm)
        else:
            result = solve_domain_prices(
                problem,
                nested,
                s.mode,
                s.tol,
                warm,
                domain_tol=s.domain_tol,
                warm_roots=self._last_roots,
            )
            if remember:
                self._last_roots = result.roots
        if not remember:
            return result
        if nested is not None:
            self._last_price = np.where(np.isfinite(result.price), result.price, 0.0)
        elif np.all(np.isfinite(result.price) & (result.price > 0)):
            self._last_price = result.price
        return result

    @staticmethod
    def _respond(
        problem: DualProblem, nested: DomainSet | None, result: DualResult | DomainResult
    ) -> tuple[FloatArray, FloatArray]:
        if not isinstance(result, DomainResult) or nested is None:
            return problem.best_response(result.price)
        x, x_m = problem.best_response(result.job_price(nested)[None, :])
        # under a domain that does not fit even at the lowest clocks every job goes to its
        # lowest clock, as every job does when the cluster does not fit: an unmeasured job,
        # counted at its limit whatever its clock, would otherwise keep its top clock
        lowest = np.zeros(nested.jobs, dtype=bool)
        lowest[nested.job_row[~np.isfinite(result.price[nested.domain])]] = True
        return np.where(lowest, problem.x_lo, x), np.where(lowest, problem.xm_lo, x_m)

    def jobs_ended(self, work_top_s: FloatArray, time_limit_s: FloatArray) -> None:
        """Jobs that ended (their estimator rows about to go): the work they did against their
        time limits teaches `limit_share`."""
        self.limit_share.observe(work_top_s, time_limit_s)

    def exploration_margin_w(
        self,
        estimator: JobEstimator,
        x: FloatArray,
        x_m: FloatArray,
        x_prev: FloatArray,
        xm_prev: FloatArray,
        tenancy: Tenancy | None = None,
    ) -> float:
        """Budget held back when the plan moves jobs to clocks their models know less well.

        RLS gives each prediction a standard error σ̂_n √(φᵀPφ). Moving a job from the clocks it
        ran at to new ones grows that error by Δ_n = σ̂_n (√(φ_newᵀPφ_new) − √(φ_oldᵀPφ_old))₊;
        after a budget drop every job moves the same way and their errors add up, so the margin
        is κ Σ_n g_n Δ_n. It is zero in steady state (the plan stays where the data are). The
        tenants of a shared GPU count their shares of it (`Tenancy.attribution`).
        """
        known = estimator.power.count > 0
        if not known.any():
            return 0.0
        cov = estimator.power.cov

        def spread(xc: FloatArray, xm: FloatArray) -> FloatArray:
            phi = estimator.power_regressors(np.nan_to_num(xc, nan=1.0), np.nan_to_num(xm, nan=1.0))
            # two two-operand contractions: einsum does not reorder a three-operand one
            quad: FloatArray = np.einsum("ni,ni->n", phi, np.einsum("nij,nj->ni", cov, phi))
            return np.sqrt(np.maximum(quad, 0.0))

        sigma = np.sqrt(estimator.power.err_var)
        grow = np.maximum(spread(x, x_m) - spread(x_prev, xm_prev), 0.0)
        gpus = estimator.statics.gpus.astype(np.float64)
        if tenancy is not None:
            gpus = gpus * tenancy.attribution(gpus)
        extra = np.where(known & np.isfinite(x_prev), gpus * sigma * grow, 0.0)
        return self.settings.exploration_sigmas * float(np.sum(extra))

    def problem(
        self,
        estimator: JobEstimator,
        jobs: JobState,
        now_s: float,
        budget_w: float,
        uncontrolled_w: float = 0.0,
        queue: QueueState | None = None,
        domains: DomainLimits | None = None,
    ) -> DualProblem:
        """The continuous problem this step solves (also handed to the cvxpy reference)."""
        return self._problem(
            estimator, jobs, now_s, budget_w, uncontrolled_w, queue, domains, None
        )[0]

    def nested(
        self,
        estimator: JobEstimator,
        jobs: JobState,
        now_s: float,
        budget_w: float,
        uncontrolled_w: float = 0.0,
        queue: QueueState | None = None,
        domains: DomainLimits | None = None,
    ) -> tuple[DualProblem, DomainSet | None]:
        """The continuous problem and its domain constraints (for the solvers' checks)."""
        problem, _, nested, _ = self._problem(
            estimator, jobs, now_s, budget_w, uncontrolled_w, queue, domains, None
        )
        return problem, nested

    def _problem(
        self,
        estimator: JobEstimator,
        jobs: JobState,
        now_s: float,
        budget_w: float,
        uncontrolled_w: float,
        queue: QueueState | None,
        domains: DomainLimits | None,
        seen: tuple[FloatArray, FloatArray] | None,
    ) -> tuple[DualProblem, ClockGrid, DomainSet | None, ServingPlan | None]:
        """The problem above the clock floor, or, with ``floor_fallback``, above the lowest
        supported clock when every job at the floor exceeds the budget (Σ g P(x_lo) > B_eff)
        or a domain's limit; the domains' constraints (None without domains); the serving
        jobs' floors (`serving_floor`, from ``seen``: the clocks applied and the latencies
        measured in the last interval), which give way only on the grid finally used."""
        s = self.settings
        if not np.isfinite(budget_w) or budget_w <= 0:
            raise InputError("the power budget must be a positive number of watts")
        _check_groups(jobs, len(estimator))
        weight = self.weights(estimator, jobs, now_s, queue)
        if jobs.tenancy is not None and domains is not None:
            domains = jobs.tenancy.domains(domains)
        fallback = s.floor_fallback and self.floor_grid is not self.grid and len(estimator) > 0
        args = (estimator, jobs, weight, budget_w, uncontrolled_w, seen)
        problem, serving = self._bounded(self.floor_grid, *args, give=not fallback)
        nested = self._nested(problem, domains)
        if fallback:
            floor_w = problem.power_w(problem.x_lo, problem.xm_lo)
            over = floor_w.sum() > problem.budget_w[0]
            if nested is not None:
                over = bool(np.any(nested.totals(floor_w) > nested.budget_w))
            if over:
                low, serving = self._bounded(self.grid, *args, give=True)
                return low, self.grid, self._nested(low, domains), serving
        return problem, self.floor_grid, nested, serving

    def _nested(self, problem: DualProblem, domains: DomainLimits | None) -> DomainSet | None:
        """Each domain's budget for its jobs, as the cluster's: B_d,eff = (B_d − P_d,uncontrolled
        − ε_d B_d) / (1 + δ), ε_d = max(ε₀, c/√N_d) for its N_d jobs."""
        if domains is None or not len(domains):
            return None
        n = problem.gpus.shape[0]
        if domains.job_row.size and domains.job_row.max() >= n:
            raise InputError("a power domain names a job row the controller does not have")
        guard = np.array([self.settings.guard_for(int(k)) for k in domains.jobs()])
        limit = domains.limit_w
        effective = (limit - domains.uncontrolled_w - guard * limit) / (1.0 + self.offset)
        return DomainSet.nested(
            n,
            float(problem.budget_w[0]),
            domains.domain,
            domains.job_row,
            domains.share,
            np.maximum(effective, 0.0),
            domains.parents(),
        )

    def _bounded(
        self,
        grid: ClockGrid,
        estimator: JobEstimator,
        jobs: JobState,
        weight: FloatArray,
        budget_w: float,
        uncontrolled_w: float,
        seen: tuple[FloatArray, FloatArray] | None,
        give: bool,
    ) -> tuple[DualProblem, ServingPlan | None]:
        s, st = self.settings, estimator.statics
        g_top, m_top = grid.top_mhz(jobs.gpu_type)
        g_lo, m_lo = grid.bottom_mhz(jobs.gpu_type)
        x_hi = g_top / st.graphics_max_mhz
        xm_hi = m_top / st.memory_max_mhz
        # unmeasured jobs: power flat at the power limit (an upper bound at any clock) → top
        # clock; those held by a power limit at a share of it, flat at that share
        new = estimator.power.count == 0
        power_theta = estimator.power.theta
        if new.any():
            share = self.new_job_share(jobs)
            count_w = share * st.power_limit_w
            power_theta = power_theta.copy()
            power_theta[new] = 0.0
            power_theta[new, -1] = count_w[new]
        x_lo = g_lo / st.graphics_max_mhz
        if grid is not self.floor_grid and new.any():
            # below the floor only where a model says what it buys: an unmeasured job is
            # counted at its limit whatever its clock, so it keeps the floor
            floor_lo = self.floor_grid.bottom_mhz(jobs.gpu_type)[0] / st.graphics_max_mhz
            x_lo = np.where(new, floor_lo, x_lo)
        # above the clock where a job reaches its power limit the firmware holds the clock down
        # anyway: planning for it would book power the job can never draw. Where the limit was
        # seen to bind, the clock it allowed; elsewhere where the model says it would bind.
        x_hi = estimator.family.clock_at_power(
            power_theta, st.power_limit_w, xm_hi, st.mem_mask, estimator.knee_x, x_lo, x_hi
        )
        x_hi = np.clip(np.minimum(x_hi, estimator.limit_x), x_lo, None)
        problem = DualProblem(
            family=estimator.family,
            gpus=st.gpus.astype(np.float64),
            power_theta=power_theta,
            time_theta=estimator.time.theta * estimator.time_scale[:, None],
            weight=weight,
            knee_x=estimator.knee_x,
            mem_mask=st.mem_mask,
            x_lo=x_lo,
            x_hi=x_hi,
            xm_lo=np.where(st.mem_mask > 0, m_lo / st.memory_max_mhz, xm_hi),
            xm_hi=xm_hi,
            budget_w=np.zeros(1),
        )
        if s.offset_per_job:
            self._weigh_offsets(estimator, problem)
        # B_eff = (B − P_uncontrolled − ε B) / (1 + δ), ε = max(ε₀, min(c/√N, Q₁₋ₚ − m))
        guard = self._guard = self.cluster_guard(len(estimator))
        effective = (budget_w - uncontrolled_w - guard * budget_w) / (1.0 + self.offset)
        problem = replace(problem, budget_w=np.array([max(effective, 0.0)]))
        serving = None
        if jobs.serving().any():
            problem, serving = self._serve(problem, grid, estimator, jobs, seen, give)
        pinned = None if serving is None else serving.serving
        if jobs.tenancy is None:
            return problem, serving
        seen_w = estimator.power.count.astype(np.float64)
        return jobs.tenancy.collapse(problem, seen_w, pinned), serving

    def _serve(
        self,
        problem: DualProblem,
        grid: ClockGrid,
        estimator: JobEstimator,
        jobs: JobState,
        seen: tuple[FloatArray, FloatArray] | None,
        give: bool,
    ) -> tuple[DualProblem, ServingPlan]:
        """Each serving job's range pinned at its floor (`serving_floor`), snapped up to a
        supported clock, at its top memory clock; with ``give``, the floors that give way
        (`give_way`) when the budget cannot hold them with every other job at its lowest
        clock go back to their lowest clock."""
        s = self.settings
        serving = jobs.serving()
        assert jobs.objective_s is not None
        b = estimator.time.theta
        plan = serving_floor(
            jobs.objective_s,
            b,
            estimator.time.count,
            problem.mem_mask * b[:, 1] / problem.xm_hi,
            problem.x_lo,
            problem.x_hi,
            None if seen is None else seen[0],
            None if seen is None else seen[1],
            estimator.floor_x,
            s.serving_margin,
            s.serving_step,
        )
        g_max = estimator.statics.graphics_max_mhz
        floor = np.where(serving, _ceil_level(grid, jobs.gpu_type, plan.floor_x, g_max), np.nan)
        x_lo = np.where(serving, floor, problem.x_lo)
        pinned = replace(
            problem,
            x_lo=x_lo,
            x_hi=np.where(serving, floor, problem.x_hi),
            xm_lo=np.where(serving, problem.xm_hi, problem.xm_lo),
        )
        gave = np.zeros(serving.shape, dtype=bool)
        if give:
            share = (
                np.ones(serving.shape)
                if jobs.tenancy is None
                else jobs.tenancy.attribution(estimator.statics.gpus)
            )
            floor_w = share * pinned.power_w(pinned.x_lo, pinned.xm_lo)
            excess_w = float(floor_w.sum() - problem.budget_w[0])
            if excess_w > 0:
                rows = np.flatnonzero(serving)
                lowest_w = share * problem.power_w(problem.x_lo, pinned.xm_lo)
                gave[rows[give_way(floor_w[rows], lowest_w[rows], excess_w)]] = True
                pinned = replace(pinned, x_lo=np.where(gave, problem.x_lo, pinned.x_lo))
        return pinned, replace(plan, floor_x=floor, gave_way=gave)

    def weights(
        self,
        estimator: JobEstimator,
        jobs: JobState,
        now_s: float,
        queue: QueueState | None = None,
    ) -> FloatArray:
        """w (1, N): deadline pressure per second of iteration time, after the rules."""
        s = self.settings
        n = len(estimator)
        t_top = _top_iteration_s(estimator)
        slack = jobs.deadline_s - now_s
        has_deadline = np.isfinite(jobs.deadline_s)
        # unknown remaining work: assume the job needs its whole slack at top clocks (pressure
        # 1), or, from its time limit, at most what the limit leaves
        bound_top_s = (
            jobs.remaining_top_s(estimator.work_top_s, now_s, self.limit_share.share)
            if s.work_from_time_limit
            else np.full(n, np.nan)
        )
        estimated = np.isfinite(bound_top_s)
        remaining = np.where(
            np.isfinite(jobs.remaining_iterations),
            jobs.remaining_iterations,
            np.where(
                estimated,
                bound_top_s,
                np.where(has_deadline, np.maximum(slack, s.interval_s), 0.0),
            )
            / t_top,
        )
        pressure_per_iter = 1.0 / np.maximum(slack, s.interval_s)  # π = 1 / max(D − t, Δt)
        low = s.default_pressure / t_top
        w = np.where(has_deadline, remaining * pressure_per_iter, low)
        # cap the pressure of late jobs: w T ≤ π_max at top clocks; of estimated ones at 1
        w = np.minimum(w, np.where(estimated, 1.0, s.max_pressure) / t_top)
        if s.pressure_floor:
            w = np.maximum(w, low)
        if s.triage:
            # hopeless: a miss even at top clocks from now on, R · T_top > D − t
            hopeless = (
                (estimator.time.count > 0)
                & has_deadline
                & (jobs.remaining_iterations * t_top > slack)
            )
            w = np.where(hopeless, low, w)
        if s.drain_pressure > 0 and queue is not None and queue.waiting:
            w = np.maximum(
                w, s.drain_pressure * self._draining(estimator, jobs, queue, t_top) / t_top
            )
        # a serving job's clock is its floor (`_serve`): it weighs nothing on the others
        return np.where(jobs.serving(), 0.0, w)[None, :]

    @staticmethod
    def _draining(
        estimator: JobEstimator, jobs: JobState, queue: QueueState, t_top: FloatArray
    ) -> FloatArray:
        """1 for the jobs on the node predicted to empty first, else 0; all 0 unless some GPU
        is free (jobs wait although GPUs are free: the head of a FIFO queue needs more than any
        node has free, and waits for a node to empty)."""
        out = np.zeros(len(estimator))
        rows, nodes = queue.job_row, queue.job_node
        if not rows.size or not (queue.free_gpus > 0).any() or rows.max() >= out.size:
            return out
        known = (estimator.time.count > 0) & np.isfinite(jobs.remaining_iterations)
        left = np.where(known, jobs.remaining_iterations * t_top, np.inf)  # at top clocks
        empties_in = np.full(queue.free_gpus.shape[0], -np.inf)
        np.maximum.at(empties_in, nodes, left[rows])  # a node empties with its last job
        empties_in[~np.isfinite(empties_in)] = np.inf  # no job, or one of unknown length
        first = int(np.argmin(empties_in))
        if np.isfinite(empties_in[first]):
            out[rows[nodes == first]] = 1.0
        return out

    def _decide(
        self,
        planned_power_w: FloatArray,
        problem: DualProblem,
        result: DualResult | DomainResult,
        plan: DiscretePlan,
        learn: tuple[RlsUpdate, RlsUpdate] | None,
        t0: float,
        budget_w: float,
    ) -> Decision:
        predicted = float(plan.job_power_w.sum())
        effective = float(problem.budget_w[0])
        return Decision(
            status=result.status[0],
            price=float(result.price[0]),
            graphics_mhz=plan.graphics_mhz,
            memory_mhz=plan.memory_mhz,
            job_power_w=plan.job_power_w,
            planned_power_w=planned_power_w,
            predicted_power_w=predicted,
            budget_w=budget_w,
            effective_budget_w=effective,
            offset=self.offset,
            dual_evaluations=result.evaluations,
            upgrades=plan.upgrades,
            solve_s=time.perf_counter() - t0,
            learn=learn,
        )


def _ceil_level(grid: ClockGrid, types: IntArray, x: FloatArray, g_max: FloatArray) -> FloatArray:
    """(N,) the lowest supported graphics clock at or above ``x`` (normalised by ``g_max``) at
    each type's top memory clock, the top one if none is; NaN stays NaN."""
    out = np.full(x.shape, np.nan)
    rows = np.flatnonzero(np.isfinite(x))
    if not rows.size:
        return out
    t = types[rows]
    m_top = grid.memory_count[t] - 1
    levels = grid.graphics_mhz[t, m_top]  # (S, G), padded with huge values
    above = levels >= (x[rows] * g_max[rows] * (1.0 - 1e-12))[:, None]
    first = np.where(above.any(axis=1), above.argmax(axis=1), grid.graphics_count[t, m_top] - 1)
    out[rows] = levels[np.arange(rows.size), first] / g_max[rows]
    return out


def _check_groups(jobs: JobState, n: int) -> None:
    """Refuse GPU groups (`JobState.tenancy`) that are not one per each of the ``n`` jobs."""
    if jobs.tenancy is not None and jobs.tenancy.group.shape != (n,):
        raise InputError("the GPU groups do not match the controller's jobs")


def _per_job(tenancy: Tenancy, x: FloatArray, x_m: FloatArray) -> tuple[FloatArray, FloatArray]:
    """Step-0 clocks per group as clocks per job."""
    return x[0][tenancy.group], x_m[0][tenancy.group]


def _top_iteration_s(estimator: JobEstimator) -> FloatArray:
    """(N,) each job's seconds per iteration at its top clocks, its model's times the plan's
    factor (`JobEstimator.time_scale`; 1 where the model gives no positive finite time)."""
    one = np.ones(len(estimator))
    t_top = estimator.predict_iteration_s(one, one) * estimator.time_scale
    return np.where(np.isfinite(t_top) & (t_top > 0), t_top, 1.0)
