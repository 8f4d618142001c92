"""cdgpcd and two cdgpc-noded processes (simulated A100s running jobs) on loopback, HMAC auth,
SQLite: a budget drop scheduled with ``cdgpc-admin budget set --at`` is approached at the
configured ramp and held from its time on; and a process outside any job that pushes the
cluster over its budget is cut in the same exchange round (the emergency path), measured from
the moment it starts to the interval the cluster draws under its budget again, against the
same site with the cut turned off.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_cdgpc.gpu.workloads import JOBS_DIR_ENV, LAUNCH_SUFFIX, Launch, write_atomically
from slurm_cdgpc.localcluster import LocalCluster
from slurm_cdgpc.localcluster import wait_for as _wait
from slurm_cdgpc.transport.http import HeadClient

pytestmark = pytest.mark.live

INTERVAL_S = 2.0
LEASE_S = 8.0
RAMP_W_PER_S = 50.0  # 100 W per interval
ADMIN = (sys.executable, "-c", "from slurm_cdgpc.cli.main import main; main()")


def _site(tmp_path: Path, control: dict[str, object]) -> LocalCluster:
    site = LocalCluster.with_hmac(
        tmp_path, interval_s=INTERVAL_S, lease_s=LEASE_S, unavailable=pytest.skip
    )
    # the jobs are not this machine's Slurm's: no reconcile with squeue
    site.add_head(extra={"head": {"reconcile": False}, "control": control})
    return site


def _launch(site: LocalCluster, node: str, job_id: str, gpus: tuple[int, ...]) -> None:
    launch = Launch(job_id, gpus, "bert", 10**7)
    jobs_dir = site.nodes[node].jobs_dir
    write_atomically(jobs_dir / f"{launch.job_id}{LAUNCH_SUFFIX}", launch.to_dict())


@pytest.fixture
def make_site(tmp_path: Path) -> Iterator[Any]:
    """A site whose node1 runs job 1 on both GPUs and node2 job 2 on GPU 0 (GPU 1 idle); the
    agents run, the head does not yet."""
    sites: list[LocalCluster] = []

    def make(**control: object) -> LocalCluster:
        home = tmp_path / f"site{len(sites)}"
        home.mkdir()
        site = _site(home, control)
        sites.append(site)
        for name in ("node1", "node2"):
            node = site.add_node(name, gpu_type="A100-SXM4-80GB", gpus=2)
            site.start_agent(name, env={JOBS_DIR_ENV: str(node.jobs_dir)})
        _launch(site, "node1", "1", (0, 1))
        _launch(site, "node2", "2", (0,))
        return site

    yield make
    for site in sites:
        site.stop(timeout_s=10)


def _running(site: LocalCluster, budget_w: float) -> HeadClient:
    """Start the head under ``budget_w`` and register jobs 1 (a deadline in an hour) and 2
    (none); returns a client once both run."""
    site.start_head()
    client = site.client()
    site.announce()
    client.post("/v1/budget", {"budget_w": budget_w, "reason": "live ramp"})
    site.wait_reachable()
    deadline_s = time.time() + 3600
    client.post(
        "/v1/jobs",
        {"job_id": "1", "user": "root", "node": "node1", "gpus": [0, 1], "deadline_s": deadline_s},
    )
    client.post("/v1/jobs", {"job_id": "2", "user": "root", "node": "node2", "gpus": [0]})
    _wait(
        "both jobs run",
        lambda: all(j["state"] == "running" for j in client.get("/v1/jobs")["jobs"]),
        20,
        site.logs,
    )
    return client


def _intervals(client: HeadClient, until_s: float) -> list[dict[str, Any]]:
    """Every interval's status from now until ``until_s`` (wall clock), one per interval."""
    seen: dict[int, dict[str, Any]] = {}
    while time.time() < until_s:
        last = client.get("/v1/status")["last_interval"]
        if last is not None:
            seen.setdefault(last["interval"], last)
        time.sleep(0.1)
    return [seen[k] for k in sorted(seen)]


