"""``bench register``: job registrations (``POST /v1/jobs``, as the Prolog sends them) under load.

A real `HeadHttpServer` over a real `Coordinator` and a SQLite store in its own process,
Prolog-like clients in others; what it measures is on `bench_register`. DESIGN.md, "The head's
API", holds the figures; `tests/unit/test_bench_live.py` runs it small.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any, Final

import numpy as np

from slurm_cdgpc.bench.exchange import (
    load_key,
    scratch_dir,
    start_workers,
    wait_for_stop,
    worker_preamble,
    write_key_file,
)
from slurm_cdgpc.coordinator.api import HeadHttpServer
from slurm_cdgpc.coordinator.daemon import Coordinator, CoordinatorSettings
from slurm_cdgpc.errors import CdgpcError, InputError
from slurm_cdgpc.service import LOG_FORMAT, settle_heap
from slurm_cdgpc.store import ACTIVE_STATES, Store, make_engine, upgrade
from slurm_cdgpc.transport.auth import AccessPolicy, HmacKey, HmacSigner, HmacVerifier
from slurm_cdgpc.transport.http import HeadClient, NodeFailure, NodeTarget
from slurm_cdgpc.wire.protocol import ExchangeResponse

logger = logging.getLogger(__name__)

GPUS_PER_NODE: Final = 8
#: jobs registered directly (no HTTP) to time the store write alone
STORE_PROBES: Final = 50
#: the Prolog's job ids start here; the probes' below
FIRST_JOB_ID: Final = 1_000_000
_MAX_REASONS: Final = 3
_DEFAULT_MAX_CONNECTIONS: Final = int(
    inspect.signature(HeadHttpServer.__init__).parameters["max_connections"].default
)


class _NoAgents:
    """Every node is unreachable: the loop runs, nothing is exchanged."""

    def exchange(
        self, targets: Mapping[str, NodeTarget]
    ) -> dict[str, ExchangeResponse | NodeFailure]:
        return {node: NodeFailure("benchmark: no agents") for node in targets}


@dataclass(frozen=True)
class HeadOptions:
    db_file: str
    log_file: str
    key_file: str
    interval_s: float
    max_connections: int | None
    listen_backlog: int | None


def _head_server(coordinator: Coordinator, options: HeadOptions, key: HmacKey) -> HeadHttpServer:
    """The API as cdgpcd serves it: HMAC credentials checked, answers signed."""
    verifier = HmacVerifier(key)
    policy = AccessPolicy(hmac_is_admin=False)
    kwargs: dict[str, Any] = {"signer": HmacSigner(key)}
    if options.max_connections is not None:
        kwargs["max_connections"] = options.max_connections
    if options.listen_backlog is None:
        return HeadHttpServer(("127.0.0.1", 0), coordinator, verifier, policy, **kwargs)

    class _Backlogged(HeadHttpServer):
        request_queue_size = options.listen_backlog  # type: ignore[assignment]

    return _Backlogged(("127.0.0.1", 0), coordinator, verifier, policy, **kwargs)


def serve_head(options: HeadOptions, conn: Connection, stop: Event, parent_pid: int) -> None:
    """Worker: cdgpcd's API and control loop over a SQLite store until ``stop`` (spawn target)."""
    worker_preamble()
    logging.basicConfig(filename=options.log_file, level=logging.INFO, format=LOG_FORMAT)
    engine = make_engine(f"sqlite:///{options.db_file}")
    loop_stop = threading.Event()
    try:
        upgrade(engine)
        coordinator = Coordinator(
            Store(engine), _NoAgents(), CoordinatorSettings(interval_s=options.interval_s)
        )
        coordinator.start()
        probe_s = []
        for i in range(STORE_PROBES):
            t0 = time.perf_counter()
            coordinator.register_job(str(i + 1), "bench", "probe", [i % GPUS_PER_NODE])
            probe_s.append(time.perf_counter() - t0)
        server = _head_server(coordinator, options, load_key(Path(options.key_file)))
        settle_heap()  # as cdgpcd does before it serves
    except Exception as e:  # reported to the parent, which fails with it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        engine.dispose()
        return
    threads = [
        threading.Thread(target=server.serve_forever, name="http", daemon=True),
        threading.Thread(target=coordinator.run, args=(loop_stop,), name="loop", daemon=True),
    ]
    for t in threads:
        t.start()
    try:
        cpu0 = time.process_time()
        conn.send(("ready", {"port": server.port, "probe_s": probe_s}))
        wait_for_stop(stop, parent_pid)
        cpu_s = time.process_time() - cpu0
        jobs = len(coordinator.store.jobs(ACTIVE_STATES)) - STORE_PROBES
        group = coordinator.registrations.group_commit  # the probes' batches included
        conn.send(
            (
                "done",
                {
                    "jobs": jobs,
                    "cpu_s": cpu_s,
                    "batches": group.batches - STORE_PROBES,
                    "largest_batch": group.largest_batch,
                },
            )
        )
    finally:
        loop_stop.set()
        server.shutdown()
        server.server_close()
        for t in threads:
            t.join(timeout=5.0)
        engine.dispose()


