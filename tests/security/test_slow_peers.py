"""Peers that send slowly on purpose: every bound is on a whole exchange, not on each read.

A peer that sends one byte just before each read would time out keeps a per-read timeout from
ever firing. Here such peers meet the real code: the Prolog's entry point against a head that
accepts and trickles a valid-looking reply (the Prolog must spool and exit 0 within its budget),
``cdgpc-admin``'s client and the head's ``https`` exchange against the same, and the node's
progress socket against a sender that trickles its line and a uid that opens every connection
it can (other users' reports must still be served).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from slurm_cdgpc.agent.progress import ProgressServer, report_progress
from slurm_cdgpc.slurm.hooks import DEFAULT_BUDGET_S, DEFAULT_TIMEOUT_S
from slurm_cdgpc.slurm.install import write_hooks
from slurm_cdgpc.slurm.spool import Spool, SpoolRecord
from slurm_cdgpc.transport import http
from slurm_cdgpc.transport.auth import HmacKey, HmacSigner
from slurm_cdgpc.transport.http import HeadClient, HeadUnavailableError, NodeExchanger, NodeTarget
from slurm_cdgpc.wire.protocol import ExchangeRequest

pytestmark = pytest.mark.security

REPO = Path(__file__).resolve().parents[2]
#: under the hooks' 1 s request timeout, so that a per-read timeout never fires
TRICKLE_S = 0.5
#: how long a trickling peer goes on (the old per-read bounds let a client wait all of it)
TRICKLE_FOR_S = 15.0
#: past this a Prolog is counted as hung (the budget is 2 s)
HUNG_S = 20.0
ENV = {
    "SLURM_JOB_ID": "42",
    "SLURM_JOB_USER": "alice",
    "SLURMD_NODENAME": "n1",
    "SLURM_JOB_GPUS": "0,1",
}
NOBODY = 65534
SOMEONE = 65533


@dataclass
class _Connection:
    accepted_s: float  # `time.monotonic`
    request_line: bytes = b""
    #: seconds from the accept to the client letting go (None: it never did)
    held_s: float | None = None


@dataclass
class _Trickler:
    """A loopback server that reads a request and answers ``HTTP/1.1 200 OK`` and then a header
    one byte every `TRICKLE_S`, for `TRICKLE_FOR_S`; it notes when each client lets go."""

    port: int
    connections: list[_Connection] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def trickler() -> Iterator[_Trickler]:
    yield from _trickling(None)


def _trickling(tls: ssl.SSLContext | None) -> Iterator[_Trickler]:
    stop = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))
    server = _Trickler(listener.getsockname()[1])

    def serve(conn: socket.socket, seen: _Connection) -> None:
        started = time.monotonic()
        conn.settimeout(5.0)
        try:
            if tls is not None:
                conn = tls.wrap_socket(conn, server_side=True)
            request = b""
            while b"\r\n\r\n" not in request:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                request += chunk
            seen.request_line = request.split(b"\r\n", 1)[0]
            conn.sendall(b"HTTP/1.1 200 OK\r\nX-Pad: ")
            while time.monotonic() - started < TRICKLE_FOR_S and not stop.is_set():
                readable, _, _ = select.select([conn], [], [], TRICKLE_S)
                if readable and not conn.recv(1):
                    break  # the client closed
                conn.sendall(b"a")
            else:
                return
        except OSError:
            pass  # the client went away mid-write (ssl.SSLError is an OSError): it let go too
        finally:
            conn.close()
        seen.held_s = time.monotonic() - started

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            seen = _Connection(time.monotonic())
            server.connections.append(seen)
            threading.Thread(target=serve, args=(conn, seen), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield server
    finally:
        stop.set()
        listener.close()


def test_a_prolog_against_a_trickling_head_spools_and_exits_within_its_budget(
    tmp_path: Path, trickler: _Trickler
) -> None:
    """The head (and the local agent the Prolog asks for its hold) accept and trickle a reply
    under the per-read timeout; the real Prolog entry point must still spool the registration
    and exit 0 within its budget (counted from its first connection, which comes after the
    interpreter's start) and a second."""
    key = tmp_path / "hmac.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    config = tmp_path / "cdgpc.toml"
    config.write_text(
        f'[auth]\nmethod = "hmac"\nhmac_key_file = "{key}"\n'
        f'[head]\nurl = "{trickler.url}"\n'
        f'[node]\nlisten_address = "127.0.0.1"\nlisten_port = {trickler.port}\n'
    )
    spool_dir = tmp_path / "spool"
    [prolog, _] = write_hooks(
        tmp_path / "hooks", sys.executable, ["--config", str(config), "--spool-dir", str(spool_dir)]
    )
    # through the interpreter, not the script's "-I" line: PYTHONPATH names the code under test
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, str(prolog)],
            env={**ENV, "PYTHONPATH": str(REPO)},
            capture_output=True,
            timeout=HUNG_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the Prolog was still running {HUNG_S:g} s after it started")
    ended = time.monotonic()
    assert (done.returncode, done.stdout, done.stderr) == (0, b"", b"")
    took_s = ended - min(c.accepted_s for c in trickler.connections)
    assert took_s < DEFAULT_BUDGET_S + 1.0, (
        f"the Prolog ran {took_s:.2f} s after its first connection ({ended - started:.2f} s in all)"
    )
    [path] = Spool(spool_dir).pending()
    record = SpoolRecord.from_json(path.read_bytes())
    assert (record.op, record.job_id) == ("register", "42")
    assert record.payload is not None and record.payload["gpus"] == [0, 1]
    lines = sorted(c.request_line for c in trickler.connections)
    assert lines == [b"POST /v1/hold HTTP/1.1", b"POST /v1/jobs HTTP/1.1"]


