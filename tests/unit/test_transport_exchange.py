"""`NodeExchanger`: one round with many nodes on real loopback sockets, real agents among them.

Each failure mode a node can have (nothing listening, listening but silent, garbage, a refusal,
a reply too large or unsigned, a credential that cannot be made) costs that node a one-line
`NodeFailure` and nobody else anything; a round never outlasts twice the per-node timeout.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from slurm_cdgpc.agent.node import NodeAgent
from slurm_cdgpc.agent.server import AgentHttpServer
from slurm_cdgpc.config import SafeCap
from slurm_cdgpc.gpu.simulated import simulated_gpus
from slurm_cdgpc.transport.auth import (
    AccessPolicy,
    AuthUnavailableError,
    HmacKey,
    HmacSigner,
    HmacVerifier,
    Principal,
    Reply,
    SignedRequest,
)
from slurm_cdgpc.transport.evented import EventLoop
from slurm_cdgpc.transport.http import MAX_REPLY_BYTES, NodeExchanger, NodeFailure, NodeTarget
from slurm_cdgpc.wire.protocol import ExchangeRequest, ExchangeResponse, Setpoint

KEY = HmacKey(b"k" * 32)
CLOCK_MHZ = 1005  # an A100 graphics clock
SIGN_S = 0.2  # what a credential takes from a signer that runs a program


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[dict[str, str]]:
    """Eight real agents on one shared loop: node name → URL."""
    loop = EventLoop(workers=0)
    servers = [
        AgentHttpServer(
            ("127.0.0.1", 0),
            NodeAgent(
                simulated_gpus("A100", 2, seed=i),
                SafeCap(),
                tmp_path / f"n{i}" / "state.json",
                node_name=f"n{i}",
            ),
            HmacVerifier(KEY),
            AccessPolicy(node_uids=frozenset({0, os.getuid()})),
            signer=HmacSigner(KEY),
            loop=loop,
        )
        for i in range(8)
    ]
    thread = threading.Thread(target=loop.serve_forever, daemon=True)
    thread.start()
    try:
        yield {s.agent.node_name: f"http://127.0.0.1:{s.port}" for s in servers}
    finally:
        loop.shutdown()
        for s in servers:
            s.server_close()
        loop.close()
        thread.join(5.0)


def _targets(urls: dict[str, str]) -> dict[str, NodeTarget]:
    return {
        node: NodeTarget(
            url,
            ExchangeRequest(
                node=node,
                interval=1,
                lease_expires_s=time.time() + 60,
                setpoints=(Setpoint(0, "7", CLOCK_MHZ),),
            ),
        )
        for node, url in urls.items()
    }


def _listener(serve: Callable[[socket.socket], None]) -> str:
    """A raw loopback listener that hands each connection to ``serve`` on a thread of its own."""
    sock = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _read_request(conn: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return
        data += chunk


def _answering(reply: bytes) -> Callable[[socket.socket], None]:
    def serve(conn: socket.socket) -> None:
        with conn:
            _read_request(conn)
            conn.sendall(reply)

    return serve


def _silent(conn: socket.socket) -> None:
    _read_request(conn)
    time.sleep(30)  # holds the connection open and never answers


def _closed_port() -> str:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _round(
    exchanger: NodeExchanger, targets: dict[str, NodeTarget]
) -> tuple[dict[str, ExchangeResponse | NodeFailure], float]:
    """One exchange round and its wall time in seconds; the exchanger is closed after it."""
    try:
        start = time.monotonic()
        results = exchanger.exchange(targets)
        return results, time.monotonic() - start
    finally:
        exchanger.close()


def test_every_agent_answers_and_applies_its_setpoint(agents: dict[str, str]) -> None:
    exchanger = NodeExchanger(HmacSigner(KEY), timeout_s=2.0)
    try:
        results = exchanger.exchange(_targets(agents))
    finally:
        exchanger.close()
    assert list(results) == list(agents)  # in the order asked
    for node, result in results.items():
        assert isinstance(result, ExchangeResponse), result
        assert result.node == node and len(result.gpus) == 2 and not result.refused


def test_each_broken_node_fails_alone_and_the_round_ends_in_time(agents: dict[str, str]) -> None:
    big = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (MAX_REPLY_BYTES + 1)
    broken = {
        "nobody": _closed_port(),
        "silent": _listener(_silent),
        "garbage": _listener(_answering(b"SSH-2.0-OpenSSH\r\n\r\n")),
        "refuses": _listener(
            _answering(b'HTTP/1.1 401 Unauthorized\r\nContent-Length: 17\r\n\r\n{"error": "nope"}')
        ),
        "huge": _listener(_answering(big + b"x" * (MAX_REPLY_BYTES + 1))),
        "not-json": _listener(_answering(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi")),
        "bad-url": "ftp://example",
    }
    targets = _targets(agents) | _targets(broken)
    results, took_s = _round(NodeExchanger(HmacSigner(KEY), timeout_s=0.5), targets)
    assert took_s < 2 * 0.5 + 0.5
    assert all(isinstance(results[n], ExchangeResponse) for n in agents)
    reasons = {n: r.reason for n, r in results.items() if isinstance(r, NodeFailure)}
    assert set(reasons) == set(broken)
    assert "ConnectionRefusedError" in reasons["nobody"]
    assert "TimeoutError: timed out" in reasons["silent"]
    assert "BadStatusLine" in reasons["garbage"]
    assert reasons["refuses"].endswith("HTTP 401: nope")
    assert f"larger than {MAX_REPLY_BYTES} bytes" in reasons["huge"]
    assert "reply refused: no X-Cdgpc-Reply-Auth header" in reasons["not-json"]
    assert "not an http(s) URL" in reasons["bad-url"]
    assert all("\n" not in reason for reason in reasons.values())


def test_a_round_larger_than_its_socket_budget_waits_its_turn(agents: dict[str, str]) -> None:
    exchanger = NodeExchanger(HmacSigner(KEY), timeout_s=2.0, max_in_flight=2)
    try:
        results = exchanger.exchange(_targets(agents))
    finally:
        exchanger.close()
    assert all(isinstance(r, ExchangeResponse) for r in results.values())


class _ProgramSigner:
    """A signer that, like ``munge``, takes a while per credential, can fail, or can hang; and,
    like ``unmunge``, takes a while to check each answer."""

    scheme = "hmac"

    def __init__(self, fail_for: str = "", hang_for: str = "") -> None:
        self._hmac = HmacSigner(KEY)
        self.fail_for = fail_for
        self.hang_for = hang_for
        self.threads: set[str] = set()
        self.checked_on: set[str] = set()

    def sign(self, method: str, path: str, body: bytes) -> str:
        return self.sign_request(method, path, body).credential

    def sign_request(self, method: str, path: str, body: bytes) -> SignedRequest:
        self.threads.add(threading.current_thread().name)
        time.sleep(SIGN_S)
        if f'"node":"{self.fail_for}"'.encode() in body:
            raise AuthUnavailableError("munge failed: cannot connect to munged")
        if f'"node":"{self.hang_for}"'.encode() in body:
            time.sleep(3.0)
        return self._hmac.sign_request(method, path, body)

    def sign_reply(self, reply: Reply) -> str:
        return self._hmac.sign_reply(reply)

    def verify_reply(self, credential: str | None, expected: Reply) -> Principal:
        self.checked_on.add(threading.current_thread().name)
        time.sleep(SIGN_S)
        return self._hmac.verify_reply(credential, expected)


def test_credentials_that_take_a_program_are_made_on_the_pool_at_once(
    agents: dict[str, str],
) -> None:
    signer = _ProgramSigner(fail_for="n3")
    results, took_s = _round(NodeExchanger(signer, timeout_s=2.0), _targets(agents))
    assert took_s < 4 * SIGN_S  # made and checked at once: one after another takes 15 × SIGN_S
    assert threading.current_thread().name not in signer.threads
    assert signer.checked_on and threading.current_thread().name not in signer.checked_on
    failure = results.pop("n3")
    assert isinstance(failure, NodeFailure) and "cannot connect to munged" in failure.reason
    assert all(isinstance(r, ExchangeResponse) for r in results.values())


def test_an_https_node_goes_through_the_pool_beside_the_loop(agents: dict[str, str]) -> None:
    def plain_http(conn: socket.socket) -> None:
        with conn:
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")  # to a TLS client hello

    plain = _listener(plain_http)
    targets = _targets(agents) | _targets({"tls": plain.replace("http://", "https://")})
    exchanger = NodeExchanger(HmacSigner(KEY), timeout_s=1.0)
    try:
        results = exchanger.exchange(targets)
    finally:
        exchanger.close()
    tls = results.pop("tls")
    assert isinstance(tls, NodeFailure) and "SSLError" in tls.reason
    assert all(isinstance(r, ExchangeResponse) for r in results.values())


def test_a_credential_that_never_comes_costs_its_node_not_the_round(
    agents: dict[str, str],
) -> None:
    # the timeout leaves the credentials that come (SIGN_S each way) room on a loaded host
    timeout_s = 1.0
    exchanger = NodeExchanger(_ProgramSigner(hang_for="n5"), timeout_s=timeout_s)
    results, took_s = _round(exchanger, _targets(agents))
    assert took_s < 2 * timeout_s + 0.5
    late = results.pop("n5")
    assert isinstance(late, NodeFailure) and "before a credential was made" in late.reason
    assert all(isinstance(r, ExchangeResponse) for r in results.values()), results


def test_host_names_are_resolved_and_each_address_tried(agents: dict[str, str]) -> None:
    """``localhost`` may resolve to ::1 first, where no agent listens: the next address is
    tried, as `socket.create_connection` would."""
    by_name = {node: url.replace("127.0.0.1", "localhost") for node, url in agents.items()}
    exchanger = NodeExchanger(HmacSigner(KEY), timeout_s=2.0)
    try:
        for _ in range(2):  # the second round takes the addresses from the cache
            results = exchanger.exchange(_targets(by_name))
            assert all(isinstance(r, ExchangeResponse) for r in results.values()), results
    finally:
        exchanger.close()
