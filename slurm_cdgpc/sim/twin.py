"""The head as a simulator policy (``simulate --engine head``): the digital twin (`HeadTwin`).

A `Policy`, not a `PlantPolicy`: it never reaches the plant, and it decides nothing itself. What
a report must hold to be trusted: DESIGN.md, "Models" (What a sample is); test:
`tests/unit/test_sim_twin.py`.
"""

from __future__ import annotations

import logging
import math
import tempfile
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Final, Self

import numpy as np
from sqlalchemy import Engine

from slurm_cdgpc.config import ControlConfig
from slurm_cdgpc.control.tuning import Tuning
from slurm_cdgpc.coordinator.daemon import Coordinator, CoordinatorSettings
from slurm_cdgpc.coordinator.report import IntervalReport
from slurm_cdgpc.gpu.catalog import GpuSpec
from slurm_cdgpc.gpu.device import ThrottleReason
from slurm_cdgpc.gpu.simulated import ManualClock
from slurm_cdgpc.sim.cluster import ClusterView, Policy, Setpoints
from slurm_cdgpc.sim.fleet import FleetSpec
from slurm_cdgpc.sim.fleet import node_name as fleet_node_name
from slurm_cdgpc.sim.sharing import TenantTimeErrors
from slurm_cdgpc.store import Store, make_engine, upgrade
from slurm_cdgpc.transport.http import NodeFailure, NodeTarget
from slurm_cdgpc.wire.board import BoardDescription
from slurm_cdgpc.wire.protocol import (
    ExchangeResponse,
    GpuReport,
    LockReport,
    ProgressReport,
    Refusal,
)

logger = logging.getLogger(__name__)

#: where the head's clock starts: the simulator's first interval maps here
EPOCH_S: Final = 1.7e9
#: the job's user: root may always report progress (uid 0)
USER: Final = "root"
ROOT_UID: Final = 0
#: measurements older than this many intervals are pruned (the head never reads them back)
RETENTION_INTERVALS: Final = 200


def node_name(node: int) -> str:
    """The head's name for the simulator's node ``node``: the fleet's (`fleet.node_name`), the
    names a topology file for the simulator refers to."""
    return fleet_node_name(node)


def job_name(row: int) -> str:
    """The head's job id for the trace's row ``row`` (a Slurm job id starts at 1)."""
    return str(row + 1)


#: a GPU's setpoint as applied: graphics MHz, memory MHz (None: not lockable), power limit W
#: (None: its default)
_Applied = tuple[int, int | None, float | None]


@dataclass(frozen=True)
class Reading:
    """What a GPU did over the interval that just ended (mean power, applied clocks)."""

    power_w: float
    sm_clock_mhz: int
    memory_clock_mhz: int
    throttle: int = 0


@dataclass
class _Gpu:
    """One simulated GPU as its agent keeps it: the lock in force and the energy counter."""

    uuid: str
    spec: GpuSpec
    locked: LockReport | None = None
    job_id: str | None = None
    energy_j: float = 0.0
    read_s: float | None = None
    #: the power limit the head set (None: the board's default)
    limit_w: float | None = None

    def board(self, mig: bool) -> BoardDescription:
        """Its board as its agent describes it (MIG mode on for a fleet in MIG mode)."""
        return BoardDescription(
            self.spec.name, self.uuid, self.spec.clocks, self.spec.power_limit, mig_mode=mig
        )


