"""One way to start a local cluster of real daemons: ``cdgpcd`` and ``cdgpc-noded`` on this machine.

Used by the demo, ``bench soak`` and the live, fault, security and Slurm tests. It talks to the
daemons only as a client does (HTTP, their files) and never imports their code; `LocalCluster`
says what it writes and how it starts and stops them. Tests: `tests/unit/test_localcluster.py`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, NoReturn

import slurm_cdgpc
from slurm_cdgpc.config import load_config
from slurm_cdgpc.errors import CdgpcError, FatalError, one_line
from slurm_cdgpc.transport.auth import Signer
from slurm_cdgpc.transport.credentials import signer_from_config
from slurm_cdgpc.transport.http import HeadClient

HEAD_MODULE: Final = "slurm_cdgpc.coordinator.main"
AGENT_MODULE: Final = "slurm_cdgpc.agent.main"
#: how long a daemon may take to answer on a loaded machine
START_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 15.0
#: how often `LocalCluster.wait` looks: the demo replays from the moment it sees every node
#: report, so this sets where in the head's interval its replay starts (its figures feel it)
POLL_S: Final = 0.1
LOOPBACK: Final = "127.0.0.1"
_PR_SET_PDEATHSIG: Final = 1

TomlValue = str | int | float | bool | Sequence[str]
#: TOML sections: name → key → value (None: the key is not written, its default holds)
Sections = Mapping[str, Mapping[str, TomlValue | None]]


class DaemonExitedError(FatalError):
    """A daemon exited while it should have been running."""


class NotReadyError(FatalError):
    """What was awaited did not happen in time."""


# -- the pieces every harness needs -------------------------------------------------------------


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on ``host`` now (the daemon binds it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for(
    what: str,
    check: Callable[[], Any],
    timeout_s: float,
    logs: Callable[[], str] | None = None,
    *,
    watch: Sequence[Daemon] = (),
    note: str = "",
    period_s: float = 0.05,
) -> Any:
    """``check()``'s first true result, polled every ``period_s``; `NotReadyError` after
    ``timeout_s`` (its first line ``what``, ``note`` in brackets; ``logs()`` below),
    `DaemonExitedError` as soon as a ``watch`` daemon exits. A check that raises OSError,
    ValueError, KeyError or `CdgpcError` counts as not yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        for daemon in watch:
            daemon.check_alive()
        try:
            result = check()
        except (OSError, ValueError, KeyError, CdgpcError):
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            message = f"{what}: not within {timeout_s:g} s" + (f" ({note})" if note else "")
            detail = logs() if logs is not None else ""
            raise NotReadyError(message + (f"\n{detail}" if detail else ""))
        time.sleep(period_s)


def daemon_env(*, keep_debug: bool = False, source_first: bool = False) -> dict[str, str]:
    """This process's environment for a daemon: no ``CDGPC_*`` settings (its TOML file decides;
    ``CDGPC_DEBUG`` kept with ``keep_debug``) and not inside a Slurm job. ``source_first`` puts
    the directory this `slurm_cdgpc` was imported from first on ``PYTHONPATH``, so that the
    daemons run this code (a checkout under test), not an installed copy."""
    env = {
        k: v
        for k, v in os.environ.items()
        if (not k.startswith("CDGPC_") or (keep_debug and k == "CDGPC_DEBUG"))
        and k != "SLURM_JOB_ID"
    }
    if source_first:
        source = str(Path(slurm_cdgpc.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [source, env.get("PYTHONPATH")]))
    return env


def write_hmac_key(path: Path, unavailable: Callable[[str], NoReturn] | None = None) -> bytes:
    """A fresh HMAC key (64 hex digits) at ``path``, mode 0600; the secret. The daemons accept
    it only if root owns it: if root does not, ``unavailable`` is told why (a test skips), or
    `FatalError`."""
    secret = secrets.token_hex(32).encode()
    path.write_bytes(secret + b"\n")
    path.chmod(0o600)
    if path.stat().st_uid != 0:
        reason = "the HMAC key must be owned by root (the daemons refuse any other): run as root"
        if unavailable is not None:
            unavailable(reason)
        raise FatalError(reason)
    return secret


