"""Slurm's part in the demo: submit the trace's jobs, place them, run the Prolog and the Epilog.

Placement is FIFO, first fit on whole GPUs of one node; a job that does not fit yet waits and
later ones that fit start meanwhile (backfill without reservations: Slurm's default scheduler
backfills too, and a strict FIFO head-of-line job would idle a quarter of this small cluster).
When a job is placed, the replayer does what slurmd does, in its order: the real Prolog logic
(`slurm_cdgpc.slurm.hooks.run_prolog`, with the job's deadline and iteration count in its
``--comment``) registers it with the head and holds its GPUs at the safe cap through the node's
agent, then the job's work starts on the node's simulated GPUs (a launch file,
`slurm_cdgpc.gpu.workloads`). When the node says the work is done (the exit
file), the real Epilog logic (`run_epilog`) resets the GPUs through the node's agent and
deregisters the job, and the GPUs are free again.

Time: one wall-clock second is ``speed`` trace seconds. A job submitted at trace time s is
submitted ``s / speed`` wall seconds after the start; its deadline, ``d`` trace seconds after its
submission, becomes ``d / speed`` wall seconds after its wall-clock submission, which is what the
head sees. Iterations run at the trace's pace (duration / iterations at top clocks) on the
accelerated GPU clock, so the head measures iteration times divided by ``speed``, consistently.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pwd
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from slurm_cdgpc.config import load_config
from slurm_cdgpc.demo.trace import TraceJob
from slurm_cdgpc.gpu.workloads import EXIT_SUFFIX, LAUNCH_SUFFIX, Launch, write_atomically
from slurm_cdgpc.localcluster import LocalCluster, Node
from slurm_cdgpc.slurm.env import HookEnv
from slurm_cdgpc.slurm.hooks import (
    HookSettings,
    hold_gpus,
    make_local_hold,
    make_local_release,
    run_epilog,
    run_prolog,
)
from slurm_cdgpc.slurm.scontrol import JobTimes
from slurm_cdgpc.slurm.spool import Spool
from slurm_cdgpc.transport.credentials import signer_from_config
from slurm_cdgpc.transport.http import HeadClient

logger = logging.getLogger(__name__)

#: each hook's time budget (the installed hooks default to 2 s)
HOOK_BUDGET_S = 2.0


@dataclass
class Placed:
    """A job on a node: what the replayer knows of it."""

    job: TraceJob
    node: Node
    gpus: tuple[int, ...]
    submitted_wall_s: float
    started_wall_s: float
    deadline_wall_s: float
    finished_wall_s: float | None = None


@dataclass
class Replayer:
    """Submits, places, starts and ends the trace's jobs on a `LocalCluster`."""

    cluster: LocalCluster
    jobs: Sequence[TraceJob]
    speed: float
    on_event: Callable[[str], None] = lambda _: None
    start_wall_s: float = 0.0
    queue: deque[tuple[TraceJob, float]] = field(default_factory=deque)
    running: dict[str, Placed] = field(default_factory=dict)
    finished: list[Placed] = field(default_factory=list)
    hook_failures: int = 0
    _next: int = 0
    _free: dict[str, set[int]] = field(default_factory=dict)
    _clients: dict[str, HeadClient] = field(default_factory=dict)
    _releases: dict[str, Callable[[str], str]] = field(default_factory=dict)
    _holds: dict[str, Callable[[str, Sequence[int]], str]] = field(default_factory=dict)
    _user: str = ""

    def start(self, now_wall_s: float | None = None) -> None:
        self.start_wall_s = time.time() if now_wall_s is None else now_wall_s
        self._user = pwd.getpwuid(os.geteuid()).pw_name
        for node in self.cluster.nodes.values():
            self._free[node.name] = set(range(node.gpus or 0))
            config = load_config(node.config, env={})
            self._clients[node.name] = HeadClient(
                config.head.url, signer_from_config(config, 1.0), timeout_s=1.0
            )
            settings = HookSettings(config_path=node.config, timeout_s=1.0)
            # as slurmd tells a hook: the node whose agent must sign the hold and the release
            node_env = {**self.cluster.env, "SLURMD_NODENAME": node.name}
            self._releases[node.name] = make_local_release(settings, node_env)
            self._holds[node.name] = make_local_hold(settings, node_env)

    def trace_s(self, wall_s: float) -> float:
        """Trace seconds since the start of the replay at wall-clock time ``wall_s``."""
        return (wall_s - self.start_wall_s) * self.speed

    def step(self, now_wall_s: float | None = None) -> None:
        """Submit what is due, end what finished, place what fits (in that order)."""
        now = time.time() if now_wall_s is None else now_wall_s
        while self._next < len(self.jobs) and self.jobs[self._next].submit_s <= self.trace_s(now):
            job = self.jobs[self._next]
            self.queue.append((job, self.start_wall_s + job.submit_s / self.speed))
            self._next += 1
        for placed in list(self.running.values()):
            exit_file = placed.node.jobs_dir / f"{placed.job.job_id}{EXIT_SUFFIX}"
            if exit_file.exists():
                self._end(placed, exit_file)
        waiting: deque[tuple[TraceJob, float]] = deque()
        while self.queue:
            job, submitted = self.queue.popleft()
            node = next(
                (n for n in self.cluster.nodes.values() if len(self._free[n.name]) >= job.gpus),
                None,
            )
            if node is None:
                waiting.append((job, submitted))
            else:
                self._start(job, node, submitted)
        self.queue = waiting

    def _hook_env(self, placed: Placed, comment: str = "") -> HookEnv:
        return HookEnv(placed.job.job_id, self._user, placed.node.name, placed.gpus, comment)

    def _start(self, job: TraceJob, node: Node, submitted_wall_s: float) -> None:
        free = self._free[node.name]
        gpus = tuple(sorted(free)[: job.gpus])
        free.difference_update(gpus)
        deadline_wall_s = submitted_wall_s + job.deadline_s / self.speed
        placed = Placed(job, node, gpus, submitted_wall_s, time.time(), deadline_wall_s)
        deadline = datetime.fromtimestamp(deadline_wall_s, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        comment = f"deadline={deadline} iters={job.iterations}"
        outcome = run_prolog(
            self._hook_env(placed, comment),
            self._clients[node.name],
            Spool(self.cluster.run_dir / "spool" / node.name),
            now_s=time.time(),
            until_s=time.monotonic() + HOOK_BUDGET_S,
            # what `scontrol show job` says of a job submitted as `sbatch -J MODEL`: its name
            times=lambda _job: JobTimes(name=job.model),
        )
        outcome = hold_gpus(self._hook_env(placed), outcome, self._holds[node.name])
        if outcome.action != "registered" or "local hold failed" in outcome.line:
            self.hook_failures += 1
            logger.warning("prolog: %s", outcome.line)
        launch = Launch(job.job_id, gpus, job.model, job.iterations, job.iteration_time_s)
        write_atomically(node.jobs_dir / f"{job.job_id}{LAUNCH_SUFFIX}", launch.to_dict())
        self.running[job.job_id] = placed
        self.on_event(
            f"job {job.job_id} ({job.model}, {job.gpus} GPU) starts on {node.name} "
            f"GPU {','.join(map(str, gpus))}"
        )

    def _end(self, placed: Placed, exit_file: Path) -> None:
        job_id = placed.job.job_id
        try:
            placed.finished_wall_s = float(json.loads(exit_file.read_text())["finished_s"])
        except (OSError, ValueError, KeyError, TypeError):
            placed.finished_wall_s = time.time()
        outcome = run_epilog(
            self._hook_env(placed),
            self._clients[placed.node.name],
            Spool(self.cluster.run_dir / "spool" / placed.node.name),
            until_s=time.monotonic() + HOOK_BUDGET_S,
            release=self._releases[placed.node.name],
        )
        if outcome.action != "deregistered" or "local reset failed" in outcome.line:
            self.hook_failures += 1
            logger.warning("epilog: %s", outcome.line)
        for path in (placed.node.jobs_dir / f"{job_id}{LAUNCH_SUFFIX}", exit_file):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._free[placed.node.name].update(placed.gpus)
        del self.running[job_id]
        self.finished.append(placed)
        late = placed.finished_wall_s > placed.deadline_wall_s
        self.on_event(f"job {job_id} finished{' after its deadline' if late else ''}")

    @property
    def submitted(self) -> int:
        return self._next


def trace_clock(start_wall_s: float, speed: float) -> Callable[[float], float]:
    """Wall-clock time → trace seconds since the start (for tables and plots)."""
    return lambda wall_s: (wall_s - start_wall_s) * speed
