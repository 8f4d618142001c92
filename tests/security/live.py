"""A real cdgpcd and a real cdgpc-noded on loopback for the attacks, and a raw HTTP client.

The client speaks HTTP over a bare socket so that an attack can send exactly what a hostile
peer would: no ``Authorization`` header or two of them, a ``Content-Length`` that lies, a
chunked body, a credential made for another request. Every request says ``Connection: close``
and the answer is read to the end of the stream.

By default both daemons run with long intervals and leases (nothing changes on its own while
the attacks run), so any difference between two snapshots of their state is a request's work.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from slurm_cdgpc import localcluster
from slurm_cdgpc.localcluster import (
    LocalCluster,
    TomlValue,
    daemon_env,
    free_port,
    hmac_auth,
    stop_processes,
    write_hmac_key,
)
from slurm_cdgpc.transport.auth import HmacKey, HmacSigner

START_TIMEOUT_S = 30.0
REPLY_TIMEOUT_S = 15.0
#: the agent's simulated GPUs
AGENT_GPUS = 2


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> str:
        """The one-line ``{"error": ...}`` message of a refusal (fails the test otherwise)."""
        data = json.loads(self.body)
        assert isinstance(data, dict) and set(data) == {"error"}, self.body[:200]
        message = data["error"]
        assert isinstance(message, str) and message, self.body[:200]
        assert "\n" not in message and "\r" not in message, message
        assert "Traceback" not in message, message
        return message

    def json(self) -> Any:
        return json.loads(self.body)


def raw_request(
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    *,
    credentials: Sequence[str] = (),
    headers: Mapping[str, str] | None = None,
    content_length: str | None = "auto",
    send_body: bool = True,
    host: str = "127.0.0.1",
) -> Reply:
    """One request on a fresh connection, exactly as given; the answer read to the end."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    lines += [f"Authorization: {c}" for c in credentials]
    if content_length == "auto":
        lines.append(f"Content-Length: {len(body)}")
    elif content_length is not None:
        lines.append(f"Content-Length: {content_length}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    with socket.create_connection((host, port), timeout=REPLY_TIMEOUT_S) as sock:
        # the server may answer and close before reading it all: then read the answer
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(head + (body if send_body else b""))
        data = bytearray()
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data.extend(chunk)
    head_bytes, _, rest = bytes(data).partition(b"\r\n\r\n")
    status_line, *header_lines = head_bytes.decode("latin-1").split("\r\n")
    assert status_line.startswith("HTTP/1."), f"not an HTTP answer: {bytes(data[:200])!r}"
    reply_headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        reply_headers[name.strip().lower()] = value.strip()
    length = int(reply_headers.get("content-length", len(rest)))
    return Reply(int(status_line.split()[1]), reply_headers, rest[:length])


@dataclass(frozen=True)
class Keys:
    secret: bytes
    file: Path

    def signer(
        self, uid: int = 0, gid: int = 0, clock: Callable[[], float] = time.time
    ) -> HmacSigner:
        return HmacSigner(HmacKey(self.secret), uid=uid, gid=gid, clock=clock)


@dataclass
class Daemon:
    """One running daemon (started by `slurm_cdgpc.localcluster`): where it listens, its log,
    and the signer the tests trust."""

    started: localcluster.Daemon
    port: int
    keys: Keys
    home: Path
    extra: dict[str, Any] = field(default_factory=dict)
    host: str = "127.0.0.1"

    @property
    def name(self) -> str:
        return self.started.name

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.started.proc

    def text(self) -> str:
        return self.started.text()

    @property
    def signer(self) -> HmacSigner:
        """Signs as root with the shared key: what the Prolog and the head do."""
        return self.keys.signer()

    def request(
        self, method: str, path: str, body: bytes = b"", *, signer: HmacSigner | None = None
    ) -> Reply:
        """A request signed for exactly what is sent (by the trusted signer by default)."""
        credential = (signer or self.signer).sign(method, path, body)
        return raw_request(self.port, method, path, body, credentials=[credential], host=self.host)

    def ok(self, method: str, path: str, payload: object | None = None) -> Any:
        body = b"" if payload is None else json.dumps(payload).encode()
        reply = self.request(method, path, body)
        assert reply.status == 200, (reply.status, reply.body[:300], self.text()[-2000:])
        return reply.json()


def make_keys(directory: Path) -> Keys:
    key_file = directory / "hmac.key"
    return Keys(write_hmac_key(key_file, pytest.skip), key_file)


def _cluster(
    home: Path,
    auth: Mapping[str, TomlValue | None],
    *,
    interval_s: float | None = None,
    lease_s: float,
) -> LocalCluster:
    home.mkdir(parents=True, exist_ok=True)
    return LocalCluster(
        home,
        auth,
        interval_s=interval_s,
        lease_s=lease_s,
        env=daemon_env(source_first=True),
        start_timeout_s=START_TIMEOUT_S,
    )


def start_head(
    home: Path,
    keys: Keys,
    *,
    hmac_is_admin: bool,
    name: str = "head",
    auth: Mapping[str, TomlValue | None] | None = None,
    interval_s: float = 600.0,
    lease_s: float = 1200.0,
) -> Daemon:
    """cdgpcd on SQLite; the control interval is long so that nothing moves on its own.

    ``auth`` replaces the HMAC ``[auth]`` section (MUNGE tests).
    """
    cluster = _cluster(
        home,
        auth or hmac_auth(keys.file, admin=hmac_is_admin),
        interval_s=interval_s,
        lease_s=lease_s,
    )
    head = cluster.add_head(
        name,
        store_url=f"sqlite:///{home / f'{name}.db'}",
        extra={"budget": {"initial": "10kW"}},
    )
    return Daemon(cluster.start_head(name), head.port, keys, home)


def start_agent(
    home: Path,
    keys: Keys,
    *,
    name: str = "node1",
    listen_address: str = "127.0.0.1",
    auth: Mapping[str, TomlValue | None] | None = None,
    progress_socket: Path | None = None,
) -> Daemon:
    """cdgpc-noded with simulated GPUs; its lease is an hour, so it never lapses in a test."""
    cluster = _cluster(home, auth or hmac_auth(keys.file, admin=False), lease_s=3600.0)
    node = cluster.add_node(
        name,
        gpu_type="A100-SXM4-80GB",
        gpus=AGENT_GPUS,
        address=listen_address,
        head_url=f"http://127.0.0.1:{free_port()}",
        progress_socket=progress_socket,
    )
    started = cluster.start_agent(name)
    return Daemon(started, node.port, keys, home, {"state": node.state_file}, listen_address)


def stop_all(daemons: Sequence[Daemon]) -> None:
    stop_processes([d.proc for d in daemons], timeout_s=10)


@contextlib.contextmanager
def head_and_agent(home: Path) -> Iterator[tuple[Daemon, Daemon, Keys]]:
    """A head (HMAC key holders are admins) and node1's agent sharing a fresh key under
    ``home``; both stopped at the end, or the head alone if the agent never started."""
    keys = make_keys(home)
    head = start_head(home / "head", keys, hmac_is_admin=True)
    try:
        agent = start_agent(home / "node1", keys)
    except BaseException:
        stop_all([head])
        raise
    try:
        yield head, agent, keys
    finally:
        stop_all([head, agent])


def running(daemons: Sequence[Daemon]) -> Iterator[Daemon]:
    """The daemons, each checked alive (a crash under attack fails the test that caused it)."""
    for d in daemons:
        assert d.proc.poll() is None, f"{d.name} exited ({d.proc.returncode}):\n{d.text()[-3000:]}"
        yield d
