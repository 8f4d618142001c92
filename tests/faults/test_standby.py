"""Two cdgpcd processes on one PostgreSQL store, two agents: the standby takes over, no split brain.

The active head is killed (``kill -9``) ten times in a row, each time by the head that took over
last, and a fresh standby is started in its place. The takeover time of each kill runs from the
instant just before the kill to the instant the test sees that every agent has accepted an
exchange carrying the new leader's epoch (the agents' state files, polled every 10 ms; the poll
can only overstate it). The claim: within two control intervals, plus slack for a loaded machine.

A leader paused (SIGSTOP) past its leader lease loses the lock to the standby. What it would
push if it had been paused right after its last successful check, its old epoch, is refused by
every agent (409) and changes no clock; woken (SIGCONT), it finds the lock gone, logs it and
exits non-zero without pushing again, while the new leader carries on.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_cdgpc.errors import CdgpcError
from slurm_cdgpc.localcluster import Daemon, LocalCluster
from slurm_cdgpc.localcluster import wait_for as _wait
from slurm_cdgpc.transport.http import EXCHANGE_PATH, HeadClient, HeadRefusedError
from slurm_cdgpc.wire.protocol import ExchangeRequest, Setpoint
from tests.evidence import record
from tests.integration import conftest as databases
from tests.integration.test_head_live import INTERVAL_S, LEASE_S, make_site

pytestmark = [pytest.mark.faults, pytest.mark.live, pytest.mark.postgres]

postgres_database = databases.postgres_database
postgres_url = databases.postgres_url

KILLS = 10
#: the leader lease the heads run with: the default, 1.5 control intervals (< LEASE_S)
LEADER_LEASE_S = 1.5 * INTERVAL_S
#: what a loaded 2-core machine may add to a takeover (process wake-up, store, exchange)
SLACK_S = 0.5
NODES = ("node1", "node2")


@pytest.fixture
def site(tmp_path: Path, postgres_url: str) -> Iterator[LocalCluster]:
    yield from make_site(tmp_path, postgres_url)


class Heads:
    """Head processes on the site's store, each on its own port (config ``head-<name>.toml``)."""

    def __init__(self, site: LocalCluster) -> None:
        self.site = site

    def start(self, name: str) -> Daemon:
        """Start head ``name`` and return once it is active or waiting as a standby (a standby
        does not listen)."""
        head = f"head-{name}"
        if head not in self.site.heads:
            self.site.add_head(head, store_url=self.site.head.store_url)
        return self.site.start_head(
            head, ready=lambda d: "standby:" in d.text() or "leader lock taken" in d.text()
        )

    def client(self, name: str) -> HeadClient:
        return self.site.client(f"head-{name}")

    def job(self, name: str, job_id: str) -> dict[str, Any] | None:
        return self.site.job(job_id, head=f"head-{name}")


def _epochs(site: LocalCluster) -> dict[str, int]:
    """The leader epoch each agent has accepted (from its state file)."""
    return {
        node: int(json.loads(site.nodes[node].state_file.read_text())["epoch"]) for node in NODES
    }


def _all_above(site: LocalCluster, epoch: int) -> bool:
    try:
        return min(_epochs(site).values()) > epoch
    except (OSError, ValueError, KeyError):
        return False


def _first_seen_above(site: LocalCluster, epoch: int, timeout_s: float) -> float:
    """When (``time.monotonic``) every agent had accepted an epoch above ``epoch``, polled every
    10 ms."""
    deadline = time.monotonic() + timeout_s
    while not _all_above(site, epoch):
        if time.monotonic() > deadline:
            pytest.fail(f"no epoch above {epoch} within {timeout_s:g} s\n{site.logs()}")
        time.sleep(0.01)
    return time.monotonic()


def _settled_epoch(site: LocalCluster) -> int:
    """The epoch every agent follows (waiting until they agree)."""
    found: list[int] = []

    def agreed() -> bool:
        epochs = set(_epochs(site).values())
        found[:] = epochs
        return len(epochs) == 1

    _wait("every agent follows the same head", agreed, 10, site.logs)
    return found[0]


def _leader(procs: dict[str, Daemon], epoch: int, site: LocalCluster) -> str:
    """The head that took the lock at ``epoch``."""
    names = [name for name, p in procs.items() if f"(epoch {epoch}, lease" in p.text()]
    if len(names) != 1:
        pytest.fail(f"epoch {epoch} taken by {names or 'no head'}\n{site.logs()}")
    return names[0]


