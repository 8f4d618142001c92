"""Trace-driven cluster simulator (`Simulator`): FIFO placement, control loop, calibrated plant.

Policies see a `ClusterView`, never the plant; only a `PlantPolicy` is handed it. Design:
DESIGN.md, "Simulator"; tests: `tests/unit/test_sim_cluster.py`,
`tests/unit/test_sim_policies.py`.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Final

import numpy as np
import numpy.typing as npt

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.gpu.catalog import GpuSpec, catalog_spec
from slurm_cdgpc.gpu.plant import (
    Plant,
    PlantState,
    WorkloadArrays,
    draw_workloads,
    hardware_calibration,
)
from slurm_cdgpc.sim.colocation import draw_pair_throughput, throughput_factors
from slurm_cdgpc.sim.fleet import FleetSpec
from slurm_cdgpc.sim.mig import draw_slice_speed, slice_milli, slice_sevenths
from slurm_cdgpc.sim.reporting import (
    DEFAULT_TIME_LIMITS,
    NONE,
    REPORTED,
    STEPS,
    ProgressMix,
    TimeLimitModel,
)
from slurm_cdgpc.sim.serving import Serving, ServingReplay, ServingState
from slurm_cdgpc.sim.sharing import SharedGpus, shared_step
from slurm_cdgpc.sim.traces import WHOLE_GPU, StrArray, Trace

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

_WORKLOAD_FIELDS = tuple(WorkloadArrays.__dataclass_fields__)


@dataclass(frozen=True)
class ClusterView:
    """Everything a policy may know at the start of an interval (no reference to the plant).

    Job rows: the previous view's rows still running (``kept`` over them), in order, then the
    ``started`` jobs placed this interval. Measurements are the last interval's means as node
    agents report them (noisy); NaN for jobs that started this interval. Serving jobs
    (`slurm_cdgpc.sim.serving`) are the first rows, from the first interval on: their
    ``job_id`` is −1 − k, they have no deadline, limit or iterations, and their
    ``iteration_s`` is the latency at their objective's percentile.
    """

    now_s: float
    interval_s: float
    budget_w: float
    specs: tuple[GpuSpec, ...]  # GPU types (catalog data), indexed by job_type / node_type
    kept: BoolArray  # over the previous view's rows
    started: int
    job_id: IntArray  # the job's row in the trace
    job_gpus: IntArray
    job_type: IntArray
    job_nodes: IntArray  # (jobs, nodes): GPUs of each job on each node
    submit_s: FloatArray
    start_s: FloatArray
    deadline_s: FloatArray  # NaN: none
    time_limit_s: FloatArray  # Slurm's, from the start; NaN: none (UNLIMITED)
    iterations: FloatArray  # total, as the job reports it
    remaining_iterations: FloatArray  # as the job reports its progress
    iterations_done: FloatArray  # steps done, as the job reports them
    graphics_mhz: FloatArray  # applied clock
    memory_mhz: FloatArray
    power_w: FloatArray  # mean per GPU
    iteration_s: FloatArray
    power_capped: BoolArray
    node_type: IntArray
    node_gpus: IntArray
    node_power_w: FloatArray  # measured mean per node over the last interval (NaN: none yet)
    idle_power_w: float  # GPUs without a job, at their idle power
    queued_jobs: int
    queued_gpus: int
    #: serving jobs' latency objective (s) at their percentile, NaN for training jobs; None
    #: when no job serves (`JobState.objective_s`)
    objective_s: FloatArray | None = None
    #: the shared GPU a job holds part of (`slurm_cdgpc.sim.sharing`): an id, the same for its
    #: tenants, or −1 for a job on whole GPUs; None when no job shares
    shared_gpu: IntArray | None = None
    #: every GPU is in MIG mode (`slurm_cdgpc.sim.mig`): clocks cannot be locked, a power
    #: limit is the only setpoint that acts
    mig: bool = False
    #: each job's name as Slurm has it (the trace's model name; "": none), for the kind prior
    #: (`JobEstimator.add_jobs`); None when the trace names none
    job_name: StrArray | None = None

    def __post_init__(self) -> None:
        # read-only views: a policy cannot write into the simulator's state
        for name, value in vars(self).items():
            if isinstance(value, np.ndarray):
                frozen = value.view()
                frozen.setflags(write=False)
                object.__setattr__(self, name, frozen)

    def __len__(self) -> int:
        return int(self.job_gpus.shape[0])

    @property
    def busy_gpus(self) -> int:
        return round(float(self.gpus_held.sum()))

    @property
    def gpus_held(self) -> FloatArray:
        """Per job, the physical GPUs that are its own: its GPUs, or 1 / tenants of a shared
        one (so that sums over jobs count every GPU once)."""
        gpus = self.job_gpus.astype(np.float64)
        if self.shared_gpu is None:
            return gpus
        shared = self.shared_gpu >= 0
        _, where, count = np.unique(self.shared_gpu, return_inverse=True, return_counts=True)
        return np.where(shared, 1.0 / count[where.reshape(-1)], gpus)

    def node_busy_gpus(self) -> FloatArray:
        """Per node, its GPUs that run jobs (a shared GPU once)."""
        held: FloatArray = self.job_nodes.T @ (self.gpus_held / self.job_gpus)
        return held

    def rows(
        self, keep: BoolArray, kept: BoolArray, started: int, **changes: object
    ) -> ClusterView:
        """The view of the rows ``keep`` only, whose previous rows are ``kept`` over the
        previous view of those rows and of which the last ``started`` are new."""
        per_job = {
            name: getattr(self, name)[keep]
            for name in JOB_FIELDS
            if getattr(self, name) is not None
        }
        fields = {**per_job, **changes, "kept": kept, "started": started}
        return replace(self, **fields)  # type: ignore[arg-type]


#: `ClusterView`'s fields with one value per job row
JOB_FIELDS: Final = (
    "job_id",
    "job_gpus",
    "job_type",
    "job_nodes",
    "submit_s",
    "start_s",
    "deadline_s",
    "time_limit_s",
    "iterations",
    "remaining_iterations",
    "iterations_done",
    "graphics_mhz",
    "memory_mhz",
    "power_w",
    "iteration_s",
    "power_capped",
    "objective_s",
    "shared_gpu",
    "job_name",
)


@dataclass(frozen=True)
class Setpoints:
    """A policy's answer, per job row of the view; None means "leave at default"."""

    graphics_mhz: FloatArray | None = None  # clock lock; NaN = top clock
    memory_mhz: FloatArray | None = None
    limit_w: FloatArray | None = None  # per-GPU power limit; NaN = default


