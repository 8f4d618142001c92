"""The head's book of nodes (`NodeBook`): each node's agent, its last answer, and the type of each
of its GPUs. Only `NodeBook.persist` writes the store; no decisions and no sockets here. Rules:
DESIGN.md, "Models" (What a sample is: `interval_power`) and "Boards"; tests:
`tests/unit/test_coordinator_daemon.py`, `tests/unit/test_coordinator_boards.py`.
"""

from __future__ import annotations

import logging
from collections.abc import (
    Callable,
    Collection,
    ItemsView,
    Iterable,
    Iterator,
    KeysView,
    Mapping,
    Sequence,
    ValuesView,
)
from dataclasses import dataclass, field
from typing import Final

from slurm_cdgpc.coordinator.jobs import GpuRef, GpuSample
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.gpu.board import spec_from_board
from slurm_cdgpc.gpu.catalog import CATALOG, GpuSpec, catalog_spec
from slurm_cdgpc.gpu.device import ThrottleReason
from slurm_cdgpc.store import Node, Store
from slurm_cdgpc.transport.http import NodeFailure, NodeTarget
from slurm_cdgpc.wire.protocol import ExchangeRequest, ExchangeResponse, GpuReport, ProtocolError
from slurm_cdgpc.wire.protocol import Setpoint as AgentSetpoint

logger = logging.getLogger(__name__)

#: Slurm lists each MIG instance as a GRES record of its own, and a whole GPU's index in the
#: Prolog is its record's position: beside a MIG GPU it need not be the GPU's NVML index
_MIG_NODE: Final = (
    "another GPU here is in MIG mode: Slurm's GPU indices on this node are positions in its "
    "GRES list, not NVML's (counted at what it draws)"
)
_NOT_DESCRIBED: Final = "board not described yet"
#: a MIG GPU's enforced limit within this of its setpoint's held it (NVML takes milliwatts)
_LIMIT_TOLERANCE_W: Final = 1.0
#: throttle reasons that only another limiter (the board, the BMC, the rack) causes
_LIMITER_REASONS: Final = (
    (ThrottleReason.HW_POWER_BRAKE, "power brake (an external power-brake signal)"),
    (ThrottleReason.HW_SLOWDOWN, "hardware slowdown (thermal or power)"),
    (ThrottleReason.HW_THERMAL, "hardware thermal slowdown"),
    (ThrottleReason.SW_THERMAL, "software thermal slowdown"),
)


def catalog_max_w() -> float:
    """The largest maximum power limit of the catalog: a GPU of unknown type may be any."""
    return max(s.power_limit.max_w for s in CATALOG.values())


@dataclass
class NodeState:
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
    #: GPUs in MIG mode (as last described): controlled through their power limit, whole-GPU,
    #: since their clocks cannot be locked; the jobs on their instances are their tenants
    mig: frozenset[int] = frozenset()
    #: ask the agent for its boards at the next exchange (a GPU reported one not known here)
    describe: bool = False
    #: GPUs whose setpoint the agent refused because another process holds their clocks
    foreign: frozenset[int] = frozenset()


