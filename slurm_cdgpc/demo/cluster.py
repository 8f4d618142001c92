"""A cluster on one machine: ``cdgpcd`` on a SQLite file and ``cdgpc-noded`` per node, on loopback.

Everything lives in one private run directory: the configuration files, the HMAC key (generated
for the run; MUNGE instead when ``munge -n | unmunge`` works), the store, each node's state file,
progress socket and launch directory, and every process's log. The daemons are the installed
ones (``python -m``, the same code as ``cdgpcd`` and ``cdgpc-noded``), configured by their TOML
files only: ``CDGPC_*`` settings of the caller's environment are not passed on.

`LocalCluster.stop` sends SIGTERM to every process, waits, then SIGKILLs what is left; the
children also get SIGTERM from the kernel if the demo itself dies (``PR_SET_PDEATHSIG``), so no
daemon outlives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from slurm_cdgpc.config import Config, load_config
from slurm_cdgpc.errors import CdgpcError, FatalError, one_line
from slurm_cdgpc.gpu.workloads import JOBS_DIR_ENV, SPEED_ENV
from slurm_cdgpc.transport.credentials import munge_works, signer_from_config
from slurm_cdgpc.transport.http import HeadClient

logger = logging.getLogger(__name__)

#: how long the daemons may take to start on a loaded machine
START_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 15.0
_PR_SET_PDEATHSIG: Final = 1


@dataclass(frozen=True)
class NodeSpec:
    name: str
    gpu_type: str
    gpus: int = 8


#: two A100 and two A40 nodes: both types are calibrated on measured clock sweeps (Perseus)
DEFAULT_NODES: Final = (
    NodeSpec("node1", "A100-SXM4-80GB"),
    NodeSpec("node2", "A100-SXM4-80GB"),
    NodeSpec("node3", "A40"),
    NodeSpec("node4", "A40"),
)


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass
class Node:
    spec: NodeSpec
    config_path: Path
    port: int
    jobs_dir: Path
    state_file: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the demo dies, however it dies (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class LocalCluster:
    """The run directory, the configurations and the daemons of one demo run."""

    run_dir: Path
    interval_s: float
    lease_s: float
    speed: float
    initial_budget_w: float
    nodes_spec: Sequence[NodeSpec] = DEFAULT_NODES
    auth: str = "hmac"
    head_port: int = 0
    nodes: list[Node] = field(default_factory=list)
    processes: list[Process] = field(default_factory=list)

    @classmethod
    def create(
        cls,
        *,
        interval_s: float,
        lease_s: float,
        speed: float,
        initial_budget_w: float,
        nodes: Sequence[NodeSpec] = DEFAULT_NODES,
        parent: Path | None = None,
    ) -> LocalCluster:
        run_dir = Path(tempfile.mkdtemp(prefix="cdgpc-demo-", dir=parent))
        auth = "munge" if munge_works() else "hmac"
        if auth == "hmac" and os.geteuid() != 0:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise FatalError(
                "the demo needs root (the daemons accept only a root-owned HMAC key) "
                "or a running munged"
            )
        cluster = cls(run_dir, interval_s, lease_s, speed, initial_budget_w, nodes, auth)
        cluster._write_configs()
        return cluster

    @property
    def store_url(self) -> str:
        return f"sqlite:///{self.run_dir / 'cdgpc.db'}"

    @property
    def head_url(self) -> str:
        return f"http://127.0.0.1:{self.head_port}"

    @property
    def head_config_path(self) -> Path:
        return self.run_dir / "head.toml"

    def head_config(self) -> Config:
        return load_config(self.head_config_path, env={})

    def head_client(self, timeout_s: float = 10.0) -> HeadClient:
        return HeadClient(
            self.head_url, signer_from_config(self.head_config()), timeout_s=timeout_s
        )

    # -- configuration ---------------------------------------------------------------------

    def _common(self) -> str:
        user = pwd.getpwuid(os.geteuid()).pw_name
        if self.auth == "munge":
            auth = f'method = "munge"\nadmin_users = ["{user}"]\nslurm_user = "{user}"\n'
        else:
            key = self.run_dir / "hmac.key"
            key.write_text(secrets.token_hex(32) + "\n")
            key.chmod(0o600)
            auth = f'method = "hmac"\nhmac_key_file = "{key}"\nhmac_is_admin = true\n'
        return (
            f'[control]\ninterval = "{self.interval_s:g}s"\n'
            f'[lease]\nduration = "{self.lease_s:g}s"\nsafe_cap = 0.6\n'
            f"[auth]\n{auth}"
        )

    def _write_configs(self) -> None:
        common = self._common()
        self.head_port = _free_port()
        head = (
            f'[head]\nlisten_address = "127.0.0.1"\nlisten_port = {self.head_port}\n'
            f'url = "{self.head_url}"\n'
            # the demo's jobs are not this machine's Slurm's: no reconcile with squeue
            "reconcile = false\n"
            f'[store]\nurl = "{self.store_url}"\n'
            f'[budget]\ninitial = "{self.initial_budget_w:.0f}W"\n'
        )
        self.head_config_path.write_text(common + head)
        for spec in self.nodes_spec:
            directory = self.run_dir / spec.name
            jobs_dir = directory / "jobs"
            jobs_dir.mkdir(parents=True)
            port = _free_port()
            state_file = directory / "state.json"
            text = (
                f'[head]\nurl = "{self.head_url}"\n'
                f'[node]\nbackend = "simulated"\nsimulated_gpu_type = "{spec.gpu_type}"\n'
                f"simulated_gpu_count = {spec.gpus}\n"
                f'state_file = "{state_file}"\n'
                f'progress_socket = "{directory / "progress.sock"}"\n'
                f'listen_address = "127.0.0.1"\nlisten_port = {port}\n'
            )
            path = self.run_dir / f"{spec.name}.toml"
            path.write_text(common + text)
            self.nodes.append(Node(spec, path, port, jobs_dir, state_file))

    # -- processes ---------------------------------------------------------------------------

    def child_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The caller's environment without ``CDGPC_*`` settings (the TOML files decide)."""
        env = {
            k: v for k, v in os.environ.items() if not k.startswith("CDGPC_") or k == "CDGPC_DEBUG"
        }
        env.pop("SLURM_JOB_ID", None)
        env.update(extra or {})
        return env

    def _spawn(self, name: str, module: str, args: Sequence[str], env: dict[str, str]) -> Process:
        log = self.run_dir / f"{name}.log"
        with log.open("wb") as stderr:
            popen = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env=env,
                cwd=self.run_dir,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - only prctl, before exec
            )
        process = Process(name, popen, log)
        self.processes.append(process)
        return process

    def start(self, on_step: Callable[[str], None] = lambda _: None) -> None:
        """Start the agents and the head, wait until all answer, announce the nodes."""
        for node in self.nodes:
            env = self.child_env({JOBS_DIR_ENV: str(node.jobs_dir), SPEED_ENV: f"{self.speed:g}"})
            self._spawn(
                node.spec.name,
                "slurm_cdgpc.agent.main",
                ["--config", str(node.config_path), "--node-name", node.spec.name],
                env,
            )
        head = self._spawn(
            "cdgpcd",
            "slurm_cdgpc.coordinator.main",
            ["--config", str(self.head_config_path)],
            self.child_env(),
        )
        on_step(f"started cdgpcd and {len(self.nodes)} cdgpc-noded; waiting for them to listen")
        unsigned = HeadClient(self.head_url, None, timeout_s=2.0)
        self._wait("cdgpcd answers", lambda: bool(unsigned.get("/v1/health")), head)
        for node, process in zip(self.nodes, self.processes, strict=False):
            self._wait(f"{node.spec.name} listens", _listening(process), process)
        client = self.head_client()
        for node in self.nodes:
            client.post(
                "/v1/nodes",
                {"node": node.spec.name, "url": node.url, "gpu_type": node.spec.gpu_type},
            )

        def all_reachable() -> bool:
            nodes = client.get("/v1/nodes")["nodes"]
            return len(nodes) == len(self.nodes) and all(n["reachable"] for n in nodes)

        self._wait("every node reports to cdgpcd", all_reachable, head)

    def _wait(self, what: str, check: Callable[[], Any], process: Process) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.popen.poll() is not None:
                raise FatalError(
                    f"{process.name} exited with status {process.popen.returncode} "
                    f"({one_line(process.tail(), keep='last', empty='no log output')})"
                )
            try:
                if check():
                    return
            except (OSError, KeyError, ValueError, CdgpcError):
                pass
            if time.monotonic() > deadline:
                raise FatalError(
                    f"{what}: not within {START_TIMEOUT_S:g} s (logs in {self.run_dir})"
                )
            time.sleep(0.1)

    def check_alive(self) -> None:
        """Raise if a daemon died during the run (its last log line says why)."""
        for p in self.processes:
            if p.popen.poll() is not None:
                raise FatalError(
                    f"{p.name} exited with status {p.popen.returncode} "
                    f"({one_line(p.tail(), keep='last', empty='no log output')})"
                )

    @property
    def pids(self) -> list[int]:
        return [p.popen.pid for p in self.processes]

    def stop(self) -> list[str]:
        """SIGTERM the head, then the agents (so that its last interval still reaches every
        node), wait, SIGKILL what is left; the names of the processes that had to be killed."""
        heads = [p for p in self.processes if p.name == "cdgpcd"]
        agents = [p for p in self.processes if p.name != "cdgpcd"]
        killed: list[str] = []
        for group in (heads, agents):
            for p in group:
                if p.popen.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for p in group:
                try:
                    p.popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    p.popen.wait(timeout=STOP_TIMEOUT_S)
                    killed.append(p.name)
        return killed

    def remove(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _listening(process: Process) -> Callable[[], bool]:
    return lambda: "listening on" in process.tail()
