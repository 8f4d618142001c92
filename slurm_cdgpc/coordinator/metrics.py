"""Prometheus exposition of ``cdgpcd`` (``GET /metrics``): cluster-level series only, none per job,
node or GPU, and every label from a small fixed set (a power domain is one of the topology's).
Each head has a registry of its own (`HeadMetrics.registry`), never the library's global one.
The series: DESIGN.md, "Metrics"; tests: `tests/unit/test_metrics.py`,
`tests/unit/test_coordinator_domains.py`, `tests/integration/test_metrics_live.py`.
"""

from __future__ import annotations

import math
import re
from collections import Counter as Tally
from collections.abc import Iterator
from typing import TYPE_CHECKING, Final

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from slurm_cdgpc.coordinator.report import SERVING_STATES
from slurm_cdgpc.store import ACTIVE_STATES

if TYPE_CHECKING:
    from slurm_cdgpc.coordinator.daemon import Coordinator
    from slurm_cdgpc.coordinator.report import IntervalReport

#: the text format `generate_latest` writes (0.0.4)
CONTENT_TYPE: Final = CONTENT_TYPE_PLAIN_0_0_4
#: bucket bounds in seconds: an interval (a solve, one exchange round, one store transaction)
INTERVAL_BUCKETS_S: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: one exchange round with every node: bounded by twice the per-node timeout (at most 10 s)
EXCHANGE_BUCKETS_S: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0)
#: a registration, request to committed answer: a Prolog waits for it
REGISTRATION_BUCKETS_S: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)
#: why an exchange with a node failed. ``request``: the head could not build it; the others are
#: read from the transport's one-line reason (`NodeFailure`), in this order, ``connection``
#: being whatever matches none (refused, reset, no route, a failed lookup or ssh)
EXCHANGE_FAILURE_KINDS: Final = ("request", "timeout", "refused", "reply", "connection")
_FAILURE_SHAPES: Final = (
    ("timeout", re.compile(r"no answer|timed out|TimeoutError|passed before a credential")),
    ("refused", re.compile(r": HTTP [0-9]{3}: ")),  # the agent answered with an error
    ("reply", re.compile(r"\breply\b")),  # an answer that is not an exchange response
)
#: HTTP statuses a refused registration may get (`slurm_cdgpc.coordinator.api`)
REFUSAL_CODES: Final = (400, 401, 403, 411, 413, 500, 503)


def failure_kind(reason: str) -> str:
    """The kind (`EXCHANGE_FAILURE_KINDS`) of a transport's failure ``reason``."""
    for kind, shape in _FAILURE_SHAPES:
        if shape.search(reason):
            return kind
    return "connection"


