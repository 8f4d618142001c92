"""Faults injected into real processes: the head, the agents, the network, the GPUs, the clock.

Every test runs the same small cluster (`tests.faults.cluster`: cdgpcd, two cdgpc-noded on
loopback or in network namespaces, training jobs on four simulated A100s under a 1200 W budget),
injects one fault while control is established, registers jobs during the fault the way the
Prolog and Epilog do (spooling what the head does not take), heals it, and checks the invariants
on an independent power meter:

- the cluster's true power is never above the budget by more than the guard band for longer
  than one lease;
- every registration sent reaches the store (directly, or through the spool once the head is back);
- no GPU stays locked once its job has ended;
- the daemons recover without a person: nothing is restarted by hand except a process the test
  killed, and control of both jobs comes back.

Database faults are in ``test_store_faults.py``; the wall-clock jumps in ``test_clock_faults.py``.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_cdgpc.localcluster import wait_for as _wait
from tests.faults.cluster import (
    INTERVAL_S,
    JOBS,
    LEASE_S,
    SAFE_MHZ,
    SLACK_S,
    Cluster,
    make_cluster,
    registrar,
)

pytestmark = [pytest.mark.faults, pytest.mark.live]

#: node2's three A100s at their maximum power limit: how the head must count it when it is away
NODE2_WORST_W = 3 * 400.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    yield from make_cluster(tmp_path, f"sqlite:///{tmp_path / 'cdgpc.db'}")


@pytest.fixture
def netns_cluster(tmp_path: Path) -> Iterator[Cluster]:
    yield from make_cluster(tmp_path, f"sqlite:///{tmp_path / 'cdgpc.db'}", netns=True)


def _all_at_safe_cap(cluster: Cluster, nodes: tuple[str, ...] = ("node1", "node2")) -> bool:
    return all(
        len(locks := cluster.locks(n)) == 3 and max(locks.values()) <= SAFE_MHZ for n in nodes
    )


def _counted_at_worst_case(cluster: Cluster) -> bool:
    last = cluster.status()["last_interval"]
    return bool(last["nodes_unreachable"] == 1 and last["uncontrolled_w"] >= NODE2_WORST_W)


def test_head_killed_and_restarted(cluster: Cluster) -> None:
    head = cluster.start_head()
    meter = cluster.establish()
    jobs = registrar(cluster)
    jobs.register(2)

    head.proc.kill()
    head.proc.wait(timeout=10)
    killed_s = time.monotonic()
    jobs.register(3)  # the head is gone: spooled
    assert len(jobs.spool.pending()) == 6
    _wait("every GPU at the safe cap", lambda: _all_at_safe_cap(cluster), LEASE_S + 4, cluster.logs)
    assert time.monotonic() - killed_s < LEASE_S + SLACK_S

    cluster.start_head()
    jobs.flush()
    _wait(
        "both jobs controlled again",
        lambda: all(cluster.controlled(n) for n in JOBS),
        10,
        cluster.logs,
    )
    _wait(
        "the lapse's caps lifted",
        lambda: all(cluster.locks(n).get(2) is None for n in JOBS),
        5,
        cluster.logs,
    )
    cluster.finish("head-sigkill", meter, jobs)


def test_head_frozen_past_the_lease(cluster: Cluster) -> None:
    head = cluster.start_head()
    meter = cluster.establish()
    jobs = registrar(cluster)

    head.proc.send_signal(signal.SIGSTOP)  # frozen, not dead: its socket stays open
    frozen_s = time.monotonic()
    jobs.register(2)  # the first times out and is spooled; the rest queue behind it
    _wait("every GPU at the safe cap", lambda: _all_at_safe_cap(cluster), LEASE_S + 5, cluster.logs)
    assert time.monotonic() - frozen_s < LEASE_S + jobs_timeout_s() + SLACK_S

    head.proc.send_signal(signal.SIGCONT)
    jobs.flush()
    _wait(
        "both jobs controlled again",
        lambda: all(cluster.controlled(n) for n in JOBS),
        10,
        cluster.logs,
    )
    cluster.finish("head-sigstop", meter, jobs)


def jobs_timeout_s() -> float:
    return 2.0  # Registrar's request timeout: the first request to a frozen head waits that long


def test_agent_killed_and_restarted(cluster: Cluster) -> None:
    cluster.start_head()
    meter = cluster.establish()
    jobs = registrar(cluster)
    node2 = cluster.nodes["node2"]
    assert node2.daemon is not None
    locked = cluster.locks("node2")

    node2.daemon.proc.kill()
    node2.daemon.proc.wait(timeout=10)
    jobs.register(2)
    _wait(
        "node2 counted at its worst case", lambda: _counted_at_worst_case(cluster), 10, cluster.logs
    )
    assert cluster.locks("node2") == locked  # the crash left the locks (and the state file)

    restarted = cluster.start_agent("node2")
    assert "stale state file" in restarted.text()
    _wait("job 102 controlled again", lambda: cluster.controlled("node2"), 10, cluster.logs)
    jobs.register(2)
    cluster.finish("agent-sigkill", meter, jobs)


def test_agent_frozen_is_counted_at_its_worst_case(cluster: Cluster) -> None:
    cluster.start_head()
    meter = cluster.establish()
    jobs = registrar(cluster)
    node2 = cluster.nodes["node2"]
    assert node2.daemon is not None

    node2.daemon.proc.send_signal(signal.SIGSTOP)
    _wait(
        "node2 counted at its worst case (3 × 400 W, never 0 or a stale reading)",
        lambda: _counted_at_worst_case(cluster),
        10 * INTERVAL_S + 5,
        cluster.logs,
    )
    jobs.register(2)
    node2.daemon.proc.send_signal(signal.SIGCONT)
    _wait(
        "node2 reachable again",
        lambda: cluster.status()["last_interval"]["nodes_unreachable"] == 0,
        10,
        cluster.logs,
    )
    _wait("job 102 controlled again", lambda: cluster.controlled("node2"), 10, cluster.logs)
    cluster.finish("agent-sigstop", meter, jobs)


def test_agent_partitioned_from_the_head(netns_cluster: Cluster) -> None:
    cluster = netns_cluster
    cluster.start_head()
    meter = cluster.establish()
    jobs = registrar(cluster)
    node2 = cluster.nodes["node2"]
    netns = cluster.netns["node2"]
    assert node2.daemon is not None

    netns.cut()
    cut_s = time.monotonic()
    _wait(
        "node2 counted at its worst case", lambda: _counted_at_worst_case(cluster), 10, cluster.logs
    )
    _wait(
        "node2's agent at the safe cap on its own",
        lambda: _all_at_safe_cap(cluster, ("node2",)),
        LEASE_S + 5,
        cluster.logs,
    )
    assert time.monotonic() - cut_s < LEASE_S + SLACK_S
    jobs.register(3)  # node1 and the head are fine: taken at once
    assert not jobs.spool.pending()
    assert cluster.controlled("node1")

    netns.heal()
    proc = node2.daemon
    _wait(
        "node2 takes the head's setpoints again",
        lambda: "controls the clocks again" in proc.text(),
        10,
        cluster.logs,
    )
    _wait("job 102 controlled again", lambda: cluster.controlled("node2"), 10, cluster.logs)
    cluster.finish("agent-partition", meter, jobs)


def test_agent_answering_slowly(cluster: Cluster) -> None:
    head = cluster.start_head()
    meter = cluster.establish()
    jobs = registrar(cluster)
    node2 = cluster.nodes["node2"]
    assert node2.daemon is not None
    slow = node2.daemon.proc

    start = cluster.status()["last_interval"]["interval"]
    started_s = time.monotonic()
    seen_worst = False
    # the agent runs 0.2 s of every 1.7 s: most exchanges outlast the per-node timeout (0.15 s)
    for _ in range(4):
        slow.send_signal(signal.SIGSTOP)
        time.sleep(1.5)
        seen_worst = seen_worst or _counted_at_worst_case(cluster)
        slow.send_signal(signal.SIGCONT)
        time.sleep(0.2)
    elapsed_s = time.monotonic() - started_s
    intervals = cluster.status()["last_interval"]["interval"] - start
    jobs.register(2)
    # the per-node timeout holds the interval: the head kept its pace (half of it, at least,
    # on a loaded machine); waiting for the slow node would make one interval per 1.7 s cycle,
    # under 30 % of it
    assert intervals >= 0.5 * elapsed_s / INTERVAL_S, (intervals, elapsed_s, head.text()[-3000:])
    assert seen_worst, "the slow node was never counted at its worst case"
    _wait("job 102 controlled again", lambda: cluster.controlled("node2"), 10, cluster.logs)
    cluster.finish("agent-slow", meter, jobs)


#: the budget cut while node1's GPU 1 refuses clock writes
CUT_W = 1200.0


def test_clock_writes_failing_on_one_gpu(cluster: Cluster) -> None:
    cluster.start_head()
    meter = cluster.establish(budget_w=1400.0)
    jobs = registrar(cluster)
    time.sleep(6 * INTERVAL_S)  # let the models settle at the generous budget

    def held_as_planned() -> bool:  # not the safe cap of a lease that lapsed as the head started
        job = cluster.job("101")
        return bool(job and job["controlled"] and cluster.locks("node1")[1] == job["graphics_mhz"])

    _wait("GPU 1 holds the head's setpoint", held_as_planned, 10, cluster.logs)
    high_mhz = cluster.locks("node1")[1]

    cluster.set_faults("node1", "1 fail_clock_writes\n")
    # GPU 1 stays at its clock (up to 367 W: the model may settle anywhere up to 1245 MHz under
    # 1400 W); job 102 goes no lower than 705 MHz (half the top clock, ≈ 200 W a GPU) and the
    # idle GPUs draw 60 W each. GPU 0 at the setpoint it took with the cut (up to ≈ 340 W) may
    # leave no room: then the head sends it to 705 MHz too, and ≈ 1090 W is the least this fault
    # allows, so the cut is to 1200 W (at 1000 W no head could stay within the budget). A head
    # that plans GPU 1 at the clock it refused, or holds GPU 0 where the cut left it, stays up to
    # 30-70 W over the budget for as long as the fault lasts
    cluster.client().post("/v1/budget", {"budget_w": CUT_W, "reason": "cut under a fault"})
    meter.budget_w = CUT_W
    proc = cluster.nodes["node1"].daemon
    assert proc is not None
    _wait("the refusal is logged", lambda: "setpoint refused" in proc.text(), 5, cluster.logs)
    assert cluster.locks("node1")[1] == high_mhz  # the write failed: the GPU kept its clock
    jobs.register(2)
    time.sleep(LEASE_S + 4 * INTERVAL_S)  # long enough for an overshoot to outlast a lease
    job = cluster.job("101")  # out of the plan, counted at what its GPUs draw
    assert job is not None and not job["controlled"], job

    cluster.set_faults("node1", "")
    _wait(
        "GPU 1 follows the head again",
        lambda: cluster.locks("node1")[1] < high_mhz,
        5,
        cluster.logs,
    )
    # the head hears of the refusal at the next exchange and plans around it at the one after
    # (measured: 0.86-0.96 s over, against 2.4-3.4 s when it planned GPU 1 at the refused clock
    # and learned the gap through the offset); the invariant asserted is the suite's: no longer
    # than a lease, and the job out of the plan (above) is what tells the two apart
    cluster.finish("gpu-clock-writes-fail", meter, jobs)


def test_gpus_reporting_garbage_power(cluster: Cluster) -> None:
    # node1's GPU 0 (job 101's) and node2's idle GPU 2 report NaN, 0, −1 W and 0xFFFFFFFF mW
    cluster.set_faults("node1", "0 garbage_power\n")
    cluster.set_faults("node2", "2 garbage_power\n")
    cluster.start_head()
    # node2's GPU 2 counts at 400 W instead of its 60: a budget that leaves the jobs room
    meter = cluster.establish(budget_w=1500.0)
    jobs = registrar(cluster)
    jobs.register(2)
    time.sleep(8 * INTERVAL_S)

    status = cluster.status()["last_interval"]
    # node2's GPU 2 has no believable reading: counted at its limit (400 W), never at 0 or −1 W;
    # node1's idle GPU 2 at its reading (≈ 60 W)
    assert status["uncontrolled_w"] >= 400.0 + 50.0, status
    assert 0 < status["measured_power_w"] < 3 * 400.0 + 200.0, status
    # job 101 learned from GPU 1 alone: its prediction is close to what its GPUs truly draw
    job = cluster.job("101")
    assert job is not None and job["controlled"] and job["predicted_power_w"] is not None
    true_w = 2 * meter._plant.busy_w(cluster.locks("node1").get(0))
    assert abs(job["predicted_power_w"] - true_w) < 0.15 * true_w, (job, true_w)
    cluster.finish("gpu-garbage-power", meter, jobs)


def test_release_refused_while_clock_writes_fail(cluster: Cluster) -> None:
    cluster.start_head()
    meter = cluster.establish()
    jobs = registrar(cluster)
    jobs.register(1)
    assert cluster.locks("node1").get(1)

    cluster.set_faults("node1", "1 fail_clock_writes\n")
    cluster.client().delete("/v1/jobs/101")  # the job ends while GPU 1 cannot be reset
    proc = cluster.nodes["node1"].daemon
    assert proc is not None
    _wait(
        "the failed reset is logged",
        lambda: "reset to default clocks failed" in proc.text(),
        5,
        cluster.logs,
    )
    time.sleep(4 * INTERVAL_S)
    cluster.set_faults("node1", "")  # the GPU works again: the release must still happen
    with cluster.failure_recorded("gpu-release-refused", meter, jobs, {"node1": (0, 1)}):
        _wait(
            "job 101's GPUs unlocked",
            lambda: not {0, 1} & set(cluster.locks("node1")),
            6,
            cluster.logs,
        )
    cluster.finish("gpu-release-refused", meter, jobs)
