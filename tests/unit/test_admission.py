"""Admission at job start: the verdict rule against a head that runs real intervals with
in-process agents on simulated GPUs, ``POST /v1/admission`` over a loopback socket, and the
PrologSlurmctld entry point with no head to answer."""

from __future__ import annotations

import http.client
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurm_cdgpc.agent.node import NodeAgent
from slurm_cdgpc.config import SafeCap
from slurm_cdgpc.control.empc import ControllerSettings
from slurm_cdgpc.coordinator.admission import (
    FEASIBLE,
    IF_OTHERS_SLOW,
    INFEASIBLE,
    NO_DEADLINE,
    UNKNOWN,
    Admission,
    AdmissionRequest,
    judge,
)
from slurm_cdgpc.coordinator.api import HeadHttpServer
from slurm_cdgpc.coordinator.daemon import Coordinator, CoordinatorSettings
from slurm_cdgpc.gpu.catalog import CATALOG
from slurm_cdgpc.gpu.simulated import ManualClock, simulated_gpus
from slurm_cdgpc.slurm import admission as hook
from slurm_cdgpc.slurm.install import write_entry_point
from slurm_cdgpc.store import Store, make_engine, upgrade
from slurm_cdgpc.topology import Topology, parse_topology
from slurm_cdgpc.transport.auth import AccessPolicy, HmacKey, HmacSigner, HmacVerifier
from slurm_cdgpc.transport.http import NodeFailure, NodeTarget
from slurm_cdgpc.wire.protocol import ExchangeRequest, ExchangeResponse

T0_S = 1_767_225_600.0
A100 = "A100-SXM4-80GB"
TOP_MHZ = CATALOG[A100].max_graphics_mhz
HOUR_S = 3600.0


@dataclass
class InProcess:
    """Exchanges with in-process agents through the JSON wire format."""

    agents: Mapping[str, NodeAgent]

    def exchange(
        self, targets: Mapping[str, NodeTarget]
    ) -> dict[str, ExchangeResponse | NodeFailure]:
        return {
            node: ExchangeResponse.from_json(
                self.agents[node].exchange(ExchangeRequest.from_json(t.request.to_json())).to_json()
            )
            for node, t in targets.items()
        }


@dataclass
class Head:
    coordinator: Coordinator
    clock: ManualClock
    agents: dict[str, NodeAgent]

    def tick(self, n: int = 1) -> None:
        for _ in range(n):
            self.clock.advance(1.0)
            for agent in self.agents.values():
                agent.tick()
            self.coordinator.run_interval()

    def ask(self, **fields: object) -> Admission:
        base: dict[str, object] = {"job_id": "9", "user": "bob", "gpus": 1, "nodes": ("n1",)}
        return judge(self.coordinator, AdmissionRequest(**{**base, **fields}))  # type: ignore[arg-type]


@pytest.fixture
def make_head(tmp_path: Path) -> Iterator[object]:
    engines = []

    def make(topology: Topology | None = None, nodes: tuple[str, ...] = ("n1", "n2")) -> Head:
        clock = ManualClock(T0_S)
        home = tmp_path / f"head{len(engines)}"
        home.mkdir()
        agents = {
            name: NodeAgent(
                simulated_gpus(A100, 2, seed=i, time_source=clock),
                SafeCap(clock_fraction=0.6),
                home / f"{name}-state.json",
                clock,
                node_name=name,
                lease_duration_s=5.0,
            )
            for i, name in enumerate(nodes)
        }
        engine = make_engine(f"sqlite:///{home / 'head.db'}")
        engines.append(engine)
        upgrade(engine)
        settings = CoordinatorSettings(
            interval_s=1.0, lease_s=5.0, controller=ControllerSettings(interval_s=1.0)
        )
        store = Store(engine, clock=clock)
        coordinator = Coordinator(
            store, InProcess(agents), settings, clock=clock, topology=topology
        )
        coordinator.start()
        for name in nodes:
            coordinator.register_node(name, f"http://{name}.test:8464")
        return Head(coordinator, clock, agents)

    yield make
    for engine in engines:
        engine.dispose()


