"""The SSH transport end to end: the head's `SshExchanger` → a private sshd → ``cdgpc-noded
exchange`` → a real ``cdgpc-noded`` (simulated GPUs, HMAC) on loopback, and back. The head signs
each request and checks the agent's signed answer through the forwarder, end to end."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from slurm_cdgpc.localcluster import (
    LocalCluster,
    daemon_env,
    free_port,
    hmac_auth,
    write_hmac_key,
)
from slurm_cdgpc.transport.auth import HmacKey, HmacSigner
from slurm_cdgpc.transport.http import NodeFailure, NodeTarget
from slurm_cdgpc.transport.ssh import SshExchanger, ssh_url
from slurm_cdgpc.wire.protocol import ExchangeRequest, ExchangeResponse, GpuReport, Setpoint
from tests.integration import sshd_fixture
from tests.integration.sshd_fixture import SshServer

pytestmark = pytest.mark.live

sshd = sshd_fixture.sshd

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 8.0


@dataclass(frozen=True)
class Node:
    """A running agent, the forwarder's config, and the key the head signs with (the agent's,
    and a key it does not know)."""

    config: Path
    signer: HmacSigner
    wrong_signer: HmacSigner
    log: Path


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """One ``cdgpc-noded --node-name node1`` with HMAC on 127.0.0.1; stopped at the end."""
    tmp = tmp_path_factory.mktemp("ssh-node")
    key_file = tmp / "hmac.key"
    signer = HmacSigner(HmacKey(write_hmac_key(key_file, pytest.skip)))
    wrong = HmacSigner(HmacKey(write_hmac_key(tmp / "other.key")))
    cluster = LocalCluster(
        tmp,
        hmac_auth(key_file),
        interval_s=1.0,
        lease_s=5.0,
        safe_cap=0.6,
        env=daemon_env(source_first=True),
        start_timeout_s=15,
    )
    config = cluster.add_node(
        "node1", gpu_type="A100-SXM4-80GB", gpus=2, extra={"node": {"transport": "ssh"}}
    ).config
    try:
        agent = cluster.start_agent("node1")
        yield Node(config, signer, wrong, agent.log)
    finally:
        cluster.stop(timeout_s=10)


def _forwarder(config: Path) -> list[str]:
    """``cdgpc-noded exchange`` as the remote shell will find it: this checkout, this Python."""
    return [
        "/usr/bin/env",
        f"PYTHONPATH={REPO}",
        sys.executable,
        "-m",
        "slurm_cdgpc.transport.forward",
        "--config",
        str(config),
    ]


def _exchanger(
    sshd: SshServer,
    tmp_path: Path,
    config: Path,
    signer: HmacSigner,
    *,
    ssh_path: str | None = None,
) -> SshExchanger:
    down_port = free_port()  # nothing listens there
    client_config = sshd.write_client_config(
        tmp_path / "ssh_config",
        {
            "node1": {"HostName": "127.0.0.1"},
            # a host whose key we do not know
            "node-stranger": {"HostName": "127.0.0.1", "HostKeyAlias": "node-stranger"},
            # a node that does not have our key in authorized_keys
            "node-nokey": {"HostName": "127.0.0.1", "IdentityFile": str(sshd.stranger_key)},
            "node-down": {"HostName": "127.0.0.1", "Port": str(down_port)},
        },
    )
    return SshExchanger(
        ssh_path or sshd.programs.ssh,
        signer=signer,
        timeout_s=TIMEOUT_S,
        config_file=client_config,
        remote_command=_forwarder(config),
        max_parallel=8,
    )


def _request(*setpoints: Setpoint, release: Sequence[int] = ()) -> ExchangeRequest:
    return ExchangeRequest(7, time.time() + 30, setpoints, tuple(release), node="node1")


def _gpu(response: ExchangeResponse | NodeFailure, index: int) -> GpuReport:
    assert isinstance(response, ExchangeResponse), response
    (gpu,) = [g for g in response.gpus if g.index == index]
    return gpu


def test_setpoints_go_out_and_readings_come_back_over_ssh(
    sshd: SshServer, node: Node, tmp_path: Path
) -> None:
    exchanger = _exchanger(sshd, tmp_path, node.config, node.signer)
    try:
        target = {"node1": NodeTarget(ssh_url("node1"), _request(Setpoint(0, "77", 1200)))}
        exchanger.exchange(target)
        # an agent reads before it applies: the next answer shows what this one left in force
        applied = exchanger.exchange({"node1": NodeTarget(ssh_url("node1"), _request())})["node1"]
        assert isinstance(applied, ExchangeResponse), applied
        assert applied.node == "node1"
        locked = _gpu(applied, 0).locked
        assert locked is not None and locked.graphics_max_mhz == 1200
        assert _gpu(applied, 0).job_id == "77"
        assert _gpu(applied, 1).locked is None
        power_w = _gpu(applied, 0).power_w
        assert power_w is not None and power_w > 0
        # an unsupported clock is refused by the agent, and the refusal comes back over ssh
        refused = exchanger.exchange(
            {"node1": NodeTarget(ssh_url("node1"), _request(Setpoint(1, "78", 1201)))}
        )["node1"]
        assert isinstance(refused, ExchangeResponse), refused
        assert [(r.gpu, "1201 MHz is not supported" in r.reason) for r in refused.refused] == [
            (1, True)
        ]
        exchanger.exchange({"node1": NodeTarget(ssh_url("node1"), _request(release=[0]))})
        released = exchanger.exchange({"node1": NodeTarget(ssh_url("node1"), _request())})["node1"]
        assert _gpu(released, 0).locked is None and _gpu(released, 0).job_id is None
        # a request for another node is refused by the agent behind ssh, changing nothing
        other = replace(_request(Setpoint(0, "77", 600)), node="node2")
        wrong = exchanger.exchange({"node1": NodeTarget(ssh_url("node1"), other)})["node1"]
        assert isinstance(wrong, NodeFailure)
        assert "HTTP 401" in wrong.reason and "for node node2, this is node node1" in wrong.reason
        after = exchanger.exchange({"node1": NodeTarget(ssh_url("node1"), _request())})["node1"]
        assert _gpu(after, 0).locked is None
    finally:
        exchanger.close()


def test_hosts_we_cannot_or_may_not_reach_fail_within_the_timeout(
    sshd: SshServer, node: Node, tmp_path: Path
) -> None:
    exchanger = _exchanger(sshd, tmp_path, node.config, node.signer)
    names = ("node1", "node-stranger", "node-nokey", "node-down")
    started = time.monotonic()
    try:
        results = exchanger.exchange({name: NodeTarget("", _request()) for name in names})
    finally:
        exchanger.close()
    assert time.monotonic() - started < TIMEOUT_S
    assert isinstance(results["node1"], ExchangeResponse), results["node1"]
    reasons = {}
    for name in names[1:]:
        result = results[name]
        assert isinstance(result, NodeFailure), result
        assert "\n" not in result.reason
        reasons[name] = result.reason
    assert "Host key verification failed" in reasons["node-stranger"]
    assert "Permission denied" in reasons["node-nokey"]
    assert "Connection refused" in reasons["node-down"]
    assert all("ssh failed (exit 255)" in reason for reason in reasons.values()), reasons


def test_the_agent_still_checks_the_credential_behind_ssh(
    sshd: SshServer, node: Node, tmp_path: Path
) -> None:
    # the head signs with a key the agent does not know: refused, and nothing applied
    exchanger = _exchanger(sshd, tmp_path, node.config, node.wrong_signer)
    try:
        result = exchanger.exchange({"node1": NodeTarget("", _request(Setpoint(0, "9", 1200)))})
    finally:
        exchanger.close()
    assert isinstance(result["node1"], NodeFailure)
    assert "exchange failed on the node (exit 1)" in result["node1"].reason
    assert "HTTP 401" in result["node1"].reason
    good = _exchanger(sshd, tmp_path, node.config, node.signer)
    try:
        after = good.exchange({"node1": NodeTarget("", _request())})["node1"]
    finally:
        good.close()
    assert _gpu(after, 0).job_id != "9"


def test_a_malicious_node_name_never_reaches_ssh(
    sshd: SshServer, node: Node, tmp_path: Path
) -> None:
    calls = tmp_path / "ssh-argv.log"
    pwned = tmp_path / "pwned"
    wrapper = tmp_path / "ssh"
    wrapper.write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$@" >> {calls}\nexec {sshd.programs.ssh} "$@"\n'
    )
    wrapper.chmod(0o755)
    exchanger = _exchanger(sshd, tmp_path, node.config, node.signer, ssh_path=str(wrapper))
    evil = f"-oProxyCommand=touch {pwned}"
    try:
        results = exchanger.exchange(
            {
                evil: NodeTarget("", _request()),
                "node1;touch x": NodeTarget("", _request()),
                "node2": NodeTarget(f"ssh://{evil}", _request()),
                "node1": NodeTarget(ssh_url("node1"), _request()),
            }
        )
    finally:
        exchanger.close()
    assert isinstance(results["node1"], ExchangeResponse), results["node1"]
    for name in (evil, "node1;touch x", "node2"):
        result = results[name]
        assert isinstance(result, NodeFailure) and "refused" in result.reason, result
    argv_seen = calls.read_text()
    assert "ProxyCommand" not in argv_seen and "touch" not in argv_seen
    assert argv_seen.count("\n--\nnode1\n") == 1  # only the good node was run
    assert not pwned.exists()


def test_an_impostor_on_the_agents_port_is_refused_end_to_end(
    sshd: SshServer, node: Node, tmp_path: Path
) -> None:
    """A local user who holds the agent's port (while it restarts) answers the forwarder with a
    plausible exchange response: the forwarder relays it, and the head refuses it."""
    forged = ExchangeResponse(node="node1", time_s=time.time()).to_json()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(forged)}\r\n\r\n"
                conn.sendall(head.encode() + forged)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    text = node.config.read_text().replace(
        f"listen_port = {_port_of(node.config)}", f"listen_port = {port}"
    )
    impostor_config = tmp_path / "impostor.toml"
    impostor_config.write_text(text)
    exchanger = _exchanger(sshd, tmp_path, impostor_config, node.signer)
    try:
        result = exchanger.exchange({"node1": NodeTarget("", _request())})["node1"]
    finally:
        exchanger.close()
    thread.join(TIMEOUT_S)
    assert isinstance(result, NodeFailure), result
    assert "node1 over ssh: reply refused: no X-Cdgpc-Reply-Auth header" in result.reason


def test_a_head_older_than_the_agent_still_gets_a_checked_answer(node: Node) -> None:
    """A bare request (a head that signs none) is signed by the forwarder with the node's own
    key, and the agent's answer checked there before its JSON is printed."""
    done = subprocess.run(
        _forwarder(node.config),
        input=_request().to_json(),
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert ExchangeResponse.from_json(done.stdout).node == "node1"


def _port_of(config: Path) -> int:
    (line,) = [x for x in config.read_text().splitlines() if x.startswith("listen_port")]
    return int(line.split("=")[1])
