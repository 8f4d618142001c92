"""The head's HTTP client: exchanges with every node agent at once, and admin requests to cdgpcd.

Every request is signed (`slurm_cdgpc.transport.auth.Signer`) over its method, path and body and
carries the credential in one ``Authorization`` header. Besides the agent's server and the
head's API server, this is the only module that speaks HTTP.

`NodeExchanger` sends one `ExchangeRequest` to each node concurrently (a thread pool, one
connection per node), each with its own timeout; a node that does not answer in time, refuses,
or answers garbage comes back as a `NodeFailure` with a one-line reason, never as an exception:
one dead node must not stop the control loop. `HeadClient` is what ``cdgpc-admin`` uses to talk
to ``cdgpcd``.
"""

from __future__ import annotations

import functools
import http.client
import logging
import socket
import ssl
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO, Final
from urllib.parse import urlencode, urlsplit

from slurm_cdgpc.agent.protocol import (
    ExchangeRequest,
    ExchangeResponse,
    ProtocolError,
    dump_json,
    load_json,
)
from slurm_cdgpc.errors import CdgpcError, InputError, SoftError
from slurm_cdgpc.transport.auth import Signer

logger = logging.getLogger(__name__)

EXCHANGE_PATH: Final = "/v1/exchange"
#: cap on a reply body read from an agent or the head (an agent's reply is ≤ 1 MiB)
MAX_REPLY_BYTES: Final = 4 * 1024 * 1024
#: limits on a reply's status and header lines (the standard library's)
_MAX_LINE_BYTES: Final = 65536
_MAX_HEADERS: Final = 100


class HeadUnavailableError(SoftError):
    """cdgpcd could not be reached (not running, wrong URL, timeout)."""


class HeadRefusedError(InputError):
    """cdgpcd answered with an error (its one-line message is the text)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class NodeTarget:
    """Where a node's agent listens and what to send it this interval."""

    url: str
    request: ExchangeRequest


@dataclass(frozen=True)
class NodeFailure:
    """A node that did not complete the exchange, and why (one line)."""

    reason: str


@dataclass(frozen=True)
class _Endpoint:
    scheme: str
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, url: str) -> _Endpoint:
        return _parse_endpoint(url)

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"

    def connect(self, timeout_s: float) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=timeout_s)
        if self.scheme != "https":
            return sock
        try:
            return _tls_context().wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise


@functools.lru_cache(maxsize=65536)
def _parse_endpoint(url: str) -> _Endpoint:
    """Parsed once per URL: the exchange sends to the same agents every interval."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise InputError(f"not an http(s) URL: {url!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InputError(f"not an http(s) URL: {url!r}")
    default = 443 if parts.scheme == "https" else 80
    return _Endpoint(parts.scheme, parts.hostname, port or default, parts.path.rstrip("/"))


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """What `http.client.HTTPSConnection` uses by default: the system's CAs, names checked."""
    return ssl.create_default_context()


