"""Simulator sweeps: traces × seeds × budgets × progress mixes × policies, one replay per cell.

A sweep is one directory (`Sweep`), all that the machines running it share; `run_cells` runs
cells in this process, `run_local` on a process pool. Nothing here runs a Slurm command
(`tests/unit/test_import_graph.py`). Tests: `tests/unit/test_sim_sweep.py`,
`tests/integration/test_sim_sweep_slurm.py`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import multiprocessing
import os
import re
import signal
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import IO, Any, Final, TypeVar

import numpy as np

from slurm_cdgpc.errors import FatalError, InputError
from slurm_cdgpc.sim.cluster import SimulationResult, Simulator
from slurm_cdgpc.sim.fleet import (
    FleetSpec,
    default_fleet,
    parse_budget_w,
    parse_fleet,
    parse_racks,
    with_domains,
)
from slurm_cdgpc.sim.metrics import SERVING_MEANS, compute_metrics
from slurm_cdgpc.sim.policies import POLICIES, READS_PLANT, make_policy
from slurm_cdgpc.sim.reporting import DEFAULT_TIME_LIMITS, ProgressMix, TimeLimitModel
from slurm_cdgpc.sim.serving import Arrivals, Serving
from slurm_cdgpc.sim.traces import Trace, load_trace
from slurm_cdgpc.topology import Topology, load_topology
from slurm_cdgpc.units import parse_power_w

logger = logging.getLogger(__name__)

VERSION: Final = 1
DEFINITION_FILE: Final = "sweep.json"
CELLS_DIR: Final = "cells"
REFERENCES_DIR: Final = "references"
#: a seed range longer than this is a typo, not a sweep
MAX_SEEDS: Final = 100_000
_SEEDS: Final = re.compile(r"([0-9]+)(?:-([0-9]+))?")
#: characters a trace's name keeps in file names; "_" separates a key's parts
_NAME_UNSAFE: Final = re.compile(r"[^A-Za-z0-9.-]+")
_T = TypeVar("_T", int, float, str)


# --- the lists a sweep is given --------------------------------------------------------------


def _items(text: str, what: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise InputError(f"{what} {text!r}: an empty item in the list")
    return items


def _distinct(values: Sequence[_T], what: str) -> tuple[_T, ...]:
    seen: set[_T] = set()
    for value in values:
        if value in seen:
            raise InputError(f"{what} {value} is listed twice")
        seen.add(value)
    return tuple(values)


def parse_seeds(text: str) -> tuple[int, ...]:
    """``0,3,5-7`` → (0, 3, 5, 6, 7); a range includes both ends and must not run backwards."""
    seeds: list[int] = []
    for item in _items(text, "seeds"):
        match = _SEEDS.fullmatch(item)
        if match is None:
            raise InputError(f"seed {item!r}: use N, a list N,M or a range N-M (e.g. 0-4)")
        low = int(match[1])
        high = low if match[2] is None else int(match[2])
        if high < low:
            raise InputError(f"seed range {item!r} runs backwards (write {high}-{low})")
        if high - low >= MAX_SEEDS:
            raise InputError(f"seed range {item!r} has more than {MAX_SEEDS} seeds")
        seeds.extend(range(low, high + 1))
    return _distinct(seeds, "seed")


def format_seeds(seeds: Sequence[int]) -> str:
    """(0, 1, 2, 4) → ``0-2,4``: what `parse_seeds` reads back."""
    parts: list[str] = []
    ordered = sorted(seeds)
    start = 0
    for i in range(1, len(ordered) + 1):
        if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
            low, high = ordered[start], ordered[i - 1]
            parts.append(str(low) if low == high else f"{low}-{high}")
            start = i
    return ",".join(parts)


def parse_shares(text: str) -> tuple[float, ...]:
    """``0.25,1`` → (0.25, 1.0): shares of jobs that report progress, each in (0, 1]."""
    shares: list[float] = []
    for item in _items(text, "progress shares"):
        try:
            share = float(item)
        except ValueError:
            raise InputError(f"progress share {item!r} is not a number") from None
        if not 0.0 < share <= 1.0:
            raise InputError(f"progress share {item!r} is not in (0, 1]")
        shares.append(share)
    return _distinct(shares, "progress share")


def parse_policies(text: str) -> tuple[str, ...]:
    """``cdgpc,uniform-clock`` or ``all`` (every policy in `POLICIES`)."""
    if text.strip() == "all":
        return tuple(POLICIES)
    names = _items(text, "policies")
    for name in names:
        if name not in POLICIES:
            raise InputError(f"unknown policy {name!r} (known: {', '.join(POLICIES)}, all)")
    return _distinct(names, "policy")


def canonical_budget(text: str) -> str:
    """One spelling per budget: ``0.70`` → ``0.7`` (a fraction), ``450kW`` → ``450000W``."""
    try:
        return repr(float(text))
    except ValueError:
        power_w = parse_power_w(text)
    return f"{int(power_w)}W" if power_w.is_integer() else f"{power_w!r}W"


def parse_budgets(text: str) -> tuple[str, ...]:
    """``0.6,0.7,450kW`` → canonical budgets (each checked by `parse_budget_w` on a fleet later)."""
    return _distinct([canonical_budget(item) for item in _items(text, "budgets")], "budget")


def parse_mixes(shares_text: str | None, mix_texts: Sequence[str]) -> tuple[ProgressMix, ...]:
    """``--progress-share P,Q`` (each reported P, time-limit 1 − P) or ``--progress-mix`` given
    once per mix (`ProgressMix.parse`); neither: all jobs report."""
    if shares_text is not None and mix_texts:
        raise InputError("give --progress-share or --progress-mix, not both")
    if shares_text is not None:
        mixes = [ProgressMix.of_share(p) for p in parse_shares(shares_text)]
    else:
        mixes = [ProgressMix.parse(text) for text in mix_texts] or [ProgressMix()]
    return _distinct_mixes(mixes)


def _distinct_mixes(mixes: Sequence[ProgressMix]) -> tuple[ProgressMix, ...]:
    seen: set[ProgressMix] = set()
    for mix in mixes:
        if mix in seen:
            raise InputError(f"progress mix {mix} is listed twice")
        seen.add(mix)
    return tuple(mixes)


def simulator_options(mix: ProgressMix, time_limits: TimeLimitModel) -> dict[str, Any]:
    """Keywords for `Simulator`: only those that are not the defaults."""
    options: dict[str, Any] = {}
    if mix != ProgressMix():
        options["progress_mix"] = mix
    if time_limits != DEFAULT_TIME_LIMITS:
        options["time_limits"] = time_limits
    return options


def canonical_racks(text: str) -> str:
    """One spelling per ``--racks``: ``4:0.750`` → ``4:0.75`` (checked by `parse_racks`)."""
    nodes, fraction = parse_racks(text)
    return f"{nodes}:{fraction!r}"


def mix_label(mix: ProgressMix) -> str:
    """A mix in keys and tables: ``share0.5`` for ``--progress-share 0.5``, else its shares
    in `SOURCES` order (``progress0.2-0.6-0.2-0``)."""
    if mix.share is not None:
        return f"share{mix.share!r}"
    return "progress" + "-".join(f"{v!r}" for v in mix.shares)


# --- the definition ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceFile:
    name: str  # in keys and tables: the file's stem, reduced to [A-Za-z0-9.-]
    path: str  # absolute
    sha256: str


@dataclass(frozen=True)
class TopologyFile:
    """A sweep's ``--topology``, as the file was when the sweep was defined."""

    path: str  # absolute
    sha256: str


