"""The Epilog's local release over the agent's real HTTP listener (in-process, loopback)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from slurm_cdgpc.agent.node import NodeAgent, safe_limit_w
from slurm_cdgpc.agent.server import AgentHttpServer
from slurm_cdgpc.config import SafeCap
from slurm_cdgpc.gpu.simulated import ManualClock, simulated_gpus
from slurm_cdgpc.slurm import hooks
from slurm_cdgpc.transport.auth import AccessPolicy, HmacKey, HmacSigner, HmacVerifier
from slurm_cdgpc.transport.http import HeadClient, HeadRefusedError, HeadUnavailableError
from slurm_cdgpc.wire.protocol import (
    HOLD_PATH,
    MIG_PATH,
    RELEASE_PATH,
    ExchangeRequest,
    Setpoint,
)

SECRET = b"k" * 32


@contextmanager
def _serving(gpu_types: str, state_dir: Path) -> Iterator[tuple[AgentHttpServer, NodeAgent]]:
    """Node n1's agent on simulated GPUs of ``gpu_types``, behind its real HTTP listener."""
    clock = ManualClock(1000.0)
    gpus = simulated_gpus(gpu_types, None, seed=1, time_source=clock)
    agent = NodeAgent(
        gpus, SafeCap(clock_fraction=0.6), state_dir / "state.json", clock, node_name="n1"
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
    try:
        yield server, agent
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[AgentHttpServer, NodeAgent]]:
    with _serving("A100:2", tmp_path) as (server, agent):
        agent.exchange(
            ExchangeRequest(
                interval=1,
                lease_expires_s=agent.lease_expires_s,
                setpoints=(Setpoint(0, "41", 1200), Setpoint(1, "42", 1200)),
                node="n1",
            )
        )
        yield server, agent


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


# -- jobs on MIG instances ----------------------------------------------------------------------

MIG_BOARD = (
    Path(__file__).resolve().parent.parent / "data" / "nvml" / "a100-sxm4-80gb-mig.board.json"
)


@pytest.fixture
def mig_node(tmp_path: Path) -> Iterator[tuple[AgentHttpServer, NodeAgent]]:
    """A node whose GPU 0 is whole and GPU 1 (a recorded A100 board) has MIG on."""
    with _serving(f"A100:1,{MIG_BOARD}:1", tmp_path) as served:
        yield served


class _Head:
    """What the head was told: registrations and deregistrations."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, Any]] = {}

    def post(self, path: str, payload: dict[str, Any]) -> Any:
        self.jobs[str(payload["job_id"])] = dict(payload)
        return {}

    def delete(self, path: str) -> Any:
        if self.jobs.pop(path.rsplit("/", 1)[1], None) is None:
            raise HeadRefusedError(404, "not registered")
        return {}


def _hook(
    kind: str, server: AgentHttpServer, head: _Head, env: dict[str, str], tmp_path: Path
) -> str:
    """One real hook run (`slurm.hooks.run`) against the agent's real listener; its line."""
    lines: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hooks, "_local_agent", lambda _s, _e: _client(server))
        status = hooks.run(
            kind,
            hooks.HookSettings(spool_dir=tmp_path / "spool"),
            env,
            emit=lambda _p, line: lines.append(line),
            client_factory=lambda _s, _e: head,
        )
    assert status == 0
    [line] = lines
    return line


def test_jobs_on_mig_instances_are_tenants_of_their_physical_gpu(
    mig_node: tuple[AgentHttpServer, NodeAgent], tmp_path: Path
) -> None:
    server, agent = mig_node
    first, second = agent.gpus[1].mig_instances()[:2]
    head = _Head()
    # what slurmd gives the Prolog: the GRES record's position (not GPU 0!) and the UUID
    env = {"SLURM_JOB_ID": "51", "SLURM_JOB_USER": "alice", "SLURMD_NODENAME": "n1"}
    line = _hook(
        "prolog",
        server,
        head,
        {**env, "SLURM_JOB_GPUS": "0", "CUDA_VISIBLE_DEVICES": first.uuid},
        tmp_path,
    )
    assert head.jobs["51"]["gpus"] == [1]
    assert f"MIG instance(s) {first.uuid} on GPU(s) 1" in line
    # held by its power limit until the head's first plan: its clocks cannot be locked
    assert "GPU(s) [1] held here" in line, line
    mig = agent.gpus[1]
    assert mig.locked is None and mig.power_limit_set_w == safe_limit_w(mig, agent.safe_cap)
    # an older driver's name for the second instance: the same physical GPU
    older = f"MIG-{agent.gpus[1].uuid}/{second.gpu_instance}/{second.compute_instance}"
    env52 = {**env, "SLURM_JOB_ID": "52", "SLURM_JOB_GPUS": "1", "CUDA_VISIBLE_DEVICES": older}
    _hook("prolog", server, head, env52, tmp_path)
    assert head.jobs["52"]["gpus"] == [1]
    # an instance this node does not have: no GPU, not registered, said so
    lost = {**env, "SLURM_JOB_ID": "53", "CUDA_VISIBLE_DEVICES": "MIG-0000-1111"}
    line = _hook("prolog", server, head, lost, tmp_path)
    assert "53" not in head.jobs and "not registered" in line
    assert "1 not on this node's GPUs: MIG-0000-1111" in line
    # the Epilog sees the same environment: deregistered, GPU 1 untouched
    line = _hook("epilog", server, head, {**env, "CUDA_VISIBLE_DEVICES": first.uuid}, tmp_path)
    assert "51" not in head.jobs and "52" in head.jobs and "deregistered" in line
    assert [g.locked for g in agent.gpus] == [None, None]
    assert mig.power_limit_set_w is not None  # job 52 still holds it
    _hook("epilog", server, head, env52, tmp_path)
    assert "52" not in head.jobs and mig.power_limit_set_w is None


@pytest.mark.parametrize(
    "payload",
    [
        {"job_id": "51"},
        {"job_id": "51", "names": "MIG-abc"},
        {"job_id": "51", "names": ["MIG-abc/../x"]},
        {"job_id": "51", "names": ["GPU-abc"]},
        {"job_id": "51", "names": [7]},
        {"job_id": "51", "names": ["MIG-abc"], "gpus": [1]},
    ],
)
def test_bad_mig_questions_are_refused(
    mig_node: tuple[AgentHttpServer, NodeAgent], payload: dict[str, object]
) -> None:
    server, _agent = mig_node
    with pytest.raises(HeadRefusedError) as err:
        _client(server).post(MIG_PATH, payload)
    assert err.value.status == 400 and "\n" not in str(err.value)


def test_beside_a_mig_gpu_a_plain_index_is_not_capped(
    mig_node: tuple[AgentHttpServer, NodeAgent],
) -> None:
    server, agent = mig_node
    reply = _client(server).post(HOLD_PATH, {"job_id": "54", "gpus": [0]})
    reason = "another GPU here is in MIG mode: not capped (counted as drawn)"
    assert reply == {"job_id": "54", "held": [], "refused": [{"gpu": 0, "reason": reason}]}
    assert agent.gpus[0].locked is None
