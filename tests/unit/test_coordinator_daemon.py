"""The head's control loop against in-process node agents on simulated GPUs (no sockets).

Every exchange goes through the real `NodeAgent` and the JSON messages both ways, so a setpoint
the head gets wrong is refused or lands on the wrong GPU exactly as it would on a cluster.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import numpy as np
import pytest
from sqlalchemy import Engine

from slurm_cdgpc.agent.node import NodeAgent
from slurm_cdgpc.config import SafeCap
from slurm_cdgpc.control.empc import ControllerSettings, Decision, QueueState
from slurm_cdgpc.control.limits import NewJobShare
from slurm_cdgpc.control.overdraw import ClusterDraw
from slurm_cdgpc.coordinator.daemon import Coordinator, CoordinatorSettings
from slurm_cdgpc.coordinator.jobs import GpuRef, GpuSample
from slurm_cdgpc.coordinator.reconcile import deregister_gone
from slurm_cdgpc.coordinator.report import IntervalReport, JobView
from slurm_cdgpc.gpu.catalog import CATALOG
from slurm_cdgpc.gpu.simulated import ManualClock, SimulatedGpu, simulated_gpus
from slurm_cdgpc.store import Node, Store, StoreError, make_engine, upgrade
from slurm_cdgpc.topology import Topology
from slurm_cdgpc.transport.http import NodeFailure, NodeTarget
from slurm_cdgpc.wire.protocol import ExchangeRequest, ExchangeResponse, GpuReport

T0_S = 1_767_225_600.0
INTERVAL_S = 1.0
LEASE_S = 5.0
A100 = "A100-SXM4-80GB"
H100 = "H100-SXM"
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
    topology: Topology | None = None
    #: the index in ``transport.sent`` of the last tick's first exchange (an emergency cut's
    #: may follow it)
    ticked_at: int = -1

    def tick(self) -> IntervalReport:
        """One interval: time moves, the agents' watchdogs run, the head runs an interval."""
        self.clock.advance(INTERVAL_S)
        for agent in self.agents.values():
            agent.tick()
        self.ticked_at = len(self.transport.sent)
        return self.head.run_interval()

    def restart_head(self) -> Coordinator:
        self.head = Coordinator(
            self.store, self.transport, self.settings, clock=self.clock, topology=self.topology
        )
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
        """The last interval's exchange (not an emergency cut's after it)."""
        sent = self.transport.sent
        return sent[self.ticked_at] if 0 <= self.ticked_at < len(sent) else sent[-1]


MakeCluster = Callable[..., Cluster]


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[MakeCluster]:
    engines: list[Engine] = []

    def make(
        nodes: tuple[str, ...] = ("n1", "n2"),
        *,
        shadow: bool = False,
        gpu_type: str = A100,
        agent_class: type[NodeAgent] = NodeAgent,
        power_limit_margin: float = CoordinatorSettings.power_limit_margin,
        topology: Topology | None = None,
        emergency: bool = True,
        ramp_w_per_s: float = ControllerSettings.ramp_w_per_s,
        new_job_power_share: float = ControllerSettings.new_job_power_share,
        new_job_power_quantile: float = ControllerSettings.new_job_power_quantile,
    ) -> Cluster:
        clock = ManualClock(T0_S)
        home = tmp_path / f"cluster{len(engines)}"  # one per cluster, and two in one test
        home.mkdir()
        agents = {
            name: agent_class(
                simulated_gpus(gpu_type, 2, seed=i, time_source=clock),
                SafeCap(clock_fraction=0.6),
                home / f"{name}-state.json",
                clock,
                node_name=name,
                lease_duration_s=LEASE_S,
            )
            for i, name in enumerate(nodes)
        }
        engine = make_engine(f"sqlite:///{home / 'head.db'}")
        engines.append(engine)
        upgrade(engine)
        store = Store(engine, clock=clock)
        settings = CoordinatorSettings(
            interval_s=INTERVAL_S,
            lease_s=LEASE_S,
            shadow=shadow,
            power_limit_margin=power_limit_margin,
            controller=ControllerSettings(
                interval_s=INTERVAL_S,
                emergency=emergency,
                ramp_w_per_s=ramp_w_per_s,
                new_job_power_share=new_job_power_share,
                new_job_power_quantile=new_job_power_quantile,
            ),
        )
        transport = FakeTransport(agents)
        head = Coordinator(store, transport, settings, clock=clock, topology=topology)
        head.start()
        for name in nodes:
            head.register_node(name, f"http://{name}.test:8464")
        return Cluster(clock, agents, transport, store, settings, head, topology)

    yield make
    for engine in engines:
        engine.dispose()


def register_job(cluster: Cluster, job_id: str, node: str, *gpus: int) -> None:
    cluster.head.register_job(job_id, "alice", node, list(gpus), deadline_s=T0_S + 3600)


def _power(reports: tuple[GpuReport, ...]) -> float:
    return sum(r.power_w or 0.0 for r in reports)


