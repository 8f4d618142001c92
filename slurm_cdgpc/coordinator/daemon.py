"""`Coordinator`: the head's control loop, one interval at a time: reconcile → measure → learn and
solve → exchange → persist (`Coordinator.run_interval`), each stage's state in a room of its own
(`nodes`, `roster`, `locks`, `progress`, `accounting`, `registrations`). No sockets here.
Invariants: DESIGN.md, "Data flow", "Models" (What a sample is), "Safety" and "Standby heads";
tests: `tests/unit/test_coordinator_daemon.py`, `tests/unit/test_coordinator_boards.py`,
`tests/unit/test_coordinator_domains.py`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Final, Protocol

import numpy as np

from slurm_cdgpc.config import Config, configured, configured_values
from slurm_cdgpc.control.discrete import ClockGrid
from slurm_cdgpc.control.domains import DomainLimits
from slurm_cdgpc.control.dual import StepStatus
from slurm_cdgpc.control.empc import (
    ControllerSettings,
    Decision,
    EconomicMPC,
    Measurements,
    QueueState,
)
from slurm_cdgpc.control.ramp import Ramp, ScheduledLimit, emergency_cut
from slurm_cdgpc.control.tuning import Tuning, shipped
from slurm_cdgpc.coordinator.accounting import PowerLedger
from slurm_cdgpc.coordinator.jobs import GpuRef, GpuSample, JobInfo, RunningJobs, node_power_w
from slurm_cdgpc.coordinator.locks import GpuLocks, lowest_setpoints
from slurm_cdgpc.coordinator.metrics import HeadMetrics
from slurm_cdgpc.coordinator.nodes import NodeBook
from slurm_cdgpc.coordinator.progress import ProgressGate
from slurm_cdgpc.coordinator.registrations import Registration, Registrations
from slurm_cdgpc.coordinator.report import IntervalReport, domain_views, job_views
from slurm_cdgpc.coordinator.roster import Roster
from slurm_cdgpc.errors import CdgpcError, InputError
from slurm_cdgpc.gpu.catalog import CATALOG, GpuSpec
from slurm_cdgpc.model.estimator import EstimatorSettings, JobEstimator
from slurm_cdgpc.model.families import FloatArray
from slurm_cdgpc.slurm.comment import LatencyObjective
from slurm_cdgpc.store import (
    ACTIVE_STATES,
    BudgetChange,
    Job,
    Measurement,
    ModelSnapshot,
    Node,
    Store,
)
from slurm_cdgpc.store.leader import LeadershipLostError
from slurm_cdgpc.topology import CLUSTER, Topology, format_powers
from slurm_cdgpc.transport.http import NodeFailure, NodeTarget
from slurm_cdgpc.wire.protocol import (
    ExchangeResponse,
    ProgressReport,
)
from slurm_cdgpc.wire.protocol import Setpoint as AgentSetpoint

if TYPE_CHECKING:
    from sqlalchemy import Connection

logger = logging.getLogger(__name__)

#: the budget handed to the controller when none is set (it never binds)
UNCAPPED_W: Final = 1e12
#: measurements are pruned every this many intervals
PRUNE_EVERY: Final = 100
#: what the head records as the setter of ``budget.initial``
CONFIG_USER: Final = "cdgpcd"


class NodeTransport(Protocol):
    """Exchanges with node agents (`slurm_cdgpc.transport.http.NodeExchanger`, or a fake)."""

    def exchange(
        self, targets: Mapping[str, NodeTarget]
    ) -> dict[str, ExchangeResponse | NodeFailure]: ...


class Leadership(Protocol):
    """The leader lock as the loop sees it (`slurm_cdgpc.store.leader.LeaderLock`, or a fake)."""

    @property
    def epoch(self) -> int: ...

    def confirm(self, within: Connection | None = None) -> None:
        """Renew (inside ``within``'s transaction, if given); raise `LeadershipLostError` if
        another head holds the lock now."""


@dataclass(frozen=True)
class CoordinatorSettings:
    interval_s: float = configured("control", "interval_s")
    lease_s: float = configured("lease", "duration_s")
    shadow: bool = configured("control", "shadow")
    retention_s: float = configured("retention", "measurements_s")
    initial_budget_w: float | None = configured("budget", "initial_w")
    #: agents of nodes first seen in a registration listen here (``node.transport = http``)
    agent_port: int = configured("node", "listen_port")
    #: how the head reaches agents of nodes first seen in a registration: http or ssh
    node_transport: str = configured("node", "transport")
    #: Slurm's queue (whether jobs wait for GPUs: the drain's input) counts this long after it
    #: was read; older, the drain is off until the next read
    queue_stale_s: float = 180.0
    #: a registration re-plans out of cycle, no sooner than this after the last interval began
    replan_gap_s: float = 5.0
    #: a job's first intervals at its setpoint are its start-up: its model does not learn them
    #: (it stays counted as a new job meanwhile: at the learned share of its power limit)
    startup_intervals: int = 1
    #: the guard rail: each controlled GPU's power limit at its planned power times (1 + this)
    #: (0: off, the boards keep their default limits)
    power_limit_margin: float = configured("control", "power_limit_margin")
    controller: ControllerSettings = field(default_factory=lambda: shipped().controller)
    estimator: EstimatorSettings = field(default_factory=lambda: shipped().estimator)

    @classmethod
    def from_config(cls, config: Config) -> CoordinatorSettings:
        """The `configured` settings as ``config`` has them, and those derived from it."""
        c = config.control
        tuning = Tuning.from_config(c)
        return cls(
            **configured_values(cls, config),
            # three reconcile periods (`coordinator.main`: at least two control intervals)
            queue_stale_s=3 * max(config.head.reconcile_interval_s, 2 * c.interval_s),
            replan_gap_s=c.interval_s / 6,
            controller=tuning.controller,
            estimator=tuning.estimator,
        )


def _full_grid(specs: Mapping[str, GpuSpec]) -> ClockGrid:
    """Every supported clock of every type, in ``specs``' order: the controller applies its own
    floor (and its fallback), and a type added later keeps the earlier ones' rows."""
    return ClockGrid.from_tables([(n, s.clocks) for n, s in specs.items()], min_fraction=0.0)


def _wait(
    stop: threading.Event,
    replan: threading.Event,
    next_s: float,
    earliest_s: float,
    urgent: threading.Event | None = None,
) -> bool:
    """Until ``next_s``, or a registration's wake-up (``replan``) from ``earliest_s`` on, or an
    ``urgent`` one (a limit lowered now) at once; True if woken out of cycle."""
    while not stop.is_set():
        now_s = time.monotonic()
        if now_s >= next_s:
            return False
        if replan.is_set():
            if now_s >= earliest_s or (urgent is not None and urgent.is_set()):
                return True
            stop.wait(min(earliest_s, next_s) - now_s)
            continue
        replan.wait(next_s - now_s)
    return False


def _check_nesting(
    topology: Topology, index: int, limits_w: FloatArray, from_s: float | None
) -> None:
    """`InputError` unless domain ``index``'s limit is no more than its parent's and no less
    than any child's, in ``limits_w`` (those in force; ``from_s``: a later time they are in
    force from, which the message names)."""
    names, parents = topology.names, topology.parents
    when = (
        ""
        if from_s is None
        else " from " + time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(from_s))
    )
    mine_w = float(limits_w[index])
    parent = int(parents[index])
    if parent >= 0 and mine_w > limits_w[parent]:
        mine, theirs = format_powers(mine_w, float(limits_w[parent]))
        raise InputError(
            f"power domain {names[index]!r}: limit {mine} is above the {theirs} in force for its "
            f"parent {names[parent]!r}{when}"
        )
    for child in np.flatnonzero(parents == index):
        if limits_w[child] > mine_w:
            mine, theirs = format_powers(mine_w, float(limits_w[child]))
            raise InputError(
                f"power domain {names[index]!r}: limit {mine} is below the {theirs} in force for "
                f"its child {names[child]!r}{when}"
            )