def test_an_admin_request_to_a_trickling_head_ends_at_its_timeout(trickler: _Trickler) -> None:
    client = HeadClient(trickler.url, None, timeout_s=DEFAULT_TIMEOUT_S)
    started = time.monotonic()
    with pytest.raises(HeadUnavailableError) as raised:
        client.get("/v1/health")
    took_s = time.monotonic() - started
    assert took_s < DEFAULT_TIMEOUT_S + 0.5, f"the request took {took_s:.2f} s"
    assert str(raised.value) == f"cannot reach cdgpcd at {trickler.url}: no whole reply within 1 s"


@pytest.fixture
def tls_trickler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Trickler]:
    """A trickler behind TLS, with a certificate for 127.0.0.1 that the client trusts."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is needed to make a certificate for the TLS peer")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    request = "req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=127.0.0.1"
    names = ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)]
    subprocess.run(
        [openssl, *request.split(), *names],
        capture_output=True,
        timeout=60,
        check=True,
    )
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    monkeypatch.setattr(http, "_tls_context", lambda: ssl.create_default_context(cafile=cert))
    yield from _trickling(server)


def test_an_https_node_that_trickles_is_let_go_when_the_round_ends(
    tls_trickler: _Trickler,
) -> None:
    """An ``https`` node's exchange runs on a pool thread; the thread must let go of a node that
    trickles its reply when the round ends (twice the timeout), not when the node stops."""
    timeout_s = 2 * TRICKLE_S  # over the trickle's gaps: a per-read timeout never fires
    request = ExchangeRequest(node="n1", interval=1, lease_expires_s=time.time() + 60)
    url = tls_trickler.url.replace("http://", "https://")
    exchanger = NodeExchanger(HmacSigner(HmacKey(b"k" * 32)), timeout_s=timeout_s)
    try:
        exchanger.exchange({"n1": NodeTarget(url, request)})
        deadline = time.monotonic() + TRICKLE_FOR_S + 5.0
        while tls_trickler.connections[0].held_s is None and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        exchanger.close()
    [held] = tls_trickler.connections
    assert held.request_line == b"POST /v1/exchange HTTP/1.1"
    assert held.held_s is not None and held.held_s < 2 * timeout_s + 1.0, held


# -- the progress socket -----------------------------------------------------------------------


@pytest.fixture
def progress_dir() -> Iterator[Path]:
    """A short directory every uid may enter (Unix socket paths are limited to 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="cdgpc-") as d:
        os.chmod(d, 0o755)
        yield Path(d)


def test_a_progress_sender_that_trickles_is_cut_off_at_its_deadline(progress_dir: Path) -> None:
    timeout_s = 1.0
    server = ProgressServer(progress_dir / "p.sock", lambda *_: None, timeout_s=timeout_s)
    server.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(server.path))
            started = time.monotonic()
            answer = b""
            while time.monotonic() - started < TRICKLE_FOR_S:
                sock.sendall(b" ")  # a line that never ends, a byte every 0.1 s
                readable, _, _ = select.select([sock], [], [], 0.1)
                if readable:
                    answer = sock.recv(200)
                    break
            took_s = time.monotonic() - started
    finally:
        server.close()
    assert answer == b"error: no complete line received in time\n", f"after {took_s:.1f} s"
    assert took_s < timeout_s + 1.0, f"the connection lived {took_s:.2f} s"


def _as_uid(uid: int, work: Callable[[], int]) -> int:
    """Run ``work`` in a child process with ``uid`` (and that gid); its pid. Root only."""
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code = 1
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            code = work()
        finally:
            os._exit(code)
    return pid


def _exit_code(pid: int, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return -9


@pytest.mark.skipif(os.geteuid() != 0, reason="reporting as other uids needs root")
def test_one_uid_holding_every_progress_slot_it_can_leaves_others_served(
    progress_dir: Path,
) -> None:
    """``nobody`` opens as many connections as the server has slots (16) and sends nothing;
    another user's report, and root's, are still served, and ``nobody`` got its 4 only."""
    recorded: list[tuple[str, int]] = []
    server = ProgressServer(
        progress_dir / "p.sock",
        lambda job, _step, _total, uid: recorded.append((job, uid)),
        timeout_s=10.0,  # the held connections outlive the whole test
    )
    server.start()
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()

    def hold_every_slot() -> int:
        held = []
        for _ in range(16):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(server.path))
            held.append(sock)
        refused = set()
        deadline = time.monotonic() + 2.0
        while len(refused) < 12 and time.monotonic() < deadline:
            waiting = [s for s in held if s not in refused]
            readable, _, _ = select.select(waiting, [], [], deadline - time.monotonic())
            for sock in readable:
                if sock.recv(200).startswith(b"error: uid 65534 has 4 reports in flight"):
                    refused.add(sock)
        os.write(ready_w, json.dumps(len(refused)).encode())
        os.read(done_r, 1)  # hold the rest until the others have reported
        return 0

    holder = _as_uid(NOBODY, hold_every_slot)
    try:
        refused = json.loads(os.read(ready_r, 100))
        other = _as_uid(
            SOMEONE, lambda: 0 if report_progress(1, job_id="8", path=server.path) else 1
        )
        assert _exit_code(other) == 0, "another user's report was not served"
        assert report_progress(2, job_id="9", path=server.path), "root's report was not served"
        assert refused == 12, f"nobody was refused {refused} of its 16 connections, not 12"
        assert recorded == [("8", SOMEONE), ("9", 0)]
    finally:
        os.write(done_w, b"x")
        _exit_code(holder)
        for fd in (ready_r, ready_w, done_r, done_w):
            os.close(fd)
        server.close()
