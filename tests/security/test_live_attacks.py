"""Every endpoint of cdgpcd and cdgpc-noded under every attack class, on real processes.

For each endpoint in `ENDPOINTS` and each attack class the test sends the hostile variants,
asserts each is refused with the right status and a one-line JSON error, and compares a
snapshot of everything the daemons keep (jobs, nodes, budget history, the agent's clock locks)
before and after: a refusal must change nothing. The table is checked against the code (the
route literals in the servers, the head's documented route table) and against the live servers
(any method not in the table must be refused), so a new endpoint fails here until it is added.

With HMAC the uid in a credential is only the signer's claim (see `slurm_cdgpc.transport.auth`):
every key holder may do node operations, and admin operations only with ``hmac_is_admin``. The
wrong-uid class therefore runs here on the budget endpoint of a head without
``hmac_is_admin``; per-user refusals on every endpoint need MUNGE (``test_live_munge.py``).
"""

from __future__ import annotations

import ast
import functools
import json
import re
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from slurm_cdgpc.agent import server as agent_server
from slurm_cdgpc.coordinator import api as head_api
from slurm_cdgpc.localcluster import free_port
from slurm_cdgpc.transport.auth import HmacKey, HmacSigner
from slurm_cdgpc.wire.protocol import HOLD_PATH, MIG_PATH, RELEASE_PATH
from tests.evidence import record
from tests.security.live import (
    Daemon,
    Keys,
    Reply,
    head_and_agent,
    make_keys,
    raw_request,
    running,
    start_agent,
    start_head,
    stop_all,
)

pytestmark = [pytest.mark.security, pytest.mark.live]

REPO = Path(__file__).resolve().parents[2]

HEAD_BODY_CAP = 64 * 1024
AGENT_BODY_CAP = 1024 * 1024
#: clocks the simulated A100 supports (15 MHz steps from 210 MHz)
MHZ_A, MHZ_B, MHZ_C = 1200, 1005, 1110


@dataclass(frozen=True)
class Endpoint:
    server: str  # "head" or "agent"
    method: str
    path: str  # a template: {id} is a registered job id
    auth: str  # "none", "read", "node" or "admin"

    @property
    def name(self) -> str:
        return f"{self.server} {self.method} {self.path}"

    @property
    def has_body(self) -> bool:
        return self.method == "POST"

    @property
    def body_cap(self) -> int:
        return HEAD_BODY_CAP if self.server == "head" else AGENT_BODY_CAP


#: POSTs that answer and record nothing (the admission verdict, where a job's MIG instances
#: are): refused, an attack on them gets no answer; accepted, it changes nothing either
ANSWERS_ONLY = frozenset({"/v1/admission", MIG_PATH})

ENDPOINTS = (
    Endpoint("head", "GET", "/v1/health", "none"),
    Endpoint("head", "GET", "/metrics", "none"),
    Endpoint("head", "GET", "/v1/jobs", "read"),
    Endpoint("head", "POST", "/v1/jobs", "node"),
    Endpoint("head", "DELETE", "/v1/jobs/{id}", "node"),
    Endpoint("head", "GET", "/v1/nodes", "read"),
    Endpoint("head", "POST", "/v1/nodes", "node"),
    Endpoint("head", "GET", "/v1/budget", "read"),
    Endpoint("head", "POST", "/v1/budget", "admin"),
    Endpoint("head", "GET", "/v1/status", "read"),
    Endpoint("head", "GET", "/v1/decisions", "read"),
    Endpoint("head", "POST", "/v1/admission", "node"),
    Endpoint("agent", "GET", "/v1/health", "none"),
    Endpoint("agent", "GET", "/metrics", "none"),
    Endpoint("agent", "POST", "/v1/exchange", "node"),
    Endpoint("agent", "POST", "/v1/release", "node"),
    Endpoint("agent", "POST", "/v1/hold", "node"),
    Endpoint("agent", "POST", "/v1/mig", "node"),
)
AUTHENTICATED = [e for e in ENDPOINTS if e.auth != "none"]
WITH_BODY = [e for e in AUTHENTICATED if e.has_body]
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS")
#: the job every attack targets: registered at the head, holding GPU 0 at the agent
VICTIM_JOB = "100"


def _ids(endpoints: list[Endpoint]) -> list[str]:
    return [e.name for e in endpoints]


# -- the cluster under attack ------------------------------------------------------------------


