"""Signed replies: whatever answers on a daemon's port instead of the daemon is not believed.

A local user who binds the agent's port while the agent restarts, or the head's port on a
standby's host (where no head listens), can answer anything. Each attack here is such a plain
socket answering a plausible, well-formed reply: the head must take it for an unreachable node
(a one-line `NodeFailure`, nothing of it used), and a Prolog or Epilog for an unreachable head
(the request spooled). A reply the real agent signed for another request (an earlier one, another
node, another epoch, another answer) is refused too, and so is a request credential offered as a
reply credential, or the other way round. The real daemons' signed answers still pass, under
HMAC and under MUNGE (a private munged, `tests.integration.munge_fixture`).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from slurm_cdgpc.agent.node import NodeAgent
from slurm_cdgpc.agent.server import AgentHttpServer
from slurm_cdgpc.config import SafeCap
from slurm_cdgpc.control.empc import ControllerSettings
from slurm_cdgpc.coordinator.api import HeadHttpServer
from slurm_cdgpc.coordinator.daemon import Coordinator, CoordinatorSettings
from slurm_cdgpc.gpu.simulated import simulated_gpus
from slurm_cdgpc.slurm import hooks
from slurm_cdgpc.slurm.hooks import HookSettings
from slurm_cdgpc.slurm.spool import Spool
from slurm_cdgpc.store import Store, make_engine, upgrade
from slurm_cdgpc.transport.auth import (
    HEAD_RESPONDER,
    REPLY_HEADER,
    AccessPolicy,
    AuthError,
    HmacKey,
    HmacSigner,
    HmacVerifier,
    InvalidCredentialError,
    MalformedCredentialError,
    MungeSigner,
    MungeVerifier,
    Reply,
    Signer,
)
from slurm_cdgpc.transport.http import (
    EXCHANGE_PATH,
    HeadClient,
    HeadUnavailableError,
    NodeExchanger,
    NodeFailure,
    NodeTarget,
)
from slurm_cdgpc.wire.protocol import (
    ExchangeRequest,
    ExchangeResponse,
    ProgressReport,
    Setpoint,
)
from tests.integration import munge_fixture
from tests.integration.munge_fixture import MungeDaemon, unavailable
from tests.security.live import head_and_agent, raw_request

munged = munge_fixture.munged
munged_factory = munge_fixture.munged_factory

pytestmark = pytest.mark.security

SECRET = b"r" * 32
KEY = HmacKey(SECRET)
OTHER_KEY = HmacKey(b"o" * 32)
#: what the forged readings claim: plausible for an A100, and unlike anything simulated here
FORGED_W = 123.25
FORGED_STEP = 9000
NONCE = "0123456789abcdef" * 2
EPOCH = 1_796_130_477_479  # leader epochs are the database clock in milliseconds
BODY = b'{"node":"n1","gpus":[]}'
HOOK_ENV = {
    "SLURM_JOB_ID": "42",
    "SLURM_JOB_USER": "alice",
    "SLURMD_NODENAME": "n1",
    "SLURM_JOB_GPUS": "0,1",
}


# -- plain sockets that answer whatever they are given -------------------------------------------


@dataclass
class Impostors:
    """Plain loopback listeners that read each request whole and answer it with fixed bytes."""

    sockets: list[socket.socket]
    requests: list[bytes]

    def answering(self, answer: bytes) -> int:
        """A listener's port; every connection gets ``answer``, then is closed."""
        listener = socket.create_server(("127.0.0.1", 0))
        self.sockets.append(listener)

        def serve() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                with conn:
                    self.requests.append(_read_request(conn))
                    conn.sendall(answer)

        threading.Thread(target=serve, daemon=True).start()
        return int(listener.getsockname()[1])


@pytest.fixture
def impostors() -> Iterator[Impostors]:
    found = Impostors([], [])
    yield found
    for sock in found.sockets:
        sock.close()


def _read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        body += conn.recv(65536)
    return data


def _http(status: str, body: bytes, *headers: str) -> bytes:
    lines = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", *headers, "", ""]
    return "\r\n".join(lines).encode() + body