@dataclass
class _Client:
    latencies_s: list[float]
    errors: list[str]


def _client(
    client: HeadClient, node: str, job_ids: Sequence[int], start: threading.Barrier, out: _Client
) -> None:
    start.wait()
    for k, job in enumerate(job_ids):
        payload = {
            "job_id": str(job),
            "user": "bench",
            "node": node,
            "gpus": [k % GPUS_PER_NODE],
            "gpu_type": "A100",
        }
        t0 = time.perf_counter()
        try:
            client.post("/v1/jobs", payload)
        except CdgpcError as e:
            out.errors.append(str(e))
        out.latencies_s.append(time.perf_counter() - t0)


def run_prologs(
    url: str,
    key_file: str,
    threads: Sequence[tuple[str, Sequence[int]]],
    timeout_s: float,
    conn: Connection,
    stop: Event,
    parent_pid: int,
) -> None:
    """Worker: one client thread per ``(node, job ids)``; they start together on the parent's
    ``go`` and their latencies go back on ``conn`` (spawn target)."""
    worker_preamble()
    signer = HmacSigner(load_key(Path(key_file)), uid=0, gid=0)
    outs = [_Client([], []) for _ in threads]
    barrier = threading.Barrier(len(threads) + 1)
    workers = [
        threading.Thread(
            target=_client,
            args=(HeadClient(url, signer, timeout_s=timeout_s), node, jobs, barrier, out),
            name=f"prolog-{node}",
            daemon=True,
        )
        for (node, jobs), out in zip(threads, outs, strict=True)
    ]
    for t in workers:
        t.start()
    conn.send(("ready", None))
    if conn.recv() != "go":
        return
    cpu0 = time.process_time()
    barrier.wait()
    for t in workers:
        t.join()
    conn.send(
        (
            "done",
            {
                "latencies_s": [x for o in outs for x in o.latencies_s],
                "errors": [e for o in outs for e in o.errors],
                "cpu_s": time.process_time() - cpu0,
            },
        )
    )
    wait_for_stop(stop, parent_pid)


def _ms(values_s: Sequence[float], q: float) -> float:
    return round(1e3 * float(np.percentile(values_s, q)), 1) if len(values_s) else float("nan")


