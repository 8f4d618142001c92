"""The real ``cdgpcd`` and ``cdgpc-noded`` under a stand-in for systemd: ``$NOTIFY_SOCKET`` is a
datagram socket the test reads, ``$WATCHDOG_USEC`` one second. Each says ``READY=1`` when it
serves (the active head and the agent answer HTTP at once; a standby says so in its status),
then keeps the watchdog fed, and says ``STOPPING=1`` at SIGTERM."""

from __future__ import annotations

import http.client
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurm_cdgpc import localcluster
from slurm_cdgpc.localcluster import LocalCluster, daemon_env, hmac_auth, write_hmac_key

pytestmark = pytest.mark.live

#: sd_notify keep-alive period given to the daemons
WATCHDOG_USEC = 1_000_000


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
    started: localcluster.Daemon
    notify: socket.socket

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.started.proc

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
        return self.started.tail(3000)


@dataclass
class Site:
    cluster: LocalCluster
    daemons: list[Daemon]

    def start(self, name: str, *, head: bool) -> Daemon:
        """Start head or node ``name`` with ``$NOTIFY_SOCKET`` and ``$WATCHDOG_USEC`` set; not
        waited for (its ``READY=1`` is what the test reads)."""
        path = self.cluster.run_dir / f"{name}.notify"
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(path))
        env = {"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": str(WATCHDOG_USEC)}
        start = self.cluster.start_head if head else self.cluster.start_agent
        daemon = Daemon(start(name, env=env, wait=False), notify)
        self.daemons.append(daemon)
        return daemon

    def add_head(self, name: str) -> int:
        """Head ``name`` on the site's one store, never reconciling with Slurm; its port."""
        return self.cluster.add_head(name, extra={"head": {"reconcile": False}}).port


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    key_file = tmp_path / "hmac.key"
    write_hmac_key(key_file, pytest.skip)
    cluster = LocalCluster(
        tmp_path,
        hmac_auth(key_file),
        interval_s=0.5,
        lease_s=3.0,
        env=daemon_env(source_first=True),
    )
    s = Site(cluster, [])
    yield s
    for daemon in s.daemons:
        daemon.started.stop(timeout_s=5)
        daemon.notify.close()


def test_heads_are_ready_as_active_and_as_standby_and_keep_the_watchdog_fed(site: Site) -> None:
    port = site.add_head("head")
    head = site.start("head", head=True)
    ready = head.until("READY=1")
    assert _health(port) == 200  # ready means serving: no retry
    assert ready["STATUS"].startswith("active (leader epoch ")
    assert ready["STATUS"].endswith(f"listening on 127.0.0.1:{port}")
    head.until("WATCHDOG=1")  # from the control loop's keep-alive, after READY
    head.until("WATCHDOG=1")

    standby_port = site.add_head("standby")
    standby = site.start("standby", head=True)
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
    port = site.cluster.add_node("node1", gpu_type="A100-SXM4-80GB", gpus=2).port
    agent = site.start("node1", head=False)
    ready = agent.until("READY=1")
    assert _health(port) == 200
    assert ready["STATUS"] == f"2 GPU(s), listening on port {port}"
    agent.until("WATCHDOG=1")
    agent.until("WATCHDOG=1")
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.until("STOPPING=1")["STATUS"] == "stopping: restoring default clocks"
    assert agent.proc.wait(timeout=10) == 0, agent.text()
