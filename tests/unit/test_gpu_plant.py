"""The plant: the physics simulated GPUs obey, and how close it is to the measurements."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.gpu.catalog import CATALOG, GpuSpec, catalog_spec
from slurm_cdgpc.gpu.plant import (
    PROFILES,
    NoiseModel,
    Plant,
    WorkloadArrays,
    WorkloadCalibration,
    calibration_report,
    draw_workloads,
    windowed_power_w,
    workload_profile,
)

A100 = catalog_spec("A100-SXM4-80GB")
NO_LIMIT_W = 1e4


def bloom_on(spec: GpuSpec, n: int = 1) -> Plant:
    return Plant.of(spec, WorkloadArrays.of([PROFILES["bloom-bwd"].on(spec)] * n))


def mixed_plant(n: int, seed: int) -> Plant:
    """n jobs with drawn workloads spread over every catalog GPU type."""
    rng = np.random.default_rng(seed)
    specs = list(CATALOG.values())
    index = rng.integers(len(specs), size=n)
    parts = [draw_workloads(int(np.sum(index == k)), s, rng) for k, s in enumerate(specs)]
    order = np.argsort(index, kind="stable")
    joined = WorkloadArrays(
        *(np.concatenate([getattr(p, f) for p in parts]) for f in WorkloadArrays.__annotations__)
    )
    return Plant(specs, index[order], joined)


def test_power_rises_and_time_falls_with_the_clock() -> None:
    plant = mixed_plant(5000, seed=1)
    shares = np.linspace(0.2, 1.0, 33)
    clocks = [
        np.maximum(plant.min_graphics_mhz, share * plant.max_graphics_mhz) for share in shares
    ]
    busy = np.array([plant.busy_power_w(c) for c in clocks])
    power = np.array([plant.true_power_w(c) for c in clocks])
    time_s = np.array([plant.iteration_time_s(c) for c in clocks])
    assert np.all(np.diff(busy, axis=0) >= 0)
    assert np.all(np.diff(time_s, axis=0) <= 0)
    assert np.all(time_s[-1] < time_s[0])
    training = plant.workloads.activity >= 0.3
    assert training.mean() > 0.8
    assert np.all(np.diff(power[:, training], axis=0) >= 0)
    assert np.all(power[-1, training] > 1.2 * power[0, training])
    # input-bound jobs (NCF-like) draw nearly flat power: a longer busy share at low clocks may
    # outweigh the lower busy power (A40 NCF: 87 W at 350 MHz, 81 W at 1170), by a few percent
    dip = np.max(power[:-1] / np.minimum.accumulate(power[::-1])[::-1][1:], axis=0)
    assert np.all(dip < 1.08)


def test_the_voltage_knee_defeats_a_straight_line() -> None:
    plant = bloom_on(A100)
    clocks = np.array([f for f in A100.clocks.graphics_for() if f >= 510], dtype=float)
    power = np.array([plant.true_power_w(f)[0] for f in clocks])
    x = clocks / A100.max_graphics_mhz
    k = A100.knee_mhz / A100.max_graphics_mhz

    def fit_mape(basis: np.ndarray) -> float:
        coef, *_ = np.linalg.lstsq(basis, power, rcond=None)
        return float(np.mean(np.abs(basis @ coef / power - 1.0)))

    linear = fit_mape(np.column_stack([x, np.ones_like(x)]))
    bent = fit_mape(np.column_stack([np.maximum(x, x**3 / k**2), np.ones_like(x)]))
    assert linear > 0.03  # the straight line misses by several percent
    assert bent < linear / 3


def test_iteration_time_saturates_at_the_top_clocks() -> None:
    plant = bloom_on(A100)
    t = {f: plant.iteration_time_s(f)[0] for f in (855, 900, 1365, 1410)}
    # the last 45 MHz buy less than a third of what 45 MHz buy at 855 MHz (1/f: 0.6 ×)
    assert (t[1365] - t[1410]) < (t[855] - t[900]) / 3
    assert t[855] / t[1410] > 1.4
    # on the 500 W board Perseus measured, time is flat above ~1365 MHz, as there
    on_board = [plant.step(f, limit_w=500.0).iteration_time_s[0] for f in (1365, 1410)]
    assert on_board[0] / on_board[1] < 1.005


def test_a_binding_power_limit_makes_a_plateau() -> None:
    plant = bloom_on(A100)
    limit_w = 300.0
    clocks = np.array(A100.clocks.graphics_for()[:25], dtype=float)  # 1410 … 1050 MHz
    states = [plant.step(f, limit_w=limit_w) for f in clocks]
    applied = np.array([s.applied_mhz[0] for s in states])
    capped = np.array([s.power_capped[0] for s in states])
    time_s = np.array([s.iteration_time_s[0] for s in states])
    power_w = np.array([s.power_w[0] for s in states])
    limit_mhz = plant.limit_clock_mhz(limit_w)[0]
    assert 1050 < limit_mhz < 1410
    above = clocks > limit_mhz
    assert above.sum() >= 3 and (~above).sum() >= 3
    # above the limit clock: the firmware holds the same clock, time and power stop changing
    assert np.all(capped[above]) and not np.any(capped[~above])
    assert np.allclose(applied[above], limit_mhz)
    assert np.ptp(time_s[above]) < 1e-12
    assert np.all(power_w[above] <= limit_w)
    # below it the lock decides
    assert np.array_equal(applied[~above], clocks[~above])
    assert np.all(np.diff(time_s[~above]) > 0)


def test_the_limit_clock_meets_the_firmware_target_exactly() -> None:
    plant = mixed_plant(5000, seed=2)
    rng = np.random.default_rng(3)
    limit_w = rng.uniform(0.3, 1.0, len(plant)) * plant.default_limit_w
    clock = plant.limit_clock_mhz(limit_w)
    busy = plant.busy_power_w(clock)
    interior = (clock > plant.min_graphics_mhz) & (clock < plant.max_graphics_mhz)
    assert interior.sum() > 1000
    assert np.allclose(busy[interior], plant.cap_target[interior] * limit_w[interior], rtol=1e-9)
    # at the clock floor the GPU cannot get under the limit (as the A40 at 100 W)
    floor = clock <= plant.min_graphics_mhz
    assert floor.any()
    at_floor_w = plant.busy_power_w(plant.min_graphics_mhz)[floor]
    assert np.all(at_floor_w >= plant.cap_target[floor] * limit_w[floor])


def test_shapes_broadcast_over_jobs() -> None:
    plant = mixed_plant(1000, seed=4)
    for cap in (1000.0, np.full(1000, 1000.0)):
        state = plant.step(cap, limit_w=250.0)
        for array in (state.applied_mhz, state.power_w, state.iteration_time_s, state.power_capped):
            assert array.shape == (1000,)
    assert plant.true_power_w(plant.max_graphics_mhz).shape == (1000,)
    with pytest.raises(InputError):
        Plant.of(A100, WorkloadArrays.of([PROFILES["bert"].on(A100)] * 3)).step(np.ones(2))
    with pytest.raises(InputError):
        Plant([A100], [0, 1], WorkloadArrays.of([PROFILES["bert"].on(A100)] * 2))


def test_same_seed_same_draws_and_noise() -> None:
    def run(seed: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        plant = Plant.of(A100, draw_workloads(500, A100, rng))
        measured = plant.observe(plant.step(1200.0), rng)
        return measured.power_w, measured.iteration_time_s

    a, b, c = run(7), run(7), run(8)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.allclose(a[0], c[0])


def test_measurement_noise_has_the_configured_size() -> None:
    rng = np.random.default_rng(5)
    plant = Plant.of(A100, draw_workloads(50_000, A100, rng))
    truth = plant.step(1300.0)
    measured = plant.observe(truth, rng, NoiseModel(power_rel=0.01, time_rel=0.02))
    power_ratio = measured.power_w / truth.power_w
    time_ratio = measured.iteration_time_s / truth.iteration_time_s
    assert abs(power_ratio.mean() - 1) < 1e-3 and abs(power_ratio.std() - 0.01) < 1e-3
    assert abs(time_ratio.mean() - 1) < 1e-3 and abs(time_ratio.std() - 0.02) < 1e-3
    silent = plant.observe(truth, rng, NoiseModel(0.0, 0.0))
    assert np.array_equal(silent.power_w, truth.power_w)


def test_trace_model_names_map_to_profiles() -> None:
    spec = catalog_spec("H100")
    names = ["resnet50", "bert_base_uncased", "Inception_V3", "mystery", "mystery", "other"]
    drawn = draw_workloads(len(names), spec, np.random.default_rng(0), names, jitter=0.0)
    assert drawn.calibration(0) == PROFILES["resnet50"].on(spec)
    assert drawn.calibration(1) == PROFILES["bert"].on(spec)
    assert drawn.calibration(2) == PROFILES["inception3"].on(spec)
    assert drawn.calibration(3) == drawn.calibration(4)  # one stand-in per unknown name
    known = {p.on(spec) for p in PROFILES.values()}
    assert drawn.calibration(3) in known and drawn.calibration(5) in known
    jittered = draw_workloads(len(names), spec, np.random.default_rng(0), names)
    assert jittered.calibration(3) != jittered.calibration(4)  # alike, not identical
    fixed = draw_workloads(3, spec, np.random.default_rng(0), iteration_time_s=[1.0, 2.0, 3.0])
    assert list(fixed.iteration_time_s) == [1.0, 2.0, 3.0]
    with pytest.raises(InputError):
        draw_workloads(2, spec, np.random.default_rng(0), ["resnet50"])
    with pytest.raises(InputError):
        workload_profile("mystery")


def test_profiles_carry_their_fits_and_scale_elsewhere() -> None:
    bert = workload_profile("BERT")
    a40 = catalog_spec("A40")
    assert bert.on(a40) is bert.calibrations["A40"]
    h100 = bert.on(catalog_spec("H100-SXM")).iteration_time_s
    assert h100 < bert.on(A100).iteration_time_s  # a faster GPU
    with pytest.raises(InputError):
        WorkloadCalibration(iteration_time_s=0.0, activity=1.0, memory_ratio=1.0, other_fraction=0)


def test_a_low_gddr_memory_clock_slows_the_job_and_saves_power() -> None:
    a40 = catalog_spec("A40")
    plant = Plant.of(a40, WorkloadArrays.of([PROFILES["resnet50"].on(a40)]))
    fast = plant.step(600.0, memory_mhz=7251)
    slow = plant.step(600.0, memory_mhz=405)
    assert slow.iteration_time_s[0] > 2 * fast.iteration_time_s[0]
    assert slow.power_w[0] < fast.power_w[0]


def test_a_tighter_limit_slows_a_v100_like_the_zeus_sweep() -> None:
    v100 = catalog_spec("V100-PCIE-32GB")
    plant = Plant.of(v100, WorkloadArrays.of([workload_profile("resnet50").on(v100)] * 7))
    limits_w = np.array([250.0, 225, 200, 175, 150, 125, 100])
    state = plant.step(v100.max_graphics_mhz, limit_w=limits_w)
    slow_down = state.iteration_time_s / state.iteration_time_s[0]
    assert np.all(np.diff(slow_down) > 0)
    assert 1.7 < slow_down[-1] < 2.2  # measured 1.93 at 100 W
    binding = state.power_capped
    assert binding[-3:].all()
    assert np.all(state.power_w[binding] <= limits_w[binding])
    assert np.all(state.power_w[binding] > 0.9 * limits_w[binding])  # ≈ min(limit, uncapped)


def test_windowed_power_blends_across_one_change() -> None:
    assert windowed_power_w(100.0, 300.0, 0.25, 1.0) == pytest.approx(150.0)
    assert windowed_power_w(100.0, 300.0, 2.0, 1.0) == pytest.approx(300.0)
    assert windowed_power_w(100.0, 300.0, 0.0, 0.0) == pytest.approx(300.0)


@pytest.mark.data
def test_plant_reproduces_the_perseus_and_zeus_measurements(shared_data: Path) -> None:
    report = calibration_report(shared_data)
    for gpu in ("A100-SXM4-80GB", "A40"):
        fit = report["perseus"][gpu]
        assert fit["power_mape_pct"] <= 3.0, gpu
        assert fit["time_mape_pct"] <= 2.0, gpu
    a100 = report["perseus"]["A100-SXM4-80GB"]
    assert a100["power_mape_pct"] <= 1.0 and a100["time_mape_pct"] <= 0.6
    for gpu in ("V100-PCIE-32GB", "A40"):
        zeus = report["zeus"][gpu]
        assert zeus["power_mape_pct"] <= 4.0, gpu
        assert zeus["time_ratio_mape_pct"] <= 2.5, gpu
    assert report["zeus"]["V100-PCIE-32GB"]["power_over_limit_max_pct"] < 0
    # the A40 cannot hold a 100 W limit, in the measurements and in the plant
    a40 = report["zeus"]["A40"]
    assert a40["measured_over_limit_max_pct"] > 10 and a40["power_over_limit_max_pct"] > 10


def test_calibration_report_refuses_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot read calibration data"):
        calibration_report(tmp_path)
