"""The real ``cdgpc-noded`` process on loopback: simulated GPUs, HMAC auth, signals, crashes."""

from __future__ import annotations

import http.client
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurm_cdgpc.localcluster import LocalCluster, daemon_env, hmac_auth, write_hmac_key
from slurm_cdgpc.transport.auth import HmacKey, HmacSigner
from slurm_cdgpc.wire.protocol import ExchangeRequest, ExchangeResponse, GpuReport, Setpoint

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[2]
EXCHANGE = "/v1/exchange"
SAFE_MHZ = 840  # A100-SXM4-80GB: highest level ≤ 0.6 · 1410 MHz


@dataclass
class Agent:
    """One running agent, its files and an HMAC client."""

    proc: subprocess.Popen[bytes]
    port: int
    state_file: Path
    progress_socket: Path
    log: Path
    signer: HmacSigner

    def post(
        self, body: bytes, credential: str | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            all_headers = {"Content-Type": "application/json", **(headers or {})}
            if credential is not None:
                all_headers["Authorization"] = credential
            conn.request("POST", EXCHANGE, body=body, headers=all_headers)
            reply = conn.getresponse()
            return reply.status, reply.read()
        finally:
            conn.close()

    def get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", path)
            reply = conn.getresponse()
            return reply.status, reply.read()
        finally:
            conn.close()

    def exchange(self, *setpoints: Setpoint, lease_s: float = 30.0) -> ExchangeResponse:
        """One exchange; its readings were taken before its setpoints applied."""
        body = ExchangeRequest(1, time.time() + lease_s, setpoints, node="node1").to_json()
        status, data = self.post(body, self.signer.sign("POST", EXCHANGE, body))
        assert status == 200, data
        return ExchangeResponse.from_json(data)

    def settle(self, *setpoints: Setpoint, lease_s: float = 30.0) -> ExchangeResponse:
        """An exchange, then an empty one whose readings show what the first left in force."""
        self.exchange(*setpoints, lease_s=lease_s)
        return self.exchange(lease_s=lease_s)

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")


def _gpu(response: ExchangeResponse, index: int) -> GpuReport:
    (gpu,) = [g for g in response.gpus if g.index == index]
    return gpu


def _cap(response: ExchangeResponse, index: int) -> int | None:
    locked = _gpu(response, index).locked
    return None if locked is None else locked.graphics_max_mhz


@pytest.fixture
def start_agent(tmp_path: Path) -> Iterator[Callable[[], Agent]]:
    """Starts agents (same config, key and state file each time); stops leftovers at the end."""
    key_file = tmp_path / "hmac.key"
    secret = write_hmac_key(key_file, pytest.skip)
    cluster = LocalCluster(
        tmp_path,
        hmac_auth(key_file),
        interval_s=1.0,
        lease_s=5.0,
        safe_cap=0.6,
        env=daemon_env(source_first=True),
        start_timeout_s=15,
    )
    node = cluster.add_node("node1", gpu_type="A100-SXM4-80GB", gpus=2)
    signer = HmacSigner(HmacKey(secret), uid=0, gid=0)

    def start() -> Agent:
        daemon = cluster.start_agent("node1")
        return Agent(
            daemon.proc, node.port, node.state_file, node.progress_socket, daemon.log, signer
        )

    yield start
    cluster.stop(timeout_s=10)


def test_authenticated_exchange_applies_clocks_and_reports(
    start_agent: Callable[[], Agent],
) -> None:
    agent = start_agent()
    applied = agent.exchange(Setpoint(0, "77", 1200), Setpoint(1, "78", 1201))
    assert applied.node == "node1"
    assert [(r.gpu, "1201 MHz is not supported" in r.reason) for r in applied.refused] == [
        (1, True)
    ]
    response = agent.exchange()  # read before anything changes: what the last one left
    assert _cap(response, 0) == 1200 and _gpu(response, 0).job_id == "77"
    assert _cap(response, 1) is None
    g = _gpu(response, 0)
    assert g.error is None and g.power_w is not None and g.power_w > 0
    state = json.loads(agent.state_file.read_text())
    assert [(lock["index"], lock["graphics_max_mhz"]) for lock in state["locks"]] == [(0, 1200)]
    # a job reports progress with the stdlib client; the next exchange carries it, with our uid
    done = subprocess.run(
        [sys.executable, "-m", "slurm_cdgpc.agent.progress", "40", "100"],
        env={
            **os.environ,
            "SLURM_JOB_ID": "77",
            "CDGPC_NODE_PROGRESS_SOCKET": str(agent.progress_socket),
            "PYTHONPATH": str(REPO),
        },
        capture_output=True,
        timeout=10,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, b"")
    (progress,) = agent.exchange(Setpoint(0, "77", 1200)).progress
    assert (progress.job_id, progress.step, progress.total, progress.uid) == (
        "77",
        40,
        100,
        os.getuid(),
    )


def test_bad_requests_are_refused_and_change_nothing(start_agent: Callable[[], Agent]) -> None:
    agent = start_agent()
    assert _cap(agent.settle(Setpoint(0, "5", 1200)), 0) == 1200
    assert agent.get("/v1/health") == (200, b'{"ok":true}')
    assert agent.get(EXCHANGE)[0] == 405
    assert agent.get("/v1/nothing")[0] == 404

    attack = ExchangeRequest(1, time.time() + 30, (Setpoint(0, "5", 600),), node="node1").to_json()
    forged = HmacSigner(HmacKey(secrets.token_bytes(32)), uid=0, gid=0)
    valid = agent.signer.sign("POST", EXCHANGE, attack)
    other_body = ExchangeRequest(
        1, time.time() + 30, (Setpoint(0, "5", 1005),), node="node1"
    ).to_json()
    cases = {
        "no credential": agent.post(attack),
        "forged key": agent.post(attack, forged.sign("POST", EXCHANGE, attack)),
        "garbage": agent.post(attack, "hmac-sha256 nonsense"),
        "other body": agent.post(other_body, valid),
        "first use": agent.post(attack, valid),
        "replay": agent.post(attack, valid),
    }
    statuses = {name: status for name, (status, _) in cases.items()}
    assert statuses == {
        "no credential": 401,
        "forged key": 401,
        "garbage": 401,
        "other body": 401,
        "first use": 200,
        "replay": 401,
    }
    assert b"replay" in cases["replay"][1]
    assert _cap(agent.exchange(), 0) == 600  # only the one valid use applied
    assert _cap(agent.settle(Setpoint(0, "5", 1200)), 0) == 1200

    bad_json = json.dumps(
        {
            "version": 1,
            "node": "node1",
            "interval": -1,
            "lease_expires_s": 1e9,
            "setpoints": [],
            "release": [],
        }
    ).encode()
    status, data = agent.post(bad_json, agent.signer.sign("POST", EXCHANGE, bad_json))
    assert status == 400 and b"interval" in data and b"\n" not in data
    status, _ = agent.post(
        b"x", agent.signer.sign("POST", EXCHANGE, b"x"), {"Content-Length": str(2 * 1024 * 1024)}
    )
    assert status == 413
    with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as raw:
        raw.sendall(b"POST /v1/exchange HTTP/1.1\r\nHost: x\r\n\r\n")
        assert raw.recv(100).startswith(b"HTTP/1.1 411")
    assert _cap(agent.exchange(), 0) == 1200
    assert agent.proc.poll() is None


def test_a_request_for_another_node_is_refused_and_changes_nothing(
    start_agent: Callable[[], Agent],
) -> None:
    """A request signed for node2 (captured on its way there) is no good on node1."""
    agent = start_agent()
    assert _cap(agent.settle(Setpoint(0, "5", 1200)), 0) == 1200
    before = agent.state_file.read_text()
    body = ExchangeRequest(1, time.time() + 30, (Setpoint(0, "5", 600),), node="node2").to_json()
    status, data = agent.post(body, agent.signer.sign("POST", EXCHANGE, body))
    assert status == 401
    assert json.loads(data) == {
        "error": "exchange refused: the request is for node node2, this is node node1"
    }
    assert agent.state_file.read_text() == before
    assert _cap(agent.exchange(), 0) == 1200


def test_kill9_then_restart_restores_defaults_first(start_agent: Callable[[], Agent]) -> None:
    first = start_agent()
    first.exchange(Setpoint(0, "9", 900), Setpoint(1, "9", 900))
    assert first.state_file.exists()
    first.proc.kill()
    first.proc.wait(timeout=10)
    assert first.state_file.exists()  # the crash left it behind

    second = start_agent()
    log = second.stderr()
    assert "stale state file" in log
    assert log.index("default clocks restored") < log.index("listening on")
    assert not second.state_file.exists()
    response = second.exchange()
    assert [_cap(response, i) for i in (0, 1)] == [None, None]


def test_sigterm_restores_defaults_and_exits_0(start_agent: Callable[[], Agent]) -> None:
    agent = start_agent()
    agent.exchange(Setpoint(1, "3", 1005))
    assert agent.state_file.exists()
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(timeout=10) == 0
    assert not agent.state_file.exists()
    assert not agent.progress_socket.exists()
    assert "default clocks restored on 2 GPU(s)" in agent.stderr()


def test_lease_expiry_moves_gpus_to_the_safe_cap(start_agent: Callable[[], Agent]) -> None:
    agent = start_agent()
    assert _cap(agent.settle(Setpoint(0, "4", 1410), lease_s=0.8), 0) == 1410
    deadline = time.monotonic() + 5
    while "lease lapsed" not in agent.stderr():
        assert time.monotonic() < deadline, agent.stderr()
        time.sleep(0.1)
    lapsed = agent.exchange()  # control is back, but GPU 0's job got no new setpoint
    assert [_cap(lapsed, i) for i in (0, 1)] == [SAFE_MHZ, SAFE_MHZ]  # the lapse capped both
    response = agent.exchange()
    assert _cap(response, 0) == SAFE_MHZ
    assert _cap(response, 1) is None  # idle: capped by the lapse only, back to defaults
    assert _cap(agent.settle(Setpoint(0, "4", 1410)), 0) == 1410
