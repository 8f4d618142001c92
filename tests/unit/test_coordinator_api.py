"""cdgpcd's HTTP API over a real loopback socket (the server runs in-process on port 0)."""

from __future__ import annotations

import http.client
import json
import secrets
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurm_cdgpc.coordinator.api import HeadHttpServer
from slurm_cdgpc.coordinator.daemon import Coordinator, CoordinatorSettings
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.store import Job, Store, make_engine, upgrade
from slurm_cdgpc.store.repository import JobRegistration
from slurm_cdgpc.topology import Topology, parse_topology
from slurm_cdgpc.transport.auth import AccessPolicy, HmacKey, HmacSigner, HmacVerifier
from slurm_cdgpc.transport.http import HeadClient, HeadRefusedError, NodeFailure, NodeTarget
from slurm_cdgpc.wire.protocol import ExchangeResponse


class NoAgents:
    """Every node is down (the API tests need no agents)."""

    def exchange(
        self, targets: Mapping[str, NodeTarget]
    ) -> dict[str, ExchangeResponse | NodeFailure]:
        return {node: NodeFailure("no agents in this test") for node in targets}


@dataclass
class Api:
    server: HeadHttpServer
    coordinator: Coordinator
    signer: HmacSigner

    def call(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        *,
        sign: bool = True,
        credential: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, object], str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=10)
        try:
            all_headers = {"Content-Length": str(len(body)), **(headers or {})}
            if credential is None and sign:
                credential = self.signer.sign(method, path, body)
            if credential is not None:
                all_headers["Authorization"] = credential
            conn.request(method, path, body=body, headers=all_headers)
            reply = conn.getresponse()
            data = reply.read()
            text = data.decode()
            parsed = (
                json.loads(text) if reply.getheader("Content-Type") == "application/json" else {}
            )
            return reply.status, parsed, text
        finally:
            conn.close()

    def post(self, path: str, payload: object, **kwargs: object) -> tuple[int, dict[str, object]]:
        status, data, _ = self.call("POST", path, json.dumps(payload).encode(), **kwargs)  # type: ignore[arg-type]
        return status, data

    def jobs(self) -> list[dict[str, object]]:
        status, data, _ = self.call("GET", "/v1/jobs")
        assert status == 200
        return data["jobs"]  # type: ignore[return-value]


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    with _serving(tmp_path) as api:
        yield api


@contextmanager
def _serving(tmp_path: Path, topology: Topology | None = None) -> Iterator[Api]:
    """A head (``topology``: its power domains) and its API on a loopback port."""
    engine = make_engine(f"sqlite:///{tmp_path / 'head.db'}")
    upgrade(engine)
    coordinator = Coordinator(
        Store(engine), NoAgents(), CoordinatorSettings(interval_s=1.0), topology=topology
    )
    coordinator.start()
    key = HmacKey(secrets.token_bytes(32))
    server = HeadHttpServer(
        ("127.0.0.1", 0),
        coordinator,
        HmacVerifier(key),
        AccessPolicy(hmac_is_admin=False),
        signer=HmacSigner(key),
    )
    thread = threading.Thread(target=server.serve_forever, name="http-loop", daemon=True)
    thread.start()
    try:
        yield Api(server, coordinator, HmacSigner(key, uid=0, gid=0))
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
        engine.dispose()


JOB = {"job_id": "42", "user": "alice", "node": "n1", "gpus": [1, 0], "gpu_type": "A100"}
SERVING = {**JOB, "slo_percentile": 99, "slo_latency_s": 0.25}


def _one_line_error(data: dict[str, object], text: str) -> str:
    assert "\n" not in text.strip() and isinstance(data["error"], str)
    return data["error"]


