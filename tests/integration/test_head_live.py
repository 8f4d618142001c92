"""cdgpcd and two cdgpc-noded processes (simulated GPUs) on loopback, HMAC auth, a real store.

One scenario, run on SQLite and on PostgreSQL: nodes announce themselves, a job registers and
gets its clocks on the right node within an interval, a budget cut lowers them within an
interval, ``kill -9`` of the head lets every GPU fall to the safe cap within one lease, and a
restarted head resumes the job with its learned model.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from slurm_cdgpc.transport.auth import HmacKey, HmacSigner
from slurm_cdgpc.transport.http import HeadClient
from slurm_cdgpc.wire.board import BoardDescription
from tests.integration.processes import daemon_env, spawn, write_hmac_key
from tests.integration.processes import free_port as _free_port
from tests.integration.processes import wait_for as _wait

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[2]
INTERVAL_S = 0.5
LEASE_S = 2.0
SAFE_MHZ = 840  # A100-SXM4-80GB: highest level ≤ 0.6 · 1410 MHz


@dataclass
class Proc:
    proc: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Site:
    tmp_path: Path
    head_config: Path
    head_port: int
    agent_ports: dict[str, int]
    signer: HmacSigner
    env: dict[str, str]
    procs: list[Proc]

    def start(self, module: str, *args: str, name: str) -> Proc:
        log = self.tmp_path / f"{name}-{len(self.procs)}.log"
        proc = spawn([sys.executable, "-m", module, *args], log, env=self.env, cwd=self.tmp_path)
        started = Proc(proc, log)
        self.procs.append(started)
        return started

    def start_head(self) -> Proc:
        head = self.start(
            "slurm_cdgpc.coordinator.main", "--config", str(self.head_config), name="head"
        )
        _wait("cdgpcd answers", lambda: self.client(signed=False).get("/v1/health"), 20, head.text)
        return head

    def client(self, *, signed: bool = True) -> HeadClient:
        return HeadClient(f"http://127.0.0.1:{self.head_port}", self.signer if signed else None)

    def locks(self, node: str) -> dict[int, int]:
        """GPU index → locked graphics clock, from the agent's state file (none: no file)."""
        path = self.tmp_path / node / "state.json"
        if not path.exists():
            return {}
        return {
            lock["index"]: lock["graphics_max_mhz"]
            for lock in json.loads(path.read_text())["locks"]
        }

    def logs(self) -> str:
        return "\n".join(f"== {p.log.name}\n{p.text()[-3000:]}" for p in self.procs)


def _agent_healthy(port: int) -> bool:
    """The agent's ``GET /v1/health`` answers ``{"ok": true}`` (unauthenticated)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        connection.request("GET", "/v1/health")
        response = connection.getresponse()
        return response.status == 200 and json.loads(response.read()) == {"ok": True}
    finally:
        connection.close()


def _config(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


@pytest.fixture
def site(tmp_path: Path, db_url: str) -> Iterator[Site]:
    yield from make_site(tmp_path, db_url)


def make_site(
    tmp_path: Path,
    db_url: str,
    gpus: str = 'simulated_gpu_type = "A100-SXM4-80GB"\nsimulated_gpu_count = 2',
) -> Iterator[Site]:
    """Two agents running (not yet announced to any head), the head's config written; ``gpus``:
    the agents' simulated GPUs (their ``[node]`` keys)."""
    key_file = tmp_path / "hmac.key"
    secret = write_hmac_key(key_file)
    common = f"""
[control]
interval = "{INTERVAL_S}s"
[lease]
duration = "{LEASE_S}s"
safe_cap = 0.6
[auth]
method = "hmac"
hmac_key_file = "{key_file}"
hmac_is_admin = true
"""
    head_port = _free_port()
    head_config = _config(
        tmp_path / "head.toml",
        common
        + f"""
[head]
listen_address = "127.0.0.1"
listen_port = {head_port}
[store]
url = "{db_url}"
""",
    )
    env = daemon_env()
    s = Site(
        tmp_path, head_config, head_port, {}, HmacSigner(HmacKey(secret), uid=0, gid=0), env, []
    )
    for node in ("node1", "node2"):
        port = _free_port()
        s.agent_ports[node] = port
        (tmp_path / node).mkdir()
        config = _config(
            tmp_path / f"{node}.toml",
            common
            + f"""
[node]
backend = "simulated"
{gpus}
state_file = "{tmp_path / node / "state.json"}"
progress_socket = "{tmp_path / node / "progress.sock"}"
listen_address = "127.0.0.1"
listen_port = {port}
""",
        )
        agent = s.start(
            "slurm_cdgpc.agent.main", "--config", str(config), "--node-name", node, name=node
        )
        # its HTTP endpoint, not its log: the progress socket logs "listening on" first
        _wait("agent answers", partial(_agent_healthy, port), 20, agent.text)
    yield s
    for p in s.procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    for p in s.procs:
        try:
            p.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait(timeout=10)


