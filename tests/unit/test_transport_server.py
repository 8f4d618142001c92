"""The HTTP plumbing under the head's API and the agent's listener: request parsing, worker
threads, and the head's client side, on real loopback sockets."""

from __future__ import annotations

import ast
import http.client
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http import HTTPStatus

import pytest

from slurm_cdgpc.agent.protocol import ProtocolError
from slurm_cdgpc.transport.auth import AccessPolicy, HmacKey, HmacVerifier
from slurm_cdgpc.transport.http import MAX_REPLY_BYTES, _request
from slurm_cdgpc.transport.server import MAX_HEADERS, BoundedHttpServer, JsonHandler

WAIT_S = 10.0


class _Echo(JsonHandler):
    """Answers with what it parsed: the path and every header as (name, value) pairs."""

    def _route(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        text = repr((method, self.path, self.headers.items(), body)).encode()
        self._send_bytes(HTTPStatus.OK, text, "text/plain")


def _echo_server(
    max_connections: int = 8, timeout_s: float = 5.0, **kw: object
) -> tuple[BoundedHttpServer, threading.Thread]:
    """An `_Echo` server on a loopback port, serving on the thread returned."""
    srv = BoundedHttpServer(
        ("127.0.0.1", 0),
        _Echo,
        HmacVerifier(HmacKey(b"k" * 32)),
        AccessPolicy(),
        request_timeout_s=timeout_s,
        max_body_bytes=1024,
        max_connections=max_connections,
        **kw,  # type: ignore[arg-type]
    )
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    return srv, thread


@pytest.fixture
def server() -> Iterator[BoundedHttpServer]:
    srv, thread = _echo_server()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(WAIT_S)


def _raw(server: BoundedHttpServer, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def test_headers_are_parsed_case_insensitively_and_repeats_are_kept(
    server: BoundedHttpServer,
) -> None:
    reply = _raw(
        server,
        b"POST /x?y=1 HTTP/1.1\r\nHost: h\r\nauthorization: a\r\nAuthorization:  b \r\n"
        b"Content-Length: 3\r\nConnection: close\r\n\r\nabc",
    )
    assert _status(reply) == 200
    head, _, body = reply.partition(b"\r\n\r\n")
    assert b"Content-Length: " in head and b"Connection: close" in head
    method, path, items, sent = ast.literal_eval(body.decode())
    assert (method, path, sent) == ("POST", "/x?y=1", b"abc")
    assert [v for k, v in items if k.lower() == "authorization"] == ["a", "b"]


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET / HTTP/1.1\r\nX: a\r\n folded\r\n\r\n", 400),  # obsolete line folding
        (b"GET / HTTP/1.1\r\nBad Name: a\r\n\r\n", 400),  # space in a header name
        (b"GET / HTTP/1.1\r\nno colon here\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * (MAX_HEADERS + 1) + b"\r\n", 431),
        (b"GET / HTTP/1.1\r\nX: " + b"y" * 70000 + b"\r\n\r\n", 431),
        (b"GET / HTTP/2.0\r\n\r\n", 505),
        (b"GET / HTTX/1.1\r\n\r\n", 400),
        (b"GET /\r\n\r\n", 400),  # HTTP/0.9 is not served
        (b"GET / HTTP/1.1 extra\r\n\r\n", 400),
    ],
)
def test_a_malformed_request_is_refused(
    server: BoundedHttpServer, request_bytes: bytes, status: int
) -> None:
    assert _status(_raw(server, request_bytes)) == status


def test_keep_alive_serves_several_requests_on_one_connection(server: BoundedHttpServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
    try:
        for i in range(3):
            conn.request("POST", f"/{i}", body=b"x", headers={"Content-Length": "1"})
            reply = conn.getresponse()
            assert reply.status == 200 and f"'/{i}'".encode() in reply.read()
    finally:
        conn.close()


def test_expect_100_continue_is_honoured(server: BoundedHttpServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
        sock.sendall(
            b"POST / HTTP/1.1\r\nContent-Length: 2\r\nExpect: 100-continue\r\n"
            b"Connection: close\r\n\r\n"
        )
        assert sock.recv(1024).startswith(b"HTTP/1.1 100")
        sock.sendall(b"ok")
        assert b"b'ok'" in sock.recv(65536) + sock.recv(65536)


def test_connections_reuse_worker_threads_and_close_ends_them() -> None:
    srv, thread = _echo_server()
    workers: Callable[[], list[threading.Thread]] = lambda: [  # noqa: E731
        t for t in threading.enumerate() if t.name == "http-worker"
    ]
    before = len(workers())
    try:
        for _ in range(30):  # one after the other: one worker serves them all
            assert _status(_raw(srv, b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n")) == 200
        assert 1 <= len(workers()) - before <= 2  # not one thread per connection
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(WAIT_S)
    for t in workers()[before:]:
        t.join(WAIT_S)
    assert len(workers()) == before


# -- the client side ---------------------------------------------------------------------------


def _one_reply_server(reply: bytes) -> tuple[str, threading.Thread]:
    """A listener that reads one request and sends ``reply`` verbatim, then closes."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{port}/prefix/", thread


def _ask(reply: bytes) -> tuple[int, bytes]:
    url, thread = _one_reply_server(reply)
    try:
        return _request(url, "GET", "/v1/status", b"", None, WAIT_S)
    finally:
        thread.join(WAIT_S)


def test_client_reads_a_reply_by_its_length_or_to_the_close() -> None:
    assert _ask(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}trailing") == (200, b"{}")
    assert _ask(b'HTTP/1.0 404 Not Found\r\n\r\n{"error": "x"}') == (404, b'{"error": "x"}')
    assert (
        _ask(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n")[0]
        == 201
    )


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (b"", http.client.RemoteDisconnected),
        (b"SSH-2.0-OpenSSH\r\n\r\n", http.client.BadStatusLine),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            http.client.HTTPException,
        ),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", http.client.IncompleteRead),
        (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", http.client.HTTPException),
        (b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", http.client.HTTPException),
        (
            f"HTTP/1.1 200 OK\r\nContent-Length: {MAX_REPLY_BYTES + 1}\r\n\r\n".encode(),
            ProtocolError,
        ),
    ],
)
def test_client_refuses_a_reply_it_cannot_trust(reply: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        _ask(reply)


def test_client_sends_one_well_formed_signed_request() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    received: list[bytes] = []

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                data = b""
                while not data.endswith(b"body"):
                    data += conn.recv(65536)
                received.append(data)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    class _Signer:
        scheme = "test"

        def sign(self, method: str, path: str, body: bytes) -> str:
            return f"test {method} {path} {len(body)}"

    assert _request(f"http://127.0.0.1:{port}/p", "POST", "/v1/x", b"body", _Signer(), WAIT_S) == (
        200,
        b"",
    )
    thread.join(WAIT_S)
    head, _, body = received[0].partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /p/v1/x HTTP/1.1" and body == b"body"
    assert f"Host: 127.0.0.1:{port}" in lines and "Content-Length: 4" in lines
    assert "Authorization: test POST /p/v1/x 4" in lines and "Connection: close" in lines


def test_a_peer_trickling_bytes_is_cut_off_at_the_request_deadline() -> None:
    # a byte every 0.2 s never trips a 1 s socket timeout; the whole-connection deadline does
    srv = _echo_server(4, timeout_s=1.0)[0]
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT_S) as sock:
            start = time.monotonic()
            cut = False
            for byte in b"GET /slow HTTP/1.1\r\nX-Slow: " + b"a" * 100:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    cut = True
                    break
                time.sleep(0.2)
                if time.monotonic() - start > 6.0:
                    break
            if not cut:
                cut = sock.recv(1) == b""
            assert cut and time.monotonic() - start < 6.0
    finally:
        srv.shutdown()
        srv.server_close()


def test_one_peer_cannot_take_every_connection() -> None:
    srv = _echo_server(8, timeout_s=30.0, max_per_peer=2)[0]
    held = [socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT_S) for _ in range(2)]
    try:
        time.sleep(0.2)  # both are being served (waiting for their request line)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT_S) as third:
            assert third.recv(1) == b""  # closed at once: this peer has its two
        for sock in held:
            sock.close()
        time.sleep(0.2)
        reply = _raw(srv, b"GET /again HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _status(reply) == 200
    finally:
        for sock in held:
            sock.close()
        srv.shutdown()
        srv.server_close()


def test_the_head_lets_its_own_host_past_the_per_peer_bound() -> None:
    srv = _echo_server(8, timeout_s=30.0, max_per_peer=1, loopback_unbounded=True)[0]
    held = socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT_S)
    try:
        time.sleep(0.2)
        reply = _raw(srv, b"GET /local HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _status(reply) == 200
    finally:
        held.close()
        srv.shutdown()
        srv.server_close()
