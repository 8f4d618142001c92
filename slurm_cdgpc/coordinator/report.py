"""One control interval as the API, the metrics and the tests see it: `IntervalReport`, with a
`JobView` per active job and a `DomainView` per power domain. Built by the loop at the end of
each interval and replaced whole, so the API's threads read it without a lock (DESIGN.md, "Data
flow"); nothing here reads the store or talks to the nodes. Tests:
`tests/unit/test_coordinator_daemon.py`, `tests/unit/test_coordinator_domains.py`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Final

import numpy as np

from slurm_cdgpc.control.domains import DomainLimits
from slurm_cdgpc.control.empc import Decision
from slurm_cdgpc.coordinator.jobs import GpuRef, RunningJobs, jobs_on, node_power_w
from slurm_cdgpc.store import Job
from slurm_cdgpc.topology import Topology

#: `JobView.serving`'s states (`_served`)
SERVING_STATES: Final = ("met", "missed", "unmet", "gave-way", "waiting")


def finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


@dataclass(frozen=True)
class JobView:
    """What the head does with one job now (for ``GET /v1/jobs``)."""

    job_id: str
    controlled: bool
    graphics_mhz: int | None = None
    memory_mhz: int | None = None
    predicted_power_w: float | None = None
    #: all its GPUs, last exchange; a GPU it shares split equally between its jobs
    measured_power_w: float | None = None
    #: ``reported`` (steps arrived since it joined) or ``none``
    progress: str = "none"
    #: work left in seconds at top clocks (an upper bound when `Job.work_source` is
    #: ``time-limit``) and
    #: when it would end at the decided clocks; None: not known
    left_top_s: float | None = None
    finish_s: float | None = None
    #: the other active jobs on its GPUs (shards, MPS, MIG instances): one clock for all
    shares_with: tuple[str, ...] = ()
    #: the readings its power model has learnt from (0: counted as a new job, at a share of its
    #: power limit)
    model_readings: int = 0
    #: a serving job: its latency objective, the latency it last reported, its clock floor
    #: (`slurm_cdgpc.control.serving`) and its state: ``met`` (the last report within the
    #: objective), ``missed``, ``unmet`` (missed at the top clock), ``gave-way`` (its floor
    #: gave way to the budget) or ``waiting`` (no report yet)
    objective_s: float | None = None
    latency_s: float | None = None
    floor_mhz: int | None = None
    serving: str | None = None


@dataclass(frozen=True)
class DomainView:
    """One power domain (a row, a rack, a PDU) in an interval, judged as the cluster is."""

    name: str
    limit_w: float
    #: the controlled jobs' planned power under it plus its power outside the plan
    planned_w: float
    #: what its nodes' GPUs reported in the last exchange (as `IntervalReport.measured_power_w`)
    measured_w: float
    #: its price in the decision (`Decision.domain_price`: 0 where its limit does not bind, +inf
    #: where it does not fit even at the lowest clocks); a job under it pays it on top of the
    #: cluster's (`coordinator.admission`)
    price: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "limit_w": self.limit_w,
            "planned_w": self.planned_w,
            "measured_w": self.measured_w,
        }


@dataclass(frozen=True)
class IntervalReport:
    """One interval as the API, the metrics and the tests see it."""

    interval: int
    time_s: float
    budget_w: float | None
    effective_budget_w: float | None
    uncontrolled_w: float
    predicted_power_w: float | None  # the controlled jobs, at the decided clocks
    #: every GPU that reported a power in the last exchange: the interval's mean where the energy
    #: counter gives it, else the reading
    measured_power_w: float
    price: float | None
    status: str  # the controller's step status, or "idle" without jobs
    solve_s: float
    shadow: bool
    nodes_reachable: int
    nodes_unreachable: int
    setpoints_sent: int
    jobs: tuple[JobView, ...] = ()
    #: GPUs another limiter holds (a lower enforced limit, a brake, a slowdown, clocks another
    #: process took), one line each: ``node:index: why``
    limited: tuple[str, ...] = ()
    #: the power domains below the budget, in the topology's order (none without a topology)
    domains: tuple[DomainView, ...] = ()
    #: the cluster's limit the plan was made under where a ramp held it below the budget
    #: (`control.ramp`); None where it was the budget
    ramp_budget_w: float | None = None
    #: the share of the budget the plan held back as its guard band (None: no plan)
    guard_band: float | None = None
    #: δ, how far recent plans' settled jobs drew over (+) or under (−) their plans, as a
    #: share; it scales the plan (None: no plan)
    offset: float | None = None

    def to_dict(self) -> dict[str, object]:
        return {
            "interval": self.interval,
            "time_s": self.time_s,
            "budget_w": self.budget_w,
            "effective_budget_w": self.effective_budget_w,
            "ramp_budget_w": self.ramp_budget_w,
            "guard_band": self.guard_band,
            "offset": self.offset,
            "uncontrolled_w": self.uncontrolled_w,
            "predicted_power_w": self.predicted_power_w,
            "measured_power_w": self.measured_power_w,
            "price": finite_or_none(self.price),
            "status": self.status,
            "solve_s": self.solve_s,
            "shadow": self.shadow,
            "nodes_reachable": self.nodes_reachable,
            "nodes_unreachable": self.nodes_unreachable,
            "setpoints_sent": self.setpoints_sent,
            "jobs_controlled": sum(1 for j in self.jobs if j.controlled),
            "limited": list(self.limited),
            "domains": [d.to_dict() for d in self.domains],
        }


def domain_views(
    topology: Topology,
    limits: DomainLimits,
    decision: Decision | None,
    power_by_gpu: Mapping[GpuRef, float],
) -> tuple[DomainView, ...]:
    """Each domain of ``limits``: its limit, its planned power (the decision's share of the
    controlled jobs' power under it, `Decision.domain_planned_w`, plus its power outside the
    plan) and its measured power (``power_by_gpu`` summed per node, then per domain)."""
    measured_w = topology.node_power_w(node_power_w(power_by_gpu))
    planned_w = limits.uncontrolled_w + (0.0 if decision is None else decision.domain_planned_w)
    prices = np.zeros(len(limits.names))
    if decision is not None and decision.domain_price.shape == prices.shape:
        prices = decision.domain_price
    return tuple(
        DomainView(
            name,
            float(limits.limit_w[d]),
            float(planned_w[d]),
            float(measured_w[d]),
            float(prices[d]),
        )
        for d, name in enumerate(limits.names)
    )


def job_views(
    known: Mapping[str, Job],
    running: RunningJobs,
    decision: Decision | None,
    power_by_gpu: Mapping[GpuRef, float],
    now_s: float,
    bounded: bool,
) -> tuple[JobView, ...]:
    """A view of every ``known`` job: the decided clocks and outlook of the controlled ones
    (``bounded``: `ControllerSettings.work_from_time_limit`), what each drew."""
    views: list[JobView] = []
    infos = running.jobs
    row = {j.job_id: i for i, j in enumerate(infos)}
    outlook = None if decision is None or not infos else running.outlook(decision, now_s, bounded)
    on = jobs_on((job_id, gpu_refs(job)) for job_id, job in known.items())
    for job_id, job in known.items():
        refs = gpu_refs(job)
        drawn = [power_by_gpu[r] / len(on[r]) for r in refs if r in power_by_gpu]
        measured = float(sum(drawn)) if drawn else None
        shares = tuple(sorted({j for r in refs for j in on[r]} - {job_id}))
        i = row.get(job_id)
        if decision is None or outlook is None or i is None:
            views.append(
                JobView(job_id, i is not None, measured_power_w=measured, shares_with=shares)
            )
            continue
        view = JobView(
            job_id,
            True,
            int(decision.graphics_mhz[i]),
            int(decision.memory_mhz[i]),
            float(decision.job_power_w[i]),
            measured,
            progress="reported" if running.reported(job_id) else "none",
            left_top_s=finite_or_none(float(outlook.left_top_s[i])),
            finish_s=finite_or_none(float(outlook.finish_s[i])),
            shares_with=shares,
            model_readings=int(running.estimator.power.count[i]),
        )
        views.append(_served(view, running, decision, i))
    return tuple(views)


def gpu_refs(job: Job) -> list[GpuRef]:
    """A stored job's GPUs as the head's table names them."""
    return [GpuRef(g.node, g.gpu_index) for g in job.gpus]


def _served(view: JobView, running: RunningJobs, decision: Decision, row: int) -> JobView:
    """``view`` with its serving fields, if job ``row`` serves."""
    objective_s = running.jobs[row].objective_s
    plan = decision.serving
    if objective_s is None or plan is None:
        return view
    latency_s = running.latency_s(view.job_id)
    floor_x = float(plan.floor_x[row])
    if plan.gave_way[row]:
        state = "gave-way"
    elif plan.unmet[row]:
        state = "unmet"
    elif latency_s is None:
        state = "waiting"
    else:
        state = "met" if latency_s <= objective_s else "missed"
    return replace(
        view,
        objective_s=objective_s,
        latency_s=latency_s,
        floor_mhz=(
            round(floor_x * float(running.estimator.statics.graphics_max_mhz[row]))
            if math.isfinite(floor_x)
            else None
        ),
        serving=state,
    )
