"""The site's power distribution tree (``head.topology``, e.g. ``/etc/cdgpc/topology.toml``):
nested domains below the cluster (rows, PDUs, racks), each with a limit, read and checked once,
then turned every interval into the controller's `DomainLimits`.

The file's format is `Topology`'s; ``daemon/topology.toml`` is a commented example. Standard
library, numpy, `errors`, the config's power parser, `wire.names`, the hostlist parser and
`control.domains` only (`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Power domains";
test: `tests/unit/test_topology.py`.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from slurm_cdgpc.config import _BadValueError, _power, _ramp
from slurm_cdgpc.control.domains import DomainLimits
from slurm_cdgpc.errors import InputError, one_line
from slurm_cdgpc.model.families import FloatArray
from slurm_cdgpc.slurm.squeue import expand_hostlist
from slurm_cdgpc.units import format_power
from slurm_cdgpc.wire.names import NODE_NAME

#: the root: every node is under it, and its limit is the budget (``cdgpc-admin budget set``)
CLUSTER = "cluster"
#: a ``[[domain]]`` table's keys
KEYS = ("name", "parent", "limit", "nodes", "ramp")


def _got(value: object) -> str:
    return f"got {one_line(repr(value), 60)}"


def _names(names: Sequence[str], limit: int = 10) -> str:
    """``'a', 'b'`` (and how many more past ``limit``), for a one-line message."""
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def format_powers(a_w: float, b_w: float) -> tuple[str, str]:
    """Two powers as people read them, with every digit when rounding would make them equal."""
    a, b = format_power(a_w), format_power(b_w)
    return (a, b) if a != b else (f"{a_w:g} W", f"{b_w:g} W")


@dataclass(frozen=True)
class Domain:
    """One ``[[domain]]`` of the file: a row, PDU or rack whose GPUs must draw at most its limit.

    ``name``: a node name's grammar (letters, digits, ``.``, ``_``, ``-``), unique, not
    ``cluster``. ``limit``: a power (``40kW``, ``1.2MW``, a bare number is watts), no more than
    its parent's. ``parent``: another domain's name, or ``cluster`` (the default). ``nodes``: a
    Slurm hostlist (``gpu[001-004],gpu010``) or a list of them: the nodes in this domain and no
    other (a node in a child domain is in its parents through it; a node in none is under the
    cluster alone).
    """

    name: str
    #: ``cluster`` for a top-level domain
    parent: str
    limit_w: float
    #: the nodes named directly here (not through a child), expanded and sorted
    nodes: tuple[str, ...] = ()
    #: how fast its GPUs' planned power may move, W/s (inf: only the cluster's ramp)
    ramp_w_per_s: float = math.inf


@dataclass(frozen=True)
class Topology:
    """The power domains below the cluster, read from a TOML file of ``[[domain]]`` tables::

        [[domain]]
        name = "row1"
        limit = "200kW"
        [[domain]]
        name = "rack12"
        parent = "row1"            # default "cluster"
        limit = "40kW"
        nodes = "gpu[001-004],gpu010"

    Built checked: names unique, each parent an earlier domain (or the cluster), limits
    positive and no more than the parent's, each node in one domain at most (`InputError`).
    """

    #: parents before children; the cluster is not among them
    domains: tuple[Domain, ...]
    _index: dict[str, int] = field(init=False, repr=False, compare=False)
    #: node → the indices of every domain containing it, outermost first
    _paths: dict[str, tuple[int, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict[str, int] = {}
        domain_paths: list[tuple[int, ...]] = []
        paths: dict[str, tuple[int, ...]] = {}
        owner: dict[str, str] = {}
        for i, domain in enumerate(self.domains):
            name = domain.name
            if not NODE_NAME.fullmatch(name) or name == CLUSTER:
                raise InputError(
                    f"domain {name!r}: a domain's name is a node name's grammar, not {CLUSTER!r}"
                )
            if name in index:
                raise InputError(f"domain {name!r} is defined twice")
            if not (domain.limit_w > 0 and math.isfinite(domain.limit_w)):
                raise InputError(f"domain {name!r}: limit must be a positive power")
            if domain.parent == CLUSTER:
                above: tuple[int, ...] = ()
            elif domain.parent in index:
                parent = self.domains[index[domain.parent]]
                if domain.limit_w > parent.limit_w:
                    mine, theirs = format_powers(domain.limit_w, parent.limit_w)
                    raise InputError(
                        f"domain {name!r}: limit {mine} is above the {theirs} of its parent "
                        f"{parent.name!r}"
                    )
                above = domain_paths[index[domain.parent]]
            else:
                raise InputError(
                    f"domain {name!r}: parent {domain.parent!r} is not a domain above it"
                )
            index[name] = i
            path = (*above, i)
            domain_paths.append(path)
            for node in domain.nodes:
                if node in owner:
                    raise InputError(
                        f"node {node!r} is in two domains, {owner[node]!r} and {name!r}"
                    )
                owner[node] = name
                paths[node] = path
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_paths", paths)

    @classmethod
    def empty(cls) -> Topology:
        """No domain below the cluster."""
        return cls(())

    def __len__(self) -> int:
        return len(self.domains)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.domains)

    @property
    def limits_w(self) -> FloatArray:
        """(D,) each domain's limit, as the file has it."""
        return np.array([d.limit_w for d in self.domains], dtype=np.float64)

    @property
    def ramps_w_per_s(self) -> FloatArray:
        """(D,) each domain's ramp rate in W/s (inf: none of its own)."""
        return np.array([d.ramp_w_per_s for d in self.domains], dtype=np.float64)

    def index(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise InputError(
                f"unknown power domain {one_line(repr(name), 60)} (known: "
                f"{_names(self.names) or 'none'})"
            ) from None

    def path(self, node: str) -> tuple[int, ...]:
        """The indices of every domain containing ``node``, outermost first; () in none."""
        return self._paths.get(node, ())

    def node_power_w(self, node_w: Mapping[str, float]) -> FloatArray:
        """(D,) Σ of ``node_w`` over each domain's nodes, its descendants' included."""
        domain: list[int] = []
        weight: list[float] = []
        paths = self._paths
        for node, w in node_w.items():
            path = paths.get(node)
            if path:
                domain.extend(path)
                weight.extend([w] * len(path))
        return np.bincount(
            np.array(domain, dtype=np.int64), weights=np.array(weight), minlength=len(self)
        ).astype(np.float64)

    def limits(
        self,
        job_gpus: Sequence[Mapping[str, int]],
        node_uncontrolled_w: Mapping[str, float],
        limit_w: FloatArray | None = None,
    ) -> DomainLimits:
        """The controller's input for one step.

        ``job_gpus[n]``: the GPUs per node of controlled job row ``n``. One triple (domain, n,
        share) per domain the job has GPUs under, share_dn = GPUs of n under d / GPUs of n.
        ``node_uncontrolled_w``: what each node's GPUs outside the plan may draw, summed per
        domain. ``limit_w``: the limits in force (default: the file's).
        """
        if not self.domains:
            return DomainLimits.none()
        paths = self._paths
        domain: list[int] = []
        job_row: list[int] = []
        share: list[float] = []
        for n, gpus in enumerate(job_gpus):
            if len(gpus) == 1:  # most jobs: every domain above the node holds all of the job
                ((node, count),) = gpus.items()
                path = paths.get(node)
                if path and count > 0:
                    domain.extend(path)
                    job_row.extend([n] * len(path))
                    share.extend([1.0] * len(path))
                continue
            total = 0
            under: dict[int, int] = {}
            for node, count in gpus.items():
                if count > 0:
                    total += count
                    for d in paths.get(node, ()):
                        under[d] = under.get(d, 0) + count
            for d, count in under.items():
                domain.append(d)
                job_row.append(n)
                share.append(count / total)
        return DomainLimits(
            names=self.names,
            limit_w=self.limits_w if limit_w is None else np.asarray(limit_w, dtype=np.float64),
            uncontrolled_w=self.node_power_w(node_uncontrolled_w),
            domain=np.array(domain, dtype=np.int64),
            job_row=np.array(job_row, dtype=np.int64),
            share=np.array(share, dtype=np.float64),
            parent=self.parents,
        )

    @property
    def parents(self) -> NDArray[np.int64]:
        """(D,) each domain's parent's index, −1 for the cluster's children."""
        index = {d.name: i for i, d in enumerate(self.domains)}
        return np.array([index.get(d.parent, -1) for d in self.domains], dtype=np.int64)


# -- reading the file --------------------------------------------------------------------------


def load_topology(path: Path) -> Topology:
    """Read and check the file at ``path``; `InputError` with one line naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 (at offset {e.start})") from e
    return parse_topology(text, str(path))


def parse_topology(text: str, source: str = "topology") -> Topology:
    """The `Topology` that ``text`` describes, or `InputError`: one line naming ``source`` and
    the offending domain, key or node. Nothing is half-loaded."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"{source}: not valid TOML: {one_line(e)}") from e
    for key in data:
        if key != "domain":
            raise InputError(f"{source}: unknown key {one_line(repr(key), 60)} (known: domain)")
    tables = data.get("domain", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise InputError(f"{source}: domain: must be [[domain]] tables, {_got(tables)}")
    parsed: dict[str, Domain] = {}
    for number, table in enumerate(tables, 1):
        domain = _domain(table, f"{source}: [[domain]] #{number}", source)
        if domain.name in parsed:
            raise InputError(f"{source}: domain {domain.name!r} is defined twice")
        parsed[domain.name] = domain
    for domain in parsed.values():
        if domain.parent != CLUSTER and domain.parent not in parsed:
            raise InputError(
                f"{source}: domain {domain.name!r}: unknown parent {domain.parent!r} "
                f"(known: {_names([CLUSTER, *parsed])})"
            )
    ordered = _parents_first(parsed, source)
    try:
        return Topology(ordered)
    except InputError as e:
        raise InputError(f"{source}: {e}") from None


def _domain(table: dict[str, object], where: str, source: str) -> Domain:
    """One ``[[domain]]`` table, its values parsed; ``where`` names it until its name is read."""
    name = table.get("name")
    if isinstance(name, str) and NODE_NAME.fullmatch(name) and name != CLUSTER:
        where = f"{source}: domain {name!r}"
    for key in table:
        if key not in KEYS:
            raise InputError(
                f"{where}: unknown key {one_line(repr(key), 60)} (known: {', '.join(KEYS)})"
            )
    for key in ("name", "limit"):
        if key not in table:
            raise InputError(f"{where}: missing {key}")
    if not (isinstance(name, str) and NODE_NAME.fullmatch(name)):
        raise InputError(
            f"{where}: name: must be a name like rack12 (letters, digits, '.', '_', '-'), "
            f"{_got(name)}"
        )
    if name == CLUSTER:
        raise InputError(
            f"{where}: name: {CLUSTER!r} is reserved for the root (its limit is the budget)"
        )
    parent = table.get("parent", CLUSTER)
    if not (isinstance(parent, str) and (parent == CLUSTER or NODE_NAME.fullmatch(parent))):
        raise InputError(f"{where}: parent: must be a domain's name or {CLUSTER!r}, {_got(parent)}")
    try:
        limit_w = _power(table["limit"])
    except _BadValueError as e:
        raise InputError(f"{where}: limit: {e}") from None
    try:
        ramp_w_per_s = _ramp(table.get("ramp", "off"))
    except _BadValueError as e:
        raise InputError(f"{where}: ramp: {e}") from None
    return Domain(name, parent, limit_w, _nodes(table.get("nodes", ()), where), ramp_w_per_s)


def _nodes(value: object, where: str) -> tuple[str, ...]:
    """A hostlist or a list of them → the names, sorted."""
    what = "must be a hostlist like gpu[001-004],gpu010 or a list of them"
    if isinstance(value, str):
        items: Sequence[object] = [value]
    elif isinstance(value, list | tuple):
        items = value
    else:
        raise InputError(f"{where}: nodes: {what}, {_got(value)}")
    names: set[str] = set()
    for item in items:
        if not isinstance(item, str):
            raise InputError(f"{where}: nodes: {what}, {_got(item)}")
        try:
            expanded = expand_hostlist(item)
        except InputError as e:
            raise InputError(f"{where}: nodes: {one_line(e)}") from None
        for node in expanded:
            if not NODE_NAME.fullmatch(node):
                raise InputError(f"{where}: nodes: {one_line(repr(node), 60)} is not a node name")
        names.update(expanded)
    return tuple(sorted(names))


def _parents_first(domains: Mapping[str, Domain], source: str) -> tuple[Domain, ...]:
    """Each domain after its parent, in the file's order under each (a depth-first walk down
    from the cluster); a domain the walk never reaches hangs below a cycle, which is named."""
    children: dict[str, list[Domain]] = {}
    for domain in domains.values():
        children.setdefault(domain.parent, []).append(domain)
    ordered: list[Domain] = []
    stack = list(reversed(children.get(CLUSTER, [])))
    while stack:
        domain = stack.pop()
        ordered.append(domain)
        stack.extend(reversed(children.get(domain.name, [])))
    if len(ordered) == len(domains):
        return tuple(ordered)
    reached = {d.name for d in ordered}
    start = next(name for name in domains if name not in reached)
    walk = [start]
    while (up := domains[walk[-1]].parent) not in walk:
        walk.append(up)
    cycle = [*walk[walk.index(up) :], up]
    raise InputError(
        f"{source}: domains form a cycle: {' → '.join(repr(n) for n in cycle)} "
        f"(each must lead up to {CLUSTER!r})"
    )