def test_register_is_idempotent_and_merges_nodes(api: Api) -> None:
    assert api.post("/v1/jobs", JOB)[0] == 200
    assert api.post("/v1/jobs", JOB)[0] == 200  # a retried Prolog
    status, data = api.post("/v1/jobs", {**JOB, "node": "n2", "gpus": [3], "deadline_s": 2e9})
    assert status == 200
    [job] = api.jobs()
    assert job["job_id"] == "42" and job["state"] == "registered"
    assert job["deadline_s"] == 2e9
    assert (job["time_limit_s"], job["work"], job["progress"]) == (None, "none", "none")
    assert job["slo"] is None
    status, _ = api.post("/v1/jobs", {**JOB, "time_limit_s": 7200.0, "start_s": 1.9e9})
    [job] = api.jobs()
    assert (status, job["time_limit_s"], job["work"]) == (200, 7200.0, "time-limit")
    assert job["gpus"] == [
        {"node": "n1", "index": 0},
        {"node": "n1", "index": 1},
        {"node": "n2", "index": 3},
    ]
    status, data, _ = api.call("GET", "/v1/nodes")
    assert [(n["name"], n["url"], n["gpu_type"]) for n in data["nodes"]] == [  # type: ignore[union-attr,index]
        ("n1", "http://n1:8464", "A100-SXM4-80GB"),
        ("n2", "http://n2:8464", "A100-SXM4-80GB"),
    ]
    status, data, _ = api.call("DELETE", "/v1/jobs/42")
    assert (status, data["state"]) == (200, "finished")
    assert api.jobs() == []
    assert api.call("DELETE", "/v1/jobs/43")[0] == 404


def test_credentials_missing_forged_or_replayed_are_refused_and_change_nothing(api: Api) -> None:
    body = json.dumps(JOB).encode()
    forged = HmacSigner(HmacKey(secrets.token_bytes(32)), uid=0, gid=0)
    valid = api.signer.sign("POST", "/v1/jobs", body)
    other = api.signer.sign("POST", "/v1/jobs", body + b" ")
    cases = {
        "missing": api.call("POST", "/v1/jobs", body, sign=False),
        "forged": api.call(
            "POST", "/v1/jobs", body, credential=forged.sign("POST", "/v1/jobs", body)
        ),
        "garbage": api.call("POST", "/v1/jobs", body, credential="hmac-sha256 nonsense"),
        "other body": api.call("POST", "/v1/jobs", body, credential=other),
        "wrong path": api.call(
            "POST", "/v1/nodes", body, credential=api.signer.sign("POST", "/v1/jobs", body)
        ),
    }
    assert {name: c[0] for name, c in cases.items()} == {name: 401 for name in cases}
    for _, data, text in cases.values():
        _one_line_error(data, text)
    assert api.jobs() == []
    assert api.call("GET", "/v1/status", sign=False)[0] == 401
    assert api.call("POST", "/v1/jobs", body, credential=valid)[0] == 200
    status, data, text = api.call("POST", "/v1/jobs", body, credential=valid)  # replay
    assert status == 401 and "replay" in _one_line_error(data, text)
    # a replayed deregistration does not deregister a job registered again later
    delete = api.signer.sign("DELETE", "/v1/jobs/42", b"")
    assert api.call("DELETE", "/v1/jobs/42", credential=delete)[0] == 200
    assert api.post("/v1/jobs", JOB)[0] == 200
    assert api.call("DELETE", "/v1/jobs/42", credential=delete)[0] == 401
    assert [j["job_id"] for j in api.jobs()] == ["42"]


