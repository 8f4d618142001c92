"""Stopping the daemons that integration tests start (munged, sshd, agents)."""

from __future__ import annotations

import subprocess


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
