"""`JsonHandler`, the request handler both HTTP servers share, and `PeerLimit`, the per-address
connection bound: with the event loop (`slurm_cdgpc.transport.evented`) they keep a slow or
hostile peer from starving the others. It never reaches `agent/` or `coordinator/`
(`tests/unit/test_import_graph.py`). Bounds: DESIGN.md, "Safety" (slow peers, requests framed
two ways); tests: `tests/unit/test_transport_server.py`, `tests/security/test_http_framing.py`.
"""

from __future__ import annotations

import email.utils
import functools
import io
import ipaddress
import json
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any, Final, Protocol

from slurm_cdgpc.errors import one_line
from slurm_cdgpc.transport.auth import AccessPolicy, Verifier

logger = logging.getLogger(__name__)

#: the standard library's limits on a header line and on the number of header lines
MAX_LINE_BYTES: Final = 65536
MAX_HEADERS: Final = 100
_VERSION: Final = re.compile(r"HTTP/(?P<major>[0-9])\.(?P<minor>[0-9])")
#: a method or a header name (RFC 9110 token): no spaces, no folding, nothing before the colon
_TOKEN: Final = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
#: a request target: visible ASCII only (RFC 9112 §3.2)
_TARGET: Final = re.compile(rb"[\x21-\x7e]+")
#: the bytes a header value may hold: no control character but a tab (RFC 9110 §5.5: a CR, LF
#: or NUL in a value is refused, not passed on); `bytes.translate` deletes these, and what is
#: left is what may not be there
_FIELD_BYTES: Final = bytes(b for b in range(256) if b == 0x09 or 0x20 <= b != 0x7F)
#: a ``Content-Length`` value (RFC 9110 §8.6), at most a terabyte's digits
_CONTENT_LENGTH: Final = re.compile(r"[0-9]{1,12}")


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


class _ServerSettings(Protocol):
    """What a `JsonHandler` reads off its server."""

    verifier: Verifier
    policy: AccessPolicy
    request_timeout_s: float
    max_body_bytes: int


