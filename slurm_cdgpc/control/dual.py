"""Lagrangian dual decomposition of one control step (Kang et al., IEEE TIE 2022).

`DualProblem` is the step's problem and each job's closed-form best response; `solve_price`
finds the price. The controller's math: never reaches `store/`, `transport/`, `agent/`,
`coordinator/` or `cli/` (`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Controller"
(3, Price); tests: `tests/unit/test_control_dual.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from slurm_cdgpc.errors import InputError, SolverError
from slurm_cdgpc.model.families import FloatArray, PowerFamily
from slurm_cdgpc.model.rls import BoolArray

MODES = ("newton", "bisection", "gradient")
#: μ is floored at this fraction of the mean μ: a job whose time ignores the clock (b_c → 0)
#: would otherwise make L, and so the paper's step 1/L, degenerate
MU_FLOOR = 1e-3


class StepStatus(StrEnum):
    SLACK = "slack"  # every job at its top clock fits: λ = 0
    BINDING = "binding"  # the cap binds: λ > 0 with −tol·B ≤ G ≤ 0
    INFEASIBLE = "infeasible"  # even the lowest clocks exceed B: all at minimum, flagged


@dataclass(frozen=True)
class DualProblem:
    """One control step's continuous problem: H steps × N jobs, clocks normalised to (0, 1].

    For H independent budgets (the controller passes one, H = 1) and prices λ_h ≥ 0, the
    Lagrangian Σ_n w_n T_n(x_n) + λ (Σ_n g_n P_n(x_n) − B) splits into one small problem per job
    and clock, each with a closed-form minimiser (`best_response`). The price needs only the
    scalar dual gradient G(λ) = Σ_n g_n P_n(x*_n(λ)) − B (`gradient`), which is continuous and
    non-increasing in λ.
    """

    family: PowerFamily
    gpus: FloatArray  # g (N,)
    power_theta: FloatArray  # (N, k_p): core coefficients, a_m, a_e
    time_theta: FloatArray  # (N, 3): b_c, b_m, b_e
    weight: FloatArray  # w (H, N)
    knee_x: FloatArray  # (N,)
    mem_mask: FloatArray  # (N,)
    x_lo: FloatArray  # core clock bounds (N,)
    x_hi: FloatArray
    xm_lo: FloatArray  # memory clock bounds (N,), both 1 on HBM parts
    xm_hi: FloatArray
    budget_w: FloatArray  # B per step (H,), for the jobs' GPUs

    @property
    def horizon(self) -> int:
        return int(self.budget_w.shape[0])

    @property
    def core_theta(self) -> FloatArray:
        return self.power_theta[:, : self.family.core_params]

    def power_w(self, x: FloatArray, x_m: FloatArray) -> FloatArray:
        """Job power g_n P_n(x, x_m), shape of x."""
        return self.gpus * self.family.power(self.power_theta, x, x_m, self.mem_mask, self.knee_x)

    def time_s(self, x: FloatArray, x_m: FloatArray) -> FloatArray:
        b = self.time_theta
        return b[:, 0] / x + self.mem_mask * b[:, 1] / x_m + b[:, 2]

    def objective(self, x: FloatArray, x_m: FloatArray) -> FloatArray:
        """Σ_n w_n T_n per step (H,)."""
        return np.asarray(np.sum(self.weight * self.time_s(x, x_m), axis=-1), dtype=np.float64)

    def best_response(self, price: FloatArray) -> tuple[FloatArray, FloatArray]:
        """Every job's minimiser of w T + λ g P, shape (H, N); λ may be 0 or +inf."""
        lam = price[:, None]
        g = self.gpus
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            # core: s/x² = m(x) with s = w b_c / (λ g); λ = 0 → s = ∞ → x_hi; b_c = 0 → x_lo
            s = np.where(lam > 0, self.weight * self.time_theta[:, 0] / (lam * g), np.inf)
            s = np.nan_to_num(s, nan=0.0)
            x = np.clip(
                self.family.stationary(s, self.core_theta, self.knee_x), self.x_lo, self.x_hi
            )
            # memory (linear power, b_m/x_m time): x_m = sqrt(w b_m / (λ g a_m))
            a_m = self.power_theta[:, -2]
            s_m = np.where(lam > 0, self.weight * self.time_theta[:, 1] / (lam * g), np.inf)
            s_m = np.nan_to_num(s_m, nan=0.0)
            x_m = np.where(a_m > 0, np.sqrt(s_m / a_m), np.inf)
        x_m = np.clip(x_m, self.xm_lo, self.xm_hi)
        return x, x_m

    def gradient(self, price: FloatArray) -> FloatArray:
        """G(λ) = Σ g P(x*(λ)) − B per step."""
        x, x_m = self.best_response(price)
        total: FloatArray = np.sum(self.power_w(x, x_m), axis=-1)
        return total - self.budget_w

    def gradient_slope(self, price: FloatArray) -> tuple[FloatArray, FloatArray]:
        """G(λ) and dG/dλ (closed form, ≤ 0) per step."""
        x, x_m = self.best_response(price)
        G = np.sum(self.power_w(x, x_m), axis=-1) - self.budget_w
        lam = price[:, None]
        g, a = self.gpus, self.core_theta
        interior = (x > self.x_lo) & (x < self.x_hi)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            s = self.weight * self.time_theta[:, 0] / (lam * g)
            # implicit differentiation of s(λ)/x² = m(x), s ∝ 1/λ:
            # dx/dλ = −(s / (λ x²)) / (2 s / x³ + m'(x))
            x2 = x * x
            dx = -(s / (lam * x2)) / (
                2.0 * s / (x2 * x) + self.family.marginal_slope(a, x, self.knee_x)
            )
            dp = g * self.family.marginal(a, x, self.knee_x) * np.where(interior, dx, 0.0)
            interior_m = (x_m > self.xm_lo) & (x_m < self.xm_hi)
            dp_m = g * self.power_theta[:, -2] * np.where(interior_m, -x_m / (2.0 * lam), 0.0)
        slope = np.sum(np.nan_to_num(dp) + np.nan_to_num(dp_m), axis=-1)
        return G, slope

    def lipschitz(self) -> FloatArray:
        """L_h = Σ g² (m(x_hi)² / μ_c + a_m² / μ_m), μ = 2 w b / x_hi³ (paper §6.4)."""
        g, w = self.gpus, self.weight
        m_top = self.family.marginal(self.core_theta, self.x_hi, self.knee_x)
        mu_c = 2.0 * w * self.time_theta[:, 0] / self.x_hi**3
        mu_m = 2.0 * w * self.time_theta[:, 1] / self.xm_hi**3
        mu_c = np.maximum(mu_c, MU_FLOOR * np.mean(mu_c, axis=-1, keepdims=True) + 1e-300)
        mu_m = np.maximum(mu_m, MU_FLOOR * np.mean(mu_c, axis=-1, keepdims=True) + 1e-300)
        a_m = self.power_theta[:, -2] * self.mem_mask
        lipschitz: FloatArray = np.sum(g**2 * (m_top**2 / mu_c + a_m**2 / mu_m), axis=-1)
        return lipschitz


