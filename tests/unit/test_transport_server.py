"""The HTTP plumbing under the head's API and the agents' listeners (`EventedHttpServer`, with
worker threads and with handlers on the loop's thread), and the head's client side, on real
loopback sockets. The tests of what every server promises run on both ways of serving."""

from __future__ import annotations

import ast
import gc
import http.client
import socket
import threading
import time
from collections.abc import Iterator
from http import HTTPStatus
from typing import Any

import pytest

from slurm_cdgpc.transport.auth import (
    AccessPolicy,
    HmacKey,
    HmacVerifier,
    Principal,
    Reply,
    SignedRequest,
)
from slurm_cdgpc.transport.evented import EventedHttpServer, EventLoop
from slurm_cdgpc.transport.http import MAX_REPLY_BYTES, _request
from slurm_cdgpc.transport.server import MAX_HEADERS, JsonHandler
from slurm_cdgpc.wire.protocol import ProtocolError

WAIT_S = 10.0
BIG_REPLY_BYTES = 8 << 20  # more than loopback's socket buffers take at once


class _Inline(EventedHttpServer):
    """The agents' way: handlers run on the loop's thread."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, workers=0, **kw)


class _Chosen(EventedHttpServer):
    """The head's way for HMAC registrations: a pool of workers, but the requests the server
    chooses (here those to ``/now``) are handled on the loop's thread; ``turn_ended`` counts
    the loop's turns, and its first call fails (a bug there must not stop the loop)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.turns = 0
        self.handled_on: list[str] = []

    def inline(self, request: bytes) -> bool:
        return request.startswith(b"GET /now ")

    def turn_ended(self) -> None:
        self.turns += 1
        if self.turns == 1:
            raise RuntimeError("a bug after a turn")


Server = EventedHttpServer
KINDS = pytest.mark.parametrize(
    "kind", [EventedHttpServer, _Inline, _Chosen], ids=["workers", "inline", "chosen"]
)


