"""The real ``cdgpcd`` and ``cdgpc-noded`` under a stand-in for systemd: ``$NOTIFY_SOCKET`` is a
datagram socket the test reads, ``$WATCHDOG_USEC`` one second. Each says ``READY=1`` when it
serves (the active head and the agent answer HTTP at once; a standby says so in its status),
then keeps the watchdog fed, and says ``STOPPING=1`` at SIGTERM."""

from __future__ import annotations

import http.client
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.processes import daemon_env, spawn, stop, write_hmac_key

pytestmark = pytest.mark.live

#: sd_notify keep-alive period given to the daemons
WATCHDOG_USEC = 1_000_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _health(port: int) -> int:
    """The status of ``GET /v1/health``, asked once."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", "/v1/health")
        return connection.getresponse().status
    finally:
        connection.close()


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    log: Path
    notify: socket.socket

    def until(self, line: str, timeout_s: float = 30.0) -> dict[str, str]:
        """The fields of the first datagram that holds ``line`` (``READY=1``)."""
        deadline = time.monotonic() + timeout_s
        while (left_s := deadline - time.monotonic()) > 0:
            self.notify.settimeout(min(left_s, 0.5))
            try:
                lines = self.notify.recv(4096).decode().split("\n")
            except TimeoutError:
                if self.proc.poll() is not None:
                    break
                continue
            if line in lines:
                return dict(entry.partition("=")[::2] for entry in lines)
        pytest.fail(f"no {line} within {timeout_s:g} s (exit {self.proc.poll()}):\n{self.text()}")

    def text(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@dataclass
class Site:
    tmp_path: Path
    common: str
    daemons: list[Daemon]

    def start(self, module: str, body: str, name: str, *args: str) -> Daemon:
        config = self.tmp_path / f"{name}.toml"
        config.write_text(self.common + body)
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(self.tmp_path / f"{name}.notify"))
        env = daemon_env()
        env.update(NOTIFY_SOCKET=str(self.tmp_path / f"{name}.notify"))
        env.update(WATCHDOG_USEC=str(WATCHDOG_USEC))
        log = self.tmp_path / f"{name}.log"
        argv = [sys.executable, "-m", module, "--config", str(config), *args]
        daemon = Daemon(spawn(argv, log, env=env, cwd=self.tmp_path), log, notify)
        self.daemons.append(daemon)
        return daemon


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    key_file = tmp_path / "hmac.key"
    write_hmac_key(key_file)
    common = f"""
[control]
interval = "0.5s"
[lease]
duration = "3s"
[auth]
method = "hmac"
hmac_key_file = "{key_file}"
"""
    s = Site(tmp_path, common, [])
    yield s
    for daemon in s.daemons:
        stop(daemon.proc)
        daemon.notify.close()


def _head(port: int, db: Path) -> str:
    return f"""
[head]
listen_address = "127.0.0.1"
listen_port = {port}
reconcile = false
[store]
url = "sqlite:///{db}"
"""


def test_heads_are_ready_as_active_and_as_standby_and_keep_the_watchdog_fed(site: Site) -> None:
    db = site.tmp_path / "cdgpc.db"
    port = _free_port()
    head = site.start("slurm_cdgpc.coordinator.main", _head(port, db), "head")
    ready = head.until("READY=1")
    assert _health(port) == 200  # ready means serving: no retry
    assert ready["STATUS"].startswith("active (leader epoch ")
    assert ready["STATUS"].endswith(f"listening on 127.0.0.1:{port}")
    head.until("WATCHDOG=1")  # from the control loop's keep-alive, after READY
    head.until("WATCHDOG=1")

    standby_port = _free_port()
    standby = site.start("slurm_cdgpc.coordinator.main", _head(standby_port, db), "standby")
    ready = standby.until("READY=1")
    assert ready["STATUS"].startswith("standby: ") and "holds the leader lock" in ready["STATUS"]
    standby.until("WATCHDOG=1")
    with pytest.raises(OSError):
        _health(standby_port)  # a standby does not listen

    standby.proc.send_signal(signal.SIGTERM)
    assert standby.until("STOPPING=1")["STATUS"] == "stopping"
    assert standby.proc.wait(timeout=10) == 0
    head.proc.send_signal(signal.SIGTERM)
    head.until("STOPPING=1")
    assert head.proc.wait(timeout=10) == 0, head.text()


def test_the_agent_is_ready_when_it_listens_and_keeps_the_watchdog_fed(site: Site) -> None:
    port = _free_port()
    node = site.tmp_path / "node1"
    node.mkdir()
    body = f"""
[node]
backend = "simulated"
simulated_gpu_type = "A100-SXM4-80GB"
simulated_gpu_count = 2
state_file = "{node / "state.json"}"
progress_socket = "{node / "progress.sock"}"
listen_address = "127.0.0.1"
listen_port = {port}
"""
    agent = site.start("slurm_cdgpc.agent.main", body, "node1", "--node-name", "node1")
    ready = agent.until("READY=1")
    assert _health(port) == 200
    assert ready["STATUS"] == f"2 GPU(s), listening on port {port}"
    agent.until("WATCHDOG=1")
    agent.until("WATCHDOG=1")
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.until("STOPPING=1")["STATUS"] == "stopping: restoring default clocks"
    assert agent.proc.wait(timeout=10) == 0, agent.text()