@dataclass(frozen=True)
class Cell:
    """One policy replay of the sweep, at ``index`` in `SweepDefinition.cells` order."""

    index: int
    trace: TraceFile
    seed: int
    budget: str
    progress_mix: ProgressMix
    policy: str

    @property
    def key(self) -> str:
        return (
            f"{self.trace.name}_b{self.budget}_{mix_label(self.progress_mix)}"
            f"_{self.policy}_seed{self.seed}"
        )

    @property
    def reference_key(self) -> str:
        return f"{self.trace.name}_seed{self.seed}"


@dataclass(frozen=True)
class SweepDefinition:
    traces: tuple[TraceFile, ...]
    trace_format: str | None
    budgets: tuple[str, ...]
    progress_mixes: tuple[ProgressMix, ...]
    policies: tuple[str, ...]
    seeds: tuple[int, ...]
    limit_jobs: int | None
    fleet: str | None  # None: each trace's default fleet
    interval_s: float
    time_limits: TimeLimitModel = DEFAULT_TIME_LIMITS
    #: the power domains of every cell, one per sweep: ``--racks`` K:F or a ``--topology``
    racks: str | None = None
    topology: TopologyFile | None = None
    #: the serving jobs of every cell, one per sweep: ``--serving`` N:MULTIPLE and the arrivals
    serving: str | None = None
    serving_arrivals: TraceFile | None = None

    def cells(self) -> tuple[Cell, ...]:
        """Trace by trace, seed by seed: the cells of one reference replay are neighbours."""
        order = (
            (t, s, b, p, name)
            for t in self.traces
            for s in self.seeds
            for b in self.budgets
            for p in self.progress_mixes
            for name in self.policies
        )
        return tuple(Cell(i, *coordinates) for i, coordinates in enumerate(order))

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "traces": [vars(t) for t in self.traces],
            "trace_format": self.trace_format,
            "budgets": list(self.budgets),
            "progress_mixes": [str(m) for m in self.progress_mixes],
            "time_limit_model": str(self.time_limits),
            "policies": list(self.policies),
            "seeds": list(self.seeds),
            "limit_jobs": self.limit_jobs,
            "fleet": self.fleet,
            "interval_s": self.interval_s,
            "racks": self.racks,
            "topology": None if self.topology is None else vars(self.topology),
            **({} if self.serving is None else {"serving": self.serving}),
            **(
                {}
                if self.serving_arrivals is None
                else {"serving_arrivals": vars(self.serving_arrivals)}
            ),
        }

    def domains(self) -> dict[str, str]:
        """The power domains as a cell's record names them (nothing without)."""
        if self.racks is not None:
            return {"racks": self.racks}
        return {} if self.topology is None else {"topology": self.topology.path}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SweepDefinition:
        """The definition ``sweep.json`` holds. The time-limit model is one per sweep; a
        definition written before mixes and limits existed (``progress_shares``, no
        ``time_limit_model``) reads as those shares' mixes under the default model, keys
        unchanged; one written before power domains has none."""
        if data.get("version") != VERSION:
            raise InputError(f"sweep definition version {data.get('version')!r}, not {VERSION}")
        try:
            return cls(
                traces=tuple(TraceFile(**t) for t in data["traces"]),
                trace_format=data["trace_format"],
                budgets=tuple(data["budgets"]),
                progress_mixes=(
                    tuple(ProgressMix.parse(m) for m in data["progress_mixes"])
                    if "progress_mixes" in data
                    else tuple(ProgressMix.of_share(float(p)) for p in data["progress_shares"])
                ),
                time_limits=TimeLimitModel.parse(
                    data.get("time_limit_model", str(DEFAULT_TIME_LIMITS))
                ),
                policies=tuple(data["policies"]),
                seeds=tuple(int(s) for s in data["seeds"]),
                limit_jobs=data["limit_jobs"],
                fleet=data["fleet"],
                interval_s=float(data["interval_s"]),
                racks=data.get("racks"),
                topology=(
                    None if data.get("topology") is None else TopologyFile(**data["topology"])
                ),
                serving=data.get("serving"),
                serving_arrivals=(
                    None
                    if data.get("serving_arrivals") is None
                    else TraceFile(**data["serving_arrivals"])
                ),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"a sweep definition without a valid {e}") from None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _prepare(
    path: str,
    trace_format: str | None,
    limit_jobs: int | None,
    fleet_text: str | None,
    racks: str | None = None,
    topology: Topology | None = None,
    serving: Serving | None = None,
) -> tuple[Trace, FleetSpec]:
    trace = load_trace(path, trace_format)
    if limit_jobs is not None:
        trace = trace.head(limit_jobs)
    if len(trace) == 0:
        raise InputError(f"{path}: no jobs to replay")
    fleet = parse_fleet(fleet_text) if fleet_text is not None else default_fleet(trace)
    fleet = fleet if serving is None else serving.fleet(fleet)
    return trace, with_domains(fleet, racks, topology)