def busy(head: Head, budget_w: float) -> Head:
    """Two running two-GPU jobs, one per node, under ``budget_w``, with models learned."""
    head.coordinator.store.set_budget(budget_w, "root")
    head.tick()  # the nodes report their GPUs
    for job, node in (("1", "n1"), ("2", "n2")):
        head.coordinator.register_job(job, "alice", node, [0, 1], deadline_s=T0_S + 2 * HOUR_S)
    head.tick(6)
    return head


def test_a_job_that_fits_at_the_current_price_is_feasible(make_head) -> None:  # type: ignore[no-untyped-def]
    head = busy(make_head(), 900.0)  # 4 A100s draw up to 1,600 W: the budget binds
    report = head.coordinator.last_report
    assert report is not None and report.status == "binding" and report.price
    verdict = head.ask(deadline_s=head.clock() + 10 * HOUR_S, time_limit_s=HOUR_S)
    assert verdict.verdict == FEASIBLE, verdict
    assert verdict.price == pytest.approx(report.price)
    # the price slows it, yet an hour of work ends well within ten
    assert verdict.clock_mhz is not None and verdict.clock_mhz < TOP_MHZ
    assert verdict.top_clock_mhz == TOP_MHZ
    assert verdict.finish_s is not None and verdict.top_finish_s is not None
    assert head.clock() + HOUR_S == pytest.approx(verdict.top_finish_s)
    assert verdict.top_finish_s < verdict.finish_s < head.clock() + 10 * HOUR_S
    assert "1.00 h limit" in verdict.reason


def test_a_job_that_needs_its_top_clock_is_feasible_only_if_others_slow(make_head) -> None:  # type: ignore[no-untyped-def]
    head = busy(make_head(), 900.0)
    deadline_s = head.clock() + 1.1 * HOUR_S
    # four GPUs pay four times the price: the clock it gets ends an hour's work after 1.1 h
    verdict = head.ask(deadline_s=deadline_s, time_limit_s=HOUR_S, gpus=4)
    assert verdict.verdict == IF_OTHERS_SLOW, verdict
    assert verdict.finish_s is not None and verdict.top_finish_s is not None
    assert verdict.top_finish_s <= deadline_s < verdict.finish_s
    assert f"at {TOP_MHZ} MHz" in verdict.reason
    # a job of one GPU under the same price makes the same deadline at its own clock
    one = head.ask(deadline_s=deadline_s, time_limit_s=HOUR_S, gpus=1)
    assert one.verdict == FEASIBLE and one.finish_s is not None and one.finish_s <= deadline_s


def test_a_job_that_cannot_make_it_even_at_top_clocks_is_infeasible(make_head) -> None:  # type: ignore[no-untyped-def]
    head = busy(make_head(), 900.0)
    verdict = head.ask(deadline_s=head.clock() + 0.5 * HOUR_S, time_limit_s=HOUR_S)
    assert verdict.verdict == INFEASIBLE, verdict
    assert "even at 1410 MHz" in verdict.reason
    past = head.ask(deadline_s=head.clock() - 60, time_limit_s=60.0)
    assert past.verdict == INFEASIBLE


def test_a_tighter_budget_gives_a_lower_clock_and_a_later_finish(make_head) -> None:  # type: ignore[no-untyped-def]
    loose = busy(make_head(), 1400.0)
    tight = busy(make_head(), 800.0)
    request = {"deadline_s": T0_S + 10 * HOUR_S, "time_limit_s": HOUR_S}
    a, b = loose.ask(**request), tight.ask(**request)
    assert a.price is not None and b.price is not None and b.price > a.price
    assert a.clock_mhz is not None and b.clock_mhz is not None and b.clock_mhz < a.clock_mhz
    assert a.finish_s is not None and b.finish_s is not None and b.finish_s > a.finish_s


