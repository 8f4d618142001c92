"""The node agent's HTTP server, and the request handler it shares with the head's.

`JsonHandler` parses a request and writes a JSON answer for both servers; the head serves it
from an event loop (`slurm_cdgpc.transport.evented`), the agent from `BoundedHttpServer`: a
`ThreadingHTTPServer` with the request verifier and access policy the handlers consult, a body
cap, and bounds that keep a slow or hostile peer from starving the others:

- at most ``max_connections`` connections are served at once, and at most ``max_per_peer`` from
  one address (a connection over either bound is closed at once);
- a connection lives at most ``request_timeout_s`` in all, however slowly its peer trickles
  bytes: a socket timeout alone bounds each read, and a peer sending a byte every few seconds
  held a slot for as long as it liked (32 such connections froze a node agent's exchanges).

Connections are served by worker threads that are kept for the next connection rather than
started for each.
"""

from __future__ import annotations

import contextlib
import email.utils
import functools
import heapq
import io
import ipaddress
import json
import logging
import queue
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

from slurm_cdgpc.transport.auth import AccessPolicy, Verifier

logger = logging.getLogger(__name__)

#: the standard library's limits on a header line and on the number of header lines
MAX_LINE_BYTES: Final = 65536
MAX_HEADERS: Final = 100
#: seconds an idle worker thread waits for a connection before it ends
WORKER_IDLE_S: Final = 60.0
_VERSION: Final = re.compile(r"HTTP/(?P<major>[0-9])\.(?P<minor>[0-9])")
#: a header name (RFC 9110 token): no spaces, no folding, nothing before the colon
_TOKEN: Final = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


class PeerLimit:
    """At most ``limit`` connections at once from one address; with ``loopback_unbounded``,
    this host's own clients are not counted (the head's benchmarks and demo; never on a node
    agent, whose local users are the cluster's users)."""

    def __init__(
        self, max_connections: int, limit: int | None = None, *, loopback_unbounded: bool = False
    ) -> None:
        """``limit`` defaults to a quarter of the server's ``max_connections`` (at least 2)."""
        self.limit = max(2, max_connections // 4) if limit is None else limit
        self.loopback_unbounded = loopback_unbounded
        self._count: Counter[str] = Counter()
        self._lock = threading.Lock()

    def admit(self, peer: str) -> bool:
        """Count one more connection from ``peer``; False (nothing counted) at the limit."""
        if self.loopback_unbounded and is_loopback(peer):
            return True
        with self._lock:
            if self._count[peer] >= self.limit:
                return False
            self._count[peer] += 1
            return True

    def release(self, peer: str) -> None:
        """One connection `admit` counted has ended."""
        if self.loopback_unbounded and is_loopback(peer):
            return
        with self._lock:
            self._count[peer] -= 1
            if self._count[peer] <= 0:
                del self._count[peer]


class BoundedHttpServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    #: the listen backlog: a burst of Prologs (a large array job starting) must queue, not be
    #: refused by the kernel (the standard library's default is 5). A connection the backlog
    #: cannot take is not refused but its SYN dropped, and the client retries one second later
    #: (then three): with 128, 200 simultaneous Prologs met exactly that second as their p99.
    #: Linux caps it at ``net.core.somaxconn`` (4096 since 5.4).
    request_queue_size = 1024

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        verifier: Verifier,
        policy: AccessPolicy,
        *,
        request_timeout_s: float,
        max_body_bytes: int,
        max_connections: int,
        max_per_peer: int | None = None,
        loopback_unbounded: bool = False,
    ) -> None:
        """``max_per_peer`` and ``loopback_unbounded``: `PeerLimit`."""
        self.verifier = verifier
        self.policy = policy
        self.request_timeout_s = request_timeout_s
        self.max_body_bytes = max_body_bytes
        self.peers = PeerLimit(max_connections, max_per_peer, loopback_unbounded=loopback_unbounded)
        self._deadlines: list[tuple[float, int, socket.socket]] = []
        self._deadline_cv = threading.Condition()
        self._reaper: threading.Thread | None = None
        self._slots = threading.BoundedSemaphore(max_connections)
        self._work: queue.SimpleQueue[tuple[Any, Any] | None] = queue.SimpleQueue()
        self._pool_lock = threading.Lock()
        self._idle = 0  # workers waiting for a connection that no dispatch has claimed
        self._workers = 0
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        """Hand the connection to an idle worker thread, or to a new one: a thread per
        connection, but not a new thread per connection (starting one costs more CPU than
        parsing the request). At most ``max_connections`` are served at once either way."""
        peer = str(client_address[0])
        if not self.peers.admit(peer):
            logger.warning("too many connections from %s; closing one", peer)
            self.shutdown_request(request)
            return
        if not self._slots.acquire(blocking=False):
            self.peers.release(peer)
            logger.warning("too many connections; closing one from %s", peer)
            self.shutdown_request(request)
            return
        try:
            with self._pool_lock:
                spawn = self._idle == 0
                if spawn:
                    self._workers += 1
                else:
                    self._idle -= 1
            self._work.put((request, client_address))
            if spawn:
                threading.Thread(target=self._worker, name="http-worker", daemon=True).start()
        except BaseException:
            self._slots.release()
            self.peers.release(peer)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        self._watch(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()
            self.peers.release(str(client_address[0]))

    # -- whole-connection deadline -------------------------------------------------------------

    def _watch(self, request: socket.socket) -> None:
        """Shut ``request`` down ``request_timeout_s`` from now if it is still open then."""
        with self._deadline_cv:
            deadline = time.monotonic() + self.request_timeout_s
            first = not self._deadlines
            heapq.heappush(self._deadlines, (deadline, id(request), request))
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name="http-reaper", daemon=True)
                self._reaper.start()
            if first:
                # deadlines only grow (now + a constant): a later one never moves the reaper's
                # next wake-up, so waking it for every connection would only cost a thread switch
                self._deadline_cv.notify()

    def _reap(self) -> None:
        with self._deadline_cv:
            while True:
                if not self._deadlines:
                    self._deadline_cv.wait()
                    continue
                deadline, _, sock = self._deadlines[0]
                wait_s = deadline - time.monotonic()
                if wait_s > 0:
                    self._deadline_cv.wait(wait_s)
                    continue
                heapq.heappop(self._deadlines)
                if sock.fileno() != -1:  # still open: its peer has had its time
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)

    def _worker(self) -> None:
        while True:
            try:
                item = self._work.get(timeout=WORKER_IDLE_S)
            except queue.Empty:
                with self._pool_lock:
                    if self._idle > 0:  # nobody counts on this worker: retire it
                        self._idle -= 1
                        self._workers -= 1
                        return
                continue
            if item is None:
                return
            self.process_request_thread(*item)
            with self._pool_lock:
                self._idle += 1

    def server_close(self) -> None:
        super().server_close()
        with self._pool_lock:
            workers, self._workers, self._idle = self._workers, 0, 0
        for _ in range(workers):  # connections still being served finish first
            self._work.put(None)


