"""Faults injected into real processes on loopback: a frozen head, a frozen node agent.

The invariants: the cluster never stays above its budget longer than a lease; a head that is
away leaves every GPU at the safe cap, not at full speed; a node that does not answer is counted
at its worst case, never at zero; and control comes back without a person.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_head_live import (
    INTERVAL_S,
    LEASE_S,
    SAFE_MHZ,
    Site,
    _job,
    _wait,
    make_site,
)

pytestmark = [pytest.mark.faults, pytest.mark.live]


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    yield from make_site(tmp_path, f"sqlite:///{tmp_path / 'cdgpc.db'}")


def _running_job(site: Site) -> None:
    client = site.client()
    for node, port in site.agent_ports.items():
        client.post("/v1/nodes", {"node": node, "url": f"http://127.0.0.1:{port}"})
    client.post("/v1/budget", {"budget_w": 5000.0, "reason": "fault test"})
    client.post("/v1/jobs", {"job_id": "9", "user": "root", "node": "node1", "gpus": [0]})
    _wait("job 9 running", lambda: _job(client, "9")["state"] == "running", 8, site.logs)


def test_a_frozen_head_leaves_every_gpu_at_the_safe_cap_and_takes_over_again(site: Site) -> None:
    head = site.start_head()
    _running_job(site)
    controlled_mhz = site.locks("node1")[0]
    assert controlled_mhz > SAFE_MHZ  # a generous budget: the job runs near its top clock

    head.proc.send_signal(signal.SIGSTOP)  # frozen, not dead: its socket stays open
    frozen_s = time.monotonic()
    _wait(
        "safe cap on every GPU",
        lambda: all(site.locks(n) == {0: SAFE_MHZ, 1: SAFE_MHZ} for n in ("node1", "node2")),
        LEASE_S + 3,
        site.logs,
    )
    assert time.monotonic() - frozen_s < LEASE_S + 2.5

    head.proc.send_signal(signal.SIGCONT)
    _wait(
        "the job's own clock is back",
        lambda: site.locks("node1").get(0, SAFE_MHZ) > SAFE_MHZ,
        5,
        site.logs,
    )
    _wait("idle GPUs uncapped", lambda: site.locks("node2") == {}, 5, site.logs)


def test_a_frozen_agent_is_counted_at_its_worst_case_then_taken_back(site: Site) -> None:
    site.start_head()
    _running_job(site)
    client = site.client()
    node2 = next(p for p in site.procs if p.log.name.startswith("node2"))
    baseline_w = client.get("/v1/status")["last_interval"]["uncontrolled_w"]

    node2.proc.send_signal(signal.SIGSTOP)
    _wait(
        "node2 unreachable",
        lambda: client.get("/v1/status")["last_interval"]["nodes_unreachable"] == 1,
        10 * INTERVAL_S + 5,
        site.logs,
    )
    # from the next interval on, its two idle A100s count at their maximum power limit
    # (2 × 400 W) instead of the ≈ 60 W each they drew: never at zero, never at a stale reading
    assert baseline_w < 400.0
    _wait(
        "node2 counted at its worst case",
        lambda: client.get("/v1/status")["last_interval"]["uncontrolled_w"] >= 2 * 400.0,
        3 * INTERVAL_S + 2,
        site.logs,
    )
    [node] = [n for n in client.get("/v1/nodes")["nodes"] if n["name"] == "node2"]
    assert node["reachable"] is False

    node2.proc.send_signal(signal.SIGCONT)
    _wait(
        "node2 reachable again",
        lambda: client.get("/v1/status")["last_interval"]["nodes_unreachable"] == 0,
        10,
        site.logs,
    )
    assert site.locks("node1")[0] > 0  # the job stayed under control throughout