@dataclass(frozen=True)
class DualResult:
    price: FloatArray  # λ per step (H,): 0 when slack, +inf when infeasible
    status: tuple[StepStatus, ...]
    evaluations: int  # evaluations of G (the dual iterations a head would run)
    mode: str


def solve_price(
    problem: DualProblem,
    mode: str = "newton",
    tol: float = 1e-6,
    warm_price: FloatArray | None = None,
    max_evaluations: int = 100_000,
) -> DualResult:
    """The price per step at which the jobs' power meets the budget, from the feasible side.

    Every mode stops with −tol·B ≤ G(λ) ≤ 0:

    - ``gradient``: the paper's projected dual ascent λ ← [λ + G(λ)/L]₊, step 1/L from the
      Lipschitz constant of G (`DualProblem.lipschitz`);
    - ``bisection`` on log λ;
    - ``newton``: safeguarded Newton on log λ with G'(λ) in closed form (`_newton`).
    """
    if mode not in MODES:
        raise InputError(f"unknown dual mode {mode!r} (known: {', '.join(MODES)})")
    if not tol > 0:
        raise InputError(f"dual tolerance must be positive, got {tol}")
    H = problem.horizon
    zero, inf = np.zeros(H), np.full(H, np.inf)
    slack = problem.gradient(zero) <= 0.0
    infeasible = problem.gradient(inf) > 0.0
    binding = ~slack & ~infeasible
    price = np.where(slack, 0.0, np.where(infeasible, np.inf, np.nan))
    evaluations = 2
    if binding.any():
        warm = None if warm_price is None else np.asarray(warm_price, np.float64)[binding]
        sub = _restrict(problem, binding)
        solver = {"newton": _newton, "bisection": _bisection, "gradient": _projected_gradient}[mode]
        lam, n = solver(sub, tol, warm, max_evaluations)
        price[binding] = lam
        evaluations += n
    status = tuple(
        StepStatus.SLACK if s else StepStatus.INFEASIBLE if i else StepStatus.BINDING
        for s, i in zip(slack, infeasible, strict=True)
    )
    return DualResult(price=price, status=status, evaluations=evaluations, mode=mode)


