"""The guard rail under a model error: jobs whose GPUs draw 10 % more than the head's models.

A unit-level closed loop (the head's `Coordinator`, real `NodeAgent`s, simulated A100s that
hold a power limit as the firmware does, the JSON messages both ways: the harness of
``tests/unit/test_coordinator_daemon.py``), not live processes: what is under test is the
power the GPUs draw in the interval after their workloads change, which the live cluster's
seconds-long intervals would only make slower to see.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.unit.test_coordinator_daemon import (  # noqa: F401 (make_cluster: the fixture)
    T0_S,
    Cluster,
    MakeCluster,
    make_cluster,
)

pytestmark = [pytest.mark.faults]

BUDGET_W = 1000.0


def _register(cluster: Cluster, job_id: str, node: str, *gpus: int) -> None:
    """As the Prolog registers a job (its deadline an hour after the cluster's start)."""
    cluster.head.register_job(job_id, "alice", node, list(gpus), deadline_s=T0_S + 3600)


def _true_w(cluster: Cluster) -> float:
    """What the GPUs of both nodes really draw."""
    return sum(cluster.gpu(n, i).true_power_w for n in cluster.agents for i in range(2))


def _heavier(cluster: Cluster, factor: float) -> None:
    """Every job's workload draws more at the same clocks (a new phase of training)."""
    for node in cluster.agents:
        for index in (0, 1):
            gpu = cluster.gpu(node, index)
            calibration = gpu.workload
            assert calibration is not None
            gpu.attach(replace(calibration, activity=calibration.activity * factor))


def _worst_after_jump(make_cluster: MakeCluster, margin: float) -> float:  # noqa: F811
    cluster = make_cluster(power_limit_margin=margin)
    for node in ("n1", "n2"):
        for index in (0, 1):
            cluster.gpu(node, index).attach("bert")
    cluster.store.set_budget(BUDGET_W, "root")
    cluster.tick()
    _register(cluster, "1", "n1", 0, 1)
    _register(cluster, "2", "n2", 0, 1)
    for _ in range(8):
        cluster.tick()
    before_w = _true_w(cluster)
    assert before_w <= BUDGET_W * 1.01
    _heavier(cluster, 1.15)  # ≈ +10 % of the power at these clocks
    # the power drawn once the firmware had a second to act, before the head re-plans
    cluster.clock.advance(1.0)
    return _true_w(cluster) / BUDGET_W - 1.0


def test_the_rail_holds_a_model_error_until_the_head_replans(
    make_cluster: MakeCluster,  # noqa: F811
) -> None:
    off = _worst_after_jump(make_cluster, 0.0)
    on = _worst_after_jump(make_cluster, 0.02)
    assert off > 0.05  # without the rail the whole interval runs over the budget
    assert on < 0.03  # with it the GPUs hold their planned power times 1.02 (and a bit)
