"""``GET /metrics`` of the head and of a node agent, parsed as Prometheus parses it.

The head and the agents serve in-process on loopback sockets; node agents are real `NodeAgent`s
on simulated GPUs, exchanged with in-process (the head) or over HTTP (an agent's own server).
"""

from __future__ import annotations

import http.client
import json
import secrets
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from slurm_cdgpc.agent.node import NodeAgent
from slurm_cdgpc.agent.server import AgentHttpServer
from slurm_cdgpc.config import SafeCap
from slurm_cdgpc.control.limits import NewJobShare
from slurm_cdgpc.control.tenancy import Interference
from slurm_cdgpc.coordinator.api import HeadHttpServer
from slurm_cdgpc.coordinator.daemon import Coordinator, CoordinatorSettings
from slurm_cdgpc.coordinator.metrics import EXCHANGE_FAILURE_KINDS, failure_kind
from slurm_cdgpc.gpu.simulated import ManualClock, simulated_gpus
from slurm_cdgpc.store import Store, make_engine, upgrade
from slurm_cdgpc.transport.auth import AccessPolicy, HmacKey, HmacSigner, HmacVerifier
from slurm_cdgpc.transport.http import NodeExchanger, NodeFailure, NodeTarget
from slurm_cdgpc.wire.protocol import ExchangeRequest, ExchangeResponse, Setpoint

T0_S = 1_767_225_600.0
LEASE_S = 5.0
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
JOB = {"job_id": "42", "user": "alice", "node": "n1", "gpus": [0], "gpu_type": "A100"}


