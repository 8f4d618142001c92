"""The head's HTTP client: `NodeExchanger` (every node agent at once, each failure a `NodeFailure`,
never an exception) and `HeadClient` (``cdgpc-admin`` and the hooks to ``cdgpcd``, the hooks to
their agent). Every request is signed, every answer must carry its reply credential, and every
bound is on a whole request. It never reaches `agent/` or `coordinator/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "The exchange"; tests:
`tests/unit/test_transport_exchange.py`, `tests/security/test_reply_auth.py`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import heapq
import http.client
import io
import ipaddress
import itertools
import logging
import os
import re
import resource
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO, Final, NamedTuple, TypeVar
from urllib.parse import urlencode, urlsplit

from slurm_cdgpc.errors import CdgpcError, InputError, SoftError, one_line
from slurm_cdgpc.transport.auth import HEAD_RESPONDER, AuthError, Reply, SignedRequest, Signer
from slurm_cdgpc.wire.protocol import (
    ExchangeRequest,
    ExchangeResponse,
    ProtocolError,
    dump_json,
    load_json,
)

logger = logging.getLogger(__name__)
_R = TypeVar("_R")
_L = TypeVar("_L")

EXCHANGE_PATH: Final = "/v1/exchange"
#: cap on a reply body read from an agent or the head (an agent's reply is ≤ 1 MiB)
MAX_REPLY_BYTES: Final = 4 * 1024 * 1024
#: limits on a reply's status and header lines (the standard library's)
_MAX_LINE_BYTES: Final = 65536
_MAX_HEADERS: Final = 100
#: how long a resolved agent address is reused (a node renumbered is seen within this)
_RESOLVE_TTL_S: Final = 30.0
#: most sockets one exchange round holds open at once (also kept under half the fd limit)
MAX_IN_FLIGHT: Final = 1024
_CONNECTING: Final = frozenset({errno.EINPROGRESS, errno.EAGAIN, errno.EALREADY, 0})
_CONTENT_LENGTH_RE: Final = re.compile(rb"\r\ncontent-length:[ \t]*([0-9]{1,12})[ \t]*\r", re.I)
_REPLY_HEADER: Final = b"x-cdgpc-reply-auth"  # `slurm_cdgpc.transport.auth.REPLY_HEADER`
_NO_REASON: Final = "no reason given"


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
    #: the address family when ``host`` is an IP address (no scope), to connect without a lookup
    literal_family: int | None = None

    @classmethod
    def parse(cls, url: str) -> _Endpoint:
        return _parse_endpoint(url)

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"

    def connect(self, deadline: _Deadline) -> socket.socket:
        """A connected socket (TLS for ``https``), each address tried in turn as
        `socket.create_connection` does, all of it by ``deadline``."""
        if self.literal_family is None:
            infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            addresses = [_Address(family, sockaddr) for family, _, _, _, sockaddr in infos]
        else:  # a literal address: no lookup (DESIGN.md, "The head's API", on what one costs)
            addresses = [_Address(self.literal_family, (self.host, self.port))]
        error: OSError = OSError(f"no address for {self.host}")
        for family, sockaddr in addresses:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                deadline.wait_on(sock)
                sock.connect(sockaddr)
            except TimeoutError:
                sock.close()
                raise deadline.expired() from None
            except OSError as e:
                sock.close()
                error = e
                continue
            except BaseException:
                sock.close()
                raise
            break
        else:
            raise error
        if self.scheme != "https":
            return sock
        try:
            deadline.wait_on(sock)  # the handshake: one wait in all (CPython's ssl module)
            return _tls_context().wrap_socket(sock, server_hostname=self.host)
        except TimeoutError:
            sock.close()
            raise deadline.expired() from None
        except BaseException:
            sock.close()
            raise


class _Deadline:
    """When one request must be done, on the `time.monotonic` clock: every socket operation of
    it waits only for what is left, so a peer that sends a byte just before each wait would end
    gets no more time than a silent one."""

    __slots__ = ("at_s", "bound_s")

    def __init__(self, timeout_s: float, until_s: float | None = None) -> None:
        now = time.monotonic()
        self.at_s = now + timeout_s if until_s is None else min(now + timeout_s, until_s)
        self.bound_s = max(self.at_s - now, 0.0)

    def expired(self) -> TimeoutError:
        return TimeoutError(f"no whole reply within {self.bound_s:.3g} s")

    def wait_on(self, sock: socket.socket) -> None:
        """Let ``sock``'s next operation wait for what is left; `TimeoutError` when nothing is."""
        left_s = self.at_s - time.monotonic()
        if left_s <= 0:
            raise self.expired()
        sock.settimeout(left_s)


