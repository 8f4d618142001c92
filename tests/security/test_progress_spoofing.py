"""Progress reports from a user who does not own the job, on a live head and agent.

The progress socket is world-writable on purpose (every job reports), and the agent learns the
sender's uid from the kernel. Whether another user's report about a job reaches the head is what
this checks: ``nobody`` reports progress for a job that root registered.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_cdgpc.localcluster import NotReadyError, wait_for
from tests.evidence import record
from tests.integration.munge_fixture import unavailable
from tests.security.live import Daemon, make_keys, start_agent, start_head, stop_all

pytestmark = [pytest.mark.security, pytest.mark.live]

#: what an unprivileged process sends: the `cdgpc-progress` wire format, standard library only
_CLIENT = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(5)
s.connect(sys.argv[1])
s.sendall(sys.argv[2].encode() + b"\\n")
print(s.recv(200).decode().strip())
"""


@pytest.fixture
def site(tmp_path: Path) -> Iterator[tuple[Daemon, Daemon, Path]]:
    socket_dir = Path(tempfile.mkdtemp(prefix="cdgpc-progress-"))
    socket_dir.chmod(0o755)  # other users must reach the socket, as on a node
    keys = make_keys(tmp_path)
    head = start_head(tmp_path / "head", keys, hmac_is_admin=True, interval_s=0.5, lease_s=5.0)
    agent = None
    try:
        agent = start_agent(tmp_path / "node1", keys, progress_socket=socket_dir / "p.sock")
        yield head, agent, socket_dir / "p.sock"
    finally:
        stop_all([head] if agent is None else [head, agent])
        shutil.rmtree(socket_dir, ignore_errors=True)


def _report_as_nobody(sock: Path, job: str, step: int) -> str:
    runuser = shutil.which("runuser", path="/usr/sbin:/usr/bin:/sbin:/bin")
    python = shutil.which("python3", path="/usr/bin:/bin")
    if runuser is None or python is None:
        unavailable("runuser and /usr/bin/python3 are needed to report as another user")
    line = json.dumps({"job_id": job, "step": step, "total": 1000})
    result = subprocess.run(
        [runuser, "-u", "nobody", "--", python, "-c", _CLIENT, str(sock), line],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_another_users_progress_report_does_not_reach_the_head(
    site: tuple[Daemon, Daemon, Path],
) -> None:
    head, agent, sock = site
    head.ok("POST", "/v1/nodes", {"node": "node1", "url": f"http://127.0.0.1:{agent.port}"})
    head.ok("POST", "/v1/jobs", {"job_id": "77", "user": "root", "node": "node1", "gpus": [0]})
    wait_for(
        "job 77 controlled",
        lambda: any(j["controlled"] for j in head.ok("GET", "/v1/jobs")["jobs"]),
        10,
        head.text,
    )
    answer = _report_as_nobody(sock, "77", 999)

    def head_knows() -> bool:
        [job] = [j for j in head.ok("GET", "/v1/jobs")["jobs"] if j["job_id"] == "77"]
        return bool(job["iterations_done"] == 999)

    try:
        wait_for("the spoofed report reaches the head", head_knows, 3, head.text)
        reached = True
    except NotReadyError:
        reached = False
    record(
        "attack",
        "spoofed-progress:agent progress socket (another user's job)",
        tried=1,
        refused=int(not reached),
        accepted=int(reached),
        state_changed=int(reached),
    )
    assert not reached, f"nobody's report for root's job was recorded (agent said {answer!r})"
    # the path works, and the spoofer, who reported first, did not lock the owner out
    owner = subprocess.run(
        [sys.executable, "-c", _CLIENT, str(sock), json.dumps({"job_id": "77", "step": 5})],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert owner.returncode == 0, owner.stderr

    def owner_recorded() -> bool:
        [job] = [j for j in head.ok("GET", "/v1/jobs")["jobs"] if j["job_id"] == "77"]
        return bool(job["iterations_done"] == 5)

    wait_for("root's own report reaches the head", owner_recorded, 10, head.text)
