"""A private sshd for tests: own port, host key, client keys and log; stops only what it started.

A test module binds the fixture with ``sshd = sshd_fixture.sshd`` (as test_munge_auth.py does for
munged). The daemon listens on a free loopback port, runs in the foreground (``-D -e``) so the
fixture holds its process, and lets in root with the generated client key only
(``PermitRootLogin prohibit-password``, ``PasswordAuthentication no``). Everything lives under one
pytest temporary directory; the client side uses `SshServer.write_client_config` (``ssh -F``) so
the machine's and the user's ssh configuration play no part.

Without the OpenSSH programs, or not as root, the tests skip with a reason, except under
``CI=true``, where they fail: CI must install Debian's ``openssh-server`` and ``openssh-client``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurm_cdgpc.localcluster import free_port, stop_processes
from tests.integration.munge_fixture import unavailable

_SEARCH_PATH = os.pathsep.join(
    [os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
)
_START_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 5.0
#: sshd refuses to start without its privilege separation directory (the init script makes it)
_PRIVSEP_DIR = Path("/run/sshd")


@dataclass(frozen=True)
class SshPrograms:
    sshd: str
    ssh: str
    ssh_keygen: str


@dataclass(frozen=True)
class SshServer:
    """One running private sshd and the client files that reach it."""

    directory: Path
    port: int
    pid: int
    programs: SshPrograms
    client_key: Path  # in authorized_keys
    stranger_key: Path  # a valid key that is not
    known_hosts: Path  # the server's host key, as [127.0.0.1]:port
    log_file: Path

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def write_client_config(
        self, path: Path, hosts: Mapping[str, Mapping[str, str]] | None = None
    ) -> Path:
        """An ``ssh -F`` file: ``hosts`` blocks first (ssh keeps the first value), then defaults.

        Defaults: user root, this server's port, the authorized client key only, this server's
        host key only, strict host key checking.
        """
        blocks = []
        for host, options in (hosts or {}).items():
            blocks.append(f"Host {host}\n" + "".join(f"    {k} {v}\n" for k, v in options.items()))
        # IdentityFile adds up rather than keeping the first: hosts naming one do not get ours
        own_key = [host for host, options in (hosts or {}).items() if "IdentityFile" in options]
        patterns = " ".join(["*", *(f"!{host}" for host in own_key)])
        blocks.append(f"Host {patterns}\n    IdentityFile {self.client_key}\n")
        defaults = {
            "User": "root",
            "Port": str(self.port),
            "IdentitiesOnly": "yes",
            "IdentityAgent": "none",
            "UserKnownHostsFile": str(self.known_hosts),
            "GlobalKnownHostsFile": "/dev/null",
            "StrictHostKeyChecking": "yes",
            "CheckHostIP": "no",
            "LogLevel": "ERROR",
        }
        blocks.append("Host *\n" + "".join(f"    {k} {v}\n" for k, v in defaults.items()))
        path.write_text("".join(blocks))
        path.chmod(0o600)  # ssh refuses a config file others can write
        return path


def find_ssh_programs() -> SshPrograms:
    found = {name: shutil.which(name, path=_SEARCH_PATH) for name in ("sshd", "ssh", "ssh-keygen")}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        unavailable(
            f"OpenSSH is not installed ({', '.join(missing)} not found; "
            "apt-get install openssh-server openssh-client)"
        )
    return SshPrograms(str(found["sshd"]), str(found["ssh"]), str(found["ssh-keygen"]))


def _keygen(programs: SshPrograms, path: Path) -> None:
    result = subprocess.run(
        [programs.ssh_keygen, "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=_START_TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0:
        unavailable(f"ssh-keygen failed: {result.stderr.strip() or result.returncode}")


def _sshd_config(directory: Path, port: int) -> str:
    # StrictModes no: the files live under /tmp, which is world-writable; sshd would refuse
    # the authorized_keys file there. Nothing else in this file is weaker than a node's sshd.
    return f"""\
ListenAddress 127.0.0.1
Port {port}
HostKey {directory / "host_ed25519"}
PidFile {directory / "sshd.pid"}
AuthorizedKeysFile {directory / "authorized_keys"}
AllowUsers root
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
UsePAM no
StrictModes no
PermitUserEnvironment no
AllowTcpForwarding no
X11Forwarding no
PrintMotd no
LogLevel VERBOSE
"""


def _wait_ready(server: SshServer, proc: subprocess.Popen[bytes]) -> None:
    """Ready when ``ssh root@127.0.0.1 true`` succeeds with the client key, not merely listens."""
    config = server.write_client_config(server.directory / "probe_config")
    probe = [server.programs.ssh, "-F", str(config), "-o", "BatchMode=yes", "127.0.0.1", "true"]
    deadline = time.monotonic() + _START_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            unavailable(f"private sshd exited with status {proc.returncode}: {server.log_tail()}")
        result = subprocess.run(probe, capture_output=True, text=True, timeout=10, check=False)
        if result.returncode == 0:
            return
        last = result.stderr.strip()
        time.sleep(0.1)
    stop_processes([proc], _STOP_TIMEOUT_S)
    unavailable(
        f"private sshd did not let the test key in within {_START_TIMEOUT_S:g} s: "
        f"{last}; {server.log_tail()}"
    )


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshServer]:
    """The session's private sshd on 127.0.0.1 (root with the generated key only)."""
    programs = find_ssh_programs()
    if os.geteuid() != 0:
        unavailable("the private sshd lets in root only: run the live ssh tests as root")
    directory = tmp_path_factory.mktemp("sshd")
    _keygen(programs, directory / "host_ed25519")
    _keygen(programs, directory / "client_ed25519")
    _keygen(programs, directory / "stranger_ed25519")
    public = (directory / "client_ed25519.pub").read_text().strip()
    # restrict: no pty, no forwarding of any kind; commands still run
    (directory / "authorized_keys").write_text(f"restrict {public}\n")
    (directory / "authorized_keys").chmod(0o600)
    port = free_port()
    host_public = " ".join((directory / "host_ed25519.pub").read_text().split()[:2])
    (directory / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_public}\n")
    config = directory / "sshd_config"
    config.write_text(_sshd_config(directory, port))
    _PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    log_file = directory / "sshd.log"
    # sshd re-executes itself, so it needs its absolute path; -D: stay in the foreground
    argv = [os.path.abspath(programs.sshd), "-D", "-e", "-f", str(config)]
    check = subprocess.run(
        [*argv[:1], "-t", "-f", str(config)], capture_output=True, text=True, check=False
    )
    if check.returncode != 0:
        unavailable(f"sshd refuses the test configuration: {check.stderr.strip()}")
    with log_file.open("wb") as log:
        try:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        except OSError as e:
            unavailable(f"cannot start sshd: {e}")
    server = SshServer(
        directory=directory,
        port=port,
        pid=proc.pid,
        programs=programs,
        client_key=directory / "client_ed25519",
        stranger_key=directory / "stranger_ed25519",
        known_hosts=directory / "known_hosts",
        log_file=log_file,
    )
    try:
        _wait_ready(server, proc)
        yield server
    finally:
        stop_processes([proc], _STOP_TIMEOUT_S)