class _ReplyStream(io.RawIOBase):
    """A socket read as a file, every read bounded by the request's `_Deadline`."""

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        super().__init__()
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._deadline.wait_on(self._sock)
        try:
            return self._sock.recv_into(buffer)
        except TimeoutError:
            raise self._deadline.expired() from None


def _send_all(sock: socket.socket, data: bytes, deadline: _Deadline) -> None:
    """`socket.sendall` by ``deadline`` (an ``ssl`` socket's ``sendall`` waits anew per write)."""
    view = memoryview(data)
    while view:
        deadline.wait_on(sock)
        try:
            sent = sock.send(view)
        except TimeoutError:
            raise deadline.expired() from None
        view = view[sent:]


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
    return _Endpoint(
        parts.scheme,
        parts.hostname,
        port or default,
        parts.path.rstrip("/"),
        _literal_family(parts.hostname),
    )


def _literal_family(host: str) -> int | None:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None  # a name: looked up as usual
    if address.version == 4:
        return socket.AF_INET
    return None if address.scope_id else socket.AF_INET6  # a scope is for the lookup to read


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """What `http.client.HTTPSConnection` uses by default: the system's CAs, names checked."""
    return ssl.create_default_context()


class _Reply(NamedTuple):
    """An answer as read: its status, body and reply credential (None: it had none)."""

    status: int
    body: bytes
    credential: str | None


def _request(
    url: str,
    method: str,
    path: str,
    body: bytes,
    signer: Signer | None,
    timeout_s: float,
    *,
    until_s: float | None = None,
) -> tuple[str | None, _Reply]:
    """One signed request on its own connection: the nonce it carried (None: unsigned) and the
    answer, not yet checked. Raises OSError or `http.client.HTTPException` on the wire,
    `ProtocolError` on a reply over the cap.

    From the connect to the reply's last byte the request has ``timeout_s`` in all, and ends by
    ``until_s`` (`time.monotonic`) if that comes first; past it, `TimeoutError` (one line) however
    steadily the peer still sends.

    HTTP/1.1 written and read here rather than by `http.client`, which parses every reply's
    headers with the `email` package: that and its request assembly were a third of the head's
    CPU per exchange. The request goes out in one write (head and body together)."""
    full_path = _parse_endpoint(url).prefix + path
    signed = None if signer is None else signer.sign_request(method, full_path, body)
    credential = None if signed is None else signed.credential
    reply = send_signed(url, method, path, body, credential, timeout_s, until_s=until_s)
    return None if signed is None else signed.nonce, reply


def send_signed(
    url: str,
    method: str,
    path: str,
    body: bytes,
    credential: str | None,
    timeout_s: float,
    *,
    until_s: float | None = None,
) -> _Reply:
    """`_request` with its credential already made (``cdgpc-noded exchange`` relays the
    head's): the answer as read, its reply credential not checked."""
    endpoint = _parse_endpoint(url)
    message = _message(endpoint, method, endpoint.prefix + path, body, credential)
    deadline = _Deadline(timeout_s, until_s)
    sock = endpoint.connect(deadline)
    try:
        _send_all(sock, message, deadline)
        with io.BufferedReader(_ReplyStream(sock, deadline)) as reply:
            return _read_reply(reply)
    finally:
        sock.close()


