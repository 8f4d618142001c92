"""The head's table of running jobs (`RunningJobs`), row-aligned with the controller's arrays: it
turns per-GPU readings into per-job measurements and a decision back into per-node setpoints. A
job gets one clock for all its GPUs on every node it spans, since it runs at its slowest GPU's
pace; jobs that share a GPU (shards, MPS, MIG instances) are its tenants and share its clock
(`Tenancy`). No store and no sockets here. Test: `tests/unit/test_coordinator_jobs.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from slurm_cdgpc.control.discrete import ClockGrid
from slurm_cdgpc.control.empc import Decision, JobState, Measurements
from slurm_cdgpc.control.guard_rail import lever_state, power_limits_w
from slurm_cdgpc.control.tenancy import Tenancy, cotenant_key
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.gpu.catalog import GpuSpec
from slurm_cdgpc.gpu.device import ThrottleReason
from slurm_cdgpc.model.estimator import JobEstimator, JobStatics
from slurm_cdgpc.model.families import FloatArray

#: what holds a GPU below the clock it was locked at: its power limit (ours, the board's, a
#: BMC's), a power brake, a hardware or thermal slowdown
HELD_BELOW_LOCK: Final = (
    ThrottleReason.SW_POWER_CAP
    | ThrottleReason.HW_POWER_BRAKE
    | ThrottleReason.HW_SLOWDOWN
    | ThrottleReason.HW_THERMAL
    | ThrottleReason.SW_THERMAL
)


@dataclass(frozen=True, order=True)
class GpuRef:
    node: str
    index: int


def jobs_on(jobs: Iterable[tuple[str, Iterable[GpuRef]]]) -> dict[GpuRef, list[str]]:
    """Each GPU that ``jobs`` (job id, its GPUs) name, and the jobs on it in their order: more
    than one are its tenants."""
    on: dict[GpuRef, list[str]] = {}
    for job_id, refs in jobs:
        for ref in refs:
            on.setdefault(ref, []).append(job_id)
    return on


def node_power_w(power_by_gpu: Mapping[GpuRef, float]) -> dict[str, float]:
    """Each node's power: ``power_by_gpu`` summed over its GPUs."""
    node_w: dict[str, float] = {}
    for ref, power_w in power_by_gpu.items():
        node_w[ref.node] = node_w.get(ref.node, 0.0) + power_w
    return node_w


@dataclass(frozen=True)
class JobInfo:
    """A running job as registered: where it runs and what it must achieve."""

    job_id: str
    gpus: tuple[GpuRef, ...]
    gpu_type: str  # catalog name of its GPUs
    deadline_s: float | None = None
    iterations_total: int | None = None
    #: Slurm's time limit and the job's start, on the head's clock (None: not known)
    time_limit_s: float | None = None
    start_s: float | None = None
    #: a serving job's latency objective at its percentile (``slo=p99:250ms``; None: trains)
    objective_s: float | None = None
    #: the kind prior's key (`job_kind`: user, Slurm job name, GPU type; None: no name known)
    kind: str | None = None

    @property
    def placement(self) -> tuple[tuple[GpuRef, ...], str]:
        """What ties the job to its estimator row: a change of GPUs or type is a new row."""
        return self.gpus, self.gpu_type

    def __post_init__(self) -> None:
        if not self.gpus:
            raise InputError(f"job {self.job_id}: no GPUs")
        if len(set(self.gpus)) != len(self.gpus):
            raise InputError(f"job {self.job_id}: a GPU is listed twice")


@dataclass(frozen=True)
class GpuSample:
    """One GPU's reading as a node agent reported it."""

    ref: GpuRef
    power_w: float
    sm_clock_mhz: float
    memory_clock_mhz: float
    throttle: int = 0
    #: the jobs that held the GPU over the interval the reading describes
    tenants: tuple[str, ...] = ()
    #: the power limit a GPU in MIG mode held as its setpoint, where below its board's default
    lever_limit_w: float | None = None


@dataclass(frozen=True)
class Progress:
    step: int
    time_s: float


@dataclass(frozen=True)
class Outlook:
    """`RunningJobs.outlook`: per-job arrays in the controller's row order."""

    left_top_s: FloatArray
    finish_s: FloatArray


@dataclass(frozen=True)
class NodeSetpoint:
    gpu: int
    job_id: str
    graphics_mhz: int
    memory_mhz: int | None
    #: the guard rail under the clocks (`slurm_cdgpc.control.guard_rail`; None: off)
    power_limit_w: float | None = None
    #: the other jobs sharing the GPU (they keep it at these clocks when ``job_id`` ends)
    tenants: tuple[str, ...] = ()


