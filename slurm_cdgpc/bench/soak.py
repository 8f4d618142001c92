"""``bench soak``: a real cdgpcd under job churn on a large simulated cluster, in accelerated time.

The head is a real ``cdgpcd`` started through `slurm_cdgpc.localcluster`; the nodes are real
node agents in worker processes (`slurm_cdgpc.bench.exchange.serve_agents`). What it measures
is on `bench_soak`; DESIGN.md, "Known gaps", holds the figures; `tests/faults/test_soak.py` runs it.
"""

from __future__ import annotations

import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np

from slurm_cdgpc.bench.exchange import (
    Shard,
    raise_fd_limit,
    scratch_dir,
    serve_agents,
    start_workers,
    write_key_file,
)
from slurm_cdgpc.errors import CdgpcError, FatalError, InputError
from slurm_cdgpc.gpu.catalog import catalog_spec
from slurm_cdgpc.localcluster import Daemon, LocalCluster, hmac_auth
from slurm_cdgpc.store import Store, make_engine
from slurm_cdgpc.transport.http import HeadClient

logger = logging.getLogger(__name__)

#: intervals after the fill before the memory baseline is taken
WARMUP_INTERVALS: Final = 5
#: job sizes in GPUs, all on one node (those above the node's GPU count are left out)
JOB_SIZES: Final = (1, 2, 4, 8)
#: threads the driver sends registrations and deregistrations from, after the burst
DRIVER_THREADS: Final = 16
#: the head's budget, as a fraction of every GPU at its maximum power limit
BUDGET_FRACTION: Final = 0.6
HEAD_START_TIMEOUT_S: Final = 60.0
_MB: Final = 1024.0 * 1024.0


@dataclass(frozen=True)
class SoakSettings:
    nodes: int = 1000
    gpus_per_node: int = 8
    sim_minutes: float = 30.0
    #: cluster seconds per wall second
    accel: float = 6.0
    #: the control interval in cluster time (cdgpcd's default)
    sim_interval_s: float = 30.0
    processes: int = 4
    burst: int = 200
    mean_job_sim_s: float = 600.0
    occupancy: float = 0.7
    gpu_type: str = "A100"
    rss_period_s: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if min(self.nodes, self.gpus_per_node, self.processes) < 1 or self.burst < 0:
            raise InputError("nodes, GPUs per node and processes must be at least 1")
        if not (self.sim_minutes > 0 and self.accel > 0 and self.sim_interval_s > 0):
            raise InputError("simulated minutes, acceleration and interval must be positive")
        if not 0 < self.occupancy <= 1:
            raise InputError(f"occupancy must be in (0, 1], got {self.occupancy}")
        if not self.mean_job_sim_s > 0:
            raise InputError("the mean job length must be positive")

    @property
    def interval_s(self) -> float:
        """The head's control interval in wall seconds."""
        return self.sim_interval_s / self.accel


@dataclass
class _Job:
    job_id: str
    node: str
    gpus: tuple[int, ...]
    end_sim_s: float


@dataclass
class _Churn:
    """Which GPUs are busy, which jobs run and when each ends (cluster time)."""

    settings: SoakSettings
    names: Sequence[str]
    rng: random.Random
    free: dict[str, list[int]] = field(default_factory=dict)
    running: dict[str, _Job] = field(default_factory=dict)
    next_id: int = 1
    busy_gpus: int = 0

    def __post_init__(self) -> None:
        self.free = {n: list(range(self.settings.gpus_per_node)) for n in self.names}

    @property
    def target_busy(self) -> int:
        return int(self.settings.occupancy * len(self.names) * self.settings.gpus_per_node)

    def new_job(self, now_sim_s: float) -> _Job | None:
        sizes = [s for s in JOB_SIZES if s <= self.settings.gpus_per_node]
        size = self.rng.choice(sizes)
        for _ in range(20):  # a few random nodes, then give up for this round
            node = self.rng.choice(self.names)
            if len(self.free[node]) >= size:
                gpus = tuple(sorted(self.free[node][:size]))
                del self.free[node][:size]
                job = _Job(
                    str(self.next_id),
                    node,
                    gpus,
                    now_sim_s + self.rng.expovariate(1.0 / self.settings.mean_job_sim_s),
                )
                self.next_id += 1
                self.running[job.job_id] = job
                self.busy_gpus += size
                return job
        return None

    def end(self, job: _Job) -> None:
        self.running.pop(job.job_id, None)
        self.free[job.node].extend(job.gpus)
        self.busy_gpus -= len(job.gpus)


