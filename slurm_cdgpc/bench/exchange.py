"""``bench exchange``: one control interval's exchange with N live node agents on loopback.

Real `AgentHttpServer`s over real `NodeAgent`s in a few worker processes, the real
`NodeExchanger` on the head's side; what it measures is on `bench_exchange`. The process helpers
here (`write_key_file`, `start_workers`, `stop_workers`) serve ``bench register`` too. DESIGN.md,
"The exchange", holds the figures; `tests/unit/test_bench_live.py` runs it small.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import resource
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any, Final

import numpy as np

from slurm_cdgpc.agent.node import NodeAgent
from slurm_cdgpc.agent.server import AgentHttpServer
from slurm_cdgpc.config import SafeCap
from slurm_cdgpc.errors import FatalError, InputError
from slurm_cdgpc.gpu.simulated import simulated_gpus
from slurm_cdgpc.service import settle_heap
from slurm_cdgpc.transport.auth import AccessPolicy, HmacKey, HmacSigner, HmacVerifier
from slurm_cdgpc.transport.evented import EventLoop
from slurm_cdgpc.transport.http import MAX_IN_FLIGHT, NodeExchanger, NodeFailure, NodeTarget
from slurm_cdgpc.wire.protocol import ExchangeRequest, Setpoint

logger = logging.getLogger(__name__)

#: how long worker processes may take to import, build their servers and say they are ready
READY_TIMEOUT_S: Final = 120.0
#: the production default of `NodeExchanger` (cdgpcd does not change it)
DEFAULT_MAX_IN_FLIGHT: Final = MAX_IN_FLIGHT
LEASE_S: Final = 90.0
TMPFS: Final = Path("/dev/shm")
_MAX_REASONS: Final = 3
_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")


# -- processes shared by the live benchmarks ---------------------------------------------------


def scratch_dir(prefix: str, *, prefer_tmpfs: bool) -> tempfile.TemporaryDirectory[str]:
    """A private temporary directory (mode 0700), on ``/dev/shm`` if asked and present."""
    base = str(TMPFS) if prefer_tmpfs and TMPFS.is_dir() and os.access(TMPFS, os.W_OK) else None
    return tempfile.TemporaryDirectory(prefix=prefix, dir=base)


def write_key_file(directory: Path) -> Path:
    """A fresh 32-byte HMAC key (hex) in ``directory``, mode 0600, owned by this user."""
    path = directory / "hmac.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(os.urandom(32).hex() + "\n")
    return path


def load_key(path: Path) -> HmacKey:
    return HmacKey.load(path, owner_uid=os.getuid())


def raise_fd_limit() -> int:
    """Raise the soft open-files limit to the hard one (each agent holds a listening socket)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def worker_preamble() -> None:
    """In a worker: the parent handles Ctrl-C and stops us; open as many sockets as allowed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise_fd_limit()


def wait_for_stop(stop: Event, parent_pid: int) -> None:
    """Block until the parent sets ``stop`` or goes away."""
    while not stop.wait(0.5):
        if os.getppid() != parent_pid:
            logger.warning("the benchmark's parent process is gone: stopping")
            return


@dataclass
class Worker:
    process: SpawnProcess
    conn: Connection


@contextlib.contextmanager
def start_workers(
    target: Callable[..., None], args_per_worker: Sequence[tuple[Any, ...]], name: str
) -> Iterator[tuple[list[Worker], Event, list[Any]]]:
    """Spawn one process per ``args`` running ``target(*args, conn, stop, parent_pid)``.

    Each must send ``("ready", payload)`` (or ``("error", one_line)``) on ``conn`` once it
    serves; yields the workers, the stop event and the payloads in order. On exit (normal,
    exception or Ctrl-C) every worker is stopped: ``stop`` is set, then stragglers are
    terminated and killed.
    """
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    workers: list[Worker] = []
    try:
        for i, args in enumerate(args_per_worker):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            process = ctx.Process(
                target=target,
                args=(*args, child_conn, stop, os.getpid()),
                name=f"{name}-{i}",
                daemon=True,
            )
            process.start()
            child_conn.close()
            workers.append(Worker(process, parent_conn))
        yield workers, stop, _await_ready(workers)
    finally:
        stop_workers(workers, stop)


def _await_ready(workers: Sequence[Worker]) -> list[Any]:
    payloads: dict[int, Any] = {}
    deadline = time.monotonic() + READY_TIMEOUT_S
    pending = {w.conn: i for i, w in enumerate(workers)}
    while pending:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise FatalError(f"{len(pending)} worker process(es) not ready in {READY_TIMEOUT_S} s")
        for conn in wait(list(pending), timeout=min(left_s, 1.0)):
            assert isinstance(conn, Connection)
            i = pending.pop(conn)
            try:
                kind, payload = conn.recv()
            except EOFError:
                raise FatalError(
                    f"worker process {i} died while starting "
                    f"(exit code {workers[i].process.exitcode})"
                ) from None
            if kind != "ready":
                raise FatalError(f"worker process {i} could not start: {payload}")
            payloads[i] = payload
        for conn, i in pending.items():
            if not workers[i].process.is_alive() and not conn.poll():
                raise FatalError(
                    f"worker process {i} died while starting "
                    f"(exit code {workers[i].process.exitcode})"
                )
    return [payloads[i] for i in range(len(workers))]


def stop_workers(workers: Sequence[Worker], stop: Event, timeout_s: float = 15.0) -> None:
    """Ask every worker to stop; terminate, then kill, those that do not."""
    stop.set()
    deadline = time.monotonic() + timeout_s
    for w in workers:
        w.process.join(timeout=max(deadline - time.monotonic(), 0.1))
    for w in workers:
        if w.process.is_alive():
            logger.warning("worker %s did not stop: terminating it", w.process.name)
            w.process.terminate()
            w.process.join(timeout=3.0)
        if w.process.is_alive():
            w.process.kill()
            w.process.join(timeout=3.0)
        w.conn.close()
        w.process.close()


# -- the agents' side ------------------------------------------------------------------------


@dataclass(frozen=True)
class Shard:
    """The nodes one worker process serves."""

    nodes: tuple[str, ...]
    first_seed: int
    key_file: str
    state_dir: str
    gpu_type: str
    gpus_per_node: int


def serve_agents(shard: Shard, conn: Connection, stop: Event, parent_pid: int) -> None:
    """Worker: one `AgentHttpServer` per node of ``shard`` until ``stop`` (spawn target).

    The process's agents share one `EventLoop` and its thread, as each ``cdgpc-noded`` has one
    of its own: a thread per agent here would measure a few hundred threads taking turns at
    one interpreter lock, which no node has."""
    worker_preamble()
    loop = EventLoop(workers=0)
    servers: list[AgentHttpServer] = []
    thread = threading.Thread(target=loop.serve_forever, name="agents", daemon=True)
    try:
        key = load_key(Path(shard.key_file))
        policy = AccessPolicy()
        signer = HmacSigner(key)
        for i, node in enumerate(shard.nodes):
            gpus = simulated_gpus(shard.gpu_type, shard.gpus_per_node, seed=shard.first_seed + i)
            agent = NodeAgent(
                gpus,
                SafeCap(),
                Path(shard.state_dir) / node / "state.json",
                node_name=node,
                lease_duration_s=LEASE_S,
            )
            servers.append(
                AgentHttpServer(
                    ("127.0.0.1", 0), agent, HmacVerifier(key), policy, signer=signer, loop=loop
                )
            )
        settle_heap()  # as cdgpc-noded does before it serves
        thread.start()
        conn.send(("ready", {s.agent.node_name: s.port for s in servers}))
    except Exception as e:  # reported to the parent, which fails with it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        _close_servers(loop, servers, thread)
        return
    try:
        wait_for_stop(stop, parent_pid)
    finally:
        _close_servers(loop, servers, thread)


def _close_servers(
    loop: EventLoop, servers: Sequence[AgentHttpServer], thread: threading.Thread
) -> None:
    if thread.is_alive():
        loop.shutdown()
    for s in servers:
        s.server_close()
    loop.close()


# -- the head's side ---------------------------------------------------------------------------


def _percentile_ms(values_s: Sequence[float], q: float) -> float:
    return round(1e3 * float(np.percentile(values_s, q)), 1) if values_s else float("nan")


def _setpoint_clocks_mhz(gpu_type: str) -> tuple[int, int]:
    """Two supported graphics clocks (about 2/3 and 1/2 of the range) to alternate between."""
    clocks = simulated_gpus(gpu_type, 1, seed=0)[0].supported_clocks().graphics_for(None)
    return clocks[len(clocks) // 3], clocks[len(clocks) // 2]


def bench_exchange(
    nodes: int,
    *,
    gpus_per_node: int = 8,
    processes: int = 4,
    intervals: int = 20,
    warmup: int = 1,
    timeout_s: float = 2.0,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    gpu_type: str = "A100",
) -> dict[str, Any]:
    """The exchange of `intervals` control intervals with `nodes` agents, as JSON.

    Each worker process hosts nodes/processes agents on one event-loop thread (as each
    ``cdgpc-noded`` has one), one loopback port per node, each with simulated GPUs, its own HMAC
    verifier and reply signer. Every interval sends every node a setpoint per GPU, alternating
    between two supported clocks so that the locks and each agent's state file really change, and a
    lease.
    Measured: the wall time of `NodeExchanger.exchange` per interval, the nodes that came back as
    `NodeFailure`, and the CPU of the head and of the agents' processes, which share the cores here
    (so an interval cannot take less than their sum over the cores): pessimistic on CPU, optimistic
    on latency, and no network. State files go to ``/dev/shm`` where it exists
    (``state_on_tmpfs``), so N agents fsyncing one disk do not measure the disk.
    """
    if nodes < 1 or processes < 1 or intervals < 1 or gpus_per_node < 1 or warmup < 0:
        raise InputError("nodes, processes, intervals and GPUs per node must be at least 1")
    if max_in_flight < 1:
        raise InputError(f"max_in_flight must be at least 1, got {max_in_flight}")
    processes = min(processes, nodes)
    load_1m = round(os.getloadavg()[0], 2)  # other work on this machine skews every number
    clocks_mhz = _setpoint_clocks_mhz(gpu_type)
    raise_fd_limit()
    names = [f"bench{i:05d}" for i in range(nodes)]
    with scratch_dir("cdgpc-bench-exchange-", prefer_tmpfs=True) as tmp:
        key_file = write_key_file(Path(tmp))
        shards = [
            Shard(
                nodes=tuple(names[p::processes]),
                first_seed=p * nodes,
                key_file=str(key_file),
                state_dir=tmp,
                gpu_type=gpu_type,
                gpus_per_node=gpus_per_node,
            )
            for p in range(processes)
        ]
        t0 = time.perf_counter()
        with start_workers(serve_agents, [(s,) for s in shards], "cdgpc-bench-agents") as (
            workers,
            _,
            ready,
        ):
            startup_s = time.perf_counter() - t0
            ports: dict[str, int] = {}
            for payload in ready:
                ports.update(payload)
            logger.info("%d agents ready in %.1f s", len(ports), startup_s)
            urls = {node: f"http://127.0.0.1:{ports[node]}" for node in names}
            exchanger = NodeExchanger(
                HmacSigner(load_key(key_file)), timeout_s=timeout_s, max_in_flight=max_in_flight
            )
            exchanger_max_in_flight = exchanger.max_in_flight  # after the open-files bound
            pids = [w.process.pid for w in workers if w.process.pid is not None]
            settle_heap()  # as cdgpcd does before its control loop starts
            try:
                measured = _run_intervals(
                    exchanger, urls, gpus_per_node, clocks_mhz, warmup, intervals, pids
                )
            finally:
                exchanger.close()
        state_on_tmpfs = Path(tmp).is_relative_to(TMPFS)
    return {
        "nodes": nodes,
        "gpus": nodes * gpus_per_node,
        "gpus_per_node": gpus_per_node,
        "gpu_type": gpu_type,
        "processes": processes,
        "intervals": intervals,
        "warmup_intervals": warmup,
        "exchange_timeout_s": timeout_s,
        "exchanger_max_in_flight": exchanger_max_in_flight,
        **measured,
        "agents_startup_s": round(startup_s, 2),
        "state_on_tmpfs": state_on_tmpfs,
        "cpu_count": os.cpu_count(),
        "load_avg_1m_at_start": load_1m,
    }


def _run_intervals(
    exchanger: NodeExchanger,
    urls: dict[str, str],
    gpus_per_node: int,
    clocks_mhz: tuple[int, int],
    warmup: int,
    intervals: int,
    agent_pids: Sequence[int] = (),
) -> dict[str, Any]:
    jobs = {node: str(i + 1) for i, node in enumerate(urls)}
    round_s: list[float] = []
    failures_per_interval: list[int] = []
    reasons: dict[str, int] = {}
    refused = 0
    cpu_s = agents_cpu_s = 0.0
    for k in range(warmup + intervals):
        clock_mhz = clocks_mhz[k % 2]
        lease_expires_s = time.time() + LEASE_S
        targets = {
            node: NodeTarget(
                url,
                ExchangeRequest(
                    node=node,
                    interval=k,
                    lease_expires_s=lease_expires_s,
                    setpoints=tuple(
                        Setpoint(gpu=g, job_id=jobs[node], graphics_mhz=clock_mhz)
                        for g in range(gpus_per_node)
                    ),
                ),
            )
            for node, url in urls.items()
        }
        agents0 = _processes_cpu_s(agent_pids)
        cpu0, t0 = time.process_time(), time.perf_counter()
        results = exchanger.exchange(targets)
        elapsed_s, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        agents_cpu = _processes_cpu_s(agent_pids) - agents0
        failed = [r.reason for r in results.values() if isinstance(r, NodeFailure)]
        logger.info("interval %d: %.1f ms, %d failure(s)", k, 1e3 * elapsed_s, len(failed))
        if k < warmup:
            continue
        round_s.append(elapsed_s)
        cpu_s += cpu
        agents_cpu_s += agents_cpu
        failures_per_interval.append(len(failed))
        for reason in failed:
            key = _reason_kind(reason)
            reasons[key] = reasons.get(key, 0) + 1
        refused += sum(len(r.refused) for r in results.values() if not isinstance(r, NodeFailure))
    return {
        "interval_ms_p50": _percentile_ms(round_s, 50),
        "interval_ms_p99": _percentile_ms(round_s, 99),
        "interval_ms_max": _percentile_ms(round_s, 100),
        "failures": sum(failures_per_interval),
        "failures_max_per_interval": max(failures_per_interval),
        "failure_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:_MAX_REASONS]),
        "refused_setpoints": refused,
        "head_cpu_ms_per_interval": round(1e3 * cpu_s / intervals, 1),
        "agents_cpu_ms_per_interval": (
            round(1e3 * agents_cpu_s / intervals, 1) if agent_pids else None
        ),
    }


def _processes_cpu_s(pids: Sequence[int]) -> float:
    """User + system CPU seconds of the agents' processes so far (Linux ``/proc``; 0 if
    unreadable): with the head's, where an interval's time goes when the cores are shared."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return total


def _reason_kind(reason: str) -> str:
    """A failure reason without the node's URL (so that equal causes group)."""
    head, sep, tail = reason.partition(": ")
    return (tail if sep and head.startswith("http") else reason)[:120]
