"""What a replay is judged by (`Metrics`), computed from a `SimulationResult`.

Each field is defined on `Metrics`. Design: DESIGN.md, "Simulator" (Reference run, Results);
test: `tests/unit/test_sim_metrics.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from slurm_cdgpc.config import ControlConfig
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.sim.cluster import SimulationResult, Simulator
from slurm_cdgpc.sim.policies import make_policy

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

#: P > (1 + this) B counts as over budget
OVER_BUDGET_TOLERANCE = 0.01


@dataclass(frozen=True)
class Metrics:
    """One replay's figures. A job "meets" its deadline when it finishes at or before it; a
    deadline job that never ran, being larger than the fleet, misses it."""

    policy: str
    fleet_gpus: int
    budget_w: float
    #: jobs in the trace; jobs that finished; jobs larger than the whole fleet (never queued)
    jobs: int
    finished: int
    rejected: int
    #: jobs with a deadline; those that miss it; violations / deadline_jobs
    deadline_jobs: int
    violations: int
    dvr: float
    #: deadline jobs that meet their deadline in the ``max-clock`` replay of the same seeded
    #: workload (the reference) but miss it here, None without a reference run; and over
    #: deadline_jobs. Judging a miss "unavoidable" from a job's actual start would depend on the
    #: policy, since slowing jobs lengthens the queue; the reference run does not.
    violations_induced: int | None
    dvr_induced: float | None
    #: deadline jobs with deadline ≥ submission + duration at max clocks (they could make it
    #: if they started at once); the misses among them
    feasible_jobs: int
    violations_feasible: int
    #: mean |P − B| / B × 100 over the binding intervals (P: cluster power over the interval),
    #: None when the cap never binds
    power_mae_pct: float | None
    #: intervals where the running jobs' max-clock demand (idle GPUs included) exceeds the
    #: budget, i.e. the cap binds
    binding_intervals: int
    #: share of simulated intervals with P > (1 + `OVER_BUDGET_TOLERANCE`) B, × 100
    over_budget_intervals_pct: float
    #: max over intervals of (P / B − 1) × 100 (negative: never above the budget)
    max_overshoot_pct: float
    #: cluster energy over the replay, idle GPUs and idle gaps included
    energy_kwh: float
    #: mean of finish − submission over finished jobs; last finish − first submission
    mean_jct_s: float
    makespan_s: float
    #: median time of the policy's decision per interval, milliseconds
    controller_ms_p50: float
    #: jobs Slurm ended at their time limit (never finished; a deadline job among them misses)
    killed_at_time_limit: int = 0
    #: for traces that class their jobs (Chronus: strict, soft, best-effort), ``deadline_jobs``,
    #: ``violations`` and ``violations_induced`` per class. Soft jobs are judged by their first
    #: deadline, like strict ones; best-effort jobs carry none.
    by_job_type: dict[str, dict[str, int | None]] = field(default_factory=dict)
    #: power domains below the cluster (0: none, and the two below are left out of `as_dict`)
    domains: int = 0
    #: the worst domain's share of simulated intervals in which its nodes' true power P_d
    #: exceeded (1 + `OVER_BUDGET_TOLERANCE`) × its limit L_d, × 100
    domain_over_limit_intervals_pct: float | None = None
    #: max over domains and intervals of (P_d − L_d) / L_d × 100
    domain_max_overshoot_pct: float | None = None
    #: serving jobs (0: none, and the fields below are left out of `as_dict`)
    serving_jobs: int = 0
    #: share of the serving jobs' intervals with requests whose true latency at the
    #: objective's percentile met the objective
    slo_attainment: float | None = None
    #: the serving GPUs' energy over the replay (in ``energy_kwh`` too), and their mean power
    #: per GPU: a replay that takes longer serves longer, so the mean compares policies
    serving_energy_kwh: float | None = None
    serving_mean_w: float | None = None
    #: mean over the serving jobs' intervals of their clock over their top clock
    serving_clock_fraction: float | None = None
    #: the most the running jobs (idle GPUs included) would have drawn at top clocks in one
    #: interval: ``max-clock``'s is the fleet's peak draw, against which to set a budget
    peak_demand_w: float = 0.0
    #: jobs that share GPUs (`slurm_cdgpc.sim.sharing`; None, and left out of `as_dict`, when
    #: none does): the mean number of shared GPUs over the intervals, and their mean tenants
    shared_gpus_mean: float | None = None
    tenants_per_shared_gpu: float | None = None
    #: ... and how far the controller's time models missed each job's iteration time, mean
    #: |error| in percent, alone, shared and just after co-tenants changed or left
    #: (`slurm_cdgpc.sim.sharing.TenantTimeErrors`; None: not a cdgpc replay)
    time_model_error_pct: dict[str, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if not self.domains:
            for key in ("domains", "domain_over_limit_intervals_pct", "domain_max_overshoot_pct"):
                del out[key]
        if not self.serving_jobs:
            for key in ("serving_jobs", *SERVING_MEANS):
                del out[key]
        if self.shared_gpus_mean is None:
            del out["shared_gpus_mean"], out["tenants_per_shared_gpu"]
        if self.time_model_error_pct is None:
            del out["time_model_error_pct"]
        return out


#: the serving metrics a sweep averages over seeds (`Metrics`; with ``serving_jobs``, left out
#: when nothing serves)
SERVING_MEANS: Final = (
    "slo_attainment",
    "serving_energy_kwh",
    "serving_mean_w",
    "serving_clock_fraction",
)


def missed(result: SimulationResult) -> BoolArray:
    """Deadline jobs that finish after their deadline or never finish."""
    has = np.isfinite(result.deadline_s)
    late = ~(result.finish_s <= result.deadline_s)  # NaN finish: a miss
    return has & late


def slowdown(result: SimulationResult) -> FloatArray:
    """(finish − submission) / duration at max clocks, for finished jobs of non-zero length."""
    ok = np.isfinite(result.finish_s) & (result.duration_s > 0)
    return (result.finish_s[ok] - result.submit_s[ok]) / result.duration_s[ok]


def _finite(value: float) -> float:
    return float(value) if math.isfinite(value) else 0.0


def compute_metrics(result: SimulationResult, reference: SimulationResult | None = None) -> Metrics:
    """The metrics of ``result``; ``reference`` is the max-clock replay of the same workload."""
    has = np.isfinite(result.deadline_s)
    miss = missed(result)
    deadline_jobs = int(has.sum())
    induced: int | None = None
    if reference is not None:
        if reference.submit_s.shape != result.submit_s.shape:
            raise InputError("the reference replay is of another trace")
        induced = int(np.sum(miss & ~missed(reference) & has))
    feasible = has & (result.deadline_s >= result.submit_s + result.duration_s)
    finished = np.isfinite(result.finish_s)
    budget = result.budget_w
    binding = result.demand_w > budget
    gap = np.abs(result.power_w[binding] - budget) / budget  # |P − B| / B
    intervals = max(result.power_w.size, 1)
    over = result.power_w > (1.0 + OVER_BUDGET_TOLERANCE) * budget
    return Metrics(
        policy=result.policy,
        fleet_gpus=result.fleet_gpus,
        budget_w=budget,
        jobs=int(result.submit_s.size),
        finished=int(finished.sum()),
        rejected=int(result.rejected.sum()),
        deadline_jobs=deadline_jobs,
        violations=int(miss.sum()),
        dvr=int(miss.sum()) / deadline_jobs if deadline_jobs else 0.0,
        violations_induced=induced,
        dvr_induced=None if induced is None or not deadline_jobs else induced / deadline_jobs,
        feasible_jobs=int(feasible.sum()),
        violations_feasible=int(np.sum(miss & feasible)),
        power_mae_pct=float(100.0 * gap.mean()) if gap.size else None,
        binding_intervals=int(binding.sum()),
        over_budget_intervals_pct=100.0 * int(over.sum()) / intervals,
        max_overshoot_pct=(
            float(100.0 * (result.power_w.max() / budget - 1.0)) if result.power_w.size else 0.0
        ),
        energy_kwh=result.energy_j / 3.6e6,
        mean_jct_s=_finite(float(np.mean(result.finish_s[finished] - result.submit_s[finished])))
        if finished.any()
        else 0.0,
        makespan_s=(
            float(np.max(result.finish_s[finished]) - np.min(result.submit_s))
            if finished.any()
            else 0.0
        ),
        controller_ms_p50=(
            float(1e3 * np.median(result.controller_s)) if result.controller_s.size else 0.0
        ),
        killed_at_time_limit=int(np.sum(result.killed)),
        by_job_type=_by_job_type(result, miss, None if reference is None else missed(reference)),
        **_domain_metrics(result),
        **_serving_metrics(result),
        peak_demand_w=float(result.demand_w.max()) if result.demand_w.size else 0.0,
        **_sharing_metrics(result),
    )


def _sharing_metrics(result: SimulationResult) -> dict[str, Any]:
    if not result.shared_gpus.size or not result.shared_gpus.any():
        return {}
    return {
        "shared_gpus_mean": float(result.shared_gpus.mean()),
        "tenants_per_shared_gpu": float(result.tenants.sum() / result.shared_gpus.sum()),
    }


def _serving_metrics(result: SimulationResult) -> dict[str, Any]:
    """`Metrics`' serving fields, from the true latencies and clocks."""
    jobs = int(result.serving_objective_s.size)
    if not jobs:
        return {}
    latency = result.serving_latency_s
    seen = np.isfinite(latency)
    met = latency <= result.serving_objective_s[None, :]
    return {
        "serving_jobs": jobs,
        "slo_attainment": float(met[seen].mean()) if seen.any() else None,
        "serving_energy_kwh": result.serving_energy_j / 3.6e6,
        "serving_mean_w": (
            result.serving_energy_j / (jobs * result.t_s.size * result.interval_s)
            if result.t_s.size
            else None
        ),
        "serving_clock_fraction": (
            float(result.serving_clock.mean()) if result.serving_clock.size else None
        ),
    }


