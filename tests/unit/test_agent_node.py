"""`NodeAgent` on simulated GPUs and a manual clock: setpoints, lease, state file, readings."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_cdgpc.agent.node import NodeAgent, safe_clock_mhz
from slurm_cdgpc.agent.protocol import ExchangeRequest, ExchangeResponse, GpuReport, Setpoint
from slurm_cdgpc.config import SafeCap
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.gpu.device import GpuSet
from slurm_cdgpc.gpu.simulated import ManualClock, SimulatedGpu, simulated_gpus

T0_S = 1_767_225_600.0
LEASE_S = 90.0
# A100-SXM4-80GB: graphics 1410 → 210 MHz in 15 MHz steps, one memory clock (1593 MHz)
MAX_MHZ = 1410
SAFE_MHZ = 840  # highest level ≤ 0.6 · 1410 = 846


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0_S)


@pytest.fixture
def gpus(clock: ManualClock) -> GpuSet:
    return simulated_gpus("A100-SXM4-80GB", 4, seed=1, time_source=clock)


@pytest.fixture
def state_file(tmp_path: Path) -> Path:
    return tmp_path / "run" / "node-state.json"


AgentFactory = Callable[..., NodeAgent]


@pytest.fixture
def make_agent(gpus: GpuSet, state_file: Path, clock: ManualClock) -> AgentFactory:
    def make(**kwargs: object) -> NodeAgent:
        options: dict[str, object] = {
            "node_name": "gpu01",
            "lease_duration_s": LEASE_S,
            "safe_cap": SafeCap(clock_fraction=0.6),
        }
        options.update(kwargs)
        return NodeAgent(gpus, state_file=state_file, clock=clock, **options)  # type: ignore[arg-type]

    return make


@pytest.fixture
def agent(make_agent: AgentFactory) -> NodeAgent:
    return make_agent()


def sim(gpus: GpuSet, index: int) -> SimulatedGpu:
    dev = gpus[index]
    assert isinstance(dev, SimulatedGpu)
    return dev


def request(
    clock: ManualClock,
    *setpoints: Setpoint,
    release: tuple[int, ...] = (),
    lease_s: float = LEASE_S,
    interval: int = 1,
) -> ExchangeRequest:
    return ExchangeRequest(
        interval=interval,
        lease_expires_s=clock() + lease_s,
        setpoints=setpoints,
        release=release,
    )


def caps(gpus: GpuSet) -> dict[int, int | None]:
    return {d.index: None if d.locked is None else d.locked.graphics_max_mhz for d in gpus}


def report(response: ExchangeResponse, index: int) -> GpuReport:
    (found,) = [g for g in response.gpus if g.index == index]
    return found


# -- setpoints -------------------------------------------------------------------------------


def test_setpoints_are_applied_to_the_right_gpus(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock
) -> None:
    response = agent.exchange(
        request(clock, Setpoint(1, "101", 1200), Setpoint(3, "102_7", 900, 1593))
    )
    assert caps(gpus) == {0: None, 1: 1200, 2: None, 3: 900}
    assert response.refused == ()
    assert response.node == "gpu01"
    assert report(response, 1).job_id == "101"
    assert report(response, 3).job_id == "102_7"
    assert report(response, 0).job_id is None
    locked = report(response, 1).locked
    assert locked is not None
    assert (locked.graphics_min_mhz, locked.graphics_max_mhz) == (210, 1200)
    assert [g.uuid for g in response.gpus] == [d.uuid for d in gpus]
    assert all(g.error is None and g.power_w is not None for g in response.gpus)


def test_unsupported_clock_is_refused_for_that_gpu_only(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock
) -> None:
    agent.exchange(request(clock, Setpoint(0, "7", 1005)))
    response = agent.exchange(
        request(
            clock,
            Setpoint(0, "7", 1201),  # not a 15 MHz level: refused, the old cap stays
            Setpoint(1, "8", 1200),
            Setpoint(2, "9", 1200, 7000),  # memory clock the part does not list
            Setpoint(9, "10", 1200),  # no such GPU
        )
    )
    assert caps(gpus) == {0: 1005, 1: 1200, 2: None, 3: None}
    refused = {r.gpu: r.reason for r in response.refused}
    assert set(refused) == {0, 2, 9}
    assert "1201 MHz is not supported" in refused[0]
    assert "7000" in refused[2]
    assert "no GPU with index 9" in refused[9]
    assert all("\n" not in reason for reason in refused.values())


def test_failed_write_is_reported_and_other_gpus_are_applied(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock
) -> None:
    sim(gpus, 2).fail_clock_writes = True
    response = agent.exchange(request(clock, *(Setpoint(i, str(100 + i), 1110) for i in range(4))))
    assert caps(gpus) == {0: 1110, 1: 1110, 2: None, 3: 1110}
    assert [r.gpu for r in response.refused] == [2]
    assert "injected fault" in response.refused[0].reason
    assert report(response, 2).job_id is None  # never claimed as applied


def test_released_gpu_is_reset_and_its_progress_dropped(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock
) -> None:
    agent.exchange(request(clock, Setpoint(0, "5", 1005), Setpoint(1, "6", 1005)))
    agent.record_progress("5", 10, 100, uid=1000)
    agent.record_progress("6", 3, None, uid=1001)
    response = agent.exchange(request(clock, Setpoint(1, "6", 1005), release=(0,)))
    assert caps(gpus) == {0: None, 1: 1005, 2: None, 3: None}
    assert report(response, 0).job_id is None
    assert [(p.job_id, p.step, p.total, p.uid) for p in response.progress] == [("6", 3, None, 1001)]


# -- the lease -------------------------------------------------------------------------------


def test_lapsed_lease_moves_every_gpu_to_the_safe_cap_within_one_tick(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    agent.exchange(request(clock, Setpoint(0, "1", MAX_MHZ), Setpoint(1, "2", 600)))
    clock.advance(LEASE_S - 0.5)
    assert not agent.tick().lapsed
    assert caps(gpus) == {0: MAX_MHZ, 1: 600, 2: None, 3: None}
    clock.advance(0.5)
    with caplog.at_level(logging.WARNING, logger="slurm_cdgpc.agent.node"):
        result = agent.tick()
        agent.tick()
        clock.advance(10)
        agent.tick()
    assert result.lapsed
    # GPU 1 was already below the safe cap and is not raised; idle GPUs are capped too
    assert caps(gpus) == {0: SAFE_MHZ, 1: 600, 2: SAFE_MHZ, 3: SAFE_MHZ}
    assert sum("lease lapsed" in r.getMessage() for r in caplog.records) == 1


def test_valid_exchange_after_a_lapse_restores_control(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock
) -> None:
    agent.exchange(request(clock, Setpoint(0, "1", MAX_MHZ), Setpoint(1, "2", MAX_MHZ)))
    clock.advance(LEASE_S + 1)
    agent.tick()
    assert agent.lapsed
    response = agent.exchange(request(clock, Setpoint(0, "1", 1305)))
    assert not agent.lapsed
    # GPU 0: the head's new setpoint; GPU 1 holds a job with no new setpoint: stays safe;
    # GPUs 2 and 3 were capped only because of the lapse: back to defaults
    assert caps(gpus) == {0: 1305, 1: SAFE_MHZ, 2: None, 3: None}
    assert response.refused == ()
    assert not agent.tick().lapsed


def test_head_that_never_answers_trips_the_lease_after_one_duration(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock
) -> None:
    clock.advance(LEASE_S - 1)
    assert not agent.tick().lapsed
    clock.advance(1)
    assert agent.tick().lapsed
    assert set(caps(gpus).values()) == {SAFE_MHZ}


def test_lease_is_clamped_to_max_lease(
    make_agent: AgentFactory, gpus: GpuSet, clock: ManualClock
) -> None:
    agent = make_agent(max_lease_s=120.0)
    agent.exchange(request(clock, Setpoint(0, "1", MAX_MHZ), lease_s=10 * 86400))
    assert agent.lease_expires_s == pytest.approx(clock() + 120.0)
    clock.advance(121)
    assert agent.tick().lapsed


def test_on_lapse_reset_and_keep(
    make_agent: AgentFactory, gpus: GpuSet, clock: ManualClock, tmp_path: Path
) -> None:
    agent = make_agent(on_lapse="reset")
    agent.exchange(request(clock, Setpoint(0, "1", 900)))
    clock.advance(LEASE_S + 1)
    agent.tick()
    assert caps(gpus)[0] is None
    keep = NodeAgent(
        gpus,
        SafeCap(clock_fraction=0.6),
        tmp_path / "keep.json",
        clock,
        node_name="n",
        on_lapse="keep",
    )
    keep.exchange(request(clock, Setpoint(0, "1", 900)))
    clock.advance(LEASE_S + 1)
    assert keep.tick().lapsed
    assert caps(gpus)[0] == 900


def test_power_safe_cap_maps_to_a_clock_fraction(gpus: GpuSet) -> None:
    # 240 W of a 400 W board → fraction 0.6 → 840 MHz
    assert safe_clock_mhz(gpus[0], SafeCap(clock_fraction=None, power_w=240.0)) == SAFE_MHZ
    assert safe_clock_mhz(gpus[0], SafeCap(clock_fraction=None, power_w=1000.0)) == MAX_MHZ
    assert safe_clock_mhz(gpus[0], SafeCap(clock_fraction=0.01)) == 210


# -- readings ----------------------------------------------------------------------------------


def test_gpu_whose_read_fails_is_reported_not_fatal(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock
) -> None:
    sim(gpus, 1).fail_reads = True
    response = agent.exchange(request(clock, Setpoint(1, "3", 1005)))
    bad = report(response, 1)
    assert bad.error is not None and "fell off the bus" in bad.error
    assert bad.power_w is None and bad.energy_j is None and bad.sm_clock_mhz is None
    assert bad.locked is not None and bad.locked.graphics_max_mhz == 1005
    assert all(report(response, i).error is None for i in (0, 2, 3))


def test_garbage_power_is_never_trusted(agent: NodeAgent, gpus: GpuSet, clock: ManualClock) -> None:
    sim(gpus, 0).report_garbage_power = True
    seen = []
    for _ in range(4):  # NaN, 0 W, -1 W, 0xFFFFFFFF mW in turn
        clock.advance(1)
        g = report(agent.exchange(request(clock)), 0)
        assert g.power_w is None
        assert g.error is not None and "implausible power" in g.error
        assert g.energy_j is not None and math.isfinite(g.energy_j)  # the counter stays true
        seen.append(g.error)
    assert len(set(seen)) == 4
    # and the response is still valid JSON the head can parse
    assert (
        ExchangeResponse.from_json(agent.exchange(request(clock)).to_json()).gpus[0].power_w is None
    )


# -- state file, recovery, shutdown ------------------------------------------------------------


def test_state_file_lists_the_locks_and_disappears_when_none_remain(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock, state_file: Path
) -> None:
    assert not state_file.exists()
    agent.exchange(request(clock, Setpoint(2, "44", 1005)))
    state = json.loads(state_file.read_text())
    assert [
        (lock["index"], lock["graphics_max_mhz"], lock["job_id"]) for lock in state["locks"]
    ] == [(2, 1005, "44")]
    assert state["locks"][0]["uuid"] == gpus[2].uuid
    assert not list(state_file.parent.glob(".node-state.*"))  # no temp files left behind
    agent.exchange(request(clock, release=(2,)))
    assert not state_file.exists()


def test_state_that_cannot_be_recorded_refuses_the_setpoint(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock, state_file: Path
) -> None:
    state_file.parent.mkdir(parents=True, exist_ok=True)
    state_file.mkdir()  # a directory where the file should be: rename fails
    response = agent.exchange(request(clock, Setpoint(0, "1", 1005)))
    assert caps(gpus)[0] is None
    assert [r.gpu for r in response.refused] == [0]
    assert "state file" in response.refused[0].reason


def test_stale_state_file_restores_defaults_first(
    gpus: GpuSet, clock: ManualClock, state_file: Path, make_agent: AgentFactory
) -> None:
    first = make_agent()
    first.exchange(request(clock, Setpoint(0, "1", 900), Setpoint(1, "2", 900)))
    assert state_file.exists()
    # the agent "crashes": the locks and the state file remain; a new agent starts on the GPUs
    second = make_agent()
    assert second.recovered_stale_state
    assert caps(gpus) == {0: None, 1: None, 2: None, 3: None}
    assert not state_file.exists()


def test_stale_state_file_is_kept_when_a_reset_fails(
    gpus: GpuSet, clock: ManualClock, state_file: Path, make_agent: AgentFactory
) -> None:
    make_agent().exchange(request(clock, Setpoint(0, "1", 900), Setpoint(1, "2", 900)))
    sim(gpus, 0).fail_clock_writes = True
    agent = make_agent()
    assert caps(gpus) == {0: 900, 1: None, 2: None, 3: None}  # GPU 1 was reset regardless
    assert state_file.exists()
    sim(gpus, 0).fail_clock_writes = False
    make_agent()
    assert caps(gpus)[0] is None and not state_file.exists()
    assert agent.recovered_stale_state


def test_garbage_state_file_still_triggers_a_reset(
    gpus: GpuSet, clock: ManualClock, state_file: Path, make_agent: AgentFactory
) -> None:
    gpus[3].set_locked_clocks(600)
    state_file.parent.mkdir(parents=True)
    state_file.write_bytes(b"\x00\xffnot json")
    assert make_agent().recovered_stale_state
    assert caps(gpus)[3] is None and not state_file.exists()


def test_restore_defaults_tries_every_gpu(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock, state_file: Path
) -> None:
    agent.exchange(request(clock, *(Setpoint(i, "1", 900) for i in range(4))))
    sim(gpus, 1).fail_clock_writes = True
    failed = agent.restore_defaults()
    assert [index for index, _ in failed] == [1]
    assert caps(gpus) == {0: None, 1: 900, 2: None, 3: None}
    assert state_file.exists()  # GPU 1 may still be locked
    sim(gpus, 1).fail_clock_writes = False
    assert agent.restore_defaults() == []
    assert caps(gpus) == {0: None, 1: None, 2: None, 3: None}
    assert not state_file.exists()


# -- progress ----------------------------------------------------------------------------------


def test_progress_keeps_the_latest_per_job(agent: NodeAgent, clock: ManualClock) -> None:
    agent.record_progress("12", 1, 10, uid=1000)
    clock.advance(5)
    agent.record_progress("12", 4, 10, uid=1000)
    (p,) = agent.exchange(request(clock)).progress
    assert (p.job_id, p.step, p.total, p.uid, p.time_s) == ("12", 4, 10, 1000, clock())


def test_progress_of_a_job_belongs_to_its_first_reporter(agent: NodeAgent) -> None:
    agent.record_progress("12", 1, None, uid=1000)
    with pytest.raises(InputError, match="uid 1000, not 1001"):
        agent.record_progress("12", 99, None, uid=1001)
    agent.record_progress("12", 2, None, uid=0)  # root may


@pytest.mark.parametrize(
    ("job", "step", "total"), [("abc", 1, None), ("12", -1, None), ("12", 5, 4), ("0", 1, None)]
)
def test_bad_progress_is_refused(agent: NodeAgent, job: str, step: int, total: int | None) -> None:
    with pytest.raises(InputError):
        agent.record_progress(job, step, total, uid=1000)


def test_bad_lapse_action_is_refused(make_agent: AgentFactory) -> None:
    with pytest.raises(InputError, match="on_lapse"):
        make_agent(on_lapse="panic")


def test_epilog_release_resets_only_that_jobs_gpus(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock, state_file: Path
) -> None:
    agent.exchange(
        request(clock, Setpoint(0, "7", 1200), Setpoint(1, "7", 1200), Setpoint(2, "8", 900))
    )
    released, refused = agent.release_job("7")
    assert (released, refused) == ([0, 1], [])
    assert caps(gpus) == {0: None, 1: None, 2: 900, 3: None}
    assert json.loads(state_file.read_text())  # job 8's lock is still on record
    assert agent.release_job("7") == ([], [])  # twice: nothing left to do
    assert agent.release_job("999") == ([], [])  # a job this node never ran touches nothing
    assert caps(gpus)[2] == 900
