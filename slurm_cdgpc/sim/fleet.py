"""The simulated cluster's hardware: groups of identical nodes, parsed from ``--fleet``, and the
power domains above them (``--racks``, ``--topology``).

The order of the groups is the placement order: first-fit scans nodes group by group. Node i
(from 0, in that order) is named ``node{i+1:04d}``: ``node0001``, ``node0002``, ... (`node_names`),
the names a topology file for the simulator refers to. Design: DESIGN.md, "Simulator"
(Placement); tests: `tests/unit/test_sim_fleet.py`, `tests/unit/test_sim_domains.py`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Final

import numpy as np
import numpy.typing as npt

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.gpu.catalog import GpuSpec, catalog_spec
from slurm_cdgpc.sim.traces import WHOLE_GPU, Trace
from slurm_cdgpc.topology import CLUSTER, Domain, Topology
from slurm_cdgpc.units import parse_power_w

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

DEFAULT_GPU: Final = "A100-SXM4-80GB"
DEFAULT_GPUS_PER_NODE: Final = 8
#: the share of time the default fleet covers the trace's demand (time-weighted percentile)
DEFAULT_QUANTILE: Final = 0.9

_GROUP = re.compile(r"\s*([0-9]+)\s*x\s*([0-9]+)\s*:\s*([^,]+?)\s*")
_RACKS = re.compile(r"\s*([+-]?[0-9]+)\s*:\s*(\S+?)\s*")


def node_name(index: int) -> str:
    """The simulator's name of node ``index`` (from 0, in placement order): ``node0001``."""
    return f"node{index + 1:04d}"


@dataclass(frozen=True)
class NodeGroup:
    """``nodes`` identical nodes with ``gpus_per_node`` GPUs of type ``spec``."""

    nodes: int
    gpus_per_node: int
    spec: GpuSpec


@dataclass(frozen=True)
class FleetSpec:
    """The cluster's node groups, in placement order."""

    groups: tuple[NodeGroup, ...]
    #: the power domains below the cluster, over `node_names` (None: the cluster alone)
    topology: Topology | None = None

    def __post_init__(self) -> None:
        if not self.groups:
            raise InputError("a fleet needs at least one node group")
        if self.topology is not None:
            known = set(self.node_names)
            unknown = sorted({n for d in self.topology.domains for n in d.nodes} - known)
            if unknown:
                raise InputError(
                    f"the topology names {len(unknown)} nodes the fleet lacks (first: "
                    f"{unknown[0]!r}); the simulator names its {len(known)} nodes "
                    f"{node_name(0)} to {node_name(len(known) - 1)}"
                )

    def with_topology(self, topology: Topology | None) -> FleetSpec:
        """This fleet under ``topology`` (checked: it names only this fleet's nodes)."""
        return replace(self, topology=topology)

    @property
    def specs(self) -> tuple[GpuSpec, ...]:
        """The distinct GPU types, in order of first appearance."""
        seen: dict[str, GpuSpec] = {}
        for g in self.groups:
            seen.setdefault(g.spec.name, g.spec)
        return tuple(seen.values())

    @property
    def node_type(self) -> IntArray:
        """Index into `specs` of every node, shape (nodes,)."""
        names = [s.name for s in self.specs]
        return np.concatenate(
            [np.full(g.nodes, names.index(g.spec.name), dtype=np.int64) for g in self.groups]
        )

    @property
    def node_gpus(self) -> IntArray:
        """GPUs of every node, shape (nodes,)."""
        return np.concatenate(
            [np.full(g.nodes, g.gpus_per_node, dtype=np.int64) for g in self.groups]
        )

    @property
    def node_names(self) -> tuple[str, ...]:
        """Every node's name, in placement order (`node_name`)."""
        return tuple(node_name(i) for i in range(sum(g.nodes for g in self.groups)))

    @property
    def node_max_power_w(self) -> FloatArray:
        """Per node: Σ over its GPUs of the highest power limit, shape (nodes,)."""
        max_w = np.array([s.power_limit.max_w for s in self.specs], dtype=np.float64)
        return self.node_gpus * max_w[self.node_type]

    def domain_nodes(self) -> BoolArray:
        """(domains, nodes): node i is under domain d, directly or through a child domain;
        (0, nodes) without a topology."""
        names = self.node_names
        members = np.zeros((0 if self.topology is None else len(self.topology), len(names)), bool)
        if self.topology is not None:
            for i, name in enumerate(names):
                members[list(self.topology.path(name)), i] = True
        return members

    @property
    def total_gpus(self) -> int:
        return sum(g.nodes * g.gpus_per_node for g in self.groups)

    @property
    def max_power_w(self) -> float:
        """Σ over GPUs of the highest power limit: what ``--budget 1.0`` means."""
        return float(sum(g.nodes * g.gpus_per_node * g.spec.power_limit.max_w for g in self.groups))

    def __str__(self) -> str:
        return ",".join(f"{g.nodes}x{g.gpus_per_node}:{g.spec.name}" for g in self.groups)


