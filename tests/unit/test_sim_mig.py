"""GPUs in MIG mode in the simulator: the slice a pod gets and its speed there (MISO's A100
measurements), no clock lock taking, and cdgpc holding the budget through power limits whose
gain it learns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from slurm_cdgpc.cli.simulate import simulate
from slurm_cdgpc.control.guard_rail import LIMIT_GAIN_RANGE, limit_gain, power_limits_w
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.sim.cluster import Policy, Simulator
from slurm_cdgpc.sim.fleet import parse_fleet
from slurm_cdgpc.sim.metrics import Metrics, compute_metrics
from slurm_cdgpc.sim.mig import (
    MISO_DIR,
    SLICE_SPEED_QUANTILES,
    draw_slice_speed,
    slice_milli,
    slice_sevenths,
    slice_speed_quantiles,
)
from slurm_cdgpc.sim.policies import Cdgpc, Oracle, make_policy
from slurm_cdgpc.sim.reporting import TimeLimitModel
from tests.unit.test_sim_sharing import _trace, crowded_trace


def test_a_pod_gets_the_smallest_a100_profile_with_its_share() -> None:
    milli = [50, 142, 143, 250, 500, 571, 572, 600, 1000, 2000]
    assert slice_sevenths(milli).tolist() == [1, 1, 2, 2, 4, 4, 7, 7, 7, 7]
    assert slice_milli(milli).tolist() == [142, 142, 285, 285, 571, 571, 1000, 1000, 1000, 2000]
    with pytest.raises(InputError):
        slice_sevenths([0])


def test_slice_speeds_are_drawn_from_their_profiles_measurements() -> None:
    rng = np.random.default_rng(0)
    sevenths = np.repeat([1, 2, 3, 4, 7], 4000)
    speed = draw_slice_speed(sevenths, rng)
    assert np.all(speed[sevenths == 7] == 1.0) and np.all((speed > 0) & (speed <= 1.0))
    for k, quantiles in SLICE_SPEED_QUANTILES.items():
        on = speed[sevenths == k]
        assert on.min() >= quantiles[0] and np.median(on) == pytest.approx(quantiles[5], abs=0.02)
    # more of the GPU is faster, on the median
    medians = [np.median(speed[sevenths == k]) for k in (1, 2, 3, 4, 7)]
    assert medians == sorted(medians)


@pytest.mark.data
def test_the_slice_speed_quantiles_are_misos(shared_data: Path) -> None:
    assert slice_speed_quantiles(shared_data / MISO_DIR) == SLICE_SPEED_QUANTILES


def test_a_lever_gain_settles_where_the_gpu_draws_the_plan() -> None:
    # a GPU held at 155 W that draws 118 W on the mean: ρ moves half-way to 0.76
    gain = limit_gain(np.ones(3), [118.0, 300.0, np.nan], [155.0, np.nan, 155.0])
    assert gain.tolist() == pytest.approx([0.5 * (1 + 118 / 155), 1.0, 1.0])
    assert limit_gain([0.26], [1.0], [400.0])[0] == LIMIT_GAIN_RANGE[0]  # within its range
    assert limit_gain([1.4], [600.0], [300.0])[0] == LIMIT_GAIN_RANGE[1]
    # the limit that draws the plan's 150 W with ρ = 0.75 is 200 W; at its top clock 5 % more
    # (`LEVER_TOP_MARGIN`); a GPU that is no lever keeps its default
    limits = power_limits_w(
        [150.0, 150.0, 150.0],
        [1, 1, 1],
        0.0,
        [100.0] * 3,
        [400.0] * 3,
        lever=[True, True, False],
        top=[False, True, False],
        gain=[0.75, 0.75, 0.75],
    )
    assert limits is not None and limits.tolist() == pytest.approx([200.0, 210.0, 400.0])
    # a job with no reading yet is held at its count at its top clock; one planned below it
    # with nothing else on its GPU is the fallback's, at the board's minimum
    limits = power_limits_w(
        [212.0, 212.0],
        [1, 1],
        0.0,
        [100.0] * 2,
        [400.0] * 2,
        lever=[True, True],
        top=[True, False],
        counted=[True, True],
        unmodelled=[True, True],
    )
    assert limits is not None and limits.tolist() == [212.0, 100.0]


def test_a_pod_on_a_slice_runs_at_that_slices_speed() -> None:
    trace = _trace([0.0], [3600.0], [100])
    fleet = parse_fleet("1x1:A100-SXM4-80GB")
    unlimited = TimeLimitModel.parse("none")  # it runs 1 / r as long: past any drawn limit
    whole = Simulator(trace, fleet, 1e6, time_limits=unlimited).run(make_policy("max-clock"))
    mig = Simulator(trace, fleet, 1e6, mig=True, time_limits=unlimited)
    on_slice = mig.run(make_policy("max-clock"))
    r = float(mig.slice_speed[0])
    assert 0.0 < r < 1.0 and mig.gpu_milli.tolist() == [142]
    took, alone = on_slice.finish_s[0] - on_slice.start_s[0], whole.finish_s[0] - whole.start_s[0]
    assert took == pytest.approx(alone / r, rel=0.03, abs=60.0)  # within a 60 s interval
    assert np.max(on_slice.power_w) < np.max(whole.power_w)  # r of its draw above idle


def test_in_mig_mode_clocks_do_not_take_and_cdgpc_holds_the_budget_by_limits() -> None:
    trace = crowded_trace()
    fleet = parse_fleet("2x4:A100-SXM4-80GB")
    budget_w = 0.6 * fleet.max_power_w

    def replay(name: str) -> tuple[Metrics, Policy]:
        policy = make_policy(name)
        return compute_metrics(Simulator(trace, fleet, budget_w, mig=True).run(policy)), policy

    clock, _ = replay("uniform-clock")
    m, policy = replay("cdgpc")
    cap, _ = replay("uniform-power-cap")
    assert isinstance(policy, Cdgpc) and m.binding_intervals > 100
    # a clock policy cannot touch a MIG GPU: it runs them at their top clocks, over the budget
    assert clock.over_budget_intervals_pct > 30.0 and clock.max_overshoot_pct > 30.0
    # cdgpc's limits hold it (never over here, at most +0.2 %), and closer than one uniform
    # cap does (2.1 % error against 5.7 %), finishing more pods within their limits
    assert m.over_budget_intervals_pct < 1.0 and m.max_overshoot_pct < 1.0
    assert m.power_mae_pct is not None and cap.power_mae_pct is not None
    assert m.power_mae_pct < 0.5 * cap.power_mae_pct and m.finished >= cap.finished
    # the levers' gains were learnt: bursts are held at the limit, the mean under it
    gains = policy.estimator.limit_gain
    assert len(gains) == 0 or np.all((gains >= LIMIT_GAIN_RANGE[0]) & (gains <= 1.5))


def test_mig_is_refused_where_it_cannot_run() -> None:
    trace = _trace([0.0], [600.0], [500])
    fleet = parse_fleet("1x1:A100-SXM4-80GB")
    with pytest.raises(InputError, match="not with shared ones"):
        Simulator(trace, fleet, 1e6, mig=True).run(Oracle())
    whole = _trace([0.0], [600.0], [1000])  # MIG mode and no share: still no clock to lock
    with pytest.raises(InputError, match="MIG mode"):
        Simulator(whole, fleet, 1e6, mig=True).run(Oracle())
    runner = CliRunner()
    data = Path(__file__).resolve().parents[1] / "data" / "sim" / "synthetic40.csv"
    out = runner.invoke(simulate, ["--trace", str(data), "--mig", "--sweep", "x"])
    assert out.exit_code != 0 and "--mig" in out.output