def test_a_job_without_deadline_has_nothing_to_check(make_head) -> None:  # type: ignore[no-untyped-def]
    head = busy(make_head(), 900.0)
    verdict = head.ask(time_limit_s=HOUR_S)
    assert (verdict.verdict, verdict.finish_s) == (NO_DEADLINE, None)


def test_work_is_unknown_without_a_time_limit(make_head) -> None:  # type: ignore[no-untyped-def]
    head = busy(make_head(), 900.0)
    verdict = head.ask(deadline_s=head.clock() + HOUR_S, iterations_total=5000)
    assert verdict.verdict == UNKNOWN
    assert verdict.reason == "no time limit to bound its work (iters= counts steps, not seconds)"


def test_a_head_with_no_decision_yet_judges_at_top_clocks(make_head) -> None:  # type: ignore[no-untyped-def]
    head = make_head()
    assert head.coordinator.last_report is None
    # its nodes have not reported: their GPUs' type is not known unless the request says it
    assert head.ask(deadline_s=T0_S + 2 * HOUR_S, time_limit_s=HOUR_S).verdict == UNKNOWN
    verdict = head.ask(deadline_s=T0_S + 2 * HOUR_S, time_limit_s=HOUR_S, gpu_type=A100)
    assert verdict.verdict == FEASIBLE and "no plan yet" in verdict.reason
    assert verdict.price is None and verdict.clock_mhz == TOP_MHZ
    late = head.ask(deadline_s=T0_S + 0.9 * HOUR_S, time_limit_s=HOUR_S, gpu_type=A100)
    assert late.verdict == INFEASIBLE
    head.tick()  # an interval with no job: the nodes report, nothing is planned
    idle = head.ask(deadline_s=head.clock() + 2 * HOUR_S, time_limit_s=HOUR_S)
    assert idle.verdict == FEASIBLE and "nothing else planned" in idle.reason
    assert idle.gpu_type == A100  # from the node's report


def test_a_binding_rack_raises_the_price_of_its_nodes_alone(make_head) -> None:  # type: ignore[no-untyped-def]
    topology = parse_topology('[[domain]]\nname = "rack1"\nlimit = "500W"\nnodes = "n1"\n')
    head = busy(make_head(topology), 5000.0)  # the cluster's budget does not bind; rack1 does
    report = head.coordinator.last_report
    assert report is not None and report.domains and report.domains[0].price > 0
    request = {"deadline_s": T0_S + 10 * HOUR_S, "time_limit_s": HOUR_S}
    on_rack, off_rack = head.ask(**request, nodes=("n1",)), head.ask(**request, nodes=("n2",))
    assert off_rack.price == pytest.approx(report.price)
    assert on_rack.price == pytest.approx(report.price + report.domains[0].price)
    assert on_rack.clock_mhz is not None and off_rack.clock_mhz == TOP_MHZ
    assert on_rack.clock_mhz < TOP_MHZ


# -- the endpoint ------------------------------------------------------------------------------


@dataclass
class Api:
    server: HeadHttpServer
    head: Head
    signer: HmacSigner

    def call(self, path: str, body: bytes, method: str = "POST") -> tuple[int, dict[str, object]]:
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=10)
        try:
            headers = {
                "Content-Length": str(len(body)),
                "Authorization": self.signer.sign(method, path, body),
            }
            conn.request(method, path, body=body, headers=headers)
            reply = conn.getresponse()
            text = reply.read().decode()
            assert "\n" not in text.strip()
            return reply.status, json.loads(text)
        finally:
            conn.close()