class JsonHandler(BaseHTTPRequestHandler):
    """The request plumbing both servers share: a per-request socket timeout, debug-level
    access logs, every method routed to `_route`, and JSON answers that never cache.

    The request line and headers are parsed here rather than by the standard library, which
    runs every header block through the `email` package: that was a fifth of the head's CPU per
    registration. Same limits (`MAX_LINE_BYTES`, `MAX_HEADERS`), a lighter `headers` object, and
    stricter: a folded header line or a malformed field is refused, not reinterpreted."""

    server: BoundedHttpServer
    raw_requestline: bytes  # set by handle_one_request before parse_request
    headers: Headers  # type: ignore[assignment]  # not the standard library's email Message
    sys_version = ""
    protocol_version = "HTTP/1.1"
    #: set by `slurm_cdgpc.transport.evented`: the request is in ``rfile``, whole, and the answer
    #: goes out when ``deliver`` is called (when the handler returns, unless it `defer`\ s it)
    deliver: Callable[[], None] | None = None
    deferred = False

    def defer(self) -> Callable[[], None]:
        """Answer after this handler returns: write the answer, then call what this returns.
        Only an event-loop server (`slurm_cdgpc.transport.evented`) can wait like that."""
        if self.deliver is None:
            raise RuntimeError("this server sends the answer when the handler returns")
        self.deferred = True
        return self.deliver

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.request_timeout_s)  # per-request socket timeout

    def log_message(self, format: str, *args: Any) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s %s", self.client_address[0], format % args)

    def parse_request(self) -> bool:
        """Parse ``raw_requestline`` and the headers after it; False after answering 400/431/505."""
        self.command = ""
        # errors below carry a status line (the standard library's default, HTTP/0.9, has none)
        self.request_version = "HTTP/1.0"
        self.close_connection = True
        self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        words = self.requestline.split()
        if len(words) != 3:
            self.send_error(HTTPStatus.BAD_REQUEST, "Bad request syntax")
            return False
        command, path, version = words
        match = _VERSION.fullmatch(version)
        if match is None:
            self.send_error(HTTPStatus.BAD_REQUEST, "Bad request version")
            return False
        if match["major"] != "1":
            self.send_error(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, "Only HTTP/1.x is served")
            return False
        self.command, self.path, self.request_version = command, path, version
        if self.path.startswith("//"):
            self.path = "/" + self.path.lstrip("/")  # as the standard library does
        self.close_connection = match["minor"] == "0"
        try:
            self.headers = _read_headers(self.rfile)
        except _HeaderError as e:
            self.send_error(e.status, str(e))
            return False
        connection = (self.headers.get("Connection") or "").lower()
        if connection == "close":
            self.close_connection = True
        elif connection == "keep-alive":
            self.close_connection = False
        expect = (self.headers.get("Expect") or "").lower()
        if expect == "100-continue" and self.request_version != "HTTP/1.0" and not self.deliver:
            return self.handle_expect_100()  # (an event loop said it before reading the body)
        return True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Refusals made before routing (bad request line, unknown method, 414, 431) in the
        same one-line JSON as every other error, not the standard library's HTML page."""
        status = HTTPStatus(code)
        self.close_connection = True
        text = " ".join((message or status.phrase).split())
        self._send_bytes(status, json.dumps({"error": text}).encode())

    def _route(self, method: str) -> None:
        raise NotImplementedError

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    def do_HEAD(self) -> None:
        self._route("HEAD")

    def _send_bytes(
        self,
        status: HTTPStatus,
        body: bytes,
        content_type: str = "application/json",
        *,
        allow: str | None = None,
    ) -> None:
        self.log_request(status.value)
        fields = [
            f"{self.protocol_version} {status.value} {status.phrase}",
            f"Server: {self.version_string()}",
            f"Date: {_http_date(int(time.time()))}",
            f"Content-Type: {content_type}",
            f"Content-Length: {len(body)}",
            "Cache-Control: no-store",
        ]
        if allow is not None:
            fields.append(f"Allow: {allow}")
        if self.close_connection:
            fields.append("Connection: close")
        fields.append("\r\n")
        head = "\r\n".join(fields).encode("latin-1")
        # head and body in one write: two small writes meet Nagle's algorithm and the peer's
        # delayed acknowledgement, which can hold the body back for tens of milliseconds
        self.wfile.write(head if self.command == "HEAD" else head + body)