def define_sweep(
    trace_paths: Sequence[str],
    *,
    trace_format: str | None,
    budgets: Sequence[str],
    progress_mixes: Sequence[ProgressMix],
    policies: Sequence[str],
    seeds: Sequence[int],
    limit_jobs: int | None,
    fleet: str | None,
    interval_s: float,
    time_limits: TimeLimitModel = DEFAULT_TIME_LIMITS,
    racks: str | None = None,
    topology_path: str | None = None,
    serving: str | None = None,
    serving_arrivals: str | None = None,
) -> SweepDefinition:
    """Check what every cell will need (each trace readable and not empty, each budget on each
    trace's fleet, the power domains on each trace's fleet, the serving jobs' arrivals) and
    return the definition; nothing is written."""
    if racks is not None:
        racks = canonical_racks(racks)
    topology = None if topology_path is None else load_topology(Path(topology_path))
    served, arrivals = _serving(serving, serving_arrivals)
    if served is not None:
        serving = f"{served.jobs}:{served.multiple!r}"
        if any(p != "max-clock" and p in READS_PLANT for p in policies):
            raise InputError("policies that read the training plant do not replay serving jobs")
    traces: list[TraceFile] = []
    for path in trace_paths:
        _, trace_fleet = _prepare(path, trace_format, limit_jobs, fleet, racks, topology, served)
        for budget in budgets:
            parse_budget_w(budget, trace_fleet)
        name = _NAME_UNSAFE.sub("-", Path(path).stem) or "trace"
        if name in {t.name for t in traces}:
            raise InputError(f"two traces are named {name!r}: give each file its own name")
        absolute = Path(path).resolve()
        traces.append(TraceFile(name, str(absolute), _sha256(absolute)))
    if not traces:
        raise InputError("a sweep needs at least one --trace")
    return SweepDefinition(
        traces=tuple(traces),
        trace_format=trace_format,
        budgets=tuple(budgets),
        progress_mixes=tuple(progress_mixes),
        policies=tuple(policies),
        seeds=tuple(seeds),
        limit_jobs=limit_jobs,
        fleet=fleet,
        interval_s=float(interval_s),
        time_limits=time_limits,
        racks=racks,
        topology=(
            None
            if topology_path is None
            else TopologyFile(
                str(Path(topology_path).resolve()), _sha256(Path(topology_path).resolve())
            )
        ),
        serving=serving,
        serving_arrivals=arrivals,
    )