@dataclass
class RunningJobs:
    """Running jobs in the controller's row order, with their estimator rows."""

    grid: ClockGrid
    estimator: JobEstimator
    specs: Mapping[str, GpuSpec]
    _jobs: list[JobInfo] = field(default_factory=list)
    _row: dict[str, int] = field(default_factory=dict)
    _progress: dict[str, tuple[Progress, Progress | None]] = field(default_factory=dict)
    #: serving jobs' latest latency at their objective's percentile and the time of its
    #: report; the time of the one the controller last measured
    _latency: dict[str, tuple[float, float]] = field(default_factory=dict)
    _measured_at: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._row

    @property
    def jobs(self) -> Sequence[JobInfo]:
        return tuple(self._jobs)

    def add(self, jobs: Iterable[JobInfo]) -> None:
        """Start tracking jobs (new estimator rows, priors from their GPU type). A job may
        name a GPU another job runs on: they become its tenants (`tenancy`), but only if
        they agree on its type."""
        new = [j for j in jobs if j.job_id not in self._row]
        if not new:
            return
        typed = {g: j.gpu_type for j in self._jobs for g in j.gpus}
        # the kind prior pools a job's readings with its kind's: not a serving job's (its
        # load sets them) nor one joining a GPU another job holds (they are the GPU's)
        kinds = [
            None if job.objective_s is not None or any(g in typed for g in job.gpus) else job.kind
            for job in new
        ]
        for job in new:
            if job.gpu_type not in self.specs:
                raise InputError(f"job {job.job_id}: unknown GPU type {job.gpu_type!r}")
            self.grid.type_index(job.gpu_type)
            clash = sorted(g for g in job.gpus if typed.get(g, job.gpu_type) != job.gpu_type)
            if clash:
                where = f"{clash[0].node}:{clash[0].index}"
                raise InputError(
                    f"job {job.job_id}: GPU {where} runs a job that says it is a "
                    f"{typed[clash[0]]}, not a {job.gpu_type}"
                )
            typed.update(dict.fromkeys(job.gpus, job.gpu_type))
        self.estimator.add_jobs(
            JobStatics.of(
                [self.specs[j.gpu_type] for j in new],
                np.arange(len(new)),
                np.array([len(j.gpus) for j in new], dtype=np.int64),
            ),
            kinds=kinds,
        )
        for job in new:
            self._row[job.job_id] = len(self._jobs)
            self._jobs.append(job)

    def update(self, jobs: Iterable[JobInfo]) -> None:
        """New deadlines, totals and time limits of tracked jobs (same placement, same row)."""
        for job in jobs:
            i = self._row[job.job_id]
            if self._jobs[i].placement != job.placement:
                raise InputError(f"job {job.job_id}: its GPUs changed; remove and add it")
            self._jobs[i] = job

    def work(self, job_ids: Iterable[str]) -> tuple[FloatArray, FloatArray]:
        """The work done (seconds at top clocks) and the time limits (NaN: none) of tracked
        jobs, for `EconomicMPC.jobs_ended`."""
        rows = [self._row[j] for j in job_ids if j in self._row]
        limits = [self._jobs[i].time_limit_s for i in rows]
        return (
            self.estimator.work_top_s[rows],
            np.array([math.nan if v is None else v for v in limits], dtype=np.float64),
        )

    def remove(self, job_ids: Iterable[str]) -> list[JobInfo]:
        """Stop tracking jobs (their estimator rows go); returns the ones that were running."""
        gone = {j for j in job_ids if j in self._row}
        if not gone:
            return []
        keep = np.array([j.job_id not in gone for j in self._jobs])
        self.estimator.keep(keep)
        removed = [j for j in self._jobs if j.job_id in gone]
        self._jobs = [j for j in self._jobs if j.job_id not in gone]
        self._row = {j.job_id: i for i, j in enumerate(self._jobs)}
        for job_id in gone:
            self._progress.pop(job_id, None)
            self._latency.pop(job_id, None)
            self._measured_at.pop(job_id, None)
        return removed

    def record_progress(self, job_id: str, step: int, time_s: float) -> None:
        """A job reported reaching ``step`` at ``time_s``; older or repeated reports are ignored."""
        if job_id not in self._row:
            return
        latest = self._progress.get(job_id)
        if latest is not None and (step <= latest[0].step or time_s <= latest[0].time_s):
            return
        self._progress[job_id] = (Progress(step, time_s), None if latest is None else latest[0])

    def record_latency(self, job_id: str, latency_s: float, time_s: float) -> None:
        """A serving job reported its latency at its objective's percentile over its last
        window, at ``time_s``: the next `measurements` hand it to the controller once; a
        report seen before (the agent relays the latest every exchange) is not new."""
        if job_id not in self._row or not (math.isfinite(latency_s) and latency_s > 0):
            return
        if time_s > self._latency.get(job_id, (math.nan, -math.inf))[1]:
            self._latency[job_id] = (latency_s, time_s)

    def latency_s(self, job_id: str) -> float | None:
        """A serving job's latest reported latency (None: none yet)."""
        latest = self._latency.get(job_id)
        return None if latest is None else latest[0]

    def job_state(self) -> JobState:
        types = np.array([self.grid.type_index(j.gpu_type) for j in self._jobs], dtype=np.int64)
        remaining = np.full(len(self), np.nan)
        for i, job in enumerate(self._jobs):
            latest = self._progress.get(job.job_id)
            if job.iterations_total is not None:
                done = latest[0].step if latest else 0
                remaining[i] = max(job.iterations_total - done, 0)

        def column(values: Iterable[float | None]) -> FloatArray:
            return np.array([math.nan if v is None else v for v in values], dtype=np.float64)

        return JobState(
            types,
            remaining,
            column(j.deadline_s for j in self._jobs),
            time_limit_s=column(j.time_limit_s for j in self._jobs),
            start_s=column(j.start_s for j in self._jobs),
            tenancy=self.tenancy(),
            objective_s=(
                column(j.objective_s for j in self._jobs)
                if any(j.objective_s is not None for j in self._jobs)
                else None
            ),
        )

    def tenancy(self) -> Tenancy | None:
        """The jobs that share GPUs, in row order (None: no GPU is shared)."""
        return Tenancy.of_gpus([list(j.gpus) for j in self._jobs])

    def outlook(self, decision: Decision, now_s: float, bounded: bool) -> Outlook:
        """Per job: the work left in seconds at top clocks and the predicted finish at the
        decided clocks (NaN: not known), as the plan predicted its speed (a tenant among new
        co-tenants: `JobEstimator.time_scale`). ``bounded``: a job that did not say its total
        is bounded by its time limit (`ControllerSettings.work_from_time_limit`)."""
        est = self.estimator
        state = self.job_state()
        one = np.ones(len(self))
        t_top = est.predict_iteration_s(one, one) * est.time_scale
        x, x_m = est.normalise(
            decision.graphics_mhz.astype(np.float64), decision.memory_mhz.astype(np.float64)
        )
        slowdown = est.predict_iteration_s(x, x_m) / t_top
        left_top_s = np.where(
            np.isfinite(state.remaining_iterations),
            state.remaining_iterations * t_top,
            state.remaining_top_s(est.work_top_s, now_s) if bounded else np.nan,
        )
        return Outlook(left_top_s, now_s + left_top_s * slowdown)

    def reported(self, job_id: str) -> bool:
        """The job has reported progress since it joined."""
        return job_id in self._progress

    def measurements(
        self, samples: Iterable[GpuSample], planned_power_w: FloatArray | None = None
    ) -> Measurements:
        """Per-job measurements of the last interval from per-GPU samples.

        Power is the mean over the job's GPUs that reported (NaN if none did); the applied clock
        is the slowest GPU's (it paces the job); iteration time comes from the last two progress
        reports (NaN without them); power-capped if any GPU was held below its lock by a
        limiter (`HELD_BELOW_LOCK`): the plan then does not go above the clock it ran at, and
        the job counts at what it draws; its co-tenants are the other jobs its sampled GPUs
        held over the interval (`cotenant_key`, and their number; -1: no GPU of it sampled).
        A serving job's iteration time is the latency it reported since the last
        measurements (NaN: none).
        """
        by_ref = {s.ref: s for s in samples}
        n = len(self)
        power = np.full(n, np.nan)
        clock = np.full(n, np.nan)
        memory = np.full(n, np.nan)
        iteration = np.full(n, np.nan)
        capped = np.zeros(n, dtype=bool)
        cotenants = np.full(n, -1, dtype=np.int64)
        counts = np.full(n, -1, dtype=np.int64)
        lever = np.full(n, np.nan)
        for i, job in enumerate(self._jobs):
            seen = [by_ref[g] for g in job.gpus if g in by_ref]
            if seen:
                mates = [t for s in seen for t in s.tenants if t != job.job_id]
                cotenants[i] = cotenant_key(mates) if mates else 0
                counts[i] = len(set(mates))
            good = [s for s in seen if math.isfinite(s.power_w) and s.power_w >= 0]
            if good:
                power[i] = sum(s.power_w for s in good) / len(good)
                clock[i] = min(s.sm_clock_mhz for s in good)
                memory[i] = min(s.memory_clock_mhz for s in good)
                capped[i] = any(s.throttle & HELD_BELOW_LOCK for s in good)
                limits = [s.lever_limit_w for s in good]
                if all(w is not None for w in limits):  # MIG GPUs held below their default
                    lever[i] = sum(w for w in limits if w is not None) / len(limits)
            if job.objective_s is not None:
                latency_s, at_s = self._latency.get(job.job_id, (math.nan, -math.inf))
                if at_s > self._measured_at.get(job.job_id, -math.inf):
                    iteration[i] = latency_s
                    self._measured_at[job.job_id] = at_s
                continue
            latest, before = self._progress.get(job.job_id, (None, None))
            if latest is not None and before is not None:
                iteration[i] = (latest.time_s - before.time_s) / (latest.step - before.step)
        return Measurements(
            graphics_mhz=clock,
            memory_mhz=memory,
            power_w=power,
            iteration_s=iteration,
            planned_power_w=planned_power_w,
            power_capped=capped,
            cotenants=cotenants,
            cotenant_count=counts,
            lever_limit_w=lever if np.isfinite(lever).any() else None,
        )

    def setpoints(
        self,
        decision: Decision,
        power_limit_margin: float = 0.0,
        limit_only: Callable[[GpuRef], bool] | None = None,
    ) -> dict[str, list[NodeSetpoint]]:
        """The decision as per-node setpoints: every GPU of a job gets the job's clocks and,
        with a margin above 0, the guard rail: its planned power per GPU times (1 + margin)
        (`slurm_cdgpc.control.guard_rail`), to the milliwatt NVML takes; a job the plan
        holds at a share of its limit (`Decision.held`) gets that, rail or not. A shared GPU
        gets one setpoint, its first tenant's (they all have its clocks), naming the others;
        each GPU of a group of tenants is planned at the group's power over its GPUs.

        A GPU whose clocks cannot be locked (``limit_only``: MIG mode) gets a power limit as
        its setpoint, the lever's (`power_limits_w`: its planned power over its learned gain, 5 %
        above at its top clock, its count for a tenant not yet measured): the firmware runs the
        highest clock within it."""
        if decision.graphics_mhz.shape[0] != len(self):
            raise InputError("the decision does not match the running jobs")
        gpus = np.array([len(job.gpus) for job in self._jobs], dtype=np.float64)
        gpu_w = decision.job_power_w / gpus
        # a serving job's GPUs keep their default limit (`power_limits_w`), its tenants' too
        free = np.zeros(len(self), dtype=bool)
        if decision.serving is not None:
            free = decision.serving.serving.copy()
        # a job not yet measured, counted at a share of its limit, is held there (its tenants'
        # GPU with it: the group is counted at the newcomer's share)
        held = np.zeros(len(self), dtype=bool) if decision.held is None else decision.held
        tenancy = self.tenancy()
        gain, counted, unmodelled = lever_state(self.estimator, tenancy)
        if tenancy is not None:
            gpu_w, free = tenancy.gpu_power_w(decision.job_power_w), tenancy.any_tenant(free)
            held = tenancy.any_tenant(held)
        on = jobs_on((job.job_id, job.gpus) for job in self._jobs)
        refs = list(on)
        first = [self._row[on[ref][0]] for ref in refs]  # each GPU's first tenant's row
        specs = [self.specs[self._jobs[i].gpu_type] for i in first]
        hold = held[first]
        lever = np.array(
            [limit_only is not None and limit_only(ref) for ref in refs], dtype=bool
        )  # GPUs whose setpoint is their power limit
        top = decision.graphics_mhz[first] >= [s.max_graphics_mhz for s in specs]
        limits = power_limits_w(
            gpu_w[first],
            np.ones(len(refs)),
            power_limit_margin,
            [s.power_limit.min_w for s in specs],
            [s.power_limit.default_w for s in specs],
            free[first],
            hold,
            lever,
            top,
            gain[first],
            counted[first],
            unmodelled[first],
        )
        out: dict[str, list[NodeSetpoint]] = {}
        for r, (ref, i) in enumerate(zip(refs, first, strict=True)):
            memory = int(decision.memory_mhz[i]) if specs[r].memory_lockable else None
            out.setdefault(ref.node, []).append(
                NodeSetpoint(
                    ref.index,
                    self._jobs[i].job_id,
                    int(decision.graphics_mhz[i]),
                    memory,
                    None
                    if limits is None or not (power_limit_margin > 0 or hold[r] or lever[r])
                    else round(float(limits[r]), 3),
                    tuple(on[ref][1:]),
                )
            )
        return out
