"""A GPU in MIG mode through the agent: its clocks cannot be locked, so its setpoint is its power
limit (whole-GPU), written down before it is set, released with its last tenant; the lease's
safe cap and the Prolog's hold are limits too. GPU 1 is a recorded A100 board with MIG on; GPU 0
is whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_cdgpc.agent.node import NodeAgent, safe_limit_w
from slurm_cdgpc.config import SafeCap
from slurm_cdgpc.errors import GpuNotSupportedError
from slurm_cdgpc.gpu.device import GpuSet
from slurm_cdgpc.gpu.simulated import ManualClock, SimulatedGpu, simulated_gpus
from slurm_cdgpc.wire.protocol import ExchangeRequest, ExchangeResponse, Setpoint

MIG_BOARD = Path(__file__).resolve().parents[1] / "data" / "nvml" / "a100-sxm4-80gb-mig.board.json"
LEASE_S = 30.0


def _agent(
    tmp_path: Path, gpus: GpuSet | None = None, clock: ManualClock | None = None
) -> NodeAgent:
    clock = clock or ManualClock(1000.0)
    gpus = gpus or simulated_gpus(f"A100:1,{MIG_BOARD}:1", None, seed=1, time_source=clock)
    return NodeAgent(
        gpus,
        SafeCap(clock_fraction=0.6),
        tmp_path / "state.json",
        clock,
        node_name="n1",
        lease_duration_s=LEASE_S,
    )


def _exchange(
    agent: NodeAgent, *points: Setpoint, release: tuple[int, ...] = ()
) -> ExchangeResponse:
    return agent.exchange(
        ExchangeRequest(
            interval=1,
            lease_expires_s=agent.lease_expires_s + LEASE_S,
            setpoints=points,
            release=release,
            node="n1",
        )
    )


def _mig(agent: NodeAgent) -> SimulatedGpu:
    device = agent.gpus[1]
    assert isinstance(device, SimulatedGpu) and device.mig_mode()
    return device


def _state(tmp_path: Path) -> list[dict[str, object]]:
    return list(json.loads((tmp_path / "state.json").read_text())["locks"])


def test_a_mig_gpu_cannot_be_locked_so_its_setpoint_is_its_power_limit(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    mig = _mig(agent)
    with pytest.raises(GpuNotSupportedError):
        mig.set_locked_clocks(1200)
    answer = _exchange(agent, Setpoint(1, "61", 1200, power_limit_w=250.0, tenants=("62",)))
    assert answer.refused == ()
    assert mig.locked is None and mig.power_limit_set_w == 250.0
    [entry] = _state(tmp_path)  # written down: a crash resets it
    assert (entry["index"], entry["power_limit_w"], entry["graphics_max_mhz"]) == (1, 250.0, None)
    report = next(r for r in _exchange(agent).gpus if r.index == 1)
    assert report.job_id == "61" and report.locked is None and report.enforced_limit_w == 250.0
    # a limit outside the board's range is clipped into it, as the guard rail's is
    _exchange(agent, Setpoint(1, "61", 1200, power_limit_w=20.0))
    assert mig.power_limit_set_w == mig.power_limit_range().min_w


def test_a_mig_setpoint_without_a_power_limit_is_refused_and_changes_nothing(
    tmp_path: Path,
) -> None:
    agent = _agent(tmp_path)
    mig = _mig(agent)
    answer = _exchange(agent, Setpoint(1, "61", 1200))
    [refusal] = answer.refused
    assert refusal.gpu == 1 and "MIG mode is on" in refusal.reason and "\n" not in refusal.reason
    assert mig.locked is None and mig.power_limit_set_w is None and mig.clock_writes == 0
    assert not (tmp_path / "state.json").exists()


def test_the_last_tenant_leaving_a_mig_gpu_puts_its_default_limit_back(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    mig = _mig(agent)
    _exchange(agent, Setpoint(1, "61", 1200, power_limit_w=250.0, tenants=("62",)))
    held, refused = agent.release_job("61")  # the first tenant's Epilog
    assert held == [1] and refused == []
    assert mig.power_limit_set_w == 250.0  # the other tenant keeps the GPU's setpoint
    held, refused = agent.release_job("62")
    assert held == [1] and refused == []
    assert mig.power_limit_set_w is None and mig.enforced_limit_w == mig.spec.power_limit.default_w
    assert not (tmp_path / "state.json").exists()
    # the head's release does the same
    _exchange(agent, Setpoint(1, "63", 1200, power_limit_w=300.0))
    answer = _exchange(agent, release=(1,))
    assert answer.refused == () and mig.power_limit_set_w is None


def test_a_lapsed_lease_caps_a_mig_gpu_by_its_limit_and_the_renewal_lifts_it(
    tmp_path: Path,
) -> None:
    clock = ManualClock(1000.0)
    agent = _agent(tmp_path, clock=clock)
    mig = _mig(agent)
    safe_w = safe_limit_w(mig, agent.safe_cap)
    assert safe_w == pytest.approx(0.6 * mig.spec.power_limit.default_w)
    clock.advance(LEASE_S + 1)
    result = agent.tick()
    assert result.lapsed and 1 in result.changed
    assert mig.power_limit_set_w == pytest.approx(safe_w) and mig.locked is None
    assert agent.gpus[0].locked is not None  # the whole GPU gets the safe clock
    assert agent.lease.safe_capped == 2
    assert agent.tick().changed == ()  # not again, and no error from a lock it cannot take
    _exchange(agent)  # the head is back: GPUs that hold no job return to their defaults
    assert mig.power_limit_set_w is None and agent.gpus[0].locked is None
    # a limit already at or below the safe one is kept
    _exchange(agent, Setpoint(1, "61", 1200, power_limit_w=150.0))
    clock.advance(LEASE_S + 1)
    agent.tick()
    assert mig.power_limit_set_w == 150.0


def test_a_restart_after_a_crash_resets_the_mig_limit_it_recorded(tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    gpus = simulated_gpus(f"A100:1,{MIG_BOARD}:1", None, seed=1, time_source=clock)
    _exchange(_agent(tmp_path, gpus, clock), Setpoint(1, "61", 1200, power_limit_w=250.0))
    assert gpus[1].power_limit_set_w == 250.0
    restarted = _agent(tmp_path, gpus, clock)  # the agent died; the GPUs kept the limit
    assert restarted.recovered_stale_state
    assert gpus[1].power_limit_set_w is None


def test_a_prologs_hold_caps_a_mig_gpu_by_its_limit_never_raising_it(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    mig = _mig(agent)
    safe_w = safe_limit_w(mig, agent.safe_cap)
    held, refused = agent.hold_job("61", [1])
    assert (held, refused) == ([1], [])
    assert mig.locked is None and mig.power_limit_set_w == pytest.approx(safe_w)
    [entry] = _state(tmp_path)
    assert (entry["job_id"], entry["power_limit_w"]) == ("61", pytest.approx(safe_w))
    # a second instance's job shares it, at the limit it has
    assert agent.hold_job("62", [1]) == ([1], [])
    assert mig.power_limit_set_w == pytest.approx(safe_w)
    agent.release_job("61")
    agent.release_job("62")
    assert mig.power_limit_set_w is None
    # a limit the head set below the safe one is kept
    _exchange(agent, Setpoint(1, "63", 1200, power_limit_w=150.0))
    agent.release_job("63")
    _exchange(agent, Setpoint(1, "64", 1200, power_limit_w=150.0))
    assert agent.hold_job("65", [1]) == ([1], []) and mig.power_limit_set_w == 150.0


def test_resetting_every_gpu_leaves_a_mig_gpus_clocks_alone_and_resets_its_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = _agent(tmp_path)
    mig = _mig(agent)
    _exchange(agent, Setpoint(1, "61", 1200, power_limit_w=250.0))

    def refuse() -> None:  # what NVML is expected to answer on a partitioned GPU
        raise GpuNotSupportedError("NVML: Not Supported")

    monkeypatch.setattr(mig, "reset_locked_clocks", refuse)
    assert agent.restore_defaults() == []  # nothing failed: a MIG GPU has no lock to reset
    assert mig.power_limit_set_w is None and not (tmp_path / "state.json").exists()
