"""The economic MPC: every control interval, clocks for every running job (DESIGN.md).

One step:
1. learn: RLS update of every job's power and iteration-time model from the last interval;
2. offset: δ ← (1−η) δ + η (Σ P_meas − Σ P_plan) / Σ P_plan, the share by which the last plan
   missed (model error, clocks the firmware held down), over the jobs it actually modelled. It
   is relative, so it stays right when the budget moves;
3. weights: w_n = R_n / max(D_n − t, Δt), remaining iterations over remaining slack, so that
   w_n T_n(f) is the job's deadline pressure (> 1 means a predicted miss);
4. budget: B_eff(k+h) = (B(k+h) − P_uncontrolled − ε B(k+h)) / (1 + δ), per step; a job not
   measured yet is not a decision variable: it runs at its top clock and is counted at its power
   limit (the firmware enforces it), so an unknown job can never push the cluster over;
5. price: dual decomposition (`dual.py`), one price per horizon step; when the resulting plan
   moves jobs to clocks their models know less well, an exploration margin (κ times the growth
   of the models' standard error) is held back and the price solved again;
6. clocks: floor to supported levels and greedy fill (`discrete.py`) for the step applied now.

With a constant budget the horizon steps decouple and H = 1 is exact (paper §5.3); H > 1 earns
its keep when the budget changes on a schedule: each step sees its own budget and weights built
from remaining work and slack propagated along the previous plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import NDArray

from slurm_cdgpc.control.discrete import ClockGrid, DiscretePlan, discretise
from slurm_cdgpc.control.dual import MODES, DualProblem, DualResult, StepStatus, solve_price
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.estimator import JobEstimator
from slurm_cdgpc.model.families import FloatArray
from slurm_cdgpc.model.rls import BoolArray, RlsUpdate

IntArray = NDArray[np.int64]


@dataclass(frozen=True)
class ControllerSettings:
    mode: str = "newton"
    tol: float = 1e-6
    horizon: int = 1
    interval_s: float = 60.0
    #: ε: fraction of the budget held back for a hard cap (paper §5.4: 0.2–0.5 %)
    guard_band: float = 0.003
    #: η: gain of the offset estimate
    offset_gain: float = 0.3
    #: deadline pressure assumed for jobs without a deadline (1 = "just on time at top clocks")
    default_pressure: float = 0.5
    #: pressure cap for jobs at or past their deadline (their slack is floored at Δt)
    max_pressure: float = 1e3
    greedy_rounds: int = 8
    #: measured intervals before a job's plan counts towards the offset estimate
    settle_intervals: int = 3
    #: κ of the exploration margin (`EconomicMPC.exploration_margin_w`); 0 turns it off
    uncertainty_sigmas: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"unknown dual mode {self.mode!r} (known: {', '.join(MODES)})")
        if self.horizon < 1:
            raise InputError(f"horizon must be at least 1, got {self.horizon}")
        if self.interval_s <= 0:
            raise InputError(f"control interval must be positive, got {self.interval_s}")
        if not 0.0 <= self.guard_band < 0.5:
            raise InputError(f"guard band must be in [0, 0.5), got {self.guard_band}")
        if not 0.0 <= self.offset_gain <= 1.0:
            raise InputError(f"offset gain must be in [0, 1], got {self.offset_gain}")


@dataclass(frozen=True)
class JobState:
    """The controller's view of the running jobs, aligned with the estimator's rows."""

    gpu_type: IntArray  # index into the controller's ClockGrid
    remaining_iterations: FloatArray  # R_n; NaN when the job never said
    deadline_s: FloatArray  # D_n (absolute, same clock as ``now_s``); NaN when none


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


@dataclass(frozen=True)
class Decision:
    status: StepStatus
    price: float
    prices: FloatArray  # per horizon step
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

    @property
    def budget_error_pct(self) -> float:
        """Planned power against the effective budget (negative = under)."""
        return 100.0 * (self.predicted_power_w - self.effective_budget_w) / self.effective_budget_w


class EconomicMPC:
    """The head's controller: `step` once per interval."""

    def __init__(self, grid: ClockGrid, settings: ControllerSettings | None = None) -> None:
        self.grid = grid
        self.settings = settings or ControllerSettings()
        self.offset = 0.0  # δ
        self._last_price: FloatArray | None = None

    def step(
        self,
        estimator: JobEstimator,
        jobs: JobState,
        now_s: float,
        budget_w: float | FloatArray,
        uncontrolled_w: float = 0.0,
        measured: Measurements | None = None,
    ) -> Decision:
        s = self.settings
        t0 = time.perf_counter()
        learn = None
        x_a = xm_a = None
        if measured is not None:
            x_a, xm_a = estimator.normalise(measured.graphics_mhz, measured.memory_mhz)
            if measured.planned_power_w is not None:
                drawn = estimator.statics.gpus * measured.power_w
                both = np.isfinite(drawn) & np.isfinite(measured.planned_power_w)
                if measured.power_capped is not None:
                    # a job held down by the firmware drew less than planned for a reason that
                    # leaves with the next budget change; the clock clamp, not δ, handles it
                    both &= ~measured.power_capped
                planned_w = float(np.sum(measured.planned_power_w[both]))
                if planned_w > 0:
                    miss = float(np.sum(drawn[both])) / planned_w - 1.0
                    self.offset = (1 - s.offset_gain) * self.offset + s.offset_gain * miss
            learn = estimator.observe(
                x_a,
                xm_a,
                measured.power_w,
                measured.iteration_s,
                power_capped=measured.power_capped,
            )

        problem = self.problem(estimator, jobs, now_s, budget_w, uncontrolled_w)
        warm = self._last_price
        if warm is not None and warm.shape != problem.budget_w.shape:
            warm = None
        result = solve_price(problem, s.mode, s.tol, warm_price=warm)
        if np.all(np.isfinite(result.price) & (result.price > 0)):
            self._last_price = result.price
        x, x_m = problem.best_response(result.price[:1])
        binding = result.status[0] is StepStatus.BINDING
        if s.uncertainty_sigmas > 0 and x_a is not None and xm_a is not None and binding:
            margin_w = self.exploration_margin_w(estimator, x[0], x_m[0], x_a, xm_a)
            if margin_w > 0:
                # never more than the room above every job's lowest clock: a margin must not
                # turn a binding step into an infeasible one
                room_w = -problem.gradient(np.full(problem.horizon, np.inf))
                held_w = np.minimum(margin_w, np.maximum(room_w, 0.0) * (1.0 - 1e-6))
                problem = replace(problem, budget_w=problem.budget_w - held_w)
                result = solve_price(problem, s.mode, s.tol, warm_price=result.price)
                x, x_m = problem.best_response(result.price[:1])
        if result.status[0] is StepStatus.INFEASIBLE:
            # nothing fits: unknown jobs too go to their lowest clock (still counted at the limit)
            x, x_m = problem.x_lo[None, :], problem.xm_lo[None, :]
        plan = discretise(problem, self.grid, jobs.gpu_type, x[0], x_m[0], s.greedy_rounds)
        # the offset learns only from settled models: a young job's error is RLS's to fix, and
        # counting it twice (model and offset) overshoots once the model has caught up
        settled = estimator.power.count >= s.settle_intervals
        planned = np.where(settled, plan.job_power_w, np.nan)
        return self._decide(planned, problem, result, plan, learn, t0, float(np.ravel(budget_w)[0]))

    def exploration_margin_w(
        self,
        estimator: JobEstimator,
        x: FloatArray,
        x_m: FloatArray,
        x_prev: FloatArray,
        xm_prev: FloatArray,
    ) -> float:
        """Budget held back when the plan moves jobs to clocks their models know less well.

        RLS gives each prediction a standard error σ̂_n √(φᵀPφ). Moving a job from the clocks it
        ran at to new ones grows that error by Δ_n = σ̂_n (√(φ_newᵀPφ_new) − √(φ_oldᵀPφ_old))₊;
        after a budget drop every job moves the same way and their errors add up, so the margin
        is κ Σ_n g_n Δ_n. It is zero in steady state (the plan stays where the data are).
        """
        known = estimator.power.count > 0
        if not known.any():
            return 0.0
        cov = estimator.power.cov

        def spread(xc: FloatArray, xm: FloatArray) -> FloatArray:
            phi = estimator.power_regressors(np.nan_to_num(xc, nan=1.0), np.nan_to_num(xm, nan=1.0))
            quad: FloatArray = np.einsum("ni,nij,nj->n", phi, cov, phi)
            return np.sqrt(np.maximum(quad, 0.0))

        sigma = np.sqrt(estimator.power.err_var)
        grow = np.maximum(spread(x, x_m) - spread(x_prev, xm_prev), 0.0)
        extra = np.where(known & np.isfinite(x_prev), estimator.statics.gpus * sigma * grow, 0.0)
        return self.settings.uncertainty_sigmas * float(np.sum(extra))

    def problem(
        self,
        estimator: JobEstimator,
        jobs: JobState,
        now_s: float,
        budget_w: float | FloatArray,
        uncontrolled_w: float = 0.0,
    ) -> DualProblem:
        """The continuous problem this step solves (also handed to the cvxpy reference)."""
        s = self.settings
        budget = np.broadcast_to(np.asarray(budget_w, dtype=np.float64), (s.horizon,))
        if np.any(~np.isfinite(budget)) or np.any(budget <= 0):
            raise InputError("the power budget must be a positive number of watts")
        st = estimator.statics
        g_top, m_top = self.grid.top_mhz(jobs.gpu_type)
        g_lo, m_lo = self.grid.bottom_mhz(jobs.gpu_type)
        x_hi = g_top / st.graphics_max_mhz
        xm_hi = m_top / st.memory_max_mhz
        effective = (budget - uncontrolled_w - s.guard_band * budget) / (1.0 + self.offset)
        # unmeasured jobs: power flat at the power limit (an upper bound at any clock) → top clock
        new = estimator.power.count == 0
        power_theta = estimator.power.theta
        if new.any():
            power_theta = power_theta.copy()
            power_theta[new] = 0.0
            power_theta[new, -1] = st.power_limit_w[new]
        x_lo = g_lo / st.graphics_max_mhz
        # above the clock where a job reaches its power limit the firmware holds the clock down
        # anyway: planning for it would book power the job can never draw. Where the limit was
        # seen to bind, the clock it allowed; elsewhere where the model says it would bind.
        x_hi = estimator.family.clock_at_power(
            power_theta, st.power_limit_w, xm_hi, st.mem_mask, estimator.knee_x, x_lo, x_hi
        )
        x_hi = np.clip(np.minimum(x_hi, estimator.limit_x), x_lo, None)
        return DualProblem(
            family=estimator.family,
            gpus=st.gpus.astype(np.float64),
            power_theta=power_theta,
            time_theta=estimator.time.theta,
            weight=self.weights(estimator, jobs, now_s),
            knee_x=estimator.knee_x,
            mem_mask=st.mem_mask,
            x_lo=x_lo,
            x_hi=x_hi,
            xm_lo=np.where(st.mem_mask > 0, m_lo / st.memory_max_mhz, xm_hi),
            xm_hi=xm_hi,
            budget_w=np.maximum(effective, 0.0),
        )

    def weights(self, estimator: JobEstimator, jobs: JobState, now_s: float) -> FloatArray:
        """w (H, N): remaining iterations over remaining slack, along the horizon."""
        s = self.settings
        n = len(estimator)
        one = np.ones(n)
        t_top = estimator.predict_iteration_s(one, one)  # seconds per iteration at top clocks
        t_top = np.where(np.isfinite(t_top) & (t_top > 0), t_top, 1.0)
        h = np.arange(s.horizon)[:, None]
        slack = jobs.deadline_s - now_s - h * s.interval_s  # (H, N)
        has_deadline = np.isfinite(jobs.deadline_s)
        # unknown remaining work: assume the job needs its whole slack at top clocks (pressure 1)
        remaining = np.where(
            np.isfinite(jobs.remaining_iterations),
            jobs.remaining_iterations,
            np.where(has_deadline, np.maximum(jobs.deadline_s - now_s, s.interval_s), 0.0) / t_top,
        )
        # propagate along the horizon at top-clock speed (shift-and-reuse would use the plan)
        remaining_h = np.maximum(remaining - h * s.interval_s / t_top, 0.0)
        pressure_per_iter = 1.0 / np.maximum(slack, s.interval_s)  # π = 1 / max(D − t, Δt)
        w = np.where(has_deadline, remaining_h * pressure_per_iter, s.default_pressure / t_top)
        # cap the pressure of late jobs: w T ≤ π_max at top clocks
        return np.minimum(w, s.max_pressure / t_top)

    def _decide(
        self,
        planned_power_w: FloatArray,
        problem: DualProblem,
        result: DualResult,
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
            prices=result.price,
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
