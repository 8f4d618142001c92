"""`Coordinator`: the head's control loop, one fixed-period interval at a time (no sockets here).

Every interval k (DESIGN.md, "Components and data flow"):

1. **Reconcile** the controller's job table with the store: jobs registered since the last
   interval join (their stored models, if any, are restored: a restart or a node that comes back
   resumes where it was); finished jobs leave and their GPUs are queued for release; jobs on a
   node that did not answer the last exchange leave the optimisation (their models stay in the
   store) until it answers again, and so do jobs with a GPU that refused a setpoint below the
   clock it holds (a failing clock write, a lease expired on arrival) until that GPU accepts one
   again.
2. **Measure**: per-job measurements from the last exchange's GPU reports. The agent reads
   every GPU before it applies an exchange, so the reports describe the interval that just
   ended. A report counts for a job only if its power is not null, the node also answered the
   exchange before (the interval is known from both ends), the GPU held what that exchange left
   in force for the whole interval (outside shadow mode: the job's setpoint, and the agent says
   it holds it), and the job joined before that exchange; so readings that mix two clocks, from
   before a job's first setpoint, or of a refused setpoint never teach its model. Its power is
   the interval's mean from the energy counter (ΔE/Δt between the two reports) where the counter
   rose, else the reading's own (a snapshot: on Hopper a 1 s average). Progress counts only when
   root or the job's user sent it, from one of the job's nodes.
3. **Solve**: `EconomicMPC.step`, built from ``[control]`` as the simulator builds it
   (`slurm_cdgpc.control.tuning`), with Slurm's queue as the reconcile last read it (the
   drain's input: whether jobs wait, each job's nodes, each node's free GPUs; none while it
   is unread or stale) and the budget in force now (the store's, else the
   configuration's ``budget.initial``; none: uncapped) minus the uncontrolled power:
   GPUs of unreachable nodes at their worst case (every GPU at its maximum power limit, never
   zero; a node that never reported counts every GPU its jobs name at the largest limit of the
   catalog), GPUs of jobs that are registered but not (yet) controlled at their enforced power
   limit, GPUs of jobs held out after a refusal and idle GPUs at their latest reading (at their
   limit when unreadable), never the interval's mean. A GPU whose job ended counts at its limit
   from the interval that releases it (back to default clocks: the next job may start on it at
   once) until a reading taken after the release arrives.
4. **Exchange** with every known node at once, each request naming its node: setpoints,
   releases of GPUs whose job ended, and a lease until now + ``lease.duration``, under this
   head's leader epoch. The leader lock is renewed first (`Leadership.confirm`): a head that
   cannot prove it still leads pushes nothing, and one that lost the lock stops
   (`LeadershipLostError` ends `run`). Shadow mode sends the same exchanges with no setpoints
   and no releases: the agents keep their default clocks and the lease stays renewed (so they
   do not fall to the safe cap while the head runs), but nothing is ever capped by the head.
   A refused release stays queued and is sent again at every exchange until it is done; a GPU
   that refused a setpoint below its clock is sent that setpoint again (never a higher clock)
   until it takes it; when the budget does not fit even with every planned job at its lowest
   clock, the refusing GPU's job goes to its lowest clock on every GPU that still takes one.
5. **Persist**, in one store transaction that also renews the leader lock (so a head fenced
   off during the exchange, or paused before the commit, writes nothing): the decision with
   its setpoints (the previous decision's measured power filled in), every job's model, the
   measurements, node reachability, job progress; measurements older than
   ``retention.measurements`` are pruned every `PRUNE_EVERY` intervals.

Nodes: an agent URL per node lives in the store. A node becomes known when it is announced
(`register_node`, ``POST /v1/nodes``) or when a job is first registered on it (then its URL is
``http://<node>:<node.listen_port>``). Its GPU type comes from its reports (NVML product names,
mapped through the catalog); a registration may name it (``gpu_type``) for a node that has not
answered yet. A job on a node whose GPU type is still unknown is accepted and waits, counted
at the limit, until the node reports: the Prolog never has to retry.

Thread safety: the API threads only write the store (`register_job`, `deregister_job`,
`set_budget`, `register_node`) and read the last `IntervalReport`, which is replaced whole at the
end of each interval; everything else belongs to the loop's thread.
"""

from __future__ import annotations

import logging
import math
import pwd
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Protocol

import numpy as np