@pytest.fixture
def api(make_head) -> Iterator[Api]:  # type: ignore[no-untyped-def]
    head = busy(make_head(), 900.0)
    key = HmacKey(secrets.token_bytes(32))
    server = HeadHttpServer(
        ("127.0.0.1", 0),
        head.coordinator,
        HmacVerifier(key),
        AccessPolicy(hmac_is_admin=False),
        signer=HmacSigner(key),
    )
    thread = threading.Thread(target=server.serve_forever, name="http-loop", daemon=True)
    thread.start()
    try:
        yield Api(server, head, HmacSigner(key, uid=0, gid=0))
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


BODY = {"job_id": "77", "user": "bob", "gpus": 2, "nodes": ["n1"], "time_limit_s": 3600.0}


def test_the_endpoint_answers_a_verdict_and_logs_it(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="slurm_cdgpc.coordinator.api")
    body = {**BODY, "deadline_s": api.head.clock() + 10 * HOUR_S}
    status, data = api.call("/v1/admission", json.dumps(body).encode())
    assert status == 200 and data["verdict"] == FEASIBLE and data["job_id"] == "77"
    assert data["gpu_type"] == A100 and isinstance(data["predicted_finish_s"], float)
    assert any("job 77: admission for bob" in r.getMessage() for r in caplog.records)
    status, data = api.call("/v1/admission", json.dumps({**BODY, "deadline_s": None}).encode())
    assert (status, data["verdict"]) == (200, NO_DEADLINE)
    assert api.call("/v1/admission", b"", method="GET")[0] == 405


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({**BODY, "deadline_s": "tomorrow"}, "deadline_s: must be a finite number"),
        ({**BODY, "gpus": -2}, "gpus: must be an integer ≥ 0"),
        ({**BODY, "gpus": 0}, "gpus: must be a count of GPUs from 1"),
        ({**BODY, "nodes": []}, "nodes: must be a non-empty list"),
        ({**BODY, "nodes": ["n1", "-x"]}, "nodes[1]: must be a host name"),
        ({**BODY, "job_id": "x1"}, "job_id: must be a Slurm job id"),
        ({**BODY, "time_limit_s": -5}, "time_limit_s: must be > 0"),
        ({**BODY, "colour": "red"}, "body: unknown field 'colour'"),
        (b'{"job_id": "77", "user": "b', "JSON"),
    ],
)
def test_bad_input_is_refused_in_one_line_and_changes_nothing(
    api: Api, body: object, error: str
) -> None:
    store = api.head.coordinator.store
    before = (len(store.decisions(limit=1000)), [j.job_id for j in store.jobs()])
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, data = api.call("/v1/admission", raw)
    assert status == 400 and error in str(data["error"]), data
    assert (len(store.decisions(limit=1000)), [j.job_id for j in store.jobs()]) == before


# -- the PrologSlurmctld ------------------------------------------------------------------------

SHOW = (
    "JobId={job} JobName=wrap UserId=bob(1000) JobState=CONFIGURING "
    "SubmitTime=2026-01-01T00:00:00 StartTime=2026-01-01T00:00:01 TimeLimit=00:30:00 "
    "NodeList=n[1-2] NumNodes=2 NumCPUs=2 TresPerNode=gres:gpu:2 Comment=deadline=+2h"
)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _hook_env(tmp_path: Path) -> dict[str, str]:
    key = tmp_path / "hmac.key"
    # hex, as LocalCluster writes one: a key file's trailing CR and LF are stripped
    key.write_bytes(secrets.token_hex(32).encode())
    key.chmod(0o600)
    config = tmp_path / "cdgpc.toml"
    config.write_text(
        f'[head]\nurl = "http://127.0.0.1:{_closed_port()}"\n'
        f'[auth]\nmethod = "hmac"\nhmac_key_file = "{key}"\n[admission]\nenforce = true\n'
    )
    return {
        "CDGPC_CONFIG": str(config),
        "SLURM_JOB_ID": "5",
        "SLURM_JOB_USER": "bob",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_JOB_COMMENT": "deadline=+2h",
        "SLURM_SCRIPT_CONTEXT": "prolog_slurmctld",
    }