def test_budget_needs_an_admin_and_a_positive_finite_value(api: Api) -> None:
    status, data, text = api.call("POST", "/v1/budget", b'{"budget_w": 450000}')
    assert status == 403 and "admin" in _one_line_error(data, text)
    assert api.coordinator.store.current_budget() is None
    api.server.policy = AccessPolicy(hmac_is_admin=True)
    for bad in (b'{"budget_w": 0}', b'{"budget_w": -5}', b'{"budget_w": 1e999}',
                b'{"budget_w": NaN}', b'{"budget_w": "450kW"}', b'{"budget_w": true}',
                b'{"budget": 5}', b'{"budget_w": 5, "budget_w": 6}'):  # fmt: skip
        status, data, text = api.call("POST", "/v1/budget", bad)
        assert status == 400, bad
        _one_line_error(data, text)
    assert api.coordinator.store.current_budget() is None
    status, data = api.post("/v1/budget", {"budget_w": 450000.0, "reason": "summer"})
    assert status == 200 and data["set_by"] == "root" and data["budget_w"] == 450000.0
    status, data, _ = api.call("GET", "/v1/budget")
    assert data["current"]["reason"] == "summer"  # type: ignore[index]
    status, data, _ = api.call("GET", "/v1/status")
    assert data["budget_w"] == 450000.0


#: row1 holds rack1 and rack2; rack3 is directly under the cluster
DOMAINS = """
[[domain]]
name = "row1"
limit = "2kW"
[[domain]]
name = "rack1"
parent = "row1"
limit = "1kW"
nodes = "n[1-2]"
[[domain]]
name = "rack2"
parent = "row1"
limit = "1.5kW"
nodes = "n3"
[[domain]]
name = "rack3"
limit = "3kW"
nodes = "n4"
"""


@pytest.fixture
def domain_api(tmp_path: Path) -> Iterator[Api]:
    with _serving(tmp_path, parse_topology(DOMAINS)) as api:
        api.server.policy = AccessPolicy(hmac_is_admin=True)
        api.post("/v1/budget", {"budget_w": 1000.0})  # the cluster's, below rack3's limit
        yield api


def _limits(api: Api) -> dict[str, tuple[float, str]]:
    """Each domain's limit in force and its source, as ``GET /v1/budget`` has them."""
    status, data, _ = api.call("GET", "/v1/budget")
    assert status == 200
    return {d["name"]: (d["limit_w"], d["source"]) for d in data["domains"]}  # type: ignore[attr-defined]


