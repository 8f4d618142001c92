"""The head's control loop against in-process node agents on simulated GPUs (no sockets).

Every exchange goes through the real `NodeAgent` and the JSON messages both ways, so a setpoint
the head gets wrong is refused or lands on the wrong GPU exactly as it would on a cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import Engine

from slurm_cdgpc.agent.node import NodeAgent
from slurm_cdgpc.agent.protocol import ExchangeRequest, ExchangeResponse, GpuReport
from slurm_cdgpc.config import SafeCap
from slurm_cdgpc.control.empc import ControllerSettings
from slurm_cdgpc.coordinator.daemon import Coordinator, CoordinatorSettings, IntervalReport
from slurm_cdgpc.gpu.catalog import CATALOG
from slurm_cdgpc.gpu.simulated import ManualClock, SimulatedGpu, simulated_gpus
from slurm_cdgpc.store import Store, make_engine, upgrade
from slurm_cdgpc.transport.http import NodeFailure, NodeTarget

T0_S = 1_767_225_600.0
INTERVAL_S = 1.0
LEASE_S = 5.0
A100 = "A100-SXM4-80GB"
A100_LIMIT_W = CATALOG[A100].power_limit.max_w
SAFE_MHZ = 840  # A100: highest level ≤ 0.6 · 1410 MHz


@dataclass
class FakeTransport:
    """Exchanges with in-process agents, through the JSON wire format; ``down`` nodes fail."""

    agents: Mapping[str, NodeAgent]
    down: set[str] = field(default_factory=set)
    sent: list[dict[str, ExchangeRequest]] = field(default_factory=list)

    def exchange(
        self, targets: Mapping[str, NodeTarget]
    ) -> dict[str, ExchangeResponse | NodeFailure]:
        self.sent.append({node: t.request for node, t in targets.items()})
        out: dict[str, ExchangeResponse | NodeFailure] = {}
        for node, target in targets.items():
            if node in self.down or node not in self.agents:
                out[node] = NodeFailure("connection refused")
                continue
            request = ExchangeRequest.from_json(target.request.to_json())
            out[node] = ExchangeResponse.from_json(self.agents[node].exchange(request).to_json())
        return out


@dataclass
class Cluster:
    clock: ManualClock
    agents: dict[str, NodeAgent]
    transport: FakeTransport
    store: Store
    settings: CoordinatorSettings
    head: Coordinator

    def tick(self) -> IntervalReport:
        """One interval: time moves, the agents' watchdogs run, the head runs an interval."""
        self.clock.advance(INTERVAL_S)
        for agent in self.agents.values():
            agent.tick()
        return self.head.run_interval()

    def restart_head(self) -> Coordinator:
        self.head = Coordinator(self.store, self.transport, self.settings, clock=self.clock)
        self.head.start()
        return self.head

    def gpu(self, node: str, index: int) -> SimulatedGpu:
        device = next(d for d in self.agents[node].gpus if d.index == index)
        assert isinstance(device, SimulatedGpu)
        return device

    def cap(self, node: str, index: int) -> int | None:
        locked = self.gpu(node, index).locked
        return None if locked is None else locked.graphics_max_mhz

    def last_requests(self) -> dict[str, ExchangeRequest]:
        return self.transport.sent[-1]


MakeCluster = Callable[..., Cluster]


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[MakeCluster]:
    engines: list[Engine] = []

    def make(nodes: tuple[str, ...] = ("n1", "n2"), *, shadow: bool = False) -> Cluster:
        clock = ManualClock(T0_S)
        agents = {
            name: NodeAgent(
                simulated_gpus(A100, 2, seed=i, time_source=clock),
                SafeCap(clock_fraction=0.6),
                tmp_path / f"{name}-state.json",
                clock,
                node_name=name,
                lease_duration_s=LEASE_S,
            )
            for i, name in enumerate(nodes)
        }
        engine = make_engine(f"sqlite:///{tmp_path / 'head.db'}")
        engines.append(engine)
        upgrade(engine)
        store = Store(engine, clock=clock)
        settings = CoordinatorSettings(
            interval_s=INTERVAL_S,
            lease_s=LEASE_S,
            shadow=shadow,
            controller=ControllerSettings(interval_s=INTERVAL_S),
        )
        transport = FakeTransport(agents)
        head = Coordinator(store, transport, settings, clock=clock)
        head.start()
        for name in nodes:
            head.register_node(name, f"http://{name}.test:8464")
        return Cluster(clock, agents, transport, store, settings, head)

    yield make
    for engine in engines:
        engine.dispose()