@dataclass
class _Counters:
    lock: threading.Lock = field(default_factory=threading.Lock)
    registered: int = 0
    finished: int = 0
    failures: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def failed(self, error: Exception) -> None:
        with self.lock:
            self.failures += 1
            key = str(error)[:120]
            self.reasons[key] = self.reasons.get(key, 0) + 1


def rss_mb(pid: int) -> float | None:
    """Resident memory of ``pid`` (MB), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def _percentiles_ms(values_s: Sequence[float]) -> dict[str, float]:
    if not values_s:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    a = np.asarray(values_s) * 1e3
    return {
        "p50": round(float(np.percentile(a, 50)), 1),
        "p99": round(float(np.percentile(a, 99)), 1),
        "max": round(float(a.max()), 1),
    }


def bench_soak(settings: SoakSettings) -> dict[str, Any]:
    """The soak's figures, as JSON.

    One control interval stands for ``sim_interval_s`` of cluster time and lasts
    ``sim_interval_s / accel`` wall seconds. Jobs churn as Slurm would drive them: each takes 1, 2,
    4 or 8 free GPUs of one node for an exponential time (mean ``mean_job_sim_s``), registered with
    ``POST /v1/jobs`` and deregistered with ``DELETE /v1/jobs/{id}``, keeping ``occupancy`` of the
    GPUs busy; the first ``burst`` registrations go out at once, like a large job array's Prologs.

    Measured: cdgpcd's ``VmRSS`` every ``rss_period_s``; its interval periods (between consecutive
    decisions in the store); failed node exchanges (``nodes_unreachable`` from ``GET /v1/status``);
    the burst's latencies; every request not answered with success. ``rss_start_mb`` is taken once
    the cluster is full and `WARMUP_INTERVALS` intervals ran; ``rss_slope_mb_per_sim_hour`` is the
    least-squares slope from then on and ``rss_by_tenth_mb`` the RSS at each tenth (a curve that
    flattens is a cache settling, a straight line a leak). Not measured: the network and real GPUs
    (the simulated GPUs idle: the head's memory and loop are soaked, not power).
    """
    settings.check()
    if os.geteuid() != 0:
        raise InputError("bench soak runs cdgpcd, whose HMAC key must be root's: run it as root")
    spec = catalog_spec(settings.gpu_type)
    processes = min(settings.processes, settings.nodes)
    load_1m = round(os.getloadavg()[0], 2)
    raise_fd_limit()
    names = [f"soak{i:05d}" for i in range(settings.nodes)]
    with (
        scratch_dir("cdgpc-soak-agents-", prefer_tmpfs=True) as agents_tmp,
        scratch_dir("cdgpc-soak-head-", prefer_tmpfs=False) as head_tmp,
    ):
        key_file = write_key_file(Path(head_tmp))
        shards = [
            Shard(
                nodes=tuple(names[p::processes]),
                first_seed=p * settings.nodes,
                key_file=str(key_file),
                state_dir=agents_tmp,
                gpu_type=settings.gpu_type,
                gpus_per_node=settings.gpus_per_node,
            )
            for p in range(processes)
        ]
        with start_workers(serve_agents, [(s,) for s in shards], "cdgpc-soak-agents") as (
            _,
            _,
            ready,
        ):
            ports: dict[str, int] = {}
            for payload in ready:
                ports.update(payload)
            cluster = LocalCluster(
                Path(head_tmp),
                hmac_auth(key_file, admin=True),
                interval_s=settings.interval_s,
                lease_s=3 * settings.interval_s,
                start_timeout_s=HEAD_START_TIMEOUT_S,
            )
            cluster.add_head("cdgpcd")
            try:
                head = cluster.start_head()
                max_power_w = spec.power_limit.max_w
                measured = _soak(settings, cluster.client(), head, names, ports, max_power_w)
                measured.update(_periods(cluster.head.store_url, settings.interval_s))
            finally:
                cluster.stop(timeout_s=30.0)
            text = head.text()
    return {
        "nodes": settings.nodes,
        "gpus": settings.nodes * settings.gpus_per_node,
        "gpus_per_node": settings.gpus_per_node,
        "gpu_type": settings.gpu_type,
        "sim_minutes": settings.sim_minutes,
        "accel": settings.accel,
        "interval_s": round(settings.interval_s, 3),
        "sim_interval_s": settings.sim_interval_s,
        "processes": processes,
        **measured,
        "overrun_warnings": text.count("interval overran"),
        "failed_intervals": len(re.findall(r"interval \d+ failed", text)),
        "head_exit_code": head.proc.returncode,
        "cpu_count": os.cpu_count(),
        "load_avg_1m_at_start": load_1m,
    }


def _soak(
    settings: SoakSettings,
    client: HeadClient,
    head: Daemon,
    names: Sequence[str],
    ports: dict[str, int],
    max_power_w: float,
) -> dict[str, Any]:
    counters = _Counters()
    with ThreadPoolExecutor(DRIVER_THREADS) as pool:
        list(
            pool.map(
                lambda n: client.post(
                    "/v1/nodes", {"node": n, "url": f"http://127.0.0.1:{ports[n]}"}
                ),
                names,
            )
        )
    budget_w = BUDGET_FRACTION * len(names) * settings.gpus_per_node * max_power_w
    client.post("/v1/budget", {"budget_w": budget_w, "reason": "bench soak"})

    churn = _Churn(settings, names, random.Random(settings.seed))
    t0 = time.monotonic()

    def sim_now() -> float:
        return (time.monotonic() - t0) * settings.accel

    def register(job: _Job) -> float:
        started = time.perf_counter()
        try:
            client.post(
                "/v1/jobs",
                {"job_id": job.job_id, "user": "root", "node": job.node, "gpus": list(job.gpus)},
            )
        except CdgpcError as e:
            counters.failed(e)
        else:
            with counters.lock:
                counters.registered += 1
        return time.perf_counter() - started

    def deregister(job: _Job) -> None:
        try:
            client.delete(f"/v1/jobs/{job.job_id}")
        except CdgpcError as e:
            counters.failed(e)
        else:
            with counters.lock:
                counters.finished += 1

    # the burst: `burst` Prologs at once, each on its own thread
    burst = [j for _ in range(settings.burst) if (j := churn.new_job(0.0)) is not None]
    with ThreadPoolExecutor(max(len(burst), 1)) as pool:
        burst_s = list(pool.map(register, burst))
    burst_failures = counters.failures
    # the rest of the fill, then churn until the simulated time is up
    samples = _Sampler(client, head.pid, settings.rss_period_s, settings.interval_s)
    samples.start()
    end_sim_s = settings.sim_minutes * 60.0
    with ThreadPoolExecutor(DRIVER_THREADS) as pool:
        while (now_s := sim_now()) < end_sim_s and head.proc.poll() is None:
            ending = [j for j in churn.running.values() if j.end_sim_s <= now_s]
            for job in ending:
                churn.end(job)
            list(pool.map(deregister, ending))
            starting: list[_Job] = []
            while churn.busy_gpus < churn.target_busy:
                new = churn.new_job(now_s)
                if new is None:
                    break
                starting.append(new)
            list(pool.map(register, starting))
            if samples.filled_at is None and churn.busy_gpus >= churn.target_busy:
                samples.filled_at = samples.interval
            time.sleep(0.1)
    samples.stop()
    if head.proc.poll() is not None:
        raise FatalError(f"cdgpcd exited with {head.proc.returncode} during the soak")
    return {
        "jobs_registered": counters.registered,
        "jobs_finished": counters.finished,
        "jobs_running_at_end": len(churn.running),
        "request_failures": counters.failures,
        "failure_reasons": dict(sorted(counters.reasons.items(), key=lambda kv: -kv[1])[:3]),
        "burst_registrations": len(burst),
        "burst_ms": _percentiles_ms(burst_s),
        "burst_failures": burst_failures,
        "wall_s": round(time.monotonic() - t0, 1),
        **samples.summary(settings.accel),
    }


class _Sampler:
    """cdgpcd's RSS every ``rss_period_s`` and its status every half interval, on a thread."""

    def __init__(self, client: HeadClient, pid: int, rss_period_s: float, interval_s: float):
        self.client = client
        self.pid = pid
        self.rss_period_s = rss_period_s
        self.status_period_s = max(interval_s / 2, 0.05)
        self.rss: list[tuple[float, float, int]] = []  # (wall s, MB, interval)
        self.unreachable: dict[int, int] = {}  # interval -> nodes unreachable
        self.controlled: dict[int, int] = {}
        self.interval = -1
        self.filled_at: int | None = None
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(self.rss_period_s, self._rss), daemon=True),
            threading.Thread(
                target=self._loop, args=(self.status_period_s, self._status), daemon=True
            ),
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)

    def _loop(self, period_s: float, sample: Callable[[], None]) -> None:
        while not self._stop.wait(period_s):
            try:
                sample()
            except CdgpcError as e:
                logger.debug("sample skipped: %s", e)

    def _rss(self) -> None:
        mb = rss_mb(self.pid)
        if mb is not None:
            self.rss.append((time.monotonic(), mb, self.interval))

    def _status(self) -> None:
        last = self.client.get("/v1/status").get("last_interval")
        if last is None:
            return
        k = int(last["interval"])
        self.interval = k
        self.unreachable[k] = int(last["nodes_unreachable"])
        self.controlled[k] = int(last.get("jobs_controlled", 0))

    def summary(self, accel: float) -> dict[str, Any]:
        if not self.rss:
            raise FatalError("no memory sample of cdgpcd was taken")
        baseline_at = (self.filled_at if self.filled_at is not None else 0) + WARMUP_INTERVALS
        settled = [(t, mb) for t, mb, k in self.rss if k >= baseline_at] or [
            (t, mb) for t, mb, _ in self.rss[len(self.rss) // 2 :]
        ]
        times = np.array([t for t, _ in settled])
        mbs = np.array([mb for _, mb in settled])
        slope = 0.0
        if len(settled) >= 3 and times[-1] > times[0]:
            slope = float(np.polyfit(times - times[0], mbs, 1)[0])  # MB per wall second
        return {
            "intervals": len(self.unreachable),
            "exchange_failures": sum(self.unreachable.values()),
            "intervals_with_failures": sum(1 for v in self.unreachable.values() if v),
            "jobs_controlled_max": max(self.controlled.values(), default=0),
            "rss_launch_mb": round(self.rss[0][1], 1),
            "rss_start_mb": round(float(mbs[0]), 1),
            "rss_end_mb": round(float(mbs[-1]), 1),
            "rss_max_mb": round(max(mb for _, mb, _ in self.rss), 1),
            "rss_slope_mb_per_sim_hour": round(slope * 3600.0 / accel, 2),
            # the curve, not just its ends: a cache or an allocator settling flattens out, a leak
            # does not (the settled samples at each tenth of the run)
            "rss_by_tenth_mb": [
                round(float(mbs[min(int(i * len(mbs) / 10), len(mbs) - 1)]), 1)
                for i in range(1, 11)
            ],
        }


def _periods(store_url: str, interval_s: float) -> dict[str, Any]:
    """Interval periods from the decisions' time stamps (the loop's real cadence)."""
    engine = make_engine(store_url)
    try:
        decisions = Store(engine).decisions(limit=100_000)
    finally:
        engine.dispose()
    times = np.array(sorted(d.time_s for d in decisions))
    periods = np.diff(times)
    if not len(periods):
        return {"decisions": len(times)}
    return {
        "decisions": len(times),
        "interval_period_s_p50": round(float(np.percentile(periods, 50)), 3),
        "interval_period_s_p99": round(float(np.percentile(periods, 99)), 3),
        "interval_period_s_max": round(float(periods.max()), 3),
        "interval_overrun_share": round(float(np.mean(periods > 1.5 * interval_s)), 4),
    }