def _restrict(p: DualProblem, steps: np.ndarray) -> DualProblem:
    return DualProblem(
        p.family, p.gpus, p.power_theta, p.time_theta, p.weight[steps], p.knee_x, p.mem_mask,
        p.x_lo, p.x_hi, p.xm_lo, p.xm_hi, p.budget_w[steps],
    )  # fmt: skip


def _in_window(G: FloatArray, budget: FloatArray, tol: float) -> BoolArray:
    return (G <= 0.0) & (-tol * budget <= G)


def _initial_price(p: DualProblem) -> FloatArray:
    """λ at which a typical job would sit at its top clock: median of w b_c / (g m(x_hi) x_hi²)."""
    m_top = p.family.marginal(p.core_theta, p.x_hi, p.knee_x)
    with np.errstate(divide="ignore", invalid="ignore"):
        lam = p.weight * p.time_theta[:, 0] / (p.gpus * m_top * p.x_hi**2)
    lam = np.where(np.isfinite(lam) & (lam > 0), lam, np.nan)
    guess = np.nanmedian(lam, axis=-1) if np.isfinite(lam).any() else np.ones(p.horizon)
    return np.where(np.isfinite(guess) & (guess > 0), guess, 1.0)


def _bracket(
    p: DualProblem, start: FloatArray, budget_evals: int
) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray, int]:
    """Expand from ``start`` by ×4 until G(lo) > 0 ≥ G(hi); returns lo, hi, G(lo), G(hi)."""
    lo, hi = start.copy(), start.copy()
    G = p.gradient(start)
    G_lo, G_hi = G.copy(), G.copy()
    n = 1
    while True:
        need_up, need_down = G_hi > 0.0, G_lo <= 0.0
        if not (need_up.any() or need_down.any()):
            return lo, hi, G_lo, G_hi, n
        if n >= budget_evals:
            raise SolverError("could not bracket the price")
        hi = np.where(need_up, hi * 4.0, hi)
        lo = np.where(need_down, lo / 4.0, lo)
        probe = np.where(need_up, hi, lo)
        G = p.gradient(probe)
        n += 1
        G_hi = np.where(need_up, G, G_hi)
        G_lo = np.where(need_down, G, G_lo)
        # a probe that overshot still tightens the other side
        lo = np.where(need_up & (G > 0), hi, lo)
        G_lo = np.where(need_up & (G > 0), G, G_lo)
        hi = np.where(need_down & (G <= 0), lo, hi)
        G_hi = np.where(need_down & (G <= 0), G, G_hi)


