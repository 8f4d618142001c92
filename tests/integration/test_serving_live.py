"""cdgpcd and two cdgpc-noded processes (simulated A100s) on loopback, HMAC auth, SQLite: a
serving job with a latency objective beside a training job with a deadline, under a budget
that binds. The serving job reports its latency through the node agent's progress socket as
`LatencyReporter` would (the simulated runner times a request as a number of the workload's
iterations, so its latency follows the calibrated clock response of BLOOM's forward pass);
the head brings its clock down below the top while every reported latency stays within the
objective, and the power it leaves goes to the training job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from slurm_cdgpc.gpu.workloads import JOBS_DIR_ENV, LAUNCH_SUFFIX, Launch, write_atomically
from slurm_cdgpc.localcluster import LocalCluster
from slurm_cdgpc.localcluster import wait_for as _wait

pytestmark = pytest.mark.live

INTERVAL_S = 2.0
LEASE_S = 8.0
TOP_MHZ = 1410
OBJECTIVE_S = 0.25


@pytest.fixture
def site(tmp_path: Path) -> Iterator[LocalCluster]:
    site = LocalCluster.with_hmac(
        tmp_path, interval_s=INTERVAL_S, lease_s=LEASE_S, unavailable=pytest.skip
    )
    site.add_head(extra={"head": {"reconcile": False}})
    for name in ("node1", "node2"):
        node = site.add_node(name, gpu_type="A100-SXM4-80GB", gpus=2)
        site.start_agent(name, env={JOBS_DIR_ENV: str(node.jobs_dir)})
    yield site
    site.stop(timeout_s=10)


def _launch(site: LocalCluster, node: str, launch: Launch) -> None:
    jobs_dir = site.nodes[node].jobs_dir
    write_atomically(jobs_dir / f"{launch.job_id}{LAUNCH_SUFFIX}", launch.to_dict())


def test_a_serving_job_keeps_its_objective_below_its_top_clock(site: LocalCluster) -> None:
    # a request at p99 takes 4 forward passes: about 0.14 s at the top clock, against 0.25 s
    iteration_s = 0.035
    _launch(site, "node1", Launch("1", (0, 1), "bert", 10**7))
    _launch(site, "node2", Launch("2", (0,), "bloom-fwd", 10**9, iteration_s, 4.0))
    site.start_head()
    client = site.client()
    site.announce()
    client.post("/v1/budget", {"budget_w": 700.0, "reason": "live serving"})
    site.wait_reachable()
    training = {"job_id": "1", "user": "root", "node": "node1", "gpus": [0, 1]}
    client.post("/v1/jobs", {**training, "deadline_s": time.time() + 1800})
    serving = {"job_id": "2", "user": "root", "node": "node2", "gpus": [0]}
    client.post("/v1/jobs", {**serving, "slo_percentile": 99.0, "slo_latency_s": OBJECTIVE_S})
    _wait(
        "both jobs run",
        lambda: all(j["state"] == "running" for j in client.get("/v1/jobs")["jobs"]),
        20,
        site.logs,
    )
    seen: dict[int, dict[str, Any]] = {}
    until_s = time.time() + 24 * INTERVAL_S
    while time.time() < until_s:
        interval = client.get("/v1/status")["last_interval"]
        if interval is not None and interval["interval"] not in seen:
            jobs = {j["job_id"]: j for j in client.get("/v1/jobs")["jobs"]}
            seen[interval["interval"]] = {"status": interval, **jobs}
        time.sleep(0.2)
    rows = [seen[k] for k in sorted(seen)]
    served = [r["2"]["serving"] for r in rows if r["2"]["serving"] is not None]
    latencies = [s["latency_s"] for s in served if s["latency_s"] is not None]
    clocks = [r["2"]["graphics_mhz"] for r in rows if r["2"]["graphics_mhz"] is not None]
    assert latencies, site.logs()
    assert max(latencies) <= OBJECTIVE_S, (latencies, clocks)
    assert min(clocks) < TOP_MHZ and clocks[-1] < TOP_MHZ, clocks
    assert served[-1]["state"] == "met" and served[-1]["floor_mhz"] == clocks[-1], served[-1]
    assert any(r["status"]["status"] == "binding" for r in rows)
    table = site.admin("jobs")
    [line] = [row for row in table.splitlines() if row.split()[0] == "2"]
    assert "/250 ms, floor " in line and " met " in f" {line} ", table
    training_clocks = [r["1"]["graphics_mhz"] for r in rows if r["1"]["graphics_mhz"]]
    print(
        "serving clocks (MHz):",
        clocks,
        "\nlatencies (ms):",
        [round(1e3 * s, 1) for s in latencies],
        "\ntraining clocks (MHz):",
        training_clocks,
        "\nmeasured power (W):",
        [round(r["status"]["measured_power_w"] or 0) for r in rows],
        file=sys.stderr,
    )


def test_a_vllm_servers_own_histogram_reaches_the_head_through_the_scraper(
    site: LocalCluster,
) -> None:
    """A server that exports vLLM's time-per-output-token histogram (made by prometheus_client,
    as vLLM's is) on loopback, and ``cdgpc-progress --scrape`` beside it in the job: the p99 of
    each window reaches the head through the real agent, and the job's serving state says its
    objective holds. Every token here takes 120 ms: in the (0.1, 0.15] bucket, so the p99 that
    Prometheus interpolates is 0.1 + 0.05 × 0.99 = 0.1495 s."""
    registry = CollectorRegistry()
    tpot = Histogram(
        "vllm:time_per_output_token_seconds",
        "Histogram of time per output token in seconds.",
        ["model_name"],
        buckets=(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5),
        registry=registry,
    ).labels("llama")

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    site.start_head()
    client = site.client()
    site.announce()
    site.wait_reachable()
    job = {"job_id": "7", "user": "root", "node": "node1", "gpus": [0]}
    client.post("/v1/jobs", {**job, "slo_percentile": 99.0, "slo_latency_s": OBJECTIVE_S})
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    scraper = subprocess.Popen(
        [sys.executable, "-m", "slurm_cdgpc.agent.progress", "--scrape", url, "--every", "500ms"],
        env={
            **os.environ,
            "SLURM_JOB_ID": "7",
            "CDGPC_NODE_PROGRESS_SOCKET": str(site.nodes["node1"].progress_socket),
        },
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def served() -> dict[str, Any] | None:
            for _ in range(20):
                tpot.observe(0.12)
            [view] = [j for j in client.get("/v1/jobs")["jobs"] if j["job_id"] == "7"]
            serving = view["serving"]
            return serving if serving and serving["latency_s"] is not None else None

        state = _wait("the scraped latency at the head", served, 12 * INTERVAL_S, site.logs)
    finally:
        scraper.terminate()
        _, err = scraper.communicate(timeout=10)
        server.shutdown()
        server.server_close()
    assert state["latency_s"] == pytest.approx(0.1 + 0.05 * 0.99, rel=1e-3), state
    assert state["state"] == "met", state
    assert scraper.returncode == 0 and err == "", err