def _ramped_w(budget_w: float | None, decision: Decision | None) -> float | None:
    """The limit ``decision`` was planned under where a ramp held it below ``budget_w``."""
    if decision is None or decision.budget_w >= (UNCAPPED_W if budget_w is None else budget_w):
        return None
    return decision.budget_w


@dataclass(frozen=True)
class _Plan:
    """Step 3's output: the budget, the power outside the plan, the power domains' limits (None:
    no topology), the decision, its setpoints."""

    budget_w: float | None
    uncontrolled_w: float
    domains: DomainLimits | None
    decision: Decision | None
    setpoints: dict[str, list[AgentSetpoint]]


@dataclass(frozen=True)
class EmergencyCut:
    """An emergency cut (`Coordinator._cut_if_over`): when, the limits that were over (their
    names, ``cluster`` for the budget), the jobs sent to their lowest clocks, and how long the
    check and the cut's exchange took."""

    at_s: float
    over: tuple[str, ...]
    jobs: tuple[str, ...]
    exchange_s: float

    def to_dict(self) -> dict[str, object]:
        return {
            "time_s": self.at_s,
            "over": list(self.over),
            "jobs": list(self.jobs),
            "exchange_s": self.exchange_s,
        }


@dataclass(frozen=True)
class _Exchanged:
    """Step 4's output: each node's answer, per job the samples that may teach its model, and
    the progress reports that count (in the nodes' order)."""

    responses: Mapping[str, ExchangeResponse | NodeFailure]
    samples: Mapping[str, list[GpuSample]]
    progress: Sequence[ProgressReport]