from slurm_cdgpc.config import Config, ControlConfig
from slurm_cdgpc.control.discrete import ClockGrid
from slurm_cdgpc.control.dual import StepStatus
from slurm_cdgpc.control.empc import (
    ControllerSettings,
    Decision,
    EconomicMPC,
    Measurements,
    QueueState,
)
from slurm_cdgpc.control.tuning import Tuning, shipped
from slurm_cdgpc.coordinator.jobs import GpuRef, GpuSample, JobInfo, RunningJobs
from slurm_cdgpc.coordinator.metrics import HeadMetrics
from slurm_cdgpc.errors import CdgpcError, InputError
from slurm_cdgpc.gpu.board import spec_from_board
from slurm_cdgpc.gpu.catalog import CATALOG, GpuSpec, catalog_spec
from slurm_cdgpc.gpu.device import ThrottleReason
from slurm_cdgpc.model.estimator import EstimatorSettings, JobEstimator
from slurm_cdgpc.store import (
    ACTIVE_STATES,
    BudgetChange,
    Job,
    Measurement,
    ModelSnapshot,
    Node,
    Store,
    StoreBusyError,
)
from slurm_cdgpc.store import Setpoint as StoredSetpoint
from slurm_cdgpc.store.group_commit import GroupCommit, WouldBlockError
from slurm_cdgpc.store.leader import LeadershipLostError
from slurm_cdgpc.store.repository import JobRegistration
from slurm_cdgpc.transport.http import NodeFailure, NodeTarget
from slurm_cdgpc.transport.ssh import ssh_url
from slurm_cdgpc.wire.protocol import (
    ExchangeRequest,
    ExchangeResponse,
    GpuReport,
    ProgressReport,
    ProtocolError,
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
    interval_s: float = 30.0
    lease_s: float = 90.0
    shadow: bool = False
    retention_s: float = 30 * 86400.0
    initial_budget_w: float | None = None
    #: agents of nodes first seen in a registration listen here (``node.transport = http``)
    agent_port: int = 8464
    #: how the head reaches agents of nodes first seen in a registration: http or ssh
    node_transport: str = "http"
    #: Slurm's queue (whether jobs wait for GPUs: the drain's input) counts this long after it
    #: was read; older, the drain is off until the next read
    queue_stale_s: float = 180.0
    #: a registration re-plans out of cycle, no sooner than this after the last interval began
    replan_gap_s: float = 5.0
    #: a job's first intervals at its setpoint are its start-up: its model does not learn them
    #: (it stays counted at its power limit meanwhile)
    startup_intervals: int = 1
    #: the guard rail: each controlled GPU's power limit at its planned power times (1 + this)
    #: (``control.power_limit_margin``; 0: off, the boards keep their default limits)
    power_limit_margin: float = ControlConfig.power_limit_margin
    controller: ControllerSettings = field(default_factory=lambda: shipped().controller)
    estimator: EstimatorSettings = field(default_factory=lambda: shipped().estimator)

    @classmethod
    def from_config(cls, config: Config) -> CoordinatorSettings:
        c = config.control
        tuning = Tuning.from_config(c)
        return cls(
            interval_s=c.interval_s,
            lease_s=config.lease.duration_s,
            shadow=c.shadow,
            retention_s=config.retention.measurements_s,
            initial_budget_w=config.budget.initial_w,
            agent_port=config.node.listen_port,
            node_transport=config.node.transport,
            # three reconcile periods (`coordinator.main`: at least two control intervals)
            queue_stale_s=3 * max(config.head.reconcile_interval_s, 2 * c.interval_s),
            replan_gap_s=c.interval_s / 6,
            power_limit_margin=c.power_limit_margin,
            controller=tuning.controller,
            estimator=tuning.estimator,
        )


@dataclass(frozen=True)
class JobView:
    """What the head does with one job now (for ``GET /v1/jobs``)."""

    job_id: str
    controlled: bool
    graphics_mhz: int | None = None
    memory_mhz: int | None = None
    predicted_power_w: float | None = None
    measured_power_w: float | None = None  # all its GPUs, last exchange
    #: ``reported`` (steps arrived since it joined) or ``none``
    progress: str = "none"
    #: work left in seconds at top clocks (an upper bound when `Job.work_source` is
    #: ``time-limit``) and
    #: when it would end at the decided clocks; None: not known
    left_top_s: float | None = None
    finish_s: float | None = None


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

    def to_dict(self) -> dict[str, object]:
        return {
            "interval": self.interval,
            "time_s": self.time_s,
            "budget_w": self.budget_w,
            "effective_budget_w": self.effective_budget_w,
            "uncontrolled_w": self.uncontrolled_w,
            "predicted_power_w": self.predicted_power_w,
            "measured_power_w": self.measured_power_w,
            "price": _finite_or_none(self.price),
            "status": self.status,
            "solve_s": self.solve_s,
            "shadow": self.shadow,
            "nodes_reachable": self.nodes_reachable,
            "nodes_unreachable": self.nodes_unreachable,
            "setpoints_sent": self.setpoints_sent,
            "jobs_controlled": sum(1 for j in self.jobs if j.controlled),
            "limited": list(self.limited),
        }


def _full_grid(specs: Mapping[str, GpuSpec]) -> ClockGrid:
    """Every supported clock of every type, in ``specs``' order: the controller applies its own
    floor (and its fallback), and a type added later keeps the earlier ones' rows."""
    return ClockGrid.from_tables([(n, s.clocks) for n, s in specs.items()], min_fraction=0.0)


def _catalog_max_w() -> float:
    """The largest maximum power limit of the catalog: a GPU of unknown type may be any."""
    return max(s.power_limit.max_w for s in CATALOG.values())


_MIG: Final = "MIG mode is on: its clocks cannot be locked (counted at what it draws)"
#: throttle reasons that only another limiter (the board, the BMC, the rack) causes
_LIMITER_REASONS: Final = (
    (ThrottleReason.HW_POWER_BRAKE, "power brake (an external power-brake signal)"),
    (ThrottleReason.HW_SLOWDOWN, "hardware slowdown (thermal or power)"),
    (ThrottleReason.HW_THERMAL, "hardware thermal slowdown"),
    (ThrottleReason.SW_THERMAL, "software thermal slowdown"),
)


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


@dataclass
class _NodeState:
    """What the loop knows about one node (the store holds the durable part)."""

    url: str
    gpu_type: str | None  # catalog name; None until reported or named in a registration
    worst_case_w: float
    reachable: bool | None = None  # None: not exchanged with yet
    #: the last answer's readings (each taken before that exchange changed anything)
    reports: tuple[GpuReport, ...] = ()
    #: the interval of the exchange that answered ``reports`` (-1: none yet)
    reports_at: int = -1
    #: what the last answered exchange asked of the node, and the GPUs whose setpoint it refused
    sent: ExchangeRequest | None = None
    refused: frozenset[int] = frozenset()
    #: GPUs whose lock and job did not change over the interval the reports describe
    steady: frozenset[int] = frozenset()
    #: per GPU, the interval's mean power from the energy counter, where it can be trusted
    mean_w: dict[int, float] = field(default_factory=dict)
    #: when the node last answered an exchange (the head's clock; None: never)
    answered_s: float | None = None
    #: per GPU index: the controller's type of its board (None: not controlled, see ``why``)
    gpu_types: dict[int, str | None] = field(default_factory=dict)
    why: dict[int, str] = field(default_factory=dict)
    #: ask the agent for its boards at the next exchange (a GPU reported one not known here)
    describe: bool = False
    #: GPUs whose setpoint the agent refused because another process holds their clocks
    foreign: frozenset[int] = frozenset()


def _interval_power(
    node: _NodeState,
    reports: Sequence[GpuReport],
    k: int,
    limit_w: Callable[[str], float],
) -> tuple[frozenset[int], dict[int, float]]:
    """Which GPUs of ``reports`` (exchange ``k``) held one lock and job over the whole interval
    since the node's previous answer, and, for those, the interval's mean power from the energy
    counter.

    The agent reads every GPU before it applies an exchange, so the interval between two
    answered exchanges in a row ran under what the earlier one left in force: its setpoint
    (unless refused), no lock after a release, otherwise the lock read then. A report whose lock
    or job differs from that was changed in between (a lapse's safe cap, an Epilog's release, a
    restarted agent): its readings mix two settings. The mean power is ΔE/Δt between the two
    readings; a counter that did not rise (a driver reload resets it), a GPU that changed, or a
    mean above twice the GPU's power limit leaves the reading's own power in place.
    """
    sent = node.sent
    if node.reachable is not True or sent is None or node.reports_at != k - 1:
        return frozenset(), {}
    before = {r.index: r for r in node.reports}
    points = {p.gpu: p for p in sent.setpoints if p.gpu not in node.refused}
    released = set(sent.release) - node.refused
    steady: set[int] = set()
    mean_w: dict[int, float] = {}
    for r in reports:
        prev = before.get(r.index)
        if prev is None or prev.uuid != r.uuid:
            continue
        point = points.get(r.index)
        if point is not None:
            held = (
                r.locked is not None
                and r.locked.graphics_max_mhz == point.graphics_mhz
                and (point.memory_mhz is None or r.locked.memory_mhz == point.memory_mhz)
                and r.job_id == point.job_id
            )
        elif r.index in released:
            held = r.locked is None and r.job_id is None
        else:
            held = prev.locked == r.locked and prev.job_id == r.job_id
        if not held:
            continue
        steady.add(r.index)
        e0_j, e1_j, t0_s, t1_s = prev.energy_j, r.energy_j, prev.read_s, r.read_s
        if e0_j is None or e1_j is None or t0_s is None or t1_s is None:
            continue
        dt_s, de_j = t1_s - t0_s, e1_j - e0_j
        if dt_s > 0 and de_j > 0 and de_j / dt_s <= 2 * limit_w(r.name):
            mean_w[r.index] = de_j / dt_s
    return frozenset(steady), mean_w


@dataclass(frozen=True)
class _Registration:
    """One `Coordinator.register_job` call, checked, waiting for its batch."""

    job_id: str
    user: str
    node: str
    gpus: tuple[int, ...]
    spec: GpuSpec | None
    deadline_s: float | None
    iterations_total: int | None
    adopted: bool = False
    #: who sent it (the API's authenticated principal), for the log line
    sender: object = None
    #: Slurm's time limit and start time, when the Prolog (or squeue) said
    time_limit_s: float | None = None
    started_at_s: float | None = None


def _registration(
    job_id: str,
    user: str,
    node: str,
    gpus: Sequence[int],
    gpu_type: str | None,
    deadline_s: float | None,
    iterations_total: int | None,
    adopted: bool,
    sender: object = None,
    time_limit_s: float | None = None,
    started_at_s: float | None = None,
) -> _Registration:
    if not gpus:
        raise InputError(f"job {job_id}: no GPUs on node {node}")
    spec = None if gpu_type is None else catalog_spec(gpu_type)
    return _Registration(
        job_id,
        user,
        node,
        tuple(gpus),
        spec,
        deadline_s,
        iterations_total,
        adopted,
        sender,
        time_limit_s,
        started_at_s,
    )


def _log_registration(r: _Registration) -> None:
    """One line per registration, with its sender when it came through the API."""
    logger.info(
        "job %s: registered by %s on %s GPU(s) %s (deadline %s, %s iterations)%s%s",
        r.job_id,
        r.user,
        r.node,
        ",".join(map(str, r.gpus)),
        r.deadline_s,
        r.iterations_total,
        "" if r.sender is None else ", sent by ",
        "" if r.sender is None else r.sender,
    )


class Coordinator:
    """The head's control loop over a `Store` and a `NodeTransport`."""

    def __init__(
        self,
        store: Store,
        transport: NodeTransport,
        settings: CoordinatorSettings | None = None,
        clock: Callable[[], float] = time.time,
        specs: Mapping[str, GpuSpec] = CATALOG,
        leader: Leadership | None = None,
    ) -> None:
        self.store = store
        self.transport = transport
        #: None: the only head, with no lock to hold (epoch 0)
        self.leader = leader
        self.settings = settings or CoordinatorSettings()
        self._clock = clock
        #: the controller's GPU types: the catalog's, and every board an agent described
        self.specs: dict[str, GpuSpec] = dict(specs)
        #: board digest -> the type it maps to (`spec_from_board`)
        self._board_types: dict[str, str] = {}
        self.grid = _full_grid(self.specs)
        self.controller = EconomicMPC(self.grid, self.settings.controller)
        self.running = RunningJobs(self.grid, JobEstimator(self.settings.estimator), self.specs)
        self.interval = 0
        self.last_report: IntervalReport | None = None
        self._nodes: dict[str, _NodeState] = {}
        self._known: dict[str, Job] = {}  # active jobs at the last reconcile
        self._added_at: dict[str, int] = {}  # job -> interval it joined the controller
        self._started: set[str] = set()  # jobs marked running in the store
        self._progress_done: dict[str, int] = {}
        self._releases: dict[str, set[int]] = {}
        #: released GPUs -> the exchange that released them: at default clocks from then on, they
        #: count at their limit until a reading taken after it arrives (a job may start at once)
        self._released: dict[GpuRef, int] = {}
        #: GPUs that refused a setpoint below the clock they hold, with that setpoint: their job
        #: is out of the optimisation, and the setpoint is sent again, until one is accepted
        self._refusing: dict[GpuRef, AgentSetpoint] = {}
        self._squeezed: set[str] = set()  # held-out jobs sent to their lowest clock (logged)
        self._sampled_at = -1  # interval of the exchange that produced the node reports
        self._planned_w: dict[str, float] = {}  # last decision's planned power per job
        #: the plan in force over the interval the node reports describe: the decision before
        #: the last (the agents read before they apply), what their power is judged against
        self._planned_reported_w: dict[str, float] = {}
        self._last_decision: tuple[int, tuple[GpuRef, ...]] | None = None
        self._waiting_logged: set[str] = set()
        self._write_lock = threading.Lock()  # API writes that read-then-write the store
        self._registrations = GroupCommit(self._register_batch)
        self._typed_nodes: dict[str, str] = {}  # committed nodes with a GPU type (registration)
        self._uids: dict[str, int | None] = {}  # job user -> uid on this host
        self._spoof_logged: set[tuple[str, str, int]] = set()  # refused progress, logged once
        #: per job, the node whose progress counts: the first to report (each node's agent
        #: times its own reports, and a job's nodes are a step or two apart)
        self._reporter: dict[str, str] = {}
        #: whether jobs wait for GPUs in Slurm, and when that was read (monotonic); None: unread
        self._queue_seen: tuple[bool, float] | None = None
        self._queue_known = False  # the drain has its input (logged on each change)
        self._replan = threading.Event()  # a job registered: plan for it out of cycle
        self.metrics = HeadMetrics(self)  # GET /metrics: this head's own registry

    # -- start-up ----------------------------------------------------------------------------

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
        self._load_nodes(self.store.nodes())
        active = self.store.jobs(ACTIVE_STATES)
        logger.info(
            "cdgpcd resumes at interval %d: %d node(s), %d active job(s)%s",
            self.interval,
            len(self._nodes),
            len(active),
            "".join(f", job {j.job_id}" for j in active[:20]),
        )

    def _load_nodes(self, nodes: Iterable[Node]) -> None:
        for node in nodes:
            state = self._nodes.get(node.name)
            gpu_type = node.gpu_type or None
            if state is None:
                self._nodes[node.name] = _NodeState(
                    node.url, gpu_type, node.worst_case_power_w, answered_s=node.last_seen_s
                )
            else:
                state.url = node.url
                state.gpu_type = state.gpu_type or gpu_type

    # -- what the API calls (any thread; store writes only) ------------------------------------

    def now_s(self) -> float:
        return self._clock()

    def agent_url(self, node: str) -> str:
        if self.settings.node_transport == "ssh":
            return ssh_url(node)
        return f"http://{node}:{self.settings.agent_port}"

    def register_node(self, name: str, url: str, gpu_type: str | None = None) -> Node:
        """Announce a node's agent URL (and optionally its GPU type until it reports)."""
        spec = None if gpu_type is None else catalog_spec(gpu_type)
        with self._write_lock:
            known = {n.name: n for n in self.store.nodes()}.get(name)
            node = self.store.upsert_node(
                name,
                url,
                gpu_count=known.gpu_count if known else 0,
                gpu_type=(known.gpu_type if known and known.gpu_type else "")
                or (spec.name if spec else ""),
                worst_case_power_w=known.worst_case_power_w if known else 0.0,
                reachable=known.reachable if known else False,
                last_seen_s=known.last_seen_s if known else None,
            )
        logger.info("node %s: agent at %s", name, url)
        return node

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
    ) -> Job:
        """Record a job's GPUs on one node (idempotent; a multi-node job calls once per node).
        ``adopted``: found running in Slurm without a registration (`reconcile`), not from a
        Prolog.

        Registrations that arrive together commit together (`GroupCommit`): a burst of Prologs
        pays one durable commit, not one each. This returns only once the registration is
        committed; a registration refused on its own (another user's job id) fails alone.
        """
        registration = _registration(
            job_id,
            user,
            node,
            gpus,
            gpu_type,
            deadline_s,
            iterations_total,
            adopted,
            time_limit_s=time_limit_s,
            started_at_s=started_at_s,
        )
        if self.store.in_transaction():  # the caller's transaction commits it, not a batch
            [outcome] = self._register_batch([registration])
            if isinstance(outcome, Exception):
                raise outcome
            job = outcome
        else:
            job = self._registrations.submit(registration)
        return job

    def register_job_later(
        self,
        then: Callable[[Callable[[], Job]], None],
        job_id: str,
        user: str,
        node: str,
        gpus: Sequence[int],
        *,
        gpu_type: str | None = None,
        deadline_s: float | None = None,
        iterations_total: int | None = None,
        time_limit_s: float | None = None,
        started_at_s: float | None = None,
        sender: object = None,
        lead: bool = True,
    ) -> None:
        """`register_job` without waiting: once committed (or refused), ``then(outcome)`` is
        called, where ``outcome()`` returns the job or raises, on the thread that committed the
        batch (this one when none was in progress). ``then`` must not block. A request that is
        malformed (`InputError`) raises here, before anything is queued. ``sender``: who sent
        it, named in the registration's log line. ``lead=False``: only queue it, even with no
        batch in progress, for `commit_queued_registrations`."""
        registration = _registration(
            job_id,
            user,
            node,
            gpus,
            gpu_type,
            deadline_s,
            iterations_total,
            False,
            sender,
            time_limit_s,
            started_at_s,
        )
        self._registrations.submit_later(registration, then, lead=lead)

    def commit_queued_registrations(self, *, wait: bool) -> bool:
        """Commit the registrations queued with ``lead=False``, unless a batch is in progress
        (its leader takes them). ``wait=False`` (an event loop's thread): if another writer
        holds the store, commit nothing and return False; they are then to be committed by a
        thread that may wait, with ``wait=True``."""
        if wait:
            return self._registrations.lead_queued()
        return self._registrations.lead_queued(self._register_batch_now)

    def _register_batch_now(self, batch: Sequence[_Registration]) -> list[Job | Exception]:
        return self._register_batch(batch, wait=False)

    def _register_batch(
        self, batch: Sequence[_Registration], *, wait: bool = True
    ) -> list[Job | Exception]:
        """Register ``batch`` in one transaction; a refusal (`InputError`) is returned in place of
        its job and changes nothing of it. Raises, committing nothing, if the store fails.
        ``wait=False``: raises `WouldBlockError`, having done nothing, rather than wait for
        another writer (this head's, or another process's)."""
        outcomes: list[Job | Exception | None] = [None] * len(batch)
        if not self._write_lock.acquire(blocking=wait):
            raise WouldBlockError
        try:
            with self.store.transaction(wait=wait):
                refused, typed = self._register_nodes(batch)
                accepted = [i for i, r in enumerate(batch) if r.node not in refused]
                for i, r in enumerate(batch):
                    if r.node in refused:
                        outcomes[i] = refused[r.node]
                registered = self.store.register_jobs(
                    [
                        JobRegistration(
                            batch[i].job_id,
                            batch[i].user,
                            {batch[i].node: batch[i].gpus},
                            deadline_s=batch[i].deadline_s,
                            iterations_total=batch[i].iterations_total,
                            adopted=batch[i].adopted,
                            time_limit_s=batch[i].time_limit_s,
                            started_at_s=batch[i].started_at_s,
                        )
                        for i in accepted
                    ]
                )
                for i, outcome in zip(accepted, registered, strict=True):
                    outcomes[i] = outcome
            if not self.store.in_transaction():  # committed: later batches may rely on it
                self._typed_nodes.update(typed)
        except StoreBusyError:
            raise WouldBlockError from None
        finally:
            self._write_lock.release()
        for r, o in zip(batch, outcomes, strict=True):
            if isinstance(o, Job):
                _log_registration(r)
                self._replan.set()
        return [o for o in outcomes if o is not None]

    def _register_nodes(
        self, batch: Sequence[_Registration]
    ) -> tuple[dict[str, InputError], dict[str, str]]:
        """Make the batch's nodes known (the agent URL by convention) and name the GPU type of
        those that have none yet. Returns the nodes the store refused (with why), and the nodes
        now known with a GPU type: a node never loses its type, so a later batch on them needs
        no read at all (`_typed_nodes`)."""
        unseen = {r.node for r in batch if r.node not in self._typed_nodes}
        known = self.store.nodes_named(unseen) if unseen else {}
        typed = {name: node.gpu_type for name, node in known.items() if node.gpu_type}
        new: dict[str, Node] = {}
        named: dict[str, str] = {}
        for r in batch:
            node, spec = known.get(r.node), r.spec
            if r.node in unseen and node is None and r.node not in new:
                limit_w = spec.power_limit.max_w if spec else _catalog_max_w()
                new[r.node] = Node(
                    name=r.node,
                    url=self.agent_url(r.node),
                    transport="http",
                    last_seen_s=None,
                    reachable=False,
                    gpu_count=0,
                    gpu_type=spec.name if spec else "",
                    worst_case_power_w=limit_w * (max(r.gpus) + 1),
                )
                continue
            if spec is None:
                continue
            gpu_type = self._typed_nodes.get(r.node) or typed.get(r.node) or named.get(r.node)
            if r.node in new:
                gpu_type = gpu_type or new[r.node].gpu_type
            if not gpu_type:
                named[r.node] = spec.name
                logger.info("node %s: GPU type %s named by job %s", r.node, spec.name, r.job_id)
            elif gpu_type != spec.name:
                logger.warning(
                    "job %s: registration names %s GPUs, node %s reports %s: using %s",
                    r.job_id,
                    spec.name,
                    r.node,
                    gpu_type,
                    gpu_type,
                )
        added = self.store.add_nodes(list(new.values()))
        refused = {
            name: outcome
            for name, outcome in zip(new, added, strict=True)
            if isinstance(outcome, InputError)
        }
        typed.update(
            (n.name, n.gpu_type) for n in new.values() if n.gpu_type and n.name not in refused
        )
        named = {name: gpu_type for name, gpu_type in named.items() if name not in refused}
        self.store.name_gpu_types(named)
        typed.update(named)
        return refused, typed

    def reconcile(self, slurm_running: Collection[str], grace_s: float) -> list[str]:
        """Deregister active jobs that Slurm no longer runs: their Epilog never reached us (a
        node crashed, the head was away and the spool was lost). A job registered less than
        ``grace_s`` ago is left alone: squeue may not list it yet. Returns the ids removed."""
        now_s = self._clock()
        gone = [
            job.job_id
            for job in self.store.jobs(ACTIVE_STATES)
            if job.job_id not in slurm_running and now_s - job.registered_at_s > grace_s
        ]
        for job_id in gone:
            logger.warning("job %s: no longer running in Slurm; deregistered", job_id)
            self.deregister_job(job_id)
        return gone

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
    ) -> BudgetChange:
        change = self.store.set_budget(budget_w, user, effective_at_s=effective_at_s, reason=reason)
        logger.info(
            "budget %.0f W set by %s, effective at %.0f (%s)",
            budget_w,
            user,
            change.effective_at_s,
            reason or "no reason given",
        )
        return change

    # -- the loop ----------------------------------------------------------------------------

    def observe_queue(self, waiting: bool | None) -> None:
        """Whether jobs wait for GPUs in Slurm, from the reconcile (any thread); None: Slurm
        could not be read."""
        self._queue_seen = None if waiting is None else (waiting, time.monotonic())

    def _queue_state(self) -> QueueState | None:
        """The drain's input: Slurm's queue as last read, the controlled jobs' nodes and each
        node's free GPUs; None (the drain off, said once) while the queue is unread or stale."""
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
        index = {name: i for i, name in enumerate(self._nodes)}
        rows, nodes = [], []
        for row, info in enumerate(self.running.jobs):
            for name in sorted({g.node for g in info.gpus}):
                rows.append(row)
                nodes.append(index.get(name, -1))
        busy = {GpuRef(g.node, g.gpu_index) for j in self._known.values() for g in j.gpus}
        free = np.array(
            [
                sum(GpuRef(name, r.index) not in busy for r in node.reports)
                if node.reachable
                else 0
                for name, node in self._nodes.items()
            ],
            dtype=np.int64,
        )
        placed = np.array(nodes, dtype=np.int64) >= 0
        return QueueState(
            True,
            np.array(rows, dtype=np.int64)[placed],
            np.array(nodes, dtype=np.int64)[placed],
            free,
        )

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
            if self._wait(stop, next_s, began_s + self.settings.replan_gap_s):
                next_s = time.monotonic()  # planned out of cycle: a full period from here

    def _wait(self, stop: threading.Event, next_s: float, earliest_s: float) -> bool:
        """Until ``next_s``, or a registration's wake-up from ``earliest_s`` on; True if woken
        out of cycle."""
        while not stop.is_set():
            now_s = time.monotonic()
            if now_s >= next_s:
                return False
            if self._replan.is_set():
                if now_s >= earliest_s:
                    return True
                stop.wait(min(earliest_s, next_s) - now_s)
                continue
            self._replan.wait(next_s - now_s)
        return False

    def run_interval(self) -> IntervalReport:
        began_s = time.perf_counter()
        k = self.interval
        now_s = self._clock()
        active = self.store.jobs(ACTIVE_STATES)
        self._load_nodes(self.store.nodes())
        self._reconcile(active, k)
        measured = self._measurements()
        budget = self.store.current_budget(now_s)
        budget_w = budget.budget_w if budget is not None else self.settings.initial_budget_w
        uncontrolled_w = self._uncontrolled_w()
        decision: Decision | None = None
        if len(self.running):
            decision = self.controller.step(
                self.running.estimator,
                self.running.job_state(),
                now_s,
                UNCAPPED_W if budget_w is None else budget_w,
                uncontrolled_w=uncontrolled_w,
                measured=measured,
                queue=self._queue_state(),
            )
        squeeze = budget_w is not None and (
            decision.status is StepStatus.INFEASIBLE
            if decision is not None
            else uncontrolled_w > budget_w
        )
        setpoints = self._setpoints(decision, squeeze=squeeze)
        if self.leader is not None:
            self.leader.confirm()  # renewed before every push; a failure pushes nothing
        responses = self._exchange(k, now_s, setpoints)
        report = self._persist(k, now_s, budget_w, uncontrolled_w, decision, responses, setpoints)
        self.last_report = report
        self.interval = k + 1
        self.metrics.interval_seconds.observe(time.perf_counter() - began_s)
        return report

    # -- 1. reconcile --------------------------------------------------------------------------

    def _reconcile(self, active: list[Job], k: int) -> None:
        by_id = {j.job_id: j for j in active}
        for job_id, old in self._known.items():
            if job_id not in by_id:  # finished: release its GPUs on every node
                for g in old.gpus:
                    self._releases.setdefault(g.node, set()).add(g.gpu_index)
                self._started.discard(job_id)
                self._progress_done.pop(job_id, None)
        self._known = by_id
        # what is kept per job id goes with the job (a head runs for months of job ids)
        self._waiting_logged &= by_id.keys()
        self._spoof_logged = {s for s in self._spoof_logged if s[0] in by_id}
        self._reporter = {j: n for j, n in self._reporter.items() if j in by_id}
        self._refusing = {g: p for g, p in self._refusing.items() if p.job_id in by_id}
        held_out = self._held_out()
        self._squeezed &= held_out
        wanted: dict[str, JobInfo] = {}
        for job in active:
            info = self._job_info(job, held_out)
            if info is not None:
                wanted[job.job_id] = info
        current = {j.job_id: j for j in self.running.jobs}
        leave = [
            j
            for j, info in current.items()
            if j not in wanted or wanted[j].placement != info.placement
        ]
        self.running.update(
            info
            for j, info in wanted.items()
            if j in current and j not in leave and current[j] != info
        )
        self.controller.jobs_ended(*self.running.work(j for j in leave if j not in by_id))
        for info in self.running.remove(leave):
            self._added_at.pop(info.job_id, None)
            if info.job_id not in by_id:
                reason = "finished"
            elif info.job_id in held_out:
                reason = "a GPU refused its setpoint; counted at its reported power"
            else:
                reason = "node unreachable or GPUs changed"
            logger.info("job %s: leaves the controller (%s)", info.job_id, reason)
        joining = [info for j, info in wanted.items() if j not in self.running]
        added: list[str] = []
        for info in joining:
            try:
                self.running.add([info])
            except InputError as e:
                logger.warning("job %s: not controlled: %s", info.job_id, e)
                continue
            self._added_at[info.job_id] = k
            added.append(info.job_id)
            for ref in info.gpus:  # a GPU that gets a setpoint is not released
                self._releases.get(ref.node, set()).discard(ref.index)
        if added:
            self._restore_models(added)

    def _held_out(self) -> set[str]:
        """Jobs kept out of the optimisation because one of their GPUs refuses its setpoint."""
        return {p.job_id for p in self._refusing.values()}

    def _job_info(self, job: Job, held_out: Collection[str]) -> JobInfo | None:
        """The job as the controller takes it; None while it cannot be controlled (a node away
        or of unknown type, a GPU in ``held_out`` refusing its setpoint)."""
        nodes = [self._nodes.get(n) for n in job.nodes]
        if any(n is not None and n.reachable is False for n in nodes):
            return None
        if job.job_id in held_out:
            return None
        refs = [GpuRef(g.node, g.gpu_index) for g in job.gpus]
        types = {self.gpu_type(ref) for ref in refs}
        if None in types or not types or any(n is None for n in nodes):
            if job.job_id not in self._waiting_logged:
                self._waiting_logged.add(job.job_id)
                why = sorted(
                    {n.why.get(r.index, "") for r in refs if (n := self._nodes.get(r.node))} - {""}
                )
                logger.info(
                    "job %s: not controlled: %s",
                    job.job_id,
                    "; ".join(why) or "waits for its node(s) to report their GPU type",
                )
            return None
        gpu_type = sorted(t for t in types if t is not None)[0]
        if len(types) > 1:
            logger.warning("job %s: GPU types differ across nodes; using %s", job.job_id, gpu_type)
        return JobInfo(
            job_id=job.job_id,
            gpus=tuple(GpuRef(g.node, g.gpu_index) for g in sorted(job.gpus)),
            gpu_type=gpu_type,
            deadline_s=job.deadline_s,
            iterations_total=job.iterations_total,
            time_limit_s=job.time_limit_s,
            # the Prolog runs as the job starts: its registration stands in for Slurm's word
            start_s=job.registered_at_s if job.started_at_s is None else job.started_at_s,
        )

    def _restore_models(self, job_ids: list[str]) -> None:
        """Copy stored models into the rows of jobs that just joined (restart, node back)."""
        snapshot = self.store.load_models(self.settings.estimator.family, job_ids)
        if not len(snapshot):
            return
        rows = [self.running.jobs.index(self._info(j)) for j in snapshot.job_ids]
        self.running.estimator.restore(snapshot.power, snapshot.time, rows)
        logger.info("restored the models of job(s) %s", ", ".join(snapshot.job_ids))

    def _info(self, job_id: str) -> JobInfo:
        for info in self.running.jobs:
            if info.job_id == job_id:
                return info
        raise KeyError(job_id)

    # -- 2. measure ----------------------------------------------------------------------------

    def _trusted(self) -> dict[str, list[GpuSample]]:
        """Per job, the samples of the last exchange that may teach its model: GPUs that held
        the job's lock (outside shadow mode: the agent says it holds the job's setpoint) for the
        whole interval the readings describe, with the interval's mean power where known."""
        out: dict[str, list[GpuSample]] = {}
        owner = {g: j.job_id for j in self.running.jobs for g in j.gpus}
        for name, node in self._nodes.items():
            if node.reachable is not True:
                continue
            for r in node.reports:
                ref = GpuRef(name, r.index)
                job_id = owner.get(ref)
                power_w = node.mean_w.get(r.index, r.power_w)
                if job_id is None or power_w is None or r.index not in node.steady:
                    continue  # no job, no power, or a lock that changed during the interval
                if r.sm_clock_mhz is None or r.memory_clock_mhz is None:
                    continue
                if self._added_at.get(job_id, self.interval) >= self._sampled_at:
                    continue  # read before its first setpoint held for a whole interval
                if not self.settings.shadow and r.job_id != job_id:
                    continue  # the agent does not hold this job's setpoint (yet, or refused)
                out.setdefault(job_id, []).append(
                    GpuSample(ref, power_w, r.sm_clock_mhz, r.memory_clock_mhz, r.throttle or 0)
                )
        return out

    def _measurements(self) -> Measurements:
        """What the models learn from: the trusted samples, less each job's start-up (its first
        ``startup_intervals`` under its setpoint: loading and compiling teach nothing)."""
        learning_from = self._sampled_at - self.settings.startup_intervals
        samples = [
            s
            for job_id, per_job in self._trusted().items()
            if self._added_at.get(job_id, self.interval) < learning_from
            for s in per_job
        ]
        plan = self._planned_reported_w
        planned = np.array([plan.get(j.job_id, np.nan) for j in self.running.jobs])
        return self.running.measurements(samples, planned)

    # -- 3. uncontrolled power -----------------------------------------------------------------

    def _uncontrolled_w(self) -> float:
        controlled = {g for j in self.running.jobs for g in j.gpus}
        held_out = self._held_out()
        self._released = {
            ref: k
            for ref, k in self._released.items()
            if ref.node in self._nodes and self._nodes[ref.node].reports_at <= k
        }
        releasing = {GpuRef(n, g) for n, gpus in self._releases.items() for g in gpus}
        releasing |= set(self._released)
        waiting = {
            GpuRef(g.node, g.gpu_index)
            for j in self._known.values()
            if j.job_id not in self.running and j.job_id not in held_out
            for g in j.gpus
        }
        total_w = 0.0
        named: dict[str, int] | None = None  # node -> GPUs its jobs name, once one is away
        for name, node in self._nodes.items():
            if node.reachable is False:
                if named is None:
                    named = self._gpus_named()
                total_w += self._worst_case_w(node, named.get(name, 0))  # never zero
                continue
            for r in node.reports:
                ref = GpuRef(name, r.index)
                if ref in controlled:
                    continue
                limit_w = r.enforced_limit_w or self._limit_w(r.name)
                if ref in waiting or ref in releasing or r.power_w is None:
                    total_w += limit_w
                else:
                    total_w += r.power_w
        return total_w

    def _gpus_named(self) -> dict[str, int]:
        """Per node, how many GPUs its active jobs imply (the highest index named, plus one)."""
        named: dict[str, int] = {}
        for job in self._known.values():
            for g in job.gpus:
                named[g.node] = max(named.get(g.node, 0), g.gpu_index + 1)
        return named

    def _worst_case_w(self, node: _NodeState, named: int) -> float:
        """What an unreachable node may draw: its reported GPUs at their maximum power limit,
        and at least the ``named`` GPUs its jobs imply (one, if none) at the limit of its GPU
        type, or at the largest of the catalog while its type is unknown: a node the head never
        reached (announced, or first seen in a registration) is never counted at zero."""
        per_gpu_w = _catalog_max_w() if node.gpu_type is None else self._limit_w(node.gpu_type)
        return max(node.worst_case_w, max(named, 1) * per_gpu_w)

    def _limit_w(self, gpu_name: str) -> float:
        try:
            return catalog_spec(gpu_name).power_limit.max_w
        except InputError:
            return max(s.power_limit.max_w for s in self.specs.values())

    # -- 4. exchange ---------------------------------------------------------------------------

    def _setpoints(
        self, decision: Decision | None, *, squeeze: bool = False
    ) -> dict[str, list[AgentSetpoint]]:
        """The decision's setpoints, and the refused ones again for GPUs that still refuse
        (their job is out of the decision): the only way to learn that a GPU accepts them.

        With ``squeeze`` (the budget does not fit even with every planned job at its lowest
        clock), a job held out after a refusal goes to its lowest clock on every GPU: the ones
        that accept it shed what the refusing one keeps drawing, and the refusing one is asked
        for that clock from then on. Nothing raises them again until the job rejoins the plan.
        """
        if self.settings.shadow:
            return {}
        out: dict[str, list[AgentSetpoint]] = {}
        if decision is not None:
            out = {
                node: [
                    AgentSetpoint(p.gpu, p.job_id, p.graphics_mhz, p.memory_mhz, p.power_limit_w)
                    for p in points
                ]
                for node, points in self.running.setpoints(
                    decision, self.settings.power_limit_margin
                ).items()
            }
        held_out = {p.job_id for p in self._refusing.values() if p.job_id not in self.running}
        lowest = self._lowest_points(held_out) if squeeze else {}
        for ref, point in sorted(self._refusing.items()):
            if point.job_id in held_out and ref not in lowest:
                out.setdefault(ref.node, []).append(point)
        for ref, point in sorted(lowest.items()):
            out.setdefault(ref.node, []).append(point)
        return out

    def _lowest_points(self, job_ids: Collection[str]) -> dict[GpuRef, AgentSetpoint]:
        """Setpoints at the controller's lowest clock for every GPU of ``job_ids``."""
        out: dict[GpuRef, AgentSetpoint] = {}
        for job_id in sorted(job_ids):
            job = self._known.get(job_id)
            if job is None:
                continue
            if job_id not in self._squeezed:
                self._squeezed.add(job_id)
                logger.warning(
                    "job %s: the budget does not fit while one of its GPUs refuses its "
                    "setpoint: its GPUs go to their lowest clock",
                    job_id,
                )
            for g in job.gpus:
                gpu_type = self.gpu_type(GpuRef(g.node, g.gpu_index))
                if gpu_type is None or gpu_type not in self.specs:
                    continue  # unknown type: never controlled, never held out
                g_lo, m_lo = self.grid.bottom_mhz(np.array([self.grid.type_index(gpu_type)]))
                memory = self.specs[gpu_type].memory_lockable
                out[GpuRef(g.node, g.gpu_index)] = AgentSetpoint(
                    g.gpu_index, job_id, int(g_lo[0]), int(m_lo[0]) if memory else None
                )
        return out

    def _exchange(
        self, k: int, now_s: float, setpoints: Mapping[str, list[AgentSetpoint]]
    ) -> dict[str, ExchangeResponse | NodeFailure]:
        lease_s = now_s + self.settings.lease_s
        epoch = 0 if self.leader is None else self.leader.epoch
        targets: dict[str, NodeTarget] = {}
        for name, node in self._nodes.items():
            points = tuple(setpoints.get(name, ()))
            taken = {p.gpu for p in points}
            release: tuple[int, ...] = ()
            if not self.settings.shadow:
                release = tuple(sorted(self._releases.get(name, set()) - taken))
            try:
                request = ExchangeRequest(
                    k, lease_s, points, release, epoch=epoch, node=name, describe=node.describe
                )
            except ProtocolError as e:  # no agent could take it: counted as unreachable
                logger.error("node %s: no exchange possible: %s", name, e)
                self.metrics.exchange_failures.labels("request").inc()
                continue
            targets[name] = NodeTarget(node.url, request)
        if not targets:
            return {}
        with self.metrics.exchange_seconds.time():
            responses = self.transport.exchange(targets)
        for name, node in self._nodes.items():
            result = responses.get(name, NodeFailure("not exchanged"))
            if isinstance(result, NodeFailure):
                if name in targets:
                    self.metrics.exchange_failed(result.reason)
                if node.reachable is not False:
                    logger.warning("node %s: unreachable: %s", name, result.reason)
                node.reachable = False
                node.reports = ()
                node.steady, node.mean_w = frozenset(), {}
                continue
            if node.reachable is False:
                logger.info("node %s: reachable again", name)
            if node.answered_s is not None and now_s > node.answered_s + self.settings.lease_s:
                self.metrics.lease_lapses.inc()  # its last lease ran out before this exchange
            node.answered_s = now_s
            sent = targets[name].request
            node.steady, node.mean_w = _interval_power(node, result.gpus, k, self._limit_w)
            node.reachable = True
            self._learn_boards(name, node, result)
            node.reports = result.gpus
            node.reports_at = k
            node.sent = sent
            node.refused = frozenset(r.gpu for r in result.refused)
            node.foreign = frozenset(
                r.gpu for r in result.refused if "another process holds its clocks" in r.reason
            )
            self._track_refusals(name, sent, result)
            self._release_orphans(name, sent, result)
            for refusal in result.refused:
                job = next((p.job_id for p in sent.setpoints if p.gpu == refusal.gpu), "-")
                logger.warning(
                    "job %s: node %s refused GPU %d: %s", job, name, refusal.gpu, refusal.reason
                )
            for p in self._allowed_progress(name, result):
                self.running.record_progress(p.job_id, p.step, p.time_s)
        self._sampled_at = k
        return responses

    def _release_orphans(self, name: str, sent: ExchangeRequest, result: ExchangeResponse) -> None:
        """Release a GPU the agent still holds for a job the store has finished: its release
        was lost (the head died before sending it, or the job came and went while the head was
        away), and no one else would ever lift that lock. A job the store does not know is left
        alone: its Prolog may hold its GPUs while its registration is on its way."""
        held = {g.gpu_index for j in self._known.values() for g in j.gpus if g.node == name}
        for r in result.gpus:
            if r.locked is None or r.job_id is None or r.index in held:
                continue
            if r.job_id in self._known or r.index in sent.release:  # read before it applied
                continue
            if r.index in self._releases.get(name, set()):
                continue
            job = self.store.job(r.job_id)
            if job is not None and job.state == "finished":
                logger.info(
                    "node %s: GPU %d still held for job %s, which has ended: released",
                    name,
                    r.index,
                    r.job_id,
                )
                self._releases.setdefault(name, set()).add(r.index)

    def _track_refusals(self, name: str, sent: ExchangeRequest, result: ExchangeResponse) -> None:
        """Keep refused releases queued (a GPU whose reset failed must not stay locked), and
        note the GPUs that refused a setpoint below the clock they hold: the plan must not count
        them at a clock they do not have. A refused setpoint above the held clock leaves the GPU
        below the plan, which is safe; the plan keeps it."""
        refused = frozenset(r.gpu for r in result.refused)
        by_index = {r.index: r for r in result.gpus}
        kept = {g for g in sent.release if g in refused and g in by_index}
        done = [g for g in sent.release if g not in refused]
        if kept:
            self._releases[name] = kept
            logger.warning(
                "node %s: release of GPU(s) %s refused; retried at the next exchange",
                name,
                ",".join(map(str, sorted(kept))),
            )
        else:
            self._releases.pop(name, None)
        if done:
            logger.info("node %s: released GPU(s) %s", name, ",".join(map(str, done)))
        for g in done:
            self._released[GpuRef(name, g)] = sent.interval
        for point in sent.setpoints:
            ref = GpuRef(name, point.gpu)
            report = by_index.get(point.gpu)
            held = None if report is None else report.locked  # read before: what it still holds
            above = report is not None and (
                held is None or held.graphics_max_mhz > point.graphics_mhz
            )
            if point.gpu in refused and above:
                if ref not in self._refusing:
                    logger.warning(
                        "job %s: node %s GPU %d refused its setpoint of %d MHz: the job leaves "
                        "the plan, counted at its reported power, until the GPU accepts one",
                        point.job_id,
                        name,
                        point.gpu,
                        point.graphics_mhz,
                    )
                self._refusing[ref] = point
            elif self._refusing.pop(ref, None) is not None:
                logger.info(
                    "job %s: node %s GPU %d %s: the job rejoins the plan",
                    point.job_id,
                    name,
                    point.gpu,
                    "refuses only a higher clock" if point.gpu in refused else "accepts setpoints",
                )

    def _allowed_progress(self, node: str, result: ExchangeResponse) -> list[ProgressReport]:
        """The progress reports of ``result`` that count: sent by root or the job's owner (the
        agent relays any local user's, with the uid the kernel gave it), from the node of the
        job's that reported first. Slurm clusters share uids, so the job's user name maps to
        one here."""
        allowed: list[ProgressReport] = []
        for p in result.progress:
            job = self._known.get(p.job_id)
            if job is None:
                continue
            if node in job.nodes and p.uid in (0, self._uid(job.user)):
                if self._reporter.setdefault(p.job_id, node) == node:
                    allowed.append(p)
            elif (p.job_id, node, p.uid) not in self._spoof_logged:
                self._spoof_logged.add((p.job_id, node, p.uid))
                logger.warning(
                    "job %s: progress from uid %d on node %s ignored: only root or the job's "
                    "user %s on the job's node(s) may report it",
                    p.job_id,
                    p.uid,
                    node,
                    job.user,
                )
        return allowed

    def _uid(self, user: str) -> int | None:
        """The uid of ``user`` on this host (None: unknown here; then only root may report)."""
        if user not in self._uids:
            try:
                self._uids[user] = pwd.getpwnam(user).pw_uid
            except KeyError:
                logger.warning(
                    "user %s is unknown on the head: only root may report progress", user
                )
                self._uids[user] = None
        return self._uids[user]

    # -- 5. persist ----------------------------------------------------------------------------

    def _persist(
        self,
        k: int,
        now_s: float,
        budget_w: float | None,
        uncontrolled_w: float,
        decision: Decision | None,
        responses: Mapping[str, ExchangeResponse | NodeFailure],
        setpoints: Mapping[str, list[AgentSetpoint]],
    ) -> IntervalReport:
        jobs = self.running.jobs
        power_by_gpu = {
            GpuRef(name, r.index): power_w
            for name, node in self._nodes.items()
            for r in node.reports
            if (power_w := node.mean_w.get(r.index, r.power_w)) is not None
        }
        owner = {
            GpuRef(g.node, g.gpu_index): j.job_id for j in self._known.values() for g in j.gpus
        }
        trusted = self._trusted()
        try:
            with self.store.transaction() as connection:
                if self.leader is not None:
                    # the record commits only while the lock is this head's (the store's fence)
                    self.leader.confirm(within=connection)
                self._persist_nodes(responses, now_s)
                self._persist_progress(responses, trusted)
                if self._last_decision is not None:
                    decision_id, refs = self._last_decision
                    drawn = [power_by_gpu[g] for g in refs if g in power_by_gpu]
                    if drawn:
                        self.store.set_measured_power(decision_id, float(sum(drawn)))
                self._last_decision = None
                if decision is not None:
                    record = self.store.record_decision(
                        interval_index=k,
                        status=decision.status.value,
                        mode=self.settings.controller.mode,
                        price=decision.price,
                        budget_w=math.inf if budget_w is None else budget_w,
                        effective_budget_w=decision.effective_budget_w,
                        predicted_power_w=decision.predicted_power_w,
                        solve_s=decision.solve_s,
                        setpoints=[
                            StoredSetpoint(
                                j.job_id,
                                int(decision.graphics_mhz[i]),
                                int(decision.memory_mhz[i]),
                                float(decision.job_power_w[i]),
                            )
                            for i, j in enumerate(jobs)
                        ],
                        shadow=self.settings.shadow,
                        time_s=now_s,
                    )
                    self._last_decision = (record.id, tuple(g for j in jobs for g in j.gpus))
                    self.store.save_models(
                        ModelSnapshot.of([j.job_id for j in jobs], self.running.estimator),
                        at_s=now_s,
                    )
                self.store.record_measurements(
                    Measurement(
                        time_s=now_s,
                        node=ref.node,
                        gpu_index=ref.index,
                        power_w=power_w,
                        job_id=owner.get(ref),
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
        self._planned_reported_w = self._planned_w  # what this exchange's reports measured
        self._planned_w = (
            {}
            if decision is None
            else {j.job_id: float(decision.planned_power_w[i]) for i, j in enumerate(jobs)}
        )
        views = self._job_views(decision, power_by_gpu)
        reachable = sum(1 for n in self._nodes.values() if n.reachable is True)
        return IntervalReport(
            interval=k,
            time_s=now_s,
            budget_w=budget_w,
            effective_budget_w=None if decision is None else decision.effective_budget_w,
            uncontrolled_w=uncontrolled_w,
            predicted_power_w=None if decision is None else decision.predicted_power_w,
            measured_power_w=float(sum(power_by_gpu.values())),
            price=None if decision is None else decision.price,
            status="idle" if decision is None else decision.status.value,
            solve_s=0.0 if decision is None else decision.solve_s,
            shadow=self.settings.shadow,
            nodes_reachable=reachable,
            nodes_unreachable=sum(1 for n in self._nodes.values() if n.reachable is False),
            setpoints_sent=sum(len(v) for v in setpoints.values()),
            jobs=views,
            limited=self._other_limiters(),
        )

    def _other_limiters(self) -> tuple[str, ...]:
        """The GPUs held by something else than this head, from the last reports: an enforced
        power limit below the board's default that this head did not ask for, a power brake or
        a slowdown, or a refusal because another process holds the clocks."""
        out: list[str] = []
        margin = self.settings.power_limit_margin
        for name, node in sorted(self._nodes.items()):
            for r in node.reports:
                why: list[str] = []
                t = node.gpu_types.get(r.index)
                spec = self.specs.get(t) if t is not None else None
                enforced = r.enforced_limit_w
                if (
                    spec is not None
                    and enforced is not None
                    and enforced < spec.power_limit.default_w - 1.0
                    and not (margin > 0 and r.job_id is not None)  # our rail's, when it is on
                ):
                    why.append(
                        f"enforced power limit {enforced:.0f} W, below its default "
                        f"{spec.power_limit.default_w:.0f} W"
                    )
                throttle = ThrottleReason(r.throttle or 0)
                for reason, text in _LIMITER_REASONS:
                    if reason in throttle:
                        why.append(text)
                if r.index in node.foreign:
                    why.append("another process holds its clocks")
                if why:
                    out.append(f"{name}:{r.index}: {', '.join(why)}")
        return tuple(out)

    def _persist_nodes(
        self, responses: Mapping[str, ExchangeResponse | NodeFailure], now_s: float
    ) -> None:
        for name, result in responses.items():
            node = self._nodes[name]
            if isinstance(result, NodeFailure):
                self.store.mark_node(name, False, at_s=now_s)
                continue
            gpu_type, worst_w = self._describe(name, result.gpus)
            if gpu_type != node.gpu_type or worst_w != node.worst_case_w:
                node.gpu_type = gpu_type or node.gpu_type
                node.worst_case_w = worst_w
                self.store.upsert_node(
                    name,
                    node.url,
                    gpu_count=len(result.gpus),
                    gpu_type=node.gpu_type or "",
                    worst_case_power_w=worst_w,
                    last_seen_s=now_s,
                )
                logger.info(
                    "node %s: %d GPU(s) of type %s, worst case %.0f W",
                    name,
                    len(result.gpus),
                    node.gpu_type,
                    worst_w,
                )
            else:
                self.store.mark_node(name, True, at_s=now_s)

    def _describe(self, name: str, gpus: Sequence[GpuReport]) -> tuple[str | None, float]:
        """A node's GPU type (when all its GPUs share one) and worst-case power: each GPU at
        its board's largest power limit."""
        node = self._nodes[name]
        types = {node.gpu_types.get(r.index) for r in gpus}
        gpu_type = types.pop() if len(types) == 1 else None
        worst_w = 0.0
        for r in gpus:
            t = node.gpu_types.get(r.index)
            worst_w += self.specs[t].power_limit.max_w if t in self.specs else self._limit_w(r.name)
        return gpu_type, worst_w

    def _learn_boards(self, name: str, node: _NodeState, result: ExchangeResponse) -> None:
        """Each GPU's type from its board: described by the agent (its clocks and limits, the
        catalog's priors or a generic one), else the catalog's entry for its name. A board not
        known here is asked for at the next exchange; an agent that describes none (an older
        one) is never asked."""
        for board in result.boards:
            digest = board.digest()
            if digest not in self._board_types:
                spec = spec_from_board(board)
                self._board_types[digest] = spec.name
                if spec.name not in self.specs:
                    self._add_type(spec)
                    logger.info(
                        "GPU type %s: %s (%s, %d-%d MHz, power limit %g-%g W)",
                        spec.name,
                        "estimated prior" if spec.estimated else "catalog prior",
                        board.name,
                        spec.min_graphics_mhz,
                        spec.max_graphics_mhz,
                        spec.power_limit.min_w,
                        spec.power_limit.max_w,
                    )
        mig = {b.uuid: b.mig_mode for b in result.boards}
        types: dict[int, str | None] = {}
        why: dict[int, str] = {}
        unknown = False
        for r in result.gpus:
            gpu_type = None if r.board is None else self._board_types.get(r.board)
            if r.board is not None and gpu_type is None:
                unknown = True  # asked for at the next exchange
            if gpu_type is None:
                try:  # until described: the catalog's entry for its name, if it has one
                    gpu_type = catalog_spec(r.name).name
                except InputError:
                    why[r.index] = (
                        "board not described yet"
                        if r.board is not None
                        else f"board {r.name!r} is not in the catalog and not described"
                    )
            if mig.get(r.uuid, node.why.get(r.index) == _MIG):
                gpu_type, why[r.index] = None, _MIG
            types[r.index] = gpu_type
        if types != node.gpu_types or why != node.why:
            for index, reason in sorted(why.items()):
                if node.why.get(index) != reason:
                    logger.warning("node %s GPU %d: not controlled: %s", name, index, reason)
        node.gpu_types, node.why = types, why
        node.describe = unknown and not result.boards

    def _add_type(self, spec: GpuSpec) -> None:
        """A GPU type the catalog does not have: the grid grows by it (existing types keep
        their rows)."""
        self.specs[spec.name] = spec
        self.grid = _full_grid(self.specs)
        self.controller.use_grid(self.grid)
        self.running.grid = self.grid

    def gpu_type(self, ref: GpuRef) -> str | None:
        """The controller's type of a GPU (None: not known, or not controlled)."""
        node = self._nodes.get(ref.node)
        if node is None:
            return None
        if ref.index in node.gpu_types:
            return node.gpu_types[ref.index]
        return node.gpu_type  # not reported (yet): the node's one type, if it has one

    def gpu_views(self, name: str) -> list[dict[str, object]]:
        """Each GPU of a node as ``GET /v1/nodes`` shows it: board, type, controlled or why not."""
        node = self._nodes.get(name)
        if node is None:
            return []
        views: list[dict[str, object]] = []
        for r in node.reports:
            gpu_type = node.gpu_types.get(r.index)
            spec = None if gpu_type is None else self.specs.get(gpu_type)
            views.append(
                {
                    "index": r.index,
                    "board": r.name,
                    "type": gpu_type,
                    "estimated": spec is not None and spec.estimated,
                    "controlled": gpu_type is not None,
                    "why": node.why.get(r.index),
                }
            )
        return views

    def _persist_progress(
        self,
        responses: Mapping[str, ExchangeResponse | NodeFailure],
        trusted: Mapping[str, list[GpuSample]],
    ) -> None:
        for job_id in trusted:
            if job_id not in self._started and job_id in self._known:
                self._started.add(job_id)
                if self._known[job_id].state == "registered":
                    self.store.start_job(job_id)
        for name, result in responses.items():
            if isinstance(result, NodeFailure):
                continue
            for p in self._allowed_progress(name, result):
                if self._progress_done.get(p.job_id) != p.step:
                    self._progress_done[p.job_id] = p.step
                    self.store.record_progress(p.job_id, p.step, p.total)

    def _job_views(
        self, decision: Decision | None, power_by_gpu: Mapping[GpuRef, float]
    ) -> tuple[JobView, ...]:
        views: list[JobView] = []
        infos = self.running.jobs
        row = {j.job_id: i for i, j in enumerate(infos)}
        outlook = (
            None
            if decision is None or not infos
            else self.running.outlook(
                decision, self._clock(), self.settings.controller.work_from_time_limit
            )
        )
        for job_id, job in self._known.items():
            drawn = [
                power_by_gpu[GpuRef(g.node, g.gpu_index)]
                for g in job.gpus
                if GpuRef(g.node, g.gpu_index) in power_by_gpu
            ]
            measured = float(sum(drawn)) if drawn else None
            i = row.get(job_id)
            if decision is None or outlook is None or i is None:
                views.append(JobView(job_id, i is not None, measured_power_w=measured))
                continue
            views.append(
                JobView(
                    job_id,
                    True,
                    int(decision.graphics_mhz[i]),
                    int(decision.memory_mhz[i]),
                    float(decision.job_power_w[i]),
                    measured,
                    progress="reported" if self.running.reported(job_id) else "none",
                    left_top_s=_finite_or_none(float(outlook.left_top_s[i])),
                    finish_s=_finite_or_none(float(outlook.finish_s[i])),
                )
            )
        return tuple(views)