@dataclass
class ViewTransport:
    """The head's `NodeTransport` over the simulator: node ``n<k>`` is the fleet's node k.

    Before an exchange, the twin hands it the readings of the interval that just ended
    (`readings`, per (node, GPU index); GPUs without one read at their type's idle power) and
    the jobs' progress. Each exchange reads every GPU before it applies the request (energy
    counter advanced by the reading's power over the time since the last read), then applies the
    setpoints and releases, and keeps what it applied per GPU (`applied`): a shared GPU's
    tenants run at what their GPU holds, whichever tenant its setpoint named. With ``mig``
    every GPU's board says MIG mode, as an agent describes it when the head asks: no clock is
    locked, and a setpoint's power limit is what it applies.
    """

    clock: ManualClock
    gpus: dict[str, list[_Gpu]]
    readings: dict[tuple[str, int], Reading] = field(default_factory=dict)
    progress: dict[str, tuple[ProgressReport, ...]] = field(default_factory=dict)
    #: per (node, GPU index), the interval's setpoint (an emergency cut's over the plan's):
    #: graphics MHz, memory MHz (None: not lockable), power limit in W (None: the default)
    applied: dict[tuple[str, int], _Applied] = field(default_factory=dict)
    exchanges: int = 0
    mig: bool = False
    _lowest_mhz: dict[tuple[str, int | None], int] = field(default_factory=dict)
    _digests: dict[str, str] = field(default_factory=dict)  # per GPU type: its board's

    @classmethod
    def of(cls, fleet: FleetSpec, clock: ManualClock) -> ViewTransport:
        specs = fleet.specs
        gpus = {
            node_name(n): [_Gpu(f"GPU-twin-{n}-{i}", specs[int(kind)]) for i in range(int(count))]
            for n, (kind, count) in enumerate(zip(fleet.node_type, fleet.node_gpus, strict=True))
        }
        return cls(clock, gpus)

    def exchange(
        self, targets: Mapping[str, NodeTarget]
    ) -> dict[str, ExchangeResponse | NodeFailure]:
        now_s = self.clock()
        self.exchanges += 1
        applied: dict[tuple[str, int], _Applied] = {}
        out: dict[str, ExchangeResponse | NodeFailure] = {}
        for name, target in targets.items():
            gpus = self.gpus.get(name)
            if gpus is None:
                out[name] = NodeFailure("no such node in the fleet")
                continue
            reports = tuple(self._read(name, i, gpu, now_s) for i, gpu in enumerate(gpus))
            request = target.request
            refused: list[Refusal] = []
            for point in request.setpoints:
                gpu = gpus[point.gpu]
                if self.mig:  # its limit is the setpoint, and one without is refused
                    if point.power_limit_w is None:
                        refused.append(Refusal(point.gpu, "MIG mode is on: no power limit"))
                        continue
                    gpu.limit_w, gpu.job_id = point.power_limit_w, point.job_id
                    top = gpu.spec.max_graphics_mhz
                    applied.setdefault((name, point.gpu), (top, None, point.power_limit_w))
                    continue
                key = (gpu.spec.name, point.memory_mhz)
                if key not in self._lowest_mhz:  # the lowest clock at that memory, as agents lock
                    self._lowest_mhz[key] = min(gpu.spec.clocks.graphics_for(point.memory_mhz))
                gpu.locked = LockReport(self._lowest_mhz[key], point.graphics_mhz, point.memory_mhz)
                gpu.job_id = point.job_id
                applied.setdefault(
                    (name, point.gpu), (point.graphics_mhz, point.memory_mhz, point.power_limit_w)
                )
            for index in request.release:
                gpus[index].locked = None
                gpus[index].job_id = None
                gpus[index].limit_w = None
            out[name] = ExchangeResponse(
                node=name,
                time_s=now_s,
                gpus=reports,
                progress=self.progress.get(name, ()),
                refused=tuple(refused),
                boards=tuple(g.board(self.mig) for g in gpus) if request.describe else (),
            )
        self.applied.update(applied)  # an emergency cut's exchange after the interval's wins
        return out

    def _digest(self, gpu: _Gpu) -> str:
        """Its board's digest, computed once per type (a digest leaves UUID and MIG mode out)."""
        digest = self._digests.get(gpu.spec.name)
        if digest is None:
            digest = self._digests[gpu.spec.name] = gpu.board(self.mig).digest()
        return digest

    def _read(self, node: str, index: int, gpu: _Gpu, now_s: float) -> GpuReport:
        """The GPU as its agent reads it before applying an exchange: the interval behind it."""
        spec = gpu.spec
        reading = self.readings.get((node, index)) or Reading(
            spec.idle_power_w, spec.idle_graphics_mhz, spec.max_memory_mhz
        )
        if gpu.read_s is not None:
            gpu.energy_j += reading.power_w * (now_s - gpu.read_s)  # E += P̄·Δt
        gpu.read_s = now_s
        return GpuReport(
            index=index,
            uuid=gpu.uuid,
            name=spec.name,
            power_w=float(reading.power_w),
            energy_j=float(gpu.energy_j),
            sm_clock_mhz=reading.sm_clock_mhz,
            memory_clock_mhz=reading.memory_clock_mhz,
            # only a MIG GPU's setpoint sets a limit here (`exchange`)
            enforced_limit_w=float(
                spec.power_limit.default_w if gpu.limit_w is None else gpu.limit_w
            ),
            throttle=reading.throttle,
            locked=gpu.locked,
            job_id=gpu.job_id,
            error=None,
            read_s=now_s,
            board=self._digest(gpu) if self.mig else None,
        )