def _job(client: HeadClient, job_id: str) -> dict[str, Any]:
    [job] = [j for j in client.get("/v1/jobs")["jobs"] if j["job_id"] == job_id]
    return job  # type: ignore[no-any-return]


def test_register_budget_crash_and_resume(site: Site) -> None:
    head = site.start_head()
    client = site.client()
    for node, port in site.agent_ports.items():
        client.post("/v1/nodes", {"node": node, "url": f"http://127.0.0.1:{port}"})
    client.post("/v1/budget", {"budget_w": 5000.0, "reason": "live test"})
    _wait(
        "both nodes report",
        lambda: all(
            n["reachable"] and n["gpu_count"] == 2 for n in client.get("/v1/nodes")["nodes"]
        ),
        5,
        site.logs,
    )

    # a job on node2's GPU 1 gets its clock there (and nowhere else) within an interval
    client.post("/v1/jobs", {"job_id": "7", "user": "root", "node": "node2", "gpus": [1]})
    registered_s = time.monotonic()
    _wait("job 7 capped on node2 GPU 1", lambda: 1 in site.locks("node2"), 5, site.logs)
    assert time.monotonic() - registered_s < 2 * INTERVAL_S + 0.5
    assert site.locks("node1") == {} and list(site.locks("node2")) == [1]
    high_mhz = site.locks("node2")[1]
    job = _wait(
        "job 7 controlled", lambda: (j := _job(client, "7"))["controlled"] and j, 3, site.logs
    )
    assert job["graphics_mhz"] == high_mhz

    # let it learn, then cut the budget: the clock drops within an interval
    _wait("job 7 measured", lambda: _job(client, "7")["state"] == "running", 5, site.logs)
    time.sleep(4 * INTERVAL_S)
    client.post("/v1/budget", {"budget_w": 150.0, "reason": "cut"})
    cut_s = time.monotonic()
    _wait("clock lowered", lambda: site.locks("node2").get(1, high_mhz) < high_mhz, 5, site.logs)
    assert time.monotonic() - cut_s < 2 * INTERVAL_S + 0.5
    status = client.get("/v1/status")
    assert status["budget_w"] == 150.0
    decisions = _wait(
        "decision recorded",
        lambda: (
            (d := client.get("/v1/decisions", {"limit": 50})["decisions"])[-1]["budget_w"] == 150.0
            and d
        ),
        2,
        site.logs,
    )
    assert any(d["measured_power_w"] is not None for d in decisions)

    # kill -9: no head; within one lease every GPU of both nodes is at the safe cap or below
    # (the job's GPU keeps its lower clock: the lapse never raises a clock)
    low_mhz = site.locks("node2")[1]
    assert low_mhz < SAFE_MHZ
    head.proc.kill()
    head.proc.wait(timeout=10)
    killed_s = time.monotonic()
    expected = {"node1": {0: SAFE_MHZ, 1: SAFE_MHZ}, "node2": {0: SAFE_MHZ, 1: low_mhz}}
    _wait(
        "safe cap everywhere",
        lambda: all(site.locks(n) == locks for n, locks in expected.items()),
        LEASE_S + 3,
        site.logs,
    )
    assert time.monotonic() - killed_s < LEASE_S + 2.5

    # a new head resumes: the job is controlled again with its stored model
    restarted = site.start_head()
    job = _wait("job 7 resumed", lambda: (j := _job(client, "7"))["controlled"] and j, 5, site.logs)
    assert job["state"] == "running" and job["gpus"] == [{"node": "node2", "index": 1}]
    _wait("restored", lambda: "restored the models of job(s) 7" in restarted.text(), 3, site.logs)
    _wait("idle GPUs uncapped", lambda: site.locks("node1") == {}, 3, site.logs)
    assert list(site.locks("node2")) == [1]

    # deregistration releases the GPU at the next exchange; SIGTERM stops the head cleanly
    client.delete("/v1/jobs/7")
    _wait("GPU released", lambda: site.locks("node2") == {}, 3, site.logs)
    restarted.proc.send_signal(signal.SIGTERM)
    assert restarted.proc.wait(timeout=10) == 0
    assert "cdgpcd stopped" in restarted.text()