def hmac_auth(key_file: Path, *, admin: bool | None = None) -> dict[str, TomlValue | None]:
    """An ``[auth]`` section for the shared key; ``admin``: ``hmac_is_admin`` (None: unset)."""
    return {"method": "hmac", "hmac_key_file": str(key_file), "hmac_is_admin": admin}


def toml_text(*layers: Sections) -> str:
    """The sections as TOML, merged in order (a later key replaces an earlier one)."""
    merged: dict[str, dict[str, TomlValue | None]] = {}
    for layer in layers:
        for section, keys in layer.items():
            merged.setdefault(section, {}).update(keys)
    lines: list[str] = []
    for section, keys in merged.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in keys.items() if v is not None]
    return "\n".join(lines) + "\n"


def _toml_value(value: TomlValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: quotes, backslashes and \uXXXX escaped
    return "[" + ", ".join(json.dumps(str(v)) for v in value) + "]"


def stop_processes(
    procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = STOP_TIMEOUT_S
) -> list[subprocess.Popen[bytes]]:
    """SIGTERM every process still running (and SIGCONT, so that a stopped one acts on it), wait
    up to ``timeout_s`` for them all, SIGKILL what is left; those that had to be killed."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
            p.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + timeout_s
    killed = []
    for p in running:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=timeout_s)
            killed.append(p)
    return killed


def _answers(host: str, port: int) -> bool:
    """``GET /v1/health`` answers 200 (the head and the agent serve it unauthenticated)."""
    connection = http.client.HTTPConnection(host, port, timeout=2.0)
    try:
        connection.request("GET", "/v1/health")
        return connection.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies, however it dies (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


# -- the cluster --------------------------------------------------------------------------------


@dataclass(eq=False)
class Daemon:
    """One started daemon: its process, its role (``head`` or ``agent``) and its log (stderr)."""

    name: str
    role: str
    proc: subprocess.Popen[bytes]
    log: Path
    #: (host, port) of its HTTP endpoint
    listens: tuple[str, int] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, chars: int = 2000) -> str:
        return self.text()[-chars:]

    def check_alive(self) -> None:
        """Raise if it has exited (its last log line says why)."""
        if self.proc.poll() is not None:
            last = one_line(self.tail(), keep="last", empty="no log output")
            raise DaemonExitedError(
                f"{self.name} exited with status {self.proc.returncode} ({last})"
            )

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> bool:
        """SIGTERM, then SIGKILL after ``timeout_s``; whether it had to be killed."""
        return bool(stop_processes([self.proc], timeout_s))


@dataclass
class Head:
    name: str
    config: Path
    port: int
    store_url: str
    daemon: Daemon | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


@dataclass
class Node:
    """One node's agent: its configuration and files (in ``directory``) and where it listens."""

    name: str
    config: Path
    address: str
    port: int
    directory: Path
    progress_socket: Path
    gpu_type: str | None = None
    gpus: int | None = None
    daemon: Daemon | None = None

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    @property
    def state_file(self) -> Path:
        return self.directory / "state.json"

    @property
    def jobs_dir(self) -> Path:
        """The launch directory of simulated workloads (`slurm_cdgpc.gpu.workloads`)."""
        return self.directory / "jobs"


@dataclass
class LocalCluster:
    """The run directory, the configurations and the daemons of one local cluster.

    It writes each daemon's TOML file into the run directory (the ``[control]``, ``[lease]`` and
    ``[auth]`` every daemon shares; a head's port and store; a node's simulated GPUs, state file,
    progress socket and port), starts the daemons as ``python -m`` processes with their stderr in
    a log file there, waits until they answer, and stops them: SIGTERM, then SIGKILL for what is
    left, which `stop` reports. ``interval_s``, ``lease_s``, ``safe_cap`` and ``auth`` go into
    every daemon's file (None: not written, the default holds); ``env`` is every daemon's
    environment.
    """

    run_dir: Path
    auth: Mapping[str, TomlValue | None]
    interval_s: float | None = None
    lease_s: float | None = None
    safe_cap: float | None = None
    env: dict[str, str] = field(default_factory=daemon_env)
    start_timeout_s: float = START_TIMEOUT_S
    #: the daemons get SIGTERM from the kernel when this process dies (``PR_SET_PDEATHSIG``)
    die_with_parent: bool = False
    heads: dict[str, Head] = field(default_factory=dict)
    nodes: dict[str, Node] = field(default_factory=dict)
    daemons: list[Daemon] = field(default_factory=list)

    # -- configuration -------------------------------------------------------------------------

    @classmethod
    def with_hmac(
        cls,
        run_dir: Path,
        *,
        interval_s: float,
        lease_s: float,
        unavailable: Callable[[str], NoReturn] | None = None,
        start_timeout_s: float = 20.0,
    ) -> LocalCluster:
        """A site whose daemons and admin share a fresh HMAC key in ``run_dir`` (``unavailable``
        as `write_hmac_key` takes it), agents' safe cap at 0.6 of the top clock, daemons run
        from this source tree: what the live tests of a head and its agents start from."""
        key_file = run_dir / "hmac.key"
        write_hmac_key(key_file, unavailable)
        return cls(
            run_dir,
            hmac_auth(key_file, admin=True),
            interval_s=interval_s,
            lease_s=lease_s,
            safe_cap=0.6,
            env=daemon_env(source_first=True),
            start_timeout_s=start_timeout_s,
        )

    def _common(self) -> Sections:
        control = {"interval": None if self.interval_s is None else f"{self.interval_s:g}s"}
        lease = {
            "duration": None if self.lease_s is None else f"{self.lease_s:g}s",
            "safe_cap": self.safe_cap,
        }
        return {"control": control, "lease": lease, "auth": self.auth}

    def add_head(
        self,
        name: str = "head",
        *,
        store_url: str | None = None,
        port: int | None = None,
        extra: Sections | None = None,
    ) -> Head:
        """Write ``<name>.toml`` for a head on loopback; the store is ``cdgpc.db`` in the run
        directory unless ``store_url`` says otherwise."""
        head = Head(
            name,
            self.run_dir / f"{name}.toml",
            free_port() if port is None else port,
            store_url or f"sqlite:///{self.run_dir / 'cdgpc.db'}",
        )
        own: Sections = {
            "head": {"listen_address": LOOPBACK, "listen_port": head.port, "url": head.url},
            "store": {"url": head.store_url},
        }
        head.config.write_text(toml_text(self._common(), own, extra or {}))
        self.heads[name] = head
        return head

    def add_node(
        self,
        name: str,
        *,
        gpu_type: str | None = None,
        gpus: int | None = None,
        address: str = LOOPBACK,
        head_url: str | None = None,
        progress_socket: Path | None = None,
        extra: Sections | None = None,
    ) -> Node:
        """Write ``<name>.toml`` for an agent with simulated GPUs listening on ``address``; its
        files go to the directory ``<name>``. ``head_url``: its ``[head] url`` (None: unset)."""
        directory = self.run_dir / name
        (directory / "jobs").mkdir(parents=True, exist_ok=True)
        node = Node(
            name,
            self.run_dir / f"{name}.toml",
            address,
            free_port(),
            directory,
            progress_socket or directory / "progress.sock",
            gpu_type,
            gpus,
        )
        own: Sections = {
            "head": {"url": head_url},
            "node": {
                "backend": "simulated",
                "simulated_gpu_type": gpu_type,
                "simulated_gpu_count": gpus,
                "state_file": str(node.state_file),
                "progress_socket": str(node.progress_socket),
                "listen_address": address,
                "listen_port": node.port,
            },
        }
        node.config.write_text(toml_text(self._common(), own, extra or {}))
        self.nodes[name] = node
        return node

    @property
    def head(self) -> Head:
        """The first head added."""
        return next(iter(self.heads.values()))

    @property
    def auth_method(self) -> str:
        return str(self.auth.get("method"))

    @functools.cached_property
    def signer(self) -> Signer:
        """Credentials as the ``[auth]`` section gives them to a client (``cdgpc-admin``)."""
        configs = [h.config for h in self.heads.values()] + [n.config for n in self.nodes.values()]
        return signer_from_config(load_config(configs[0], env={}))

    # -- processes -------------------------------------------------------------------------------

    def _spawn(
        self,
        name: str,
        role: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        prefix: Sequence[str] = (),
        listens: tuple[str, int] | None = None,
    ) -> Daemon:
        """Run ``[*prefix, python, "-m", *argv]`` in the run directory with ``env`` added to the
        cluster's environment, stdin and stdout closed, stderr into ``<name>.log`` (a later start
        of the same name: ``<name>-<k>.log``)."""
        earlier = sum(1 for d in self.daemons if d.name == name)
        log = self.run_dir / (f"{name}-{earlier}.log" if earlier else f"{name}.log")
        with log.open("wb") as stderr:
            proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", *argv],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env={**self.env, **(env or {})},
                cwd=self.run_dir,
                preexec_fn=_die_with_parent if self.die_with_parent else None,  # noqa: PLW1509 - only prctl, before exec
            )
        daemon = Daemon(name, role, proc, log, listens)
        self.daemons.append(daemon)
        return daemon

    def start_head(
        self,
        name: str | None = None,
        *,
        env: Mapping[str, str] | None = None,
        prefix: Sequence[str] = (),
        launcher: Sequence[str] = (),
        wait: bool = True,
        ready: Callable[[Daemon], object] | None = None,
    ) -> Daemon:
        """Start head ``name`` (the first one by default) and, with ``wait``, return once it
        answers ``GET /v1/health`` (or ``ready`` is true). ``prefix`` runs before the
        interpreter (``ip netns exec NS``), ``launcher`` is a ``-m`` module that runs the daemon's
        module with its arguments after its own."""
        head = self.heads[name] if name is not None else self.head
        argv = [*launcher, HEAD_MODULE, "--config", str(head.config)]
        head.daemon = self._spawn(
            head.name, "head", argv, env=env, prefix=prefix, listens=(LOOPBACK, head.port)
        )
        if wait:
            self.wait_ready(head.daemon, ready)
        return head.daemon

    def start_agent(
        self,
        name: str,
        *,
        env: Mapping[str, str] | None = None,
        prefix: Sequence[str] = (),
        launcher: Sequence[str] = (),
        wait: bool = True,
        ready: Callable[[Daemon], object] | None = None,
    ) -> Daemon:
        """Start node ``name``'s agent as `start_head` starts a head (``GET /v1/health`` on the
        node's address)."""
        node = self.nodes[name]
        argv = [*launcher, AGENT_MODULE, "--config", str(node.config), "--node-name", name]
        node.daemon = self._spawn(
            name, "agent", argv, env=env, prefix=prefix, listens=(node.address, node.port)
        )
        if wait:
            self.wait_ready(node.daemon, ready)
        return node.daemon

    def wait_ready(self, daemon: Daemon, ready: Callable[[Daemon], object] | None = None) -> None:
        """Return once ``ready(daemon)`` is true (by default: once it answers ``GET /v1/health``
        where it listens); fail at once if it exits."""

        def answers() -> object:
            if ready is not None:
                return ready(daemon)
            return daemon.listens is not None and _answers(*daemon.listens)

        self.wait(f"{daemon.name} answers", answers, watch=[daemon])

    def wait(
        self,
        what: str,
        check: Callable[[], Any],
        timeout_s: float | None = None,
        *,
        watch: Sequence[Daemon] = (),
    ) -> Any:
        """`wait_for` with this cluster's logs (``start_timeout_s`` unless told otherwise)."""
        return wait_for(
            what,
            check,
            self.start_timeout_s if timeout_s is None else timeout_s,
            self.logs,
            watch=watch,
            note=f"logs in {self.run_dir}",
            period_s=POLL_S,
        )

    def admin(self, *args: str, head: str | None = None) -> str:
        """``cdgpc-admin ARGS --config`` head ``head``'s file (the first by default), in a
        process of its own as an admin types it: its output (`CalledProcessError` on a
        failure, with what it printed)."""
        config = (self.heads[head] if head is not None else self.head).config
        command = [sys.executable, "-c", "from slurm_cdgpc.cli.main import main; main()"]
        done = subprocess.run(
            [*command, *args, "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return done.stdout

    def client(
        self, head: str | None = None, *, signed: bool = True, timeout_s: float = 10.0
    ) -> HeadClient:
        """A client of head ``head`` (the first by default), signed with `signer`."""
        url = (self.heads[head] if head is not None else self.head).url
        return HeadClient(url, self.signer if signed else None, timeout_s=timeout_s)

    def announce(self, head: str | None = None, *, gpu_types: bool = False) -> None:
        """``POST /v1/nodes`` for every node to head ``head`` (the first by default), with its
        GPU type if ``gpu_types``."""
        client = self.client(head)
        for node in self.nodes.values():
            payload: dict[str, object] = {"node": node.name, "url": node.url}
            if gpu_types and node.gpu_type is not None:
                payload["gpu_type"] = node.gpu_type
            client.post("/v1/nodes", payload)

    def wait_reachable(self, head: str | None = None, *, timeout_s: float = 10.0) -> None:
        """Until head ``head`` (the first by default) has had an answer from every node it knows
        (`NotReadyError` after ``timeout_s``)."""
        client = self.client(head)
        self.wait(
            "every node answers the head",
            lambda: all(n["reachable"] for n in client.get("/v1/nodes")["nodes"]),
            timeout_s,
        )

    def job(self, job_id: str, *, head: str | None = None) -> dict[str, Any] | None:
        """The head's view of job ``job_id`` (None: it has none)."""
        for job in self.client(head).get("/v1/jobs")["jobs"]:
            if job["job_id"] == job_id:
                return job  # type: ignore[no-any-return]
        return None

    def locks(self, node: str) -> dict[int, int]:
        """GPU index → the highest graphics cap node ``node``'s state file lists for it (while a
        change is being made it lists the old lock and the new); none: no state file."""
        try:
            document = json.loads(self.nodes[node].state_file.read_text())
        except FileNotFoundError:
            return {}
        out: dict[int, int] = {}
        for lock in document["locks"]:
            if lock["graphics_max_mhz"] is not None:  # None: a power limit alone (MIG mode)
                out[lock["index"]] = max(out.get(lock["index"], 0), lock["graphics_max_mhz"])
        return out

    def limits(self, node: str) -> dict[int, float]:
        """GPU index → the power limit node ``node``'s state file lists for it (the agent set
        it, or is about to); none: no state file."""
        try:
            document = json.loads(self.nodes[node].state_file.read_text())
        except FileNotFoundError:
            return {}
        return {
            lock["index"]: float(lock["power_limit_w"])
            for lock in document["locks"]
            if lock["power_limit_w"] is not None
        }

    def logs(self, chars: int = 3000) -> str:
        """The end of every daemon's log, each under its file name."""
        return "\n".join(f"== {d.log.name}\n{d.tail(chars)}" for d in self.daemons)

    def check_alive(self) -> None:
        """Raise if the last started daemon of a head or a node has exited."""
        latest = [h.daemon for h in self.heads.values()] + [n.daemon for n in self.nodes.values()]
        for daemon in latest:
            if daemon is not None:
                daemon.check_alive()

    @property
    def pids(self) -> list[int]:
        return [d.pid for d in self.daemons]

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> list[str]:
        """Stop the heads, then the agents (so that a head's last interval still reaches every
        node), each group SIGTERM and then SIGKILL after ``timeout_s``; the names of those that
        had to be killed."""
        killed: list[str] = []
        for role in ("head", "agent"):
            group = [d for d in self.daemons if d.role == role]
            gone = stop_processes([d.proc for d in group], timeout_s)
            killed += [d.name for d in group if d.proc in gone]
        return killed

    def remove(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)