class Policy:
    """Decides setpoints from a `ClusterView`. Subclasses keep their own per-job state aligned
    with the view's rows (``view.kept``, ``view.started``)."""

    name = "policy"

    def start(self, fleet: FleetSpec, budget_w: float, interval_s: float) -> None:
        """Called once before the first interval."""

    def decide(self, view: ClusterView) -> Setpoints:
        raise NotImplementedError


class PlantPolicy(Policy):
    """A policy that reads the true plant (the oracle). The simulator hands the plant of the
    running jobs, rows aligned with the view, to these policies only."""

    def decide(self, view: ClusterView) -> Setpoints:
        raise InputError(f"policy {self.name!r} needs the plant: use decide_with_plant")

    def decide_with_plant(self, view: ClusterView, plant: Plant) -> Setpoints:
        raise NotImplementedError


@dataclass(frozen=True)
class SimulationResult:
    """One replay: per job (trace order) and per simulated interval."""

    policy: str
    fleet: str
    fleet_gpus: int
    budget_w: float
    interval_s: float
    # per job
    submit_s: FloatArray
    duration_s: FloatArray  # at max clocks (the trace's)
    deadline_s: FloatArray
    num_gpu: IntArray
    start_s: FloatArray  # NaN: never started (rejected)
    finish_s: FloatArray
    rejected: BoolArray
    # per simulated interval (intervals with jobs running)
    t_s: FloatArray  # interval start
    power_w: FloatArray  # cluster mean over the interval (idle GPUs included)
    demand_w: FloatArray  # what the running jobs would draw at max clocks (idle included)
    controller_s: FloatArray  # the policy's decide time
    energy_j: float  # the whole run, skipped idle gaps included
    wall_s: float
    #: per job: the trace's class (strict, soft, best-effort; "" when the trace has none)
    job_type: npt.NDArray[np.str_] = field(default_factory=lambda: np.zeros(0, dtype=str))
    #: per job: killed by Slurm at its time limit (empty in replays made before limits)
    killed: BoolArray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    #: with power domains (`FleetSpec.topology`): per simulated interval and node, its true
    #: mean power (idle GPUs included), float32 (intervals, nodes); no intervals without
    node_power_w: npt.NDArray[np.float32] = field(
        default_factory=lambda: np.zeros((0, 0), dtype=np.float32)
    )
    #: (domains, nodes): the nodes under each domain (`FleetSpec.domain_nodes`); each
    #: domain's limit (domains,)
    domain_nodes: BoolArray = field(default_factory=lambda: np.zeros((0, 0), dtype=bool))
    domain_limit_w: FloatArray = field(default_factory=lambda: np.zeros(0))
    #: serving jobs (`slurm_cdgpc.sim.serving`): each one's objective (S,); per simulated
    #: interval and job its true latency at the objective's percentile (NaN: no request) and
    #: its clock over its top clock (intervals, S); their energy over the replay
    serving_objective_s: FloatArray = field(default_factory=lambda: np.zeros(0))
    serving_latency_s: FloatArray = field(default_factory=lambda: np.zeros((0, 0)))
    serving_clock: FloatArray = field(default_factory=lambda: np.zeros((0, 0)))
    serving_energy_j: float = 0.0
    #: per simulated interval: the GPUs that jobs share, and their tenants (empty: none shares)
    shared_gpus: FloatArray = field(default_factory=lambda: np.zeros(0))
    tenants: FloatArray = field(default_factory=lambda: np.zeros(0))


@dataclass(frozen=True)
class Workloads:
    """Every trace job's workload on every GPU type of the fleet, and its iterations.

    ``fields[name]`` has shape (types, jobs). Drawn once per seed, so every policy replays the
    same jobs.
    """

    fields: dict[str, FloatArray]
    iterations: FloatArray
    slowness: FloatArray  # per type: relative iteration time (the slowest paces a mixed job)

    def on(self, types: IntArray, rows: IntArray) -> WorkloadArrays:
        return WorkloadArrays(*(self.fields[f][types, rows] for f in _WORKLOAD_FIELDS))


