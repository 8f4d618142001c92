"""`NodeAgent` on simulated GPUs and a manual clock: setpoints, lease, state file, readings."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_cdgpc.agent.node import (
    MAX_PROGRESS_PER_UID,
    NodeAgent,
    StaleEpochError,
    WrongNodeError,
    safe_clock_mhz,
)
from slurm_cdgpc.config import SafeCap
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.gpu.device import GpuSet
from slurm_cdgpc.gpu.simulated import ManualClock, SimulatedGpu, simulated_gpus
from slurm_cdgpc.wire.protocol import ExchangeRequest, ExchangeResponse, GpuReport, Setpoint

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
            "clock": clock,
        }
        options.update(kwargs)
        return NodeAgent(gpus, state_file=state_file, **options)  # type: ignore[arg-type]

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
    epoch: int = 0,
    node: str = "gpu01",
) -> ExchangeRequest:
    return ExchangeRequest(
        interval=interval,
        lease_expires_s=clock() + lease_s,
        setpoints=setpoints,
        release=release,
        epoch=epoch,
        node=node,
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
    applied = agent.exchange(
        request(clock, Setpoint(1, "101", 1200), Setpoint(3, "102_7", 900, 1593))
    )
    assert caps(gpus) == {0: None, 1: 1200, 2: None, 3: 900}
    assert applied.refused == ()
    # its readings were taken before the setpoints applied: the interval that ended, unlocked
    assert [(g.job_id, g.locked) for g in applied.gpus] == [(None, None)] * 4
    clock.advance(1.0)
    response = agent.exchange(request(clock))
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
    after = agent.exchange(request(clock))
    assert report(after, 2).job_id is None  # never claimed as applied
    assert report(after, 1).job_id == "101"


def test_released_gpu_is_reset_and_its_progress_dropped(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock
) -> None:
    agent.exchange(request(clock, Setpoint(0, "5", 1005), Setpoint(1, "6", 1005)))
    agent.record_progress("5", 10, 100, uid=1000)
    agent.record_progress("6", 3, None, uid=1001)
    response = agent.exchange(request(clock, Setpoint(1, "6", 1005), release=(0,)))
    assert caps(gpus) == {0: None, 1: 1005, 2: None, 3: None}
    assert report(response, 0).job_id == "5"  # read before the release: job 5 ran until now
    assert report(agent.exchange(request(clock)), 0).job_id is None
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


def test_wall_clock_stepped_back_does_not_stretch_the_lease(
    make_agent: AgentFactory, gpus: GpuSet, clock: ManualClock
) -> None:
    """The lease runs on the monotonic clock: a wall clock stepped back an hour after the last
    exchange (an NTP step with the head gone) still lapses one lease after that exchange."""
    wall = ManualClock(T0_S)
    agent = make_agent(clock=wall, monotonic=clock)
    agent.exchange(request(wall, Setpoint(0, "1", MAX_MHZ)))
    wall.now_s -= 3600.0  # stepped back; the monotonic clock does not move
    wall.advance(LEASE_S - 1)
    clock.advance(LEASE_S - 1)
    assert not agent.tick().lapsed
    wall.advance(1)
    clock.advance(1)
    assert agent.tick().lapsed  # by the wall clock, 3600 s of lease would be left
    assert set(caps(gpus).values()) == {SAFE_MHZ}


def test_wall_clock_stepped_ahead_does_not_cut_the_lease_short(
    make_agent: AgentFactory, gpus: GpuSet, clock: ManualClock
) -> None:
    wall = ManualClock(T0_S)
    agent = make_agent(clock=wall, monotonic=clock)
    agent.exchange(request(wall, Setpoint(0, "1", MAX_MHZ)))
    wall.advance(3600.0)
    clock.advance(LEASE_S - 1)
    assert not agent.tick().lapsed
    assert caps(gpus)[0] == MAX_MHZ


def test_exchange_expired_on_arrival_applies_and_renews_nothing(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A head whose clock is behind by more than a lease sends leases that are over when they
    arrive: applying their setpoints would flip the node between the head's clocks and the safe
    cap at every tick. They are refused, the readings answered, the lapse kept."""
    agent.exchange(request(clock, Setpoint(0, "1", 1305), Setpoint(1, "2", 1305)))
    clock.advance(LEASE_S + 1)
    assert agent.tick().lapsed
    capped = caps(gpus)
    assert capped == {0: SAFE_MHZ, 1: SAFE_MHZ, 2: SAFE_MHZ, 3: SAFE_MHZ}
    expires_s = agent.lease_expires_s
    with caplog.at_level(logging.WARNING, logger="slurm_cdgpc.agent.node"):
        response = agent.exchange(
            request(clock, Setpoint(0, "1", MAX_MHZ), release=(1,), lease_s=-0.5, interval=9)
        )
    assert caps(gpus) == capped  # no setpoint, no release
    assert sorted(r.gpu for r in response.refused) == [0, 1]
    assert all("expired on arrival" in r.reason for r in response.refused)
    assert [g.index for g in response.gpus] == [0, 1, 2, 3]
    assert report(response, 0).locked is not None and report(response, 0).power_w is not None
    assert agent.lapsed and agent.lease_expires_s == expires_s
    assert any("expired on arrival" in r.getMessage() for r in caplog.records)
    clock.advance(1.0)
    assert agent.tick().lapsed
    assert caps(gpus) == capped
    # a lease that is still running takes control back
    agent.exchange(request(clock, Setpoint(0, "1", MAX_MHZ)))
    assert not agent.lapsed
    assert caps(gpus)[0] == MAX_MHZ