def bench_register(
    concurrency: int,
    requests: int,
    *,
    timeout_s: float = 10.0,
    interval_s: float = 30.0,
    max_connections: int | None = None,
    listen_backlog: int | None = None,
    client_processes: int = 4,
) -> dict[str, Any]:
    """`requests` registrations from `concurrency` Prolog-like clients, as JSON.

    The head runs its control loop with no agents (every node unreachable) over SQLite in WAL mode,
    with HMAC auth on a fresh key, and logs as ``cdgpcd`` does (INFO, a line per registration) to a
    file where ``cdgpcd`` would write to journald. Each client thread is a `HeadClient` like the
    Prolog's (a connection per request) registering distinct jobs on its own node's GPUs; the
    threads are spread over `client_processes` processes, since real Prologs are separate processes
    and many threads in one process measure its lock more than the head. Latency runs from the call
    to the parsed answer; the clients' CPU is reported apart (``clients_cpu_s``).

    Before the clients start, the head times `Coordinator.register_job` one call at a time
    (``store_register_ms_*``): one durable commit with no HTTP and no contention. Under load,
    registrations read in one event-loop turn commit together (`slurm_cdgpc.store.group_commit`;
    ``registration_batches``, ``largest_batch``), each answered only after its own commit.
    ``head_cpu_ms_per_request`` is the head process's CPU over the requests: with the head bound by
    one core, ``1000 / that`` bounds the requests per second. The listener is the production one
    (at most 256 connections, backlog 1024) unless `max_connections` or `listen_backlog` is given.
    """
    if concurrency < 1 or requests < 1 or client_processes < 1:
        raise InputError("concurrency, requests and client processes must be at least 1")
    concurrency = min(concurrency, requests)
    load_1m = round(os.getloadavg()[0], 2)  # other work on this machine skews every number
    with scratch_dir("cdgpc-bench-register-", prefer_tmpfs=False) as tmp:
        key_file = write_key_file(Path(tmp))
        options = HeadOptions(
            db_file=str(Path(tmp) / "head.db"),
            log_file=str(Path(tmp) / "head.log"),
            key_file=str(key_file),
            interval_s=interval_s,
            max_connections=max_connections,
            listen_backlog=listen_backlog,
        )
        with start_workers(serve_head, [(options,)], "cdgpc-bench-head") as (workers, stop, ready):
            [head] = ready
            url = f"http://127.0.0.1:{head['port']}"
            per_process = [
                [
                    (f"bench{c:05d}", range(FIRST_JOB_ID + c, FIRST_JOB_ID + requests, concurrency))
                    for c in range(p, concurrency, client_processes)
                ]
                for p in range(client_processes)
            ]
            prolog_args = [(url, str(key_file), t, timeout_s) for t in per_process if t]
            with start_workers(run_prologs, prolog_args, "cdgpc-bench-prologs") as (clients, _, _):
                t0 = time.perf_counter()
                for c in clients:
                    c.conn.send("go")
                results = [c.conn.recv()[1] for c in clients]
                wall_s = time.perf_counter() - t0
            stop.set()
            conn = workers[0].conn
            done = conn.recv() if conn.poll(30.0) else ("done", {})
            server = done[1]
    latencies_s = [x for r in results for x in r["latencies_s"]]
    errors = [e for r in results for e in r["errors"]]
    client_cpu_s = sum(r["cpu_s"] for r in results)
    reasons: dict[str, int] = {}
    for e in errors:
        reasons[e[:120]] = reasons.get(e[:120], 0) + 1
    probe_s = head["probe_s"]
    return {
        "concurrency": concurrency,
        "requests": len(latencies_s),
        "p50_ms": _ms(latencies_s, 50),
        "p99_ms": _ms(latencies_s, 99),
        "max_ms": _ms(latencies_s, 100),
        "errors": len(errors),
        "error_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:_MAX_REASONS]),
        "requests_per_s": round(len(latencies_s) / wall_s, 1),
        "jobs_in_store": server.get("jobs"),
        "store_register_ms_p50": _ms(probe_s, 50),
        "store_register_ms_p99": _ms(probe_s, 99),
        "head_cpu_s": None if "cpu_s" not in server else round(server["cpu_s"], 2),
        "head_cpu_ms_per_request": (
            None if "cpu_s" not in server else round(1e3 * server["cpu_s"] / len(latencies_s), 3)
        ),
        "clients_cpu_s": round(client_cpu_s, 2),
        "client_processes": len(results),
        "registration_batches": server.get("batches"),
        "largest_batch": server.get("largest_batch"),
        "wall_s": round(wall_s, 2),
        "head_max_connections": max_connections or _DEFAULT_MAX_CONNECTIONS,
        "head_listen_backlog": listen_backlog or HeadHttpServer.request_queue_size,
        "store": "sqlite (WAL)",
        "head_log": "INFO, to a file",
        "cpu_count": os.cpu_count(),
        "load_avg_1m_at_start": load_1m,
    }
