"""What the head asked of the GPUs' locks and is not done yet (`GpuLocks`): releases, and refused
setpoints, each kept until the agent reports it done. It reads the store, never writes it.
Rules: DESIGN.md, "Safety" (the rows on refused clocks, releases and jobs that end); test:
`tests/unit/test_coordinator_daemon.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from types import MappingProxyType

import numpy as np

from slurm_cdgpc.control.discrete import ClockGrid
from slurm_cdgpc.coordinator.jobs import GpuRef, NodeSetpoint
from slurm_cdgpc.coordinator.nodes import NodeBook
from slurm_cdgpc.gpu.catalog import GpuSpec
from slurm_cdgpc.store import Job, JobGpu, Store
from slurm_cdgpc.wire.protocol import ExchangeRequest, ExchangeResponse
from slurm_cdgpc.wire.protocol import Setpoint as AgentSetpoint

logger = logging.getLogger(__name__)


class GpuLocks:
    """Releases queued and done, and the GPUs refusing their setpoint (the loop's thread)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._releases: dict[str, set[int]] = {}
        #: released GPUs -> the exchange that released them: at default clocks from then on, they
        #: count at their limit until a reading taken after it arrives (a job may start at once)
        self._released: dict[GpuRef, int] = {}
        #: GPUs that refused a setpoint below the clock they hold, with that setpoint: their job
        #: is out of the optimisation, and the setpoint is sent again, until one is accepted
        self._refusing: dict[GpuRef, AgentSetpoint] = {}
        self._squeezed: set[str] = set()  # held-out jobs sent to their lowest clock (logged)

    @property
    def refusing(self) -> Mapping[GpuRef, AgentSetpoint]:
        """The GPUs that refuse a setpoint below the clock they hold, with that setpoint."""
        return MappingProxyType(self._refusing)

    @property
    def released(self) -> Mapping[GpuRef, int]:
        """Released GPUs not read since (counted at their limit), with the releasing exchange."""
        return MappingProxyType(self._released)

    @property
    def squeezed(self) -> frozenset[str]:
        """Held-out jobs sent to their lowest clock (each said once)."""
        return frozenset(self._squeezed)

    # -- 1. reconcile ----------------------------------------------------------------------------

    def release(self, gpus: Iterable[JobGpu]) -> None:
        """Queue the release of a finished job's GPUs, at the next exchange."""
        for g in gpus:
            self._releases.setdefault(g.node, set()).add(g.gpu_index)

    def cancel_release(self, refs: Iterable[GpuRef]) -> None:
        """GPUs that get a setpoint: not released."""
        for ref in refs:
            self._releases.get(ref.node, set()).discard(ref.index)

    def keep(self, active: Collection[str]) -> set[str]:
        """Forget the refusals of jobs no longer ``active``; returns the jobs held out of the
        optimisation because one of their GPUs refuses its setpoint."""
        self._refusing = {g: p for g, p in self._refusing.items() if p.job_id in active}
        held_out = {p.job_id for p in self._refusing.values()}
        self._squeezed &= held_out
        return held_out

    # -- 3. solve --------------------------------------------------------------------------------

    def releasing(self, nodes: NodeBook) -> set[GpuRef]:
        """GPUs to count at their limit: queued for release, or released and not read since."""
        self._released = {
            ref: k
            for ref, k in self._released.items()
            if ref.node in nodes and nodes[ref.node].reports_at <= k
        }
        releasing = {GpuRef(n, g) for n, gpus in self._releases.items() for g in gpus}
        return releasing | set(self._released)

    def lowest(
        self,
        job_ids: Collection[str],
        known: Mapping[str, Job],
        gpu_type: Callable[[GpuRef], str | None],
        grid: ClockGrid,
        specs: Mapping[str, GpuSpec],
        limit_only: Callable[[GpuRef], bool] | None = None,
    ) -> dict[GpuRef, AgentSetpoint]:
        """Setpoints at the controller's lowest clock for every GPU of ``job_ids``, held out
        while the budget does not fit: the GPUs that accept it shed what the refusing one keeps
        drawing, and the refusing one is asked for that clock from then on. Nothing raises
        them again until the job rejoins the plan."""
        out: dict[GpuRef, AgentSetpoint] = {}
        for job_id in sorted(job_ids):
            job = known.get(job_id)
            if job is None:
                continue
            if job_id not in self._squeezed:
                self._squeezed.add(job_id)
                logger.warning(
                    "job %s: the budget does not fit while one of its GPUs refuses its "
                    "setpoint: its GPUs go to their lowest clock",
                    job_id,
                )
            refs = [GpuRef(g.node, g.gpu_index) for g in job.gpus]
            out.update(lowest_setpoints(job_id, refs, gpu_type, grid, specs, limit_only))
        return out

    def setpoints(
        self,
        planned: Mapping[str, Sequence[NodeSetpoint]],
        held_out: Collection[str],
        lowest: Mapping[GpuRef, AgentSetpoint],
    ) -> dict[str, list[AgentSetpoint]]:
        """Per node, the plan's setpoints, then the refused setpoints of ``held_out`` jobs again
        (the only way to learn that a GPU accepts them) but where ``lowest`` replaces them,
        then ``lowest``; a GPU shared by a planned and a held-out job keeps the last of them."""
        by_gpu: dict[str, dict[int, AgentSetpoint]] = {
            node: {
                p.gpu: AgentSetpoint(
                    p.gpu, p.job_id, p.graphics_mhz, p.memory_mhz, p.power_limit_w, p.tenants
                )
                for p in points
            }
            for node, points in planned.items()
        }
        for ref, point in sorted(self._refusing.items()):
            if point.job_id in held_out and ref not in lowest:
                by_gpu.setdefault(ref.node, {})[ref.index] = point
        for ref, point in sorted(lowest.items()):
            by_gpu.setdefault(ref.node, {})[ref.index] = point
        return {node: list(points.values()) for node, points in by_gpu.items()}

    # -- 4. exchange -----------------------------------------------------------------------------

    def releases(self, node: str) -> frozenset[int]:
        """The GPUs of ``node`` whose release is queued."""
        return frozenset(self._releases.get(node, ()))

    def answered(
        self,
        name: str,
        sent: ExchangeRequest,
        result: ExchangeResponse,
        known: Mapping[str, Job],
        held: Collection[int],
        left_alone: Collection[int] = (),
        limit_only: Collection[int] = (),
    ) -> None:
        """What node ``name`` did of ``sent``: releases done or refused, setpoints refused, and
        locks held for a finished job (``held``: its GPUs that ``known`` jobs hold) or on a GPU
        the head leaves alone (``left_alone``, `NodeBook.left_alone`). A clock sent to a GPU
        now known to be in MIG mode (``limit_only``) before its board was described is not a
        refusal to keep: its next setpoint is a power limit."""
        self._track_refusals(name, sent, result, limit_only)
        self._release_orphans(name, sent, result, known, held)
        self._release_left_alone(name, sent, result, left_alone)
        for refusal in result.refused:
            job = next((p.job_id for p in sent.setpoints if p.gpu == refusal.gpu), "-")
            logger.warning(
                "job %s: node %s refused GPU %d: %s", job, name, refusal.gpu, refusal.reason
            )

    def _release_orphans(
        self,
        name: str,
        sent: ExchangeRequest,
        result: ExchangeResponse,
        known: Mapping[str, Job],
        held: Collection[int],
    ) -> None:
        """Release a GPU the agent still holds for a job the store has finished: its release
        was lost (the head died before sending it, or the job came and went while the head was
        away), and no one else would ever lift that lock. A job the store does not know is left
        alone: its Prolog may hold its GPUs while its registration is on its way."""
        for r in result.gpus:
            if r.job_id is None or r.index in held:  # a MIG GPU's is a limit, not a lock
                continue
            if r.job_id in known or r.index in sent.release:  # read before it applied
                continue
            if r.index in self._releases.get(name, set()):
                continue
            job = self._store.job(r.job_id)
            if job is not None and job.state == "finished":
                logger.info(
                    "node %s: GPU %d still held for job %s, which has ended: released",
                    name,
                    r.index,
                    r.job_id,
                )
                self._releases.setdefault(name, set()).add(r.index)

    def _release_left_alone(
        self,
        name: str,
        sent: ExchangeRequest,
        result: ExchangeResponse,
        left_alone: Collection[int],
    ) -> None:
        """Release a lock on a GPU the head does not control: a Prolog's hold, or a setpoint
        sent before its board was described as one the head leaves alone (MIG mode). No plan
        would ever move it, and the GPU is counted at what it draws; held, its jobs would run
        at that clock for as long as they run."""
        for r in result.gpus:
            if r.locked is None or r.index not in left_alone:
                continue
            if r.index in sent.release or r.index in self._releases.get(name, set()):
                continue
            logger.info("node %s: GPU %d is not controlled: its lock is released", name, r.index)
            self._releases.setdefault(name, set()).add(r.index)

    def _track_refusals(
        self,
        name: str,
        sent: ExchangeRequest,
        result: ExchangeResponse,
        limit_only: Collection[int] = (),
    ) -> None:
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
            unlimited = point.gpu in limit_only and point.power_limit_w is None
            if point.gpu in refused and above and not unlimited:
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


def lowest_setpoints(
    job_id: str,
    refs: Iterable[GpuRef],
    gpu_type: Callable[[GpuRef], str | None],
    grid: ClockGrid,
    specs: Mapping[str, GpuSpec],
    limit_only: Callable[[GpuRef], bool] | None = None,
) -> dict[GpuRef, AgentSetpoint]:
    """Setpoints at the controller's lowest clocks for ``job_id`` on ``refs``; a GPU of a type
    not known (never controlled) gets none, one whose clocks cannot be locked (``limit_only``:
    MIG mode) its board's lowest power limit."""
    out: dict[GpuRef, AgentSetpoint] = {}
    for ref in refs:
        t = gpu_type(ref)
        if t is None or t not in specs:
            continue
        g_lo, m_lo = grid.bottom_mhz(np.array([grid.type_index(t)]))
        memory = int(m_lo[0]) if specs[t].memory_lockable else None
        limit_w = specs[t].power_limit.min_w if limit_only is not None and limit_only(ref) else None
        out[ref] = AgentSetpoint(ref.index, job_id, int(g_lo[0]), memory, limit_w)
    return out