def _forged_exchange_answer(tmp_path: Path, node: str) -> bytes:
    """What a real agent of ``node`` would answer (its GPUs, a progress report), with forged
    readings and no reply credential: the forger has no key."""
    agent = NodeAgent(
        simulated_gpus("A100", 2, seed=7), SafeCap(), tmp_path / "forger.json", node_name=node
    )
    real = agent.exchange(ExchangeRequest(1, time.time() + 60, node=node))
    gpus = tuple(replace(g, power_w=FORGED_W, job_id="7") for g in real.gpus)
    progress = (ProgressReport("7", FORGED_STEP, 10_000, time.time(), 0),)
    return _http("200 OK", replace(real, gpus=gpus, progress=progress).to_json())


# -- real agents and a real head in this process ---------------------------------------------


def _agent_server(
    tmp_path: Path,
    name: str,
    verifier: HmacVerifier | MungeVerifier,
    signer: Signer,
    *,
    port: int = 0,
) -> AgentHttpServer:
    agent = NodeAgent(
        simulated_gpus("A100", 2, seed=1), SafeCap(), tmp_path / f"{name}.json", node_name=name
    )
    policy = AccessPolicy(node_uids=frozenset({0, os.getuid()}))
    server = AgentHttpServer(("127.0.0.1", port), agent, verifier, policy, signer=signer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def agent_n1(tmp_path: Path) -> Iterator[AgentHttpServer]:
    """node n1's real agent, HMAC, answering signed."""
    server = _agent_server(tmp_path, "n1", HmacVerifier(KEY), HmacSigner(KEY))
    yield server
    server.shutdown()
    server.server_close()


class _NoAgents:
    def exchange(
        self, targets: Mapping[str, NodeTarget]
    ) -> dict[str, ExchangeResponse | NodeFailure]:
        return {node: NodeFailure("no agents in this test") for node in targets}

    def close(self) -> None:
        pass


def _coordinator(tmp_path: Path, exchanger: object) -> Coordinator:
    engine = make_engine(f"sqlite:///{tmp_path / 'head.db'}")
    upgrade(engine)
    settings = CoordinatorSettings(
        interval_s=1.0, lease_s=30.0, controller=ControllerSettings(interval_s=1.0)
    )
    head = Coordinator(Store(engine), exchanger, settings)  # type: ignore[arg-type]
    head.start()
    return head


def _request(node: str, epoch: int = 0) -> ExchangeRequest:
    return ExchangeRequest(1, time.time() + 30, (Setpoint(0, "7", 1005),), epoch=epoch, node=node)


def _exchange(signer: Signer, targets: dict[str, NodeTarget]) -> dict[str, object]:
    exchanger = NodeExchanger(signer, timeout_s=2.0)
    try:
        return dict(exchanger.exchange(targets))
    finally:
        exchanger.close()


def _signed_exchange_bytes(port: int, request: ExchangeRequest) -> bytes:
    """One real exchange with the agent on ``port``, as its raw answer (a capture)."""
    body = request.to_json()
    credential = HmacSigner(KEY, uid=0, gid=0).sign("POST", EXCHANGE_PATH, body)
    head = (
        f"POST {EXCHANGE_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
        f"Authorization: {credential}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + body)
        return b"".join(iter(lambda: sock.recv(65536), b""))


# -- the head: exchanges ---------------------------------------------------------------------


def test_a_forged_exchange_answer_is_an_unreachable_node_and_reaches_nothing(
    tmp_path: Path, agent_n1: AgentHttpServer, impostors: Impostors
) -> None:
    """n2's port is held by a forger: n2 counts as unreachable, its job at its worst case, and
    neither its readings nor its progress reach the head's state or the store."""
    forger = impostors.answering(_forged_exchange_answer(tmp_path, "n2"))
    exchanger = NodeExchanger(HmacSigner(KEY, uid=0, gid=0), timeout_s=2.0)
    head = _coordinator(tmp_path, exchanger)
    try:
        head.register_node("n1", f"http://127.0.0.1:{agent_n1.port}")
        head.register_node("n2", f"http://127.0.0.1:{forger}")
        head.register_job("7", "alice", "n2", [0, 1], deadline_s=time.time() + 3600)
        head.store.set_budget(5000.0, "root")
        reports = [head.run_interval() for _ in range(3)]
    finally:
        exchanger.close()
    assert len(impostors.requests) == 3  # the forger was asked, and answered, each interval
    for report in reports:
        assert (report.nodes_reachable, report.nodes_unreachable) == (1, 1)
        assert not any(j.controlled for j in report.jobs if j.job_id == "7")
    # from the first exchange on, n2 counts at its GPUs' power limit, not at the forged 123 W
    assert reports[-1].uncontrolled_w >= 2 * 400.0
    reachable = {n.name: n.reachable for n in head.store.nodes()}
    assert reachable == {"n1": True, "n2": False}
    assert head.store.measurements(node="n2") == []
    assert head.store.measurements(node="n1")  # the real agent's readings are kept
    assert all(m.power_w != FORGED_W for m in head.store.measurements())
    job = head.store.job("7")
    assert job is not None and job.iterations_done in (None, 0)
    assert 'cdgpc_exchange_failures_total{kind="reply"} 3.0' in head.metrics.render().decode()


def test_unsigned_wrongly_signed_and_replayed_answers_are_refused(
    tmp_path: Path, agent_n1: AgentHttpServer, impostors: Impostors
) -> None:
    body = ExchangeResponse(node="n1", time_s=time.time()).to_json()
    earlier = _signed_exchange_bytes(agent_n1.port, _request("n1"))
    assert f"\r\n{REPLY_HEADER}: hmac-sha256 ".encode() in earlier  # the agent signs
    fake_credential = HmacSigner(OTHER_KEY).sign_reply(Reply.to(NONCE, "n1", 0, 200, body))
    request_credential = HmacSigner(KEY).sign("POST", EXCHANGE_PATH, body)
    urls = {
        "unsigned": impostors.answering(_http("200 OK", body)),
        "other key": impostors.answering(
            _http("200 OK", body, f"{REPLY_HEADER}: {fake_credential}")
        ),
        "a request's": impostors.answering(
            _http("200 OK", body, f"{REPLY_HEADER}: {request_credential}")
        ),
        "replayed": impostors.answering(earlier),  # the agent's own, for an earlier request
    }
    targets = {
        kind: NodeTarget(f"http://127.0.0.1:{port}", _request("n1")) for kind, port in urls.items()
    }
    results: dict[str, object] = {}
    for kind, target in targets.items():  # one at a time: every target is node n1
        results[kind] = _exchange(HmacSigner(KEY, uid=0, gid=0), {"n1": target})["n1"]
    reasons = {}
    for kind, result in results.items():
        assert isinstance(result, NodeFailure), (kind, result)
        assert "\n" not in result.reason
        reasons[kind] = result.reason
    assert "reply refused: no X-Cdgpc-Reply-Auth header" in reasons["unsigned"]
    assert "reply refused: reply HMAC does not match" in reasons["other key"]
    assert "reply refused: reply credential must look like" in reasons["a request's"]
    assert "reply refused: reply HMAC does not match" in reasons["replayed"]
    # the same agent, asked directly, passes: nothing but the forgery was refused
    good = _exchange(
        HmacSigner(KEY, uid=0, gid=0),
        {"n1": NodeTarget(f"http://127.0.0.1:{agent_n1.port}", _request("n1"))},
    )["n1"]
    assert isinstance(good, ExchangeResponse) and good.node == "n1"


@pytest.mark.parametrize("signer", [HmacSigner(KEY, uid=0, gid=0)], ids=["hmac"])
def test_a_reply_binds_its_request_node_epoch_status_and_body(signer: HmacSigner) -> None:
    _refuses_every_other_binding(signer, signer)


def _refuses_every_other_binding(maker: Signer, checker: Signer) -> None:
    """A reply signed by ``maker`` for one request passes ``checker`` for exactly it (each
    check with a credential of its own: munged takes a MUNGE credential once)."""
    signed = Reply.to(NONCE, "n1", EPOCH, 200, BODY)
    checker.verify_reply(maker.sign_reply(signed), signed)
    checker.verify_reply(maker.sign_reply(signed), replace(signed, epoch=None))  # any epoch
    others = {
        "another request": replace(signed, nonce="f" * 32),
        "another node": replace(signed, responder="n2"),
        "the head": replace(signed, responder=HEAD_RESPONDER),
        "another epoch": replace(signed, epoch=EPOCH - 1),
        "another status": replace(signed, status=409),
        "another body": Reply.to(NONCE, "n1", EPOCH, 200, BODY + b" "),
    }
    for what, expected in others.items():
        with pytest.raises(AuthError) as refused:
            checker.verify_reply(maker.sign_reply(signed), expected)
        assert "\n" not in str(refused.value), what
    with pytest.raises(MalformedCredentialError):
        checker.verify_reply(None, signed)
    # a request credential is no reply credential, and a reply credential no request's
    request = maker.sign_request("POST", EXCHANGE_PATH, BODY)
    with pytest.raises(AuthError):
        checker.verify_reply(request.credential, replace(signed, nonce=request.nonce))


def test_a_reply_credential_is_never_a_request_credential() -> None:
    credential = HmacSigner(KEY).sign_reply(Reply.to(NONCE, "n1", 0, 200, BODY))
    with pytest.raises(MalformedCredentialError):
        HmacVerifier(KEY).verify(credential, "POST", EXCHANGE_PATH, BODY)


# -- the Prolog and the Epilog ---------------------------------------------------------------


def _hook_config(tmp_path: Path, head_port: int, agent_port: int) -> Path:
    if os.geteuid() != 0:
        pytest.skip("the HMAC key must be owned by root: run as root")
    key_file = tmp_path / "hmac.key"
    key_file.write_bytes(SECRET)
    key_file.chmod(0o600)
    config = tmp_path / "cdgpc.toml"
    config.write_text(
        f'[head]\nurl = "http://127.0.0.1:{head_port}"\n'
        f'[node]\nlisten_address = "127.0.0.1"\nlisten_port = {agent_port}\n'
        f'[auth]\nmethod = "hmac"\nhmac_key_file = "{key_file}"\n'
    )
    return config


def _run_hook(kind: str, config: Path, spool: Path) -> tuple[int, list[str]]:
    lines: list[tuple[int, str]] = []
    settings = HookSettings(
        config_path=config, spool_dir=spool, scontrol=Path("/nonexistent/scontrol")
    )
    status = hooks.run(kind, settings, HOOK_ENV, emit=lambda p, m: lines.append((p, m)))
    return status, [m for _, m in lines]


def test_a_prolog_answered_by_an_impostor_head_spools_and_trusts_nothing(
    tmp_path: Path, impostors: Impostors
) -> None:
    """A plain socket on the head's port says "registered", and on the agent's port "held":
    neither is believed. The registration is spooled, the hold noted as failed."""
    registered = json.dumps({"job_id": "42", "state": "registered", "gpus": []}).encode()
    held = json.dumps({"job_id": "42", "held": [0, 1], "refused": []}).encode()
    head = impostors.answering(_http("200 OK", registered))
    agent = impostors.answering(_http("200 OK", held))
    spool = tmp_path / "spool"
    status, lines = _run_hook("prolog", _hook_config(tmp_path, head, agent), spool)
    assert status == 0 and len(lines) == 1
    [line] = lines
    assert "spooled as" in line and "answer refused: no X-Cdgpc-Reply-Auth header" in line
    assert "local hold failed (the local agent at" in line
    assert len(impostors.requests) == 2  # both were asked, and neither believed
    [record] = Spool(spool).pending()
    assert "-register-42.json" in record.name


def test_an_epilog_answered_by_impostors_spools_its_deregistration(
    tmp_path: Path, impostors: Impostors
) -> None:
    gone = json.dumps({"job_id": "42", "state": "finished"}).encode()
    released = json.dumps({"job_id": "42", "released": [0, 1], "refused": []}).encode()
    head = impostors.answering(_http("200 OK", gone))
    agent = impostors.answering(_http("200 OK", released))
    # a refusal the impostor makes up is not believed either: it would drop the request
    refusing = impostors.answering(_http("400 Bad Request", b'{"error": "no such job"}'))
    spool = tmp_path / "spool"
    status, [line] = _run_hook("epilog", _hook_config(tmp_path, head, agent), spool)
    assert status == 0 and "spooled as" in line and "local reset failed" in line
    assert "answer refused" in line
    status, [line] = _run_hook("prolog", _hook_config(tmp_path, refusing, agent), spool)
    assert status == 0 and "spooled as" in line and "it said 400: no such job" in line
    assert [p.name.split("-")[2] for p in Spool(spool).pending()] == ["deregister", "register"]


def test_a_prolog_answered_by_the_real_head_and_agent_registers_and_holds(
    tmp_path: Path,
) -> None:
    """The happy path of the hooks under HMAC: both answers signed, both believed."""
    head = _coordinator(tmp_path, _NoAgents())
    server = HeadHttpServer(
        ("127.0.0.1", 0),
        head,
        HmacVerifier(KEY),
        AccessPolicy(),
        signer=HmacSigner(KEY),
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    agent = _agent_server(tmp_path, "n1", HmacVerifier(KEY), HmacSigner(KEY))
    try:
        config = _hook_config(tmp_path, server.port, agent.port)
        status, [line] = _run_hook("prolog", config, tmp_path / "spool")
        assert status == 0, line
        assert "registered GPUs 0,1" in line and "GPU(s) [0, 1] held here" in line, line
        job = head.store.job("42")
        assert job is not None and job.user == "alice"
        status, [line] = _run_hook("epilog", config, tmp_path / "spool")
        assert status == 0 and "deregistered" in line and "GPU(s) [0, 1] reset here" in line
        assert Spool(tmp_path / "spool").pending() == []
    finally:
        for s in (server, agent):
            s.shutdown()
            s.server_close()


def test_an_agent_answering_as_another_node_is_not_this_nodes_agent(
    tmp_path: Path,
) -> None:
    """The local agent's answers are bound to the node: an agent named n2 on n1's port (signed
    with the cluster's key all the same) is refused by n1's Epilog."""
    agent = _agent_server(tmp_path, "n2", HmacVerifier(KEY), HmacSigner(KEY))
    try:
        client = HeadClient(
            f"http://127.0.0.1:{agent.port}",
            HmacSigner(KEY, uid=0, gid=0),
            peer="the local agent",
            responder="n1",
        )
        with pytest.raises(HeadUnavailableError, match="answer refused: reply HMAC"):
            client.post("/v1/release", {"job_id": "42"})
    finally:
        agent.shutdown()
        agent.server_close()


# -- the daemons as deployed -----------------------------------------------------------------


@pytest.mark.live
def test_the_running_daemons_sign_every_answer_to_an_authenticated_request(
    tmp_path: Path,
) -> None:
    """cdgpcd and cdgpc-noded as their entry points build them: an answer to a request whose
    credential checks out, a refusal too, carries a reply credential for exactly it; an answer
    to one that does not cannot be bound to a request, and is not signed."""
    if os.geteuid() != 0:
        pytest.skip("the HMAC key must be owned by root: run the live tests as root")
    with head_and_agent(tmp_path) as (head, agent, keys):
        signer = keys.signer()
        exchange = json.dumps(
            {
                "version": 1,
                "node": "node1",
                "interval": 1,
                "lease_expires_s": time.time() + 3600,
                "setpoints": [],
                "release": [],
                "epoch": 3,
            }
        ).encode()
        asked = [
            (head, HEAD_RESPONDER, None, "GET", "/v1/status", b"", 200),
            (head, HEAD_RESPONDER, None, "GET", "/v1/health", b"", 200),
            (head, HEAD_RESPONDER, None, "POST", "/v1/budget", b'{"budget_w": -1}', 400),
            (head, HEAD_RESPONDER, None, "DELETE", "/v1/jobs/404", b"", 404),
            (agent, "node1", 3, "POST", EXCHANGE_PATH, exchange, 200),
            (agent, "node1", 0, "POST", "/v1/hold", b'{"job_id": "1", "gpus": [9]}', 200),
            (agent, "node1", 0, "POST", "/v1/release", b'{"job_id": "x"}', 400),
        ]
        for daemon, responder, epoch, method, path, body, status in asked:
            signed = signer.sign_request(method, path, body)
            reply = raw_request(daemon.port, method, path, body, credentials=[signed.credential])
            assert reply.status == status, (path, reply.status, reply.body[:200])
            expected = Reply.to(signed.nonce, responder, epoch, reply.status, reply.body)
            signer.verify_reply(reply.headers.get(REPLY_HEADER.lower()), expected)
        forged = HmacSigner(OTHER_KEY, uid=0, gid=0).sign("GET", "/v1/status", b"")
        refused = raw_request(head.port, "GET", "/v1/status", credentials=[forged])
        assert refused.status == 401 and REPLY_HEADER.lower() not in refused.headers


# -- MUNGE -------------------------------------------------------------------------------------


def _munge_signer(
    daemon: MungeDaemon, munge: str | Path | None = None, **kw: object
) -> MungeSigner:
    return MungeSigner(
        munge or daemon.programs.munge,
        unmunge_path=daemon.programs.unmunge,
        socket=daemon.socket,
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
def root_under_munge() -> None:
    if os.geteuid() != 0:
        unavailable("an agent's MUNGE replies must come from root: run as root")


@pytest.fixture
def munge_as_nobody(munged: MungeDaemon, tmp_path: Path) -> tuple[Path, int]:
    """A `munge` that runs the real one as ``nobody``: a local user's credentials."""
    if os.geteuid() != 0:
        unavailable("signing as another user needs root (runuser)")
    import pwd  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    runuser = shutil.which("runuser", path="/usr/sbin:/usr/bin:/sbin:/bin")
    if runuser is None:
        unavailable("runuser (util-linux) is not installed")
    wrapper = tmp_path / "munge-as-nobody"
    wrapper.write_text(f'#!/bin/sh\nexec {runuser} -u nobody -- {munged.programs.munge} "$@"\n')
    wrapper.chmod(0o700)
    return wrapper, pwd.getpwnam("nobody").pw_uid


@pytest.mark.live
def test_munge_replies_bind_their_request_and_come_from_root(
    munged: MungeDaemon, root_under_munge: None
) -> None:
    signer = _munge_signer(munged)
    _refuses_every_other_binding(signer, signer)


@pytest.mark.live
def test_a_munge_reply_from_a_local_user_or_another_realm_is_refused(
    munged: MungeDaemon,
    munged_factory: Callable[[str], MungeDaemon],
    munge_as_nobody: tuple[Path, int],
) -> None:
    wrapper, nobody = munge_as_nobody
    checker = _munge_signer(munged)
    as_agent = Reply.to(NONCE, "n1", 0, 200, BODY)
    as_head = Reply.to(NONCE, HEAD_RESPONDER, 3, 200, BODY)
    forged = _munge_signer(munged, wrapper)
    with pytest.raises(InvalidCredentialError, match=rf"made by uid {nobody}, not by root"):
        checker.verify_reply(forged.sign_reply(as_agent), as_agent)
    with pytest.raises(InvalidCredentialError, match=rf"made by uid {nobody}"):
        checker.verify_reply(forged.sign_reply(as_head), as_head)
    # a head that runs as the Slurm user: its answers pass, and still not as an agent's
    slurm_head = _munge_signer(munged, head_uids=[nobody])
    slurm_head.verify_reply(forged.sign_reply(as_head), as_head)
    with pytest.raises(InvalidCredentialError):
        slurm_head.verify_reply(forged.sign_reply(as_agent), as_agent)
    other = _munge_signer(munged_factory("reply-other"))
    with pytest.raises(InvalidCredentialError):
        checker.verify_reply(other.sign_reply(as_agent), as_agent)


@pytest.mark.live
def test_munge_exchanges_and_registrations_pass_end_to_end(
    tmp_path: Path, munged: MungeDaemon, root_under_munge: None, impostors: Impostors
) -> None:
    """The happy path under MUNGE: the agent and the head sign with munge, the head checks the
    agent's answers with unmunge (on its pool), a hook checks the head's; an impostor fails."""
    signer = _munge_signer(munged)
    verifier = MungeVerifier(munged.programs.unmunge, socket=munged.socket)
    agent = _agent_server(tmp_path, "n1", verifier, _munge_signer(munged))
    head = _coordinator(tmp_path, _NoAgents())
    api = HeadHttpServer(
        ("127.0.0.1", 0),
        head,
        MungeVerifier(munged.programs.unmunge, socket=munged.socket),
        AccessPolicy(),
        signer=_munge_signer(munged),
    )
    threading.Thread(target=api.serve_forever, daemon=True).start()
    forger = impostors.answering(_forged_exchange_answer(tmp_path, "n2"))
    try:
        results = _exchange(
            signer,
            {
                "n1": NodeTarget(f"http://127.0.0.1:{agent.port}", _request("n1", epoch=EPOCH)),
                "n2": NodeTarget(f"http://127.0.0.1:{forger}", _request("n2", epoch=EPOCH)),
            },
        )
        n1, n2 = results["n1"], results["n2"]
        assert isinstance(n1, ExchangeResponse) and n1.node == "n1", n1
        assert isinstance(n2, NodeFailure) and "reply refused: no X-Cdgpc-Reply-Auth" in n2.reason
        client = HeadClient(f"http://127.0.0.1:{api.port}", signer)
        job = {"job_id": "42", "user": "alice", "node": "n1", "gpus": [0]}
        assert client.post("/v1/jobs", job)["job_id"] == "42"
        assert client.get("/v1/health") == {"ok": True}  # signed when asked signed
    finally:
        for s in (api, agent):
            s.shutdown()
            s.server_close()