def test_boards_the_catalog_lacks_and_a_node_of_two_kinds_are_controlled(tmp_path: Path) -> None:
    """Each agent describes its boards as NVML would: node1 one A100 and one RTX 4000 SFF Ada
    (recorded from a real ``nvidia-smi -q -x``; not in the catalog), node2 two of the Ada."""
    ada = REPO / "tests" / "data" / "nvml" / "rtx-4000-sff-ada.board.json"
    board = BoardDescription.from_dict(json.loads(ada.read_text()))
    mixed = f'simulated_gpu_type = "A100-SXM4-80GB:1,{ada}:1"'
    sites = make_site(tmp_path, f"sqlite:///{tmp_path / 'cdgpc.db'}", mixed)
    site = next(sites)
    try:
        (site.tmp_path / "node2.toml").write_text(
            (site.tmp_path / "node2.toml")
            .read_text()
            .replace(mixed, f'simulated_gpu_type = "{ada}:2"')
        )
        site.procs[1].proc.terminate()  # node2 again, with two Ada boards
        site.procs[1].proc.wait(timeout=10)
        port = site.agent_ports["node2"]
        agent = site.start(
            "slurm_cdgpc.agent.main",
            "--config",
            str(site.tmp_path / "node2.toml"),
            "--node-name",
            "node2",
            name="node2",
        )
        _wait("node2 answers", partial(_agent_healthy, port), 20, agent.text)
        site.start_head()
        client = site.client()
        for node, port in site.agent_ports.items():
            client.post("/v1/nodes", {"node": node, "url": f"http://127.0.0.1:{port}"})
        client.post("/v1/budget", {"budget_w": 2000.0, "reason": "boards"})

        def gpus() -> dict[tuple[str, int], dict[str, Any]]:
            return {
                (n["name"], g["index"]): g
                for n in client.get("/v1/nodes")["nodes"]
                for g in n["gpus"]
            }

        def all_controlled() -> dict[tuple[str, int], dict[str, Any]] | None:
            now = gpus()  # one look: no GPU reported yet is not every GPU controlled
            return now if len(now) == 4 and all(g["controlled"] for g in now.values()) else None

        seen = _wait("every GPU controlled", all_controlled, 10, site.logs)
        assert (
            seen[("node1", 0)]["type"] == "A100-SXM4-80GB" and not seen[("node1", 0)]["estimated"]
        )
        ada_type = seen[("node1", 1)]["type"]
        assert ada_type.endswith("#" + board.digest()[:8]) and seen[("node1", 1)]["estimated"]
        assert {seen[("node2", i)]["type"] for i in (0, 1)} == {ada_type}
        client.post("/v1/jobs", {"job_id": "71", "user": "root", "node": "node1", "gpus": [0]})
        client.post("/v1/jobs", {"job_id": "72", "user": "root", "node": "node1", "gpus": [1]})
        client.post("/v1/jobs", {"job_id": "73", "user": "root", "node": "node2", "gpus": [0, 1]})
        _wait(
            "every job locked",
            lambda: set(site.locks("node1")) == {0, 1} and set(site.locks("node2")) == {0, 1},
            10,
            site.logs,
        )

        def jobs_controlled() -> dict[str, dict[str, Any]] | None:
            # the locks are on before the interval that sent them reports its jobs controlled
            now = {j["job_id"]: j for j in client.get("/v1/jobs")["jobs"]}
            return now if all(now[i]["controlled"] for i in ("71", "72", "73")) else None

        jobs = _wait("every job controlled", jobs_controlled, 10, site.logs)
        for job_id in ("72", "73"):
            mem, mhz = jobs[job_id]["memory_mhz"], jobs[job_id]["graphics_mhz"]
            assert mem in board.clocks.memory_mhz and mhz in board.clocks.graphics_for(mem), jobs
        assert jobs["71"]["graphics_mhz"] <= 1410 and jobs["71"]["controlled"]
        assert "refused" not in site.logs()
    finally:
        for _ in sites:
            pass