def parse_fleet(text: str) -> FleetSpec:
    """``64x8:A100-SXM4-80GB,32x8:V100-SXM2`` → `FleetSpec`; malformed text is an `InputError`.

    A comma-separated list of ``NODESxGPUS:TYPE`` groups: here 64 nodes of 8 A100s, then 32
    nodes of 8 V100s."""
    groups = []
    for part in text.split(","):
        match = _GROUP.fullmatch(part)
        if match is None:
            raise InputError(
                f"cannot read fleet group {part.strip()!r}: use NODESxGPUS:TYPE, "
                "e.g. 64x8:A100-SXM4-80GB"
            )
        nodes, gpus = int(match[1]), int(match[2])
        if nodes < 1 or gpus < 1:
            raise InputError(f"fleet group {part.strip()!r} needs at least one node and one GPU")
        groups.append(NodeGroup(nodes, gpus, catalog_spec(match[3])))
    return FleetSpec(tuple(groups))


def parse_budget_w(text: str, fleet: FleetSpec) -> float:
    """``0.6`` → 0.6 × the fleet's Σ max power limit; ``450kW`` → 450,000 W."""
    try:
        fraction = float(text)
    except ValueError:
        return parse_power_w(text)
    if not 0.0 < fraction <= 1.0:
        raise InputError(
            f"budget {text!r}: a bare number is a fraction of the fleet's maximum power in "
            "(0, 1]; give watts with a unit (e.g. 450kW)"
        )
    return fraction * fleet.max_power_w


def parse_racks(text: str) -> tuple[int, float]:
    """``4:0.75`` → (4, 0.75): racks of 4 consecutive nodes, each limited to 0.75 × its maximum
    power; malformed text, K < 1 or F outside (0, 1] is an `InputError`."""
    match = _RACKS.fullmatch(text)
    try:
        if match is None:
            raise ValueError(text)
        nodes, fraction = int(match[1]), float(match[2])
    except ValueError:
        raise InputError(
            f"--racks {text!r}: use K:F, racks of K nodes each limited to F × its maximum "
            "power (e.g. 4:0.75)"
        ) from None
    if nodes < 1:
        raise InputError(f"--racks {text!r}: a rack needs at least one node (K ≥ 1)")
    if not 0.0 < fraction <= 1.0:
        raise InputError(
            f"--racks {text!r}: F is a fraction of each rack's maximum power, in (0, 1]"
        )
    return nodes, fraction


def rack_topology(fleet: FleetSpec, nodes_per_rack: int, fraction: float) -> Topology:
    """Racks ``rack001``, ``rack002``, ... of ``nodes_per_rack`` consecutive nodes (the last
    holds what is left), each under the cluster and limited to ``fraction`` × Σ over its GPUs
    of their highest power limit (what ``--budget`` fractions are of, for the fleet)."""
    names = fleet.node_names
    node_max_w = fleet.node_max_power_w
    racks = []
    for number, first in enumerate(range(0, len(names), nodes_per_rack), 1):
        last = first + nodes_per_rack
        limit_w = fraction * float(node_max_w[first:last].sum())
        racks.append(Domain(f"rack{number:03d}", CLUSTER, limit_w, names[first:last]))
    return Topology(tuple(racks))


def with_domains(fleet: FleetSpec, racks: str | None, topology: Topology | None) -> FleetSpec:
    """``fleet`` under ``--racks`` K:F (`parse_racks`) or a ``--topology`` (neither: as it is)."""
    if racks is not None:
        if topology is not None:
            raise InputError("give --racks or --topology, not both")
        return fleet.with_topology(rack_topology(fleet, *parse_racks(racks)))
    return fleet.with_topology(topology)


def concurrent_demand_quantile(
    submit_s: FloatArray, duration_s: FloatArray, num_gpu: IntArray | FloatArray, quantile: float
) -> float:
    """Time-weighted quantile of Σ GPUs of the jobs in [submit, submit + duration).

    Demand is a step function changing at every start and end; each level is weighted by how
    long it holds, from the first submission to the last end.
    """
    if submit_s.size == 0:
        return 0.0
    times = np.concatenate([submit_s, submit_s + duration_s])
    delta = np.concatenate([num_gpu, -num_gpu]).astype(np.float64)
    order = np.argsort(times, kind="stable")
    times, delta = times[order], delta[order]
    level = np.cumsum(delta)[:-1]  # demand on [t_i, t_{i+1})
    span = np.diff(times)
    if span.sum() <= 0:
        return float(num_gpu.sum())
    by_level = np.argsort(level, kind="stable")
    cum = np.cumsum(span[by_level]) / span.sum()
    k = int(np.searchsorted(cum, quantile, side="left"))
    return float(level[by_level][min(k, level.size - 1)])


def default_fleet(trace: Trace) -> FleetSpec:
    """The trace's time-weighted p90 concurrent GPU demand, in whole 8-GPU A100 nodes (≥ 1):
    the GPUs the trace would keep busy if every job started at submission and ran at max
    clocks (a job that shares a GPU counts its part of it)."""
    gpus = trace.num_gpu * trace.gpu_milli / WHOLE_GPU
    demand = concurrent_demand_quantile(trace.submit_s, trace.duration_s, gpus, DEFAULT_QUANTILE)
    nodes = max(1, math.ceil(demand / DEFAULT_GPUS_PER_NODE))
    return FleetSpec((NodeGroup(nodes, DEFAULT_GPUS_PER_NODE, catalog_spec(DEFAULT_GPU)),))