def test_exchange_expired_on_arrival_does_not_shorten_a_running_lease(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock
) -> None:
    agent.exchange(request(clock, Setpoint(0, "1", 1305)))
    response = agent.exchange(request(clock, Setpoint(0, "1", 900), lease_s=-1.0))
    assert [r.gpu for r in response.refused] == [0]
    assert caps(gpus)[0] == 1305
    clock.advance(LEASE_S - 1)
    assert not agent.tick().lapsed


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
    keep.exchange(request(clock, Setpoint(0, "1", 900), node="n"))
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
    agent.exchange(request(clock, Setpoint(1, "3", 1005)))
    response = agent.exchange(request(clock))
    bad = report(response, 1)
    assert bad.error is not None and "fell off the bus" in bad.error
    assert bad.power_w is None and bad.energy_j is None and bad.sm_clock_mhz is None
    assert bad.read_s is None
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


def test_on_hopper_each_reading_describes_the_interval_that_ended(
    tmp_path: Path, clock: ManualClock
) -> None:
    """An H100 reports power averaged over the last second. Read right after a clock change,
    as the agent used to, that reading still is the old clock's power next to the new clock;
    read before the change, it is the power of the clock reported with it, and the energy
    counter's difference over the interval is the interval's true mean power."""
    h100 = simulated_gpus("H100-SXM", 1, seed=3, time_source=clock)
    gpu = sim(h100, 0)
    gpu.attach("resnet50")
    agent = NodeAgent(
        h100, SafeCap(clock_fraction=0.6), tmp_path / "s.json", clock, node_name="gpu01"
    )
    previous: GpuReport | None = None
    after_errors, before_errors, mean_errors = [], [], []
    for interval, mhz in enumerate((1980, 1005, 1755, 1200, 1500, 990, 1950), start=1):
        clock.advance(1.0)
        drawn_w = gpu.true_power_w  # constant since the last exchange
        now = report(agent.exchange(request(clock, Setpoint(0, "7", mhz), interval=interval)), 0)
        then = gpu.read()  # what the agent used to report: read after applying the new clock
        assert then.sm_clock_mhz == mhz or interval == 1
        after_errors.append(abs(then.power_w - gpu.true_power_w) / gpu.true_power_w)
        assert now.power_w is not None and now.energy_j is not None and now.read_s is not None
        if previous is not None:
            assert now.locked is not None and now.job_id == "7"
            before_errors.append(abs(now.power_w - drawn_w) / drawn_w)
            assert previous.energy_j is not None and previous.read_s is not None
            mean_w = (now.energy_j - previous.energy_j) / (now.read_s - previous.read_s)
            mean_errors.append(abs(mean_w - drawn_w) / drawn_w)
        previous = now
    # the first lock (1980 MHz) is the default clock; every later change reads ≥ 10 % off
    assert min(after_errors[1:]) > 0.10
    assert max(before_errors) < 0.04  # the reading's 1 % noise, no more
    assert max(mean_errors) < 1e-9


# -- fencing: the leader epoch ------------------------------------------------------------------


