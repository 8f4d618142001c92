"""The jobs the head plans for (`Roster`): the store's active jobs at the last reconcile, and which
of them the controller holds a row for (`RunningJobs`), since which interval. It reads the
store's models and writes only that a job runs (`Roster.mark_started`). Rules: DESIGN.md,
"Safety" and "Boards"; test: `tests/unit/test_coordinator_daemon.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from types import MappingProxyType

import numpy as np

from slurm_cdgpc.control.empc import EconomicMPC, QueueState
from slurm_cdgpc.coordinator.jobs import GpuRef, JobInfo, RunningJobs
from slurm_cdgpc.coordinator.nodes import NodeBook
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.kind_prior import job_kind
from slurm_cdgpc.store import Job, Store

logger = logging.getLogger(__name__)


class Roster:
    """Active jobs by id, their GPUs, and the interval each controlled one joined.

    A job joins the controller once its nodes answer and its GPUs' type is known, taking back
    its stored model, and leaves when it ends, a node of its is away, its GPUs change or one of
    them refuses its setpoint.
    """

    def __init__(
        self, store: Store, running: RunningJobs, controller: EconomicMPC, family: str
    ) -> None:
        self._store = store
        self._running = running
        self._controller = controller
        self._family = family  # of the estimator's power models: the stored ones it restores
        self._known: dict[str, Job] = {}  # active jobs at the last reconcile
        self._holders: dict[GpuRef, str] = {}  # their GPUs -> the job holding each
        self._held_on: dict[str, set[int]] = {}  # per node, the GPU indices they hold
        self._added_at: dict[str, int] = {}  # job -> interval it joined the controller
        self._started: set[str] = set()  # jobs marked running in the store
        self._waiting_logged: set[str] = set()

    @property
    def known(self) -> Mapping[str, Job]:
        """The active jobs at the last reconcile, by id."""
        return MappingProxyType(self._known)

    @property
    def holders(self) -> Mapping[GpuRef, str]:
        """Every GPU of an active job, and the job that holds it."""
        return MappingProxyType(self._holders)

    @property
    def waiting_logged(self) -> frozenset[str]:
        """Active jobs said to wait (once each) for their nodes or GPU type."""
        return frozenset(self._waiting_logged)

    def held_on(self, node: str) -> Collection[int]:
        """The GPU indices of ``node`` that active jobs hold."""
        return self._held_on.get(node, set())

    def joined_at(self, job_id: str) -> int | None:
        """The interval a controlled job joined the controller (None: not controlled)."""
        return self._added_at.get(job_id)

    def owners(self, before: int) -> dict[GpuRef, tuple[str, ...]]:
        """The GPUs of controlled jobs that joined before interval ``before``, and their jobs
        (its tenants, where jobs share a GPU)."""
        out: dict[GpuRef, tuple[str, ...]] = {}
        for j in self._running.jobs:
            if self._added_at.get(j.job_id, before) < before:
                for g in j.gpus:
                    out[g] = (*out.get(g, ()), j.job_id)
        return out

    def queue(self, nodes: NodeBook) -> QueueState:
        """The drain's input while jobs wait in Slurm: the controlled jobs' nodes (rows of
        ``nodes``' order) and each node's free GPUs."""
        index = {name: i for i, name in enumerate(nodes)}
        rows, placed_on = [], []
        for row, info in enumerate(self._running.jobs):
            for name in sorted({g.node for g in info.gpus}):
                rows.append(row)
                placed_on.append(index.get(name, -1))
        free = np.array(nodes.free_gpus(self._holders.keys()), dtype=np.int64)
        placed = np.array(placed_on, dtype=np.int64) >= 0
        return QueueState(
            True,
            np.array(rows, dtype=np.int64)[placed],
            np.array(placed_on, dtype=np.int64)[placed],
            free,
        )

    # -- 1. reconcile ----------------------------------------------------------------------------

    def refresh(self, active: Sequence[Job]) -> list[Job]:
        """The store's active jobs now; returns the ones that finished since the last call."""
        by_id = {j.job_id: j for j in active}
        finished = [old for job_id, old in self._known.items() if job_id not in by_id]
        for old in finished:
            self._started.discard(old.job_id)
        self._known = by_id
        self._holders = {
            GpuRef(g.node, g.gpu_index): j.job_id for j in by_id.values() for g in j.gpus
        }
        self._held_on = {}
        for ref in self._holders:
            self._held_on.setdefault(ref.node, set()).add(ref.index)
        self._waiting_logged &= by_id.keys()
        return finished

    def plan(self, k: int, held_out: Collection[str], nodes: NodeBook) -> list[JobInfo]:
        """Bring the controller's rows in line with the active jobs at interval ``k``: jobs
        that cannot be controlled (see `_job_info`) leave, jobs that can join (with their
        stored models). Returns the jobs that joined."""
        wanted: dict[str, JobInfo] = {}
        for job in self._known.values():
            info = self._job_info(job, held_out, nodes)
            if info is not None:
                wanted[job.job_id] = info
        running = self._running
        current = {j.job_id: j for j in running.jobs}
        leave = [
            j
            for j, info in current.items()
            if j not in wanted or wanted[j].placement != info.placement
        ]
        running.update(
            info
            for j, info in wanted.items()
            if j in current and j not in leave and current[j] != info
        )
        self._controller.jobs_ended(*running.work(j for j in leave if j not in self._known))
        for info in running.remove(leave):
            self._added_at.pop(info.job_id, None)
            if info.job_id not in self._known:
                reason = "finished"
            elif info.job_id in held_out:
                reason = "a GPU refused its setpoint; counted at its reported power"
            else:
                reason = "node unreachable or GPUs changed"
            logger.info("job %s: leaves the controller (%s)", info.job_id, reason)
        joining = [info for j, info in wanted.items() if j not in running]
        joined: list[JobInfo] = []
        for info in joining:
            try:
                running.add([info])
            except InputError as e:
                logger.warning("job %s: not controlled: %s", info.job_id, e)
                continue
            self._added_at[info.job_id] = k
            joined.append(info)
        if joined:
            self._restore_models([info.job_id for info in joined])
        return joined

    def _job_info(self, job: Job, held_out: Collection[str], nodes: NodeBook) -> JobInfo | None:
        """The job as the controller takes it; None while it cannot be controlled (a node away
        or of unknown type, a GPU in ``held_out`` refusing its setpoint)."""
        states = [nodes.get(n) for n in job.nodes]
        if any(n is not None and n.reachable is False for n in states):
            return None
        if job.job_id in held_out:
            return None
        refs = [GpuRef(g.node, g.gpu_index) for g in job.gpus]
        types = {nodes.gpu_type(ref) for ref in refs}
        if None in types or not types or any(n is None for n in states):
            if job.job_id not in self._waiting_logged:
                self._waiting_logged.add(job.job_id)
                why = sorted(
                    {n.why.get(r.index, "") for r in refs if (n := nodes.get(r.node))} - {""}
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
            objective_s=job.slo_latency_s,
            kind=None if job.job_name is None else job_kind(job.user, job.job_name, gpu_type),
        )

    def _restore_models(self, job_ids: list[str]) -> None:
        """Copy stored models into the rows of jobs that just joined (restart, node back)."""
        snapshot = self._store.load_models(self._family, job_ids)
        if not len(snapshot):
            return
        rows = {j.job_id: i for i, j in enumerate(self._running.jobs)}
        self._running.estimator.restore(
            snapshot.power, snapshot.time, [rows[j] for j in snapshot.job_ids]
        )
        logger.info("restored the models of job(s) %s", ", ".join(snapshot.job_ids))

    # -- 5. persist ------------------------------------------------------------------------------

    def mark_started(self, measured: Iterable[str]) -> None:
        """Jobs measured under their setpoint run: the store says so (once)."""
        for job_id in measured:
            if job_id not in self._started and job_id in self._known:
                self._started.add(job_id)
                if self._known[job_id].state == "registered":
                    self._store.start_job(job_id)