class Coordinator:
    """The head's control loop over a `Store` and a `NodeTransport`, and the API's entry to it.

    `run_interval` reads as the interval's data flow; what each stage keeps between intervals
    has a room of its own: `NodeBook` (nodes), `Roster` (jobs), `GpuLocks` (releases and
    refusals), `ProgressGate` (progress), `PowerLedger` (power outside the plan) and
    `Registrations` (the API's writes). ``topology``: the power domains below the budget, each
    with its limit, loaded once at start (None: the budget is the only limit).
    """

    def __init__(
        self,
        store: Store,
        transport: NodeTransport,
        settings: CoordinatorSettings | None = None,
        clock: Callable[[], float] = time.time,
        specs: Mapping[str, GpuSpec] = CATALOG,
        leader: Leadership | None = None,
        topology: Topology | None = None,
    ) -> None:
        self.store = store
        self.transport = transport
        #: None: the only head, with no lock to hold (epoch 0)
        self.leader = leader
        self.settings = settings or CoordinatorSettings()
        self.topology = topology or Topology.empty()
        self._clock = clock
        #: the controller's GPU types: the catalog's, and every board an agent described
        self.specs: dict[str, GpuSpec] = dict(specs)
        self.grid = _full_grid(self.specs)
        self.controller = EconomicMPC(self.grid, self.settings.controller)
        self.running = RunningJobs(self.grid, JobEstimator(self.settings.estimator), self.specs)
        self.interval = 0
        self.last_report: IntervalReport | None = None
        self.nodes = NodeBook(self.specs, self._add_type)
        self.roster = Roster(store, self.running, self.controller, self.settings.estimator.family)
        self.locks = GpuLocks(store)
        self.progress = ProgressGate()
        self.ledger = PowerLedger(mode=self.settings.controller.mode, shadow=self.settings.shadow)
        self._replan = threading.Event()  # a job registered: plan for it out of cycle
        self._urgent = threading.Event()  # a limit lowered now: plan at once, gap or not
        #: the limits (the budget, then each domain's) of the last plan and of the one before:
        #: the answers of an exchange measure the interval the one before planned for
        self._plan_limits: tuple[FloatArray | None, FloatArray | None] = (None, None)
        #: the GPUs this head set a power limit on in the last two plans (a new job held at its
        #: share, the guard rail): an answer shows the limit of the plan before the exchange's
        self._limits_sent: tuple[frozenset[GpuRef], frozenset[GpuRef]] = (frozenset(),) * 2
        self.last_cut: EmergencyCut | None = None
        self.registrations = Registrations(
            store,
            node_transport=self.settings.node_transport,
            agent_port=self.settings.agent_port,
            committed=self._replan.set,
        )
        #: the last exchange's interval (-1: none yet) and its samples (`_exchange`)
        self._sampled: tuple[int, Mapping[str, list[GpuSample]]] = (-1, {})
        #: the jobs that ended since the last reconcile, by GPU: they held those GPUs for part
        #: of the interval the next exchange's readings describe (their co-tenants' company)
        self._left: dict[GpuRef, tuple[str, ...]] = {}
        #: whether jobs wait for GPUs in Slurm, and when that was read (monotonic); None: unread
        self._queue_seen: tuple[bool, float] | None = None
        self._queue_known = False  # the drain has its input (logged on each change)
        self.metrics = HeadMetrics(self)  # GET /metrics: this head's own registry

    def start(self) -> None:
        """Resume from the store: interval count, nodes, jobs (models restore when they join)."""
        latest = self.store.decisions(limit=1)
        self.interval = latest[-1].interval_index + 1 if latest else 0
        if self.store.current_budget() is None and not self.store.budget_history():
            initial = self.settings.initial_budget_w
            if initial is not None:
                self.store.set_budget(
                    initial, CONFIG_USER, reason="budget.initial from the configuration"
                )
        self.nodes.load(self.store.nodes())
        active = self.store.jobs(ACTIVE_STATES)
        logger.info(
            "cdgpcd resumes at interval %d: %d node(s), %d active job(s)%s",
            self.interval,
            len(self.nodes),
            len(active),
            "".join(f", job {j.job_id}" for j in active[:20]),
        )

    # -- what the API calls (any thread; store writes only) ------------------------------------

    def now_s(self) -> float:
        return self._clock()

    def register_node(self, name: str, url: str, gpu_type: str | None = None) -> Node:
        """Announce a node's agent URL (and optionally its GPU type until it reports)."""
        return self.registrations.register_node(name, url, gpu_type)

    def register_job(
        self,
        job_id: str,
        user: str,
        node: str,
        gpus: Sequence[int],
        *,
        gpu_type: str | None = None,
        deadline_s: float | None = None,
        iterations_total: int | None = None,
        adopted: bool = False,
        time_limit_s: float | None = None,
        started_at_s: float | None = None,
        slo: LatencyObjective | None = None,
        job_name: str | None = None,
    ) -> Job:
        """Record a job's GPUs on one node (idempotent; a multi-node job calls once per node).
        ``adopted``: found running in Slurm without a registration (`reconcile`), not from a
        Prolog. Returns once committed, in a batch with the registrations that arrived
        together (`Registrations`); a registration refused on its own fails alone."""
        registration = Registration.checked(
            job_id,
            user,
            node,
            gpus,
            gpu_type=gpu_type,
            deadline_s=deadline_s,
            iterations_total=iterations_total,
            adopted=adopted,
            time_limit_s=time_limit_s,
            started_at_s=started_at_s,
            slo=slo,
            job_name=job_name,
        )
        return self.registrations.register_job(registration)

    def deregister_job(self, job_id: str) -> Job | None:
        """The job ended: its GPUs are released at the next exchange. None if unknown."""
        job = self.store.finish_job(job_id)
        if job is not None:
            logger.info("job %s: deregistered; GPUs released at the next exchange", job_id)
        return job

    def set_budget(
        self,
        budget_w: float,
        user: str,
        *,
        effective_at_s: float | None = None,
        reason: str = "",
        domain: str | None = None,
    ) -> BudgetChange:
        """Record the cluster's budget, or with ``domain`` that power domain's limit, from now or
        ``effective_at_s``. A domain's limit is checked against the topology first: the domain
        must be one of its, and its limit no more than its parent's in force then, nor less
        than any child's (`InputError`, one line naming it, nothing recorded)."""
        if domain is None:
            change = self.store.set_budget(
                budget_w, user, effective_at_s=effective_at_s, reason=reason
            )
        else:
            change = self._set_domain_limit(domain, budget_w, user, effective_at_s, reason)
        if change.effective_at_s <= self._clock():
            # in force now: checked against the nodes' last answers at once (`_cut_if_over`)
            self._urgent.set()
            self._replan.set()
        logger.info(
            "%s %.0f W set by %s, effective at %.0f (%s)",
            "budget" if domain is None else f"power domain {domain}: limit",
            budget_w,
            user,
            change.effective_at_s,
            reason or "no reason given",
        )
        return change

    def domain_limits_in_force(
        self, at_s: float
    ) -> tuple[FloatArray, tuple[BudgetChange | None, ...]]:
        """(D,) each power domain's limit at ``at_s``, in the topology's order: the latest
        change an admin set for it by then (`Store.domain_limits`), else the topology file's;
        and for each, that change (None: the file's)."""
        changes = self.store.domain_limits(at_s) if self.topology.names else {}
        sources = tuple(changes.get(name) for name in self.topology.names)
        limits_w = self.topology.limits_w  # a new array: the file's limits
        for i, change in enumerate(sources):
            if change is not None:
                limits_w[i] = change.budget_w
        return limits_w, sources

    def _set_domain_limit(
        self,
        domain: str,
        limit_w: float,
        user: str,
        effective_at_s: float | None,
        reason: str,
    ) -> BudgetChange:
        """Check ``domain``'s new limit against its parent and children over the time it is in
        force (from ``effective_at_s`` until the domain's next scheduled change, at each change
        of theirs scheduled meanwhile), then record it, in one store transaction."""
        if domain == CLUSTER:
            raise InputError(
                f"{CLUSTER!r} is the root: its limit is the budget (budget set without --domain)"
            )
        index = self.topology.index(domain)  # unknown: one line naming the known ones
        if not (math.isfinite(limit_w) and limit_w > 0):
            raise InputError(
                f"power domain {domain!r}: limit must be a positive power, got {limit_w!r}"
            )
        at_s = self._clock() if effective_at_s is None else effective_at_s
        parents = self.topology.parents
        related = {self.topology.names[j] for j in np.flatnonzero(parents == index)}
        if parents[index] >= 0:
            related.add(self.topology.names[parents[index]])
        with self.store.transaction():  # checked against what is recorded, and recorded, at once
            later = [
                c for c in self.store.domain_limit_history(since_s=at_s) if c.effective_at_s > at_s
            ]
            until_s = min((c.effective_at_s for c in later if c.domain == domain), default=math.inf)
            times_s = {c.effective_at_s for c in later if c.domain in related}
            for t_s in [at_s, *sorted(t for t in times_s if t < until_s)]:
                limits_w, _ = self.domain_limits_in_force(t_s)
                limits_w[index] = limit_w
                _check_nesting(self.topology, index, limits_w, None if t_s == at_s else t_s)
            return self.store.set_budget(
                limit_w, user, effective_at_s=at_s, reason=reason, domain=domain
            )

    def observe_queue(self, waiting: bool | None) -> None:
        """Whether jobs wait for GPUs in Slurm, from the reconcile (any thread); None: Slurm
        could not be read."""
        self._queue_seen = None if waiting is None else (waiting, time.monotonic())

    # -- the loop ----------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Run intervals at a fixed period until ``stop`` is set (an overrun skips ahead).

        A registration asks for a plan out of cycle (`replan_gap_s` after the last interval
        began, at the earliest): the new job's GPUs, held at the safe cap by its Prolog, are
        planned for when it starts rather than an interval later, and the period starts anew.
        """
        period_s = self.settings.interval_s

        def wake_on_stop() -> None:  # ``stop`` wakes the loop as a registration does
            stop.wait()
            self._replan.set()

        threading.Thread(target=wake_on_stop, name="wake-on-stop", daemon=True).start()
        next_s = time.monotonic()
        while not stop.is_set():
            began_s = time.monotonic()
            self._replan.clear()
            self._urgent.clear()
            try:
                self.run_interval()
            except LeadershipLostError:
                raise
            except CdgpcError as e:
                logger.error("interval %d failed: %s", self.interval, e)
                self.metrics.intervals_failed.inc()
                self.interval += 1
            except Exception:
                logger.exception("interval %d failed", self.interval)
                self.metrics.intervals_failed.inc()
                self.interval += 1
            next_s += period_s
            now_s = time.monotonic()
            if now_s > next_s:
                missed = math.ceil((now_s - next_s) / period_s)
                logger.warning(
                    "interval overran by %.2f s; %d tick(s) skipped", now_s - next_s, missed
                )
                next_s += missed * period_s
            earliest_s = began_s + self.settings.replan_gap_s
            if _wait(stop, self._replan, next_s, earliest_s, self._urgent):
                next_s = time.monotonic()  # planned out of cycle: a full period from here

    @property
    def samples(self) -> Mapping[str, list[GpuSample]]:
        """Per job, the samples of the last exchange that may teach its model."""
        return self._sampled[1]

    def run_interval(self) -> IntervalReport:
        """One interval, each stage's output handed to the next: reconcile → measure → learn
        and solve → exchange → persist → the emergency cut where the answers just in show a
        limit broken (`_cut_if_over`)."""
        began_s = time.perf_counter()
        k = self.interval
        now_s = self._clock()
        held_out = self._reconcile(k)
        measured = self._measure()
        plan = self._learn_and_solve(now_s, measured, held_out)
        limited = frozenset(
            GpuRef(node, p.gpu)
            for node, points in plan.setpoints.items()
            for p in points
            if p.power_limit_w is not None
        )
        self._limits_sent = (limited, self._limits_sent[0])
        exchanged = self._exchange(k, now_s, plan.setpoints)
        report = self._persist(k, now_s, plan, exchanged)
        if exchanged.responses:
            self._cut_if_over(k, plan.domains)
        self.last_report = report
        self.interval = k + 1
        self.metrics.interval_seconds.observe(time.perf_counter() - began_s)
        return report

    def _reconcile(self, k: int) -> set[str]:
        """1. The controller's jobs against the store's; returns the jobs held out because a
        GPU of theirs refuses its setpoint."""
        active = self.store.jobs(ACTIVE_STATES)
        self.nodes.load(self.store.nodes())
        named = {(g.node, g.gpu_index) for job in active for g in job.gpus}
        self._left = {}
        for job in self.roster.refresh(active):  # finished: release its GPUs on every node,
            # but for a GPU another job still runs on (shared: it keeps its clock)
            self.locks.release(g for g in job.gpus if (g.node, g.gpu_index) not in named)
            self.progress.ended(job.job_id)
            for g in job.gpus:
                ref = GpuRef(g.node, g.gpu_index)
                self._left[ref] = (*self._left.get(ref, ()), job.job_id)
        known = self.roster.known
        self.progress.keep(known)
        held_out = self.locks.keep(known)
        for info in self.roster.plan(k, held_out, self.nodes):
            self.locks.cancel_release(info.gpus)  # a GPU that gets a setpoint is not released
        return held_out

    def _measure(self) -> Measurements:
        """2. What the models learn from: the last exchange's samples (`_exchange`) of the jobs
        controlled since before it, less each job's start-up (its first ``startup_intervals``
        under its setpoint: loading and compiling teach nothing); and what every GPU drew in
        them against the plan in force then (`PowerLedger.cluster_draw`)."""
        sampled_at, samples = self._sampled
        learning_from = sampled_at - self.settings.startup_intervals
        learned = [
            s
            for job_id, per_job in samples.items()
            if (joined := self.roster.joined_at(job_id)) is not None
            and joined < sampled_at
            and joined < learning_from
            for s in per_job
        ]
        measured = self.running.measurements(
            learned, self.ledger.planned_reported_w(self.running.jobs)
        )
        # the whole cluster against the plan in force then: what sizes the guard band
        power_by_gpu = self.nodes.power_by_gpu()
        drawn_w = float(sum(power_by_gpu.values())) if power_by_gpu else None
        return replace(measured, cluster=self.ledger.cluster_draw(drawn_w))

    def _learn_and_solve(
        self, now_s: float, measured: Measurements, held_out: Collection[str]
    ) -> _Plan:
        """3. The controller learns from ``measured`` and plans for the budget in force now (the
        store's, else ``budget.initial``; none: uncapped) and each power domain's limit, less
        the power outside the plan (`PowerLedger.uncontrolled_by_node_w`, summed over the
        cluster and over each domain); the setpoints to send."""
        budget = self.store.current_budget(now_s)
        budget_w = budget.budget_w if budget is not None else self.settings.initial_budget_w
        node_uncontrolled_w = self.ledger.uncontrolled_by_node_w(
            self.nodes, self.roster.known, self.running, held_out, self.locks.releasing(self.nodes)
        )
        uncontrolled_w = sum(node_uncontrolled_w.values())
        domains = self._domain_limits(now_s, node_uncontrolled_w)
        limits_w = np.concatenate(
            (
                [math.inf if budget_w is None else budget_w],
                () if domains is None else domains.limit_w,
            )
        )
        self._plan_limits = (limits_w, self._plan_limits[0])
        decision: Decision | None = None
        if len(self.running):
            ramp = self._ramp(now_s, domains is not None)
            decision = self.controller.step(
                self.running.estimator,
                self.running.job_state(),
                now_s,
                UNCAPPED_W if budget_w is None else budget_w,
                uncontrolled_w=uncontrolled_w,
                measured=measured,
                queue=self._queue_state(),
                domains=domains,
                ramp=ramp,
            )
        if decision is not None:  # the budget, or a domain's limit, does not fit at all
            squeeze = (budget_w is not None and decision.status is StepStatus.INFEASIBLE) or bool(
                np.any(np.isinf(decision.domain_price))
            )
        else:  # nothing planned: the power outside the plan alone breaks a limit
            squeeze = (budget_w is not None and uncontrolled_w > budget_w) or (
                domains is not None and bool(np.any(domains.uncontrolled_w > domains.limit_w))
            )
        setpoints = self._setpoints(decision, held_out, squeeze=squeeze)
        return _Plan(budget_w, uncontrolled_w, domains, decision, setpoints)

    def _domain_limits(
        self, now_s: float, node_uncontrolled_w: Mapping[str, float]
    ) -> DomainLimits | None:
        """The power domains for this step: each one's limit in force now (an admin's, else the
        file's: `domain_limits_in_force`), each running job's GPUs per node (in the
        controller's row order) and each node's power outside the plan; None without a
        topology."""
        if not self.topology.names:
            return None
        limits_w, _ = self.domain_limits_in_force(now_s)
        job_gpus = [Counter(g.node for g in job.gpus) for job in self.running.jobs]
        return self.topology.limits(job_gpus, node_uncontrolled_w, limits_w)

    def _measured_w(self, power_by_gpu: Mapping[GpuRef, float]) -> FloatArray:
        """(1+D,) what the cluster and each power domain drew in the nodes' last answers."""
        node_w = node_power_w(power_by_gpu)
        total = float(sum(node_w.values()))
        if not self.topology.names:
            return np.array([total])
        return np.concatenate(([total], self.topology.node_power_w(node_w)))

    def _ramp(self, now_s: float, with_domains: bool) -> Ramp | None:
        """The ramp rule's input (`Ramp`): the cluster's rate and, with domains, each one's;
        what each drew in the nodes' last answers (NaN before any); the limits scheduled after
        now. None when no rate is set."""
        rates = [self.settings.controller.ramp_w_per_s]
        if with_domains:
            rates.extend(self.topology.ramps_w_per_s.tolist())
        rate = np.array(rates)
        if not np.isfinite(rate).any():
            return None
        power_by_gpu = self.nodes.power_by_gpu()
        last_w = self._measured_w(power_by_gpu) if power_by_gpu else np.full(rate.size, np.nan)
        if last_w.size != rate.size:
            last_w = last_w[:1]  # no domains planned this step
        ahead = [
            ScheduledLimit(c.effective_at_s, 0, c.budget_w)
            for c in self.store.budget_history(since_s=now_s)
            if c.effective_at_s > now_s
        ]
        if with_domains:
            index = {name: 1 + i for i, name in enumerate(self.topology.names)}
            ahead.extend(
                ScheduledLimit(c.effective_at_s, index[c.domain], c.budget_w)
                for c in self.store.domain_limit_history(since_s=now_s)
                if c.effective_at_s > now_s and c.domain in index
            )
        return Ramp(rate, last_w, tuple(ahead))

    def _cut_if_over(self, k: int, domains: DomainLimits | None) -> EmergencyCut | None:
        """The emergency path: where the answers just in show the interval they measure over a
        limit it was planned under (the budget, or a power domain's) by more than its margin
        (`ControllerSettings.emergency_margin`, or its guard band if more), the lowest-pressure
        jobs under that limit go to their lowest clocks at once
        (`EconomicMPC.cut_order`, `emergency_cut`), in an exchange with their nodes alone,
        before the controller re-plans. Cut jobs are planned again at the next interval; their
        planned power does not teach the offset meanwhile. A limit lowered now needs no cut: it
        wakes the loop at once (`set_budget`) and the plan meets it. DESIGN.md, "Ramp limits and
        the emergency cut". ``domains``: this interval's plan's (the running jobs' shares)."""
        limits_w = self._plan_limits[1]
        settings = self.settings.controller
        if not settings.emergency or self.settings.shadow or not len(self.running):
            return None
        if limits_w is None:
            return None
        power_by_gpu = self.nodes.power_by_gpu()
        if not power_by_gpu:
            return None
        began_s = time.perf_counter()
        now_s = self._clock()
        measured_w = self._measured_w(power_by_gpu)
        jobs = self.running.jobs
        counts = [len(jobs)] + ([] if domains is None else domains.jobs().tolist())
        if len(counts) != limits_w.size:
            return None  # the topology's domains were not planned for then
        guard = np.array(
            [self.controller.cluster_guard(counts[0])] + [settings.guard_for(n) for n in counts[1:]]
        )
        margin = np.maximum(guard, settings.emergency_margin)
        over = (measured_w > limits_w * (1.0 + margin)) & np.isfinite(limits_w)
        if not over.any():
            return None
        # sized on what each GPU draws now where that is more than the interval's mean (a
        # process that started within the interval): the cut must cover the excess as it is
        now_w = {ref: max(w, self.nodes.reading_w(ref) or 0.0) for ref, w in power_by_gpu.items()}
        excess_w = np.where(over, self._measured_w(now_w) - limits_w * (1.0 - guard), 0.0)
        estimator, state = self.running.estimator, self.running.job_state()
        drawn_w = np.array([sum(now_w.get(g, 0.0) for g in job.gpus) for job in jobs])
        saving_w = np.maximum(drawn_w - self.controller.lowest_power_w(estimator, state), 0.0)
        if state.tenancy is not None:  # a shared GPU's saving, once
            saving_w = saving_w * state.tenancy.attribution(estimator.statics.gpus)
        empty = np.zeros(0, dtype=np.int64)
        cut = emergency_cut(
            excess_w,
            empty if domains is None else domains.domain + 1,
            empty if domains is None else domains.job_row,
            np.zeros(0) if domains is None else domains.share,
            saving_w,
            self.controller.cut_order(estimator, state, now_s, None),
        )
        if state.tenancy is not None and cut.any():  # a GPU's lowest clock is all its tenants'
            cut = state.tenancy.any_tenant(cut)
        names = (CLUSTER, *self.topology.names)
        over_names = tuple(names[i] for i in np.flatnonzero(over))
        cut_jobs = [jobs[i] for i in np.flatnonzero(cut).tolist()]
        for name in over_names:
            self.metrics.emergency_cuts.labels(name).inc()
        if not cut_jobs:
            logger.error(
                "emergency: %s over the limit, and no controlled job can shed power",
                ", ".join(over_names),
            )
            return None
        self._send_cut(k, now_s, cut_jobs)
        self.ledger.overridden(j.job_id for j in cut_jobs)
        event = EmergencyCut(
            now_s,
            over_names,
            tuple(j.job_id for j in cut_jobs),
            time.perf_counter() - began_s,
        )
        self.last_cut = event
        logger.warning(
            "emergency: %s over the limit by more than its margin: %d job(s) to their "
            "lowest clocks in %.3f s (%s)",
            ", ".join(
                f"{n} {measured_w[i]:.0f} W > {limits_w[i]:.0f} W"
                for i, n in zip(np.flatnonzero(over).tolist(), over_names, strict=True)
            ),
            len(cut_jobs),
            event.exchange_s,
            ", ".join(f"job {j}" for j in event.jobs[:20]),
        )
        return event

    def _send_cut(self, k: int, now_s: float, cut_jobs: Sequence[JobInfo]) -> None:
        """Exchange the cut jobs' GPUs' lowest clocks with their nodes alone (the leader lock
        renewed first); the answers update the nodes and the locks as any exchange's do."""
        setpoints: dict[str, list[AgentSetpoint]] = {}
        sent: set[GpuRef] = set()
        for job in cut_jobs:
            lowest = lowest_setpoints(
                job.job_id,
                job.gpus,
                self.nodes.gpu_type,
                self.grid,
                self.specs,
                self.nodes.limit_only,
            )
            for ref, point in lowest.items():
                if ref not in sent:  # a shared GPU once, named for its first cut tenant
                    sent.add(ref)
                    setpoints.setdefault(ref.node, []).append(point)
        if self.leader is not None:
            self.leader.confirm()
        epoch = 0 if self.leader is None else self.leader.epoch
        targets, _ = self.nodes.requests(k, now_s + self.settings.lease_s, epoch, setpoints, None)
        targets = {name: t for name, t in targets.items() if name in setpoints}
        responses = self.transport.exchange(targets)
        known = self.roster.known
        for name, target in targets.items():
            result = responses.get(name, NodeFailure("not exchanged"))
            if isinstance(result, NodeFailure):
                self.metrics.exchange_failed(result.reason)
                self.nodes.lost(name, result.reason)
                continue
            self.nodes.answered(name, target.request, result, now_s, self.settings.lease_s)
            self.locks.answered(
                name,
                target.request,
                result,
                known,
                self.roster.held_on(name),
                self.nodes.left_alone(name),
                self.nodes.limit_only_on(name),
            )

    def _queue_state(self) -> QueueState | None:
        """The drain's input (`Roster.queue`) while Slurm's queue, as last read, has jobs
        waiting for GPUs; None (the drain off, said once) while the queue is unread or stale."""
        seen = self._queue_seen
        known = seen is not None and time.monotonic() - seen[1] <= self.settings.queue_stale_s
        if known != self._queue_known and self.settings.controller.drain_pressure > 0:
            if known:
                logger.info("Slurm's queue is read: the drain is on")
            else:
                logger.warning("Slurm's queue cannot be read: the drain is off until it can")
        self._queue_known = known
        if seen is None or not known or not seen[0]:
            return None
        return self.roster.queue(self.nodes)

    def _setpoints(
        self, decision: Decision | None, held_out: Collection[str], *, squeeze: bool
    ) -> dict[str, list[AgentSetpoint]]:
        """The decision's setpoints, the refused ones again for GPUs that still refuse (their
        job is in ``held_out``), and with ``squeeze`` (the budget does not fit even with every
        planned job at its lowest clock) every held-out job at its lowest clock. None in shadow
        mode."""
        if self.settings.shadow:
            return {}
        planned = (
            {}
            if decision is None
            else self.running.setpoints(
                decision, self.settings.power_limit_margin, self.nodes.limit_only
            )
        )
        lowest: dict[GpuRef, AgentSetpoint] = {}
        if squeeze:
            known, gpu_type = self.roster.known, self.nodes.gpu_type
            lowest = self.locks.lowest(
                held_out, known, gpu_type, self.grid, self.specs, self.nodes.limit_only
            )
        return self.locks.setpoints(planned, held_out, lowest)

    def _exchange(
        self, k: int, now_s: float, setpoints: Mapping[str, list[AgentSetpoint]]
    ) -> _Exchanged:
        """4. Exchange with every known node at once, the leader lock renewed first; each answer
        updates its node, its GPUs' locks and its jobs' progress, and the answers give the
        samples that may teach the models (computed here, once, for persist and the next
        interval's measure). In shadow mode the exchanges carry no setpoints and no releases:
        the lease stays renewed, so the agents keep their default clocks and never fall to the
        safe cap, and nothing is capped."""
        if self.leader is not None:
            self.leader.confirm()  # renewed before every push; a failure pushes nothing
        epoch = 0 if self.leader is None else self.leader.epoch
        releases = None if self.settings.shadow else self.locks.releases
        targets, unsent = self.nodes.requests(
            k, now_s + self.settings.lease_s, epoch, setpoints, releases
        )
        if unsent:
            self.metrics.exchange_failures.labels("request").inc(unsent)
        if not targets:
            return _Exchanged({}, {}, ())
        with self.metrics.exchange_seconds.time():
            responses = self.transport.exchange(targets)
        known = self.roster.known
        progress: list[ProgressReport] = []
        for name in self.nodes:
            result = responses.get(name, NodeFailure("not exchanged"))
            if isinstance(result, NodeFailure):
                if name in targets:
                    self.metrics.exchange_failed(result.reason)
                self.nodes.lost(name, result.reason)
                continue
            sent = targets[name].request
            if self.nodes.answered(name, sent, result, now_s, self.settings.lease_s):
                self.metrics.lease_lapses.inc()  # its last lease ran out before this exchange
            self.locks.answered(
                name,
                sent,
                result,
                known,
                self.roster.held_on(name),
                self.nodes.left_alone(name),
                self.nodes.limit_only_on(name),
            )
            for p in self.progress.allowed(name, result, known):
                self.running.record_progress(p.job_id, p.step, p.time_s)
                if p.latency_s is not None:  # a serving job's (its step counts requests)
                    self.running.record_latency(p.job_id, p.latency_s, p.time_s)
                progress.append(p)
        samples = self.nodes.samples(
            self.roster.owners(before=k), self.settings.shadow, left=self._left
        )
        self._sampled = (k, samples)
        return _Exchanged(responses, samples, progress)

    def _persist(self, k: int, now_s: float, plan: _Plan, exchanged: _Exchanged) -> IntervalReport:
        """5. Record the interval in one store transaction that renews the leader lock (a head
        fenced off meanwhile writes nothing), then report it."""
        jobs = self.running.jobs
        decision = plan.decision
        power_by_gpu = self.nodes.power_by_gpu()
        try:
            with self.store.transaction() as connection:
                if self.leader is not None:
                    # the record commits only while the lock is this head's (the store's fence)
                    self.leader.confirm(within=connection)
                self.nodes.persist(self.store, exchanged.responses, now_s)
                self.roster.mark_started(exchanged.samples)
                self.progress.record(self.store, exchanged.progress)
                self.ledger.fill_measured(self.store, power_by_gpu)
                if decision is not None:
                    self.ledger.record(self.store, k, now_s, plan.budget_w, decision, jobs)
                    self.store.save_models(
                        ModelSnapshot.of([j.job_id for j in jobs], self.running.estimator),
                        at_s=now_s,
                    )
                holders = self.roster.holders
                self.store.record_measurements(
                    Measurement(
                        time_s=now_s,
                        node=ref.node,
                        gpu_index=ref.index,
                        power_w=power_w,
                        job_id=holders.get(ref),
                    )
                    for ref, power_w in sorted(power_by_gpu.items())
                )
                if k % PRUNE_EVERY == 0:
                    self.store.prune_measurements(self.settings.retention_s, now_s=now_s)
        except LeadershipLostError:
            raise
        except CdgpcError as e:
            logger.error("interval %d: not recorded in the store: %s", k, e)
        try:  # here, not on the commit that happens to fill the log: often the API's loop's
            self.store.checkpoint()
        except CdgpcError as e:
            logger.warning("interval %d: %s", k, e)
        self.ledger.planned(decision, jobs, capped=plan.budget_w is not None)
        return self._report(k, now_s, plan, power_by_gpu)

    def _report(
        self, k: int, now_s: float, plan: _Plan, power_by_gpu: Mapping[GpuRef, float]
    ) -> IntervalReport:
        decision = plan.decision
        views = job_views(
            self.roster.known,
            self.running,
            decision,
            power_by_gpu,
            self._clock(),
            self.settings.controller.work_from_time_limit,
        )
        reachable, unreachable = self.nodes.reachability()
        domains = (
            ()
            if plan.domains is None
            else domain_views(self.topology, plan.domains, decision, power_by_gpu)
        )
        return IntervalReport(
            interval=k,
            time_s=now_s,
            budget_w=plan.budget_w,
            effective_budget_w=None if decision is None else decision.effective_budget_w,
            ramp_budget_w=_ramped_w(plan.budget_w, decision),
            guard_band=None if decision is None else decision.guard_band,
            offset=None if decision is None else decision.offset,
            uncontrolled_w=plan.uncontrolled_w,
            predicted_power_w=None if decision is None else decision.predicted_power_w,
            measured_power_w=float(sum(power_by_gpu.values())),
            price=None if decision is None else decision.price,
            status="idle" if decision is None else decision.status.value,
            solve_s=0.0 if decision is None else decision.solve_s,
            shadow=self.settings.shadow,
            nodes_reachable=reachable,
            nodes_unreachable=unreachable,
            setpoints_sent=sum(len(v) for v in plan.setpoints.values()),
            jobs=views,
            limited=self.nodes.other_limiters(
                self.settings.power_limit_margin, self._limits_sent[0] | self._limits_sent[1]
            ),
            domains=domains,
        )

    def _add_type(self, spec: GpuSpec) -> None:
        """A GPU type the catalog does not have: the grid grows by it (existing types keep
        their rows)."""
        self.specs[spec.name] = spec
        self.grid = _full_grid(self.specs)
        self.controller.use_grid(self.grid)
        self.running.grid = self.grid