def test_a_domain_limit_the_head_cannot_hold_is_refused_with_one_line_and_changes_nothing(
    domain_api: Api,
) -> None:
    api, store = domain_api, domain_api.coordinator.store
    later_s = time.time() + 3600
    refused: list[tuple[dict[str, object], int, str]] = [
        ({"domain": "rack99", "budget_w": 500.0}, 400,
         "unknown power domain 'rack99' (known: 'row1', 'rack1', 'rack2', 'rack3')"),
        ({"domain": "cluster", "budget_w": 500.0}, 400,
         "'cluster' is the root: its limit is the budget (budget set without --domain)"),
        ({"domain": "rack1", "budget_w": 0}, 400, "budget_w: must be positive, got 0"),
        ({"domain": "rack1", "budget_w": -5}, 400, "budget_w: must be positive, got -5"),
        ({"domain": "rack1", "budget_w": "40kW"}, 400,
         "budget_w: must be a finite number, got '40kW'"),
        ({"domain": 12, "budget_w": 500.0}, 400, "domain: not a valid value: 12"),
        ({"domain": "rack1", "budget_w": 2500.0}, 400,
         "power domain 'rack1': limit 2.5 kW is above the 2 kW in force for its parent 'row1'"),
        ({"domain": "row1", "budget_w": 1200.0}, 400,
         "power domain 'row1': limit 1.2 kW is below the 1.5 kW in force for its child 'rack2'"),
        ({"domain": "rack1", "budget_w": 2500.0, "effective_at_s": later_s}, 400,
         "power domain 'rack1': limit 2.5 kW is above the 2 kW in force for its parent 'row1'"),
    ]  # fmt: skip
    for body, code, message in refused:
        status, data = api.post("/v1/budget", body)
        assert (status, data) == (code, {"error": message}), body
    api.server.policy = AccessPolicy(hmac_is_admin=False)
    status, data = api.post("/v1/budget", {"domain": "rack1", "budget_w": 500.0})
    assert status == 403 and "admin" in str(data["error"])
    api.server.policy = AccessPolicy(hmac_is_admin=True)
    assert store.domain_limit_history() == []
    assert store.current_budget().budget_w == 1000.0  # type: ignore[union-attr]

    # the parent's limit in force is the admin's, not the file's; a top-level domain may be set
    # above the cluster's budget, which may change freely
    assert api.post("/v1/budget", {"domain": "row1", "budget_w": 1800.0})[0] == 200
    assert api.post("/v1/budget", {"domain": "rack3", "budget_w": 2500.0})[0] == 200
    status, data = api.post("/v1/budget", {"domain": "rack2", "budget_w": 1900.0})
    assert (status, data) == (
        400,
        {"error": "power domain 'rack2': limit 1.9 kW is above the 1.8 kW in force for its "
                  "parent 'row1'"},
    )  # fmt: skip
    # a parent's change scheduled for later bounds a child's set now, from its time on
    lowered = {"domain": "row1", "budget_w": 1600.0, "effective_at_s": later_s}
    assert api.post("/v1/budget", lowered)[0] == 200
    status, data = api.post("/v1/budget", {"domain": "rack2", "budget_w": 1700.0})
    assert status == 400
    assert data["error"] == (
        "power domain 'rack2': limit 1.7 kW is above the 1.6 kW in force for its parent 'row1' "
        f"from {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(later_s))}"
    )
    # and a child's limit bounds its parent's change scheduled for later
    status, data = api.post(
        "/v1/budget", {"domain": "row1", "budget_w": 1400.0, "effective_at_s": later_s + 1}
    )
    assert (status, data) == (
        400,
        {"error": "power domain 'row1': limit 1.4 kW is below the 1.5 kW in force for its "
                  "child 'rack2'"},
    )  # fmt: skip
    assert [(c.domain, c.budget_w) for c in store.domain_limit_history()] == [
        ("row1", 1800.0),
        ("rack3", 2500.0),
        ("row1", 1600.0),
    ]
    assert _limits(api) == {
        "row1": (1800.0, "set"),
        "rack1": (1000.0, "file"),
        "rack2": (1500.0, "file"),
        "rack3": (2500.0, "set"),
    }
    assert store.current_budget().budget_w == 1000.0  # type: ignore[union-attr]


def test_a_domain_limit_set_through_the_api_is_the_heads(domain_api: Api) -> None:
    api = domain_api
    status, data = api.post("/v1/budget", {"domain": "rack1", "budget_w": 800.0, "reason": "PDU"})
    assert status == 200
    assert (data["domain"], data["budget_w"], data["set_by"], data["reason"]) == (
        "rack1", 800.0, "root", "PDU"
    )  # fmt: skip
    at_s = time.time() + 600
    body = {"domain": "rack1", "budget_w": 600.0, "effective_at_s": at_s}
    assert api.post("/v1/budget", body)[0] == 200
    status, view, _ = api.call("GET", "/v1/budget")
    rack1 = view["domains"][1]  # type: ignore[index]
    assert (rack1["name"], rack1["limit_w"], rack1["source"], rack1["file_limit_w"]) == (
        "rack1", 800.0, "set", 1000.0
    )  # fmt: skip
    assert rack1["set"]["reason"] == "PDU"
    assert [(c["budget_w"], c["effective_at_s"]) for c in rack1["scheduled"]] == [(600.0, at_s)]
    # the cluster's budget, its schedule and its history know nothing of the domains
    assert view["current"]["budget_w"] == 1000.0 and view["current"]["domain"] is None  # type: ignore[index]
    assert view["scheduled"] == [] and len(view["history"]) == 1  # type: ignore[arg-type]
    limits_w, _ = api.coordinator.domain_limits_in_force(at_s)
    assert list(limits_w) == [2000.0, 600.0, 1500.0, 3000.0]