def _message(
    endpoint: _Endpoint, method: str, full_path: str, body: bytes, credential: str | None
) -> bytes:
    """A whole request, head and body, to go out in one write."""
    lines = [
        f"{method} {full_path} HTTP/1.1",
        f"Host: {endpoint.host_header}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if credential is not None:
        lines.append(f"Authorization: {credential}")
    lines.append("\r\n")
    return "\r\n".join(lines).encode("latin-1") + body


def _read_reply(reply: BinaryIO) -> _Reply:
    while True:
        line = reply.readline(_MAX_LINE_BYTES + 1)
        if not line:
            raise http.client.RemoteDisconnected("the peer closed the connection without a reply")
        if len(line) > _MAX_LINE_BYTES:
            raise http.client.LineTooLong("status line")
        version, _, rest = line.decode("latin-1").rstrip("\r\n").partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise http.client.BadStatusLine(one_line(line.decode("latin-1"), 100))
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
    credential = headers.get(_REPLY_HEADER)
    return _Reply(int(code), data, None if credential is None else credential.decode("latin-1"))


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


def error_text(data: bytes) -> str:
    """The one-line message of an error answer (its JSON ``error``, else its text)."""
    try:
        decoded = load_json(data)
    except ProtocolError:
        return one_line(data.decode("utf-8", "replace"), empty=_NO_REASON)
    if isinstance(decoded, dict) and isinstance(decoded.get("error"), str):
        return one_line(decoded["error"], empty=_NO_REASON)
    return one_line(data.decode("utf-8", "replace"), empty=_NO_REASON)


class NodeExchanger:
    """Concurrent, signed exchanges with node agents (``POST /v1/exchange``).

    Plain-HTTP nodes are served by one event loop on the calling thread (`_Round`): non-blocking
    sockets under ``epoll``, one connection per node, so a thousand nodes cost a thousand
    sockets, not a thousand thread switches. ``https://`` nodes, and credentials that take a
    process to make or check (MUNGE), go through a thread pool. A node that does not answer in
    time, refuses or answers garbage is a `NodeFailure` with a one-line reason: one dead node
    must not stop the control loop.

    Every node has ``timeout_s`` to accept the connection and then ``timeout_s`` to answer once
    its request is written; the whole round ends after ``2 * timeout_s`` whatever happens. An
    ``https`` node's request, on a pool thread, ends with the round too, so a node that trickles
    its reply cannot keep a thread of the pool past it.

    An answer counts only with the agent's reply credential for this request, node and epoch
    (`Signer.verify_reply`): anything else is a `NodeFailure` (logged), and nothing from it is
    used. A signer that runs a program checks each answer on the pool as it arrives, all by the
    round's end; an HMAC signer checks it on the loop's thread.
    """

    def __init__(
        self,
        signer: Signer,
        *,
        timeout_s: float,
        max_workers: int = 64,
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        if not timeout_s > 0:
            raise InputError(f"exchange timeout must be positive, got {timeout_s}")
        if max_in_flight < 1:
            raise InputError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.signer = signer
        self.timeout_s = timeout_s
        soft_fds = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        fd_share = max(soft_fds // 2, 16) if soft_fds != resource.RLIM_INFINITY else max_in_flight
        self.max_in_flight = min(max_in_flight, fd_share)
        #: an HMAC signature costs microseconds: made and checked on the loop's thread. A signer
        #: that runs a program (``munge``, ``unmunge``) takes milliseconds each, so a round's
        #: credentials are made on the pool at once, and its answers checked there as they come
        self._sign_inline = bool(getattr(signer, "in_process", False))
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="exchange")
        self._addresses = _AddressCache(_RESOLVE_TTL_S)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def exchange(
        self, targets: Mapping[str, NodeTarget]
    ) -> dict[str, ExchangeResponse | NodeFailure]:
        """Exchange with every node at once; every node gets an answer or a `NodeFailure`."""
        started = time.monotonic()
        deadline = started + 2 * self.timeout_s
        results: dict[str, ExchangeResponse | NodeFailure] = {}
        plain: dict[str, tuple[NodeTarget, _Endpoint]] = {}
        tls: dict[str, NodeTarget] = {}
        for node, target in targets.items():
            try:
                endpoint = _parse_endpoint(target.url)
            except CdgpcError as e:
                results[node] = NodeFailure(one_line(f"{target.url}: {e}"))
                continue
            if endpoint.scheme == "http":
                plain[node] = (target, endpoint)
            else:
                tls[node] = target
        futures = {node: self._pool.submit(self._one, node, t, deadline) for node, t in tls.items()}
        if plain:
            results.update(self._round(plain, started, deadline))
        late = _too_late(self.timeout_s)
        for node, future in futures.items():
            try:
                results[node] = future.result(timeout=max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                future.cancel()
                results[node] = late
        return {node: results[node] for node in targets}

    # -- plain HTTP: one event loop ---------------------------------------------------------------

    def _round(
        self,
        targets: Mapping[str, tuple[NodeTarget, _Endpoint]],
        started: float,
        deadline: float,
    ) -> dict[str, ExchangeResponse | NodeFailure]:
        results: dict[str, ExchangeResponse | NodeFailure] = {}
        # credentials and addresses that take a program or a resolver get one timeout in all,
        # so that a hung munged or DNS server leaves the nodes it did not hold up their turn
        ready_by = started + self.timeout_s
        lookups = self._addresses.start({(e.host, e.port) for _, e in targets.values()}, self._pool)
        messages = self._messages(targets, results, ready_by)
        addresses = self._addresses.finish(lookups, ready_by)
        calls: list[_Call] = []
        for node, (message, nonce) in messages.items():
            target, endpoint = targets[node]
            found = addresses[(endpoint.host, endpoint.port)]
            if isinstance(found, str):
                results[node] = NodeFailure(one_line(f"{target.url}: {found}"))
            else:
                calls.append(_Call(node, target.url, message, found, nonce, target.request.epoch))
        checks: dict[str, Future[ExchangeResponse | NodeFailure]] = {}

        def check_on_pool(call: _Call, reply: _Reply) -> None:
            checks[call.node] = self._pool.submit(self._answer, call, reply)

        answered = None if self._sign_inline else check_on_pool
        round_ = _Round(calls, self.timeout_s, self.max_in_flight, answered)
        for call, outcome in round_.run(deadline):
            if isinstance(outcome, NodeFailure):
                results[call.node] = outcome
            elif call.node not in checks:
                results[call.node] = self._answer(call, outcome)
        checked = _collect(checks.values(), deadline, None)
        for node, answer in zip(checks, checked, strict=True):
            results[node] = answer or NodeFailure(
                f"{targets[node][0].url}: {2 * self.timeout_s:g} s passed before a credential "
                "was checked on its reply"
            )
        logger.debug(
            "exchanged with %d node(s) in %.1f ms", len(calls), 1e3 * (time.monotonic() - started)
        )
        return results

    def _messages(
        self,
        targets: Mapping[str, tuple[NodeTarget, _Endpoint]],
        failures: dict[str, ExchangeResponse | NodeFailure],
        deadline: float,
    ) -> dict[str, tuple[bytes, str]]:
        """Each node's whole signed request and its nonce; a node whose credential cannot be
        made (by ``deadline``, for a signer that runs a program) fails."""
        bodies = {node: t.request.to_json() for node, (t, _) in targets.items()}
        paths = {node: e.prefix + EXCHANGE_PATH for node, (_, e) in targets.items()}

        def sign(node: str) -> SignedRequest | NodeFailure:
            try:
                return self.signer.sign_request("POST", paths[node], bodies[node])
            except CdgpcError as e:
                return NodeFailure(one_line(f"{targets[node][0].url}: {e}"))

        if self._sign_inline:
            credentials = {node: sign(node) for node in targets}
        else:
            futures = [self._pool.submit(sign, node) for node in targets]
            made = _collect(futures, deadline, None)
            credentials = {
                node: NodeFailure(
                    f"{targets[node][0].url}: {self.timeout_s:g} s passed before a credential "
                    "was made"
                )
                if credential is None
                else credential
                for node, credential in zip(targets, made, strict=True)
            }
        messages: dict[str, tuple[bytes, str]] = {}
        for node, signed in credentials.items():
            if isinstance(signed, NodeFailure):
                failures[node] = signed
                continue
            endpoint = targets[node][1]
            message = _message(endpoint, "POST", paths[node], bodies[node], signed.credential)
            messages[node] = (message, signed.nonce)
        return messages

    def _answer(self, call: _Call, reply: _Reply) -> ExchangeResponse | NodeFailure:
        return exchange_answer(self.signer, call.node, call.url, call.nonce, call.epoch, *reply)

    # -- https: a thread each ---------------------------------------------------------------------

    def _one(
        self, node: str, target: NodeTarget, deadline: float
    ) -> ExchangeResponse | NodeFailure:
        try:
            nonce, reply = _request(
                target.url,
                "POST",
                EXCHANGE_PATH,
                target.request.to_json(),
                self.signer,
                2 * self.timeout_s,
                until_s=deadline,
            )
        except (OSError, http.client.HTTPException) as e:
            return NodeFailure(one_line(f"{target.url}: {type(e).__name__}: {e}"))
        except CdgpcError as e:
            return NodeFailure(one_line(f"{target.url}: {e}"))
        assert nonce is not None  # signed by self.signer
        return exchange_answer(self.signer, node, target.url, nonce, target.request.epoch, *reply)


def _too_late(timeout_s: float) -> NodeFailure:
    """A node still waiting when the round ends, at twice the per-node timeout."""
    return NodeFailure(f"no answer within {2 * timeout_s:g} s")


def exchange_answer(
    signer: Signer,
    node: str,
    where: str,
    nonce: str,
    epoch: int,
    status: int,
    data: bytes,
    credential: str | None,
) -> ExchangeResponse | NodeFailure:
    """What a node's answer (``status``, body ``data``, reply ``credential``) to the exchange
    request with ``nonce`` and ``epoch`` means: an error status is a failure, and a success
    counts only when ``node``'s agent signed it for exactly this request."""
    if status != 200:
        return NodeFailure(f"{where}: HTTP {status}: {error_text(data)}")
    try:
        signer.verify_reply(credential, Reply.to(nonce, node, epoch, status, data))
    except AuthError as e:
        logger.warning("node %s: answer refused (nothing of it is used): %s", node, e)
        return NodeFailure(one_line(f"{where}: reply refused: {e}"))
    except CdgpcError as e:  # unmunge could not run: as if the node had not answered
        return NodeFailure(one_line(f"{where}: reply not checked: {e}"))
    try:
        response = ExchangeResponse.from_json(data)
    except ProtocolError as e:
        return NodeFailure(one_line(f"{where}: bad reply: {e}"))
    if response.node != node:
        logger.warning("node %s answers as %r (check its --node-name)", node, response.node)
    return response


class _Address(NamedTuple):
    family: int
    sockaddr: Any


class _AddressCache:
    """Agents' addresses, resolved at most once per ``ttl_s``: a round must not wait on a
    thousand lookups one after another (misses are looked up on the pool, all at once)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, int], tuple[float, tuple[_Address, ...]]] = {}

    def start(self, wanted: Iterable[tuple[str, int]], pool: ThreadPoolExecutor) -> _Lookups:
        """Begin resolving each (host, port): from the cache, else on ``pool``."""
        now = time.monotonic()
        lookups = _Lookups(now, {}, {})
        with self._lock:
            for key in wanted:
                cached = self._cache.get(key)
                if cached is not None and cached[0] > now:
                    lookups.found[key] = cached[1]
                else:
                    lookups.pending[key] = pool.submit(_lookup, key)
        return lookups

    def finish(
        self, lookups: _Lookups, deadline: float
    ) -> dict[tuple[str, int], tuple[_Address, ...] | str]:
        """Each (host, port): its addresses, or a one-line reason it has none (a lookup still
        going at ``deadline`` is one: a slow resolver must not hold up the round)."""
        looked_up = _collect(lookups.pending.values(), deadline, "the address lookup took too long")
        with self._lock:
            for key, result in zip(lookups.pending, looked_up, strict=True):
                lookups.found[key] = result
                if not isinstance(result, str):  # a failed lookup is retried next round
                    self._cache[key] = (lookups.started + self.ttl_s, result)
        return lookups.found


@dataclass
class _Lookups:
    started: float
    found: dict[tuple[str, int], tuple[_Address, ...] | str]
    pending: dict[tuple[str, int], Future[tuple[_Address, ...] | str]]


def _collect(futures: Iterable[Future[_R]], deadline: float, late: _L) -> list[_R | _L]:
    """Each future's result; ``late`` for those not done by ``deadline`` (on the
    `time.monotonic` clock), which are abandoned."""
    results: list[_R | _L] = []
    for future in futures:
        try:
            results.append(future.result(timeout=max(deadline - time.monotonic(), 0.0)))
        except TimeoutError:
            future.cancel()
            results.append(late)
    return results


def _lookup(key: tuple[str, int]) -> tuple[_Address, ...] | str:
    host, port = key
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    addresses = tuple(_Address(family, sockaddr) for family, _, _, _, sockaddr in infos)
    return addresses or f"gaierror: no address for {host}"


class _Call:
    """One node's request on its way: connect, write, read until the reply is whole."""

    __slots__ = (
        "addresses",
        "deadline",
        "epoch",
        "message",
        "node",
        "nonce",
        "reply",
        "sent",
        "sock",
        "url",
    )

    def __init__(
        self,
        node: str,
        url: str,
        message: bytes,
        addresses: tuple[_Address, ...],
        nonce: str,
        epoch: int,
    ):
        self.node = node
        self.url = url
        self.message = message
        self.nonce = nonce  # the request's, which the agent's signed answer repeats
        self.epoch = epoch
        self.addresses = list(addresses)  # tried in order, as `socket.create_connection` does
        self.sock: socket.socket | None = None
        self.sent = 0
        self.reply = bytearray()
        self.deadline = 0.0


_Outcome = _Reply | NodeFailure


class _Round:
    """The event loop of one plain-HTTP exchange round (runs on the caller's thread).

    At most ``max_in_flight`` sockets are open at once; the rest wait in order. A call fails
    (`NodeFailure`) if it is not connected within ``timeout_s`` of its start, or not answered
    within ``timeout_s`` of its request being written, or is still waiting when the round ends.
    ``answered`` is told of each whole answer as it arrives (to start checking it).
    """

    def __init__(
        self,
        calls: list[_Call],
        timeout_s: float,
        max_in_flight: int,
        answered: Callable[[_Call, _Reply], None] | None = None,
    ) -> None:
        self.waiting = iter(calls)
        self.answered = answered
        self.timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        self.selector = selectors.DefaultSelector()
        self.deadlines: list[tuple[float, int, _Call]] = []  # a heap; stale entries skipped
        self.order = itertools.count()
        self.open = 0
        self.done: list[tuple[_Call, _Outcome]] = []

    def run(self, round_deadline: float) -> list[tuple[_Call, _Outcome]]:
        try:
            self._start_more()
            while self.open:
                now = time.monotonic()
                if now >= round_deadline:
                    break
                self._expire(now)
                wait_s = round_deadline - now
                if self.deadlines:
                    wait_s = min(wait_s, self.deadlines[0][0] - now)
                for key, events in self.selector.select(max(wait_s, 0.0)):
                    call: _Call = key.data
                    if key.fileobj is not call.sock:
                        continue  # closed earlier in this batch (its number may be reused)
                    if events & selectors.EVENT_WRITE:
                        self._writable(call)
                    else:
                        self._readable(call)
                self._start_more()
        finally:
            late = _too_late(self.timeout_s)
            for key in list(self.selector.get_map().values()):
                self._finish(key.data, late)
            for call in self.waiting:
                self.done.append((call, late))
            self.selector.close()
        return self.done

    def _start_more(self) -> None:
        while self.open < self.max_in_flight:
            call = next(self.waiting, None)
            if call is None:
                return
            self._connect(call)

    def _connect(self, call: _Call) -> None:
        address = call.addresses.pop(0)
        try:
            sock = socket.socket(address.family, socket.SOCK_STREAM)
        except OSError as e:
            self.done.append((call, _failure(call, e)))
            return
        sock.setblocking(False)
        call.sock = sock
        self.open += 1
        code = sock.connect_ex(address.sockaddr)
        if code not in _CONNECTING:
            self._connect_failed(call, code)
            return
        self.selector.register(sock, selectors.EVENT_WRITE, call)
        self._arm(call)

    def _connect_failed(self, call: _Call, code: int) -> None:
        if call.addresses:  # the next address of the host, as `create_connection` would
            self._close(call)
            self._connect(call)
        else:
            self._finish(call, _failure(call, OSError(code, os.strerror(code))))

    def _arm(self, call: _Call) -> None:
        call.deadline = time.monotonic() + self.timeout_s
        heapq.heappush(self.deadlines, (call.deadline, next(self.order), call))

    def _expire(self, now: float) -> None:
        while self.deadlines and self.deadlines[0][0] <= now:
            deadline, _, call = heapq.heappop(self.deadlines)
            if call.sock is not None and call.deadline == deadline:
                self._finish(call, _failure(call, TimeoutError("timed out")))

    def _writable(self, call: _Call) -> None:
        assert call.sock is not None
        if call.sent == 0 and not call.reply:
            code = call.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                self._connect_failed(call, code)
                return
        try:
            call.sent += call.sock.send(memoryview(call.message)[call.sent :])
        except BlockingIOError:
            return
        except OSError as e:
            self._finish(call, _failure(call, e))
            return
        if call.sent == len(call.message):
            self.selector.modify(call.sock, selectors.EVENT_READ, call)
            self._arm(call)  # now the node has timeout_s to answer

    def _readable(self, call: _Call) -> None:
        assert call.sock is not None
        try:
            data = call.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError as e:
            self._finish(call, _failure(call, e))
            return
        call.reply += data
        if len(call.reply) > MAX_REPLY_BYTES + _MAX_LINE_BYTES:
            too_large = ProtocolError(f"reply larger than {MAX_REPLY_BYTES} bytes")
            self._finish(call, NodeFailure(f"{call.url}: {too_large}"))
        elif not data or _whole(call.reply):
            self._finish(call, _parse(call))

    def _finish(self, call: _Call, outcome: _Outcome) -> None:
        self._close(call)
        self.done.append((call, outcome))
        if self.answered is not None and isinstance(outcome, _Reply):
            self.answered(call, outcome)

    def _close(self, call: _Call) -> None:
        if call.sock is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(call.sock)
        call.sock.close()
        call.sock = None
        self.open -= 1


def _whole(reply: bytearray) -> bool:
    """Whether ``reply`` holds a whole reply by its Content-Length (else: read to the close)."""
    end = reply.find(b"\r\n\r\n")
    if end < 0:
        return False
    if reply.startswith(b"HTTP/1.1 1") or reply.startswith(b"HTTP/1.0 1"):
        return False  # an interim reply: the real one follows, read to the close
    match = _CONTENT_LENGTH_RE.search(reply, 0, end + 2)
    return match is not None and len(reply) >= end + 4 + int(match.group(1))


def _parse(call: _Call) -> _Outcome:
    try:
        return _read_reply(io.BytesIO(bytes(call.reply)))
    except (OSError, http.client.HTTPException) as e:
        return _failure(call, e)
    except CdgpcError as e:
        return NodeFailure(one_line(f"{call.url}: {e}"))


def _failure(call: _Call, error: BaseException) -> NodeFailure:
    return NodeFailure(one_line(f"{call.url}: {type(error).__name__}: {error}"))


class HeadClient:
    """Signed JSON requests to cdgpcd's API (``cdgpc-admin``, the Prolog and Epilog), or to a
    node's own agent (``peer="the local agent"``, ``responder`` its node's name: the hooks'
    hold and release).

    Each request has ``timeout_s`` in all, connect to last byte, and none runs past ``until_s``
    (`time.monotonic`; a hook's budget); a request out of time is a `HeadUnavailableError`. So
    is an answer to a signed request that ``responder`` did not sign for it, whatever its
    status: whoever else answers on the port is no head (or agent), and a hook spools. With no
    ``signer`` (a health probe) nothing is signed, and no answer can be checked."""

    def __init__(
        self,
        url: str,
        signer: Signer | None,
        *,
        timeout_s: float = 10.0,
        until_s: float | None = None,
        peer: str = "cdgpcd",
        responder: str = HEAD_RESPONDER,
    ) -> None:
        _Endpoint.parse(url)
        self.url = url.rstrip("/")
        self.signer = signer
        self.timeout_s = timeout_s
        self.until_s = until_s
        self.peer = peer
        self.responder = responder

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
            nonce, reply = _request(
                self.url, method, path, body, self.signer, self.timeout_s, until_s=self.until_s
            )
        except (OSError, http.client.HTTPException) as e:
            raise HeadUnavailableError(
                f"cannot reach {self.peer} at {self.url}: {one_line(str(e) or type(e).__name__)}"
            ) from e
        status, data, credential = reply
        if self.signer is not None and nonce is not None:
            try:
                expected = Reply.to(nonce, self.responder, None, status, data)
                self.signer.verify_reply(credential, expected)
            except CdgpcError as e:
                said = f"; it said {status}: {error_text(data)}" if status >= 400 else ""
                raise HeadUnavailableError(
                    one_line(f"{self.peer} at {self.url}: answer refused: {e}{said}")
                ) from e
        if status >= 400:
            raise HeadRefusedError(status, f"{self.peer} refused ({status}): {error_text(data)}")
        try:
            return load_json(data, MAX_REPLY_BYTES)
        except ProtocolError as e:
            raise HeadUnavailableError(f"{self.peer} sent a reply that is not JSON: {e}") from e