class JsonHandler(BaseHTTPRequestHandler):
    """The request plumbing both servers share: debug-level access logs, every method routed
    to `_route`, and JSON answers that never cache.

    The request line and headers are parsed here rather than by the standard library, which
    runs every header block through the `email` package: that was a fifth of the head's CPU per
    registration. Same limits (`MAX_LINE_BYTES`, `MAX_HEADERS`), a lighter `headers` object, and
    stricter: a folded header line, a malformed field or request line, and a request whose end
    could be read two ways (`_check_framing`) are refused, not reinterpreted."""

    server: _ServerSettings  # type: ignore[assignment]  # an event loop's, not a socketserver
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

    def log_message(self, format: str, *args: Any) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s %s", self.client_address[0], format % args)

    def parse_request(self) -> bool:
        """Parse ``raw_requestline`` and the headers after it; False after answering 400/431/505."""
        self.command = ""
        # errors below carry a status line (the standard library's default, HTTP/0.9, has none)
        self.request_version = "HTTP/1.0"
        self.close_connection = True
        line = _line(self.raw_requestline)
        self.requestline = str(line, "iso-8859-1")
        words = line.split(b" ")  # one space apart: no other reading of the line (RFC 9112 §3)
        if len(words) != 3 or _TOKEN.fullmatch(words[0]) is None or not _TARGET.fullmatch(words[1]):
            self.send_error(HTTPStatus.BAD_REQUEST, "Bad request syntax")
            return False
        command, path, version = (str(word, "iso-8859-1") for word in words)
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
            _check_framing(self.headers, host_required=match["minor"] != "0")
        except _HeaderError as e:
            self.send_error(e.status, str(e))
            return False
        connection = (self.headers.get("Connection") or "").lower()
        if connection == "close":
            self.close_connection = True
        elif connection == "keep-alive":
            self.close_connection = False
        # ``Expect: 100-continue`` was answered by the event loop before it read the body
        return True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Refusals made before routing (bad request line, unknown method, 414, 431) in the
        same one-line JSON as every other error, not the standard library's HTML page."""
        status = HTTPStatus(code)
        self.close_connection = True
        text = one_line(message or status.phrase, 500)
        self._send_bytes(status, json.dumps({"error": text}).encode())

    def _route(self, method: str) -> None:
        raise NotImplementedError

    def _signed(self, status: HTTPStatus, body: bytes) -> list[str]:
        """Header lines that sign this answer (a server's reply credential); none here."""
        return []

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
        fields.extend(self._signed(status, body))
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
    field through the `email` package: DESIGN.md, "The head's API")."""

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


def content_length(values: Iterable[str]) -> int | None:
    """The body's length by a request's ``Content-Length`` values (None: there is none).

    ValueError for a value that is not a number of bytes, or for two that differ: either leaves
    the end of the body unknowable (RFC 9112 §6.3). The event loop frames a request by this and
    the handler refuses what it raises, so the two never read one request two ways."""
    length: str | None = None
    for value in values:
        if _CONTENT_LENGTH.fullmatch(value) is None:
            raise ValueError("Content-Length must be a number of bytes")
        if length is not None and value != length:
            raise ValueError("Content-Length is given twice, with different values")
        length = value
    return None if length is None else int(length)


def header_value(raw: bytes) -> bytes:
    """A header's value: what follows the colon on its line (the line's end already removed),
    less the spaces and tabs around it (RFC 9112 §5)."""
    return raw.strip(b" \t")


def _line(raw: bytes) -> bytes:
    """``raw`` less its line end: CRLF, or a bare LF (RFC 9112 §2.2); one CR, never two."""
    if raw.endswith(b"\r\n"):
        return raw[:-2]
    return raw[:-1] if raw.endswith(b"\n") else raw


def _read_headers(rfile: io.BufferedIOBase) -> Headers:
    """The header block up to its empty line."""
    headers = Headers()
    for _ in range(MAX_HEADERS + 1):
        raw = rfile.readline(MAX_LINE_BYTES + 1)
        if len(raw) > MAX_LINE_BYTES:
            raise _HeaderError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Line too long")
        # the line less its end, as `_line` (written out: this runs for every header line)
        if raw[-2:] == b"\r\n":
            line = raw[:-2]
        elif raw[-1:] == b"\n":
            line = raw[:-1]
        else:  # the peer closed before the block's empty line
            raise _HeaderError(HTTPStatus.BAD_REQUEST, "Header block cut short")
        if not line:
            return headers
        name, colon, value = line.partition(b":")
        if not colon or _TOKEN.fullmatch(name) is None or value.translate(None, _FIELD_BYTES):
            raise _HeaderError(HTTPStatus.BAD_REQUEST, "Malformed header line")
        headers.add(name.decode("ascii"), header_value(value).decode("iso-8859-1"))
    raise _HeaderError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Too many headers")


def _check_framing(headers: Headers, *, host_required: bool) -> None:
    """Refuse what two readers of one request could read two ways (RFC 9112): a missing
    (HTTP/1.1) or repeated ``Host`` (§3.2); any ``Transfer-Encoding``, empty included, for
    none is served (§6.1); and a ``Content-Length`` `content_length` refuses (§6.3)."""
    fields = headers._by_name  # read only, once per request: no copies of its lists
    hosts = len(fields.get("host", ()))
    if hosts > 1 or (host_required and not hosts):
        raise _HeaderError(HTTPStatus.BAD_REQUEST, "exactly one Host header is needed")
    if "transfer-encoding" in fields:
        raise _HeaderError(
            HTTPStatus.NOT_IMPLEMENTED, "Transfer-Encoding is not supported: send Content-Length"
        )
    try:
        content_length(fields.get("content-length", ()))
    except ValueError as e:
        raise _HeaderError(HTTPStatus.BAD_REQUEST, str(e)) from None