@dataclass
class Cluster:
    head: Daemon
    agent: Daemon
    keys: Keys

    def daemon(self, endpoint: Endpoint) -> Daemon:
        return self.head if endpoint.server == "head" else self.agent

    def state(self) -> dict[str, Any]:
        """Everything the daemons keep, read through the head's API and the agent's state file."""
        jobs = self.head.ok("GET", "/v1/jobs")["jobs"]
        nodes = self.head.ok("GET", "/v1/nodes")["nodes"]
        budget = self.head.ok("GET", "/v1/budget")
        state_file = Path(self.agent.extra["state"])
        return {
            "jobs": sorted(
                (j["job_id"], j["user"], j["state"], j["deadline_s"], json.dumps(j["gpus"]))
                for j in jobs
            ),
            "nodes": sorted((n["name"], n["url"], n["gpu_type"]) for n in nodes),
            "budget": budget,
            "locks": json.loads(state_file.read_text())["locks"] if state_file.exists() else None,
        }

    def check_alive(self) -> None:
        for daemon in running([self.head, self.agent]):
            assert "Traceback" not in daemon.text(), daemon.text()[-3000:]


def exchange_body(
    setpoints: list[tuple[int, str, int]], release: list[int], node: str = "node1"
) -> bytes:
    """An exchange for ``node`` (the cluster's agent by default: any other node refuses it)."""
    return json.dumps(
        {
            "version": 1,
            "node": node,
            "interval": 1,
            "lease_expires_s": time.time() + 3600,
            "setpoints": [
                {"gpu": gpu, "job_id": job, "graphics_mhz": mhz} for gpu, job, mhz in setpoints
            ],
            "release": release,
        }
    ).encode()


def _settle(agent: Daemon, setpoints: list[tuple[int, str, int]]) -> None:
    body = exchange_body(setpoints, [], node=agent.name)
    reply = agent.ok("POST", "/v1/exchange", json.loads(body))
    assert reply["refused"] == [], reply


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with head_and_agent(tmp_path_factory.mktemp("security")) as (head, agent, keys):
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: the head's view stays still
        head.ok("POST", "/v1/nodes", {"node": "ghost", "url": dead})
        head.ok("POST", "/v1/budget", {"budget_w": 9000.0, "reason": "security setup"})
        job = {"job_id": VICTIM_JOB, "user": "root", "node": "ghost", "gpus": [0]}
        head.ok("POST", "/v1/jobs", job)
        _settle(agent, [(0, VICTIM_JOB, MHZ_A), (1, "101", MHZ_B)])
        yield Cluster(head, agent, keys)


@pytest.fixture(scope="module")
def non_admin_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A head whose HMAC key holders are not admins (``hmac_is_admin = false``)."""
    home = tmp_path_factory.mktemp("security-non-admin")
    head = start_head(home, make_keys(home), hmac_is_admin=False, name="head-non-admin")
    try:
        yield head
    finally:
        stop_all([head])


# -- what each endpoint is asked to do by an attacker --------------------------------------------


def attack_path(endpoint: Endpoint) -> str:
    if endpoint.path == "/v1/decisions":
        return "/v1/decisions?limit=5"
    return endpoint.path.replace("{id}", VICTIM_JOB)


def attack_body(endpoint: Endpoint) -> bytes:
    """A body that would change the state if it were accepted."""
    if endpoint.server == "agent":
        if endpoint.path == RELEASE_PATH:
            return json.dumps({"job_id": VICTIM_JOB}).encode()
        if endpoint.path == HOLD_PATH:  # the victim's GPU once the victim is released
            return json.dumps({"job_id": "666", "gpus": [0]}).encode()
        if endpoint.path == MIG_PATH:  # records nothing when accepted, like the admission
            return json.dumps({"job_id": "666", "names": ["MIG-0a1b"]}).encode()
        return exchange_body([(0, "666", 1410)], [1])
    bodies: dict[str, object] = {
        "/v1/jobs": {"job_id": "666", "user": "root", "node": "ghost", "gpus": [1]},
        "/v1/nodes": {"node": "evil", "url": "http://127.0.0.1:9"},
        "/v1/budget": {"budget_w": 1.0, "reason": "attack"},
        # records nothing when accepted: a refusal must still change nothing and log nothing
        "/v1/admission": {"job_id": "666", "user": "root", "gpus": 1, "nodes": ["ghost"]},
    }
    return json.dumps(bodies[endpoint.path]).encode() if endpoint.has_body else b""


@dataclass(frozen=True)
class Attempt:
    what: str
    reply: Reply
    expected: tuple[int, ...]


def _send(
    daemon: Daemon,
    endpoint: Endpoint,
    *,
    credentials: list[str],
    path: str | None = None,
    body: bytes | None = None,
    **kwargs: Any,
) -> Reply:
    return raw_request(
        daemon.port,
        endpoint.method,
        attack_path(endpoint) if path is None else path,
        attack_body(endpoint) if body is None else body,
        credentials=credentials,
        **kwargs,
    )


def _judge(
    cluster: Cluster,
    cls: str,
    endpoint: Endpoint,
    attack: Callable[[Daemon], list[Attempt]],
    before: dict[str, Any] | None = None,
) -> None:
    """Run one attack class on one endpoint, record the figures, then assert them."""
    if before is None:
        before = cluster.state()
    attempts = attack(cluster.daemon(endpoint))
    after = cluster.state()
    refused = [a for a in attempts if a.reply.status in a.expected]
    record(
        "attack",
        f"{cls}:{endpoint.name}",
        tried=len(attempts),
        refused=len(refused),
        accepted=sum(1 for a in attempts if a.reply.status < 400),
        state_changed=int(after != before),
    )
    assert attempts
    for a in attempts:
        assert a.reply.status in a.expected, (
            f"{cls} {endpoint.name} ({a.what}): HTTP {a.reply.status} {a.reply.body[:300]!r}"
        )
        a.reply.error()
    assert after == before, f"{cls} {endpoint.name} changed the state"
    cluster.check_alive()


# -- the table is complete ---------------------------------------------------------------------


def _route_literals(path: Path) -> set[str]:
    """Every string constant in a module that looks like a route (regex groups become {id})."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if re.fullmatch(r"/(v1/|metrics)\S*", text):
                found.add(re.sub(r"\(\?P<\w+>[^)]*\)", "{id}", text))
    return found


