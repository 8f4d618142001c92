"""The event loop's search for the end of a header block, and the bound on the block's size.

A peer may send its header block a few bytes at a time. The search for the block's end resumes
where the last read left it, so the bytes the loop examines grow with the block, not with its
square (searching the whole block again at every read let 64 slow peers hold the loop for
seconds); and a block over `MAX_HEADER_BLOCK_BYTES` is refused at once, whole or not.
The loop's framing is driven here directly, one read at a time, so that the count of bytes
examined is exact; the bound is checked on a real loopback server.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http import HTTPStatus

import pytest

from slurm_cdgpc.transport import evented
from slurm_cdgpc.transport.auth import AccessPolicy, HmacKey, HmacVerifier
from slurm_cdgpc.transport.evented import EventedHttpServer, EventLoop
from slurm_cdgpc.transport.server import JsonHandler

WAIT_S = 10.0
#: the bound, in these tests: what the event loop promises
BLOCK_BOUND = 16 * 1024


class _Length(JsonHandler):
    """Answers with the length of the body it was given."""

    def _route(self, method: str) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._send_bytes(HTTPStatus.OK, str(len(body)).encode(), "text/plain")


def _server(loop: EventLoop | None = None) -> EventedHttpServer:
    return EventedHttpServer(
        ("127.0.0.1", 0),
        _Length,
        HmacVerifier(HmacKey(b"k" * 32)),
        AccessPolicy(),
        request_timeout_s=5.0,
        max_body_bytes=1 << 20,
        max_connections=8,
        loop=loop,
    )


class _Fed:
    """One connection of a loop that is not running, fed by hand: what `_frame` dispatches is
    kept, and every search for a header block's end is counted in bytes examined."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.loop = EventLoop(workers=0)
        self.server = _server(self.loop)
        self.peer, self.sock = socket.socketpair()
        self.conn = evented._Connection(
            self.server, self.sock, ("127.0.0.1", 1), time.monotonic() + 60
        )
        self.dispatched: list[bytes] = []
        self.searches = 0
        self.examined = 0
        search = evented._header_end

        def counted(buf: bytearray, *start: int) -> int | None:
            self.searches += 1
            self.examined += len(buf) - (start[0] if start else 0)
            return search(buf, *start)

        def dispatch(conn: object, request: bytes, *, close: bool) -> None:
            self.dispatched.append(request)

        monkeypatch.setattr(evented, "_header_end", counted)
        monkeypatch.setattr(self.loop, "_dispatch", dispatch)

    def feed(self, data: bytes) -> None:
        """What one read from the peer brings."""
        self.conn.inbuf += data
        self.loop._frame(self.conn)

    def close(self) -> None:
        self.server.server_close()
        self.loop.close()
        self.peer.close()
        self.sock.close()


@pytest.fixture
def fed(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Fed]:
    f = _Fed(monkeypatch)
    yield f
    f.close()


def _request(header_bytes: int, body: bytes = b"", *, line_bytes: int = 6) -> bytes:
    """A POST whose header block is ``header_bytes`` long, of ``line_bytes`` lines (short ones
    are the most a search can have to step over)."""
    start = f"POST /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {len(body)}\r\n"
    lines, extra = divmod(header_bytes - len(start) - 2, line_bytes)
    line = b"X: " + b"y" * (line_bytes - 5) + b"\r\n"
    pad = line * (lines - 1) + b"X: " + b"y" * (line_bytes - 5 + extra) + b"\r\n"
    request = start.encode() + pad + b"\r\n" + body
    assert request.index(b"\r\n\r\n") + 4 == header_bytes
    return request


def test_a_block_fed_a_byte_at_a_time_is_searched_in_linear_time(fed: _Fed) -> None:
    body = b"b" * 4096
    header_bytes = 8192
    request = _request(header_bytes, body)
    for i in range(len(request)):
        fed.feed(request[i : i + 1])
    assert fed.dispatched == [request]  # found at its last byte, and the body framed after it
    # each search examines the new byte and the two before it (an end may begin there), never
    # the whole block again; one search per read until the block's end, none while its body comes
    assert fed.examined <= 3 * header_bytes, f"{fed.examined} bytes examined"
    assert fed.searches == header_bytes


@pytest.mark.parametrize("end", [b"\r\n\r\n", b"\n\n", b"\n\r\n", b"\r\n\n"])
def test_a_block_end_split_across_reads_is_found(fed: _Fed, end: bytes) -> None:
    head = b"GET /a HTTP/1.1\r\nHost: x" + end
    second = b"GET /b HTTP/1.1\r\nHost: x" + end
    for cut in range(len(head) - 4, len(head) + 1):
        fed.dispatched.clear()
        fed.feed(head[:cut])
        fed.feed(head[cut:] + second[:cut])  # the next request, pipelined, starts the search over
        fed.feed(second[cut:])
        assert fed.dispatched == [head, second], cut


def _ask(server: EventedHttpServer, data: bytes) -> bytes:
    """Send ``data`` and read until the server closes (or the test's patience ends)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
        sock.sendall(data)
        reply = bytearray()
        while chunk := sock.recv(65536):
            reply += chunk
    return bytes(reply)


@pytest.fixture
def server() -> Iterator[EventedHttpServer]:
    srv = _server()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(WAIT_S)


def _status(reply: bytes) -> int:
    assert reply.startswith(b"HTTP/1.1 "), reply[:100]
    return int(reply.split(b" ", 2)[1])


def test_a_block_within_the_bound_is_served(server: EventedHttpServer) -> None:
    reply = _ask(server, _request(BLOCK_BOUND, b"abc", line_bytes=200))
    assert _status(reply) == 200 and reply.endswith(b"\r\n\r\n3")


def test_a_block_over_the_bound_is_refused_before_its_end(server: EventedHttpServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
        sock.sendall(
            _request(BLOCK_BOUND + 200, line_bytes=200)[: BLOCK_BOUND + 100]
        )  # no end yet, nor to come
        reply = sock.recv(65536)
    assert _status(reply) == 431 and b"header block too large" in reply


def test_a_whole_block_over_the_bound_is_refused(server: EventedHttpServer) -> None:
    assert _status(_ask(server, _request(BLOCK_BOUND + 200, line_bytes=200))) == 431


def test_a_request_line_over_the_bound_is_refused_as_too_long(server: EventedHttpServer) -> None:
    line = b"GET /" + b"a" * BLOCK_BOUND + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    assert _status(_ask(server, line)) == 414