def test_a_scheduled_budget_drop_is_approached_at_the_ramp_and_held(make_site: Any) -> None:
    site = make_site(ramp=f"{RAMP_W_PER_S:g}W/s")
    client = _running(site, 5000.0)  # three busy A100s draw about 1.1 kW: it does not bind
    _wait(
        "the jobs at top clocks, measured",
        lambda: client.get("/v1/status")["last_interval"]["measured_power_w"] > 900.0,
        20,
        site.logs,
    )
    start_w = client.get("/v1/status")["last_interval"]["measured_power_w"]
    target_w = start_w - 500.0  # five intervals of ramp
    at_s = time.time() + 20.0
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at_s))
    at_s = float(int(at_s))  # the time as written, to the second
    command = ("budget", "set", f"{target_w:.0f}W", "--at", when, "--reason", "utility")
    done = subprocess.run(
        [*ADMIN, *command, "--config", str(site.head.config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    intervals = _intervals(client, at_s + 5 * INTERVAL_S)
    drawn = [(i["time_s"], i["measured_power_w"]) for i in intervals]
    # the limit each plan was made under falls at the rate (over the time between the plans),
    # to the budget itself from the drop on
    caps = [
        (i["time_s"], i["budget_w"] if i["ramp_budget_w"] is None else i["ramp_budget_w"])
        for i in intervals
    ]
    ramped = [c for c in caps if c[1] < start_w]
    assert len(ramped) >= 4, caps  # approached over several intervals, not in one step
    for (t0, c0), (t1, c1) in itertools.pairwise(caps):
        assert c1 >= c0 - RAMP_W_PER_S * (t1 - t0) - 1.0, caps
    # the drawn power follows, but for the jobs' own swing (±25 W at top clocks) and the
    # models' error (a few percent of a 300 W GPU)
    steps = [b - a for (_, a), (_, b) in itertools.pairwise(drawn)]
    assert min(steps) >= -2.5 * RAMP_W_PER_S * INTERVAL_S, drawn
    before = [w for t, w in drawn if t <= at_s - 2 * INTERVAL_S]
    assert before[-1] < start_w - 2 * RAMP_W_PER_S * INTERVAL_S, drawn  # it fell ahead of time
    after = [w for t, w in drawn if t >= at_s + INTERVAL_S]  # intervals wholly after the drop
    assert after and max(after) <= 1.01 * target_w, (target_w, drawn)
    assert intervals[-1]["budget_w"] == pytest.approx(target_w, abs=1.0)
    assert "emergency" not in _head_log(site)  # met by the plan
    print(
        "drop to", round(target_w), "at +0 s:", [(round(t - at_s, 1), round(w)) for t, w in drawn]
    )


@pytest.mark.parametrize("emergency", [True, False], ids=["cut", "no-cut"])
def test_a_process_outside_the_plan_is_cut_in_the_same_round(
    make_site: Any, emergency: bool
) -> None:
    """The budget binds; a process no Prolog announced starts on node2's idle GPU. With the
    emergency cut, the answers that first show the cluster over its budget send job 2 (no
    deadline: the lowest pressure) to its lowest clocks at once, and job 1 too if that is not
    enough, and the next interval's answers show it under; without, the next plan counts the
    process, and the cluster is back under an interval or two after it was seen over."""
    budget_w = 800.0
    site = make_site(emergency=emergency)
    client = _running(site, budget_w)
    _wait(
        "the budget held",
        lambda: (
            (s := client.get("/v1/status")["last_interval"])["measured_power_w"] <= 1.01 * budget_w
            and s["status"] == "binding"
        ),
        30,
        site.logs,
    )
    time.sleep(3 * INTERVAL_S)  # settled
    event_s = time.time()
    _launch(site, "node2", "9", (1,))
    intervals = _intervals(client, event_s + 6 * INTERVAL_S)
    drawn = [(i["time_s"] - event_s, i["measured_power_w"]) for i in intervals]
    over = [t for t, w in drawn if t > 0 and w > 1.01 * budget_w]
    assert over, drawn  # the process pushed the cluster over
    back = [t for t, w in drawn if t > over[0] and w <= 1.01 * budget_w]
    assert back, drawn
    log = _head_log(site)
    if emergency:
        cuts = [line for line in log.splitlines() if "emergency: cluster" in line]
        assert cuts and "job 2" in cuts[-1], log[-3000:]
        print(cuts[-1])
        # the interval after the one that showed it over is under already
        assert back[0] <= over[0] + 1.5 * INTERVAL_S, drawn
    else:
        assert "emergency" not in log
        assert back[0] >= over[0] + 1.5 * INTERVAL_S, drawn
    print(f"emergency={emergency}: over at +{over[0]:.2f} s, back under at +{back[0]:.2f} s")


def _head_log(site: LocalCluster) -> str:
    daemon = site.head.daemon
    assert daemon is not None
    return daemon.text()