class HeadMetrics:
    """cdgpcd's metric families over one `Coordinator`, in a registry of their own. The gauges
    are read from the coordinator and its store at each scrape (`_StateCollector`); counters and
    histograms are this process's. Per-job detail is in ``GET /v1/jobs`` and the store's audit
    trail, never in a label."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, CPU, fds
        PlatformCollector(registry=self.registry)  # python_info
        self.registry.register(_StateCollector(coordinator))
        r = self.registry
        self.registrations = Counter(
            "cdgpc_registrations", "job registrations accepted (committed)", registry=r
        )
        self.registrations_refused = Counter(
            "cdgpc_registrations_refused",
            "job registrations refused, by the HTTP status of the answer",
            ["code"],
            registry=r,
        )
        for code in REFUSAL_CODES:
            self.registrations_refused.labels(str(code))
        self.registration_seconds = Histogram(
            "cdgpc_registration_duration_seconds",
            "time from a registration's request to its committed answer",
            buckets=REGISTRATION_BUCKETS_S,
            registry=r,
        )
        self.exchange_failures = Counter(
            "cdgpc_exchange_failures",
            "exchanges with a node that failed, by kind",
            ["kind"],
            registry=r,
        )
        for kind in EXCHANGE_FAILURE_KINDS:
            self.exchange_failures.labels(kind)
        self.exchange_seconds = Histogram(
            "cdgpc_exchange_duration_seconds",
            "time of one exchange round with every node (its slowest answer or timeout)",
            buckets=EXCHANGE_BUCKETS_S,
            registry=r,
        )
        self.lease_lapses = Counter(
            "cdgpc_lease_lapses",
            "nodes that answered after more than a lease without an answered exchange "
            "(their agent's lease lapsed meanwhile)",
            registry=r,
        )
        self.interval_seconds = Histogram(
            "cdgpc_interval_duration_seconds",
            "time of one control interval, reconcile to persist (intervals that completed)",
            buckets=INTERVAL_BUCKETS_S,
            registry=r,
        )
        self.intervals_failed = Counter(
            "cdgpc_intervals_failed", "control intervals that failed (nothing pushed)", registry=r
        )
        self.emergency_cuts = Counter(
            "cdgpc_emergency_cuts",
            "emergency cuts: a limit's measured power over it by more than the guard band, its "
            "lowest-pressure jobs sent to their lowest clocks before the next plan (by limit: "
            "cluster or a power domain)",
            ["domain"],
            registry=r,
        )

    def registration_answered(self, status: int, elapsed_s: float) -> None:
        """Count a registration's answer; an accepted one is timed as well."""
        if status == 200:
            self.registrations.inc()
            self.registration_seconds.observe(elapsed_s)
        else:
            self.registrations_refused.labels(str(status)).inc()

    def exchange_failed(self, reason: str) -> None:
        self.exchange_failures.labels(failure_kind(reason)).inc()

    def render(self) -> bytes:
        """The exposition text (`CONTENT_TYPE`)."""
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """The last interval, the active jobs and the nodes, read at each scrape."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator

    def collect(self) -> Iterator[Metric]:
        c = self._coordinator
        report = c.last_report
        budget = c.store.current_budget()
        budget_w = budget.budget_w if budget is not None else c.settings.initial_budget_w
        yield _gauge("cdgpc_budget_watts", "GPU power budget in force (NaN: uncapped)", budget_w)
        if report is not None:
            yield _gauge(
                "cdgpc_measured_power_watts",
                "GPU power the agents reported at the last exchange",
                report.measured_power_w,
            )
            yield _gauge(
                "cdgpc_predicted_power_watts",
                "power of the controlled jobs the last decision predicted",
                report.predicted_power_w,
            )
            yield _gauge(
                "cdgpc_uncontrolled_power_watts",
                "power counted outside the optimisation (idle GPUs, unreachable nodes at worst "
                "case)",
                report.uncontrolled_w,
            )
            yield _gauge(
                "cdgpc_guard_band_ratio",
                "share of the budget the last decision held back as its guard band",
                report.guard_band,
            )
            yield _gauge(
                "cdgpc_plan_offset_ratio",
                "how far recent plans' settled jobs drew over (+) or under (-) their plans, "
                "as a share; it scales the next plan",
                report.offset,
            )
            yield _gauge("cdgpc_price", "dual price of the last decision", report.price)
            yield _gauge(
                "cdgpc_solve_seconds", "controller time of the last decision", report.solve_s
            )
            yield _gauge("cdgpc_interval", "index of the last control interval", report.interval)
            yield _gauge(
                "cdgpc_jobs_controlled",
                "jobs whose clocks the last decision chose",
                sum(1 for j in report.jobs if j.controlled),
            )
            served = Tally(j.serving for j in report.jobs if j.serving is not None)
            serving = GaugeMetricFamily(
                "cdgpc_serving_jobs",
                "serving jobs by the state of their latency objective at the last interval: "
                "met or missed by their last report, unmet at the top clock, gave-way to the "
                "budget, waiting for a report",
                labels=["state"],
            )
            for state in SERVING_STATES:
                serving.add_metric([state], served.get(state, 0))
            yield serving
        yield from _domains(c, report)
        by_state = Tally(j.state for j in c.store.jobs(ACTIVE_STATES))
        jobs = GaugeMetricFamily("cdgpc_jobs", "active jobs by state", labels=["state"])
        for state in ACTIVE_STATES:
            jobs.add_metric([state], by_state.get(state, 0))
        yield jobs
        reach = Tally("true" if n.reachable else "false" for n in c.store.nodes())
        nodes = GaugeMetricFamily(
            "cdgpc_nodes", "known nodes by reachability at the last exchange", labels=["reachable"]
        )
        for reachable in ("true", "false"):
            nodes.add_metric([reachable], reach.get(reachable, 0))
        yield nodes
        yield _gauge(
            "cdgpc_shadow", "1 when decisions are recorded but not applied", c.settings.shadow
        )
        learned = c.controller.new_share.learned()
        if learned:
            share = GaugeMetricFamily(
                "cdgpc_new_job_power_share",
                "share of its power limit at which a new job of each kind (GPU type, alone or "
                "joining co-tenants) is counted until measured, learned from first readings",
                labels=["kind"],
            )
            for kind, value in sorted(learned.items()):
                share.add_metric([kind], value)
            yield share
        factors = c.controller.interference.learned()
        if factors:
            ratio = GaugeMetricFamily(
                "cdgpc_cotenant_time_ratio",
                "factor on a tenant's predicted iteration time when the number of its "
                "co-tenants goes from before to after (3: three or more), learned from the "
                "tenants that went through such a change",
                labels=["before", "after"],
            )
            for (before, after), value in sorted(factors.items()):
                ratio.add_metric([str(before), str(after)], value)
            yield ratio
        yield _gauge(
            "cdgpc_leader_epoch",
            "this head's leader epoch (0: no leader lock); it rises at each takeover",
            0 if c.leader is None else c.leader.epoch,
        )


def _domains(c: Coordinator, report: IntervalReport | None) -> Iterator[Metric]:
    """One series per power domain of the topology (none without one): its limit, and the last
    interval's planned and measured power under it."""
    if not c.topology.names:
        return
    limit = GaugeMetricFamily(
        "cdgpc_domain_limit_watts", "power limit of each domain below the budget", labels=["domain"]
    )
    limits_w, _ = c.domain_limits_in_force(c.now_s())  # an admin's, else the file's
    for name, limit_w in zip(c.topology.names, limits_w, strict=True):
        limit.add_metric([name], float(limit_w))
    yield limit
    if report is None or not report.domains:
        return
    planned = GaugeMetricFamily(
        "cdgpc_domain_planned_watts",
        "power the last decision planned under each domain (its jobs' share and what is "
        "outside the plan)",
        labels=["domain"],
    )
    measured = GaugeMetricFamily(
        "cdgpc_domain_power_watts",
        "GPU power the agents of each domain's nodes reported at the last exchange",
        labels=["domain"],
    )
    for d in report.domains:
        planned.add_metric([d.name], d.planned_w)
        measured.add_metric([d.name], d.measured_w)
    yield planned
    yield measured


def _gauge(name: str, help_text: str, value: float | None) -> GaugeMetricFamily:
    """A gauge of one sample; None is NaN."""
    return GaugeMetricFamily(name, help_text, value=math.nan if value is None else float(value))
