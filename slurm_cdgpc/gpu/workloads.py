"""Jobs that run on a node's simulated GPUs, for ``cdgpc-noded`` with ``node.backend = simulated``.

Switched on by environment variables, never configuration keys. Reaches only `gpu/`, `wire/`,
`errors` and `units` of the package (`tests/unit/test_import_graph.py`): whoever builds the
runner hands it the way to report. Design: DESIGN.md, "The demo"; test:
`tests/unit/test_gpu_workloads.py`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final, Protocol

from slurm_cdgpc.errors import CdgpcError, InputError
from slurm_cdgpc.gpu.device import GpuReading, GpuSet
from slurm_cdgpc.gpu.plant import WorkloadCalibration, WorkloadProfile, workload_profile
from slurm_cdgpc.gpu.simulated import SimulatedGpu, node_gpu_kinds, simulated_gpus
from slurm_cdgpc.wire.board import BoardDescription

logger = logging.getLogger(__name__)

#: the launch directory a `JobRunner` reads
JOBS_DIR_ENV: Final = "CDGPC_SIMULATED_JOBS"
#: simulated seconds per wall-clock second for the GPUs' work (default 1): iterations, energy and
#: Hopper's power averaging run on the accelerated clock, power is still watts; leases,
#: intervals and progress time stamps stay in wall-clock time, so a job's iteration time as the
#: head measures it is the simulated one divided by the speed (its deadline is scaled alike)
SPEED_ENV: Final = "CDGPC_SIMULATED_SPEED"
#: how often the runner looks for launched and removed jobs and reports progress (wall seconds)
POLL_PERIOD_S: Final = 0.25
#: a serving job's latency window (wall seconds)
SERVING_WINDOW_S: Final = 1.0
LAUNCH_SUFFIX: Final = ".json"
EXIT_SUFFIX: Final = ".exit"


class Reporter(Protocol):
    """report(job_id, step, total[, latency_s=]): True once the node agent recorded it (until
    then the runner reports again at its next poll); a serving job's with its latency."""

    def __call__(
        self, job_id: str, step: int, total: int | None, /, *, latency_s: float | None = None
    ) -> bool: ...


class AcceleratedClock:
    """A monotonic time source that runs ``speed`` times faster than the wall clock."""

    def __init__(self, speed: float, base: Callable[[], float] = time.monotonic) -> None:
        if not (speed > 0 and math.isfinite(speed)):
            raise InputError(f"simulation speed must be a positive number, got {speed!r}")
        self.speed = speed
        self._base = base
        self._start = base()

    def __call__(self) -> float:
        return self._start + (self._base() - self._start) * self.speed


class SharedSimulatedGpu(SimulatedGpu):
    """A `SimulatedGpu` whose public calls hold a lock shared with the job runner.

    The agent's threads and the runner's both use the GPUs, and a `SimulatedGpu` advances its
    state lazily on every call, which is not safe from two threads at once: one lock per node."""

    def __init__(self, *args: Any, lock: threading.RLock, **kwargs: Any) -> None:
        self._shared_lock = lock
        super().__init__(*args, **kwargs)

    def set_locked_clocks(self, graphics_mhz: int, memory_mhz: int | None = None) -> None:
        with self._shared_lock:
            super().set_locked_clocks(graphics_mhz, memory_mhz)

    def reset_locked_clocks(self) -> None:
        with self._shared_lock:
            super().reset_locked_clocks()

    def read(self) -> GpuReading:
        with self._shared_lock:
            return super().read()

    def attach(self, workload: WorkloadProfile | WorkloadCalibration | str) -> None:
        with self._shared_lock:
            super().attach(workload)

    def detach(self) -> None:
        with self._shared_lock:
            super().detach()

    def set_power_limit_w(self, limit_w: float) -> None:
        with self._shared_lock:
            super().set_power_limit_w(limit_w)

    def reset_power_limit(self) -> None:
        with self._shared_lock:
            super().reset_power_limit()

    def describe(self) -> BoardDescription:
        with self._shared_lock:
            return super().describe()

    @property
    def iterations_done(self) -> float:
        with self._shared_lock:
            return super().iterations_done