class _Echo(JsonHandler):
    """Answers with what it parsed: the path and every header as (name, value) pairs; ``/big``
    with `BIG_REPLY_BYTES`; ``/later`` 0.5 s after it returns, from another thread."""

    def _route(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        if self.path == "/big":
            self._send_bytes(HTTPStatus.OK, b"b" * BIG_REPLY_BYTES, "text/plain")
            return
        text = repr((method, self.path, self.headers.items(), body)).encode()
        if isinstance(self.server, _Chosen):
            self.server.handled_on.append(threading.current_thread().name)
        if self.path == "/later":
            deliver = self.defer()

            def answer() -> None:
                time.sleep(0.5)
                self._send_bytes(HTTPStatus.OK, text, "text/plain")
                deliver()

            threading.Thread(target=answer, daemon=True).start()
            return
        self._send_bytes(HTTPStatus.OK, text, "text/plain")


def _echo_server(
    max_connections: int = 8,
    timeout_s: float = 5.0,
    kind: type[Server] = EventedHttpServer,
    **kw: object,
) -> tuple[Server, threading.Thread]:
    """An `_Echo` server on a loopback port, serving on the thread returned."""
    srv = kind(
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


@pytest.fixture(params=[EventedHttpServer, _Inline, _Chosen], ids=["workers", "inline", "chosen"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    srv, thread = _echo_server(kind=request.param)
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(WAIT_S)


def _raw(server: Server, data: bytes) -> bytes:
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
    server: Server,
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
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\r\n folded\r\n\r\n", 400),  # obsolete line folding
        (b"GET / HTTP/1.1\r\nHost: x\r\nBad Name: a\r\n\r\n", 400),  # space in a header name
        (b"GET / HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X: y\r\n" * (MAX_HEADERS + 1) + b"\r\n", 431),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"y" * 70000 + b"\r\n\r\n", 431),
        (b"GET / HTTP/2.0\r\n\r\n", 505),
        (b"GET / HTTX/1.1\r\n\r\n", 400),
        (b"GET /\r\n\r\n", 400),  # HTTP/0.9 is not served
        (b"GET / HTTP/1.1 extra\r\n\r\n", 400),
    ],
)
def test_a_malformed_request_is_refused(server: Server, request_bytes: bytes, status: int) -> None:
    assert _status(_raw(server, request_bytes)) == status


def test_keep_alive_serves_several_requests_on_one_connection(server: Server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
    try:
        for i in range(3):
            conn.request("POST", f"/{i}", body=b"x", headers={"Content-Length": "1"})
            reply = conn.getresponse()
            assert reply.status == 200 and f"'/{i}'".encode() in reply.read()
    finally:
        conn.close()


def test_expect_100_continue_is_honoured(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
        sock.sendall(
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n"
            b"Connection: close\r\n\r\n"
        )
        assert sock.recv(1024).startswith(b"HTTP/1.1 100")
        sock.sendall(b"ok")
        assert b"b'ok'" in sock.recv(65536) + sock.recv(65536)


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
        _, (status, body, _) = _request(url, "GET", "/v1/status", b"", None, WAIT_S)
        return status, body
    finally:
        thread.join(WAIT_S)


def test_client_reads_a_reply_by_its_length_or_to_the_close() -> None:
    assert _ask(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}trailing") == (200, b"{}")
    assert _ask(b'HTTP/1.0 404 Not Found\r\n\r\n{"error": "x"}') == (404, b'{"error": "x"}')
    assert (
        _ask(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n")[0]
        == 201
    )


def test_client_connects_to_an_address_without_a_lookup_and_to_a_name_with_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    looked_up: list[object] = []
    getaddrinfo = socket.getaddrinfo

    def spy(host: object, *args: Any, **kw: Any) -> Any:
        looked_up.append(host)
        return getaddrinfo(host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", spy)
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    assert _ask(ok) == (200, b"{}")  # http://127.0.0.1:PORT
    assert looked_up == []
    url, thread = _one_reply_server(ok)
    try:
        assert _request(url.replace("127.0.0.1", "localhost"), "GET", "/", b"", None, WAIT_S)[1]
    finally:
        thread.join(WAIT_S)
    assert "localhost" in looked_up
    with pytest.raises(ConnectionRefusedError):  # what a lookup-and-connect raises, too
        _request("http://127.0.0.1:1", "GET", "/", b"", None, WAIT_S)


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
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nX-Cdgpc-Reply-Auth: test r\r\n\r\n"
                )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    class _Signer:
        scheme = "test"

        def sign(self, method: str, path: str, body: bytes) -> str:
            return f"test {method} {path} {len(body)}"

        def sign_request(self, method: str, path: str, body: bytes) -> SignedRequest:
            return SignedRequest(self.sign(method, path, body), "0" * 32)

        def sign_reply(self, reply: Reply) -> str:
            raise NotImplementedError

        def verify_reply(self, credential: str | None, expected: Reply) -> Principal:
            raise NotImplementedError

    # the nonce it sent, and the answer with its reply credential (checked by the callers)
    assert _request(f"http://127.0.0.1:{port}/p", "POST", "/v1/x", b"body", _Signer(), WAIT_S) == (
        "0" * 32,
        (200, b"", "test r"),
    )
    thread.join(WAIT_S)
    head, _, body = received[0].partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /p/v1/x HTTP/1.1" and body == b"body"
    assert f"Host: 127.0.0.1:{port}" in lines and "Content-Length: 4" in lines
    assert "Authorization: test POST /p/v1/x 4" in lines and "Connection: close" in lines


@KINDS
def test_a_peer_trickling_bytes_is_cut_off_at_the_request_deadline(kind: type[Server]) -> None:
    # a byte every 0.2 s never trips a 1 s socket timeout; the whole-connection deadline does
    srv = _echo_server(4, timeout_s=1.0, kind=kind)[0]
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT_S) as sock:
            start = time.monotonic()
            cut = False
            for byte in b"GET /slow HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
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


@KINDS
def test_one_peer_cannot_take_every_connection(kind: type[Server]) -> None:
    srv = _echo_server(8, timeout_s=30.0, kind=kind, max_per_peer=2)[0]
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


@KINDS
def test_the_head_lets_its_own_host_past_the_per_peer_bound(kind: type[Server]) -> None:
    srv = _echo_server(8, timeout_s=30.0, kind=kind, max_per_peer=1, loopback_unbounded=True)[0]
    held = socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT_S)
    try:
        time.sleep(0.2)
        reply = _raw(srv, b"GET /local HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _status(reply) == 200
    finally:
        held.close()
        srv.shutdown()
        srv.server_close()


# -- the event loop's own: pipelining, slow readers, deferred answers, the connection bound -----


def _evented(**kw: object) -> EventedHttpServer:
    srv = _echo_server(kind=EventedHttpServer, **kw)[0]
    assert isinstance(srv, EventedHttpServer)
    return srv


def _stop(srv: Server) -> None:
    srv.shutdown()
    srv.server_close()


def test_pipelined_requests_are_answered_in_order() -> None:
    srv = _evented()
    try:
        reply = _raw(
            srv,
            b"POST /1 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nab"
            b"GET /2 HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /3 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        assert reply.count(b"HTTP/1.1 200") == 3
        assert reply.index(b"'/1'") < reply.index(b"'/2'") < reply.index(b"'/3'")
        assert b"b'ab'" in reply
    finally:
        _stop(srv)


def test_a_reader_too_slow_for_its_answer_holds_up_nobody() -> None:
    srv = _evented(workers=1)
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT_S) as slow:
            slow.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            time.sleep(0.3)  # the loop has sent what the socket takes and waits to send more
            assert (
                _status(_raw(srv, b"GET /quick HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
                == 200
            )
            received = 0
            while chunk := slow.recv(1 << 20):
                received += len(chunk)
        assert received > BIG_REPLY_BYTES
    finally:
        _stop(srv)


def test_an_answered_request_leaves_nothing_to_the_cyclic_collector(server: Server) -> None:
    """A request's handler goes when its answer is out, by reference counting: handlers left in
    reference cycles were most of what the collector walked under a burst of Prologs."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector would free is kept here to be seen
    try:
        for request, status in (
            (b"GET /now HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 200),
            (b"GET /later HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 200),  # deferred
            (b"GET / HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", 400),  # refused
        ):
            assert _status(_raw(server, request)) == status
        time.sleep(0.2)  # the serving threads drop their last references after answering
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage if isinstance(o, JsonHandler)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []


def test_a_deferred_answer_holds_no_worker() -> None:
    srv = _evented(workers=1)
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT_S) as later:
            start = time.monotonic()
            later.sendall(b"GET /later HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            time.sleep(0.1)
            # the one worker is free again: this is answered while /later still waits
            assert (
                _status(_raw(srv, b"GET /now HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
                == 200
            )
            assert time.monotonic() - start < 0.5
            reply = later.recv(65536)
            assert _status(reply) == 200 and b"'/later'" in reply
            assert time.monotonic() - start >= 0.5
    finally:
        _stop(srv)


def test_an_answer_deferred_from_the_loops_thread_still_comes() -> None:
    srv = _echo_server(kind=_Inline)[0]
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT_S) as later:
            later.sendall(b"GET /later HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            time.sleep(0.1)  # the loop is free while /later waits for its thread
            assert (
                _status(_raw(srv, b"GET /now HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
                == 200
            )
            reply = later.recv(65536)
            assert _status(reply) == 200 and b"'/later'" in reply
    finally:
        _stop(srv)


def test_requests_the_server_chooses_are_handled_on_the_loops_thread_and_turns_are_told() -> None:
    srv, thread = _echo_server(kind=_Chosen)
    assert isinstance(srv, _Chosen)
    try:
        assert (
            _status(_raw(srv, b"GET /now HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")) == 200
        )
        assert (
            _status(_raw(srv, b"GET /else HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")) == 200
        )
        assert srv.handled_on == [thread.name, "http-loop-worker"]
        # the loop counts a turn after its events, so a reply can arrive before its turn is told
        deadline = time.monotonic() + 5
        while srv.turns < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.turns >= 2  # the first one's bug was logged, and the loop went on
    finally:
        _stop(srv)


class _Name(JsonHandler):
    def _route(self, method: str) -> None:
        self._send_bytes(HTTPStatus.OK, b"name:" + str(self.server.max_body_bytes).encode())


def test_servers_sharing_a_loop_answer_each_for_itself_and_close_alone() -> None:
    loop = EventLoop(workers=0)
    verifier, policy = HmacVerifier(HmacKey(b"k" * 32)), AccessPolicy()

    def serve(handler: type[JsonHandler], body_cap: int) -> EventedHttpServer:
        return EventedHttpServer(
            ("127.0.0.1", 0),
            handler,
            verifier,
            policy,
            request_timeout_s=5.0,
            max_body_bytes=body_cap,
            max_connections=1,
            loop=loop,
        )

    first, second = serve(_Name, 111), serve(_Echo, 1024)
    thread = threading.Thread(target=loop.serve_forever, daemon=True)
    thread.start()
    get = b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    try:
        with pytest.raises(RuntimeError, match="shared"):
            first.serve_forever()
        assert _raw(first, get).endswith(b"name:111")
        assert b"'/x'" in _raw(second, get)
        # each server's bound is its own: one connection held on the first leaves the second's
        with socket.create_connection(("127.0.0.1", first.port), timeout=WAIT_S):
            time.sleep(0.2)
            assert b"'/x'" in _raw(second, get)
        first.server_close()
        with pytest.raises(OSError):
            _raw(first, get)
        assert b"'/x'" in _raw(second, get)
    finally:
        loop.shutdown()
        first.server_close()
        second.server_close()
        loop.close()
        thread.join(WAIT_S)


@KINDS
def test_connections_over_the_bound_are_closed_at_once(kind: type[Server]) -> None:
    srv = _echo_server(2, timeout_s=30.0, kind=kind, loopback_unbounded=True)[0]
    held = [socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT_S) for _ in range(2)]
    try:
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT_S) as third:
            assert third.recv(1) == b""
        held.pop().close()
        time.sleep(0.2)
        assert _status(_raw(srv, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")) == 200
    finally:
        for sock in held:
            sock.close()
        _stop(srv)


def test_a_header_block_without_end_is_refused_once_over_its_bound() -> None:
    srv = _evented()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT_S) as sock:
            sock.sendall(
                b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X: y\r\n" * 11000
            )  # 66 kB, no empty line
            reply = sock.recv(65536)
        assert _status(reply) == 431 and b"header block too large" in reply
    finally:
        _stop(srv)


def test_a_bug_while_framing_one_connection_costs_that_connection_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    srv = _evented()
    frame = EventLoop._frame

    def broken(self: EventLoop, conn: object) -> None:
        if b"/boom" in conn.inbuf:  # type: ignore[attr-defined]
            raise RuntimeError("a bug")
        frame(self, conn)  # type: ignore[arg-type]

    monkeypatch.setattr(EventLoop, "_frame", broken)
    try:
        assert _raw(srv, b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n") == b""  # closed, unanswered
        assert (
            _status(_raw(srv, b"GET /fine HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")) == 200
        )
    finally:
        _stop(srv)