def test_an_older_leader_epoch_is_refused_and_changes_nothing(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock, state_file: Path
) -> None:
    agent.exchange(request(clock, Setpoint(0, "1", 1005), Setpoint(1, "2", 1005), epoch=3))
    lease_s = agent.lease_expires_s
    clock.advance(10.0)
    # the head that held epoch 2 wakes up and pushes what it decided before it was paused
    stale = request(clock, Setpoint(0, "1", 600), release=(1,), lease_s=LEASE_S, epoch=2)
    with pytest.raises(StaleEpochError, match="leader epoch 2 is older than epoch 3") as info:
        agent.exchange(stale)
    assert isinstance(info.value, InputError) and "\n" not in str(info.value)
    assert caps(gpus) == {0: 1005, 1: 1005, 2: None, 3: None}  # neither set nor released
    assert agent.lease_expires_s == lease_s  # nor did it renew the lease
    assert agent.epoch == 3 and json.loads(state_file.read_text())["epoch"] == 3
    # so the lease still lapses on time: a stale head cannot keep the node from its safe cap
    clock.advance(LEASE_S)
    assert agent.tick().lapsed
    assert caps(gpus) == {0: SAFE_MHZ, 1: SAFE_MHZ, 2: SAFE_MHZ, 3: SAFE_MHZ}


def test_the_same_or_a_newer_epoch_is_obeyed_and_remembered(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock
) -> None:
    agent.exchange(request(clock, Setpoint(0, "1", 1005), epoch=3))
    agent.exchange(request(clock, Setpoint(0, "1", 900), epoch=3))
    assert caps(gpus)[0] == 900
    agent.exchange(request(clock, Setpoint(0, "1", 1200), epoch=5))  # a standby took over
    assert caps(gpus)[0] == 1200 and agent.epoch == 5
    for old in (0, 3, 4):
        with pytest.raises(StaleEpochError):
            agent.exchange(request(clock, Setpoint(0, "1", 600), epoch=old))
    assert caps(gpus)[0] == 1200


def test_the_epoch_outlives_a_clean_restart_of_the_agent(
    gpus: GpuSet, clock: ManualClock, state_file: Path, make_agent: AgentFactory
) -> None:
    first = make_agent()
    first.exchange(request(clock, Setpoint(0, "1", 1005), epoch=4))
    first.restore_defaults()  # SIGTERM: every GPU back to defaults, but the epoch is kept
    assert json.loads(state_file.read_text()) | {"pid": 0, "written_s": 0} == {
        "version": 1,
        "node": "gpu01",
        "pid": 0,
        "written_s": 0,
        "epoch": 4,
        "locks": [],
    }
    second = make_agent()
    assert not second.recovered_stale_state  # an empty lock list is no crash
    assert second.epoch == 4
    with pytest.raises(StaleEpochError):
        second.exchange(request(clock, Setpoint(0, "1", 600), epoch=3))
    assert caps(gpus) == {0: None, 1: None, 2: None, 3: None}


def test_the_epoch_outlives_a_crash_of_the_agent(
    gpus: GpuSet, clock: ManualClock, state_file: Path, make_agent: AgentFactory
) -> None:
    make_agent().exchange(request(clock, Setpoint(0, "1", 1005), epoch=6))
    # the agent "crashes" with GPU 0 locked; the next one resets it and still knows epoch 6
    second = make_agent()
    assert second.recovered_stale_state
    assert caps(gpus)[0] is None
    assert second.epoch == 6 and json.loads(state_file.read_text())["locks"] == []
    with pytest.raises(StaleEpochError):
        second.exchange(request(clock, Setpoint(0, "1", 600), epoch=5))


def test_a_new_epoch_is_recorded_before_anything_is_applied(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock, state_file: Path
) -> None:
    """Even an exchange that sets nothing moves the epoch on, durably: the old head is fenced
    off from the first contact with the new one."""
    agent.exchange(request(clock, epoch=2))
    assert caps(gpus) == {0: None, 1: None, 2: None, 3: None}
    assert json.loads(state_file.read_text())["epoch"] == 2


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