def test_a_serving_jobs_latency_objective_is_kept_and_shown(api: Api) -> None:
    status, data = api.post("/v1/jobs", SERVING)
    assert (status, data["slo"]) == (200, {"percentile": 99.0, "latency_s": 0.25})
    assert api.post("/v1/jobs", {**JOB, "node": "n2", "gpus": [0]})[0] == 200  # not said: kept
    [job] = api.jobs()
    assert job["slo"] == {"percentile": 99.0, "latency_s": 0.25}
    stored = api.coordinator.store.job("42")
    assert stored is not None and (stored.slo_percentile, stored.slo_latency_s) == (99.0, 0.25)


def test_the_job_name_slurm_shows_is_kept_and_shown(api: Api) -> None:
    status, data = api.post("/v1/jobs", {**JOB, "job_name": "train-bert"})
    assert (status, data["job_name"]) == (200, "train-bert")
    assert api.post("/v1/jobs", {**JOB, "node": "n2", "gpus": [0]})[0] == 200  # not said: kept
    stored = api.coordinator.store.job("42")
    assert stored is not None and stored.job_name == "train-bert"
    [job] = api.jobs()
    assert job["job_name"] == "train-bert"


def test_malformed_and_oversized_bodies(api: Api) -> None:
    bad_bodies = {
        b"not json": "not valid JSON",
        b"[1]": "JSON object",
        json.dumps({**JOB, "extra": 1}).encode(): "extra",
        json.dumps({**JOB, "gpus": []}).encode(): "gpus",
        json.dumps({**JOB, "gpus": [0, 0]}).encode(): "twice",
        json.dumps({**JOB, "job_id": "abc"}).encode(): "job_id",
        json.dumps({**JOB, "node": "bad node"}).encode(): "node",
        json.dumps({**JOB, "user": "a b"}).encode(): "user",
        json.dumps({**JOB, "gpu_type": "Z9000"}).encode(): "unknown GPU type",
        json.dumps({**JOB, "deadline_s": "soon"}).encode(): "deadline_s",
        json.dumps({**JOB, "time_limit_s": -5}).encode(): "time_limit_s: must be > 0",
        json.dumps({**JOB, "time_limit_s": 0}).encode(): "time_limit_s: must be > 0",
        json.dumps({**JOB, "start_s": "yesterday"}).encode(): "start_s",
        json.dumps({**JOB, "slo_percentile": 99}).encode(): "give both or neither",
        json.dumps({**JOB, "slo_latency_s": 0.25}).encode(): "give both or neither",
        json.dumps({**SERVING, "slo_percentile": 49.9}).encode(): "in [50, 99.99], got 49.9",
        json.dumps({**SERVING, "slo_percentile": 100}).encode(): "in [50, 99.99], got 100.0",
        json.dumps({**SERVING, "slo_percentile": "p99"}).encode(): "slo_percentile: must be",
        json.dumps({**SERVING, "slo_latency_s": 0}).encode(): "in (0, 600], got 0.0",
        json.dumps({**SERVING, "slo_latency_s": 600.5}).encode(): "in (0, 600], got 600.5",
        json.dumps({**SERVING, "slo_latency_s": True}).encode(): "slo_latency_s: must be",
        json.dumps({**JOB, "job_name": ""}).encode(): "job_name: must be 1 to 200 printable",
        json.dumps({**JOB, "job_name": "a\nb"}).encode(): "job_name: must be 1 to 200 printable",
        json.dumps({**JOB, "job_name": "x" * 201}).encode(): "job_name: must be 1 to 200",
        json.dumps({**JOB, "job_name": 7}).encode(): "job_name: must be 1 to 200 printable",
    }
    for body, expected in bad_bodies.items():
        status, data, text = api.call("POST", "/v1/jobs", body)
        assert status == 400, body
        assert expected in _one_line_error(data, text), (body, data)
    assert api.jobs() == []
    big = b"x" * (70 * 1024)
    assert api.call("POST", "/v1/jobs", big)[0] == 413
    status, _, _ = api.call("POST", "/v1/jobs", b"", headers={"Content-Length": "99999999"})
    assert status == 413
    assert api.call("GET", "/v1/decisions?limit=0")[0] == 400
    assert api.call("GET", "/v1/decisions?limit=5")[0] == 200


