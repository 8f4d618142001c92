"""What the tests that start daemons share: their environment, their HMAC key, free ports,
waiting for them, starting them with their stderr in a log file, and stopping them (munged,
sshd, agents, heads)."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import pytest

from slurm_cdgpc.errors import CdgpcError

REPO = Path(__file__).resolve().parents[2]


def daemon_env() -> dict[str, str]:
    """This environment for a daemon under test: no ``CDGPC_*`` settings (its TOML file
    decides), not inside a Slurm job, and this checkout first on ``PYTHONPATH``."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("CDGPC_") and k != "SLURM_JOB_ID"
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def write_hmac_key(path: Path, unavailable: Callable[[str], NoReturn] = pytest.skip) -> bytes:
    """A fresh HMAC key at ``path``, mode 0600; the daemons refuse one that root does not own,
    so without root the test is ``unavailable`` (skipped, or failed where it must run)."""
    secret = secrets.token_hex(32).encode()
    path.write_bytes(secret)
    path.chmod(0o600)
    if path.stat().st_uid != 0:
        unavailable("the HMAC key must be owned by root: run the live tests as root")
    return secret


def spawn(
    argv: Sequence[str], log: Path, *, env: dict[str, str], cwd: Path
) -> subprocess.Popen[bytes]:
    """Start ``argv`` with no stdin, stdout discarded and stderr into ``log`` (the daemons log
    there; a failing test prints it)."""
    with log.open("wb") as stderr:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=env,
            cwd=cwd,
        )


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``; a no-op if it is gone."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)


def free_port() -> int:
    """A TCP port free on loopback now (the daemon under test binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, logs: Callable[[], str]) -> Any:
    """``check()``'s first true result, polled; a failed test with ``logs()`` after ``timeout_s``
    (a check that raises OSError, ValueError, KeyError or `CdgpcError` counts as not yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = check()
        except (OSError, ValueError, KeyError, CdgpcError):
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:g} s\n{logs()}")
        time.sleep(0.05)