def draw_trace_workloads(trace: Trace, specs: tuple[GpuSpec, ...], seed: int) -> Workloads:
    """Workloads per job and GPU type such that iterations × T(max clocks) = duration.

    Iterations come from the trace; where missing, duration / a drawn iteration time (on the
    first type). T(f) of the plant scales with the workload's base time, so one plant step at
    max clocks gives the factor that makes the time at max clocks (default limit) match.
    """
    n = len(trace)
    rng = np.random.default_rng(seed)
    names = [str(m) for m in trace.model_name]
    fields: dict[str, list[FloatArray]] = {f: [] for f in _WORKLOAD_FIELDS}
    iterations = np.asarray(trace.iterations, dtype=np.float64).copy()
    for k, spec in enumerate(specs):
        drawn = draw_workloads(n, spec, rng, model_names=names)
        if k == 0:
            missing = ~(np.isfinite(iterations) & (iterations > 0))
            iterations[missing] = trace.duration_s[missing] / drawn.iteration_time_s[missing]
        unit = WorkloadArrays(np.ones(n), *(getattr(drawn, f) for f in _WORKLOAD_FIELDS[1:]))
        t_top = Plant.of(spec, unit).step(spec.max_graphics_mhz).iteration_time_s
        # T0 = (duration / iterations) / T_top(T0 = 1); zero-length jobs keep the drawn time
        per_iter = np.divide(
            trace.duration_s,
            iterations,
            out=np.zeros(n),
            where=iterations > 0,
        )
        base = np.where(per_iter > 0, per_iter / t_top, drawn.iteration_time_s)
        fields["iteration_time_s"].append(base)
        for f in _WORKLOAD_FIELDS[1:]:
            fields[f].append(getattr(drawn, f))
    iterations = np.where(trace.duration_s > 0, iterations, 0.0)
    slowness = np.array([hardware_calibration(s).relative_time for s in specs])
    return Workloads({f: np.stack(v) for f, v in fields.items()}, iterations, slowness)


@dataclass
class _Running:
    """Rows of the running jobs, all arrays aligned."""

    rows: IntArray
    types: IntArray
    gpus: IntArray
    alloc: IntArray  # (jobs, nodes)
    remaining: FloatArray
    # last interval's measurement (NaN for new rows)
    graphics_mhz: FloatArray
    memory_mhz: FloatArray
    power_w: FloatArray
    iteration_s: FloatArray
    power_capped: BoolArray
    shared: IntArray  # the shared GPU's id, −1: whole GPUs

    def select(self, keep: BoolArray) -> _Running:
        return _Running(*(getattr(self, f)[keep] for f in self.__dataclass_fields__))


class _Served:
    """The serving jobs of one replay: what they showed last interval, and what they did."""

    def __init__(self, replay: ServingReplay, nodes: IntArray, types: IntArray, seed: int) -> None:
        self.replay = replay
        self.nodes = nodes  # (S, nodes)
        self.types = types
        self.rng = np.random.default_rng([seed, 2])  # apart from the training jobs' noise
        nan = np.full(replay.jobs, np.nan)
        self.seen = ServingState(nan, nan, nan, np.zeros(replay.jobs, dtype=bool))
        self.memory_mhz = nan
        self.latency: list[FloatArray] = []
        self.clock: list[FloatArray] = []
        self.energy_j = 0.0

    def prepend(self, view: ClusterView, first: bool) -> ClusterView:
        """``view`` with the serving jobs as its first rows (new in the first interval)."""
        s = self.replay.jobs
        nan = np.full(s, np.nan)
        heads: dict[str, npt.NDArray[np.generic]] = {
            "job_id": -1 - np.arange(s),
            "job_gpus": np.ones(s, dtype=np.int64),
            "job_type": self.types,
            "job_nodes": self.nodes,
            "submit_s": nan,
            "start_s": nan,
            "deadline_s": nan,
            "time_limit_s": nan,
            "iterations": nan,
            "remaining_iterations": nan,
            "iterations_done": nan,
            "graphics_mhz": self.seen.applied_mhz,
            "memory_mhz": self.memory_mhz,
            "power_w": self.seen.power_w,
            "iteration_s": self.seen.latency_s,
            "power_capped": self.seen.power_capped,
        }
        if view.shared_gpu is not None:
            heads["shared_gpu"] = np.full(s, -1, dtype=np.int64)
        if view.job_name is not None:
            heads["job_name"] = np.full(s, "", dtype=view.job_name.dtype)
        rows = {k: np.concatenate([v, getattr(view, k)]) for k, v in heads.items()}
        objective = np.concatenate([self.replay.objective_s, np.full(len(view), np.nan)])
        kept = view.kept if first else np.concatenate([np.ones(s, dtype=bool), view.kept])
        started = view.started + (s if first else 0)
        return replace(view, kept=kept, started=started, objective_s=objective, **rows)  # type: ignore[arg-type]

    def split(self, sp: Setpoints) -> tuple[Setpoints, Setpoints]:
        """A policy's answer on the prepended view: the serving jobs', the training jobs'."""
        s = self.replay.jobs

        def part(values: FloatArray | None, rows: slice) -> FloatArray | None:
            return None if values is None else values[rows]

        head, tail = slice(0, s), slice(s, None)
        return (
            Setpoints(*(part(v, head) for v in (sp.graphics_mhz, sp.memory_mhz, sp.limit_w))),
            Setpoints(*(part(v, tail) for v in (sp.graphics_mhz, sp.memory_mhz, sp.limit_w))),
        )

    def step(self, interval: int, sp: Setpoints, dt: float) -> ServingState:
        """Interval number ``interval`` at ``sp``: the truth, recorded; ``seen`` is measured."""
        nan = np.full(self.replay.jobs, np.nan)
        clock = nan if sp.graphics_mhz is None else sp.graphics_mhz
        limit = nan if sp.limit_w is None else sp.limit_w
        truth = self.replay.step(interval, clock, limit)
        self.seen = self.replay.observe(truth, self.rng)
        self.memory_mhz = np.full(self.replay.jobs, self.replay.memory_mhz)
        self.latency.append(truth.latency_s)
        self.clock.append(truth.applied_mhz / self.replay.top_mhz)
        self.energy_j += float(truth.power_w.sum()) * dt
        return truth

    def top_w(self, interval: int) -> float:
        """What they would draw at top clocks and default limits this interval."""
        nan = np.full(self.replay.jobs, np.nan)
        return float(self.replay.step(interval, nan, nan).power_w.sum())

    def result(self, result: SimulationResult) -> SimulationResult:
        """``result`` with its serving fields."""
        s = self.replay.jobs
        return replace(
            result,
            serving_objective_s=self.replay.objective_s,
            serving_latency_s=np.array(self.latency).reshape(-1, s),
            serving_clock=np.array(self.clock).reshape(-1, s),
            serving_energy_j=self.energy_j,
        )