def test_moving_a_listed_gpus_clock_writes_the_state_file_once(
    agent: NodeAgent,
    gpus: GpuSet,
    clock: ManualClock,
    state_file: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    writes: list[Path] = []
    replace = os.replace

    def counting(src: Path, dst: Path) -> None:
        writes.append(Path(dst))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", counting)
    agent.exchange(request(clock, Setpoint(0, "1", 900)))
    assert writes == [state_file, state_file]  # GPU 0 is new: recorded before it is locked
    writes.clear()
    agent.exchange(request(clock, Setpoint(0, "1", 1005)))
    assert writes == [state_file]  # only its clock moved: recorded after
    writes.clear()
    agent.exchange(request(clock, Setpoint(0, "1", 900), Setpoint(1, "1", 900)))
    assert writes == [state_file, state_file]  # GPU 1 is new again


def test_a_crash_before_the_record_of_a_moved_clock_still_resets_every_gpu(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock, make_agent: AgentFactory
) -> None:
    """The single write comes after the clock moves; a crash in between leaves a file naming the
    old clock, which is enough: recovery resets every GPU the file lists, whatever the clock."""
    agent.exchange(request(clock, Setpoint(0, "1", 900)))

    def crash() -> None:
        raise RuntimeError("the agent dies here")

    agent._sync_state = crash  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        agent.exchange(request(clock, Setpoint(0, "1", 1005)))
    assert caps(gpus)[0] == 1005
    restarted = make_agent()
    assert restarted.recovered_stale_state
    assert caps(gpus) == {0: None, 1: None, 2: None, 3: None}


def test_a_temp_file_left_by_a_crash_mid_write_is_replaced(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock, state_file: Path
) -> None:
    state_file.parent.mkdir(parents=True, exist_ok=True)
    leftover = state_file.with_name(f".node-state.{state_file.name}.tmp")
    leftover.write_text("half a document")
    agent.exchange(request(clock, Setpoint(2, "44", 1005)))
    assert caps(gpus)[2] == 1005
    assert json.loads(state_file.read_text())["locks"][0]["graphics_max_mhz"] == 1005
    assert not leftover.exists()


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


# -- one node per request ----------------------------------------------------------------------


def test_a_request_for_another_node_is_refused_and_changes_nothing(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock, state_file: Path
) -> None:
    """A request captured on its way to gpu02 and replayed here (its credential binds the body,
    so the node name too) sets no clock, releases nothing, renews no lease, raises no epoch."""
    agent.exchange(request(clock, Setpoint(0, "1", 1005), Setpoint(1, "2", 1005), epoch=3))
    lease_s, before = agent.lease_expires_s, state_file.read_text()
    clock.advance(10.0)
    captured = request(clock, Setpoint(0, "1", 600), release=(1,), epoch=4, node="gpu02")
    with pytest.raises(WrongNodeError, match="for node gpu02, this is node gpu01") as info:
        agent.exchange(captured)
    assert isinstance(info.value, InputError) and "\n" not in str(info.value)
    assert caps(gpus) == {0: 1005, 1: 1005, 2: None, 3: None}
    assert agent.lease_expires_s == lease_s and agent.epoch == 3
    assert state_file.read_text() == before
    clock.advance(LEASE_S)
    assert agent.tick().lapsed  # so the replay could not keep this node from its safe cap


# -- progress ----------------------------------------------------------------------------------


def test_progress_keeps_the_latest_per_job(agent: NodeAgent, clock: ManualClock) -> None:
    agent.record_progress("12", 1, 10, uid=1000)
    clock.advance(5)
    agent.record_progress("12", 4, 10, uid=1000)
    (p,) = agent.exchange(request(clock)).progress
    assert (p.job_id, p.step, p.total, p.uid, p.time_s) == ("12", 4, 10, 1000, clock())


def test_another_user_can_neither_overwrite_nor_lock_out_a_jobs_progress(
    agent: NodeAgent, clock: ManualClock
) -> None:
    """Each uid's report is kept apart (the head keeps root's and the owner's only): a user who
    reports another's job first does not own it, and cannot overwrite the owner's report."""
    agent.record_progress("12", 999, None, uid=65534)  # first, and not the owner
    agent.record_progress("12", 5, 100, uid=1000)
    clock.advance(1)
    agent.record_progress("12", 998, None, uid=65534)
    agent.record_progress("12", 7, 100, uid=0)
    reports = {p.uid: p.step for p in agent.exchange(request(clock)).progress}
    assert reports == {1000: 5, 65534: 998, 0: 7}


def test_one_user_flooding_job_ids_keeps_only_its_own_latest(
    agent: NodeAgent, clock: ManualClock
) -> None:
    agent.record_progress("12", 5, None, uid=1000)
    for job in range(1, MAX_PROGRESS_PER_UID + 50):
        agent.record_progress(str(job + 100), 1, None, uid=65534)
    progress = agent.exchange(request(clock)).progress
    assert [(p.job_id, p.step) for p in progress if p.uid == 1000] == [("12", 5)]
    assert sum(p.uid == 65534 for p in progress) == MAX_PROGRESS_PER_UID


@pytest.mark.parametrize(
    ("job", "step", "total"), [("abc", 1, None), ("12", -1, None), ("12", 5, 4), ("0", 1, None)]
)
def test_bad_progress_is_refused(agent: NodeAgent, job: str, step: int, total: int | None) -> None:
    with pytest.raises(InputError):
        agent.record_progress(job, step, total, uid=1000)


def test_bad_lapse_action_is_refused(make_agent: AgentFactory) -> None:
    with pytest.raises(InputError, match="on_lapse"):
        make_agent(on_lapse="panic")


def test_a_prolog_hold_caps_the_jobs_gpus_until_the_heads_setpoint(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock, state_file: Path
) -> None:
    held, refused = agent.hold_job("77", [1, 2])
    assert (held, refused) == ([1, 2], [])
    assert caps(gpus) == {0: None, 1: SAFE_MHZ, 2: SAFE_MHZ, 3: None}
    locks = json.loads(state_file.read_text())["locks"]
    assert {(lock["index"], lock["job_id"]) for lock in locks} == {(1, "77"), (2, "77")}
    response = agent.exchange(request(clock, Setpoint(1, "77", 1200)))
    assert report(response, 2).job_id == "77"  # the readings name the job before the head does
    assert caps(gpus)[1] == 1200  # the head's setpoint takes over
    assert agent.release_job("77") == ([1, 2], [])  # the Epilog resets held GPUs too
    assert caps(gpus) == {0: None, 1: None, 2: None, 3: None}


def test_a_hold_never_raises_a_clock_and_shares_another_jobs_gpu(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock
) -> None:
    agent.exchange(request(clock, Setpoint(0, "5", 600), Setpoint(3, "6", 1200)))
    agent.release_job("6")  # GPU 3 is free again
    gpus[3].set_locked_clocks(405)  # below the safe cap, left there (say, by a lapse)
    held, refused = agent.hold_job("77", [0, 3, 9])
    assert held == [0, 3] and caps(gpus)[3] == 405  # kept, not raised to the safe cap
    assert {r.gpu: r.reason for r in refused} == {9: "no GPU with index 9 on this node"}
    assert caps(gpus)[0] == 600  # job 5's GPU, shared at the clock the head gave it


def test_a_shared_gpu_returns_to_defaults_only_when_its_last_job_leaves(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock
) -> None:
    """Two jobs on GPU 0 (shards, MPS, MIG slices: one physical GPU): the first job's Epilog
    releases its share and leaves the GPU at its clock for the second; the second's resets it.
    """
    agent.exchange(request(clock, Setpoint(0, "5", 600)))
    assert agent.hold_job("6", [0]) == ([0], [])
    released, refused = agent.release_job("5")
    assert (released, refused) == ([0], [])
    assert caps(gpus)[0] == 600  # job 6 still runs on it
    assert agent.exchange(request(clock)).gpus[0].job_id == "6"  # now the GPU's job
    assert agent.release_job("6") == ([0], [])
    assert caps(gpus)[0] is None  # the last job left: default clocks
    # the head's setpoint passes the GPU to a job sharing it (the first one's Epilog has not
    # come yet): a third job's share stays, the first job's assignment does not
    agent.exchange(request(clock, Setpoint(1, "7", 600)))
    agent.hold_job("8", [1])
    agent.hold_job("9", [1])
    agent.exchange(request(clock, Setpoint(1, "8", 900)))
    assert agent.release_job("8") == ([1], [])
    assert caps(gpus)[1] == 900  # job 9 still runs on it
    assert agent.release_job("7") == ([], [])  # no longer the GPU's: nothing of it to release
    assert agent.release_job("9") == ([1], [])
    assert caps(gpus)[1] is None


def test_the_heads_tenants_keep_a_shared_gpu_at_its_clock_until_the_last_leaves(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock
) -> None:
    """The head names a shared GPU's other jobs in its setpoint (its Prologs' holds may have
    come before the head named the GPU's first job): whichever tenant ends first, the GPU
    keeps its clock for the others, and returns to defaults with the last."""
    agent.exchange(request(clock, Setpoint(2, "8", 900, tenants=("7",))))
    agent.exchange(request(clock, Setpoint(2, "8", 825, tenants=("7", "9"))))
    assert agent.release_job("8") == ([2], [])
    assert caps(gpus)[2] == 825  # jobs 7 and 9 still run on it
    assert agent.release_job("7") == ([2], [])
    assert caps(gpus)[2] == 825
    assert agent.release_job("9") == ([2], [])
    assert caps(gpus)[2] is None


def test_a_hold_after_the_heads_setpoint_keeps_the_setpoint(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock
) -> None:
    # the Prolog holds after it registers: within one interval the head may plan the job first
    agent.exchange(request(clock, Setpoint(1, "77", 1200)))
    held, refused = agent.hold_job("77", [1, 2])
    assert (held, refused) == ([1, 2], [])
    assert caps(gpus) == {0: None, 1: 1200, 2: SAFE_MHZ, 3: None}
    assert agent.hold_job("77", [1, 2]) == ([1, 2], [])  # a hold repeated changes nothing
    assert caps(gpus) == {0: None, 1: 1200, 2: SAFE_MHZ, 3: None}


def test_a_hold_that_cannot_be_recorded_changes_nothing(
    agent: NodeAgent, gpus: GpuSet, state_file: Path
) -> None:
    state_file.parent.mkdir(parents=True, exist_ok=True)
    state_file.mkdir()  # a directory where the file should be: the write fails
    held, refused = agent.hold_job("77", [1])
    assert held == [] and [r.gpu for r in refused] == [1]
    assert caps(gpus)[1] is None


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


# -- the power-limit guard rail ----------------------------------------------------------------

A100_DEFAULT_W = 400.0
A100_MIN_W = 100.0


def test_the_guard_rail_is_set_with_the_lock_and_clipped_into_the_board(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock
) -> None:
    answer = agent.exchange(
        request(
            clock,
            Setpoint(0, "7", 1200, None, 287.5),
            Setpoint(1, "7", 1200, None, 5000.0),  # above the board: its default
            Setpoint(2, "7", 1200, None, 20.0),  # below the board: its minimum
            Setpoint(3, "8", 1200),
        )
    )
    assert answer.refused == ()
    limits = [sim(gpus, i).power_limit_set_w for i in range(4)]
    assert limits == [287.5, A100_DEFAULT_W, A100_MIN_W, None]
    assert all(sim(gpus, i).locked is not None for i in range(4))
    assert sim(gpus, 0).read().enforced_limit_w == 287.5  # what the firmware now holds
    # a setpoint without one puts the default limit back
    agent.exchange(request(clock, Setpoint(0, "7", 1200)))
    assert sim(gpus, 0).power_limit_set_w is None
    assert sim(gpus, 0).read().enforced_limit_w == A100_DEFAULT_W


def test_a_refused_limit_is_logged_once_and_the_lock_stands(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    sim(gpus, 0).fail_power_limit_writes = True  # NO_PERMISSION
    with caplog.at_level(logging.WARNING, logger="slurm_cdgpc.agent.node"):
        for interval, mhz in enumerate((1200, 1110, 1005), start=1):
            answer = agent.exchange(
                request(clock, Setpoint(0, "7", mhz, None, 250.0), interval=interval)
            )
            assert answer.refused == ()
            locked = sim(gpus, 0).locked
            assert locked is not None and locked.graphics_max_mhz == mhz
    warnings = [r for r in caplog.records if "power limit" in r.getMessage()]
    assert len(warnings) == 1 and "lock stands" in warnings[0].getMessage()
    assert sim(gpus, 0).power_limit_set_w is None


def test_release_lapse_and_shutdown_restore_the_default_limit(
    make_agent: AgentFactory, gpus: GpuSet, clock: ManualClock, state_file: Path
) -> None:
    agent = make_agent()
    agent.exchange(request(clock, *(Setpoint(i, "7", 1200, None, 250.0) for i in range(3))))
    assert json.loads(state_file.read_text())["locks"][0]["power_limit_w"] == 250.0
    agent.exchange(request(clock, release=(0,)))  # the job ended on GPU 0
    assert sim(gpus, 0).power_limit_set_w is None and sim(gpus, 0).locked is None
    assert sim(gpus, 1).power_limit_set_w == 250.0
    clock.advance(LEASE_S + 1)
    assert agent.tick().lapsed  # the safe cap is a clock: the head's rail goes with the head
    assert [sim(gpus, i).power_limit_set_w for i in range(3)] == [None] * 3
    agent.exchange(request(clock, Setpoint(1, "7", 1200, None, 250.0)))
    assert sim(gpus, 1).power_limit_set_w == 250.0
    assert agent.restore_defaults() == []
    assert all(sim(gpus, i).power_limit_set_w is None for i in range(4))
    assert not state_file.exists()


def test_reset_on_lapse_restores_the_default_limit(
    make_agent: AgentFactory, gpus: GpuSet, clock: ManualClock
) -> None:
    agent = make_agent(on_lapse="reset")
    agent.exchange(request(clock, Setpoint(0, "7", 1200, None, 250.0)))
    clock.advance(LEASE_S + 1)
    assert agent.tick().changed == (0,)
    assert sim(gpus, 0).power_limit_set_w is None and sim(gpus, 0).locked is None


def test_a_limit_left_by_a_crashed_agent_is_reset_at_the_next_start(
    make_agent: AgentFactory, gpus: GpuSet, clock: ManualClock, state_file: Path
) -> None:
    crashed = make_agent()
    crashed.exchange(request(clock, Setpoint(2, "7", 1200, None, 250.0)))
    # its clocks were reset by hand, its limit was not: the file still lists the limit
    sim(gpus, 2).reset_locked_clocks()
    crashed._sync_state()
    [entry] = json.loads(state_file.read_text())["locks"]
    assert (entry["index"], entry["graphics_max_mhz"], entry["power_limit_w"]) == (2, None, 250.0)
    del crashed  # killed: nothing restored
    restarted = make_agent()
    assert restarted.recovered_stale_state
    assert sim(gpus, 2).power_limit_set_w is None
    assert sim(gpus, 2).read().enforced_limit_w == A100_DEFAULT_W
    assert not state_file.exists()


def test_the_epilogs_release_restores_the_default_limit(
    agent: NodeAgent, gpus: GpuSet, clock: ManualClock
) -> None:
    agent.exchange(request(clock, Setpoint(1, "7", 1200, None, 250.0)))
    assert agent.release_job("7") == ([1], [])
    assert sim(gpus, 1).power_limit_set_w is None and sim(gpus, 1).locked is None


# -- another process's clocks --------------------------------------------------------------------


@pytest.mark.parametrize("action", ["reapply", "yield"])
def test_clocks_changed_behind_our_back_are_locked_again_or_left_to_the_other_process(
    make_agent: AgentFactory,
    gpus: GpuSet,
    clock: ManualClock,
    action: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = make_agent(on_override=action)
    gpu = sim(gpus, 1)
    gpu.attach("resnet50")  # busy: an idle GPU's clock says nothing of the lock
    point = Setpoint(gpu=1, job_id="5", graphics_mhz=1005)
    agent.exchange(request(clock, point))
    clock.advance(30)
    agent.exchange(request(clock, point))
    assert report(agent.exchange(request(clock, point)), 1).sm_clock_mhz <= 1005
    gpu.override_lock(1410)  # nvidia-smi -lgc by someone else; NVML still shows ours
    with caplog.at_level("WARNING", logger="slurm_cdgpc.agent.node"):
        for _ in range(3):
            clock.advance(30)
            response = agent.exchange(request(clock, point))
    overrides = [r for r in caplog.records if "another process changed them" in r.getMessage()]
    assert len(overrides) == 1  # once, not every exchange
    clock.advance(30)
    after = agent.exchange(request(clock, point))
    if action == "reapply":
        assert report(after, 1).sm_clock_mhz <= 1005 and after.refused == ()
    else:
        assert report(after, 1).sm_clock_mhz > 1005  # theirs stands
        assert [r.gpu for r in response.refused] == [1] and "another process" in response.refused[
            0
        ].reason
        ended = agent.exchange(request(clock, release=(1,)))
        assert ended.refused == () and report(ended, 1).sm_clock_mhz > 1005  # left as it is
        assert report(agent.exchange(request(clock, point)), 1).locked is not None  # ours again
