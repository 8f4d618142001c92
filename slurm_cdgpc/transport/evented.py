"""The event-loop HTTP server the head and the agents share (`EventLoop`, `EventedHttpServer`): one
thread owns every socket, and worker threads (none on the agent) run `JsonHandler` on each whole
request. It keeps the connection, peer, lifetime and header-block bounds. It never reaches
`agent/` or `coordinator/` (`tests/unit/test_import_graph.py`). Design: DESIGN.md,
"The head's API" and "Safety" (slow peers); tests: `tests/unit/test_transport_server.py`,
`tests/unit/test_transport_evented_scan.py`, `tests/security/test_slow_peers.py`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import logging
import queue
import re
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from slurm_cdgpc.transport.auth import AccessPolicy, Verifier
from slurm_cdgpc.transport.server import JsonHandler, PeerLimit, content_length, header_value

logger = logging.getLogger(__name__)

#: a request line and headers together; a longer block is answered 431 as soon as it is over
#: (a registration's is about 300 bytes)
MAX_HEADER_BLOCK_BYTES: Final = 16 * 1024
#: the end of a header block: a line end followed by an empty line
_BLOCK_END: Final = re.compile(rb"\n\r?\n")
#: bytes searched again on the next read: an end not found may have begun in them
_END_OVERLAP: Final = len(b"\n\r\n") - 1
#: worker threads: they run handlers, which block on the store or on ``unmunge``
DEFAULT_WORKERS: Final = 16
_RECV_BYTES: Final = 65536
#: connections accepted per wake-up, so that reading and answering are not starved by a burst
_ACCEPTS_PER_TURN: Final = 64
#: how often the open connections are checked against their deadlines (a connection is cut at
#: most this much after its time: a sweep of the open ones, not a heap entry per connection
#: ever accepted, which a burst fills with one per request for a whole request timeout)
_SWEEP_S: Final = 0.1
#: how long a refused peer's unread bytes are read and dropped before its connection is closed
#: (closed with them unread, the kernel resets it, and the peer may lose the answer)
_LINGER_S: Final = 1.0


@dataclass(eq=False, slots=True)
class _Connection:
    server: EventedHttpServer
    sock: socket.socket
    address: Any
    deadline: float
    inbuf: bytearray = field(default_factory=bytearray)
    #: how much of ``inbuf`` has been searched for the end of its header block, in vain
    scanned: int = 0
    #: the request at the head of ``inbuf``, once its header block is whole: the block's
    #: length, the body's and whether ``100 Continue`` is expected
    framed: tuple[int, int, bool] | None = None
    #: the events the selector watches on ``sock`` (0: none; the socket is not registered)
    watching: int = 0
    #: a request is with a worker (the socket is not read meanwhile)
    working: bool = False
    #: what is left of an answer the socket could not take at once
    outbuf: memoryview | None = None
    close_after: bool = False
    #: the peer asked for ``100 Continue`` and has it
    continued: bool = False
    #: the socket is closed; a connection whose request is with a worker keeps its slot until
    #: the answer comes back
    closed: bool = False
    #: answered for the last time and shut for writing: what still comes is dropped
    lingering: bool = False

    @property
    def peer(self) -> str:
        return str(self.address[0])


class EventedHttpServer:
    """A `JsonHandler` server on an `EventLoop`, with the interface of the standard library's
    servers that its users need (``port``, ``serve_forever``, ``shutdown``, ``server_close``).

    Without ``loop`` it has one of its own, with ``workers`` threads, run by `serve_forever`.
    Given a shared ``loop``, whoever made the loop runs it; ``workers`` is then the loop's
    (``bench exchange`` serves a few hundred agents from each of its processes that way).

    The bounds: ``max_connections`` open at once and ``max_per_peer`` from one address (over
    either, a connection is closed at once), ``request_timeout_s`` for a connection's whole life
    however slowly its peer sends, and the body cap (the handler's). A header block over
    `MAX_HEADER_BLOCK_BYTES` is refused with 431 (414 when its request line alone is) without
    waiting for its end; the search for a block's end resumes where the last read left it, so a
    trickled block costs each read its new bytes, not the whole block again. A handler may
    `JsonHandler.defer` its answer (a registration waits for its group commit without holding a
    worker); whoever completes it hands the bytes back to the loop.
    """

    #: the listen backlog: a burst of Prologs (a large array job starting) must queue, not be
    #: refused by the kernel (the standard library's default is 5). A connection the backlog
    #: cannot take is not refused but its SYN dropped, and the client retries one second later
    #: (DESIGN.md, "The head's API"). Linux caps it at ``net.core.somaxconn`` (4096 since 5.4).
    request_queue_size = 1024

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[JsonHandler],
        verifier: Verifier,
        policy: AccessPolicy,
        *,
        request_timeout_s: float,
        max_body_bytes: int,
        max_connections: int,
        max_per_peer: int | None = None,
        loopback_unbounded: bool = False,
        workers: int = DEFAULT_WORKERS,
        loop: EventLoop | None = None,
    ) -> None:
        self.handler = handler
        self.verifier = verifier
        self.policy = policy
        self.request_timeout_s = request_timeout_s
        self.max_body_bytes = max_body_bytes
        self.max_connections = max_connections
        self.peers = PeerLimit(max_connections, max_per_peer, loopback_unbounded=loopback_unbounded)
        self.connections = 0  # open now (counted by the loop)
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(address)
            self.socket.listen(self.request_queue_size)
            self.socket.setblocking(False)
        except BaseException:
            self.socket.close()
            raise
        self.server_address = self.socket.getsockname()
        self._owns_loop = loop is None
        self.loop = EventLoop(workers=workers) if loop is None else loop
        self.loop.listen(self)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def inline(self, request: bytes) -> bool:
        """Whether to handle ``request`` (whole, as received) on the loop's thread rather than
        hand it to a worker: only for a handler that blocks on nothing (the head's HMAC-signed
        registrations)."""
        return False

    def turn_ended(self) -> None:
        """Called on the loop's thread once a turn's ready sockets are served: what inline
        handlers queued during the turn can be done together here (without blocking)."""

    def serve_forever(self) -> None:
        if not self._owns_loop:
            raise RuntimeError("this server's loop is shared: run the loop, not the server")
        self.loop.serve_forever()

    def shutdown(self) -> None:
        """Stop `serve_forever` and wait for it to return (a shared loop is left running)."""
        if self._owns_loop:
            self.loop.shutdown()

    def server_close(self) -> None:
        """Close the listener and its connections (and the loop, if it is this server's)."""
        self.loop.forget(self)
        self.socket.close()
        if self._owns_loop:
            self.loop.close()


class EventLoop:
    """One thread's ``epoll`` loop over the sockets of one or more `EventedHttpServer`\\ s, and
    ``workers`` threads that run their handlers (0: the loop's thread runs them)."""

    def __init__(self, *, workers: int = DEFAULT_WORKERS) -> None:
        if workers < 0:
            raise ValueError(f"workers must be at least 0, got {workers}")
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._woken)
        self._open: set[_Connection] = set()
        self._next_sweep = 0.0
        # answers from other threads: appended there, sent by the loop
        self._outbox: collections.deque[tuple[_Connection, bytes, bool]] = collections.deque()
        self._wake_lock = threading.Lock()
        self._wake_pending = False
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._workers = [
            threading.Thread(target=self._worker, name="http-loop-worker", daemon=True)
            for _ in range(workers)
        ]
        self._servers: list[EventedHttpServer] = []  # those with a `turn_ended` of their own
        self._thread: int | None = None  # the loop's, while it runs
        self._stop = False
        self._stopped = threading.Event()
        self._stopped.set()  # shutdown() before serve_forever() returns at once
        self._started = False

    def listen(self, server: EventedHttpServer) -> None:
        """Accept ``server``'s connections on this loop (call before the loop runs)."""
        self._selector.register(server.socket, selectors.EVENT_READ, server)
        if type(server).turn_ended is not EventedHttpServer.turn_ended:
            self._servers.append(server)  # told of every turn: not hundreds of agents for naught

    def forget(self, server: EventedHttpServer) -> None:
        """Stop accepting for ``server`` and close its connections."""
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(server.socket)
        with contextlib.suppress(ValueError):
            self._servers.remove(server)
        for conn in [c for c in self._open if c.server is server]:
            self._close(conn)

    # -- the loop --------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        self._stopped.clear()
        self._thread = threading.get_ident()
        if not self._started:
            self._started = True
            for t in self._workers:
                t.start()
        try:
            while not self._stop:
                timeout = max(0.0, self._next_sweep - time.monotonic()) if self._open else None
                for key, mask in self._selector.select(timeout):
                    self._event(key.data, mask)
                self._turn_ended()
                self._expire()
        finally:
            self._thread = None
            self._stopped.set()

    def in_loop_thread(self) -> bool:
        """Whether the caller runs on this loop's thread (an inline handler does)."""
        return threading.get_ident() == self._thread

    def run_in_worker(self, work: Callable[[], None]) -> None:
        """Run ``work`` on a worker thread (on this one when the loop has none): work that may
        block, which the loop's thread must never do."""
        if self._workers:
            self._work.put(work)
        else:
            work()

    def _turn_ended(self) -> None:
        for server in self._servers:
            try:
                server.turn_ended()
            except Exception:
                logger.exception("internal error after an HTTP event-loop turn")

    def _event(self, target: Any, mask: int) -> None:
        """One ready socket's work; a bug costs that connection, never the loop (which every
        other connection depends on)."""
        try:
            if isinstance(target, _Connection):
                self._ready(target, mask)
            elif isinstance(target, EventedHttpServer):
                self._accept(target)
            else:
                target(mask)
        except Exception:
            logger.exception("internal error in the HTTP event loop")
            if isinstance(target, _Connection):
                target.working = False
                self._close(target)

    def shutdown(self) -> None:
        """Stop `serve_forever` and wait for it to return."""
        self._stop = True
        self._wake()
        self._stopped.wait()

    def close(self) -> None:
        """Close every connection; workers end after their current request."""
        self._stop = True
        for conn in list(self._open):
            self._close(conn)
        for _ in self._workers:
            self._work.put(None)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- connections -----------------------------------------------------------------------------

    def _accept(self, server: EventedHttpServer) -> None:
        for _ in range(_ACCEPTS_PER_TURN):
            try:
                sock, address = server.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors: the backlog keeps the rest for later
                logger.warning("accept failed: %s", e)
                return
            peer = str(address[0])
            if server.connections >= server.max_connections:
                logger.warning("too many connections; closing one from %s", peer)
                _close_socket(sock)
                continue
            if not server.peers.admit(peer):
                logger.warning("too many connections from %s; closing one", peer)
                _close_socket(sock)
                continue
            sock.setblocking(False)
            now = time.monotonic()
            conn = _Connection(server, sock, address, now + server.request_timeout_s)
            if not self._open:
                self._next_sweep = now + _SWEEP_S
            self._open.add(conn)
            server.connections += 1
            # a client writes its request as soon as it is connected, so it is usually here
            # already: read it now, and only wait on the socket if it is not (one epoll
            # registration and removal, and one turn of the loop, fewer per request)
            self._event(conn, selectors.EVENT_READ)

    def _watch(self, conn: _Connection, events: int) -> None:
        """Watch ``conn`` for ``events`` only (0: not at all)."""
        if events == conn.watching:
            return
        if conn.watching and events:
            self._selector.modify(conn.sock, events, conn)
        elif events:
            self._selector.register(conn.sock, events, conn)
        else:
            self._selector.unregister(conn.sock)
        conn.watching = events

    def _ready(self, conn: _Connection, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._write(conn)
        elif mask & selectors.EVENT_READ:
            self._read(conn)

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            self._watch(conn, selectors.EVENT_READ)
            return
        except OSError:
            self._close(conn)
            return
        if conn.lingering:
            if not data:
                self._close(conn)
            return
        if not data:
            if conn.inbuf.strip():  # a truncated request: the handler says what is missing
                request = bytes(conn.inbuf)
                conn.inbuf.clear()
                self._dispatch(conn, request, close=True)
            else:
                self._close(conn)
            return
        conn.inbuf += data
        self._frame(conn)
        if not (conn.working or conn.closed or conn.outbuf is not None):
            self._watch(conn, selectors.EVENT_READ)  # the rest of the request is to come

    def _frame(self, conn: _Connection) -> None:
        """Dispatch the request at the head of ``conn.inbuf`` once it is whole."""
        buf = conn.inbuf
        if conn.framed is None:
            end = _header_end(buf, conn.scanned)
            if end is None:
                conn.scanned = max(0, len(buf) - _END_OVERLAP)
                if len(buf) > MAX_HEADER_BLOCK_BYTES:
                    self._refuse_header_block(conn)
                return
            if end > MAX_HEADER_BLOCK_BYTES:
                self._refuse_header_block(conn)
                return
            conn.scanned = 0
            conn.framed = (end, *_framing(bytes(buf[:end])))
        end, length, expect = conn.framed
        if length > conn.server.max_body_bytes:
            # the handler answers 413 from the header alone; the body is not read
            request = bytes(buf[:end])
            buf.clear()
            conn.framed = None
            self._dispatch(conn, request, close=True)
            return
        if len(buf) < end + length:
            if expect and not conn.continued:
                conn.continued = True
                self._continue(conn)
            return
        request = bytes(buf[: end + length])
        del buf[: end + length]
        conn.framed = None
        conn.continued = False
        self._dispatch(conn, request, close=False)

    def _refuse_header_block(self, conn: _Connection) -> None:
        """Answer a header block over `MAX_HEADER_BLOCK_BYTES` at once, and close."""
        line_too_long = conn.inbuf.find(b"\n", 0, MAX_HEADER_BLOCK_BYTES) < 0
        conn.inbuf.clear()
        handler = self._handler(conn, b"")
        if line_too_long:
            handler.send_error(414, "Request line too long")
        else:
            handler.send_error(431, "Request header block too large")
        self._watch(conn, 0)
        self._send(conn, _written(handler), close=True)

    def _continue(self, conn: _Connection) -> None:
        try:
            sent = conn.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            sent = -1
        if sent != 25:  # 25 bytes not taken by an empty send buffer: the peer is gone
            self._close(conn)

    def _dispatch(self, conn: _Connection, request: bytes, *, close: bool) -> None:
        self._watch(conn, 0)
        conn.working = True
        conn.close_after = close
        if self._workers and not conn.server.inline(request):
            self._work.put(functools.partial(self._serve, conn, request))
        else:
            self._serve(conn, request)

    def _expire(self) -> None:
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + _SWEEP_S
        for conn in [c for c in self._open if c.deadline <= now and not c.closed]:
            self._close(conn)  # its peer has had its time

    def _close(self, conn: _Connection) -> None:
        if not conn.closed:
            conn.closed = True
            self._watch(conn, 0)
            _close_socket(conn.sock)
        if not conn.working and conn in self._open:  # a working one goes when its answer comes
            self._open.discard(conn)
            conn.server.connections -= 1
            conn.server.peers.release(conn.peer)

    # -- answers ---------------------------------------------------------------------------------

    def answer(self, conn: _Connection, data: bytes, close: bool) -> None:
        """Send a handler's answer to ``conn``: from any thread (the loop's own sends it now)."""
        if self.in_loop_thread():
            self._deliver(conn, data, close)
            return
        self._outbox.append((conn, data, close))
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_pending:
                return
            self._wake_pending = True
        with contextlib.suppress(OSError):  # closed by server_close
            self._wake_w.send(b"\0")

    def _woken(self, _mask: int) -> None:
        with contextlib.suppress(OSError):
            self._wake_r.recv(4096)
        with self._wake_lock:
            self._wake_pending = False
        while self._outbox:
            self._deliver(*self._outbox.popleft())

    def _deliver(self, conn: _Connection, data: bytes, close: bool) -> None:
        """On the loop's thread: the answer to the request ``conn`` had with a handler."""
        conn.working = False
        self._send(conn, data, close=close or conn.close_after)

    def _send(self, conn: _Connection, data: bytes, *, close: bool) -> None:
        """Write an answer to ``conn``, the rest when the socket can take it; then close, or
        read the next request."""
        if conn.closed:
            self._close(conn)
            return
        try:
            sent = conn.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(conn)
            return
        if sent < len(data):
            conn.outbuf = memoryview(data)[sent:]
            conn.close_after = close
            self._watch(conn, selectors.EVENT_WRITE)
            return
        self._answered(conn, close)

    def _write(self, conn: _Connection) -> None:
        assert conn.outbuf is not None
        try:
            sent = conn.sock.send(conn.outbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        conn.outbuf = conn.outbuf[sent:]
        if not conn.outbuf:
            conn.outbuf = None
            self._answered(conn, conn.close_after)

    def _answered(self, conn: _Connection, close: bool) -> None:
        if close:
            self._end(conn)
            return
        conn.close_after = False
        self._watch(conn, selectors.EVENT_READ)
        if conn.inbuf:
            self._frame(conn)

    def _end(self, conn: _Connection) -> None:
        """Close ``conn`` after its last answer; if the peer sent more than was used (the rest
        of a refused request, read or still to come), first let it read the answer: its own
        half is shut, and what comes is dropped until it closes (`_LINGER_S` at most)."""
        try:
            unread = bool(conn.inbuf) or bool(conn.sock.recv(1, socket.MSG_PEEK))
        except (BlockingIOError, InterruptedError):
            unread = False
        except OSError:
            self._close(conn)
            return
        if not unread:
            self._close(conn)
            return
        conn.inbuf.clear()
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return
        conn.lingering = True
        conn.deadline = min(conn.deadline, time.monotonic() + _LINGER_S)
        self._watch(conn, selectors.EVENT_READ)

    # -- workers ---------------------------------------------------------------------------------

    def _handler(self, conn: _Connection, request: bytes) -> JsonHandler:
        """A handler over buffered bytes, as `BaseHTTPRequestHandler` would be over a socket."""
        h = conn.server.handler.__new__(conn.server.handler)
        h.server = conn.server
        h.client_address = conn.address
        h.request = None
        h.rfile = io.BytesIO(request)
        h.wfile = io.BytesIO()
        h.close_connection = True
        h.requestline, h.command, h.request_version = "", "", "HTTP/1.0"

        def deliver() -> None:
            h.deliver = None  # h and this function refer to each other: see `_serve`
            self.answer(conn, _written(h), h.close_connection)

        h.deliver = deliver
        return h

    def _worker(self) -> None:
        while (work := self._work.get()) is not None:
            try:
                work()
            except Exception:  # `_serve` answers its own errors: this is other work's
                logger.exception("internal error in an HTTP worker")

    def _serve(self, conn: _Connection, request: bytes) -> None:
        h = self._handler(conn, request)
        failed = False
        try:
            h.handle_one_request()
        except Exception:
            logger.exception("internal error serving %s", conn.peer)
            failed = True
        if h.deferred:
            return
        # the handler and its ``deliver`` form a cycle: broken here (or by ``deliver`` itself,
        # when the handler deferred), every request's objects go as soon as it is answered,
        # not at the collector's next pass, which would walk them with the GIL held
        # (DESIGN.md, "The head's API": The collector).
        h.deliver = None
        if failed:
            self.answer(conn, b"", True)
        else:
            self.answer(conn, _written(h), h.close_connection)


def _header_end(buf: bytearray, start: int) -> int | None:
    """The offset just past the header block's empty line, searched for from ``start``; None
    while it has not come."""
    match = _BLOCK_END.search(buf, start)
    return None if match is None else match.end()


def _framing(head: bytes) -> tuple[int, bool]:
    """The body's length and whether ``100 Continue`` is expected, read off a header block
    only to know where the request ends, by the handler's rule (`content_length`). Without a
    length, or with none to trust (a malformed one, two that differ, any ``Transfer-Encoding``),
    no body is framed; the handler refuses the untrusted ones with the precise reason, and
    closes the connection."""
    lengths: list[str] = []
    expect = False
    for line in head.split(b"\n")[1:]:
        name, colon, value = line.removesuffix(b"\r").partition(b":")
        if not colon:
            continue
        name = name.lower()
        if name == b"content-length":
            lengths.append(header_value(value).decode("iso-8859-1"))
        elif name == b"transfer-encoding":
            return 0, False
        elif name == b"expect":
            expect = header_value(value).lower() == b"100-continue"
    try:
        length = content_length(lengths)
    except ValueError:
        return 0, False
    return length or 0, expect


def _written(handler: JsonHandler) -> bytes:
    """What a handler made by `EventedHttpServer._handler` has written."""
    wfile = handler.wfile
    assert isinstance(wfile, io.BytesIO)
    return wfile.getvalue()


def _close_socket(sock: socket.socket) -> None:
    # no shutdown() first: no other process shares the descriptor, so close() alone sends FIN
    sock.close()