def test_routes_health_and_metrics(api: Api) -> None:
    assert api.call("GET", "/v1/health", sign=False)[:2] == (200, {"ok": True})
    assert api.call("GET", "/v1/nothing")[0] == 404
    assert api.call("PUT", "/v1/jobs")[0] == 405
    assert api.call("GET", "/v1/jobs/42")[0] == 405
    api.post("/v1/jobs", JOB)
    api.coordinator.run_interval()
    status, _, text = api.call("GET", "/metrics", sign=False)
    assert status == 200
    assert 'cdgpc_jobs{state="registered"} 1' in text
    assert 'cdgpc_nodes{reachable="false"} 1' in text
    assert "cdgpc_uncontrolled_power_watts" in text
    # no per-job series: no label carries a job id (values may contain any digits)
    labels = [line.split("{", 1)[1] for line in text.splitlines() if "{" in line]
    assert not any('"42"' in label or "job=" in label for label in labels)


def test_head_client_signs_and_reports_refusals(api: Api) -> None:
    client = HeadClient(f"http://127.0.0.1:{api.server.port}", api.signer)
    assert client.post("/v1/jobs", JOB)["job_id"] == "42"
    assert [j["job_id"] for j in client.get("/v1/jobs")["jobs"]] == ["42"]
    assert client.get("/v1/decisions", {"limit": 3}) == {"decisions": []}
    with pytest.raises(HeadRefusedError, match=r"\(403\)"):
        client.post("/v1/budget", {"budget_w": 1000.0})
    unsigned = HeadClient(f"http://127.0.0.1:{api.server.port}", None)
    with pytest.raises(HeadRefusedError, match=r"\(401\)"):
        unsigned.get("/v1/status")


def test_admin_commands_talk_to_the_head(api: Api, tmp_path: Path) -> None:
    from click.testing import CliRunner  # noqa: PLC0415

    from slurm_cdgpc.cli import admin  # noqa: PLC0415

    key_file = tmp_path / "hmac.key"
    key_file.write_text(secrets.token_hex(32) + "\n")  # as `openssl rand -hex 32 > key` writes it
    key_file.chmod(0o600)
    if key_file.stat().st_uid != 0:
        pytest.skip("the HMAC key must be owned by root: run as root")
    key = HmacKey.load(key_file)  # read as the CLI reads it
    api.server.verifier = HmacVerifier(key)
    api.server.signer = HmacSigner(key)
    api.server.policy = AccessPolicy(hmac_is_admin=True)
    config = tmp_path / "cdgpc.toml"
    config.write_text(
        f'[head]\nurl = "http://127.0.0.1:{api.server.port}"\n'
        f'[store]\nurl = "sqlite:///{tmp_path / "admin.db"}"\n'
        f'[auth]\nmethod = "hmac"\nhmac_key_file = "{key_file}"\n'
    )
    runner = CliRunner()

    def run(group: object, *args: str) -> str:
        result = runner.invoke(group, [*args, "--config", str(config)])  # type: ignore[arg-type]
        assert result.exit_code == 0, result.output
        return result.output

    assert "450 kW" in run(admin.budget, "set", "450kW", "--reason", "test")
    assert api.coordinator.store.current_budget().budget_w == 450_000.0  # type: ignore[union-attr]
    run(admin.budget, "set", "1.2MW", "--at", "+1h")
    shown = json.loads(run(admin.budget, "show", "--json"))
    assert shown["current"]["budget_w"] == 450_000.0
    assert [b["budget_w"] for b in shown["scheduled"]] == [1_200_000.0]
    assert json.loads(run(admin.status, "--json"))["budget_w"] == 450_000.0
    assert json.loads(run(admin.jobs, "--json")) == {"jobs": []}
    assert "no nodes" in run(admin.nodes)
    assert "schema" in run(admin.db, "upgrade")
    bad = runner.invoke(admin.budget, ["set", "0W", "--config", str(config)])
    assert isinstance(bad.exception, InputError) and "positive" in str(bad.exception)
    assert len(shown["history"]) == 2  # the refused budget changed nothing


