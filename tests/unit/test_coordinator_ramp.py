"""The head's ramp limits and emergency cut: a raised budget and a scheduled drop reach the GPUs
at the configured rate, and a limit broken between plans is cut in the same exchange round.

The clusters are `tests.unit.test_coordinator_daemon`'s: in-process agents on simulated GPUs,
one-second intervals on a manual clock.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from slurm_cdgpc.coordinator.api import status_dict
from slurm_cdgpc.coordinator.daemon import _wait
from slurm_cdgpc.topology import parse_topology
from tests.unit.test_coordinator_daemon import (
    A100,
    INTERVAL_S,
    T0_S,
    Cluster,
    MakeCluster,
    _two_busy_jobs,
    make_cluster,
    register_job,
)

__all__ = ["make_cluster"]  # the fixture, imported to be found

RATE_W_PER_S = 60.0  # a 600 W change takes ten one-second intervals


def _true_w(cluster: Cluster) -> float:
    return sum(cluster.gpu(n, i).true_power_w for n in cluster.agents for i in range(2))


def _busy(make_cluster: MakeCluster, budget_w: float, **kwargs: object) -> Cluster:
    """Jobs 1 (n1) and 2 (n2) training on both GPUs of their node, settled under ``budget_w``."""
    return _two_busy_jobs(make_cluster, budget_w, settle=8, **kwargs)


def test_a_raised_budget_reaches_the_gpus_no_faster_than_the_ramp(
    make_cluster: MakeCluster,
) -> None:
    cluster = _busy(make_cluster, 900.0, ramp_w_per_s=RATE_W_PER_S)
    before_w = _true_w(cluster)
    assert before_w <= 900.0 * 1.01
    cluster.store.set_budget(1500.0, "root")
    drawn = [before_w]
    for _ in range(12):
        report = cluster.tick()
        assert report.status != "infeasible"
        drawn.append(_true_w(cluster))
    rises = np.diff(drawn)
    # each step planned under what was drawn plus one interval at the rate (the models' error
    # and the guard band aside: a few watts)
    assert rises.max() <= RATE_W_PER_S * INTERVAL_S * 1.1, drawn
    assert drawn[-1] > before_w + 300.0, drawn  # and it got there, step by step
    assert (rises > 20.0).sum() >= 5, drawn


def test_without_a_ramp_the_raise_arrives_at_once(make_cluster: MakeCluster) -> None:
    cluster = _busy(make_cluster, 900.0)
    before_w = _true_w(cluster)
    cluster.store.set_budget(1500.0, "root")
    cluster.tick()
    assert _true_w(cluster) > before_w + 2 * RATE_W_PER_S * INTERVAL_S


def test_a_scheduled_drop_is_approached_at_the_rate_and_met_on_time(
    make_cluster: MakeCluster,
) -> None:
    cluster = _busy(make_cluster, 1500.0, ramp_w_per_s=RATE_W_PER_S)
    start_w = _true_w(cluster)
    assert start_w > 900.0 + 3 * RATE_W_PER_S * INTERVAL_S
    at_s = cluster.clock() + 12 * INTERVAL_S
    cluster.head.set_budget(900.0, "root", effective_at_s=at_s, reason="utility window")
    drawn = [start_w]
    while cluster.clock() < at_s + 2 * INTERVAL_S:
        cluster.tick()
        drawn.append(_true_w(cluster))
        if cluster.clock() >= at_s:  # the step running at the drop's time holds it
            assert drawn[-1] <= 900.0 * 1.01, drawn
    falls = -np.diff(drawn)
    # each plan falls by one interval at the rate; what the GPUs draw, by that and the
    # models' error on it
    assert falls.max() <= RATE_W_PER_S * INTERVAL_S * 1.25, drawn
    # it began to fall intervals before the drop: a step-down at its time would be larger
    assert drawn[-6] < start_w - 50.0, drawn
    assert cluster.head.last_cut is None  # met by the plan: no emergency


def test_a_limit_broken_between_plans_is_cut_in_the_same_round(
    make_cluster: MakeCluster,
) -> None:
    """A process outside any job starts on a GPU of n3 while the budget binds: the answers show the
    cluster over its budget, and before the next plan the job of lowest pressure (job 2, no
    deadline) goes to its lowest clocks, in an exchange with its node alone; the GPUs then draw
    under the budget again."""
    cluster = make_cluster(("n1", "n2", "n3"))
    for node in ("n1", "n2"):
        for index in (0, 1):
            cluster.gpu(node, index).attach("bert")
    budget_w = 1350.0
    cluster.store.set_budget(budget_w, "root")
    cluster.tick()
    register_job(cluster, "1", "n1", 0, 1)  # a deadline in an hour
    cluster.head.register_job("2", "bob", "n2", [0, 1])  # none
    for _ in range(8):
        cluster.tick()
    assert _true_w(cluster) <= budget_w * 1.01
    # (the jobs' first interval, at top clocks before they were planned, was cut too)
    cluster.head.last_cut = None
    registry = cluster.head.metrics.registry
    cuts_before = registry.get_sample_value("cdgpc_emergency_cuts_total", {"domain": "cluster"})

    cluster.gpu("n3", 0).attach("bert")  # outside the plan, seen only in the answers
    sent_before = len(cluster.transport.sent)
    cluster.tick()
    cut = cluster.head.last_cut
    assert cut is not None and cut.over == ("cluster",) and cut.jobs == ("2",)
    exchanges = cluster.transport.sent[sent_before:]
    assert len(exchanges) == 2 and set(exchanges[1]) == {"n2"}
    grid = cluster.head.grid
    lowest_mhz = int(grid.bottom_mhz(np.array([grid.type_index(A100)]))[0][0])
    assert [p.graphics_mhz for p in exchanges[1]["n2"].setpoints] == [lowest_mhz] * 2
    assert cluster.cap("n2", 0) == cluster.cap("n2", 1) == lowest_mhz
    assert cluster.cap("n1", 0) != lowest_mhz  # the job with a deadline keeps its clock
    cuts = registry.get_sample_value("cdgpc_emergency_cuts_total", {"domain": "cluster"})
    assert cuts == (cuts_before or 0.0) + 1
    # GET /v1/status and cdgpc-admin status say so
    shown = status_dict(cluster.head)["last_emergency_cut"]
    assert shown == {
        "time_s": cut.at_s,
        "over": ["cluster"],
        "jobs": ["2"],
        "exchange_s": cut.exchange_s,
    }
    assert _true_w(cluster) <= budget_w  # back under at once, before the next plan
    # the next plan takes job 2 back, with the new load counted outside it
    report = cluster.tick()
    assert report.uncontrolled_w > 300.0
    cluster.tick()
    assert _true_w(cluster) <= budget_w * 1.01


def test_a_budget_lowered_now_wakes_the_loop_at_once(make_cluster: MakeCluster) -> None:
    cluster = make_cluster()
    head = cluster.head
    head.set_budget(1000.0, "root", effective_at_s=T0_S + 3600.0)
    assert not head._urgent.is_set()  # scheduled: the loop meets it in its own time
    head.set_budget(800.0, "root")
    assert head._urgent.is_set() and head._replan.is_set()
    stop = threading.Event()
    began = time.monotonic()
    # woken at once, although the earliest out-of-cycle plan is a minute away
    assert _wait(stop, head._replan, began + 60.0, began + 60.0, head._urgent)
    assert time.monotonic() - began < 1.0


def test_a_rack_over_its_limit_cuts_only_jobs_under_it(make_cluster: MakeCluster) -> None:
    """The budget does not bind, rack1 (n1, n2; 800 W) does; a process outside any job starts
    on n2's idle GPU: job 2 (no deadline, in the rack) is cut, not job 3 (no deadline, outside
    it)."""
    topology = parse_topology('[[domain]]\nname = "rack1"\nlimit = "800W"\nnodes = "n[1-2]"\n')
    cluster = make_cluster(("n1", "n2", "n3"), topology=topology)
    for node in ("n1", "n2", "n3"):
        cluster.gpu(node, 0).attach("bert")
    cluster.store.set_budget(5000.0, "root")
    cluster.tick()
    register_job(cluster, "1", "n1", 0)  # a deadline in an hour
    cluster.head.register_job("2", "bob", "n2", [0])
    cluster.head.register_job("3", "bob", "n3", [0])
    for _ in range(8):
        cluster.tick()
    cluster.head.last_cut = None  # (the jobs' first interval, unplanned, was cut)

    cluster.gpu("n2", 1).attach("bert")
    cluster.tick()
    cut = cluster.head.last_cut
    # job 2 first; job 1 too where job 2's lowest clocks do not shed enough; never job 3
    assert cut is not None and cut.over == ("rack1",) and "2" in cut.jobs and "3" not in cut.jobs
    rack_w = sum(cluster.gpu(n, i).true_power_w for n in ("n1", "n2") for i in range(2))
    assert rack_w <= 800.0 * 1.01