class Simulator:
    """Replays `trace` on `fleet` under one policy.

    Every ``interval_s`` (one control interval, default 60 s), at the interval's start ``t``:

    1. jobs submitted at or before ``t`` join the queue (so a job waits for the next boundary);
       a job asking for more GPUs than the whole fleet is rejected and counted, never queued;
    2. strict FIFO first-fit (`_place`): the first job that does not fit blocks every job
       behind it. A job of g ≤ GPUs-per-node GPUs takes the first node with g free GPUs; a
       larger job takes ⌈g / n⌉ entirely free nodes, first within one node group, else across
       groups in order (the last node holds the remainder). A job that names GPU types goes
       only on nodes of those types (`allowed_nodes`). A job that asks for part of one GPU
       (`Trace.gpu_milli`) goes onto the oldest shared GPU with room for it, else opens one
       (`slurm_cdgpc.sim.sharing`: what tenants of one GPU draw and how fast they run);
    3. the policy sees a `ClusterView` (measurements of the last interval, GPU counts and types,
       deadlines, reported progress, the budget) and returns `Setpoints`; what a job reports
       follows its progress source (`_as_seen`), and every job but a ``none`` one has a Slurm
       time limit (the trace's, else drawn from a `TimeLimitModel`);
    4. the plant runs every job for the interval at its applied clock. A job's workload is drawn
       per GPU type from its model name (`draw_trace_workloads`), its iteration time scaled so
       that iterations × time per iteration at max clocks is the trace's duration; a job
       spanning GPU types runs as its slowest type;
    5. progress: ΔR = Δt / T; a job with R ≤ Δt / T finishes at t + R·T (interpolated), its
       GPUs draw idle power for the rest of the interval and are free at the next boundary. A
       job still running at start + time limit is killed there, as Slurm does
       (`SimulationResult.killed`);
    6. cluster power over the interval: busy GPUs at plant power, idle GPUs at idle power;
       with power domains (``fleet.topology``) the same per node is recorded too.

    Intervals with nothing running or queued are skipped (their idle energy is still counted),
    unless jobs serve. Measurements are interval means with seeded noise (`Plant.observe`);
    Hopper's 1 s power averaging does not matter at interval means and is not modelled here.

    With ``serving``, that many serving jobs hold the fleet's last GPUs, one each, from the
    first interval to the last (`Serving.fleet` adds nodes for them), and are the view's first
    rows; their latency and power come from `ServingReplay`, and they count in the cluster's
    power and energy like any job. The oracle reads the training plant alone, so it cannot
    replay them.
    """

    def __init__(
        self,
        trace: Trace,
        fleet: FleetSpec,
        budget_w: float,
        *,
        interval_s: float = 60.0,
        seed: int = 0,
        workloads: Workloads | None = None,
        progress_share: float | None = None,
        progress_mix: ProgressMix | None = None,
        time_limits: TimeLimitModel = DEFAULT_TIME_LIMITS,
        serving: Serving | None = None,
        mig: bool = False,
    ) -> None:
        if not budget_w > 0 or not math.isfinite(budget_w):
            raise InputError(f"the power budget must be a positive number of watts, got {budget_w}")
        if progress_share is not None:
            if progress_mix is not None:
                raise InputError("give a progress share or a progress mix, not both")
            progress_mix = ProgressMix.of_share(progress_share)
        if not interval_s > 0:
            raise InputError(f"the control interval must be positive, got {interval_s}")
        self.trace = trace
        self.fleet = fleet
        self.budget_w = float(budget_w)
        self.interval_s = float(interval_s)
        self.seed = seed
        self.specs = fleet.specs
        self.workloads = workloads or draw_trace_workloads(trace, self.specs, seed)
        #: per trace job: its progress source and time limit (drawn once, so every policy
        #: sees the same); the trace's own limit where it has one
        self.progress_mix = progress_mix or ProgressMix()
        self.time_limits = time_limits
        self.source = self.progress_mix.draw(len(trace), seed)
        self.reports_progress = self.source == REPORTED
        #: every GPU in MIG mode: a sharing job holds its profile's sevenths and runs at its
        #: slice's speed (`slurm_cdgpc.sim.mig`), alone or not; its user knows that speed and
        #: asks for a time limit on its run time there
        self.mig = mig
        self.gpu_milli = np.asarray(trace.gpu_milli, dtype=np.int64)
        self.slice_speed = np.ones(len(trace))
        if mig:
            sevenths = slice_sevenths(self.gpu_milli)
            self.gpu_milli = slice_milli(self.gpu_milli)
            self.slice_speed = draw_slice_speed(sevenths, np.random.default_rng([seed, 7]))
        run_s = np.asarray(trace.duration_s, dtype=np.float64) / self.slice_speed
        drawn = time_limits.draw(run_s, seed)
        limit_s = np.where(np.isfinite(trace.time_limit_s), trace.time_limit_s, drawn)
        self.time_limit_s = np.where(self.source == NONE, np.nan, limit_s)
        self.node_type = fleet.node_type
        self.node_gpus = fleet.node_gpus
        self.node_group = np.concatenate(
            [np.full(g.nodes, k, dtype=np.int64) for k, g in enumerate(fleet.groups)]
        )
        self.idle_w_by_type = np.array([s.idle_power_w for s in self.specs])
        self.max_mhz_by_type = np.array([float(s.max_graphics_mhz) for s in self.specs])
        #: per trace job: the thousandths of a GPU a sharing job asks for (1000: whole GPUs;
        #: in MIG mode its profile's, above), and the combined throughput its GPU's tenants
        #: reach with it (`sim.colocation`)
        self.combined = draw_pair_throughput(len(trace), np.random.default_rng([seed, 3]))
        self.sharing = bool(np.any(self.gpu_milli < WHOLE_GPU))
        self.serving = serving
        #: (S, nodes): the serving jobs' GPUs, the fleet's last ones
        count = 0 if serving is None else serving.jobs
        if count > int(self.node_gpus.sum()):
            raise InputError(f"{count} serving jobs need more GPUs than the fleet has")
        gpu_node = np.repeat(np.arange(self.node_gpus.size), self.node_gpus)
        gpu_node = gpu_node[gpu_node.size - count :]
        self.serving_nodes = np.zeros((count, self.node_gpus.size), dtype=np.int64)
        self.serving_nodes[np.arange(count), gpu_node] = 1
        self.serving_types = self.node_type[gpu_node]
        if np.unique(self.serving_types).size > 1:
            raise InputError("the serving jobs' GPUs must be of one type: the fleet's last GPUs")
        self.serving_replay = (
            None
            if serving is None
            else ServingReplay(serving, self.specs[int(self.serving_types[0])], self.interval_s)
        )

    def _as_seen(self, view: ClusterView) -> ClusterView:
        """The view as a live head has it, by each job's progress source: ``steps`` shows no
        total or remaining work, ``time-limit`` and ``none`` no iteration time either."""
        source = self.source[view.job_id]
        if np.all(source == REPORTED):
            return view
        no_total = source != REPORTED
        silent = no_total & (source != STEPS)
        return replace(
            view,
            iterations=np.where(no_total, np.nan, view.iterations),
            remaining_iterations=np.where(no_total, np.nan, view.remaining_iterations),
            iterations_done=np.where(silent, np.nan, view.iterations_done),
            iteration_s=np.where(silent, np.nan, view.iteration_s),
        )

    # --- placement -------------------------------------------------------------------------

    def allowed_nodes(self) -> tuple[BoolArray, IntArray]:
        """Per job, the nodes it may run on (trace ``gpu_type``), as (masks, job → mask row).

        One mask per distinct ``gpu_type``: a job names few types and traces repeat them.
        """
        names = [s.name for s in self.specs]
        wanted, inverse = np.unique(self.trace.gpu_type, return_inverse=True)
        masks = np.ones((len(wanted), self.node_gpus.shape[0]), dtype=bool)
        unmatched = 0
        for row, text in enumerate(wanted):
            if not text:
                continue
            types = set()
            for name in str(text).split("|"):
                try:
                    types.add(catalog_spec(name).name)
                except InputError:
                    continue
            kinds = [k for k, name in enumerate(names) if name in types]
            if kinds:
                masks[row] = np.isin(self.node_type, kinds)
            else:
                unmatched += int(np.sum(inverse == row))
        if unmatched:
            logger.info(
                "%d jobs ask for GPU types this fleet (%s) lacks: placed on any GPU",
                unmatched,
                ", ".join(names),
            )
        return masks, inverse.astype(np.int64).reshape(-1)

    def _place(self, gpus: int, free: IntArray, allowed: BoolArray) -> IntArray | None:
        """GPUs taken on each node by first-fit, or None when the job does not fit now."""
        take = np.zeros_like(free)
        fits = np.flatnonzero((free >= gpus) & (self.node_gpus >= gpus) & allowed)
        if fits.size:
            take[fits[0]] = gpus
            return take
        whole = (free == self.node_gpus) & allowed
        for group in [*np.unique(self.node_group[allowed]), None]:
            pick = np.flatnonzero(whole if group is None else whole & (self.node_group == group))
            if pick.size == 0:
                continue
            cum = np.cumsum(self.node_gpus[pick])
            k = int(np.searchsorted(cum, gpus, side="left"))
            if k < pick.size:
                take[pick[:k]] = self.node_gpus[pick[:k]]
                take[pick[k]] = gpus - (int(cum[k - 1]) if k else 0)
                return take
        return None

    # --- the loop --------------------------------------------------------------------------

    def run(
        self, policy: Policy, progress: Callable[[int], None] | None = None
    ) -> SimulationResult:
        """Replay the whole trace under ``policy``; ``progress(n)`` gets jobs done so far."""
        wall0 = time.perf_counter()
        trace, wl, dt = self.trace, self.workloads, self.interval_s
        n = len(trace)
        n_nodes = self.node_gpus.shape[0]
        total_gpus = int(self.node_gpus.sum())
        rng = np.random.default_rng([self.seed, 1])
        served = None
        if self.serving_replay is not None:
            if isinstance(policy, PlantPolicy):
                raise InputError(
                    f"policy {policy.name!r} reads the training plant: not with serving"
                )
            served = _Served(self.serving_replay, self.serving_nodes, self.serving_types, self.seed)
        if self.sharing and isinstance(policy, PlantPolicy):
            raise InputError(
                f"policy {policy.name!r} reads the plant of whole GPUs: not with shared ones"
            )
        if self.mig and isinstance(policy, PlantPolicy):
            raise InputError(f"policy {policy.name!r} locks clocks: not with GPUs in MIG mode")
        shared = SharedGpus()
        policy.start(self.fleet, self.budget_w, dt)
        start_s = np.full(n, np.nan)
        finish_s = np.full(n, np.nan)
        killed = np.zeros(n, dtype=bool)
        masks, mask_of = self.allowed_nodes()
        names = trace.model_name if np.any(trace.model_name != "") else None
        # a job that never fits: more than one node with room and more than the whole nodes
        # (a node with serving GPUs is never whole) of the types it asks for
        serving_gpus = self.serving_nodes.sum(axis=0)
        room = np.where(masks, self.node_gpus - serving_gpus, 0).max(axis=1)[mask_of]
        whole = np.where(serving_gpus > 0, 0, self.node_gpus)
        allowed_gpus = (masks * whole[None, :]).sum(axis=1)[mask_of]
        rejected = (trace.num_gpu > allowed_gpus) & (trace.num_gpu > room)
        if rejected.any():
            logger.info(
                "%d jobs need more GPUs than the fleet's %d (of the types they ask for)",
                rejected.sum(),
                total_gpus,
            )
        free = self.node_gpus - serving_gpus
        node_power_w = np.full(n_nodes, np.nan)
        empty_f, empty_i = np.zeros(0), np.zeros(0, dtype=np.int64)
        run = _Running(
            empty_i,
            empty_i,
            empty_i,
            np.zeros((0, n_nodes), dtype=np.int64),
            empty_f,
            empty_f,
            empty_f,
            empty_f,
            empty_f,
            np.zeros(0, dtype=bool),
            empty_i,
        )
        kept = np.zeros(0, dtype=bool)
        queue: deque[int] = deque()
        queued_gpus = 0
        next_job = 0  # next trace row not yet submitted
        done = int(rejected.sum())
        plant: Plant | None = None
        tenants: Plant | None = None  # the plant of the rows that share GPUs
        t_rec: list[float] = []
        p_rec: list[float] = []
        d_rec: list[float] = []
        c_rec: list[float] = []
        topology = self.fleet.topology
        n_rec: list[npt.NDArray[np.float32]] = []
        shared_rec: list[tuple[int, int]] = []
        energy_j = 0.0
        t = float(trace.submit_s[0]) if n else 0.0
        t0 = t
        idle_all_w = float(np.sum(self.node_gpus * self.idle_w_by_type[self.node_type]))
        while done < n:
            if not queue and len(run.rows) == 0 and served is None:
                # nothing to do: jump to the boundary at or after the next submission
                nxt = float(trace.submit_s[next_job])
                if nxt > t:
                    jump = math.ceil((nxt - t) / dt - 1e-9) * dt
                    energy_j += idle_all_w * jump
                    t += jump
            while next_job < n and trace.submit_s[next_job] <= t:
                if not rejected[next_job]:
                    queue.append(next_job)
                    queued_gpus += int(trace.num_gpu[next_job])
                next_job += 1
            started_rows: list[int] = []
            started_alloc: list[IntArray] = []
            started_shared: list[int] = []
            while queue:
                head = queue[0]
                allowed = masks[mask_of[head]]
                milli = int(self.gpu_milli[head])
                gpu = -1
                if milli < WHOLE_GPU:  # the oldest shared GPU with room, else a new one
                    found = shared.find(milli, allowed)
                    if found is None:
                        take = self._place(1, free, allowed)
                        if take is None:
                            break
                        free -= take
                        found = shared.open(int(np.argmax(take)))
                    gpu = found
                    shared.join(gpu, milli)
                    take = np.zeros_like(free)
                    take[shared.node[gpu]] = 1
                else:
                    take = self._place(int(trace.num_gpu[head]), free, allowed)
                    if take is None:
                        break  # strict FIFO: the head blocks the queue
                    free -= take
                started_rows.append(queue.popleft())
                queued_gpus -= int(trace.num_gpu[started_rows[-1]])
                started_alloc.append(take)
                started_shared.append(gpu)
            if started_rows:
                new_rows = np.array(started_rows, dtype=np.int64)
                new_alloc = np.stack(started_alloc)
                # the slowest GPU type a job holds paces it
                held = new_alloc[:, :, None] * (
                    self.node_type[None, :, None] == np.arange(len(self.specs))[None, None, :]
                )
                holds = held.sum(axis=1) > 0  # (new, types)
                slow = np.where(holds, wl.slowness[None, :], -np.inf)
                new_types = np.argmax(slow, axis=1).astype(np.int64)
                start_s[new_rows] = t
                nan = np.full(new_rows.size, np.nan)
                run = _Running(
                    np.concatenate([run.rows, new_rows]),
                    np.concatenate([run.types, new_types]),
                    np.concatenate([run.gpus, trace.num_gpu[new_rows]]),
                    np.concatenate([run.alloc, new_alloc]),
                    np.concatenate([run.remaining, wl.iterations[new_rows]]),
                    np.concatenate([run.graphics_mhz, nan]),
                    np.concatenate([run.memory_mhz, nan]),
                    np.concatenate([run.power_w, nan]),
                    np.concatenate([run.iteration_s, nan]),
                    np.concatenate([run.power_capped, np.zeros(new_rows.size, dtype=bool)]),
                    np.concatenate([run.shared, np.array(started_shared, dtype=np.int64)]),
                )
                plant = None
            if len(run.rows) == 0 and served is None:
                t += dt
                energy_j += idle_all_w * dt
                continue
            if plant is None:
                plant = Plant(self.specs, run.types, wl.on(run.types, run.rows))
                tenant = run.shared >= 0
                tenants = None
                if tenant.any():
                    rows, types = run.rows[tenant], run.types[tenant]
                    tenants = Plant(self.specs, types, wl.on(types, rows))
                    gpu_of = np.unique(run.shared[tenant], return_inverse=True)[1].reshape(-1)
                    factor = (
                        self.slice_speed[rows]
                        if self.mig
                        else throughput_factors(self.gpu_milli[rows], gpu_of, self.combined[rows])
                    )
            idle_gpu_w = float(np.sum(free * self.idle_w_by_type[self.node_type]))
            view = ClusterView(
                now_s=t,
                interval_s=dt,
                budget_w=self.budget_w,
                specs=self.specs,
                kept=kept,
                started=len(started_rows),
                job_id=run.rows,
                job_name=names[run.rows] if names is not None else None,
                job_gpus=run.gpus,
                job_type=run.types,
                job_nodes=run.alloc,
                submit_s=trace.submit_s[run.rows],
                start_s=start_s[run.rows],
                deadline_s=trace.deadline_s[run.rows],
                time_limit_s=self.time_limit_s[run.rows],
                iterations=wl.iterations[run.rows],
                remaining_iterations=run.remaining.copy(),
                iterations_done=wl.iterations[run.rows] - run.remaining,
                graphics_mhz=run.graphics_mhz,
                memory_mhz=run.memory_mhz,
                power_w=run.power_w,
                iteration_s=run.iteration_s,
                power_capped=run.power_capped,
                node_type=self.node_type,
                node_gpus=self.node_gpus,
                node_power_w=node_power_w,
                idle_power_w=idle_gpu_w,
                queued_jobs=len(queue),
                queued_gpus=queued_gpus,
                shared_gpu=run.shared if self.sharing else None,
                mig=self.mig,
            )
            if not isinstance(policy, PlantPolicy):
                view = self._as_seen(view)
                if served is not None:
                    view = served.prepend(view, first=not c_rec)
            c0 = time.perf_counter()
            if isinstance(policy, PlantPolicy):
                sp = policy.decide_with_plant(view, plant)
            else:
                sp = policy.decide(view)
            c_rec.append(time.perf_counter() - c0)
            serving_w = serving_top_w = 0.0
            serving_node_w = serving_seen_w = np.zeros(n_nodes)
            if served is not None:
                serve_sp, sp = served.split(sp)
                served_now = served.step(len(c_rec) - 1, serve_sp, dt)
                serving_w = float(served_now.power_w.sum())
                serving_top_w = served.top_w(len(c_rec) - 1)
                serving_node_w = served.nodes.T @ served_now.power_w
                serving_seen_w = served.nodes.T @ served.seen.power_w
            top = self.max_mhz_by_type[run.types]
            clock = (
                top
                if sp.graphics_mhz is None or self.mig  # MIG: no clock lock takes
                else np.where(np.isfinite(sp.graphics_mhz), sp.graphics_mhz, top)
            )
            limit = None
            if sp.limit_w is not None:
                default = np.array([s.power_limit.default_w for s in self.specs])[run.types]
                limit = np.where(np.isfinite(sp.limit_w), sp.limit_w, default)
            mem = None if self.mig else sp.memory_mhz
            truth = plant.step(clock, mem, limit)
            at_max = plant.step(top)
            if tenants is not None:  # shared GPUs: one clock, one power each
                truth, tenant_w = _with_tenants(
                    truth, tenants, tenant, gpu_of, factor, clock, mem, limit
                )
                at_max, tenant_top_w = _with_tenants(at_max, tenants, tenant, gpu_of, factor, top)
            # progress ΔR = Δt / T; a job with R ≤ Δt/T ran the share R·T/Δt of the interval
            per_interval = dt / truth.iteration_time_s
            finishing = run.remaining <= per_interval * (1.0 + 1e-9)  # FP: exact fits finish
            share = np.where(
                finishing, np.minimum(run.remaining * truth.iteration_time_s / dt, 1.0), 1.0
            )
            # Slurm ends a job at start + L: it runs the share (start + L − t) / Δt, unfinished
            end_share = (start_s[run.rows] + self.time_limit_s[run.rows] - t) / dt
            killing = np.isfinite(end_share) & np.where(
                finishing, share > end_share + 1e-9, end_share <= 1.0 + 1e-9
            )
            share = np.where(killing, np.clip(end_share, 0.0, 1.0), share)
            killed[run.rows[killing]] = True
            finishing &= ~killing
            idle_job_w = self.idle_w_by_type[run.types]
            job_w = run.gpus * (truth.power_w * share + idle_job_w * (1.0 - share))
            demand_w = run.gpus * at_max.power_w
            if tenants is not None:  # a tenant's draw above idle while it ran, and its idle part
                job_w[tenant] = share[tenant] * tenant_w[0] + tenant_w[1]
                demand_w[tenant] = tenant_top_w[0] + tenant_top_w[1]
            power_w = float(job_w.sum()) + idle_gpu_w + serving_w
            energy_j += power_w * dt
            t_rec.append(t)
            p_rec.append(power_w)
            if self.sharing:
                shared_rec.append((len(shared), int(np.sum(run.shared >= 0))))
            d_rec.append(float(demand_w.sum()) + idle_gpu_w + serving_top_w)
            if topology is not None:
                # per node, as p_rec: its jobs' GPUs at true power, its idle GPUs at idle power
                n_rec.append(
                    (
                        run.alloc.T @ (job_w / run.gpus)
                        + free * self.idle_w_by_type[self.node_type]
                        + serving_node_w
                    ).astype(np.float32)
                )
            seen = plant.observe(truth, rng)
            seen_job_w = run.gpus * (seen.power_w * share + idle_job_w * (1.0 - share))
            if tenants is not None:  # one reading per GPU: every tenant sees its first's
                first = np.unique(gpu_of, return_index=True)[1]
                read = (seen.power_w[tenant] / truth.power_w[tenant])[first][gpu_of]
                seen_w = seen.power_w.copy()
                seen_w[tenant] = truth.power_w[tenant] * read
                seen = replace(seen, power_w=seen_w)
                seen_job_w[tenant] = job_w[tenant] * read
            # per node: Σ_jobs GPUs on the node × measured per-GPU power, plus its idle GPUs
            node_power_w = (
                run.alloc.T @ (seen_job_w / run.gpus)
                + free * self.idle_w_by_type[self.node_type]
                + serving_seen_w
            )
            finish_s[run.rows[finishing]] = t + share[finishing] * dt
            run.remaining = np.maximum(run.remaining - per_interval, 0.0)
            finishing |= killing  # leaves like a finished job, without a finish time
            run.graphics_mhz = truth.applied_mhz
            run.memory_mhz = (
                np.array([float(s.max_memory_mhz) for s in self.specs])[run.types]
                if mem is None
                else np.asarray(mem, dtype=np.float64)
            )
            run.power_w = seen.power_w
            run.iteration_s = seen.iteration_time_s
            run.power_capped = truth.power_capped
            kept = ~finishing
            if finishing.any():
                free += run.alloc[finishing & (run.shared < 0)].sum(axis=0)
                for row in np.flatnonzero(finishing & (run.shared >= 0)).tolist():
                    node = shared.leave(int(run.shared[row]), int(self.gpu_milli[run.rows[row]]))
                    if node is not None:  # its last tenant left: the GPU is whole again
                        free[node] += 1
                run = run.select(kept)
                plant = None
                done += int(finishing.sum())
                if progress is not None:
                    progress(done)
            t += dt
        logger.debug("replayed %d jobs in %.1f s of simulated time", n, t - t0)
        result = SimulationResult(
            policy=policy.name,
            fleet=str(self.fleet),
            fleet_gpus=total_gpus,
            budget_w=self.budget_w,
            interval_s=dt,
            submit_s=np.asarray(trace.submit_s, dtype=np.float64),
            duration_s=np.asarray(trace.duration_s, dtype=np.float64),
            deadline_s=np.asarray(trace.deadline_s, dtype=np.float64),
            num_gpu=np.asarray(trace.num_gpu, dtype=np.int64),
            start_s=start_s,
            finish_s=finish_s,
            rejected=rejected,
            t_s=np.array(t_rec),
            power_w=np.array(p_rec),
            demand_w=np.array(d_rec),
            controller_s=np.array(c_rec),
            energy_j=energy_j,
            wall_s=time.perf_counter() - wall0,
            job_type=np.asarray(trace.job_type, dtype=str),
            killed=killed,
            node_power_w=(np.stack(n_rec) if n_rec else np.zeros((0, n_nodes), dtype=np.float32)),
            domain_nodes=self.fleet.domain_nodes(),
            domain_limit_w=np.zeros(0) if topology is None else topology.limits_w,
            shared_gpus=np.array([g for g, _ in shared_rec], dtype=np.float64),
            tenants=np.array([k for _, k in shared_rec], dtype=np.float64),
        )
        return result if served is None else served.result(result)


def _with_tenants(
    state: PlantState,
    tenants: Plant,
    tenant: BoolArray,
    gpu_of: IntArray,
    factor: FloatArray,
    clock: FloatArray,
    memory_mhz: FloatArray | None = None,
    limit_w: FloatArray | None = None,
) -> tuple[PlantState, tuple[FloatArray, FloatArray]]:
    """``state`` with its ``tenant`` rows as their shared GPUs run them (`shared_step`), and
    per tenant row its draw above idle and its equal part of its GPU's idle power."""
    step = shared_step(
        tenants,
        gpu_of,
        factor,
        clock[tenant],
        None if memory_mhz is None else np.asarray(memory_mhz, dtype=np.float64)[tenant],
        None if limit_w is None else limit_w[tenant],
    )
    fields = {}
    for name in ("applied_mhz", "power_w", "iteration_time_s", "power_capped"):
        values = getattr(state, name).copy()
        values[tenant] = getattr(step.state, name)
        fields[name] = values
    idle_part = step.idle_w / np.bincount(gpu_of)[gpu_of]
    return PlantState(**fields), (step.dynamic_w, idle_part)