def test_the_table_covers_every_route_in_the_code() -> None:
    head_paths = {e.path for e in ENDPOINTS if e.server == "head"}
    agent_paths = {e.path for e in ENDPOINTS if e.server == "agent"}
    api = REPO / "slurm_cdgpc" / "coordinator" / "api.py"
    assert _route_literals(api) <= head_paths, "a head route is missing from ENDPOINTS"
    server = REPO / "slurm_cdgpc" / "agent" / "server.py"
    assert _route_literals(server) | {RELEASE_PATH, HOLD_PATH, MIG_PATH} <= agent_paths, (
        "an agent route is missing"
    )

    documented = set(re.findall(r"``([A-Z]+) (/\S+)``", head_api.__doc__ or ""))
    assert documented == {(e.method, e.path) for e in ENDPOINTS if e.server == "head"}
    routes = set(agent_server._ROUTES.items())
    assert routes == {(e.path, e.method) for e in ENDPOINTS if e.server == "agent"}


def test_every_other_method_and_path_is_refused(cluster: Cluster) -> None:
    before = cluster.state()
    tried = refused = 0
    for server, daemon in (("head", cluster.head), ("agent", cluster.agent)):
        table = [e for e in ENDPOINTS if e.server == server]
        for path in {e.path for e in table}:
            listed = {e.method for e in table if e.path == path}
            for method in METHODS:
                concrete = path.replace("{id}", VICTIM_JOB)
                if method in listed:
                    auth = next(e.auth for e in table if e.path == path and e.method == method)
                    reply = raw_request(daemon.port, method, concrete)
                    assert reply.status == (200 if auth == "none" else 401), (server, method, path)
                    continue
                tried += 1
                reply = raw_request(daemon.port, method, concrete, b"{}")
                refused += reply.status in (405, 501)
                assert reply.status in (405, 501), (server, method, path, reply.status)
        for path in ("/v1/admin", "/v1/budget/", "/v1//budget", "/v1/../v1/budget", "/v2/jobs"):
            tried += 1
            reply = raw_request(daemon.port, "GET", path)
            refused += reply.status == 404
            assert reply.status == 404, (server, path, reply.status)
    record("attack", "unlisted-route:all", tried=tried, refused=refused, state_changed=0)
    assert cluster.state() == before
    cluster.check_alive()


# -- the attack classes ------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", AUTHENTICATED, ids=_ids(AUTHENTICATED))
def test_no_credential(cluster: Cluster, endpoint: Endpoint) -> None:
    def attack(d: Daemon) -> list[Attempt]:
        return [Attempt("no Authorization header", _send(d, endpoint, credentials=[]), (401,))]

    _judge(cluster, "no-credential", endpoint, attack)