def _serving(text: str | None, path: str | None) -> tuple[Serving | None, TraceFile | None]:
    """``--serving`` and its arrivals file (`Arrivals.path`), as a sweep holds them."""
    if text is None:
        return None, None
    jobs, multiple = Serving.parse(text)
    absolute = Path(Arrivals.path(path)).resolve()
    served = Serving(jobs, multiple, Arrivals.load(absolute))
    return served, TraceFile(absolute.stem, str(absolute), _sha256(absolute))


# --- files ------------------------------------------------------------------------------------


def write_atomically(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """``write`` into a temp file beside ``path``, then rename it over ``path``: never half."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    text = json.dumps(data, indent=1) + "\n"
    write_atomically(path, lambda f: f.write(text.encode()))


def save_result(path: Path, result: SimulationResult) -> None:
    """Every field of ``result`` into an ``.npz`` (no pickles), atomically."""
    arrays = {f.name: np.asarray(getattr(result, f.name)) for f in fields(result)}
    write_atomically(path, lambda f: np.savez_compressed(f, **arrays))  # type: ignore[arg-type]


def load_result(path: Path) -> SimulationResult:
    """What `save_result` wrote; 0-d arrays come back as Python scalars."""
    with np.load(path, allow_pickle=False) as saved:
        values = {
            f.name: saved[f.name].item() if saved[f.name].ndim == 0 else saved[f.name]
            for f in fields(SimulationResult)
            if f.name in saved.files
        }
    try:
        return SimulationResult(**values)
    except TypeError as e:
        raise FatalError(f"{path}: not a replay of this version ({e}): delete it") from None


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` while the block runs (none where the file system has
    no locks: then two processes may compute the same file, and one rename wins)."""
    with path.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as e:
            logger.info("%s: no lock (%s); a reference may be computed twice", path, e)
        yield


@dataclass(frozen=True)
class Sweep:
    """A sweep's directory and its definition.

    ``sweep.json`` (the definition; a different one is refused), ``cells/KEY.json`` (one cell's
    coordinates and `Metrics`), ``references/TRACE_seedN.npz`` (the max-clock replay, per trace
    and seed, that `compute_metrics` counts induced misses against). Every file appears whole
    (temp file + ``os.replace``) or not at all; a cell on disk is never run again.
    """

    directory: Path
    definition: SweepDefinition

    @classmethod
    def create(cls, directory: Path, definition: SweepDefinition) -> Sweep:
        """Write ``sweep.json`` into ``directory``, or check that the one there is the same."""
        path = directory / DEFINITION_FILE
        if path.exists():
            on_disk = cls.load(directory).definition.as_dict()
            wanted = definition.as_dict()
            if on_disk != wanted:
                differ = next((k for k in wanted if on_disk.get(k) != wanted[k]), "definition")
                raise InputError(
                    f"{directory} holds another sweep (its {differ} differ): "
                    "use a new directory, or the definition that started it"
                )
        elif directory.exists() and any(directory.iterdir()):
            raise InputError(f"{directory} is not empty and holds no {DEFINITION_FILE}")
        sweep = cls(directory, definition)
        for sub in (CELLS_DIR, REFERENCES_DIR):
            (directory / sub).mkdir(parents=True, exist_ok=True)
        if not path.exists():
            _write_json(path, definition.as_dict())
        return sweep

    @classmethod
    def load(cls, directory: Path) -> Sweep:
        path = directory / DEFINITION_FILE
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise InputError(f"{path}: cannot read the sweep's definition: {e}") from None
        return cls(directory, SweepDefinition.from_dict(data))

    def cell_path(self, cell: Cell) -> Path:
        return self.directory / CELLS_DIR / f"{cell.key}.json"

    def reference_path(self, cell: Cell) -> Path:
        return self.directory / REFERENCES_DIR / f"{cell.reference_key}.npz"

    def pending(self) -> list[Cell]:
        """The cells not on disk yet, in order."""
        return [c for c in self.definition.cells() if not self.cell_path(c).exists()]

    def records(self) -> tuple[list[dict[str, Any]], list[Cell]]:
        """Every cell on disk (in order) and the cells missing."""
        found: list[dict[str, Any]] = []
        missing: list[Cell] = []
        for cell in self.definition.cells():
            try:
                found.append(json.loads(self.cell_path(cell).read_text()))
            except FileNotFoundError:
                missing.append(cell)
        return found, missing


# --- running cells ----------------------------------------------------------------------------


class _Traces:
    """The traces (limited) and fleets one process has loaded, checked against the definition."""

    def __init__(self, definition: SweepDefinition) -> None:
        self.definition = definition
        self.loaded: dict[str, tuple[Trace, FleetSpec]] = {}
        self.topology: Topology | None = None
        self.serving: Serving | None = None

    def get(self, trace: TraceFile) -> tuple[Trace, FleetSpec]:
        """The trace and its fleet, under the sweep's power domains."""
        if trace.name not in self.loaded:
            if _sha256(Path(trace.path)) != trace.sha256:
                raise InputError(f"{trace.path} changed since the sweep was defined")
            d = self.definition
            if d.topology is not None and self.topology is None:
                if _sha256(Path(d.topology.path)) != d.topology.sha256:
                    raise InputError(f"{d.topology.path} changed since the sweep was defined")
                self.topology = load_topology(Path(d.topology.path))
            if d.serving_arrivals is not None and self.serving is None:
                if _sha256(Path(d.serving_arrivals.path)) != d.serving_arrivals.sha256:
                    raise InputError(
                        f"{d.serving_arrivals.path} changed since the sweep was defined"
                    )
                self.serving = _serving(d.serving, d.serving_arrivals.path)[0]
            self.loaded[trace.name] = _prepare(
                trace.path,
                d.trace_format,
                d.limit_jobs,
                d.fleet,
                d.racks,
                self.topology,
                self.serving,
            )
        return self.loaded[trace.name]


def _reference(sweep: Sweep, cell: Cell, traces: _Traces) -> SimulationResult:
    """The max-clock replay of the cell's trace and seed: from disk, else computed and saved.

    It depends on neither budget (max clocks ignore it; `compute_metrics` reads only its
    finish times and deadlines) nor progress mix (run at the default) nor power domains (run
    without: it records no per-node power); it has the sweep's time limits and serving jobs.
    """
    path = sweep.reference_path(cell)
    if path.exists():
        return load_result(path)
    with _exclusive(path.with_suffix(".lock")):
        if path.exists():  # another process computed it while this one waited
            return load_result(path)
        trace, fleet = traces.get(cell.trace)
        simulator = Simulator(
            trace,
            replace(fleet, topology=None),
            fleet.max_power_w,
            interval_s=sweep.definition.interval_s,
            seed=cell.seed,
            serving=traces.serving,
            **simulator_options(ProgressMix(), sweep.definition.time_limits),
        )
        result = simulator.run(make_policy("max-clock"))
        save_result(path, result)
        logger.info("reference %s: %.1f s", cell.reference_key, result.wall_s)
        return result


def _run_cell(sweep: Sweep, cell: Cell, traces: _Traces) -> None:
    reference = _reference(sweep, cell, traces)
    trace, fleet = traces.get(cell.trace)
    budget_w = parse_budget_w(cell.budget, fleet)
    simulator = Simulator(
        trace,
        fleet,
        budget_w,
        interval_s=sweep.definition.interval_s,
        seed=cell.seed,
        serving=traces.serving,
        **simulator_options(cell.progress_mix, sweep.definition.time_limits),
    )
    result = simulator.run(make_policy(cell.policy))
    record = {
        "key": cell.key,
        "trace": cell.trace.name,
        "budget": cell.budget,
        "progress_share": cell.progress_mix.share,
        "progress_mix": str(cell.progress_mix),
        "seed": cell.seed,
        "fleet": str(fleet),
        "interval_s": sweep.definition.interval_s,
        "limit_jobs": sweep.definition.limit_jobs,
        **sweep.definition.domains(),
        **({} if sweep.definition.serving is None else {"serving": sweep.definition.serving}),
        **compute_metrics(result, reference).as_dict(),
        "wall_s": result.wall_s,
    }
    _write_json(sweep.cell_path(cell), record)
    logger.info("cell %s: %.1f s", cell.key, result.wall_s)


def run_cells(
    directory: Path,
    indices: Sequence[int],
    *,
    references_only: bool = False,
    progress: Callable[[], None] | None = None,
) -> int:
    """Run the cells at ``indices`` that are not on disk yet, here; how many ran.

    ``references_only``: only make sure their reference replays are on disk.
    """
    sweep = Sweep.load(directory)
    cells = sweep.definition.cells()
    for index in indices:
        if not 0 <= index < len(cells):
            raise InputError(f"the sweep has cells 0-{len(cells) - 1}, not {index}")
    traces = _Traces(sweep.definition)
    ran = 0
    for index in indices:
        cell = cells[index]
        if references_only:
            _reference(sweep, cell, traces)
        elif not sweep.cell_path(cell).exists():
            _run_cell(sweep, cell, traces)
            ran += 1
        if progress is not None:
            progress()
    return ran


def _ignore_sigint() -> None:
    # the parent alone answers Ctrl-C (it terminates the pool), so workers print no tracebacks
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _pool_task(task: tuple[str, bool, int]) -> bool:
    directory, references_only, index = task
    run_cells(Path(directory), [index], references_only=references_only)
    return references_only


def run_local(
    sweep: Sweep,
    cells: Sequence[Cell],
    workers: int,
    progress: Callable[[], None] | None = None,
) -> None:
    """Run ``cells`` on ``workers`` processes (in this one when 1); ``progress()`` per cell.

    The references missing are queued first, one task each, so cells seldom wait on them.
    """
    if workers <= 1 or len(cells) <= 1:
        run_cells(sweep.directory, [c.index for c in cells], progress=progress)
        return
    first: dict[str, Cell] = {}
    for cell in cells:
        if not sweep.reference_path(cell).exists():
            first.setdefault(cell.reference_key, cell)
    directory = str(sweep.directory)
    tasks = [(directory, True, c.index) for c in first.values()]
    tasks += [(directory, False, c.index) for c in cells]
    context = multiprocessing.get_context("spawn")
    pool = context.Pool(min(workers, len(cells)), initializer=_ignore_sigint)
    try:
        for references_only in pool.imap_unordered(_pool_task, tasks, chunksize=1):
            if not references_only and progress is not None:
                progress()
    except BaseException:
        pool.terminate()
        raise
    else:
        pool.close()
    finally:
        pool.join()


# --- the table --------------------------------------------------------------------------------


def record_mix(record: Mapping[str, Any]) -> str:
    """A cell record's progress mix (records made before mixes hold only a share)."""
    mix = record.get("progress_mix")
    return str(mix) if mix is not None else str(ProgressMix.of_share(record["progress_share"]))


def aggregate(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per trace × budget × progress mix × policy, over its seeds: Σ violations and
    induced violations, max power MAE and over-budget share, mean energy; with power domains
    the max over seeds of the worst domain's over-limit share; with serving jobs the mean over
    seeds of their SLO attainment and serving energy."""
    groups: dict[tuple[str, str, str, str], list[Mapping[str, Any]]] = {}
    for r in records:
        key = (r["trace"], r["budget"], record_mix(r), r["policy"])
        groups.setdefault(key, []).append(r)
    rows = []
    for (trace, budget, mix, policy), group in groups.items():
        mae = [r["power_mae_pct"] for r in group if r["power_mae_pct"] is not None]
        induced = [r["violations_induced"] for r in group]
        domain_over = [
            r["domain_over_limit_intervals_pct"]
            for r in group
            if r.get("domain_over_limit_intervals_pct") is not None
        ]
        rows.append(
            {
                "trace": trace,
                "budget": budget,
                "budget_w": group[0]["budget_w"],
                "progress_share": ProgressMix.parse(mix).share,
                "progress_mix": mix,
                "policy": policy,
                "seeds": sorted(r["seed"] for r in group),
                "violations": sum(r["violations"] for r in group),
                "violations_induced": None if None in induced else sum(induced),
                "power_mae_pct": max(mae) if mae else None,
                "over_budget_intervals_pct": max(r["over_budget_intervals_pct"] for r in group),
                "killed_at_time_limit": sum(r.get("killed_at_time_limit", 0) for r in group),
                "energy_kwh": sum(r["energy_kwh"] for r in group) / len(group),
                **({"domain_over_limit_intervals_pct": max(domain_over)} if domain_over else {}),
                **_serving_means(group),
            }
        )
    return rows


def _serving_means(group: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Means over seeds of the serving metrics (nothing without serving jobs)."""
    if not all(r.get("serving_jobs") for r in group):
        return {}
    values = {k: [r[k] for r in group if r[k] is not None] for k in SERVING_MEANS}
    return {k: sum(v) / len(v) if v else None for k, v in values.items()}