def _domain_metrics(result: SimulationResult) -> dict[str, Any]:
    """`Metrics`' power-domain fields, from the true power of each domain's nodes."""
    limit_w = result.domain_limit_w
    if not limit_w.size:
        return {}
    # P_d(t) = Σ_{nodes in d} P_node(t), (intervals, domains)
    domain_w = result.node_power_w.astype(np.float64) @ result.domain_nodes.T.astype(np.float64)
    over = domain_w > (1.0 + OVER_BUDGET_TOLERANCE) * limit_w
    intervals = max(domain_w.shape[0], 1)
    return {
        "domains": int(limit_w.size),
        "domain_over_limit_intervals_pct": 100.0 * int(over.sum(axis=0).max()) / intervals,
        "domain_max_overshoot_pct": (
            float(100.0 * ((domain_w - limit_w) / limit_w).max()) if domain_w.size else 0.0
        ),
    }


def _by_job_type(
    result: SimulationResult, miss: BoolArray, reference_miss: BoolArray | None
) -> dict[str, dict[str, int | None]]:
    types = result.job_type
    if types.size != result.submit_s.size or not np.any(types != ""):
        return {}
    has = np.isfinite(result.deadline_s)
    out: dict[str, dict[str, int | None]] = {}
    for name in sorted(set(types.tolist()) - {""}):
        mine = types == name
        out[name] = {
            "jobs": int(mine.sum()),
            "deadline_jobs": int(np.sum(mine & has)),
            "violations": int(np.sum(mine & miss)),
            "violations_induced": (
                None if reference_miss is None else int(np.sum(mine & miss & ~reference_miss))
            ),
        }
    return out