@pytest.mark.parametrize("endpoint", AUTHENTICATED, ids=_ids(AUTHENTICATED))
def test_malformed_credential(cluster: Cluster, endpoint: Endpoint) -> None:
    def attack(d: Daemon) -> list[Attempt]:
        good = d.signer.sign(endpoint.method, attack_path(endpoint), attack_body(endpoint))
        uid, gid, stamp, nonce, mac = good.split(" ", 1)[1].split(":")
        variants = {
            "empty": "",
            "scheme only": "hmac-sha256",
            "other scheme": "Bearer " + mac,
            "munge scheme": "munge MUNGE:AAAA:",
            "truncated": good[:-1],
            "a field missing": f"hmac-sha256 {uid}:{stamp}:{nonce}:{mac}",
            "uid out of range": f"hmac-sha256 4294967295:{gid}:{stamp}:{nonce}:{mac}",
            "non-hex nonce": f"hmac-sha256 {uid}:{gid}:{stamp}:{'z' * 32}:{mac}",
            "negative time": f"hmac-sha256 {uid}:{gid}:-{stamp}:{nonce}:{mac}",
            "latin-1": good + "\xe9",
        }
        attempts = [
            Attempt(what, _send(d, endpoint, credentials=[cred]), (401,))
            for what, cred in variants.items()
        ]
        second = d.signer.sign(endpoint.method, attack_path(endpoint), attack_body(endpoint))
        attempts.append(
            Attempt(
                "two Authorization headers", _send(d, endpoint, credentials=[good, second]), (401,)
            )
        )
        return attempts

    _judge(cluster, "malformed-credential", endpoint, attack)


@pytest.mark.parametrize("endpoint", AUTHENTICATED, ids=_ids(AUTHENTICATED))
def test_forged(cluster: Cluster, endpoint: Endpoint) -> None:
    def attack(d: Daemon) -> list[Attempt]:
        path, body = attack_path(endpoint), attack_body(endpoint)
        wrong_key = HmacSigner(HmacKey(b"x" * 64), uid=0, gid=0).sign(endpoint.method, path, body)
        good = d.signer.sign(endpoint.method, path, body)
        flipped = good[:-1] + ("0" if good[-1] != "0" else "1")
        uid, rest = good.split(" ", 1)[1].split(":", 1)
        other_uid = f"hmac-sha256 {int(uid) + 1}:{rest}"
        return [
            Attempt(what, _send(d, endpoint, credentials=[cred]), (401,))
            for what, cred in (
                ("wrong key", wrong_key),
                ("MAC changed", flipped),
                ("claimed uid changed", other_uid),
            )
        ]

    _judge(cluster, "forged", endpoint, attack)


@pytest.mark.parametrize("endpoint", AUTHENTICATED, ids=_ids(AUTHENTICATED))
def test_tampered_after_signing(cluster: Cluster, endpoint: Endpoint) -> None:
    """The credential is genuine but made for another body, path or method."""

    def attack(d: Daemon) -> list[Attempt]:
        path, body = attack_path(endpoint), attack_body(endpoint)
        attempts = []
        if endpoint.has_body:
            signed_for = body.replace(b"}", b', "x": 1}', 1)
            cred = d.signer.sign(endpoint.method, path, signed_for)
            attempts.append(Attempt("body changed", _send(d, endpoint, credentials=[cred]), (401,)))
            cred = d.signer.sign(endpoint.method, path, b"")
            attempts.append(Attempt("body added", _send(d, endpoint, credentials=[cred]), (401,)))
        other_path = path + ("&x=1" if "?" in path else "?x=1")
        if endpoint.path == "/v1/jobs/{id}":
            other_path = "/v1/jobs/999"
        cred = d.signer.sign(endpoint.method, other_path, body)
        attempts.append(Attempt("path changed", _send(d, endpoint, credentials=[cred]), (401,)))
        other_method = "PUT" if endpoint.method != "PUT" else "POST"
        cred = d.signer.sign(other_method, path, body)
        attempts.append(Attempt("method changed", _send(d, endpoint, credentials=[cred]), (401,)))
        return attempts

    _judge(cluster, "tampered", endpoint, attack)


def _shifted_time(shift_s: float) -> float:
    return time.time() + shift_s


@pytest.mark.parametrize("endpoint", AUTHENTICATED, ids=_ids(AUTHENTICATED))
def test_expired(cluster: Cluster, endpoint: Endpoint) -> None:
    def attack(d: Daemon) -> list[Attempt]:
        attempts = []
        for what, shift_s in (("signed 2 min ago", -120.0), ("signed 1 min ahead", 60.0)):
            signer = cluster.keys.signer(clock=functools.partial(_shifted_time, shift_s))
            cred = signer.sign(endpoint.method, attack_path(endpoint), attack_body(endpoint))
            attempts.append(Attempt(what, _send(d, endpoint, credentials=[cred]), (401,)))
        return attempts

    _judge(cluster, "expired", endpoint, attack)


def _signed(d: Daemon, method: str, path: str, payload: object | None) -> tuple[str, bytes]:
    body = b"" if payload is None else json.dumps(payload).encode()
    return d.signer.sign(method, path, body), body