def _request(
    url: str,
    method: str,
    path: str,
    body: bytes,
    signer: Signer | None,
    timeout_s: float,
) -> tuple[int, bytes]:
    """One signed request on its own connection; (status, body). Raises OSError or
    `http.client.HTTPException` on the wire, `ProtocolError` on a reply over the cap.

    HTTP/1.1 written and read here rather than by `http.client`, which parses every reply's
    headers with the `email` package: that and its request assembly were a third of the head's
    CPU per exchange. The request goes out in one write (head and body together)."""
    endpoint = _parse_endpoint(url)
    full_path = endpoint.prefix + path
    lines = [
        f"{method} {full_path} HTTP/1.1",
        f"Host: {endpoint.host_header}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if signer is not None:
        lines.append(f"Authorization: {signer.sign(method, full_path, body)}")
    lines.append("\r\n")
    message = "\r\n".join(lines).encode("latin-1") + body
    sock = endpoint.connect(timeout_s)
    try:
        sock.sendall(message)
        with sock.makefile("rb") as reply:
            return _read_reply(reply)
    finally:
        sock.close()


def _read_reply(reply: BinaryIO) -> tuple[int, bytes]:
    while True:
        line = reply.readline(_MAX_LINE_BYTES + 1)
        if not line:
            raise http.client.RemoteDisconnected("the peer closed the connection without a reply")
        if len(line) > _MAX_LINE_BYTES:
            raise http.client.LineTooLong("status line")
        version, _, rest = line.decode("latin-1").rstrip("\r\n").partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise http.client.BadStatusLine(_one_line(line.decode("latin-1"), 100))
        headers = _read_reply_headers(reply)
        if not 100 <= int(code) < 200:  # an interim reply (100 Continue) is skipped
            break
    if headers.get(b"transfer-encoding", b"identity").lower() != b"identity":
        raise http.client.HTTPException("chunked replies are not supported")
    length_text = headers.get(b"content-length")
    if length_text is None:  # until the peer closes (we asked it to)
        data = reply.read(MAX_REPLY_BYTES + 1)
    else:
        if not length_text.isdigit() or len(length_text) > 12:
            raise http.client.HTTPException("reply has a malformed Content-Length")
        length = int(length_text)
        if length > MAX_REPLY_BYTES:
            raise ProtocolError(f"reply larger than {MAX_REPLY_BYTES} bytes")
        data = reply.read(length)
        if len(data) != length:
            raise http.client.IncompleteRead(data, length - len(data))
    if len(data) > MAX_REPLY_BYTES:
        raise ProtocolError(f"reply larger than {MAX_REPLY_BYTES} bytes")
    return int(code), data


def _read_reply_headers(reply: BinaryIO) -> dict[bytes, bytes]:
    """Header names lower-cased; a repeated header keeps its last value."""
    headers: dict[bytes, bytes] = {}
    for _ in range(_MAX_HEADERS + 1):
        line = reply.readline(_MAX_LINE_BYTES + 1)
        if len(line) > _MAX_LINE_BYTES:
            raise http.client.LineTooLong("header line")
        if line in (b"\r\n", b"\n", b""):
            return headers
        name, colon, value = line.partition(b":")
        if not colon:
            raise http.client.HTTPException("reply has a malformed header line")
        headers[name.strip().lower()] = value.strip()
    raise http.client.HTTPException(f"reply has more than {_MAX_HEADERS} headers")


def _one_line(text: str, limit: int = 300) -> str:
    return " ".join(text.split())[:limit] or "no reason given"


def _error_text(data: bytes) -> str:
    try:
        decoded = load_json(data)
    except ProtocolError:
        return _one_line(data.decode("utf-8", "replace"))
    if isinstance(decoded, dict) and isinstance(decoded.get("error"), str):
        return _one_line(decoded["error"])
    return _one_line(data.decode("utf-8", "replace"))


class NodeExchanger:
    """Concurrent, signed exchanges with node agents (``POST /v1/exchange``)."""

    def __init__(self, signer: Signer, *, timeout_s: float, max_workers: int = 64) -> None:
        if not timeout_s > 0:
            raise InputError(f"exchange timeout must be positive, got {timeout_s}")
        self.signer = signer
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="exchange")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def exchange(
        self, targets: Mapping[str, NodeTarget]
    ) -> dict[str, ExchangeResponse | NodeFailure]:
        """Exchange with every node at once; every node gets an answer or a `NodeFailure`."""
        futures: dict[str, Future[ExchangeResponse | NodeFailure]] = {
            node: self._pool.submit(self._one, node, target) for node, target in targets.items()
        }
        # each request has its own socket timeout; this bounds the whole round (connect, send,
        # receive may each take up to the timeout, so allow a little more than one timeout)
        deadline = time.monotonic() + 2 * self.timeout_s
        results: dict[str, ExchangeResponse | NodeFailure] = {}
        for node, future in futures.items():
            try:
                results[node] = future.result(timeout=max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                future.cancel()
                results[node] = NodeFailure(f"no answer within {2 * self.timeout_s:g} s")
        return results

    def _one(self, node: str, target: NodeTarget) -> ExchangeResponse | NodeFailure:
        try:
            status, data = _request(
                target.url,
                "POST",
                EXCHANGE_PATH,
                target.request.to_json(),
                self.signer,
                self.timeout_s,
            )
        except (OSError, http.client.HTTPException) as e:
            return NodeFailure(_one_line(f"{target.url}: {type(e).__name__}: {e}"))
        except CdgpcError as e:
            return NodeFailure(_one_line(f"{target.url}: {e}"))
        if status != 200:
            return NodeFailure(f"{target.url}: HTTP {status}: {_error_text(data)}")
        try:
            response = ExchangeResponse.from_json(data)
        except ProtocolError as e:
            return NodeFailure(_one_line(f"{target.url}: bad reply: {e}"))
        if response.node != node:
            logger.warning("node %s answers as %r (check its --node-name)", node, response.node)
        return response


class HeadClient:
    """Signed JSON requests to cdgpcd's API (``cdgpc-admin``, the Prolog and Epilog), or to a
    node's own agent (``peer="the local agent"``: the Epilog's release)."""

    def __init__(
        self,
        url: str,
        signer: Signer | None,
        *,
        timeout_s: float = 10.0,
        peer: str = "cdgpcd",
    ) -> None:
        _Endpoint.parse(url)
        self.url = url.rstrip("/")
        self.signer = signer
        self.timeout_s = timeout_s
        self.peer = peer

    def get(self, path: str, query: Mapping[str, object] | None = None) -> Any:
        if query:
            path = f"{path}?{urlencode({k: v for k, v in query.items() if v is not None})}"
        return self._call("GET", path, b"")

    def post(self, path: str, payload: Mapping[str, object]) -> Any:
        return self._call("POST", path, dump_json(dict(payload)))

    def delete(self, path: str) -> Any:
        return self._call("DELETE", path, b"")

    def _call(self, method: str, path: str, body: bytes) -> Any:
        try:
            status, data = _request(self.url, method, path, body, self.signer, self.timeout_s)
        except (OSError, http.client.HTTPException) as e:
            raise HeadUnavailableError(
                f"cannot reach {self.peer} at {self.url}: {_one_line(str(e) or type(e).__name__)}"
            ) from e
        if status >= 400:
            raise HeadRefusedError(status, f"{self.peer} refused ({status}): {_error_text(data)}")
        try:
            return load_json(data, MAX_REPLY_BYTES)
        except ProtocolError as e:
            raise HeadUnavailableError(f"{self.peer} sent a reply that is not JSON: {e}") from e