def test_registered_job_gets_setpoints_on_its_gpus_in_the_next_interval(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster()
    cluster.store.set_budget(500.0, "root")
    cluster.tick()  # nodes report their GPUs
    register_job(cluster, "7", "n2", 1)
    report = cluster.tick()
    requests = cluster.last_requests()
    assert {name: r.node for name, r in requests.items()} == {"n1": "n1", "n2": "n2"}
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


def test_each_interval_checkpoints_the_store_and_a_failed_checkpoint_costs_nothing_else(
    make_cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control loop checkpoints SQLite's log, not whichever commit fills it (often the
    API's event loop, committing registrations)."""
    cluster = make_cluster()
    calls: list[int] = []
    checkpoint = cluster.store.checkpoint

    def counted() -> None:
        calls.append(cluster.head.interval)
        if len(calls) == 2:
            raise StoreError("store checkpoint: disk I/O error")
        checkpoint()

    monkeypatch.setattr(cluster.store, "checkpoint", counted)
    cluster.tick()
    cluster.tick()  # its checkpoint fails: logged, and the interval is whole
    register_job(cluster, "7", "n1", 0)
    report = cluster.tick()
    assert calls == [0, 1, 2]
    assert [j.job_id for j in report.jobs if j.controlled] == ["7"]
    assert len(cluster.store.decisions()) >= 1


def test_budget_change_is_honoured_within_one_interval(make_cluster: MakeCluster) -> None:
    cluster = make_cluster()
    cluster.tick()
    register_job(cluster, "1", "n1", 0, 1)
    register_job(cluster, "2", "n2", 0, 1)
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


def test_the_report_says_the_offset_that_scaled_the_plan(make_cluster: MakeCluster) -> None:
    cluster = make_cluster()
    cluster.store.set_budget(900.0, "root")
    assert cluster.tick().offset is None  # no job: no plan
    register_job(cluster, "1", "n1", 0, 1)
    for _ in range(6):
        report = cluster.tick()
    assert report.offset is not None and report.offset == cluster.head.controller.offset
    assert report.to_dict()["offset"] == report.offset


def test_unreachable_node_counts_at_worst_case_and_its_jobs_leave(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster()
    cluster.store.set_budget(2000.0, "root")
    cluster.tick()
    register_job(cluster, "1", "n1", 0, 1)
    register_job(cluster, "2", "n2", 0)
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
    register_job(cluster, "3", "n1", 0, 1)
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
    register_job(cluster, "5", "n1", 0, 1)
    register_job(cluster, "6", "n2", 0)
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
    register_job(cluster, "8", "n1", 0, 1)
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
    register_job(cluster, "4", "n1", 0)
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
    assert cluster.head.roster.waiting_logged == {"9"}  # logged once while it waits ...
    cluster.head.deregister_job("9")
    cluster.tick()
    assert cluster.head.roster.waiting_logged == set()  # ... and forgotten when it ends


def test_reconcile_drops_jobs_slurm_no_longer_runs(make_cluster: MakeCluster) -> None:
    cluster = make_cluster()
    cluster.store.set_budget(600.0, "root")
    cluster.tick()
    register_job(cluster, "11", "n1", 0)
    register_job(cluster, "12", "n1", 1)
    cluster.tick()
    cluster.clock.advance(100.0)
    register_job(cluster, "13", "n2", 0)  # just started: squeue may not list it yet
    # Slurm runs 12 only; 11's Epilog never arrived
    assert deregister_gone(cluster.head, {"12"}, grace_s=30.0) == ["11"]
    assert cluster.store.job("11").state == "finished"
    assert cluster.store.job("12").state != "finished"
    assert cluster.store.job("13").state != "finished"
    cluster.tick()
    assert cluster.last_requests()["n1"].release == (0,)


# -- what the model learns from: the interval that ended, its mean power -----------------------


def _learned_error(head: Coordinator, truth: Mapping[int, float]) -> float:
    """The worst relative error of the job's power model (row 0) over the clocks it ran at."""
    estimator = head.running.estimator
    worst = 0.0
    for mhz, power_w in truth.items():
        x, x_m = estimator.normalise(np.array([float(mhz)]), np.array([float(H100_MEMORY_MHZ)]))
        predicted_w = float(estimator.predict_power_w(x, x_m)[0])
        worst = max(worst, abs(predicted_w - power_w) / power_w)
    return worst


H100_MEMORY_MHZ = 2619


class _ReadAfterApply(NodeAgent):
    """The agent as it was: it read the GPUs after applying the new setpoints."""

    def exchange(self, request: ExchangeRequest) -> ExchangeResponse:
        response = super().exchange(request)
        return replace(response, gpus=tuple(self._report(dev) for dev in self.gpus))


_Samples = Callable[
    [Mapping[GpuRef, tuple[str, ...]], bool, Mapping[GpuRef, tuple[str, ...]] | None],
    dict[str, list[GpuSample]],
]


def _samples_as_they_were(head: Coordinator) -> _Samples:
    """The head as it was: the last snapshot of each GPU holding the job's setpoint (of the
    jobs that held their GPUs since before the exchange, as `NodeBook.samples` is given)."""

    def samples(
        owners: Mapping[GpuRef, tuple[str, ...]],
        shadow: bool,
        left: Mapping[GpuRef, tuple[str, ...]] | None = None,
    ) -> dict[str, list[GpuSample]]:
        out: dict[str, list[GpuSample]] = {}
        for name, node in head.nodes.items():
            for r in node.reports if node.reachable else ():
                jobs = owners.get(GpuRef(name, r.index), ())
                if len(jobs) != 1 or r.power_w is None or r.sm_clock_mhz is None:
                    continue
                job_id = jobs[0]
                if r.job_id == job_id and r.memory_clock_mhz is not None:
                    ref = GpuRef(name, r.index)
                    sample = GpuSample(ref, r.power_w, r.sm_clock_mhz, r.memory_clock_mhz)
                    out.setdefault(job_id, []).append(sample)
        return out

    return samples


_BUDGETS_W: Final = (1400.0, 600.0, 1100.0, 700.0, 1300.0, 800.0, 1000.0, 650.0) * 3


def _hopper_run(cluster: Cluster) -> tuple[dict[int, float], int, list[tuple[float, float]]]:
    """Job 1 on both H100s of h1 under a budget that moves its clock every interval. Returns the
    true power per GPU at each clock it ran at, how often its clock changed, and per interval the
    power the head measured against the true mean power of the interval it describes."""
    for index in (0, 1):
        cluster.gpu("h1", index).attach("resnet50")
    cluster.tick()
    register_job(cluster, "1", "h1", 0, 1)
    truth: dict[int, float] = {}
    measured: list[tuple[float, float]] = []
    changes, previous_mhz = 0, None
    for budget_w in _BUDGETS_W:
        cluster.store.set_budget(budget_w, "root")
        cluster.clock.advance(INTERVAL_S)
        drawn_w = sum(cluster.gpu("h1", i).true_power_w for i in (0, 1))  # the interval's
        report = cluster.head.run_interval()
        measured.append((report.measured_power_w, drawn_w))
        gpu = cluster.gpu("h1", 0)
        mhz = gpu.read().sm_clock_mhz  # the clock the next interval runs at, and its power
        truth[mhz] = gpu.true_power_w
        changes += previous_mhz is not None and mhz != previous_mhz
        previous_mhz = mhz
    return truth, changes, measured[3:]  # from when the job's setpoints held a whole interval


def test_on_hopper_the_model_learns_each_clock_with_the_power_it_drew(
    make_cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """H100 power readings average the last second. The agent reads before it applies, so each
    sample pairs the clock of the interval that ended with that interval's power, from the
    energy counter; the agent and head as they were paired the new clock with a reading that
    still averaged the old clock's power, and learned a model several times further off.
    (No emergency cut: its first intervals overshoot budgets that move every interval, and
    the cut would hold the clock at its lowest, not move it.)"""
    cluster = make_cluster(("h1",), gpu_type=H100, emergency=False)
    truth, changes, measured = _hopper_run(cluster)
    assert changes >= 15  # the clock moved nearly every interval
    for measured_w, drawn_w in measured:  # the counter's mean is the interval's, exactly
        assert measured_w == pytest.approx(drawn_w, rel=1e-9)
    error = _learned_error(cluster.head, truth)

    before = make_cluster(("h1",), gpu_type=H100, agent_class=_ReadAfterApply, emergency=False)
    monkeypatch.setattr(before.head.nodes, "samples", _samples_as_they_were(before.head))
    truth_before, _, _ = _hopper_run(before)
    error_before = _learned_error(before.head, truth_before)
    # 5.2 %: what the three-parameter bent family can do over 990..1980 MHz (its worst, at
    # 990 MHz); the mismatched pairs put the model 58 % off at 990 MHz and 28 % at 1980 MHz
    assert error < 0.07, (error, error_before)
    assert error_before > 5 * error, (error, error_before)


def test_a_counter_that_did_not_rise_falls_back_to_the_reading(make_cluster: MakeCluster) -> None:
    """A driver reload resets the energy counter: that interval's power is the reading's own."""
    cluster = make_cluster(("h1",), gpu_type=H100)
    cluster.tick()
    cluster.tick()
    first = cluster.tick()
    idle_w = CATALOG[H100].idle_power_w
    assert first.measured_power_w == pytest.approx(2 * idle_w, rel=1e-9)  # the counter's mean
    cluster.gpu("h1", 0)._energy_j = 0.0  # what a driver reload does to the counter
    reset = cluster.tick()
    r0 = cluster.head.nodes["h1"].reports[0]
    assert r0.power_w is not None
    assert reset.measured_power_w == pytest.approx(r0.power_w + idle_w, rel=1e-9)
    assert cluster.head.nodes["h1"].mean_w == {1: pytest.approx(idle_w)}
    assert cluster.tick().measured_power_w == pytest.approx(2 * idle_w, rel=1e-9)


def test_a_lock_changed_during_the_interval_teaches_nothing(make_cluster: MakeCluster) -> None:
    """The Epilog resets a job's GPU between two exchanges: that interval ran at two settings,
    so it is neither learned from nor averaged from the energy counter."""
    cluster = make_cluster(("h1",), gpu_type=H100)
    cluster.store.set_budget(900.0, "root")
    for index in (0, 1):
        cluster.gpu("h1", index).attach("resnet50")
    cluster.tick()
    register_job(cluster, "1", "h1", 0, 1)
    cluster.tick()
    cluster.tick()
    assert set(cluster.head.samples) == {"1"}
    cluster.agents["h1"].release_job("1")  # between two exchanges
    cluster.tick()
    node = cluster.head.nodes["h1"]
    assert node.steady == frozenset() and node.mean_w == {}
    assert cluster.head.samples == {}


def test_a_node_that_missed_an_exchange_is_not_averaged_across_it(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster(("h1",), gpu_type=H100)
    cluster.tick()
    cluster.tick()
    assert cluster.head.nodes["h1"].mean_w.keys() == {0, 1}
    cluster.transport.down.add("h1")
    cluster.tick()
    cluster.transport.down.clear()
    back = cluster.tick()  # the first answer after the gap: its reading, no mean
    assert cluster.head.nodes["h1"].mean_w == {}
    assert back.measured_power_w == pytest.approx(
        sum(r.power_w or 0.0 for r in cluster.head.nodes["h1"].reports)
    )
    assert cluster.tick().uncontrolled_w > 0
    assert cluster.head.nodes["h1"].mean_w.keys() == {0, 1}


# -- progress: only root or the job's user, only from the job's nodes ---------------------------


def _iterations_done(cluster: Cluster, job_id: str) -> int:
    job = cluster.store.job(job_id)
    assert job is not None
    return job.iterations_done


def _some_user() -> pwd.struct_passwd:
    return next(p for p in pwd.getpwall() if p.pw_uid not in (0, os.getuid()))


def test_progress_counts_only_from_root_or_the_jobs_user_on_its_nodes(
    make_cluster: MakeCluster,
) -> None:
    owner = _some_user()
    cluster = make_cluster()
    cluster.tick()
    cluster.head.register_job("21", owner.pw_name, "n1", [0], iterations_total=1000)
    cluster.tick()
    n1, n2 = cluster.agents["n1"], cluster.agents["n2"]
    n1.record_progress("21", 900, 1000, uid=owner.pw_uid + 1)  # another user, on its node
    n2.record_progress("21", 800, 1000, uid=owner.pw_uid)  # its user, on another node
    cluster.tick()
    assert _iterations_done(cluster, "21") == 0
    n1.record_progress("21", 40, 1000, uid=owner.pw_uid)
    cluster.tick()
    assert _iterations_done(cluster, "21") == 40
    n1.record_progress("21", 55, 1000, uid=0)  # root may
    cluster.tick()
    assert _iterations_done(cluster, "21") == 55
    assert cluster.head.progress.refused_senders  # each refused sender is logged once ...
    cluster.head.deregister_job("21")
    cluster.tick()
    assert cluster.head.progress.refused_senders == set()  # ... and forgotten with the job


def test_a_node_no_request_can_name_is_unreachable_not_fatal(make_cluster: MakeCluster) -> None:
    """Every request names its node; a name no agent could carry costs that node, not the
    interval: the others are exchanged with, and it counts at its worst case."""
    cluster = make_cluster(("n1",))
    # the store refuses that name: the node book takes it as the store would hand it over
    bad = Node("bad name", "http://x.test:8464", "http", None, False, 0, A100, A100_LIMIT_W)
    cluster.head.nodes.load([bad])
    cluster.tick()
    report = cluster.tick()
    assert set(cluster.last_requests()) == {"n1"}
    assert (report.nodes_reachable, report.nodes_unreachable) == (1, 1)
    assert report.uncontrolled_w > A100_LIMIT_W  # n1's idle GPUs and the worst case


# -- refusals: a GPU that does not take its setpoint is never planned as if it did --------------


def _true_w(cluster: Cluster) -> float:
    return sum(cluster.gpu(n, i).true_power_w for n in cluster.agents for i in range(2))


def _two_busy_jobs(
    make_cluster: MakeCluster, budget_w: float = 1500.0, settle: int = 6, **kwargs: object
) -> Cluster:
    """Jobs 1 (n1) and 2 (n2) training on both GPUs of their node, settled under ``budget_w``
    for ``settle`` intervals (``kwargs``: the cluster's, to `make_cluster`)."""
    cluster = make_cluster(**kwargs)
    for node in ("n1", "n2"):
        for index in (0, 1):
            cluster.gpu(node, index).attach("bert")
    cluster.store.set_budget(budget_w, "root")
    cluster.tick()
    register_job(cluster, "1", "n1", 0, 1)
    register_job(cluster, "2", "n2", 0, 1)
    for _ in range(settle):
        cluster.tick()
    return cluster


def test_a_gpu_refusing_a_lower_clock_takes_its_job_out_of_the_plan(
    make_cluster: MakeCluster,
) -> None:
    """A clock write fails on one GPU while the budget drops: the head counts that job at its
    reported power, the other job absorbs the difference, and the refused setpoint is sent again
    until the GPU takes it; then the job rejoins the plan."""
    cluster = _two_busy_jobs(make_cluster)
    high_mhz = cluster.cap("n1", 1)
    assert high_mhz is not None
    stuck = cluster.gpu("n1", 1)
    stuck.fail_clock_writes = True
    cluster.head.set_budget(1200.0, "root", reason="cut under a fault")
    cluster.tick()  # job 1's new setpoint: GPU 0 takes it, GPU 1 refuses
    [refused] = [p for p in cluster.last_requests()["n1"].setpoints if p.gpu == 1]
    assert refused.graphics_mhz < high_mhz and cluster.cap("n1", 1) == high_mhz
    cluster.tick()  # job 1 leaves the plan (its readings: from before GPU 0 moved)
    assert cluster.last_requests()["n1"].setpoints == (refused,)  # sent again, alone
    reported = {r.index: r.power_w for r in cluster.head.nodes["n1"].reports}
    report = cluster.tick()
    assert [j.job_id for j in report.jobs if j.controlled] == ["2"]
    assert reported[1] is not None and reported[0] is not None
    # job 1's GPUs at their readings (GPU 1 still at its high clock), never at a planned clock
    assert report.uncontrolled_w == pytest.approx(reported[0] + reported[1])
    assert report.predicted_power_w is not None
    assert report.predicted_power_w + report.uncontrolled_w <= 1200.0
    for _ in range(3):
        cluster.tick()
        assert _true_w(cluster) <= 1200.0 * 1.01  # what the GPUs draw
    stuck.fail_clock_writes = False
    cluster.tick()  # the GPU takes the setpoint sent again
    assert cluster.cap("n1", 1) == refused.graphics_mhz
    back = cluster.tick()
    assert sorted(j.job_id for j in back.jobs if j.controlled) == ["1", "2"]
    assert cluster.head.locks.refusing == {}


def test_a_refusal_that_breaks_the_budget_sends_its_job_to_the_lowest_clock(
    make_cluster: MakeCluster,
) -> None:
    """The cut leaves no room for the GPU that refused it, even with the other job at its lowest
    clock: the held-out job's GPUs that still accept setpoints go to the lowest clock too (and the
    refusing one is asked for it), so the GPUs end within the budget; when the GPU accepts, the
    job rejoins the plan."""
    cluster = _two_busy_jobs(make_cluster)
    high_mhz = cluster.cap("n1", 1)
    assert high_mhz is not None and high_mhz > 1100  # ≈ 367 W: the cut has to move it
    stuck = cluster.gpu("n1", 1)
    stuck.fail_clock_writes = True
    # job 2 at the lowest supported clock and GPU 1 where it is leave 900 W only if GPU 0
    # goes to the lowest clock as well
    cluster.head.set_budget(900.0, "root", reason="cut under a fault")
    lowest_mhz = int(
        cluster.head.grid.bottom_mhz(np.array([cluster.head.grid.type_index(A100)]))[0][0]
    )
    for _ in range(5):
        cluster.tick()
    assert cluster.cap("n1", 0) == lowest_mhz and cluster.cap("n1", 1) == high_mhz
    [resent] = [p for p in cluster.last_requests()["n1"].setpoints if p.gpu == 1]
    assert resent.graphics_mhz == lowest_mhz
    report = cluster.tick()
    assert [j.job_id for j in report.jobs if j.controlled] == ["2"]
    for _ in range(3):
        cluster.tick()
        assert _true_w(cluster) <= 900.0 * 1.003
    stuck.fail_clock_writes = False
    cluster.tick()
    assert cluster.cap("n1", 1) == lowest_mhz
    back = cluster.tick()
    assert sorted(j.job_id for j in back.jobs if j.controlled) == ["1", "2"]
    assert cluster.head.locks.refusing == {} and cluster.head.locks.squeezed == set()


def test_a_refused_higher_clock_keeps_the_job_in_the_plan(make_cluster: MakeCluster) -> None:
    """A GPU that cannot be raised draws less than planned: safe, so the plan keeps its job."""
    cluster = make_cluster()
    cluster.gpu("n1", 0).attach("bert")
    cluster.store.set_budget(300.0, "root")
    cluster.tick()
    register_job(cluster, "1", "n1", 0)
    for _ in range(4):
        cluster.tick()
    low_mhz = cluster.cap("n1", 0)
    assert low_mhz is not None and low_mhz < 1410
    cluster.gpu("n1", 0).fail_clock_writes = True
    cluster.head.set_budget(5000.0, "root")
    cluster.tick()
    [point] = cluster.last_requests()["n1"].setpoints
    assert point.graphics_mhz > low_mhz and cluster.cap("n1", 0) == low_mhz
    report = cluster.tick()
    assert [j.job_id for j in report.jobs if j.controlled] == ["1"]
    assert cluster.head.locks.refusing == {}


def test_a_released_gpu_counts_at_its_limit_until_a_reading_after_the_release(
    make_cluster: MakeCluster,
) -> None:
    """A job's end puts its GPUs back at default clocks: the plan that releases them must not
    count them at their last (capped) reading, or the next job started there overshoots."""
    cluster = make_cluster(("n1",))
    for index in (0, 1):
        cluster.gpu("n1", index).attach("bert")
    cluster.store.set_budget(500.0, "root")
    cluster.tick()
    register_job(cluster, "1", "n1", 0)
    for _ in range(4):
        cluster.tick()
    assert cluster.cap("n1", 0) is not None
    cluster.head.deregister_job("1")
    idle_w = next(r.power_w for r in cluster.head.nodes["n1"].reports if r.index == 1)
    assert idle_w is not None
    releasing = cluster.tick()  # plans with GPU 0 at its limit, and releases it
    assert cluster.last_requests()["n1"].release == (0,)
    assert cluster.cap("n1", 0) is None
    assert releasing.uncontrolled_w == pytest.approx(A100_LIMIT_W + idle_w)
    after = cluster.tick()  # the readings were taken before the release took effect
    assert after.uncontrolled_w >= A100_LIMIT_W
    read_after = [r.power_w for r in cluster.head.nodes["n1"].reports]
    settled = cluster.tick()  # read after the release: the GPU at what it draws
    assert None not in read_after
    assert settled.uncontrolled_w == pytest.approx(sum(w for w in read_after if w is not None))
    assert cluster.head.locks.released == {}


def test_a_refused_release_is_sent_again_until_it_is_done(make_cluster: MakeCluster) -> None:
    cluster = make_cluster()
    cluster.store.set_budget(600.0, "root")
    cluster.tick()
    register_job(cluster, "3", "n1", 0, 1)
    cluster.tick()
    assert cluster.cap("n1", 1) is not None
    cluster.gpu("n1", 1).fail_clock_writes = True  # the reset will fail
    cluster.head.deregister_job("3")
    cluster.tick()
    assert cluster.last_requests()["n1"].release == (0, 1)
    assert cluster.cap("n1", 0) is None and cluster.cap("n1", 1) is not None
    for _ in range(2):
        cluster.tick()
        assert cluster.last_requests()["n1"].release == (1,)  # kept queued
    cluster.gpu("n1", 1).fail_clock_writes = False
    cluster.tick()
    assert cluster.cap("n1", 1) is None
    cluster.tick()
    assert cluster.last_requests()["n1"].release == ()  # done: not sent again


def test_a_node_never_reached_is_never_counted_at_zero(make_cluster: MakeCluster) -> None:
    """A job registered on a node the head has never reached, with no GPU type: the node's
    worst case is every GPU the job names at the largest power limit of the catalog, in the
    store and in the budget; so is a node announced without a type before its jobs came."""
    cluster = make_cluster(("n1",))
    cluster.store.set_budget(5000.0, "root")
    largest_w = max(s.power_limit.max_w for s in CATALOG.values())
    cluster.head.register_job("9", "bob", "n9", [0, 2])  # no agent, never reported, no type
    cluster.head.register_node("n8", "http://n8.test:8464")  # announced, no type
    cluster.head.register_job("10", "bob", "n8", [1])
    nodes = {n.name: n for n in cluster.store.nodes()}
    assert nodes["n9"].worst_case_power_w == 3 * largest_w
    cluster.tick()  # the exchanges with n8 and n9 fail
    n1_w = sum(r.power_w or 0.0 for r in cluster.head.nodes["n1"].reports)  # idle, read
    report = cluster.tick()
    assert report.nodes_unreachable == 2
    assert report.uncontrolled_w == pytest.approx(n1_w + 3 * largest_w + 2 * largest_w)


# -- the drain's input: Slurm's queue, the jobs' nodes and the free GPUs ---------------------


def test_the_head_hands_the_controller_slurms_queue_while_it_can_read_it(
    make_cluster: MakeCluster, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = make_cluster()
    cluster.store.set_budget(1500.0, "root")
    register_job(cluster, "1", "n1", 0)  # n1: one GPU free
    register_job(cluster, "2", "n2", 0, 1)  # n2: full
    for _ in range(3):
        cluster.tick()
    head = cluster.head
    seen: list[QueueState | None] = []
    step = head.controller.step

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(kwargs.get("queue"))  # type: ignore[arg-type]
        return step(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(head.controller, "step", spy)
    cluster.tick()
    assert seen[-1] is None  # never read: the drain is off
    head.observe_queue(True)
    with caplog.at_level("INFO", logger="slurm_cdgpc.coordinator.daemon"):
        cluster.tick()
        cluster.tick()
    queue = seen[-1]
    assert queue is not None and queue.waiting
    rows = {info.job_id: row for row, info in enumerate(head.running.jobs)}
    nodes = list(head.nodes)
    pairs = {(int(r), nodes[int(n)]) for r, n in zip(queue.job_row, queue.job_node, strict=True)}
    assert pairs == {(rows["1"], "n1"), (rows["2"], "n2")}
    assert dict(zip(nodes, queue.free_gpus.tolist(), strict=True)) == {"n1": 1, "n2": 0}
    assert sum("the drain is on" in r.message for r in caplog.records) == 1  # said once
    head.observe_queue(False)  # nothing waits: nothing to drain
    cluster.tick()
    assert seen[-1] is None
    head.observe_queue(None)  # squeue failed: off, said once
    with caplog.at_level("INFO", logger="slurm_cdgpc.coordinator.daemon"):
        cluster.tick()
        cluster.tick()
    assert seen[-1] is None
    assert sum("the drain is off" in r.message for r in caplog.records) == 1
    # a read older than queue_stale_s counts as none
    head.observe_queue(True)
    cluster.tick()
    assert seen[-1] is not None
    monkeypatch.setattr(
        "slurm_cdgpc.coordinator.daemon.time.monotonic",
        lambda: 1e9,
    )
    cluster.tick()
    assert seen[-1] is None


def test_a_registration_is_planned_out_of_cycle_not_an_interval_later(
    make_cluster: MakeCluster,
) -> None:
    import threading  # noqa: PLC0415
    import time  # noqa: PLC0415

    cluster = make_cluster()
    cluster.store.set_budget(1500.0, "root")
    head = cluster.head
    # a long period: only a registration can bring the next interval within the test
    head.settings = replace(head.settings, interval_s=60.0, replan_gap_s=0.05)
    stop = threading.Event()
    loop = threading.Thread(target=head.run, args=(stop,), daemon=True)
    loop.start()
    try:
        deadline = time.monotonic() + 5.0
        while head.interval < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        first = head.interval
        time.sleep(0.2)
        assert head.interval == first  # the period is long: nothing until a registration
        t0 = time.monotonic()
        register_job(cluster, "1", "n1", 0, 1)
        while head.interval == first and time.monotonic() - t0 < 5.0:
            time.sleep(0.01)
        assert head.interval == first + 1
        assert time.monotonic() - t0 < 2.0  # out of cycle, not 60 s later
        report = head.last_report
        assert report is not None and [j.job_id for j in report.jobs] == ["1"]
    finally:
        stop.set()
        loop.join(timeout=5.0)
    assert not loop.is_alive()  # stop wakes the loop at once


def _view(report: IntervalReport, job_id: str) -> JobView:
    return next(v for v in report.jobs if v.job_id == job_id)


def test_a_job_that_says_no_total_is_bounded_by_its_time_limit(make_cluster: MakeCluster) -> None:
    cluster = make_cluster()
    cluster.store.set_budget(2000.0, "root")
    cluster.tick()
    hour = 3600.0
    # started an hour ago with a 4 h limit and a deadline 5 h away: at most 3 h of work left
    cluster.head.register_job(
        "31",
        "alice",
        "n1",
        [0],
        deadline_s=T0_S + 5 * hour,
        time_limit_s=4 * hour,
        started_at_s=cluster.clock() - hour,
    )
    cluster.head.register_job("32", "alice", "n2", [0], deadline_s=T0_S + 5 * hour)
    report = cluster.tick()
    limited, unlimited = _view(report, "31"), _view(report, "32")
    assert cluster.store.job("31").work_source == "time-limit"
    assert cluster.store.job("32").work_source == "none"
    assert limited.progress == unlimited.progress == "none"
    assert limited.left_top_s == pytest.approx(3 * hour, rel=1e-3)
    assert limited.finish_s is not None and limited.finish_s >= cluster.clock() + 3 * hour - 5
    assert unlimited.left_top_s is None and unlimited.finish_s is None
    state = cluster.head.running.job_state()
    w = cluster.head.controller.weights(cluster.head.running.estimator, state, cluster.clock())
    one = np.ones(2)
    pressure = w[0] * cluster.head.running.estimator.predict_iteration_s(one, one)
    rows = [j.job_id for j in cluster.head.running.jobs]
    assert pressure[rows.index("31")] == pytest.approx(0.6, rel=0.01)  # 3 h over 5 h
    assert pressure[rows.index("32")] == pytest.approx(1.0)  # nothing known: just in time
    # Slurm raises the limit (scontrol update): the same controller row takes the new bound
    for _ in range(4):
        cluster.tick()
    learned = int(cluster.head.running.estimator.power.count[rows.index("31")])
    assert learned > 0
    cluster.store.record_time_limit("31", 8 * hour, cluster.clock() - hour)
    report = cluster.tick()
    assert _view(report, "31").left_top_s == pytest.approx(7 * hour, rel=1e-3)
    # ... and keeps what its models learned
    assert cluster.head.running.estimator.power.count[rows.index("31")] == learned + 1


def test_the_comment_total_wins_and_one_node_reports_a_jobs_progress(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster()
    cluster.tick()
    cluster.head.register_job("41", "root", "n1", [0], iterations_total=1000)
    cluster.head.register_job("41", "root", "n2", [1], iterations_total=1000)
    cluster.head.register_job("42", "root", "n1", [1])
    cluster.tick()
    n1, n2 = cluster.agents["n1"], cluster.agents["n2"]
    n2.record_progress("41", 30, 5000, uid=0)  # a framework's total: the comment's wins
    n2.record_progress("42", 10, 900, uid=0)  # a node where 42 has no GPU: refused
    n1.record_progress("42", 10, 900, uid=0)
    report = cluster.tick()
    assert cluster.store.job("41").iterations_total == 1000
    assert cluster.store.job("41").work_source == "comment"
    assert cluster.store.job("42").iterations_total == 900
    assert cluster.store.job("42").work_source == "framework"
    assert _view(report, "41").progress == "reported"
    n1.record_progress("41", 99, 1000, uid=0)  # n2 reported first: only its steps count
    n2.record_progress("41", 40, 1000, uid=0)
    cluster.tick()
    assert _iterations_done(cluster, "41") == 40


@pytest.mark.parametrize("margin", [0.0, 0.05])
def test_setpoints_carry_the_guard_rail_when_its_margin_is_above_zero(
    make_cluster: MakeCluster, margin: float
) -> None:
    """Each GPU of a controlled job gets its share of the job's planned power times
    (1 + margin) as its power limit; with the margin at 0 no setpoint carries one and the
    boards keep their default limits."""
    cluster = make_cluster(power_limit_margin=margin)
    for index in (0, 1):
        cluster.gpu("n1", index).attach("bert")
    cluster.gpu("n2", 0).attach("resnet50")
    cluster.store.set_budget(900.0, "root")
    cluster.tick()
    register_job(cluster, "1", "n1", 0, 1)
    register_job(cluster, "2", "n2", 0)
    decisions: list[Decision] = []
    step = cluster.head.controller.step

    def recorded(*args: Any, **kwargs: Any) -> Decision:
        decisions.append(step(*args, **kwargs))
        return decisions[-1]

    cluster.head.controller.step = recorded  # type: ignore[method-assign]
    for _ in range(6):
        cluster.tick()
    decision = decisions[-1]
    planned = dict(
        zip((j.job_id for j in cluster.head.running.jobs), decision.job_power_w, strict=True)
    )
    points = [p for r in cluster.last_requests().values() for p in r.setpoints]
    assert len(points) == 3
    for node, index, job, gpus in (("n1", 0, "1", 2), ("n1", 1, "1", 2), ("n2", 0, "2", 1)):
        [point] = [p for p in cluster.last_requests()[node].setpoints if p.gpu == index]
        gpu = cluster.gpu(node, index)
        if margin == 0:
            assert point.power_limit_w is None and gpu.power_limit_set_w is None
            assert gpu.enforced_limit_w == A100_LIMIT_W
            continue
        expected_w = planned[job] / gpus * (1 + margin)
        assert point.power_limit_w == pytest.approx(expected_w, abs=1e-3)
        assert gpu.power_limit_set_w == pytest.approx(expected_w, abs=1e-3)
        assert gpu.enforced_limit_w < A100_LIMIT_W


def test_a_new_job_is_held_at_its_share_of_the_limit_until_measured(
    make_cluster: MakeCluster,
) -> None:
    """With ``new_job_power_share`` 0.6 a new job's GPUs get 240 W (0.6 of an A100's 400 W)
    with its first setpoints, the agent sets it, the head's status does not take its own limit
    for another limiter's, and once the job's model has readings the limit goes back to the
    board's default."""
    cluster = make_cluster(new_job_power_share=0.6, new_job_power_quantile=1.0)
    cluster.gpu("n1", 0).attach("bert")
    cluster.store.set_budget(900.0, "root")
    cluster.tick()
    register_job(cluster, "1", "n1", 0)
    seen: list[float | None] = []
    for _ in range(6):
        report = cluster.tick()
        [point] = cluster.last_requests()["n1"].setpoints
        seen.append(point.power_limit_w)
        assert report.limited == ()
        if point.power_limit_w is not None:
            assert cluster.gpu("n1", 0).power_limit_set_w == pytest.approx(240.0)
    assert seen[0] == pytest.approx(240.0)
    held = [w for w in seen if w is not None]
    assert held == pytest.approx([240.0] * len(held)) and len(held) <= 3
    assert seen[-1] is None and cluster.gpu("n1", 0).power_limit_set_w is None
    assert cluster.gpu("n1", 0).enforced_limit_w == A100_LIMIT_W


def test_the_head_learns_a_new_jobs_count_from_its_agents_first_readings(
    make_cluster: MakeCluster,
) -> None:
    """With ``new_job_power_quantile`` the head learns the share from what its agents read
    (the SM clock at its lock, the GPU's power, no power-cap throttle): the next new job is
    counted at it, not at 400 W, and no limit holds it."""
    cluster = make_cluster(new_job_power_quantile=0.9)
    head = cluster.head
    head.controller.new_share = NewJobShare(1.0, 0.9, min_jobs=2)  # 20 in production
    for node in ("n1", "n2"):
        cluster.gpu(node, 0).attach("ncf")
    cluster.store.set_budget(5000.0, "root")
    cluster.tick()
    register_job(cluster, "1", "n1", 0)
    register_job(cluster, "2", "n2", 0)
    for _ in range(5):
        report = cluster.tick()
    drew = [_view(report, j).measured_power_w for j in ("1", "2")]
    assert all(w is not None and 50.0 < w < 0.5 * A100_LIMIT_W for w in drew)  # NCF: ~74 W
    [share] = head.controller.new_share.learned().values()
    assert share * A100_LIMIT_W == pytest.approx(max(w for w in drew if w is not None), rel=0.1)
    cluster.gpu("n1", 1).attach("ncf")
    register_job(cluster, "3", "n1", 1)
    report = cluster.tick()
    assert _view(report, "3").predicted_power_w == pytest.approx(share * A100_LIMIT_W)
    assert all(p.power_limit_w is None for p in cluster.last_requests()["n1"].setpoints)


def test_status_names_the_gpus_another_limiter_holds(make_cluster: MakeCluster) -> None:
    cluster = make_cluster()
    cluster.tick()
    assert cluster.tick().limited == ()
    cluster.gpu("n1", 1).set_external_power_cap_w(150.0)  # a BMC cap, an admin's nvidia-smi -pl
    cluster.gpu("n2", 0).power_brake = True
    report = cluster.tick()
    assert report.limited == (
        "n1:1: enforced power limit 150 W, below its default 400 W",
        "n2:0: power brake (an external power-brake signal)",
    )
    assert report.to_dict()["limited"] == list(report.limited)


def test_a_gpu_held_for_a_job_that_ended_while_the_head_was_away_is_released(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster()
    cluster.tick()
    register_job(cluster, "81", "n1", 0)
    cluster.tick()
    cluster.tick()
    assert cluster.cap("n1", 0) is not None  # the agent holds GPU 0 for job 81
    cluster.store.finish_job("81")  # its Epilog reached the store, the release never the agent
    cluster.restart_head()  # a head that never knew job 81
    cluster.tick()  # it sees the orphan lock ...
    cluster.tick()  # ... and releases it
    assert cluster.cap("n1", 0) is None
    register_job(cluster, "82", "n2", 1)  # a job the store knows as active is never touched
    cluster.tick()
    cluster.tick()
    assert cluster.cap("n2", 1) is not None


def test_a_gpu_two_jobs_share_is_released_only_when_the_last_one_ends(
    make_cluster: MakeCluster,
) -> None:
    """Jobs 1 and 2 on n1's GPU 0 (shards: one physical GPU): both are controlled, as its
    tenants, with one setpoint for the GPU naming the other. When job 1 ends, the head sends
    no release for the GPU and job 2 keeps it; when job 2 ends, the GPU is released."""
    cluster = make_cluster()
    cluster.gpu("n1", 0).attach("bert")
    cluster.store.set_budget(1500.0, "root")
    cluster.tick()
    register_job(cluster, "1", "n1", 0)
    register_job(cluster, "2", "n1", 0)
    cluster.agents["n1"].hold_job("2", [0])  # job 2's Prolog
    for _ in range(3):
        report = cluster.tick()
    assert [j.job_id for j in report.jobs if j.controlled] == ["1", "2"]
    [point] = cluster.last_requests()["n1"].setpoints
    assert (point.gpu, point.job_id, point.tenants) == (0, "1", ("2",))
    views = {v.job_id: v for v in report.jobs}
    assert views["1"].graphics_mhz == views["2"].graphics_mhz
    assert views["1"].shares_with == ("2",) and views["2"].shares_with == ("1",)
    cluster.head.deregister_job("1")
    cluster.agents["n1"].release_job("1")  # job 1's Epilog
    report = cluster.tick()
    assert cluster.last_requests()["n1"].release == ()
    assert cluster.cap("n1", 0) is not None  # job 2 runs on it: never back to defaults
    report = cluster.tick()
    assert [j.job_id for j in report.jobs if j.controlled] == ["2"]
    [point] = cluster.last_requests()["n1"].setpoints
    assert (point.gpu, point.job_id, point.tenants) == (0, "2", ())
    cluster.head.deregister_job("2")
    cluster.tick()
    assert cluster.last_requests()["n1"].release == (0,)
    assert cluster.cap("n1", 0) is None


def test_the_head_hands_the_controller_the_cluster_against_the_plan_in_force(
    make_cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What sizes the guard band (`Overdraw`): every GPU's power in the answers just in,
    against the plan the agents ran while they measured it (the decision before the last),
    none while uncapped or when the emergency cut overrode that plan."""
    cluster = make_cluster()
    head = cluster.head
    decisions: list[Decision | None] = []
    draws: list[ClusterDraw | None] = []
    step = head.controller.step

    def spied(*args: Any, **kwargs: Any) -> Decision:
        measured = kwargs["measured"]
        draws.append(None if measured is None else measured.cluster)
        decision = step(*args, **kwargs)
        decisions.append(decision)
        return decision

    monkeypatch.setattr(head.controller, "step", spied)
    cluster.tick()
    register_job(cluster, "1", "n1", 0, 1)
    register_job(cluster, "2", "n2", 0)
    for _ in range(3):  # uncapped: no over-draw is a share of a budget
        cluster.tick()
    assert draws and all(d is None for d in draws)
    cluster.store.set_budget(900.0, "root")
    first = len(decisions)
    for _ in range(4):
        cluster.tick()
    capped = draws[first:]
    assert capped[:2] == [None, None]  # the plan in force over the readings was uncapped
    for k in range(first + 2, len(draws)):
        draw, plan = draws[k], decisions[k - 2]
        assert draw is not None and plan is not None
        assert (draw.expected_w, draw.budget_w) == (plan.expected_w, plan.budget_w) and (
            plan.budget_w == 900.0
        )
    # what every GPU drew in the answers the last plan was made from (idle ones too)
    drawn_w = sum(head.nodes.power_by_gpu().values())
    cluster.tick()
    assert draws[-1] is not None and draws[-1].drawn_w == pytest.approx(drawn_w)
    assert head.controller.overdraw.quantile(0.5) is None  # 100 intervals before it counts