def _accept(d: Daemon, method: str, path: str, cred: str, body: bytes) -> None:
    reply = raw_request(d.port, method, path, body, credentials=[cred])
    assert reply.status == 200, (method, path, reply.status, reply.body[:300])


@pytest.mark.parametrize("endpoint", AUTHENTICATED, ids=_ids(AUTHENTICATED))
def test_replayed(cluster: Cluster, endpoint: Endpoint) -> None:
    """A request that was accepted once is sent again when it would undo what came after it."""
    d = cluster.daemon(endpoint)
    head, agent = cluster.head, cluster.agent
    path = attack_path(endpoint)
    if endpoint.name == "head POST /v1/jobs":
        job = {"job_id": "200", "user": "root", "node": "ghost", "gpus": [1]}
        cred, body = _signed(d, "POST", path, job)
        _accept(d, "POST", path, cred, body)
        head.ok("DELETE", "/v1/jobs/200")
    elif endpoint.name == "head DELETE /v1/jobs/{id}":
        job = {"job_id": "201", "user": "root", "node": "ghost", "gpus": [1]}
        head.ok("POST", "/v1/jobs", job)
        path = "/v1/jobs/201"
        cred, body = _signed(d, "DELETE", path, None)
        _accept(d, "DELETE", path, cred, body)
        head.ok("POST", "/v1/jobs", job)
    elif endpoint.name == "head POST /v1/nodes":
        cred, body = _signed(d, "POST", path, {"node": "moved", "url": "http://127.0.0.1:7"})
        _accept(d, "POST", path, cred, body)
        head.ok("POST", path, {"node": "moved", "url": "http://127.0.0.1:8"})
    elif endpoint.name == "head POST /v1/budget":
        cred, body = _signed(d, "POST", path, {"budget_w": 7000.0, "reason": "first"})
        _accept(d, "POST", path, cred, body)
        head.ok("POST", path, {"budget_w": 9000.0, "reason": "second"})
    elif endpoint.name == "head POST /v1/admission":
        ask = {"job_id": "204", "user": "root", "gpus": 1, "nodes": ["ghost"]}
        cred, body = _signed(d, "POST", path, ask)
        _accept(d, "POST", path, cred, body)
    elif endpoint.name == "agent POST /v1/exchange":
        cred = d.signer.sign("POST", path, body := exchange_body([(1, "101", MHZ_C)], []))
        _accept(d, "POST", path, cred, body)
        _settle(agent, [(1, "101", MHZ_B)])
    elif endpoint.name == "agent POST /v1/release":
        _settle(agent, [(1, "102", MHZ_C)])
        cred, body = _signed(d, "POST", path, {"job_id": "102"})
        _accept(d, "POST", path, cred, body)
        _settle(agent, [(1, "102", MHZ_C)])
    elif endpoint.name == "agent POST /v1/hold":
        agent.ok("POST", RELEASE_PATH, {"job_id": "101"})
        cred, body = _signed(d, "POST", path, {"job_id": "103", "gpus": [1]})
        _accept(d, "POST", path, cred, body)
        agent.ok("POST", RELEASE_PATH, {"job_id": "103"})  # the job ended: GPU 1 is free
    elif endpoint.name == "agent POST /v1/mig":
        cred, body = _signed(d, "POST", path, {"job_id": "104", "names": ["MIG-0a1b"]})
        _accept(d, "POST", path, cred, body)
    else:
        assert endpoint.method == "GET", endpoint
        cred, body = _signed(d, "GET", path, None)
        _accept(d, "GET", path, cred, body)

    def attack(d: Daemon) -> list[Attempt]:
        reply = raw_request(d.port, endpoint.method, path, body, credentials=[cred])
        return [Attempt("sent again", reply, (401,))]

    _judge(cluster, "replayed", endpoint, attack)
    if endpoint.name in ("agent POST /v1/release", "agent POST /v1/hold"):
        _settle(agent, [(1, "101", MHZ_B)])


@pytest.mark.parametrize("endpoint", AUTHENTICATED, ids=_ids(AUTHENTICATED))
def test_oversized(cluster: Cluster, endpoint: Endpoint) -> None:
    def attack(d: Daemon) -> list[Attempt]:
        long_credential = "hmac-sha256 " + "0" * 5000
        attempts = [
            Attempt(
                "5000-character credential",
                _send(d, endpoint, credentials=[long_credential]),
                (401,),
            ),
            Attempt(
                "2000-character path",
                _send(d, endpoint, credentials=[], path=attack_path(endpoint) + "?" + "a" * 2000),
                (401, 404) if endpoint.server == "agent" else (401,),
            ),
        ]
        if endpoint.has_body:
            big = attack_body(endpoint) + b" " * endpoint.body_cap
            cred = d.signer.sign(endpoint.method, attack_path(endpoint), big)
            reply = _send(
                d, endpoint, credentials=[cred], content_length=str(len(big)), send_body=False
            )
            attempts.append(Attempt(f"body over {endpoint.body_cap} bytes", reply, (413,)))
            reply = _send(d, endpoint, credentials=[cred], content_length="9" * 12, send_body=False)
            attempts.append(Attempt("Content-Length 10^12", reply, (413,)))
        return attempts

    _judge(cluster, "oversized", endpoint, attack)