def test_a_request_cut_short_gets_a_one_line_answer_and_changes_nothing(api: Api) -> None:
    body = json.dumps(JOB).encode()
    head = (
        f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
        f"Authorization: {api.signer.sign('POST', '/v1/jobs', body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", api.server.port), timeout=10) as sock:
        sock.sendall(head + body[: len(body) // 2])
        sock.shutdown(socket.SHUT_WR)  # the peer is gone before its body is whole
        reply = b"".join(iter(lambda: sock.recv(65536), b""))
    status_line, _, rest = reply.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 400 Bad Request"
    assert json.loads(rest.partition(b"\r\n\r\n")[2]) == {
        "error": "body shorter than Content-Length"
    }
    assert api.jobs() == []


def test_simultaneous_registrations_are_each_answered_once_committed(api: Api) -> None:
    client = HeadClient(f"http://127.0.0.1:{api.server.port}", api.signer)
    answers: dict[str, object] = {}

    def register(i: int) -> None:
        job = {**JOB, "job_id": str(100 + i), "node": f"n{i}"}
        answers[job["job_id"]] = client.post("/v1/jobs", job)["job_id"]

    threads = [threading.Thread(target=register, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert answers == {str(100 + i): str(100 + i) for i in range(64)}
    assert len(api.jobs()) == 64


def test_a_registration_whose_answer_fails_to_build_still_gets_a_one_line_answer(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    import slurm_cdgpc.coordinator.api as head_api  # noqa: PLC0415

    def broken(*args: object) -> dict[str, object]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(head_api, "job_dict", broken)
    status, data, text = api.call("POST", "/v1/jobs", json.dumps(JOB).encode())
    assert status == 500
    assert "internal error" in _one_line_error(data, text)


def test_hmac_registrations_are_checked_and_committed_on_the_loop_thread(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HMAC blocks on nothing: the loop checks each registration itself and commits a turn's
    together, with no worker in between."""
    batches: list[tuple[str, int]] = []
    store = api.coordinator.store
    register_jobs = store.register_jobs

    def spy(batch: list[JobRegistration]) -> list[Job | InputError]:
        batches.append((threading.current_thread().name, len(batch)))
        return register_jobs(batch)

    monkeypatch.setattr(store, "register_jobs", spy)
    status, data = api.post("/v1/jobs", JOB)
    assert (status, data["job_id"]) == (200, "42")
    assert batches == [("http-loop", 1)]
    assert [j["job_id"] for j in api.jobs()] == ["42"]


def test_a_registration_waiting_for_a_busy_store_leaves_the_loop_serving(
    api: Api, tmp_path: Path
) -> None:
    """Another writer holds the database (the control loop's interval, another process): the
    turn's registrations are handed to a worker, which waits; the loop answers everyone else."""
    writer = sqlite3.connect(tmp_path / "head.db", isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    answers: list[tuple[int, dict[str, object]]] = []
    prolog = threading.Thread(target=lambda: answers.append(api.post("/v1/jobs", JOB)))
    try:
        prolog.start()
        deadline = time.monotonic() + 10
        while not api.coordinator.registrations.group_commit.busy:  # a worker leads it, waiting
            assert time.monotonic() < deadline, "the registration was never handed to a worker"
            time.sleep(0.01)
        assert api.call("GET", "/v1/health")[0] == 200  # the loop is not the one waiting
        assert api.call("GET", "/metrics")[0] == 200
        assert api.jobs() == [] and answers == []  # not committed, so not acknowledged
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    prolog.join(10)
    assert [(status, data["job_id"]) for status, data in answers] == [(200, "42")]
    assert [j["job_id"] for j in api.jobs()] == ["42"]
