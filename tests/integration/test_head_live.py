"""cdgpcd and two cdgpc-noded processes (simulated GPUs) on loopback, HMAC auth, a real store.

One scenario, run on SQLite and on PostgreSQL: nodes announce themselves, a job registers and
gets its clocks on the right node within an interval, a budget cut lowers them within an
interval, ``kill -9`` of the head lets every GPU fall to the safe cap within one lease, and a
restarted head resumes the job with its learned model.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_cdgpc.localcluster import LocalCluster
from slurm_cdgpc.localcluster import wait_for as _wait
from slurm_cdgpc.wire.board import BoardDescription

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[2]
INTERVAL_S = 0.5
LEASE_S = 2.0
SAFE_MHZ = 840  # A100-SXM4-80GB: highest level ≤ 0.6 · 1410 MHz


@pytest.fixture
def site(tmp_path: Path, db_url: str) -> Iterator[LocalCluster]:
    yield from make_site(tmp_path, db_url)


def make_site(
    tmp_path: Path, db_url: str, gpu_type: str = "A100-SXM4-80GB", gpus: int | None = 2
) -> Iterator[LocalCluster]:
    """Two agents running (not yet announced to any head), the head's config written; ``gpu_type``
    and ``gpus``: the agents' simulated GPUs (their ``[node]`` keys; None: unset)."""
    site = LocalCluster.with_hmac(
        tmp_path, interval_s=INTERVAL_S, lease_s=LEASE_S, unavailable=pytest.skip
    )
    site.add_head(store_url=db_url)
    try:
        for node in ("node1", "node2"):
            site.add_node(node, gpu_type=gpu_type, gpus=gpus)
            site.start_agent(node)
        yield site
    finally:
        site.stop(timeout_s=10)


def test_register_budget_crash_and_resume(site: LocalCluster) -> None:
    head = site.start_head()
    client = site.client()
    site.announce()
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
        "job 7 controlled", lambda: (j := site.job("7")) and j["controlled"] and j, 3, site.logs
    )
    assert job["graphics_mhz"] == high_mhz

    # let it learn, then cut the budget: the clock drops within an interval
    _wait("job 7 measured", lambda: (j := site.job("7")) and j["state"] == "running", 5, site.logs)
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
    job = _wait(
        "job 7 resumed", lambda: (j := site.job("7")) and j["controlled"] and j, 5, site.logs
    )
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
    mixed = f"A100-SXM4-80GB:1,{ada}:1"
    sites = make_site(tmp_path, f"sqlite:///{tmp_path / 'cdgpc.db'}", mixed, None)
    site = next(sites)
    try:
        node2 = site.nodes["node2"].daemon
        assert node2 is not None
        node2.proc.terminate()  # node2 again, with two Ada boards
        node2.proc.wait(timeout=10)
        site.add_node("node2", gpu_type=f"{ada}:2")
        site.start_agent("node2")
        site.start_head()
        client = site.client()
        site.announce()
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