REQUIRED: dict[str, tuple[str, ...]] = {
    "/v1/jobs": ("job_id", "user", "node", "gpus"),
    "/v1/nodes": ("node", "url"),
    "/v1/budget": ("budget_w",),
    "/v1/admission": ("job_id", "user", "gpus", "nodes"),
    "/v1/exchange": ("version", "node", "interval", "lease_expires_s", "setpoints", "release"),
    "/v1/release": ("job_id",),
    "/v1/hold": ("job_id", "gpus"),
    "/v1/mig": ("job_id", "names"),
}
SPECIFIC: dict[str, list[dict[str, object]]] = {
    "/v1/admission": [
        {"gpus": 0},
        {"gpus": -2},
        {"nodes": []},
        {"nodes": ["../etc"]},
        {"deadline_s": "tomorrow"},
    ],
    "/v1/jobs": [{"gpus": []}, {"gpus": [0, 0]}, {"gpus": [-1]}, {"gpus": [5000]}, {"job_id": 7}],
    "/v1/nodes": [{"url": "ftp://x"}, {"url": ""}, {"node": ""}],
    "/v1/budget": [
        {"budget_w": 0},
        {"budget_w": -5.0},
        {"budget_w": "450kW"},
        {"effective_at_s": "now"},
    ],
    "/v1/exchange": [
        {"version": 2},
        {"interval": -1},
        {"lease_expires_s": 1e300},
        {"release": [0, 0]},
        {"node": "../etc"},
    ],
    "/v1/release": [{"job_id": ""}, {"job_id": 100}],
    "/v1/hold": [{"gpus": []}, {"gpus": [-1]}, {"gpus": [True]}, {"gpus": "0"}, {"job_id": 100}],
    "/v1/mig": [
        {"names": []},
        {"names": ["GPU-0a1b"]},
        {"names": ["MIG-0a1b/../x"]},
        {"names": "MIG-0a1b"},
        {"job_id": 100},
    ],
}