@dataclass(frozen=True)
class PolicyRun:
    """One policy's replay and its metrics."""

    result: SimulationResult
    metrics: Metrics


def run_policies(
    simulator: Simulator,
    names: Sequence[str],
    progress: Callable[[str, int], None] | None = None,
    control: ControlConfig | None = None,
) -> dict[str, PolicyRun]:
    """Replay the simulator's trace under each policy in ``names``, on the same seeded workload
    (``control``: the ``[control]`` section ``cdgpc`` runs with; None: the shipped one).

    The ``max-clock`` replay (the reference of ``violations_induced``) runs first, whether
    asked for or not; it is returned only when asked for.
    """
    for name in names:
        make_policy(name)  # unknown names fail before any replay

    def replay(name: str) -> tuple[SimulationResult, dict[str, float] | None]:
        tick = None if progress is None else (lambda done: progress(name, done))
        policy = make_policy(name, control)
        result = simulator.run(policy, tick)
        errors = getattr(policy, "time_errors", None)
        return result, None if errors is None else errors.summary()

    reference, _ = replay("max-clock")
    runs: dict[str, PolicyRun] = {}
    for name in names:
        result, errors = (reference, None) if name == "max-clock" else replay(name)
        metrics = compute_metrics(result, reference)
        if errors is not None:
            metrics = replace(metrics, time_model_error_pct=errors)
        runs[name] = PolicyRun(result, metrics)
    return runs
