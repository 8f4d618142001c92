"""The economic MPC: every control interval, clocks for every running job (DESIGN.md).

One step:
1. learn: RLS update of every job's power and iteration-time model from the last interval;
2. offset: d̂ ← (1−η) d̂ + η (P_meas − P_pred), the model–plant mismatch of the last plan;
3. weights: w_n = R_n / max(D_n − t, Δt), remaining iterations over remaining slack, so that
   w_n T_n(f) is the job's deadline pressure (> 1 means a predicted miss);
4. budget: B_eff(k+h) = B(k+h) − P_uncontrolled − d̂ − ε B(k+h), per horizon step;
5. price: dual decomposition (`dual.py`), one price per horizon step;
6. clocks: floor to supported levels and greedy fill (`discrete.py`) for the step applied now.

With a constant budget the horizon steps decouple and H = 1 is exact (paper §5.3); H > 1 earns
its keep when the budget changes on a schedule: each step sees its own budget and weights built
from remaining work and slack propagated along the previous plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from slurm_cdgpc.control.discrete import ClockGrid, DiscretePlan, discretise
from slurm_cdgpc.control.dual import MODES, DualProblem, DualResult, StepStatus, solve_price
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.estimator import JobEstimator
from slurm_cdgpc.model.families import FloatArray
from slurm_cdgpc.model.rls import RlsUpdate

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
    #: measured total of the jobs' GPUs that the last decision planned for
    total_power_w: float | None = None


@dataclass(frozen=True)
class Decision:
    status: StepStatus
    price: float
    prices: FloatArray  # per horizon step
    graphics_mhz: IntArray
    memory_mhz: IntArray
    job_power_w: FloatArray  # predicted per job at the planned clocks
    predicted_power_w: float
    budget_w: float
    effective_budget_w: float
    offset_w: float
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
        self.offset_w = 0.0
        self._last_predicted_w: float | None = None
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
        if measured is not None:
            x_a, xm_a = estimator.normalise(measured.graphics_mhz, measured.memory_mhz)
            learn = estimator.observe(x_a, xm_a, measured.power_w, measured.iteration_s)
            if measured.total_power_w is not None and self._last_predicted_w is not None:
                miss = measured.total_power_w - self._last_predicted_w
                self.offset_w = (1 - s.offset_gain) * self.offset_w + s.offset_gain * miss

        problem = self.problem(estimator, jobs, now_s, budget_w, uncontrolled_w)
        warm = self._last_price
        if warm is not None and warm.shape != problem.budget_w.shape:
            warm = None
        result = solve_price(problem, s.mode, s.tol, warm_price=warm)
        if np.all(np.isfinite(result.price) & (result.price > 0)):
            self._last_price = result.price
        x, x_m = problem.best_response(result.price[:1])
        plan = discretise(problem, self.grid, jobs.gpu_type, x[0], x_m[0], s.greedy_rounds)
        return self._decide(problem, result, plan, learn, t0, float(np.ravel(budget_w)[0]))

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
        effective = budget - uncontrolled_w - self.offset_w - s.guard_band * budget
        return DualProblem(
            family=estimator.family,
            gpus=st.gpus.astype(np.float64),
            power_theta=estimator.power.theta,
            time_theta=estimator.time.theta,
            weight=self.weights(estimator, jobs, now_s),
            knee_x=estimator.knee_x,
            mem_mask=st.mem_mask,
            x_lo=g_lo / st.graphics_max_mhz,
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
        problem: DualProblem,
        result: DualResult,
        plan: DiscretePlan,
        learn: tuple[RlsUpdate, RlsUpdate] | None,
        t0: float,
        budget_w: float,
    ) -> Decision:
        predicted = float(plan.job_power_w.sum())
        self._last_predicted_w = predicted
        effective = float(problem.budget_w[0])
        return Decision(
            status=result.status[0],
            price=float(result.price[0]),
            prices=result.price,
            graphics_mhz=plan.graphics_mhz,
            memory_mhz=plan.memory_mhz,
            job_power_w=plan.job_power_w,
            predicted_power_w=predicted,
            budget_w=budget_w,
            effective_budget_w=effective,
            offset_w=self.offset_w,
            dual_evaluations=result.evaluations,
            upgrades=plan.upgrades,
            solve_s=time.perf_counter() - t0,
            learn=learn,
        )