def _bad_bodies(endpoint: Endpoint) -> dict[str, bytes]:
    """Bodies that are not what the endpoint accepts (each is signed: only parsing refuses)."""
    body = attack_body(endpoint)
    good = json.loads(body)
    key = next(iter(good))
    depth = 30_000  # under the head's body cap: the parser, not the cap, must refuse it
    bodies = {
        "empty": b"",
        "not JSON": b"budget please",
        "truncated": body[: len(body) // 2],
        "array": b"[]",
        "null": b"null",
        "not UTF-8": b'{"\xff": 1}',
        "NaN": body.replace(b"}", b', "n": NaN}', 1),
        "duplicate key": b"{" + json.dumps(key).encode() + b": 0, " + body[1:],
        "unknown field": json.dumps({**good, "admin": True}).encode(),
        "deeply nested": b"[" * depth + b"]" * depth,
    }
    for name in good:
        if name in REQUIRED[endpoint.path]:
            without = {k: v for k, v in good.items() if k != name}
            bodies[f"{name} missing"] = json.dumps(without).encode()
        for label, value in (("true", True), ("an object", {"$ne": 1}), ("nested lists", [[1]])):
            bodies[f"{name} is {label}"] = json.dumps({**good, name: value}).encode()
    for i, change in enumerate(SPECIFIC[endpoint.path]):
        bodies[f"bad value {i}"] = json.dumps({**good, **change}).encode()
    return bodies


@pytest.mark.parametrize("endpoint", WITH_BODY, ids=_ids(WITH_BODY))
def test_malformed_body(cluster: Cluster, endpoint: Endpoint) -> None:
    def attack(d: Daemon) -> list[Attempt]:
        path = attack_path(endpoint)
        attempts = []
        for what, body in _bad_bodies(endpoint).items():
            cred = d.signer.sign(endpoint.method, path, body)
            reply = _send(d, endpoint, credentials=[cred], body=body)
            attempts.append(Attempt(what, reply, (400,)))
        body = attack_body(endpoint)
        cred = d.signer.sign(endpoint.method, path, body)
        # the server refuses these before reading a body: send none, or the close of a
        # socket with unread data could reset the connection before the answer is read
        framing: dict[str, tuple[dict[str, Any], tuple[int, ...]]] = {
            "no Content-Length": ({"content_length": None}, (411,)),
            "chunked": ({"headers": {"Transfer-Encoding": "chunked"}}, (501,)),
            "Content-Length not a number": ({"content_length": "12abc"}, (400,)),
            "negative Content-Length": ({"content_length": "-1"}, (400,)),
        }
        for what, (kwargs, expected) in framing.items():
            cred = d.signer.sign(endpoint.method, path, body)
            reply = _send(d, endpoint, credentials=[cred], send_body=False, **kwargs)
            attempts.append(Attempt(what, reply, expected))
        return attempts

    _judge(cluster, "malformed-body", endpoint, attack)


@pytest.mark.parametrize(
    "endpoint",
    [e for e in AUTHENTICATED if not e.has_body],
    ids=_ids([e for e in AUTHENTICATED if not e.has_body]),
)
def test_malformed_request(cluster: Cluster, endpoint: Endpoint) -> None:
    """Endpoints without a body: a bad job id or query, signed, is still refused."""

    def attack(d: Daemon) -> list[Attempt]:
        if endpoint.path == "/v1/jobs/{id}":
            paths = ["/v1/jobs/abc", "/v1/jobs/0", "/v1/jobs/1;id", "/v1/jobs/%2e%2e", "/v1/jobs/"]
            expected: tuple[int, ...] = (400, 404)
        elif endpoint.path == "/v1/decisions":
            paths = [f"/v1/decisions?limit={v}" for v in ("abc", "0", "-1", "1001", "1e3", "%00")]
            expected = (400,)
        else:
            paths = [endpoint.path + "?limit=abc&x=%00"]
            expected = (200,)  # no parameters: a query is ignored, and a GET changes nothing
        attempts = []
        for path in paths:
            cred = d.signer.sign(endpoint.method, path, b"")
            reply = raw_request(d.port, endpoint.method, path, credentials=[cred])
            attempts.append(Attempt(path, reply, expected))
        return attempts

    if endpoint.path in ("/v1/jobs/{id}", "/v1/decisions"):
        _judge(cluster, "malformed-body", endpoint, attack)
    else:
        before = cluster.state()
        for a in attack(cluster.daemon(endpoint)):
            assert a.reply.status == 200, (a.what, a.reply.status)
        assert cluster.state() == before


def test_wrong_uid_may_not_change_the_budget(non_admin_head: Daemon, tmp_path: Path) -> None:
    """With ``hmac_is_admin = false`` no HMAC principal is an admin, whatever uid it claims."""
    head = non_admin_head
    endpoint = next(e for e in ENDPOINTS if e.name == "head POST /v1/budget")
    before = head.ok("GET", "/v1/budget")
    attempts = []
    for uid in (65534, 1000, 0):
        signer = head.keys.signer(uid=uid, gid=uid)
        reply = head.request("POST", "/v1/budget", attack_body(endpoint), signer=signer)
        attempts.append(reply)
    changed = head.ok("GET", "/v1/budget") != before
    refused = sum(r.status == 403 for r in attempts)
    record(
        "attack",
        f"wrong-uid:{endpoint.name} (hmac)",
        tried=len(attempts),
        refused=refused,
        accepted=sum(r.status < 400 for r in attempts),
        state_changed=int(changed),
    )
    for reply in attempts:
        assert reply.status == 403, reply.body
        assert "may not perform admin operations" in reply.error()
    assert not changed
    # the same head still lets a key holder do node operations
    assert head.ok("POST", "/v1/nodes", {"node": "n1", "url": "http://127.0.0.1:9"})["name"] == "n1"


# -- findings and controls ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def second_agent(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    agent = start_agent(tmp_path_factory.mktemp("security-node2"), cluster.keys, name="node2")
    try:
        yield agent
    finally:
        stop_all([agent])


def _non_loopback_ipv4() -> str | None:
    """This host's address on its default route (a UDP connect sends nothing), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = str(s.getsockname()[0])
    return None if address.startswith("127.") else address


def test_release_from_another_host_is_refused(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``/v1/release`` is the node's own Epilog's: a valid credential from elsewhere is refused."""
    address = _non_loopback_ipv4()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address to send from")
    home = tmp_path_factory.mktemp("security-remote")
    agent = start_agent(home, cluster.keys, name="node3", listen_address=address)
    try:
        _settle(agent, [(0, VICTIM_JOB, MHZ_A)])
        state = Path(agent.extra["state"])
        before = state.read_text()
        body = json.dumps({"job_id": VICTIM_JOB}).encode()
        reply = agent.request("POST", RELEASE_PATH, body)
        changed = state.read_text() != before
        record(
            "attack",
            "wrong-origin:agent POST /v1/release",
            tried=1,
            refused=int(reply.status == 403),
            accepted=int(reply.status < 400),
            state_changed=int(changed),
        )
        assert reply.status == 403 and "own Epilog" in reply.error()
        assert not changed
    finally:
        stop_all([agent])


def test_an_exchange_for_one_node_is_refused_by_another(
    cluster: Cluster, second_agent: Daemon
) -> None:
    body = exchange_body([(0, "300", MHZ_C)], [])
    cred = cluster.agent.signer.sign("POST", "/v1/exchange", body)
    _accept(cluster.agent, "POST", "/v1/exchange", cred, body)
    _settle(cluster.agent, [(0, VICTIM_JOB, MHZ_A), (1, "101", MHZ_B)])
    state = Path(second_agent.extra["state"])
    before = state.read_text() if state.exists() else None
    reply = raw_request(second_agent.port, "POST", "/v1/exchange", body, credentials=[cred])
    record(
        "attack",
        "replayed:agent POST /v1/exchange (to another node)",
        tried=1,
        refused=int(reply.status == 401),
        accepted=int(reply.status < 400),
        state_changed=int((state.read_text() if state.exists() else None) != before),
    )
    assert reply.status == 401


@pytest.mark.parametrize("server", ["head", "agent"])
def test_refusals_before_routing_are_one_line_json(cluster: Cluster, server: str) -> None:
    d = cluster.head if server == "head" else cluster.agent
    replies = [
        raw_request(d.port, "PATCH", "/v1/jobs"),
        raw_request(d.port, "GET", "/v1/status?" + "a" * 70_000),
        raw_request(d.port, "GET", "/v1/status", headers={"X-Long": "a" * 70_000}),
    ]
    assert [r.status for r in replies] == [501, 414, 431]
    for reply in replies:
        reply.error()


def test_a_query_with_many_fields_is_a_bad_request(non_admin_head: Daemon) -> None:
    query = "&".join(f"f{i}=1" for i in range(11))
    reply = raw_request(non_admin_head.port, "GET", f"/v1/health?{query}")
    assert reply.status == 400, (reply.status, reply.body)


def test_a_credential_captured_before_a_restart_is_refused_after_it(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The replay cache is in memory; the restarted agent refuses what was signed before."""
    home = tmp_path_factory.mktemp("security-restart")
    agent = start_agent(home, cluster.keys, name="node4")
    body = exchange_body([(0, "400", MHZ_A)], [], node="node4")
    cred = agent.signer.sign("POST", "/v1/exchange", body)
    try:
        _accept(agent, "POST", "/v1/exchange", cred, body)
    finally:
        stop_all([agent])
    time.sleep(1.0)  # the next start is in a later second than the signature
    agent = start_agent(home, cluster.keys, name="node4")
    try:
        state = Path(agent.extra["state"])
        before = state.read_text() if state.exists() else None
        reply = raw_request(agent.port, "POST", "/v1/exchange", body, credentials=[cred])
        changed = (state.read_text() if state.exists() else None) != before
        record(
            "attack",
            "replayed:agent POST /v1/exchange (after a restart)",
            tried=1,
            refused=int(reply.status == 401),
            accepted=int(reply.status < 400),
            state_changed=int(changed),
        )
        assert reply.status == 401 and "before this service started" in reply.error()
        assert not changed
        _settle(agent, [(0, "400", MHZ_A)])  # a request signed now passes
    finally:
        stop_all([agent])


def test_the_attack_requests_would_change_the_state_if_accepted(cluster: Cluster) -> None:
    """The control: signed properly, each attack request is accepted and changes the snapshot.

    So "refused and nothing changed" above means the defence worked, not that the request was
    harmless. Runs last: it leaves the cluster changed.
    """
    changing = [e for e in AUTHENTICATED if e.method != "GET"]
    # the exchange takes the victim's GPU from it: release the victim first
    for endpoint in sorted(changing, key=lambda e: e.path == "/v1/exchange"):
        before = cluster.state()
        reply = cluster.daemon(endpoint).request(
            endpoint.method, attack_path(endpoint), attack_body(endpoint)
        )
        assert reply.status == 200, (endpoint.name, reply.status, reply.body[:300])
        if endpoint.path in ANSWERS_ONLY:  # an answer, and nothing recorded: the refusals
            answer = json.loads(reply.body)  # above are its test
            assert answer["gpus"] == {} if endpoint.path == MIG_PATH else answer["verdict"]
            assert cluster.state() == before, endpoint.name
            continue
        assert cluster.state() != before, endpoint.name
    cluster.check_alive()
