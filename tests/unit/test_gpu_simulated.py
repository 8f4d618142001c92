"""The simulated GPU backend, on a manual clock: what an agent or a demo sees of it."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_cdgpc.errors import (
    GpuError,
    GpuLostError,
    InputError,
    PowerLimitPermissionError,
    UnsupportedClockError,
    UnsupportedPowerLimitError,
)
from slurm_cdgpc.gpu.board import spec_from_board
from slurm_cdgpc.gpu.catalog import catalog_spec
from slurm_cdgpc.gpu.device import LockedClocks, ThrottleReason, lock_overridden
from slurm_cdgpc.gpu.plant import NoiseModel, workload_profile
from slurm_cdgpc.gpu.simulated import ManualClock, SimulatedGpu, node_gpu_kinds, simulated_gpus
from slurm_cdgpc.wire.board import BoardDescription

QUIET = NoiseModel(power_rel=0.0, time_rel=0.0)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(start_s=100.0)


@pytest.fixture
def make_gpu(clock: ManualClock) -> Callable[..., SimulatedGpu]:
    def make(spec: str = "A100", *, noise: NoiseModel = QUIET, seed: int = 0) -> SimulatedGpu:
        return SimulatedGpu(catalog_spec(spec), seed=seed, time_source=clock, noise=noise)

    return make


def test_unsupported_clocks_are_refused_before_anything_changes(
    make_gpu: Callable[..., SimulatedGpu], clock: ManualClock
) -> None:
    gpu = make_gpu("A100")
    gpu.attach("bert")
    gpu.set_locked_clocks(1200)
    before = gpu.read()
    for graphics_mhz, memory_mhz in ((1201, None), (1500, None), (1200, 1215), (195, None)):
        with pytest.raises(UnsupportedClockError):
            gpu.set_locked_clocks(graphics_mhz, memory_mhz)
    assert gpu.locked == LockedClocks(210, 1200, None)
    assert gpu.clock_writes == 1
    clock.advance(1.0)
    after = gpu.read()
    assert after.sm_clock_mhz == before.sm_clock_mhz == 1200


def test_locks_are_ranges_and_idempotent(make_gpu: Callable[..., SimulatedGpu]) -> None:
    gpu = make_gpu("H100-SXM")
    gpu.set_locked_clocks(1500, 2619)  # an HBM part: the memory clock is not locked
    gpu.set_locked_clocks(1500)
    assert gpu.locked == LockedClocks(graphics_min_mhz=345, graphics_max_mhz=1500, memory_mhz=None)
    assert gpu.clock_writes == 1
    gpu.reset_locked_clocks()
    gpu.reset_locked_clocks()
    assert gpu.locked is None
    assert gpu.clock_writes == 2


def test_gddr_memory_locks_follow_the_table(
    make_gpu: Callable[..., SimulatedGpu], clock: ManualClock
) -> None:
    gpu = make_gpu("A40")
    gpu.attach("resnet50")
    with pytest.raises(UnsupportedClockError):
        gpu.set_locked_clocks(1740, 405)  # 405 MHz memory lists graphics only up to 645
    gpu.set_locked_clocks(645, 405)
    assert gpu.locked == LockedClocks(210, 645, 405)
    clock.advance(1.0)
    reading = gpu.read()
    assert reading.memory_clock_mhz == 405
    assert reading.sm_clock_mhz == 645
    slow = gpu.true_iteration_time_s
    gpu.set_locked_clocks(645, 7251)
    assert gpu.true_iteration_time_s is not None and slow is not None
    assert gpu.true_iteration_time_s < slow / 2  # the memory clock matters on GDDR


def test_reset_restores_the_max_clock(
    make_gpu: Callable[..., SimulatedGpu], clock: ManualClock
) -> None:
    gpu = make_gpu("A100")
    gpu.attach("ncf")  # light enough that the 400 W limit never binds
    gpu.set_locked_clocks(900)
    clock.advance(1.0)
    assert gpu.read().sm_clock_mhz == 900
    gpu.reset_locked_clocks()
    clock.advance(1.0)
    reading = gpu.read()
    assert reading.sm_clock_mhz == 1410
    assert reading.throttle == ThrottleReason.NONE


def test_energy_is_the_integral_of_true_power_and_never_decreases(
    make_gpu: Callable[..., SimulatedGpu], clock: ManualClock
) -> None:
    gpu = make_gpu("A100", noise=NoiseModel())
    expected_j = 0.0
    last_j = gpu.read().energy_j
    steps: list[Callable[[], None]] = [
        lambda: gpu.attach("bloom-bwd"),
        lambda: gpu.set_locked_clocks(1005),
        lambda: gpu.set_power_limit_w(250.0),
        gpu.reset_locked_clocks,
        gpu.detach,
    ]
    for change in steps:
        change()
        for _ in range(4):
            # 1 ms steps: a binding limit lets the power run high for a burst after a change
            for _ in range(370):
                power_w = gpu.true_power_w
                clock.advance(0.001)
                expected_j += power_w * 0.001
            reading = gpu.read()
            assert reading.energy_j >= last_j
            last_j = reading.energy_j
    assert last_j == pytest.approx(expected_j, rel=1e-3)
    assert last_j > 20 * 0.37 * catalog_spec("A100").idle_power_w  # mostly under load


def test_hopper_averages_a_step_change_over_one_second(
    make_gpu: Callable[..., SimulatedGpu], clock: ManualClock
) -> None:
    gpu = make_gpu("H100")
    gpu.attach("gpt2")
    clock.advance(5.0)
    high_w = gpu.true_power_w
    assert gpu.read().power_w == pytest.approx(high_w)
    gpu.set_locked_clocks(900)
    low_w = gpu.true_power_w
    assert low_w < 0.7 * high_w
    seen = []
    for _ in range(5):
        seen.append(gpu.read().power_w)
        clock.advance(0.25)
    assert seen[0] == pytest.approx(high_w)  # the change is not visible yet
    assert seen[2] == pytest.approx((high_w + low_w) / 2)
    assert seen[4] == pytest.approx(low_w)  # one second later it is complete


def test_ampere_reports_a_step_change_at_once(
    make_gpu: Callable[..., SimulatedGpu], clock: ManualClock
) -> None:
    gpu = make_gpu("A100")
    gpu.attach("gpt2")
    clock.advance(5.0)
    gpu.set_locked_clocks(900)
    assert gpu.read().power_w == pytest.approx(gpu.true_power_w)


def test_progress_is_faster_at_higher_clocks(clock: ManualClock) -> None:
    fast, slow = simulated_gpus("A100", 2, seed=3, time_source=clock)
    assert isinstance(fast, SimulatedGpu) and isinstance(slow, SimulatedGpu)
    for gpu in (fast, slow):
        gpu.attach(workload_profile("resnet50"))
    slow.set_locked_clocks(705)
    clock.advance(60.0)
    assert fast.iterations_done > 1.3 * slow.iterations_done
    time_s = fast.true_iteration_time_s
    assert time_s is not None
    # rel 1e-3: the first tens of ms ran uncapped, faster, before the 400 W limit bit
    assert fast.iterations_done == pytest.approx(60.0 / time_s, rel=1e-3)
    fast.attach("resnet50")  # a new job starts from zero
    assert fast.iterations_done == 0.0


def test_an_idle_gpu_idles(make_gpu: Callable[..., SimulatedGpu], clock: ManualClock) -> None:
    gpu = make_gpu("H200")
    gpu.set_locked_clocks(1500)
    clock.advance(10.0)
    reading = gpu.read()
    spec = catalog_spec("H200")
    assert reading.throttle == ThrottleReason.GPU_IDLE
    assert reading.sm_clock_mhz == spec.idle_graphics_mhz
    assert reading.power_w == pytest.approx(spec.idle_power_w)
    assert reading.energy_j == pytest.approx(10.0 * spec.idle_power_w)
    assert gpu.iterations_done == 0.0
    assert gpu.true_iteration_time_s is None
    gpu.attach("bert")
    gpu.detach()
    assert gpu.locked == LockedClocks(345, 1500, None)  # the lock outlives the job


def test_a_binding_power_limit_throttles(
    make_gpu: Callable[..., SimulatedGpu], clock: ManualClock
) -> None:
    gpu = make_gpu("A100")
    gpu.attach("bloom-bwd")
    gpu.set_power_limit_w(200.0)
    clock.advance(1.0)
    reading = gpu.read()
    assert reading.throttle == ThrottleReason.SW_POWER_CAP
    assert reading.sm_clock_mhz < 1100
    assert reading.enforced_limit_w == 200.0
    assert reading.power_w <= 200.0
    with pytest.raises(InputError):
        gpu.set_power_limit_w(450.0)
    assert gpu.enforced_limit_w == 200.0


def test_clock_write_faults_change_nothing(
    make_gpu: Callable[..., SimulatedGpu], clock: ManualClock
) -> None:
    gpus = simulated_gpus("A100", 3, seed=1, time_source=clock)
    first = gpus[0]
    assert isinstance(first, SimulatedGpu)
    for gpu in gpus:
        gpu.set_locked_clocks(1005)
    first.fail_clock_writes = True
    with pytest.raises(GpuError):
        first.set_locked_clocks(1200)
    assert first.locked == LockedClocks(210, 1005, None)
    first.set_locked_clocks(1005)  # already set: no driver call, no error
    failed = gpus.reset_all()
    assert [dev for dev, _ in failed] == [first]
    assert [gpu.locked for gpu in gpus] == [LockedClocks(210, 1005, None), None, None]


def test_read_faults(make_gpu: Callable[..., SimulatedGpu], clock: ManualClock) -> None:
    gpus = simulated_gpus("A40", 2, seed=1, time_source=clock)
    lost = gpus[1]
    assert isinstance(lost, SimulatedGpu)
    lost.fail_reads = True
    readings, failed = gpus.read_all()
    assert [r.uuid for r in readings] == [gpus[0].uuid]
    assert failed[0][0] is lost and isinstance(failed[0][1], GpuLostError)

    gpu = make_gpu("A40")
    gpu.attach("bert")
    gpu.report_garbage_power = True
    clock.advance(1.0)
    garbage = [gpu.read().power_w for _ in range(4)]
    assert math.isnan(garbage[0]) and garbage[1:] == [0.0, -1.0, 4_294_967.295]
    gpu.report_garbage_power = False
    # the counter stays true: BERT is held at the A40's 300 W as a 1 s average, so 300 J
    assert gpu.read().energy_j == pytest.approx(300.0 * 1.0)


def test_same_seed_same_node(clock: ManualClock) -> None:
    def readings(seed: int) -> list[tuple[str, float]]:
        gpus = simulated_gpus("A100", 4, seed=seed, time_source=clock)
        for gpu in gpus:
            assert isinstance(gpu, SimulatedGpu)
            gpu.attach("resnet50")
        return [(r.uuid, r.power_w) for r in gpus.read_all()[0]]

    first, again, other = readings(11), readings(11), readings(12)
    assert first == again
    assert len({uuid for uuid, _ in first}) == 4
    assert {u for u, _ in first}.isdisjoint({u for u, _ in other})


def test_simulated_gpus_refuses_bad_requests(clock: ManualClock) -> None:
    with pytest.raises(InputError, match="known"):
        simulated_gpus("RTX 4090", 2, seed=0, time_source=clock)
    with pytest.raises(InputError):
        simulated_gpus("A100", 0, seed=0, time_source=clock)
    with pytest.raises(InputError):
        clock.advance(-1.0)
    gpus = simulated_gpus("NVIDIA A100-SXM4-80GB", 2, seed=0, time_source=clock)
    assert [g.index for g in gpus] == [0, 1]
    assert gpus[1].name == "A100-SXM4-80GB"
    assert gpus.by_uuid(gpus[1].uuid) is gpus[1]


# --- power limits, other limiters, described boards ---------------------------------------------

DATA = Path(__file__).resolve().parent.parent / "data" / "nvml"


def test_a_limit_is_held_as_a_one_second_average(
    make_gpu: Callable[..., SimulatedGpu], clock: ManualClock
) -> None:
    gpu = make_gpu("A100")
    gpu.set_power_limit_w(200.0)
    gpu.attach("bloom-bwd")  # draws far more than 200 W at full clock
    clock.advance(0.005)
    burst = gpu.read()
    assert burst.power_w > 200.0  # the firmware lets the instantaneous power run high...
    assert ThrottleReason.SW_POWER_CAP not in burst.throttle
    clock.advance(0.5)
    held = gpu.read()
    assert held.power_w <= 200.0 and held.throttle == ThrottleReason.SW_POWER_CAP
    assert held.sm_clock_mhz < burst.sm_clock_mhz
    # ...but no 1 s window averages more than the limit
    energies = [gpu.read().energy_j]
    for _ in range(40):
        clock.advance(0.05)
        energies.append(gpu.read().energy_j)
    assert max(b - a for a, b in zip(energies, energies[20:], strict=False)) <= 200.0 + 1e-9


def test_power_limit_api_records_what_we_set_and_refuses_out_of_range(
    make_gpu: Callable[..., SimulatedGpu],
) -> None:
    gpu = make_gpu("A100")
    assert gpu.power_limit_set_w is None
    gpu.set_power_limit_w(300.0)
    gpu.set_power_limit_w(300.0)
    assert (gpu.power_limit_set_w, gpu.power_limit_writes) == (300.0, 1)
    for bad in (99.0, 401.0, float("nan")):
        with pytest.raises(UnsupportedPowerLimitError) as info:
            gpu.set_power_limit_w(bad)
        assert isinstance(info.value, GpuError) and "100..400 W" in str(info.value)
    assert gpu.enforced_limit_w == 300.0
    gpu.fail_power_limit_writes = True
    with pytest.raises(PowerLimitPermissionError, match="Insufficient Permissions"):
        gpu.reset_power_limit()
    assert gpu.power_limit_set_w == 300.0
    gpu.fail_power_limit_writes = False
    gpu.reset_power_limit()
    gpu.reset_power_limit()
    assert (gpu.power_limit_set_w, gpu.enforced_limit_w, gpu.power_limit_writes) == (None, 400.0, 2)


def test_an_external_cap_below_ours_shows_in_the_readings(
    make_gpu: Callable[..., SimulatedGpu], clock: ManualClock
) -> None:
    gpu = make_gpu("A100")
    gpu.attach("bloom-bwd")
    gpu.set_power_limit_w(350.0)
    gpu.set_locked_clocks(1305)
    clock.advance(2.0)
    gpu.set_external_power_cap_w(250.0)  # a BMC caps the board
    clock.advance(2.0)
    reading = gpu.read()
    assert gpu.power_limit_set_w == 350.0
    assert reading.enforced_limit_w == 250.0
    assert reading.throttle == ThrottleReason.SW_POWER_CAP
    assert reading.sm_clock_mhz < 1305
    gpu.set_external_power_cap_w(None)
    assert gpu.read().enforced_limit_w == 350.0


def test_a_power_brake_halves_the_clock(
    make_gpu: Callable[..., SimulatedGpu], clock: ManualClock
) -> None:
    gpu = make_gpu("A100")
    gpu.attach("ncf")
    clock.advance(1.0)
    gpu.power_brake = True
    clock.advance(1.0)
    reading = gpu.read()
    assert ThrottleReason.HW_POWER_BRAKE in reading.throttle
    assert reading.sm_clock_mhz == 705
    gpu.power_brake = False
    clock.advance(1.0)
    assert gpu.read().sm_clock_mhz == 1410


def test_a_lock_changed_behind_our_back_is_detected_and_won_back(
    make_gpu: Callable[..., SimulatedGpu], clock: ManualClock
) -> None:
    gpu = make_gpu("A100")
    gpu.attach("ncf")
    gpu.set_locked_clocks(1005)
    readings = []
    for _ in range(3):
        clock.advance(0.5)
        readings.append(gpu.read())
    assert not lock_overridden(readings, gpu.locked)
    gpu.override_lock(1410)  # e.g. someone ran nvidia-smi -lgc 210,1410
    for _ in range(2):
        clock.advance(0.5)
        readings.append(gpu.read())
    assert gpu.locked == LockedClocks(210, 1005, None)  # what we set, as NVML would say
    assert readings[-1].sm_clock_mhz == 1410
    assert not lock_overridden(readings, gpu.locked)  # two odd reads are not enough
    clock.advance(0.5)
    readings.append(gpu.read())
    assert lock_overridden(readings, gpu.locked)
    gpu.set_locked_clocks(1005)  # idempotent: no driver call, the other lock stays
    assert gpu.read().sm_clock_mhz == 1410
    gpu.reset_locked_clocks()
    gpu.set_locked_clocks(1005)
    clock.advance(0.5)
    assert gpu.read().sm_clock_mhz == 1005
    gpu.detach()
    idle = [gpu.read() for _ in range(3)]
    assert not lock_overridden(idle, LockedClocks(210, 100, None))  # idle clocks never count


def test_a_recorded_board_the_catalog_lacks_runs_and_describes_itself() -> None:
    board = BoardDescription.from_dict(
        json.loads((DATA / "rtx-4000-sff-ada.board.json").read_text())
    )
    clock = ManualClock()
    gpu = SimulatedGpu(board, index=1, seed=2, time_source=clock, noise=QUIET)
    assert gpu.name == board.name and gpu.spec.estimated
    gpu.attach("resnet50")
    gpu.set_locked_clocks(1500, 7001)
    clock.advance(1.0)
    reading = gpu.read()
    assert (reading.sm_clock_mhz, reading.memory_clock_mhz) == (1500, 7001)
    described = gpu.describe()
    assert described.uuid == gpu.uuid != board.uuid
    assert described.digest() == board.digest()
    assert spec_from_board(described) == gpu.spec
    assert described.enforced_limit_w == 70.0
    catalog = SimulatedGpu(catalog_spec("A100"), time_source=clock).describe()
    assert spec_from_board(catalog) is catalog_spec("A100")  # the head keeps its catalog type


def test_a_node_may_mix_gpu_kinds(clock: ManualClock) -> None:
    board_file = DATA / "rtx-4000-sff-ada.board.json"
    gpus = simulated_gpus(f"A100-SXM4-80GB:2, L40S:1, {board_file}:1", 4, seed=5)
    assert [g.name for g in gpus] == [
        "A100-SXM4-80GB",
        "A100-SXM4-80GB",
        "L40S",
        "NVIDIA RTX 4000 SFF Ada Generation",
    ]
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert len(simulated_gpus("T4:3", None, seed=5)) == 3
    kinds = node_gpu_kinds("H200", 2)
    assert kinds == [catalog_spec("H200")] * 2
    for text, count, message in [
        ("A100:2,L40S:2", 8, "list 4 GPUs, but the count is 8"),
        ("A100:2,L40S", None, "give every type a count"),
        ("A100:x", 1, "expected TYPE:N"),
        ("A100,,L4", 2, "an empty entry"),
        ("A100", None, "how many"),
        ("A100:0", None, "at least one GPU"),
        ("/nonexistent/board.json:1", None, "simulated board file"),
    ]:
        with pytest.raises(InputError, match=message):
            node_gpu_kinds(text, count)


def test_a_simulated_gpu_in_mig_mode_lists_stable_instances() -> None:
    board = (
        Path(__file__).resolve().parent.parent / "data" / "nvml" / "a100-sxm4-80gb-mig.board.json"
    )
    gpus = simulated_gpus(f"A100:1,{board}:1", None, seed=4)
    assert gpus[0].mig_instances() == ()  # MIG off
    instances = gpus[1].mig_instances()
    assert [i.gpu_instance for i in instances] == list(range(7, 14))
    assert len({i.uuid for i in instances}) == 7 and all(
        i.uuid.startswith("MIG-") for i in instances
    )
    again = simulated_gpus(f"A100:1,{board}:1", None, seed=4)[1].mig_instances()
    assert again == instances  # the same node names the same instances after a restart
