"""The Epilog's local release over the agent's real HTTP listener (in-process, loopback)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_cdgpc.agent.node import NodeAgent
from slurm_cdgpc.agent.server import AgentHttpServer
from slurm_cdgpc.config import SafeCap
from slurm_cdgpc.gpu.simulated import ManualClock, simulated_gpus
from slurm_cdgpc.transport.auth import AccessPolicy, HmacKey, HmacSigner, HmacVerifier
from slurm_cdgpc.transport.http import HeadClient, HeadRefusedError, HeadUnavailableError
from slurm_cdgpc.wire.protocol import HOLD_PATH, RELEASE_PATH, ExchangeRequest, Setpoint

SECRET = b"k" * 32


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[AgentHttpServer, NodeAgent]]:
    clock = ManualClock(1000.0)
    gpus = simulated_gpus("A100", 2, seed=1, time_source=clock)
    agent = NodeAgent(
        gpus, SafeCap(clock_fraction=0.6), tmp_path / "state.json", clock, node_name="n1"
    )
    key = HmacKey(SECRET, "test")
    server = AgentHttpServer(
        ("127.0.0.1", 0),
        agent,
        HmacVerifier(key),
        AccessPolicy(node_uids=frozenset({0, os.getuid()})),
        signer=HmacSigner(key),
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    agent.exchange(
        ExchangeRequest(
            interval=1,
            lease_expires_s=clock() + 60,
            setpoints=(Setpoint(0, "41", 1200), Setpoint(1, "42", 1200)),
            node="n1",
        )
    )
    try:
        yield server, agent
    finally:
        server.shutdown()
        server.server_close()


def _client(server: AgentHttpServer, secret: bytes = SECRET) -> HeadClient:
    signer = HmacSigner(HmacKey(secret, "test"))
    return HeadClient(
        f"http://127.0.0.1:{server.port}", signer, peer="the local agent", responder="n1"
    )


def test_release_resets_the_jobs_gpus_at_once(served: tuple[AgentHttpServer, NodeAgent]) -> None:
    server, agent = served
    reply = _client(server).post(RELEASE_PATH, {"job_id": "41"})
    assert reply == {"job_id": "41", "released": [0], "refused": []}
    assert agent.gpus[0].locked is None
    assert agent.gpus[1].locked is not None


@pytest.mark.parametrize(
    ("payload", "status"),
    [({"job_id": "41; rm -rf /"}, 400), ({"job_id": "41", "gpus": [1]}, 400), ({}, 400)],
)
def test_bad_release_requests_change_nothing(
    served: tuple[AgentHttpServer, NodeAgent], payload: dict[str, object], status: int
) -> None:
    server, agent = served
    with pytest.raises(HeadRefusedError) as err:
        _client(server).post(RELEASE_PATH, payload)
    assert err.value.status == status
    assert agent.gpus[0].locked is not None and agent.gpus[1].locked is not None


def test_a_forged_release_is_refused(served: tuple[AgentHttpServer, NodeAgent]) -> None:
    server, agent = served
    # the agent cannot sign its refusal of a request it could not authenticate: to the client
    # an unsigned answer is no answer (it cannot tell it from an impostor's)
    with pytest.raises(HeadUnavailableError, match="it said 401: HMAC does not match"):
        _client(server, secret=b"x" * 32).post(RELEASE_PATH, {"job_id": "41"})
    assert agent.gpus[0].locked is not None


def test_a_prolog_hold_caps_the_new_jobs_gpus(served: tuple[AgentHttpServer, NodeAgent]) -> None:
    server, agent = served
    _client(server).post(RELEASE_PATH, {"job_id": "42"})  # GPU 1 free again
    reply = _client(server).post(HOLD_PATH, {"job_id": "43", "gpus": [1]})
    assert reply == {"job_id": "43", "held": [1], "refused": []}
    lock = agent.gpus[1].locked
    assert lock is not None and lock.graphics_max_mhz < 1200  # the safe cap (0.6 of the top)


@pytest.mark.parametrize(
    "payload",
    [
        {"job_id": "43"},
        {"job_id": "43", "gpus": []},
        {"job_id": "43", "gpus": [True]},
        {"job_id": "43", "gpus": [-1]},
        {"job_id": "43", "gpus": "1"},
        {"job_id": "43", "gpus": [1], "clock": 100},
        {"job_id": "x", "gpus": [1]},
    ],
)
def test_bad_holds_change_nothing(
    served: tuple[AgentHttpServer, NodeAgent], payload: dict[str, object]
) -> None:
    server, agent = served
    before = [g.locked for g in agent.gpus]
    with pytest.raises(HeadRefusedError) as err:
        _client(server).post(HOLD_PATH, payload)
    assert err.value.status == 400 and "\n" not in str(err.value)
    assert [g.locked for g in agent.gpus] == before


def test_a_forged_hold_is_refused(served: tuple[AgentHttpServer, NodeAgent]) -> None:
    server, agent = served
    _client(server).post(RELEASE_PATH, {"job_id": "42"})
    with pytest.raises(HeadUnavailableError, match="it said 401: HMAC does not match"):
        _client(server, secret=b"x" * 32).post(HOLD_PATH, {"job_id": "43", "gpus": [1]})
    assert agent.gpus[1].locked is None