def test_the_request_is_built_from_the_environment_and_scontrol() -> None:
    environ = {"SLURM_JOB_ID": "5", "SLURM_JOB_USER": "bob", "SLURM_JOB_NODELIST": "n[1-2]"}
    body = hook.request_body(
        {**environ, "SLURM_JOB_COMMENT": "deadline=+2h iters=900"},
        SHOW.format(job=5),
        now_s=T0_S,
    )
    submit_s = body["deadline_s"] - 7200  # type: ignore[operator]
    assert abs(submit_s - time.mktime((2026, 1, 1, 0, 0, 0, 0, 0, -1))) < 1
    assert {k: v for k, v in body.items() if k != "deadline_s"} == {
        "job_id": "5",
        "user": "bob",
        "gpus": 4,  # two per node on two nodes
        "nodes": ["n1", "n2"],
        "iterations_total": 900,
        "time_limit_s": 1800.0,
    }


def test_with_the_head_away_the_hook_logs_one_line_writes_nothing_and_exits_0(
    tmp_path: Path,
) -> None:
    """scontrol here is a script standing in for slurmctld (the seam `slurm/` owns); the head
    is a real closed port. Enforcement is on, and still the job starts."""
    calls = tmp_path / "scontrol-calls"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(
        f'#!/bin/sh\necho "$@" >>{calls}\n[ "$1" = show ] && echo "{SHOW.format(job=5)}"\nexit 0\n'
    )
    scontrol.chmod(0o755)
    environ = _hook_env(tmp_path)
    settings = hook.AdmissionSettings(timeout_s=1.0, budget_s=2.0, scontrol=scontrol)
    ask, enforce = hook.head_asker(settings, environ)
    lines: list[str] = []
    began_s = time.monotonic()
    status = hook.run(
        settings, environ, emit=lambda _p, line: lines.append(line), ask=ask, enforce=enforce
    )
    assert enforce and status == 0 and time.monotonic() - began_s < 2.0
    [line] = lines
    assert line.startswith("job 5: no verdict, the job starts: cannot reach cdgpcd"), line
    assert calls.read_text().splitlines() == ["show job -o 5"]  # no AdminComment written


def test_an_infeasible_verdict_fails_the_hook_only_when_enforced(tmp_path: Path) -> None:
    scontrol = tmp_path / "scontrol"
    calls = tmp_path / "scontrol-calls"
    scontrol.write_text(
        f'#!/bin/sh\necho "$@" >>{calls}\n[ "$1" = show ] && echo "{SHOW.format(job=5)}"\nexit 0\n'
    )
    scontrol.chmod(0o755)
    environ = _hook_env(tmp_path)
    settings = hook.AdmissionSettings(scontrol=scontrol)

    def infeasible(_body: Mapping[str, object]) -> Mapping[str, object]:
        return {"verdict": INFEASIBLE, "reason": "work takes 3 h even at 1410 MHz"}

    lines: list[str] = []
    for enforce, expected in ((False, 0), (True, 1)):
        status = hook.run(
            settings, environ, emit=lambda _p, x: lines.append(x), ask=infeasible, enforce=enforce
        )
        assert status == expected, lines
    assert "[admission] enforce: the job is requeued" in lines[1] and "enforce" not in lines[0]
    written = calls.read_text().splitlines()
    assert written[1] == (
        "update JobId=5 AdminComment=cdgpc: infeasible: work takes 3 h even at 1410 MHz"
    )


def test_the_installed_entry_point_exits_0_quickly_without_a_head(tmp_path: Path) -> None:
    script = write_entry_point(tmp_path / "bin", "prolog-slurmctld", sys.executable)
    environ = {**_hook_env(tmp_path), "PATH": ""}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CDGPC_", "SLURM_"))}
    began_s = time.monotonic()
    done = subprocess.run(
        [str(script)],
        env={**env, **environ},
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - began_s < 5.0
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("job 5: no verdict, the job starts: "), line