def _release(engine: Engine, directory: tempfile.TemporaryDirectory[str]) -> None:
    engine.dispose()
    directory.cleanup()


class HeadTwin(Policy):
    """cdgpc through the real head: registrations, the store, the exchange.

    It replays a trace through the real `Coordinator` (reconcile, measure, learn, solve,
    exchange, persist) over a SQLite store in a temporary directory, on a `ManualClock` that the
    simulator's interval moves. Each job registers as its Prolog would: deadline, total when it
    reports one, Slurm's time limit and its start. Its transport, `ViewTransport`, answers every
    node's exchange from the `ClusterView` as node agents do: readings taken before the exchange
    applies, energy counters, the lock in force, progress as root reports it (steps, and the
    total for a job that says it). Every clock the simulator applies is a setpoint the head sent.

    Call `close` (or use it as a context manager) when the replay is done: it disposes of the
    store and removes its directory; a twin that is dropped unclosed is cleaned up when collected.
    """

    name = "head"

    def __init__(self, directory: Path | None = None, control: ControlConfig | None = None) -> None:
        #: where the store's temporary directory is made (None: the system's default)
        self.directory = directory
        #: the ``[control]`` section the head runs with (None: the shipped one)
        self.control = control
        self.coordinator: Coordinator | None = None
        self.transport: ViewTransport | None = None
        #: the head's last interval (`Coordinator.run_interval`'s report)
        self.report: IntervalReport | None = None
        self.store_path: Path | None = None
        self._finalizer: (
            weakref.finalize[[Engine, tempfile.TemporaryDirectory[str]], HeadTwin] | None
        ) = None

    # -- lifetime ----------------------------------------------------------------------------

    def start(self, fleet: FleetSpec, budget_w: float, interval_s: float) -> None:
        self.close()
        workdir = tempfile.TemporaryDirectory(prefix="cdgpc-twin-", dir=self.directory)
        self.store_path = Path(workdir.name) / "head.db"
        engine = make_engine(f"sqlite:///{self.store_path}")
        self._finalizer = weakref.finalize(self, _release, engine, workdir)
        upgrade(engine)
        logger.debug("head twin: store %s", self.store_path)
        self.clock = ManualClock(EPOCH_S)
        self.offset_s = 0.0  # head time − simulator time, from the first interval on
        self._intervals = 0
        self.transport = ViewTransport.of(fleet, self.clock)
        tuning = Tuning.from_config(self.control or ControlConfig()).with_interval(interval_s)
        settings = CoordinatorSettings(
            interval_s=interval_s,
            lease_s=3 * interval_s,
            retention_s=RETENTION_INTERVALS * interval_s,
            initial_budget_w=budget_w,
            queue_stale_s=math.inf,  # the queue is observed every interval
            replan_gap_s=interval_s,  # `Coordinator.run` alone re-plans out of cycle: unused
            controller=tuning.controller,
            estimator=tuning.estimator,
        )
        self.coordinator = Coordinator(
            Store(engine, clock=self.clock),
            self.transport,
            settings,
            clock=self.clock,
            topology=fleet.topology,
        )
        self.coordinator.start()
        for n, kind in enumerate(fleet.node_type):
            name = node_name(n)
            self.coordinator.register_node(
                name, f"http://{name}.twin:8464", gpu_type=fleet.specs[int(kind)].name
            )
        self.budget_w = budget_w
        self.specs = fleet.specs
        self.report = None
        #: per view row: the GPU indices it holds on each node
        self._held: list[dict[int, tuple[int, ...]]] = []
        self._free: list[set[int]] = [set(range(int(g))) for g in fleet.node_gpus]
        #: the simulator's shared GPUs (`ClusterView.shared_gpu`): each one's node and index,
        #: and its tenants
        self._shared: dict[int, tuple[int, int]] = {}
        self._tenants: dict[int, int] = {}
        #: per view row: its total iterations as registered (None: it reports none)
        self._totals: list[int | None] = []
        self._rows: list[int] = []  # per view row: the trace's row
        self._shared_of: list[int] = []  # per view row: its shared GPU, −1: whole GPUs
        #: the head's time models against what the jobs measured (`_score_time_model`)
        self.time_errors = TenantTimeErrors()
        self._unscored: ClusterView | None = None

    def close(self) -> None:
        """Dispose of the store and remove its directory (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self.coordinator = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    # -- one interval ------------------------------------------------------------------------

    def decide(self, view: ClusterView) -> Setpoints:
        head, transport = self.coordinator, self.transport
        if head is None or transport is None:
            raise RuntimeError("HeadTwin.decide before start (or after close)")
        if not self._intervals:
            self.offset_s = EPOCH_S - view.now_s
        self._intervals += 1
        transport.mig = view.mig
        self._score_time_model(head, view)
        self.clock.advance(view.now_s + self.offset_s - self.clock())
        self._follow_jobs(head, view)
        if view.budget_w != self.budget_w:
            head.set_budget(view.budget_w, USER, reason="the simulator's budget")
            self.budget_w = view.budget_w
        head.observe_queue(view.queued_jobs > 0)
        transport.readings, transport.progress = self._readings(view)
        transport.applied = {}
        self.report = head.run_interval()
        return self._setpoints(view, transport.applied)

    def _score_time_model(self, head: Coordinator, view: ClusterView) -> None:
        """What the head's time models predicted for the interval it is about to learn from,
        against what the jobs measured (`TenantTimeErrors`, as the fast engine scores its
        own), on traces whose jobs share GPUs. The head learns from the exchange before this
        one, which carried the last view's measurements: those are scored, one view late."""
        last = self._unscored
        self._unscored = view if view.shared_gpu is not None else None
        if last is None:
            return
        ran = len(last) - last.started
        index = {job.job_id: row for row, job in enumerate(head.running.jobs)}
        rows = np.array(
            [index.get(job_name(int(r)), -1) for r in last.job_id[:ran].tolist()], dtype=np.int64
        )
        self.time_errors.score(head.running.estimator, last, rows, head.controller.interference)

    def _follow_jobs(self, head: Coordinator, view: ClusterView) -> None:
        """Deregister the jobs that left and register the ones that started (the Epilog and
        the Prolog), keeping each row's GPU indices: a job takes its node's lowest free ones."""
        for gone in np.flatnonzero(~view.kept).tolist():
            head.deregister_job(job_name(self._rows[gone]))
            gpu = self._shared_of[gone]
            if gpu >= 0:  # a tenant: its GPU is free once its last tenant has gone
                self._tenants[gpu] -= 1
                if self._tenants[gpu]:
                    continue
                del self._tenants[gpu]
                self._shared.pop(gpu)
            for node, indices in self._held[gone].items():
                self._free[node].update(indices)
        kept = [bool(k) for k in view.kept]
        self._held = [h for h, keep in zip(self._held, kept, strict=True) if keep]
        self._totals = [t for t, keep in zip(self._totals, kept, strict=True) if keep]
        shared = view.shared_gpu if view.shared_gpu is not None else np.full(len(view), -1)
        for row in range(len(view) - view.started, len(view)):
            held: dict[int, tuple[int, ...]] = {}
            deadline_s = float(view.deadline_s[row])
            limit_s = float(view.time_limit_s[row])
            total = float(view.iterations[row])
            iterations = math.ceil(total) if math.isfinite(total) and total > 0 else None
            gpu = int(shared[row])
            for n in np.flatnonzero(view.job_nodes[row]).tolist():
                if gpu >= 0 and gpu in self._shared:  # a tenant: its GPU's index, as Slurm
                    take = [self._shared[gpu][1]]  # names one shard's GPU in both Prologs
                else:
                    take = sorted(self._free[n])[: int(view.job_nodes[row, n])]
                    self._free[n].difference_update(take)
                    if gpu >= 0:
                        self._shared[gpu] = (n, take[0])
                if gpu >= 0:
                    self._tenants[gpu] = self._tenants.get(gpu, 0) + 1
                held[n] = tuple(take)
                head.register_job(
                    job_name(int(view.job_id[row])),
                    USER,
                    node_name(n),
                    take,
                    gpu_type=self.specs[int(view.node_type[n])].name,
                    deadline_s=deadline_s + self.offset_s if math.isfinite(deadline_s) else None,
                    iterations_total=iterations,
                    time_limit_s=limit_s if math.isfinite(limit_s) else None,
                    started_at_s=float(view.start_s[row]) + self.offset_s,
                    job_name=None if view.job_name is None else str(view.job_name[row]) or None,
                )
            self._held.append(held)
            self._totals.append(iterations)
        self._rows = [int(j) for j in view.job_id]
        self._shared_of = [int(g) for g in shared]

    def _readings(
        self, view: ClusterView
    ) -> tuple[dict[tuple[str, int], Reading], dict[str, tuple[ProgressReport, ...]]]:
        """Per GPU, the last interval's reading of the job that ran on it (jobs that started
        this interval have none: their GPUs read idle); per node, the progress root reports."""
        readings: dict[tuple[str, int], Reading] = {}
        progress: dict[str, list[ProgressReport]] = {}
        now_s = self.clock()
        for row, held in enumerate(self._held):
            power_w = float(view.power_w[row])
            if math.isfinite(power_w):
                reading = Reading(
                    power_w,
                    round(float(view.graphics_mhz[row])),
                    round(float(view.memory_mhz[row])),
                    int(ThrottleReason.SW_POWER_CAP) if view.power_capped[row] else 0,
                )
                for node, indices in held.items():
                    for index in indices:
                        readings[(node_name(node), index)] = reading
            total, remaining = self._totals[row], float(view.remaining_iterations[row])
            done = float(view.iterations_done[row])
            if total is not None and math.isfinite(remaining):
                # iterations done so far, whole ones: total − ⌈R⌉
                step = min(max(total - math.ceil(remaining - 1e-9), 0), total)
            elif math.isfinite(done):  # steps without a total (the automatic hook)
                step = max(math.floor(done + 1e-9), 0)
            else:
                continue
            if held:
                first = node_name(min(held))
                progress.setdefault(first, []).append(
                    ProgressReport(job_name(int(view.job_id[row])), step, total, now_s, ROOT_UID)
                )
        return readings, {node: tuple(p) for node, p in progress.items()}

    def _setpoints(
        self, view: ClusterView, applied: Mapping[tuple[str, int], _Applied]
    ) -> Setpoints:
        """Per view row, what the head set on its GPUs (the slowest's, which paces it, and the
        lowest power limit); a job whose GPUs got none (not controlled yet) runs at its top
        clock and default limit (NaN)."""
        n = len(view)
        graphics = np.full(n, np.nan)
        limit = np.full(n, np.nan)
        memory = np.array([float(self.specs[int(t)].max_memory_mhz) for t in view.job_type])
        for row, held in enumerate(self._held):
            points = [
                point
                for node, indices in held.items()
                for index in indices
                if (point := applied.get((node_name(node), index))) is not None
            ]
            if not points:
                continue
            point = min(points, key=lambda p: p[0])
            graphics[row] = point[0]
            if point[1] is not None:
                memory[row] = point[1]
            limits = [p[2] for p in points if p[2] is not None]
            if limits:
                limit[row] = min(limits)
        return Setpoints(
            graphics_mhz=graphics,
            memory_mhz=memory,
            limit_w=limit if np.isfinite(limit).any() else None,
        )