def _bisection(
    p: DualProblem, tol: float, warm: FloatArray | None, max_evals: int
) -> tuple[FloatArray, int]:
    start = warm if warm is not None and np.all(warm > 0) and np.all(np.isfinite(warm)) else None
    lo, hi, _, G_hi, n = _bracket(p, _initial_price(p) if start is None else start, max_evals)
    done = _in_window(G_hi, p.budget_w, tol)
    while not done.all():
        if n >= max_evals:
            raise SolverError(f"bisection did not converge in {n} evaluations")
        mid = np.sqrt(lo * hi)  # bisection on log λ
        G = p.gradient(mid)
        n += 1
        feasible = G <= 0.0
        hi = np.where(~done & feasible, mid, hi)
        G_hi = np.where(~done & feasible, G, G_hi)
        lo = np.where(~done & ~feasible, mid, lo)
        done |= _in_window(G_hi, p.budget_w, tol) | (hi / lo - 1.0 < 1e-15)
    return hi, n


def _newton(
    p: DualProblem, tol: float, warm: FloatArray | None, max_evals: int
) -> tuple[FloatArray, int]:
    """Safeguarded Newton on u = log λ inside the bracket (0, ∞), known from the caller's checks
    G(0) > 0 ≥ G(∞); falls back to bisection (or ×4 while a bracket end is still 0 or ∞)."""
    ok_warm = warm is not None and np.all(warm > 0) and np.all(np.isfinite(warm))
    lam = warm.copy() if ok_warm and warm is not None else _initial_price(p)
    lo, hi = np.zeros(p.horizon), np.full(p.horizon, np.inf)
    target = -0.5 * tol * p.budget_w  # aim at the middle of the feasible window
    best, done = lam.copy(), np.zeros(p.horizon, dtype=bool)
    n = 0
    while True:
        G, slope = p.gradient_slope(lam)
        n += 1
        hit = ~done & _in_window(G, p.budget_w, tol)
        best = np.where(hit, lam, best)
        done |= hit
        feasible = G <= 0.0
        hi = np.where(~done & feasible, lam, hi)
        lo = np.where(~done & ~feasible, lam, lo)
        collapsed = ~done & np.isfinite(hi) & (hi / np.maximum(lo, 1e-300) - 1.0 < 1e-15)
        best = np.where(collapsed, hi, best)
        done |= collapsed
        if done.all():
            return best, n
        if n >= max_evals:
            raise SolverError(f"Newton did not converge in {n} evaluations")
        # u ← u − (G − target) / (λ G'(λ)); outside the bracket: bisect, or ×4 towards it
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            cand = lam * np.exp(-(G - target) / (lam * slope))
        inside = np.isfinite(cand) & (cand > lo) & (cand < hi)
        fallback = np.where(
            np.isfinite(hi) & (lo > 0), np.sqrt(lo * hi), np.where(np.isfinite(hi), hi / 4, lo * 4)
        )
        lam = np.where(inside, cand, fallback)


def _projected_gradient(
    p: DualProblem, tol: float, warm: FloatArray | None, max_evals: int
) -> tuple[FloatArray, int]:
    L = p.lipschitz()
    if not np.all(np.isfinite(L) & (L > 0)):
        raise SolverError("the dual gradient's Lipschitz bound is not finite")
    lam = np.zeros(p.horizon) if warm is None else np.where(np.isfinite(warm), warm, 0.0)
    target = -0.5 * tol * p.budget_w  # aim at the middle of the feasible window
    for n in range(1, max_evals + 1):
        G = p.gradient(lam)
        if np.all(_in_window(G, p.budget_w, tol)):
            return lam, n
        lam = np.maximum(lam + (G - target) / L, 0.0)  # λ ← [λ + γ G]₊, γ = 1/L
    raise SolverError(f"dual gradient did not converge in {max_evals} evaluations")