def interval_power(
    node: NodeState,
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
        if point is not None and r.index in node.mig:  # its setpoint is a power limit
            held = (
                r.locked is None
                and r.job_id == point.job_id
                and point.power_limit_w is not None
                and r.enforced_limit_w is not None
                and abs(r.enforced_limit_w - point.power_limit_w) <= _LIMIT_TOLERANCE_W
            )
        elif point is not None:
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


class NodeBook(Mapping[str, NodeState]):
    """Every known node by name, in the order it became known (the loop's thread; the API's
    threads only read `gpu_views`)."""

    def __init__(self, specs: dict[str, GpuSpec], add_type: Callable[[GpuSpec], None]) -> None:
        #: the controller's GPU types, shared with the loop; ``add_type`` adds a described one
        self.specs = specs
        self._add_type = add_type
        self._nodes: dict[str, NodeState] = {}
        #: board digest -> the type it maps to (`spec_from_board`)
        self._board_types: dict[str, str] = {}

    def __getitem__(self, name: str) -> NodeState:
        return self._nodes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def keys(self) -> KeysView[str]:
        return self._nodes.keys()

    def values(self) -> ValuesView[NodeState]:
        return self._nodes.values()

    def items(self) -> ItemsView[str, NodeState]:
        return self._nodes.items()

    def load(self, nodes: Iterable[Node]) -> None:
        """Nodes as the store holds them: new ones join, known ones take their URL (and a GPU
        type, while they have none)."""
        for node in nodes:
            state = self._nodes.get(node.name)
            gpu_type = node.gpu_type or None
            if state is None:
                self._nodes[node.name] = NodeState(
                    node.url, gpu_type, node.worst_case_power_w, answered_s=node.last_seen_s
                )
            else:
                state.url = node.url
                state.gpu_type = state.gpu_type or gpu_type

    # -- what the GPUs are ---------------------------------------------------------------------

    def gpu_type(self, ref: GpuRef) -> str | None:
        """The controller's type of a GPU (None: not known, or not controlled)."""
        node = self._nodes.get(ref.node)
        if node is None:
            return None
        if ref.index in node.gpu_types:
            return node.gpu_types[ref.index]
        return node.gpu_type  # not reported (yet): the node's one type, if it has one

    def limit_w(self, gpu_name: str) -> float:
        """The maximum power limit of a board by its name (the largest known, if unknown)."""
        try:
            return catalog_spec(gpu_name).power_limit.max_w
        except InputError:
            return max(s.power_limit.max_w for s in self.specs.values())

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
                    # what the head sets: a MIG GPU's clocks cannot be locked
                    "lever": None
                    if gpu_type is None
                    else "power limit"
                    if r.index in node.mig
                    else "clocks",
                }
            )
        return views

    # -- an exchange ---------------------------------------------------------------------------

    def requests(
        self,
        k: int,
        lease_s: float,
        epoch: int,
        setpoints: Mapping[str, Sequence[AgentSetpoint]],
        releases: Callable[[str], frozenset[int]] | None,
    ) -> tuple[dict[str, NodeTarget], int]:
        """Exchange ``k``'s request to each node, naming it: its setpoints, the releases queued
        for its other GPUs (none without ``releases``: shadow mode), a lease until ``lease_s``.
        Returns them, and how many nodes no request could be built for (no agent could take
        one: they count as unreachable)."""
        targets: dict[str, NodeTarget] = {}
        for name, node in self._nodes.items():
            points = tuple(setpoints.get(name, ()))
            taken = {p.gpu for p in points}
            release = () if releases is None else tuple(sorted(releases(name) - taken))
            try:
                request = ExchangeRequest(
                    k, lease_s, points, release, epoch=epoch, node=name, describe=node.describe
                )
            except ProtocolError as e:  # no agent could take it: counted as unreachable
                logger.error("node %s: no exchange possible: %s", name, e)
                continue
            targets[name] = NodeTarget(node.url, request)
        return targets, len(self._nodes) - len(targets)

    def lost(self, name: str, reason: str) -> None:
        """The exchange with ``name`` failed: it is unreachable, and its reports are gone."""
        node = self._nodes[name]
        if node.reachable is not False:
            logger.warning("node %s: unreachable: %s", name, reason)
        node.reachable = False
        node.reports = ()
        node.steady, node.mean_w = frozenset(), {}

    def answered(
        self,
        name: str,
        sent: ExchangeRequest,
        result: ExchangeResponse,
        now_s: float,
        lease_s: float,
    ) -> bool:
        """``name`` answered ``sent``; True if its last lease ran out before this exchange."""
        node = self._nodes[name]
        if node.reachable is False:
            logger.info("node %s: reachable again", name)
        lapsed = node.answered_s is not None and now_s > node.answered_s + lease_s
        node.answered_s = now_s
        node.steady, node.mean_w = interval_power(node, result.gpus, sent.interval, self.limit_w)
        node.reachable = True
        self._learn_boards(name, node, result)
        node.reports = result.gpus
        node.reports_at = sent.interval
        node.sent = sent
        node.refused = frozenset(r.gpu for r in result.refused)
        node.foreign = frozenset(
            r.gpu for r in result.refused if "another process holds its clocks" in r.reason
        )
        return lapsed

    def _learn_boards(self, name: str, node: NodeState, result: ExchangeResponse) -> None:
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
        described = {b.uuid: bool(b.mig_mode) for b in result.boards}
        # a board not described in this answer keeps what the last description said
        mig = {r.uuid: described.get(r.uuid, r.index in node.mig) for r in result.gpus}
        mixed = any(mig.values())
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
                        _NOT_DESCRIBED
                        if r.board is not None
                        else f"board {r.name!r} is not in the catalog and not described"
                    )
            if mixed and not mig[r.uuid]:
                gpu_type, why[r.index] = None, _MIG_NODE
            types[r.index] = gpu_type
        in_mig = frozenset(r.index for r in result.gpus if mig[r.uuid])
        if types != node.gpu_types or why != node.why or in_mig != node.mig:
            for index, reason in sorted(why.items()):
                if node.why.get(index) != reason:
                    logger.warning("node %s GPU %d: not controlled: %s", name, index, reason)
            for index in sorted(in_mig - node.mig):
                if types.get(index) is not None:
                    logger.info(
                        "node %s GPU %d: MIG mode is on: controlled through its power limit",
                        name,
                        index,
                    )
        node.gpu_types, node.why, node.mig = types, why, in_mig
        node.describe = unknown and not result.boards

    # -- what the last answers say -------------------------------------------------------------

    def samples(
        self,
        owners: Mapping[GpuRef, tuple[str, ...]],
        shadow: bool,
        left: Mapping[GpuRef, tuple[str, ...]] | None = None,
    ) -> dict[str, list[GpuSample]]:
        """Per job, the samples of the last answers that may teach its model: GPUs of
        ``owners`` (the jobs that held them since before that exchange) that held the job's lock
        (outside ``shadow`` mode: the agent says it holds the job's setpoint) for the whole
        interval the readings describe, with the interval's mean power where known. A shared
        GPU holds one setpoint, named for one of its tenants: its sample teaches them all, and
        names as its tenants its owners and the jobs ``left`` since the last exchange (they
        ran on it for part of the interval)."""
        out: dict[str, list[GpuSample]] = {}
        for name, node in self._nodes.items():
            if node.reachable is not True:
                continue
            for r in node.reports:
                ref = GpuRef(name, r.index)
                jobs = owners.get(ref, ())
                power_w = node.mean_w.get(r.index, r.power_w)
                if not jobs or power_w is None or r.index not in node.steady:
                    continue  # no job, no power, or a lock that changed during the interval
                if r.sm_clock_mhz is None or r.memory_clock_mhz is None:
                    continue
                if not shadow and r.job_id not in jobs:
                    continue  # the agent does not hold this job's setpoint (yet, or refused)
                tenants = jobs if left is None else (*jobs, *left.get(ref, ()))
                throttle = r.throttle or 0
                lever_w = None
                if r.index in node.mig:  # the power limit is the head's own lever here
                    throttle &= ~int(ThrottleReason.SW_POWER_CAP)
                    lever_w = self._lever_limit_w(node, r)
                sample = GpuSample(
                    ref, power_w, r.sm_clock_mhz, r.memory_clock_mhz, throttle, tenants, lever_w
                )
                for job_id in jobs:
                    out.setdefault(job_id, []).append(sample)
        return out

    def _lever_limit_w(self, node: NodeState, r: GpuReport) -> float | None:
        """The limit a MIG GPU held over the interval, where below its board's default and the
        firmware said it held the clock (`SW_POWER_CAP`): what teaches its lever's gain."""
        gpu_type = node.gpu_types.get(r.index)
        spec = None if gpu_type is None else self.specs.get(gpu_type)
        limit_w = r.enforced_limit_w
        default_w = None if spec is None else spec.power_limit.default_w
        if default_w is None or limit_w is None or limit_w >= default_w - _LIMIT_TOLERANCE_W:
            return None
        if not (r.throttle or 0) & ThrottleReason.SW_POWER_CAP:
            return None
        return limit_w

    def power_by_gpu(self) -> dict[GpuRef, float]:
        """Every GPU that reported a power in the last answers: the interval's mean where the
        energy counter gives it, else the reading."""
        return {
            GpuRef(name, r.index): power_w
            for name, node in self._nodes.items()
            for r in node.reports
            if (power_w := node.mean_w.get(r.index, r.power_w)) is not None
        }

    def left_alone(self, name: str) -> frozenset[int]:
        """The GPUs of node ``name`` the head will not control while they stay as they are (on a
        node with a MIG GPU, a board neither known nor described), not those it waits to see
        described: a lock left on one would never be planned again (`GpuLocks.answered`)."""
        node = self._nodes.get(name)
        if node is None:
            return frozenset()
        return frozenset(i for i, why in node.why.items() if why != _NOT_DESCRIBED)

    def limit_only_on(self, name: str) -> frozenset[int]:
        """The GPUs of node ``name`` the head controls through their power limit (MIG mode)."""
        node = self._nodes.get(name)
        if node is None:
            return frozenset()
        return frozenset(i for i in node.mig if node.gpu_types.get(i) is not None)

    def limit_only(self, ref: GpuRef) -> bool:
        """True when the head controls ``ref`` through its power limit (MIG mode)."""
        return ref.index in self.limit_only_on(ref.node)

    def read_with_job(self, ref: GpuRef, registered_at_s: float) -> bool:
        """True when ``ref`` stays outside the plan for good (beside a MIG GPU: Slurm's index
        may not be NVML's) and its node last answered after a job on it registered: the reading then
        includes the job, and the GPU is counted at what it draws, not at its limit as a job
        waiting for its first plan is (`PowerLedger.uncontrolled_by_node_w`)."""
        node = self._nodes.get(ref.node)
        return (
            node is not None
            and node.why.get(ref.index) == _MIG_NODE
            and node.answered_s is not None
            and node.answered_s > registered_at_s
        )

    def reading_w(self, ref: GpuRef) -> float | None:
        """The GPU's power as its agent read it at the last answer (None: none)."""
        node = self._nodes.get(ref.node)
        if node is None:
            return None
        return next((r.power_w for r in node.reports if r.index == ref.index), None)

    def free_gpus(self, busy: Collection[GpuRef]) -> list[int]:
        """Per node, in order, its reported GPUs outside ``busy`` (none while it is away)."""
        return [
            sum(GpuRef(name, r.index) not in busy for r in node.reports) if node.reachable else 0
            for name, node in self._nodes.items()
        ]

    def reachability(self) -> tuple[int, int]:
        """How many nodes answered the last exchange, and how many did not."""
        nodes = self._nodes.values()
        return (
            sum(1 for n in nodes if n.reachable is True),
            sum(1 for n in nodes if n.reachable is False),
        )

    def other_limiters(
        self, power_limit_margin: float, ours: Collection[GpuRef] = ()
    ) -> tuple[str, ...]:
        """The GPUs held by something else than this head, from the last reports: an enforced
        power limit below the board's default that this head did not ask for (the guard rail's,
        or one it sent to ``ours``), a power brake or a slowdown, or a refusal because another
        process holds the clocks."""
        out: list[str] = []
        margin = power_limit_margin
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
                    and GpuRef(name, r.index) not in ours
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

    # -- the durable part ----------------------------------------------------------------------

    def persist(
        self, store: Store, responses: Mapping[str, ExchangeResponse | NodeFailure], now_s: float
    ) -> None:
        """Each exchanged node's reachability (one write for the round), and its GPU type and
        worst case when they changed."""
        seen: list[str] = []
        lost: list[str] = []
        for name, result in responses.items():
            node = self._nodes[name]
            if isinstance(result, NodeFailure):
                lost.append(name)
                continue
            gpu_type, worst_w = self._describe(node, result.gpus)
            gpu_type = gpu_type or node.gpu_type  # no one type: the node keeps the one it had
            if gpu_type != node.gpu_type or worst_w != node.worst_case_w:
                node.gpu_type = gpu_type
                node.worst_case_w = worst_w
                store.upsert_node(
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
                seen.append(name)
        store.mark_nodes(seen, lost, at_s=now_s)

    def _describe(self, node: NodeState, gpus: Sequence[GpuReport]) -> tuple[str | None, float]:
        """A node's GPU type (when all its GPUs share one) and worst-case power: each GPU at
        its board's largest power limit (a GPU not controlled: its described board's, else its
        name's in the catalog)."""
        types = {node.gpu_types.get(r.index) for r in gpus}
        gpu_type = types.pop() if len(types) == 1 else None
        worst_w = 0.0
        for r in gpus:
            t = node.gpu_types.get(r.index)
            if t is None and r.board is not None:
                t = self._board_types.get(r.board)
            worst_w += self.specs[t].power_limit.max_w if t in self.specs else self.limit_w(r.name)
        return gpu_type, worst_w