def _running_job(heads: Heads, name: str) -> None:
    client = heads.client(name)
    _wait("the active head answers", lambda: client.get("/v1/health"), 20, heads.site.logs)
    heads.site.announce(f"head-{name}")
    client.post("/v1/budget", {"budget_w": 5000.0, "reason": "standby test"})
    client.post("/v1/jobs", {"job_id": "9", "user": "root", "node": "node1", "gpus": [0]})
    _wait(
        "job 9 running",
        lambda: (j := heads.job(name, "9")) and j["state"] == "running",
        10,
        heads.site.logs,
    )
    _wait("every agent follows a leader", lambda: _all_above(heads.site, 0), 5, heads.site.logs)


def test_kill_9_of_the_active_head_ten_times_the_standby_takes_over_each_time(
    site: LocalCluster,
) -> None:
    heads = Heads(site)
    procs = {"a": heads.start("a")}
    assert "leader lock taken" in procs["a"].text()
    procs["b"] = heads.start("b")
    assert "standby:" in procs["b"].text()
    _running_job(heads, "a")

    takeovers: list[float] = []
    epochs: list[int] = []
    for kill in range(KILLS):
        epochs.append(_settled_epoch(site))
        active = _leader(procs, epochs[-1], site)
        standby = "b" if active == "a" else "a"
        if procs[standby].proc.poll() is not None:
            # it lost the lock to the other one, which a loaded machine can make too slow to
            # renew in time, and stopped: start it again before the kill
            procs[standby] = heads.start(standby)
        assert "standby:" in procs[standby].text()
        killed_s = time.monotonic()
        procs[active].proc.kill()
        takeovers.append(_first_seen_above(site, epochs[-1], 10) - killed_s)
        procs[active].proc.wait(timeout=10)
        assert _leader(procs, _settled_epoch(site), site) == standby
        # the new leader resumed the job from the store, and controls it
        _wait(
            f"kill {kill + 1}: job 9 controlled by the new leader",
            lambda h=standby: (j := heads.job(h, "9")) and j["controlled"],
            10,
            site.logs,
        )
        assert 0 in site.locks("node1")
        procs[active] = heads.start(active)  # the killed one's replacement stands by

    record(
        "takeover",
        "standby-postgresql",
        kills=KILLS,
        takeover_s=[round(t, 3) for t in takeovers],
        interval_s=INTERVAL_S,
        leader_lease_s=LEADER_LEASE_S,
    )
    assert len(takeovers) == KILLS
    assert max(takeovers) <= 2 * INTERVAL_S + SLACK_S, takeovers
    assert epochs == sorted(set(epochs))  # a new, higher epoch at every takeover


def test_a_paused_leader_that_wakes_up_after_a_takeover_changes_nothing(
    site: LocalCluster,
) -> None:
    heads = Heads(site)
    old = heads.start("a")
    new = heads.start("b")
    _running_job(heads, "a")
    old_epoch = max(_epochs(site).values())

    old.proc.send_signal(signal.SIGSTOP)  # paused, not dead: it still believes it leads
    try:
        _wait(
            "the standby takes over",
            lambda: _all_above(site, old_epoch),
            LEADER_LEASE_S + 10,
            site.logs,
        )
        new_epoch = min(_epochs(site).values())
        _wait(
            "job 9 controlled by b",
            lambda: (j := heads.job("b", "9")) and j["controlled"],
            10,
            site.logs,
        )
        locks = {node: site.locks(node) for node in NODES}

        # what the old leader would push had it been paused right after its last check: its
        # epoch, a lower clock for job 9 and a release; signed with the cluster's key all the same
        for node, agent_node in site.nodes.items():
            stale = ExchangeRequest(
                interval=10**6,
                lease_expires_s=time.time() + LEASE_S,
                setpoints=(Setpoint(0, "9", 600),) if node == "node1" else (),
                release=(1,),
                epoch=old_epoch,
                node=node,
            )
            agent = HeadClient(agent_node.url, site.signer, peer=node, responder=node)
            with pytest.raises(HeadRefusedError) as refused:
                agent.post(EXCHANGE_PATH, json.loads(stale.to_json()))
            assert refused.value.status == 409
            assert f"leader epoch {old_epoch} is older than epoch {new_epoch}" in str(refused.value)
        assert {node: site.locks(node) for node in NODES} == locks
    finally:
        old.proc.send_signal(signal.SIGCONT)

    # woken, it renews before pushing, finds the lock gone, and stops with an error
    assert old.proc.wait(timeout=10) == 1
    assert f"lost the leader lock (epoch {old_epoch})" in old.text()
    assert f"holds it at epoch {new_epoch}" in old.text()
    time.sleep(3 * INTERVAL_S)  # the new leader carries on; the agents never went back
    assert new.proc.poll() is None and "lost the leader lock" not in new.text()
    assert _epochs(site) == dict.fromkeys(NODES, new_epoch)
    try:
        job = heads.job("b", "9")
        assert job is not None and job["controlled"]
    except CdgpcError as e:
        pytest.fail(f"the new leader stopped answering: {e}\n{site.logs()}")
    assert 0 in site.locks("node1")