def _register(cluster: Cluster, job_id: str, node: str, *gpus: int) -> None:
    cluster.head.register_job(job_id, "alice", node, list(gpus), deadline_s=T0_S + 3600)


def _power(reports: tuple[GpuReport, ...]) -> float:
    return sum(r.power_w or 0.0 for r in reports)


def test_registered_job_gets_setpoints_on_its_gpus_in_the_next_interval(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster()
    cluster.store.set_budget(500.0, "root")
    cluster.tick()  # nodes report their GPUs
    _register(cluster, "7", "n2", 1)
    report = cluster.tick()
    requests = cluster.last_requests()
    assert requests["n1"].setpoints == ()
    [point] = requests["n2"].setpoints
    assert (point.gpu, point.job_id) == (1, "7")
    assert cluster.cap("n2", 1) == point.graphics_mhz
    assert [cluster.cap("n1", 0), cluster.cap("n1", 1), cluster.cap("n2", 0)] == [None] * 3
    assert report.setpoints_sent == 1 and [j.job_id for j in report.jobs if j.controlled] == ["7"]
    # every exchange renews the lease one lease duration ahead
    assert requests["n1"].lease_expires_s == pytest.approx(cluster.clock() + LEASE_S)
    [decision] = cluster.store.decisions()
    assert [s.job_id for s in decision.setpoints] == ["7"]
    assert cluster.store.job("7").state == "registered"
    cluster.tick()
    assert cluster.store.job("7").state == "running"  # measured under its setpoint
    assert cluster.store.decisions()[0].measured_power_w is not None


def test_budget_change_is_honoured_within_one_interval(make_cluster: MakeCluster) -> None:
    cluster = make_cluster()
    cluster.tick()
    _register(cluster, "1", "n1", 0, 1)
    _register(cluster, "2", "n2", 0, 1)
    cluster.store.set_budget(5000.0, "root")
    for _ in range(3):
        cluster.tick()
    high = [cluster.cap(n, i) for n in ("n1", "n2") for i in (0, 1)]
    cluster.head.set_budget(900.0, "root", reason="test")
    report = cluster.tick()
    low = [cluster.cap(n, i) for n in ("n1", "n2") for i in (0, 1)]
    assert report.budget_w == 900.0
    assert report.predicted_power_w is not None and report.predicted_power_w <= 900.0
    assert all(a is not None and b is not None and b < a for a, b in zip(high, low, strict=True))


def test_unreachable_node_counts_at_worst_case_and_its_jobs_leave(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster()
    cluster.store.set_budget(2000.0, "root")
    cluster.tick()
    _register(cluster, "1", "n1", 0, 1)
    _register(cluster, "2", "n2", 0)
    cluster.tick()
    before = cluster.tick()
    assert before.uncontrolled_w < A100_LIMIT_W  # one idle GPU at its measured power
    cluster.transport.down.add("n2")
    cluster.tick()  # the exchange with n2 fails
    report = cluster.tick()
    assert report.nodes_unreachable == 1
    assert report.uncontrolled_w == pytest.approx(2 * A100_LIMIT_W)  # never zero
    assert [j.job_id for j in report.jobs if j.controlled] == ["1"]
    assert report.predicted_power_w is not None
    assert report.predicted_power_w <= 2000.0 - 2 * A100_LIMIT_W
    cluster.transport.down.clear()
    cluster.tick()
    back = cluster.tick()
    assert sorted(j.job_id for j in back.jobs if j.controlled) == ["1", "2"]


def test_deregistered_job_gpus_are_released(make_cluster: MakeCluster) -> None:
    cluster = make_cluster()
    cluster.store.set_budget(600.0, "root")
    cluster.tick()
    _register(cluster, "3", "n1", 0, 1)
    cluster.tick()
    assert cluster.cap("n1", 0) is not None and cluster.cap("n1", 1) is not None
    assert cluster.head.deregister_job("3") is not None
    report = cluster.tick()
    assert cluster.last_requests()["n1"].release == (0, 1)
    assert [cluster.cap("n1", 0), cluster.cap("n1", 1)] == [None, None]
    assert report.status == "idle" and report.jobs == ()
    cluster.tick()
    assert cluster.last_requests()["n1"].release == ()  # released once
    assert cluster.head.deregister_job("999") is None


def test_restart_resumes_jobs_and_models_from_the_store(make_cluster: MakeCluster) -> None:
    cluster = make_cluster()
    cluster.store.set_budget(700.0, "root")
    cluster.tick()
    _register(cluster, "5", "n1", 0, 1)
    _register(cluster, "6", "n2", 0)
    for _ in range(6):
        cluster.tick()
    old = cluster.head
    theta = {
        j.job_id: old.running.estimator.power.theta[i].copy()
        for i, j in enumerate(old.running.jobs)
    }
    counts = dict(
        zip([j.job_id for j in old.running.jobs], old.running.estimator.power.count, strict=True)
    )
    assert min(counts.values()) > 0  # they learned something
    interval = old.interval
    head = cluster.restart_head()
    assert head.interval == interval
    report = cluster.tick()
    assert sorted(j.job_id for j in report.jobs if j.controlled) == ["5", "6"]
    assert report.interval == interval
    assert sorted(p.job_id for p in cluster.store.decisions()[-1].setpoints) == ["5", "6"]
    # the first interval after the restart learned once more from the stored models
    for i, job in enumerate(head.running.jobs):
        assert head.running.estimator.power.count[i] >= counts[job.job_id]
        assert np.allclose(head.running.estimator.power.theta[i], theta[job.job_id], rtol=0.2)


def test_shadow_mode_decides_and_records_but_sets_nothing(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(shadow=True)
    cluster.store.set_budget(400.0, "root")
    cluster.tick()
    _register(cluster, "8", "n1", 0, 1)
    for _ in range(3):
        report = cluster.tick()
    assert report.setpoints_sent == 0 and report.shadow
    assert all(r.setpoints == () and r.release == () for r in cluster.last_requests().values())
    assert [cluster.cap(n, i) for n in ("n1", "n2") for i in (0, 1)] == [None] * 4
    decisions = cluster.store.decisions()
    assert decisions and all(d.shadow for d in decisions)
    assert decisions[-1].setpoints[0].graphics_mhz < 1410  # the budget would bind
    # the lease stays renewed: the agents never fall to the safe cap while the head runs
    for _ in range(int(LEASE_S) + 2):
        cluster.tick()
    assert [cluster.cap(n, i) for n in ("n1", "n2") for i in (0, 1)] == [None] * 4


def test_agents_fall_to_the_safe_cap_when_the_head_stops(make_cluster: MakeCluster) -> None:
    cluster = make_cluster()
    cluster.store.set_budget(5000.0, "root")
    cluster.tick()
    _register(cluster, "4", "n1", 0)
    cluster.tick()
    assert cluster.cap("n1", 0) == 1410
    cluster.clock.advance(LEASE_S + 1)  # the head is gone
    for agent in cluster.agents.values():
        agent.tick()
    assert [cluster.cap(n, i) for n in ("n1", "n2") for i in (0, 1)] == [SAFE_MHZ] * 4


def test_job_on_unknown_node_waits_for_its_gpu_type(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(nodes=("n1",))
    cluster.store.set_budget(2000.0, "root")
    cluster.head.register_job("9", "bob", "n9", [0])  # no agent, never reported, no type
    report = cluster.tick()
    assert [(j.job_id, j.controlled) for j in report.jobs] == [("9", False)]
    nodes = {n.name: n for n in cluster.store.nodes()}
    assert nodes["n9"].url == "http://n9:8464" and not nodes["n9"].reachable


def test_reconcile_drops_jobs_slurm_no_longer_runs(make_cluster: MakeCluster) -> None:
    cluster = make_cluster()
    cluster.store.set_budget(600.0, "root")
    cluster.tick()
    _register(cluster, "11", "n1", 0)
    _register(cluster, "12", "n1", 1)
    cluster.tick()
    cluster.clock.advance(100.0)
    _register(cluster, "13", "n2", 0)  # just started: squeue may not list it yet
    # Slurm runs 12 only; 11's Epilog never arrived
    assert cluster.head.reconcile({"12"}, grace_s=30.0) == ["11"]
    assert cluster.store.job("11").state == "finished"
    assert cluster.store.job("12").state != "finished"
    assert cluster.store.job("13").state != "finished"
    cluster.tick()
    assert cluster.last_requests()["n1"].release == (0,)