def _get(port: int, path: str, method: str = "GET") -> tuple[int, str, str]:
    """Status, Content-Type and body of an unauthenticated request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path)
        reply = conn.getresponse()
        return reply.status, reply.getheader("Content-Type") or "", reply.read().decode()
    finally:
        conn.close()


def _post(
    port: int, path: str, body: bytes, signer: HmacSigner | None
) -> tuple[int, dict[str, object]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        headers = {"Content-Length": str(len(body))}
        if signer is not None:
            headers["Authorization"] = signer.sign("POST", path, body)
        conn.request("POST", path, body=body, headers=headers)
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


def _families(port: int) -> dict[str, Metric]:
    status, content_type, text = _get(port, "/metrics")
    assert (status, content_type) == (200, CONTENT_TYPE)
    return {f.name: f for f in text_string_to_metric_families(text)}


def _sample(families: Mapping[str, Metric], name: str, **labels: str) -> float:
    """The value of the one sample ``name`` with ``labels`` (KeyError: there is none)."""
    for family in families.values():
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    raise KeyError(f"{name}{labels}")


def _serve(server: HeadHttpServer | AgentHttpServer) -> Callable[[], None]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return stop


# -- the head ------------------------------------------------------------------------------------


@dataclass
class Agents:
    """In-process agents exchanged with through the JSON wire format; ``down`` nodes fail."""

    agents: Mapping[str, NodeAgent]
    down: set[str] = field(default_factory=set)

    def exchange(
        self, targets: Mapping[str, NodeTarget]
    ) -> dict[str, ExchangeResponse | NodeFailure]:
        out: dict[str, ExchangeResponse | NodeFailure] = {}
        for node, target in targets.items():
            if node in self.down or node not in self.agents:
                out[node] = NodeFailure(f"{target.url}: ConnectionRefusedError: refused")
                continue
            request = ExchangeRequest.from_json(target.request.to_json())
            out[node] = ExchangeResponse.from_json(self.agents[node].exchange(request).to_json())
        return out


@dataclass
class Head:
    coordinator: Coordinator
    server: HeadHttpServer
    signer: HmacSigner
    clock: ManualClock
    agents: Agents

    def register(self, job: Mapping[str, object], *, signed: bool = True) -> int:
        body = json.dumps(job).encode()
        return _post(self.server.port, "/v1/jobs", body, self.signer if signed else None)[0]

    def families(self) -> dict[str, Metric]:
        return _families(self.server.port)


@pytest.fixture
def head(tmp_path: Path) -> Iterator[Head]:
    clock = ManualClock(T0_S)
    agent = NodeAgent(
        simulated_gpus("A100", 2, seed=1, time_source=clock),
        SafeCap(clock_fraction=0.6),
        tmp_path / "n1-state.json",
        clock,
        node_name="n1",
        lease_duration_s=LEASE_S,
    )
    agents = Agents({"n1": agent})
    engine = make_engine(f"sqlite:///{tmp_path / 'head.db'}")
    upgrade(engine)
    settings = CoordinatorSettings(interval_s=1.0, lease_s=LEASE_S)
    coordinator = Coordinator(Store(engine, clock=clock), agents, settings, clock=clock)
    coordinator.start()
    key = HmacKey(secrets.token_bytes(32))
    server = HeadHttpServer(
        ("127.0.0.1", 0), coordinator, HmacVerifier(key), AccessPolicy(hmac_is_admin=False)
    )
    stop = _serve(server)
    yield Head(coordinator, server, HmacSigner(key, uid=0, gid=0), clock, agents)
    stop()
    engine.dispose()


def test_the_head_serves_its_families_with_their_types(head: Head) -> None:
    head.register(JOB)
    head.coordinator.run_interval()
    types = {name: f.type for name, f in head.families().items()}
    expected = {
        # the last interval, read at the scrape (the names the head always had)
        "cdgpc_budget_watts": "gauge",
        "cdgpc_measured_power_watts": "gauge",
        "cdgpc_predicted_power_watts": "gauge",
        "cdgpc_uncontrolled_power_watts": "gauge",
        "cdgpc_guard_band_ratio": "gauge",
        "cdgpc_plan_offset_ratio": "gauge",
        "cdgpc_price": "gauge",
        "cdgpc_solve_seconds": "gauge",
        "cdgpc_interval": "gauge",
        "cdgpc_jobs_controlled": "gauge",
        "cdgpc_jobs": "gauge",
        "cdgpc_nodes": "gauge",
        "cdgpc_shadow": "gauge",
        "cdgpc_leader_epoch": "gauge",
        # what this head counted and timed
        "cdgpc_registrations": "counter",
        "cdgpc_registrations_refused": "counter",
        "cdgpc_exchange_failures": "counter",
        "cdgpc_lease_lapses": "counter",
        "cdgpc_intervals_failed": "counter",
        "cdgpc_registration_duration_seconds": "histogram",
        "cdgpc_exchange_duration_seconds": "histogram",
        "cdgpc_interval_duration_seconds": "histogram",
        # the process
        "process_resident_memory_bytes": "gauge",
        "process_cpu_seconds": "counter",
        "process_open_fds": "gauge",
        "python_info": "gauge",
    }
    assert {name: types.get(name) for name in expected} == expected
    # no series per job or node: the only labels are fixed sets (and the histograms' bounds)
    labels = {k for f in head.families().values() for s in f.samples for k in s.labels}
    assert labels <= {"state", "reachable", "code", "kind", "le", "before", "after"} | {
        "implementation",
        "major",
        "minor",
        "patchlevel",
        "version",
    }


def test_the_learned_new_job_share_is_shown_per_kind(head: Head) -> None:
    assert "cdgpc_new_job_power_share" not in head.families()  # nothing learned: no series
    share = head.coordinator.controller.new_share = NewJobShare(1.0, 0.9)  # quantile 0.9
    share.observe(["A100-SXM4-80GB"] * 20, np.full(20, 0.5), np.zeros(20, dtype=bool))
    family = head.families()["cdgpc_new_job_power_share"]
    assert [(s.labels, s.value) for s in family.samples] == [({"kind": "A100-SXM4-80GB"}, 0.5)]


def test_the_learned_co_tenant_factors_are_shown_per_change(head: Head) -> None:
    assert "cdgpc_cotenant_time_ratio" not in head.families()  # nothing learned: no series
    cells = head.coordinator.controller.interference = Interference(min_events=2)
    cells.learn(np.array([1, 1, 0]), np.array([0, 0, 1]), np.log([0.5, 0.5, 2.0]))
    family = head.families()["cdgpc_cotenant_time_ratio"]
    samples = [(s.labels, round(s.value, 6)) for s in family.samples]
    assert samples == [({"before": "1", "after": "0"}, 0.5)]  # (0, 1) has one event


def test_a_refused_registration_counts_by_status_and_an_accepted_one_is_timed(
    head: Head,
) -> None:
    before = head.families()
    assert _sample(before, "cdgpc_registrations_refused_total", code="401") == 0
    assert head.register(JOB, signed=False) == 401
    assert head.register({**JOB, "gpus": "all"}) == 400
    assert head.register({**JOB, "gpus": "all"}) == 400
    assert head.register(JOB) == 200
    after = head.families()
    assert _sample(after, "cdgpc_registrations_refused_total", code="401") == 1
    assert _sample(after, "cdgpc_registrations_refused_total", code="400") == 2
    assert _sample(after, "cdgpc_registrations_total") == 1
    assert _sample(after, "cdgpc_registration_duration_seconds_count") == 1
    assert _sample(after, "cdgpc_registration_duration_seconds_sum") > 0


def test_an_interval_is_timed_and_a_failed_exchange_counted_by_kind(head: Head) -> None:
    head.register(JOB)
    assert _sample(head.families(), "cdgpc_interval_duration_seconds_count") == 0
    head.coordinator.run_interval()
    head.agents.down.add("n1")
    head.coordinator.run_interval()
    families = head.families()
    assert _sample(families, "cdgpc_interval_duration_seconds_count") == 2
    assert _sample(families, "cdgpc_interval_duration_seconds_bucket", le="+Inf") == 2
    assert _sample(families, "cdgpc_exchange_duration_seconds_count") == 2
    assert _sample(families, "cdgpc_exchange_failures_total", kind="connection") == 1
    assert _sample(families, "cdgpc_exchange_failures_total", kind="timeout") == 0
    assert _sample(families, "cdgpc_nodes", reachable="false") == 1


def test_a_node_back_after_more_than_a_lease_counts_as_a_lapse(head: Head) -> None:
    agent = head.agents.agents["n1"]
    head.register(JOB)
    head.coordinator.run_interval()
    head.agents.down.add("n1")
    for _ in range(3):  # under a lease away: the agent's lease still runs
        head.clock.advance(1.0)
        agent.tick()
        head.coordinator.run_interval()
    head.agents.down.clear()
    head.coordinator.run_interval()
    assert _sample(head.families(), "cdgpc_lease_lapses_total") == 0
    head.agents.down.add("n1")
    head.clock.advance(LEASE_S + 1.0)
    agent.tick()
    assert agent.lease.lapsed and agent.lease.safe_capped == 2
    head.coordinator.run_interval()
    head.agents.down.clear()
    head.coordinator.run_interval()
    assert _sample(head.families(), "cdgpc_lease_lapses_total") == 1
    assert not agent.lease.lapsed


# -- the kinds of exchange failure, as the real exchanger reports them ---------------------------


@pytest.fixture
def listener() -> Iterator[Callable[[bytes | None], str]]:
    """Loopback listeners: ``reply`` is sent to every request; None: accepted, never answered."""
    sockets: list[socket.socket] = []

    def make(reply: bytes | None) -> str:
        sock = socket.create_server(("127.0.0.1", 0))
        sockets.append(sock)

        def serve() -> None:
            while True:
                try:
                    conn, _ = sock.accept()
                except OSError:
                    return
                with conn:
                    data = b""
                    while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
                        data += chunk
                    conn.sendall(reply or b"")

        if reply is not None:  # else the kernel completes the connection and nobody reads
            threading.Thread(target=serve, daemon=True).start()
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield make
    for sock in sockets:
        sock.close()


def test_each_kind_of_exchange_failure_is_told_apart(
    listener: Callable[[bytes | None], str],
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    urls = {
        "connection": closed,
        "timeout": listener(None),
        "refused": listener(
            b'HTTP/1.1 409 Conflict\r\nContent-Length: 17\r\n\r\n{"error": "old"}\n'
        ),
        "reply": listener(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi"),
    }
    targets = {
        kind: NodeTarget(url, ExchangeRequest(1, T0_S + 60, (), node="n1"))
        for kind, url in urls.items()
    }
    exchanger = NodeExchanger(HmacSigner(HmacKey(b"k" * 32)), timeout_s=1.5)
    try:
        results = exchanger.exchange(targets)
    finally:
        exchanger.close()
    kinds = {
        expected: failure_kind(result.reason) if isinstance(result, NodeFailure) else "answered"
        for expected, result in results.items()
    }
    assert kinds == {kind: kind for kind in urls}
    assert set(kinds) <= set(EXCHANGE_FAILURE_KINDS)


# -- a node agent --------------------------------------------------------------------------------


@dataclass
class Agent:
    agent: NodeAgent
    server: AgentHttpServer
    signer: HmacSigner
    clock: ManualClock

    def exchange(self, request: ExchangeRequest, signer: HmacSigner | None = None) -> int:
        return _post(self.server.port, "/v1/exchange", request.to_json(), signer or self.signer)[0]

    def families(self) -> dict[str, Metric]:
        return _families(self.server.port)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    clock = ManualClock(T0_S)
    node = NodeAgent(
        simulated_gpus("A100", 2, seed=1, time_source=clock),
        SafeCap(clock_fraction=0.6),
        tmp_path / "state.json",
        clock,
        node_name="n1",
        lease_duration_s=LEASE_S,
    )
    key = HmacKey(secrets.token_bytes(32))
    server = AgentHttpServer(
        ("127.0.0.1", 0),
        node,
        HmacVerifier(key),
        AccessPolicy(node_uids=frozenset({0})),
        signer=HmacSigner(key),
    )
    stop = _serve(server)
    yield Agent(node, server, HmacSigner(key, uid=0, gid=0), clock)
    stop()


def test_the_agent_counts_exchanges_served_and_refused(agent: Agent) -> None:
    assert (
        agent.exchange(
            ExchangeRequest(1, T0_S + 60, (Setpoint(0, "77", 1005),), node="n1", epoch=2)
        )
        == 200
    )
    forged = HmacSigner(HmacKey(secrets.token_bytes(32)), uid=0, gid=0)
    assert agent.exchange(ExchangeRequest(2, T0_S + 60, (), node="n1", epoch=2), forged) == 401
    assert agent.exchange(ExchangeRequest(3, T0_S + 60, (), node="n1", epoch=1)) == 409
    families = agent.families()
    assert _sample(families, "cdgpc_node_exchanges_total") == 1
    assert _sample(families, "cdgpc_node_exchange_duration_seconds_count") == 1
    assert _sample(families, "cdgpc_node_exchanges_refused_total", code="401") == 1
    assert _sample(families, "cdgpc_node_exchanges_refused_total", code="409") == 1
    assert _sample(families, "cdgpc_node_exchanges_refused_total", code="400") == 0
    assert _sample(families, "cdgpc_node_leader_epoch") == 2
    assert _sample(families, "cdgpc_node_gpus") == 2
    assert families["process_resident_memory_bytes"].samples[0].value > 0
    # nothing names the job, and nothing but a status code is a label
    labels = {k: v for f in families.values() for s in f.samples for k, v in s.labels.items()}
    assert "77" not in labels.values()
    assert set(labels) <= {
        "code",
        "le",
        "implementation",
        "major",
        "minor",
        "patchlevel",
        "version",
    }


def test_the_agent_shows_its_lease_lapse_and_safe_cap(agent: Agent) -> None:
    assert agent.exchange(ExchangeRequest(1, T0_S + LEASE_S, (), node="n1")) == 200
    running = agent.families()
    assert _sample(running, "cdgpc_node_lease_lapsed") == 0
    assert _sample(running, "cdgpc_node_lease_remaining_seconds") == LEASE_S
    agent.clock.advance(LEASE_S + 1.0)
    agent.agent.tick()
    lapsed = agent.families()
    assert _sample(lapsed, "cdgpc_node_lease_lapsed") == 1
    assert _sample(lapsed, "cdgpc_node_lease_remaining_seconds") == -1.0
    assert _sample(lapsed, "cdgpc_node_lease_lapses_total") == 1
    assert _sample(lapsed, "cdgpc_node_safe_capped_gpus") == 2
    now_s = T0_S + LEASE_S + 1.0
    assert agent.exchange(ExchangeRequest(2, now_s + LEASE_S, (), node="n1")) == 200
    renewed = agent.families()
    assert _sample(renewed, "cdgpc_node_lease_lapsed") == 0
    assert _sample(renewed, "cdgpc_node_safe_capped_gpus") == 0
    assert _sample(renewed, "cdgpc_node_lease_lapses_total") == 1


def test_the_agents_metrics_take_get_only_and_no_credential(agent: Agent) -> None:
    assert _get(agent.server.port, "/metrics")[0] == 200
    assert _get(agent.server.port, "/metrics", method="POST")[0] == 405
    assert _get(agent.server.port, "/metrics/x")[0] == 404