@dataclass(frozen=True)
class Launch:
    """One job as the launch file describes it."""

    job_id: str
    gpus: tuple[int, ...]
    workload: str
    iterations: int
    iteration_time_s: float | None = None
    #: a serving job: a request at its objective's percentile takes this many iterations (its
    #: latency follows the workload's calibrated clock response); None: a training job
    request_iterations: float | None = None

    @classmethod
    def from_dict(cls, data: object) -> Launch:
        if not isinstance(data, dict):
            raise InputError("a launch file must hold a JSON object")
        try:
            job_id = str(data["job_id"])
            gpus = tuple(int(g) for g in data["gpus"])
            workload = str(data["workload"])
            iterations = int(data["iterations"])
            raw_time = data.get("iteration_time_s")
            iteration_time_s = None if raw_time is None else float(raw_time)
            raw_request = data.get("request_iterations")
            request = None if raw_request is None else float(raw_request)
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"malformed launch file: {type(e).__name__}: {e}") from None
        if not gpus or iterations < 1:
            raise InputError(f"job {job_id}: a launch needs GPUs and at least one iteration")
        if iteration_time_s is not None and not (
            iteration_time_s > 0 and math.isfinite(iteration_time_s)
        ):
            raise InputError(f"job {job_id}: iteration time must be positive")
        if request is not None and not (request > 0 and math.isfinite(request)):
            raise InputError(f"job {job_id}: a request's iterations must be positive")
        return cls(job_id, gpus, workload, iterations, iteration_time_s, request)

    def to_dict(self) -> dict[str, object]:
        return {
            "job_id": self.job_id,
            "gpus": list(self.gpus),
            "workload": self.workload,
            "iterations": self.iterations,
            "iteration_time_s": self.iteration_time_s,
            "request_iterations": self.request_iterations,
        }


