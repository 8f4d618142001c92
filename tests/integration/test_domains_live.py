"""cdgpcd with a power-domain topology, and two cdgpc-noded processes (simulated GPUs running a
job on each GPU) on loopback, HMAC auth, SQLite: the rack both nodes are in holds its limit,
well under what their jobs draw at top clocks, while the cluster's budget does not bind; and a
bad topology file stops cdgpcd at start with one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from slurm_cdgpc.cli import admin
from slurm_cdgpc.gpu.workloads import JOBS_DIR_ENV, LAUNCH_SUFFIX, Launch, write_atomically
from slurm_cdgpc.localcluster import LocalCluster
from slurm_cdgpc.localcluster import wait_for as _wait
from slurm_cdgpc.transport.http import HeadClient

pytestmark = pytest.mark.live

INTERVAL_S = 1.0
LEASE_S = 4.0
BUDGET_W = 10_000.0  # four busy A100s draw about 1.5 kW at top clocks: it never binds
RACK_W = 1000.0
NODES = ("node1", "node2")
ADMIN = (sys.executable, "-c", "from slurm_cdgpc.cli.main import main; main()")


def _site(tmp_path: Path, topology: str) -> LocalCluster:
    site = LocalCluster.with_hmac(
        tmp_path, interval_s=INTERVAL_S, lease_s=LEASE_S, unavailable=pytest.skip
    )
    topology_file = tmp_path / "topology.toml"
    topology_file.write_text(topology)
    # the jobs are not this machine's Slurm's: no reconcile with squeue
    site.add_head(extra={"head": {"reconcile": False, "topology": str(topology_file)}})
    return site


@pytest.fixture
def site(tmp_path: Path) -> Iterator[LocalCluster]:
    """Both nodes in rack1 (a limit well under their draw), each running a job on its two
    GPUs; the agents run, the head does not yet."""
    site = _site(
        tmp_path, f'[[domain]]\nname = "rack1"\nlimit = "{RACK_W:g}W"\nnodes = "node[1-2]"\n'
    )
    try:
        for name in NODES:
            node = site.add_node(name, gpu_type="A100-SXM4-80GB", gpus=2)
            launch = Launch(f"{name[-1]}", (0, 1), "bert", 10**7)
            write_atomically(node.jobs_dir / f"{launch.job_id}{LAUNCH_SUFFIX}", launch.to_dict())
            site.start_agent(name, env={JOBS_DIR_ENV: str(node.jobs_dir)})
        yield site
    finally:
        site.stop(timeout_s=10)


def _rack(status: dict[str, Any]) -> dict[str, Any] | None:
    last = status["last_interval"]
    return None if last is None or not last["domains"] else last["domains"][0]


def _rack_held(client: HeadClient, limit_w: float) -> dict[str, Any] | None:
    """The status once every job runs and the rack holds ``limit_w``, drawn and planned (the
    jobs are measured: an unmeasured job counts at its limit, so until then the rack cannot
    fit and its jobs sit at the lowest clock); None before."""
    status = client.get("/v1/status")
    rack = _rack(status)
    jobs = client.get("/v1/jobs")["jobs"]
    held = (
        rack is not None
        and rack["limit_w"] == limit_w
        and rack["measured_w"] <= 1.01 * limit_w
        and rack["planned_w"] <= limit_w
    )
    return status if held and all(j["state"] == "running" for j in jobs) else None


def _after(client: HeadClient, k: int) -> dict[str, Any] | None:
    """The status of an interval after ``k``; None before."""
    status = client.get("/v1/status")
    return status if status["last_interval"]["interval"] > k else None


def test_a_rack_holds_its_limit_under_a_budget_that_does_not_bind(site: LocalCluster) -> None:
    head = site.start_head()
    client = site.client()
    site.announce()
    client.post("/v1/budget", {"budget_w": BUDGET_W, "reason": "live domains"})
    site.wait_reachable()

    def rack_over() -> dict[str, Any] | None:
        """A status whose rack measured its jobs at top clocks, far above the limit."""
        status = client.get("/v1/status")
        rack = _rack(status)
        return status if rack is not None and rack["measured_w"] > 1.2 * RACK_W else None

    _wait("the jobs draw over the rack's limit uncontrolled", rack_over, 10, site.logs)
    for job_id, node in (("1", "node1"), ("2", "node2")):
        client.post("/v1/jobs", {"job_id": job_id, "user": "root", "node": node, "gpus": [0, 1]})

    first = _wait("the rack within its limit", partial(_rack_held, client, RACK_W), 20, site.logs)

    # it stays there, interval after interval, while the cluster is far under its budget
    status = first
    for _ in range(3):
        k = status["last_interval"]["interval"]
        status = _wait("the next interval", partial(_after, client, k), 5, site.logs, watch=[head])
        last = status["last_interval"]
        rack = _rack(status)
        assert rack is not None and rack["name"] == "rack1" and rack["limit_w"] == RACK_W
        assert rack["measured_w"] <= 1.01 * RACK_W, status
        assert rack["planned_w"] <= RACK_W, status
        assert last["measured_power_w"] < 0.5 * BUDGET_W
        assert (last["status"], last["price"]) == ("slack", 0.0), status

    # cdgpc-admin shows the rack, as a person and a script read it
    runner = CliRunner()
    config = ["--config", str(site.head.config)]
    shown = runner.invoke(admin.status, config)
    assert shown.exit_code == 0, shown.output
    assert any(
        line.startswith("domain rack1: limit 1 kW, planned ") for line in shown.output.split("\n")
    )
    # two jobs, no over-draw measured yet: c/√2 of the budget held back
    assert "guard band:   2.12 % of the budget" in shown.output.split("\n"), shown.output
    offset = [line for line in shown.output.split("\n") if line.startswith("plan offset:  ")]
    assert len(offset) == 1 and " % (what settled jobs drew" in offset[0], shown.output
    budget = runner.invoke(admin.budget, ["show", "--json", *config])
    assert budget.exit_code == 0, budget.output
    assert json.loads(budget.output)["domains"] == [
        {
            "name": "rack1",
            "limit_w": RACK_W,
            "source": "file",
            "set": None,
            "file_limit_w": RACK_W,
            "scheduled": [],
        }
    ]


def _admin(*args: str) -> subprocess.CompletedProcess[str]:
    """``cdgpc-admin ARGS`` in a process of its own, as an admin types it."""
    return subprocess.run([*ADMIN, *args], capture_output=True, text=True, timeout=60, check=False)


def test_an_admin_lowers_the_racks_limit_and_its_power_follows(site: LocalCluster) -> None:
    """``cdgpc-admin budget set --domain rack1`` below the file's limit: within a few intervals
    the rack draws no more than the new limit (+1 %), and ``budget show`` says who set it."""
    head = site.start_head()
    client = site.client()
    site.announce()
    client.post("/v1/budget", {"budget_w": BUDGET_W, "reason": "live domains"})
    site.wait_reachable()
    for job_id, node in (("1", "node1"), ("2", "node2")):
        client.post("/v1/jobs", {"job_id": job_id, "user": "root", "node": node, "gpus": [0, 1]})
    _wait("the rack within its file's limit", partial(_rack_held, client, RACK_W), 20, site.logs)
    config = ("--config", str(site.head.config))

    refused = _admin("budget", "set", "--domain", "rack9", "500W", *config)
    assert (refused.returncode, refused.stderr) == (
        1,
        "Error: cdgpcd refused (400): unknown power domain 'rack9' (known: 'rack1')\n",
    )
    lowered_w = 0.7 * RACK_W
    done = _admin("budget", "set", "--domain", "rack1", "700W", "--reason", "breaker", *config)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("domain rack1: limit 700 W from "), done.stdout

    status = _wait(
        "the rack within its new limit",
        partial(_rack_held, client, lowered_w),
        8 * INTERVAL_S,
        site.logs,
        watch=[head],
    )
    for _ in range(3):  # and it stays there
        k = status["last_interval"]["interval"]
        status = _wait("the next interval", partial(_after, client, k), 5, site.logs, watch=[head])
        rack = _rack(status)
        assert rack is not None and rack["limit_w"] == lowered_w, status
        assert rack["measured_w"] <= 1.01 * lowered_w, status
        assert rack["planned_w"] <= lowered_w, status

    shown = _admin("budget", "show", "--json", *config)
    assert shown.returncode == 0, shown.stderr
    [rack1] = json.loads(shown.stdout)["domains"]
    assert (rack1["name"], rack1["limit_w"], rack1["source"], rack1["file_limit_w"]) == (
        "rack1",
        lowered_w,
        "set",
        RACK_W,
    )
    assert (rack1["set"]["set_by"], rack1["set"]["reason"]) == ("root", "breaker")
    assert json.loads(shown.stdout)["current"]["budget_w"] == BUDGET_W


def test_a_bad_topology_stops_cdgpcd_at_start_with_one_line(tmp_path: Path) -> None:
    site = _site(tmp_path, '[[domain]]\nname = "rack1"\nlimit = "-5W"\n')
    try:
        head = site.start_head(wait=False)
        assert head.proc.wait(timeout=30) == 2  # bad input
        errors = [line for line in head.text().splitlines() if line.startswith("Error: ")]
        assert len(errors) == 1 and "topology.toml" in errors[0] and "rack1" in errors[0], (
            head.text()
        )
    finally:
        site.stop(timeout_s=10)