@functools.lru_cache(maxsize=2)
def _http_date(second: int) -> str:
    """The ``Date`` header's value, made once a second (the `email` package formats it)."""
    return email.utils.formatdate(second, usegmt=True)


@functools.lru_cache(maxsize=1024)
def is_loopback(peer: str) -> bool:
    try:
        return ipaddress.ip_address(peer.split("%", maxsplit=1)[0]).is_loopback
    except ValueError:
        return False


class _HeaderError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class Headers:
    """A request's header fields: `get` and `get_all` case-insensitive, `items` in order; what
    `http.client.HTTPMessage` offers the handlers, at a fraction of its cost (it runs every
    field through the `email` package: a tenth of the head's CPU per registration)."""

    __slots__ = ("_by_name", "_fields")

    def __init__(self) -> None:
        self._fields: list[tuple[str, str]] = []
        self._by_name: dict[str, list[str]] = {}

    def add(self, name: str, value: str) -> None:
        self._fields.append((name, value))
        self._by_name.setdefault(name.lower(), []).append(value)

    def get(self, name: str, default: str | None = None) -> str | None:
        values = self._by_name.get(name.lower())
        return values[0] if values else default

    def get_all(self, name: str, default: list[str] | None = None) -> list[str] | None:
        values = self._by_name.get(name.lower())
        return list(values) if values else default

    def items(self) -> list[tuple[str, str]]:
        return list(self._fields)


def _read_headers(rfile: io.BufferedIOBase) -> Headers:
    """The header block up to its empty line."""
    headers = Headers()
    for _ in range(MAX_HEADERS + 1):
        line = rfile.readline(MAX_LINE_BYTES + 1)
        if len(line) > MAX_LINE_BYTES:
            raise _HeaderError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Line too long")
        if line in (b"\r\n", b"\n", b""):
            return headers
        name, colon, value = line.partition(b":")
        if not colon or _TOKEN.fullmatch(name) is None:
            raise _HeaderError(HTTPStatus.BAD_REQUEST, "Malformed header line")
        headers.add(name.decode("ascii"), value.strip(b" \t\r\n").decode("iso-8859-1"))
    raise _HeaderError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Too many headers")