def write_atomically(path: Path, data: object) -> None:
    """Write JSON to ``path`` so that a reader never sees half of it (temp file, rename)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@dataclass
class _Running:
    launch: Launch
    gpus: tuple[SimulatedGpu, ...]
    reported: int = -1
    exited: bool = False
    #: a serving job's last (time, iterations done), to time the iterations of a window
    window: tuple[float, float] | None = None


class JobRunner:
    """Starts, advances and ends the jobs the launch directory names.

    The replayer writes ``<job_id>.json`` (atomically) to start a job: ``{"job_id": "1001",
    "gpus": [0, 1], "workload": "resnet50", "iterations": 50000, "iteration_time_s": 0.16}``.
    The runner attaches the workload's calibrated profile on this node's GPU type to every
    listed GPU, with the iteration time at top clocks replaced by ``iteration_time_s`` when
    given (a trace knows duration / iterations), and reports the job's progress (the slowest
    GPU's whole iterations: a synchronous job runs at the pace of its slowest GPU) through
    ``report``, as a training job does with ``cdgpc-progress``. A serving job
    (``request_iterations``) reports the requests it served and, every poll, its latency:
    ``request_iterations`` × the seconds an iteration took over the poll. When the job has done
    ``iterations`` its GPUs idle and the runner writes ``<job_id>.exit``: the job's processes
    ended. Removing the launch file (the replayer's Epilog) forgets the job, idling its GPUs if
    it was still running (cancelled).
    """

    def __init__(
        self,
        gpus: Sequence[SimulatedGpu],
        directory: Path,
        report: Reporter,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.gpus = {g.index: g for g in gpus}
        self.directory = directory
        self._clock = clock
        self._report = report
        self._jobs: dict[str, _Running] = {}
        self._refused: set[str] = set()

    @property
    def running(self) -> dict[str, int]:
        """Job id → whole iterations done, for the jobs still running."""
        return {j: r.reported for j, r in self._jobs.items() if not r.exited}

    def poll(self) -> None:
        """One pass: start launched jobs, forget removed ones, report progress, end finished."""
        try:
            names = {p.name for p in self.directory.iterdir()}
        except OSError as e:
            logger.warning("launch directory %s unreadable: %s", self.directory, e.strerror or e)
            return
        launched = {n[: -len(LAUNCH_SUFFIX)] for n in names if n.endswith(LAUNCH_SUFFIX)}
        for job_id in sorted(set(self._jobs) - launched):
            running = self._jobs.pop(job_id)
            if not running.exited:
                for gpu in running.gpus:
                    gpu.detach()
                logger.info("job %s: removed before it finished; its GPUs idle", job_id)
        self._refused &= launched
        for job_id in sorted(launched - set(self._jobs) - self._refused):
            self._start(job_id)
        for running in self._jobs.values():
            if not running.exited:
                self._advance(running)

    def _start(self, job_id: str) -> None:
        path = self.directory / f"{job_id}{LAUNCH_SUFFIX}"
        try:
            launch = Launch.from_dict(json.loads(path.read_text(encoding="utf-8")))
            gpus = tuple(self._gpu(i) for i in launch.gpus)
            profile = workload_profile(launch.workload)
        except (OSError, ValueError, CdgpcError) as e:
            logger.error("job %s: not started: %s", job_id, e)
            self._refused.add(job_id)
            return
        busy = {g.index for r in self._jobs.values() if not r.exited for g in r.gpus}
        clash = busy.intersection(launch.gpus)
        if clash:
            logger.error("job %s: GPU(s) %s already run another job", job_id, sorted(clash))
            self._refused.add(job_id)
            return
        for gpu in gpus:
            calibration = profile.on(gpu.spec)
            if launch.iteration_time_s is not None:
                calibration = replace(calibration, iteration_time_s=launch.iteration_time_s)
            gpu.attach(calibration)
        self._jobs[job_id] = _Running(launch, gpus)
        logger.info(
            "job %s: %s started on GPU(s) %s, %d iterations",
            job_id,
            launch.workload,
            ",".join(map(str, launch.gpus)),
            launch.iterations,
        )

    def _serve(self, running: _Running, done: float) -> None:
        """Report a serving job's requests and its latency over the window since its last
        report, once the window is `SERVING_WINDOW_S` long (as `LatencyReporter` sends)."""
        request = running.launch.request_iterations
        assert request is not None
        now_s = self._clock()
        if running.window is None:
            running.window = (now_s, done)
            return
        start_s, start = running.window
        if now_s - start_s < SERVING_WINDOW_S or done <= start:
            return
        latency_s = request * (now_s - start_s) / (done - start)
        served = int(done / request)
        if self._report(running.launch.job_id, served, None, latency_s=latency_s):
            running.reported = served
            running.window = (now_s, done)

    def _gpu(self, index: int) -> SimulatedGpu:
        try:
            return self.gpus[index]
        except KeyError:
            raise InputError(f"no GPU with index {index} on this node") from None

    def _advance(self, running: _Running) -> None:
        launch = running.launch
        exact = min(*(g.iterations_done for g in running.gpus), float(launch.iterations))
        done = int(exact)
        if launch.request_iterations is not None:
            self._serve(running, exact)
        elif done > running.reported and self._report(launch.job_id, done, launch.iterations):
            running.reported = done
        if done < launch.iterations:
            return
        for gpu in running.gpus:
            gpu.detach()
        running.exited = True
        exit_file = self.directory / f"{launch.job_id}{EXIT_SUFFIX}"
        try:
            write_atomically(exit_file, {"job_id": launch.job_id, "finished_s": self._clock()})
        except OSError as e:
            logger.error("job %s: cannot write %s: %s", launch.job_id, exit_file, e)
        logger.info("job %s: finished its %d iterations", launch.job_id, launch.iterations)

    def run(self, stop: threading.Event, period_s: float = POLL_PERIOD_S) -> None:
        while not stop.wait(period_s):
            try:
                self.poll()
            except Exception:
                logger.exception("simulated job runner: poll failed")


def simulated_node(
    spec_name: str,
    count: int | None,
    *,
    seed: int,
    report: Reporter,
    env: dict[str, str] | None = None,
) -> GpuSet:
    """The node's simulated GPUs, of the kinds ``spec_name`` names (`node_gpu_kinds`: one
    catalog type, ``TYPE:N,…`` mixes, recorded ``.json`` boards); with `JOBS_DIR_ENV` set, a
    `JobRunner` thread runs jobs on them and reports their progress with ``report``, and with
    `SPEED_ENV` set, they work on an `AcceleratedClock`."""
    environ = dict(os.environ) if env is None else env
    speed_text = environ.get(SPEED_ENV, "").strip()
    jobs_dir = environ.get(JOBS_DIR_ENV, "").strip()
    if not speed_text and not jobs_dir:
        return simulated_gpus(spec_name, count, seed=seed)
    try:
        speed = float(speed_text) if speed_text else 1.0
    except ValueError:
        raise InputError(f"{SPEED_ENV} must be a number, got {speed_text!r}") from None
    clock = AcceleratedClock(speed)
    lock = threading.RLock()
    devices = [
        SharedSimulatedGpu(kind, index=i, seed=seed, time_source=clock, lock=lock)
        for i, kind in enumerate(node_gpu_kinds(spec_name, count))
    ]
    if jobs_dir:
        directory = Path(jobs_dir)
        if not directory.is_dir():
            raise InputError(f"{JOBS_DIR_ENV}: {directory} is not a directory")
        runner = JobRunner(devices, directory, report)
        threading.Thread(
            target=runner.run, args=(threading.Event(),), name="simulated-jobs", daemon=True
        ).start()
        logger.info("simulated jobs from %s at %g simulated s per s", directory, speed)
    return GpuSet(devices)
