"""``bench slow-headers``: job registrations while one host trickles header blocks that never end.

The head serves every socket from one event-loop thread, before any request is authenticated:
what a peer costs that thread while it sends a header block is a cost anyone on the network
can impose. Here the head of ``bench register`` (`serve_head`: a real `HeadHttpServer` over a
real `Coordinator` and SQLite, HMAC, in its own process) is attacked from another process:
``connections`` sockets, each sending a header block that never ends in the shortest lines
(``X: y``: the most lines a search steps over), ``fill_bytes`` at once (by default 4 KiB short
of the head's bound, `MAX_HEADER_BLOCK_BYTES`), then ``chunk_bytes`` every ``period_s``; a
socket the head cuts (431 at its bound, or its request deadline) is opened again at once.
Meanwhile ``requests`` registrations, ``concurrency`` at a time, are sent and timed as ``bench
register`` times them (`run_prologs`): first with no attack (``quiet_*``), then under it
(``attack_*``), after ``warmup_s`` for the attack's blocks to grow.

By default the attack opens as many connections as the head allows one host (`PeerLimit`: a
quarter of ``max_connections``, 64 for cdgpcd): what one compute node may do. The head does not
bound its own host (loopback; its benchmarks and demo run there), so here every one is
admitted; ``attack_held_open_*`` says how many were open while registrations were timed.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any, Final

import numpy as np

from slurm_cdgpc.bench.exchange import (
    scratch_dir,
    start_workers,
    wait_for_stop,
    worker_preamble,
    write_key_file,
)
from slurm_cdgpc.bench.register import FIRST_JOB_ID, HeadOptions, run_prologs, serve_head
from slurm_cdgpc.coordinator.api import HeadHttpServer
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.transport.evented import MAX_HEADER_BLOCK_BYTES
from slurm_cdgpc.transport.server import PeerLimit

_HEAD_DEFAULTS: Final = inspect.signature(HeadHttpServer.__init__).parameters
#: what cdgpcd lets one host hold open: a quarter of its connection bound
PER_HOST_CONNECTIONS: Final = PeerLimit(_HEAD_DEFAULTS["max_connections"].default).limit
HEAD_REQUEST_TIMEOUT_S: Final = float(_HEAD_DEFAULTS["request_timeout_s"].default)
_LINE: Final = b"X: y\r\n"
#: the attack's socket timeouts: connecting to a head that is slow to accept
_CONNECT_TIMEOUT_S: Final = 5.0


class _Trickler:
    """One attacking socket: a request line, then header lines, never the empty line."""

    def __init__(self, port: int, fill: bytes) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=_CONNECT_TIMEOUT_S)
        self.sock.setblocking(False)
        self.pending = b"GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1\r\n" + fill

    def send(self, chunk: bytes) -> int:
        """Send what the socket did not take before, else ``chunk``; what went, or -1 once the
        head has cut us."""
        data = self.pending or chunk
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return -1
        self.pending = data[sent:]
        return sent

    def cut(self) -> bytes | None:
        """What the head said before cutting us (b"": nothing), or None while it has not."""
        try:
            data = self.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return b""
        return data if data else b""

    def close(self) -> None:
        self.sock.close()


@dataclass
class _Attack:
    """The attacking sockets and what befell them."""

    port: int
    fill: bytes
    chunk: bytes
    socks: list[_Trickler | None]
    opened: int = 0
    sent: int = 0
    refused_431: int = 0
    cut_other: int = 0
    failed_connects: int = 0

    def tick(self) -> int:
        """Send each socket its chunk (opening again those the head cut); how many are open."""
        self.socks = [self._step(s) for s in self.socks]
        return sum(s is not None for s in self.socks)

    def _step(self, s: _Trickler | None) -> _Trickler | None:
        if s is not None and (said := s.cut()) is not None:
            self.refused_431 += said.startswith(b"HTTP/1.1 431")
            self.cut_other += not said.startswith(b"HTTP/1.1 431")
            s.close()
            s = None
        if s is None:
            try:
                s = _Trickler(self.port, self.fill)
            except OSError:
                self.failed_connects += 1
                return None
            self.opened += 1
        n = s.send(self.chunk)
        if n < 0:
            self.cut_other += 1
            s.close()
            return None
        self.sent += n
        return s

    def close(self) -> None:
        for s in self.socks:
            if s is not None:
                s.close()


def trickle(
    port: int,
    connections: int,
    fill_bytes: int,
    chunk_bytes: int,
    period_s: float,
    conn: Connection,
    stop: Event,
    parent_pid: int,
) -> None:
    """Worker: the attack, until the parent asks for its report (spawn target). The parent
    says ``"timed"`` when the registrations it times start, and ``"report"`` when they end."""
    worker_preamble()
    fill, chunk = (_LINE * max(1, n // len(_LINE)) for n in (fill_bytes, chunk_bytes))
    attack = _Attack(port, fill, chunk, [None] * connections)
    held: list[int] = []
    timed_from = 0
    conn.send(("ready", None))
    start = next_tick = time.monotonic()
    while True:
        if conn.poll():
            if conn.recv() == "report":
                break
            timed_from = len(held)
        held.append(attack.tick())
        next_tick = max(next_tick + period_s, time.monotonic())  # late: no burst to catch up
        time.sleep(max(0.0, next_tick - time.monotonic()))
    wall_s = time.monotonic() - start
    attack.close()
    timed = held[timed_from:] or held
    conn.send(
        (
            "done",
            {
                "opened": attack.opened,
                "bytes_per_s": round(attack.sent / wall_s),
                "refused_431": attack.refused_431,
                "cut_other": attack.cut_other,
                "failed_connects": attack.failed_connects,
                "held_open_min": min(timed, default=0),
                "held_open_mean": round(float(np.mean(timed)), 1) if timed else 0.0,
            },
        )
    )
    wait_for_stop(stop, parent_pid)


def _registrations(
    url: str, key_file: str, first_job: int, requests: int, concurrency: int, timeout_s: float
) -> dict[str, Any]:
    """``requests`` registrations, ``concurrency`` at a time, from one client process."""
    threads = [
        (f"bench{c:05d}", range(first_job + c, first_job + requests, concurrency))
        for c in range(concurrency)
    ]
    with start_workers(
        run_prologs, [(url, key_file, threads, timeout_s)], "cdgpc-bench-prologs"
    ) as (clients, _, _):
        t0 = time.perf_counter()
        clients[0].conn.send("go")
        result: dict[str, Any] = clients[0].conn.recv()[1]
        result["wall_s"] = time.perf_counter() - t0
    return result


def _ms(values_s: Sequence[float], q: float) -> float:
    return round(1e3 * float(np.percentile(values_s, q)), 1) if len(values_s) else float("nan")


def _summary(prefix: str, result: dict[str, Any]) -> dict[str, Any]:
    latencies_s = result["latencies_s"]
    reasons: dict[str, int] = {}
    for e in result["errors"]:
        reasons[e[:120]] = reasons.get(e[:120], 0) + 1
    return {
        f"{prefix}_requests": len(latencies_s),
        f"{prefix}_p50_ms": _ms(latencies_s, 50),
        f"{prefix}_p99_ms": _ms(latencies_s, 99),
        f"{prefix}_max_ms": _ms(latencies_s, 100),
        f"{prefix}_errors": len(result["errors"]),
        f"{prefix}_error_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:3]),
        f"{prefix}_wall_s": round(result["wall_s"], 2),
    }


def bench_slow_headers(
    requests: int,
    *,
    concurrency: int = 4,
    connections: int = PER_HOST_CONNECTIONS,
    fill_bytes: int | None = None,
    chunk_bytes: int = 300,
    period_s: float = 0.05,
    warmup_s: float = 5.0,
    timeout_s: float = 10.0,
) -> dict[str, Any]:
    if requests < 1 or concurrency < 1 or connections < 1 or chunk_bytes < 1:
        raise InputError("requests, concurrency, connections and chunk bytes must be at least 1")
    if not period_s > 0 or warmup_s < 0:
        raise InputError("the period must be positive and the warm-up at least 0")
    concurrency = min(concurrency, requests)
    fill_bytes = max(0, MAX_HEADER_BLOCK_BYTES - 4096) if fill_bytes is None else fill_bytes
    load_1m = round(os.getloadavg()[0], 2)  # other work on this machine skews every number
    with scratch_dir("cdgpc-bench-slow-headers-", prefer_tmpfs=False) as tmp:
        key_file = str(write_key_file(Path(tmp)))
        options = HeadOptions(
            db_file=str(Path(tmp) / "head.db"),
            log_file=str(Path(tmp) / "head.log"),
            key_file=key_file,
            interval_s=30.0,
            max_connections=None,
            listen_backlog=None,
        )
        with start_workers(serve_head, [(options,)], "cdgpc-bench-head") as (heads, stop, ready):
            port = ready[0]["port"]
            url = f"http://127.0.0.1:{port}"
            quiet = _registrations(url, key_file, FIRST_JOB_ID, requests, concurrency, timeout_s)
            attack_args = [(port, connections, fill_bytes, chunk_bytes, period_s)]
            with start_workers(trickle, attack_args, "cdgpc-bench-attack") as (attackers, _, _):
                time.sleep(warmup_s)
                attackers[0].conn.send("timed")
                attacked = _registrations(
                    url, key_file, 2 * FIRST_JOB_ID, requests, concurrency, timeout_s
                )
                attackers[0].conn.send("report")
                attack = attackers[0].conn.recv()[1]
            stop.set()
            done = heads[0].conn.recv() if heads[0].conn.poll(30.0) else ("done", {})
            head = done[1]
    with contextlib.suppress(KeyError, TypeError):
        head["cpu_s"] = round(head["cpu_s"], 2)
    return {
        "requests": requests,
        "concurrency": concurrency,
        **_summary("quiet", quiet),
        **_summary("attack", attacked),
        "attack_connections": connections,
        "per_host_connections": PER_HOST_CONNECTIONS,
        "attack_held_open_min": attack["held_open_min"],
        "attack_held_open_mean": attack["held_open_mean"],
        "attack_fill_bytes": fill_bytes,
        "attack_chunk_bytes": chunk_bytes,
        "attack_period_s": period_s,
        "attack_bytes_per_s": attack["bytes_per_s"],
        "attack_connections_opened": attack["opened"],
        "attack_refused_431": attack["refused_431"],
        "attack_cut_otherwise": attack["cut_other"],
        "attack_failed_connects": attack["failed_connects"],
        "warmup_s": warmup_s,
        "head_header_block_bytes": MAX_HEADER_BLOCK_BYTES,
        "head_request_timeout_s": HEAD_REQUEST_TIMEOUT_S,
        "head_cpu_s": head.get("cpu_s"),
        "jobs_in_store": head.get("jobs"),
        "cpu_count": os.cpu_count(),
        "load_avg_1m_at_start": load_1m,
    }
