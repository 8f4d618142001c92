"""The controller driving simulated GPUs, one control interval at a time (`ClosedLoop`).

The controller never sees the plant's parameters, only what a head receives from its agents.
Tests: `tests/unit/test_closed_loop.py` (the golden runs DESIGN.md's "Safety" cites) and
`bench controller`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from slurm_cdgpc.control.discrete import ClockGrid
from slurm_cdgpc.control.domains import DomainLimits
from slurm_cdgpc.control.dual import StepStatus
from slurm_cdgpc.control.empc import (
    ControllerSettings,
    Decision,
    EconomicMPC,
    JobState,
    Measurements,
    QueueState,
)
from slurm_cdgpc.control.guard_rail import power_limits_w
from slurm_cdgpc.control.overdraw import ClusterDraw
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.gpu.catalog import GpuSpec, catalog_spec
from slurm_cdgpc.gpu.plant import NoiseModel, Plant, PlantState, WorkloadArrays, draw_workloads
from slurm_cdgpc.model.estimator import EstimatorSettings, JobEstimator, JobStatics
from slurm_cdgpc.model.families import FloatArray
from slurm_cdgpc.model.kind_prior import job_kind

IntArray = NDArray[np.int64]

#: GPUs per node of the packed placement `ClosedLoop.queue` reports
NODE_GPUS = 8
#: job names the loop's jobs share (per GPU type: the kinds the kind prior pools)
LOOP_NAMES = 64
#: GPU types of the synthetic fleet and their shares of the jobs
DEFAULT_MIX: tuple[tuple[str, float], ...] = (
    ("A100-SXM4-80GB", 0.40),
    ("H100-SXM", 0.25),
    ("H200", 0.10),
    ("A40", 0.15),
    ("V100-SXM2", 0.10),
)


@dataclass
class Fleet:
    """Running jobs on simulated GPUs (arrays of shape (N,), one row per job): per job a GPU
    type, a GPU count, a ground-truth workload (`slurm_cdgpc.gpu.plant`, calibrated on real
    measurements), remaining iterations and a deadline."""

    specs: tuple[GpuSpec, ...]
    gpu_type: IntArray
    gpus: IntArray
    workloads: WorkloadArrays
    remaining_iterations: FloatArray
    deadline_s: FloatArray

    def __len__(self) -> int:
        return int(self.gpu_type.shape[0])

    def plant(self) -> Plant:
        return Plant(self.specs, self.gpu_type, self.workloads)

    def statics(self) -> JobStatics:
        return JobStatics.of(self.specs, self.gpu_type, self.gpus)

    def max_power_w(self) -> float:
        """Every job at its top clocks (under the default power limits)."""
        top = self.plant().step(np.asarray([s.max_graphics_mhz for s in self.specs])[self.gpu_type])
        return float(np.sum(self.gpus * top.power_w))


def synthetic_fleet(
    n_jobs: int,
    rng: np.random.Generator,
    mix: Sequence[tuple[str, float]] = DEFAULT_MIX,
    slack: tuple[float, float] = (1.2, 3.0),
    hours: tuple[float, float] = (2.0, 24.0),
) -> Fleet:
    """N jobs on a heterogeneous fleet, 1–8 GPUs each, with deadlines.

    Each job needs between ``hours`` of work at top clocks and gets a deadline of that time
    times a slack factor drawn from ``slack`` (the paper's evaluation: U[1.2, 3]).
    """
    if n_jobs < 1:
        raise InputError(f"a fleet needs at least one job, got {n_jobs}")
    specs = tuple(catalog_spec(name) for name, _ in mix)
    share = np.array([s for _, s in mix], dtype=np.float64)
    gpu_type = rng.choice(len(specs), size=n_jobs, p=share / share.sum()).astype(np.int64)
    gpus = rng.choice([1, 2, 4, 8], size=n_jobs, p=[0.4, 0.2, 0.2, 0.2]).astype(np.int64)
    columns = {f: np.empty(n_jobs) for f in WorkloadArrays.__dataclass_fields__}
    for t, spec in enumerate(specs):
        rows = np.flatnonzero(gpu_type == t)
        drawn = draw_workloads(rows.size, spec, rng)
        for f, column in columns.items():
            column[rows] = getattr(drawn, f)
    workloads = WorkloadArrays(**columns)
    fleet = Fleet(specs, gpu_type, gpus, workloads, np.zeros(n_jobs), np.zeros(n_jobs))
    top = np.asarray([s.max_graphics_mhz for s in specs])[gpu_type]
    t_top = fleet.plant().step(top).iteration_time_s
    work_s = 3600.0 * rng.uniform(*hours, size=n_jobs)
    fleet.remaining_iterations = work_s / t_top
    fleet.deadline_s = work_s * rng.uniform(*slack, size=n_jobs)
    return fleet


@dataclass(frozen=True)
class IntervalRecord:
    """One control interval as it happened."""

    t_s: float
    budget_w: float
    power_w: float  # true power of the jobs' GPUs over the interval
    predicted_w: float
    #: planned power against the budget the solver was given (negative = under)
    plan_error_pct: float
    price: float
    status: StepStatus
    step_s: float  # controller: learn + solve + discretise
    dual_evaluations: int
    jobs: int
    finished: int  # jobs that finished during this interval
    late: int  # running jobs already past their deadline

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.power_w - self.budget_w) / self.budget_w


class ClosedLoop:
    """Controller, estimator and plant, stepped one interval at a time:

        measurements of the last interval → JobEstimator (RLS) → EconomicMPC → clocks → plant

    The controller sees only noisy per-job power, iteration times and applied clocks. With
    ``power_limit_margin`` above 0 each job's GPUs also get the head's guard rail
    (`slurm_cdgpc.control.guard_rail`) as their power limit, which the plant holds as the
    firmware does. `power_scale` multiplies every job's true power from the next interval on (a
    workload that draws more than its model learned, e.g. 1.1): the plant under limit L with
    power scaled by s is the plant under L / s with its power times s, exactly.
    """

    def __init__(
        self,
        fleet: Fleet,
        rng: np.random.Generator,
        settings: ControllerSettings | None = None,
        estimator_settings: EstimatorSettings | None = None,
        noise: NoiseModel | None = None,
        queued: bool = False,
        power_limit_margin: float = 0.0,
        silent_share: float = 0.0,
        domains: Callable[[ClosedLoop], DomainLimits] | None = None,
    ) -> None:
        self.fleet = fleet
        #: the power domains above the jobs, built each step from the loop (None: the cluster
        #: alone)
        self.domains = domains
        #: jobs that say no total: the controller sees only their time limit (twice the work
        #: they start with, at top clocks), as the head sees a job whose hook reports steps
        self.silent = (
            rng.random(len(fleet.gpus)) < silent_share
            if silent_share > 0
            else np.zeros(len(fleet.gpus), dtype=bool)
        )
        self.time_limit_s = np.full(len(fleet.gpus), np.nan)
        if self.silent.any():
            top = np.asarray([s.max_graphics_mhz for s in fleet.specs])[fleet.gpu_type]
            t_top = fleet.plant().step(top).iteration_time_s
            limit_s = 2.0 * fleet.remaining_iterations * t_top
            self.time_limit_s = np.where(self.silent, limit_s, np.nan)
        #: the guard rail's margin (0: off, the boards at their default limits)
        self.power_limit_margin = power_limit_margin
        #: every job's true power over what its workload alone draws (1: as calibrated)
        self.power_scale = 1.0
        self.rng = rng
        self.noise = noise
        #: jobs wait for GPUs (the drain's input): the jobs are packed on 8-GPU nodes, in order
        self.queued = queued
        # every supported clock: the controller applies its own floor, as cdgpcd's does
        self.grid = ClockGrid.from_tables(
            [(s.name, s.clocks) for s in fleet.specs], min_fraction=0.0
        )
        self.controller = EconomicMPC(self.grid, settings)
        self.estimator = JobEstimator(estimator_settings)
        # a few dozen job names per GPU type, as a site's users reuse them: with the kind
        # prior on their readings are pooled every step (every job starts at once here, so
        # none starts from a pool)
        kinds = [
            job_kind("", f"job{i % LOOP_NAMES}", fleet.specs[t].name)
            for i, t in enumerate(fleet.gpu_type.tolist())
        ]
        self.estimator.add_jobs(fleet.statics(), kinds=kinds)
        self._plant = fleet.plant()
        self._measured: Measurements | None = None
        self.t_s = 0.0
        self.last_decision: Decision | None = None
        #: the plant's truth in the last interval (clocks applied under the limits, power)
        self.last_truth: PlantState | None = None

    @property
    def interval_s(self) -> float:
        return self.controller.settings.interval_s

    def queue(self) -> QueueState | None:
        """With ``queued``: the jobs' GPUs laid end to end on nodes of `NODE_GPUS`, one more
        node with a free GPU, and jobs waiting."""
        if not self.queued:
            return None
        start = np.concatenate([[0], np.cumsum(self.fleet.gpus)[:-1]])
        first = start // NODE_GPUS
        spans = (start + self.fleet.gpus - 1) // NODE_GPUS - first + 1  # nodes per job
        rows = np.repeat(np.arange(spans.size), spans)
        nth = np.arange(rows.size) - np.repeat(np.cumsum(spans) - spans, spans)
        nodes = np.repeat(first, spans) + nth
        free = np.zeros(int(nodes.max()) + 2, dtype=np.int64)
        free[-1] = 1
        return QueueState(True, rows, nodes, free)

    def job_state(self) -> JobState:
        """What the controller sees of the jobs now (a silent job: its time limit, no total)."""
        fleet = self.fleet
        return JobState(
            fleet.gpu_type,
            np.where(self.silent, np.nan, fleet.remaining_iterations),
            fleet.deadline_s,
            time_limit_s=self.time_limit_s,
            start_s=np.zeros(len(fleet.gpus)),
        )

    def step(self, budget_w: float) -> IntervalRecord:
        """Decide, run the plant for one interval at the decided clocks, measure."""
        fleet = self.fleet
        jobs = self.job_state()
        queue = self.queue()
        t0 = time.perf_counter()
        domains = None if self.domains is None else self.domains(self)
        d = self.controller.step(
            self.estimator,
            jobs,
            self.t_s,
            budget_w,
            measured=self._measured,
            queue=queue,
            domains=domains,
        )
        step_s = time.perf_counter() - t0
        self.last_decision = d

        plant = self._plant
        limits = power_limits_w(
            d.job_power_w,
            fleet.gpus,
            self.power_limit_margin,
            np.asarray([s.power_limit.min_w for s in fleet.specs])[fleet.gpu_type],
            plant.default_limit_w,
            held=d.held,
        )
        limit_w = plant.default_limit_w if limits is None else limits
        truth = plant.step(d.graphics_mhz, d.memory_mhz, limit_w / self.power_scale)
        if self.power_scale != 1.0:
            truth = PlantState(
                truth.applied_mhz,
                truth.power_w * self.power_scale,
                truth.iteration_time_s,
                truth.power_capped,
            )
        self.last_truth = truth
        seen = self._plant.observe(truth, self.rng, self.noise)
        power_w = float(np.sum(fleet.gpus * truth.power_w))
        self._measured = Measurements(
            graphics_mhz=truth.applied_mhz,
            memory_mhz=d.memory_mhz.astype(np.float64),
            power_w=seen.power_w,
            iteration_s=seen.iteration_time_s,
            planned_power_w=d.planned_power_w,
            power_capped=truth.power_capped,
            cluster=ClusterDraw(float(np.sum(fleet.gpus * seen.power_w)), d.expected_w, d.budget_w),
        )
        fleet.remaining_iterations = fleet.remaining_iterations - self.interval_s / (
            truth.iteration_time_s
        )
        self.t_s += self.interval_s
        record = IntervalRecord(
            t_s=self.t_s,
            budget_w=d.budget_w,
            power_w=power_w,
            predicted_w=d.predicted_power_w,
            plan_error_pct=d.budget_error_pct,
            price=d.price,
            status=d.status,
            step_s=step_s,
            dual_evaluations=d.dual_evaluations,
            jobs=len(fleet),
            finished=int(np.sum(fleet.remaining_iterations <= 0)),
            late=int(np.sum(fleet.deadline_s < self.t_s)),
        )
        self._drop_finished()
        return record

    def predicted_finish_s(self) -> FloatArray:
        """When each running job would finish at the speed it ran in the last interval (its
        measured iteration time, as an operator would extrapolate it; not the plant's truth)."""
        if self._measured is None:
            return np.full(len(self.fleet), np.nan)
        return self.t_s + self.fleet.remaining_iterations * self._measured.iteration_s

    def _drop_finished(self) -> None:
        running = self.fleet.remaining_iterations > 0
        if running.all():
            return
        f = self.fleet
        self.fleet = Fleet(
            f.specs,
            f.gpu_type[running],
            f.gpus[running],
            WorkloadArrays(*(getattr(f.workloads, k)[running] for k in _WORKLOAD_FIELDS)),
            f.remaining_iterations[running],
            f.deadline_s[running],
        )
        self.estimator.keep(running)
        self._plant = self.fleet.plant()
        if self._measured is not None:
            m = self._measured
            self._measured = Measurements(
                m.graphics_mhz[running],
                m.memory_mhz[running],
                m.power_w[running],
                m.iteration_s[running],
                None if m.planned_power_w is None else m.planned_power_w[running],
                None if m.power_capped is None else m.power_capped[running],
                m.cluster,
            )


_WORKLOAD_FIELDS = tuple(WorkloadArrays.__dataclass_fields__)
