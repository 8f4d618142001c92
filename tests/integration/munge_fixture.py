"""A private munged for tests: its own key, socket, pid, seed and log; stops only what it started.

A conftest can provide the fixtures with
``from tests.integration.munge_fixture import munged, munged_factory  # noqa: F401``;
test_munge_auth.py binds them itself (``munged = munge_fixture.munged``) so that it runs either way.

Without the munge programs the tests skip with a reason, except under ``CI=true``, where they fail:
CI must install Debian's ``munge`` package. The daemon runs as whoever runs the tests (root in CI)
with ``--force``, in the foreground, so the fixture holds its process and never signals anything it
did not start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

from slurm_cdgpc.localcluster import stop_processes

_SEARCH_PATH = os.pathsep.join(
    [os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
)
_START_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class MungePrograms:
    munged: str
    munge: str
    unmunge: str
    mungekey: str | None  # munge < 0.5.14 has no mungekey; then the key comes from os.urandom


@dataclass(frozen=True)
class MungeDaemon:
    """One running private munged."""

    name: str
    socket: Path
    key_file: Path
    log_file: Path
    pid: int
    programs: MungePrograms

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(text.strip().splitlines()[-lines:])


def unavailable(reason: str) -> NoReturn:
    """Skip locally; under CI=true a component that cannot start fails the run."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {reason}", pytrace=False)
    pytest.skip(reason)


def find_munge_programs() -> MungePrograms:
    found = {
        name: shutil.which(name, path=_SEARCH_PATH)
        for name in ("munged", "munge", "unmunge", "mungekey")
    }
    missing = [name for name in ("munged", "munge", "unmunge") if found[name] is None]
    if missing:
        unavailable(
            f"MUNGE is not installed ({', '.join(missing)} not found; apt-get install munge)"
        )
    return MungePrograms(
        munged=str(found["munged"]),
        munge=str(found["munge"]),
        unmunge=str(found["unmunge"]),
        mungekey=found["mungekey"],
    )


def _make_key(programs: MungePrograms, path: Path) -> None:
    if programs.mungekey is not None:
        result = subprocess.run(
            [programs.mungekey, "--create", f"--keyfile={path}", "--bits=1024"],
            capture_output=True,
            text=True,
            timeout=_START_TIMEOUT_S,
            check=False,
        )
        if result.returncode == 0:
            return
        unavailable(f"mungekey failed: {result.stderr.strip() or result.returncode}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(os.urandom(128))


def _wait_ready(daemon: MungeDaemon, proc: subprocess.Popen[bytes]) -> None:
    """Ready when `munge --no-input` gets a credential, not merely when the socket exists."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    probe = [daemon.programs.munge, "--no-input", f"--socket={daemon.socket}"]
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            unavailable(
                f"private munged {daemon.name!r} exited with status {proc.returncode}: "
                f"{daemon.log_tail()}"
            )
        if daemon.socket.exists():
            result = subprocess.run(probe, capture_output=True, timeout=5, check=False)
            if result.returncode == 0:
                return
        time.sleep(0.05)
    stop_processes([proc], _STOP_TIMEOUT_S)
    unavailable(
        f"private munged {daemon.name!r} did not answer within {_START_TIMEOUT_S:g} s: "
        f"{daemon.log_tail()}"
    )


@pytest.fixture(scope="session")
def munged_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str], MungeDaemon]]:
    """``start(name)`` starts a private munged with a fresh key; all are stopped at session end.

    Key, pid, seed and log files live under pytest's temporary directory. The socket lives in a
    short directory of its own under the system temp dir, mode 0755: a Unix socket path must fit
    in 108 bytes, and unprivileged clients (tests that sign as ``nobody``) must reach it, which
    pytest's 0700 ``pytest-of-<user>`` directory would forbid.
    """
    programs = find_munge_programs()
    started: list[subprocess.Popen[bytes]] = []
    socket_dirs: list[Path] = []

    def start(name: str = "munged") -> MungeDaemon:
        state = tmp_path_factory.mktemp(f"munge-{name}")
        socket_dir = Path(tempfile.mkdtemp(prefix="cdgpc-munge-"))
        socket_dirs.append(socket_dir)
        socket_dir.chmod(0o755)
        key_file = state / "munge.key"
        _make_key(programs, key_file)
        log_file = state / "munged.log"
        argv = [
            programs.munged,
            "--foreground",
            "--force",
            f"--key-file={key_file}",
            f"--socket={socket_dir / 'munge.socket'}",
            f"--pid-file={state / 'munged.pid'}",
            f"--seed-file={state / 'munged.seed'}",
            "--num-threads=2",
        ]
        with log_file.open("wb") as log:
            try:
                proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
                )
            except OSError as e:
                unavailable(f"cannot start munged: {e}")
        started.append(proc)
        daemon = MungeDaemon(
            name=name,
            socket=socket_dir / "munge.socket",
            key_file=key_file,
            log_file=log_file,
            pid=proc.pid,
            programs=programs,
        )
        _wait_ready(daemon, proc)
        return daemon

    try:
        yield start
    finally:
        for proc in started:
            stop_processes([proc], _STOP_TIMEOUT_S)
        for directory in socket_dirs:
            shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def munged(munged_factory: Callable[[str], MungeDaemon]) -> MungeDaemon:
    """The session's private munged; ``munged_factory("other")`` starts one with another key."""
    return munged_factory("main")
