"""GPU sharing in the simulator: Gavel's pairs as shipped quantiles, the sampler, and each
tenant's speed on a shared GPU (`slurm_cdgpc.sim.colocation`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.sim import colocation as co
from slurm_cdgpc.sim.colocation import (
    PAIR_THROUGHPUT_QUANTILES,
    draw_pair_throughput,
    pair_throughput_quantiles,
    throughput_factors,
)

Q = np.array(PAIR_THROUGHPUT_QUANTILES)


def _gavel(path: Path, v100: dict[str, dict[str, object]]) -> Path:
    path.write_text(json.dumps({"v100": v100}))
    return path


# --- the calibration -------------------------------------------------------------------------


def test_the_shipped_quantiles_are_gavels_v100_pairs(shared_data: Path) -> None:
    path = shared_data / co.GAVEL_FILE
    assert pair_throughput_quantiles(path) == PAIR_THROUGHPUT_QUANTILES
    # the docstring's figures: 636 ordered pairs, 138 of them worse than time-slicing, a
    # member's median slowdown 0.6785
    slowdowns = co._slowdowns(path)
    assert slowdowns.shape == (636, 2)
    assert np.sum(slowdowns.sum(axis=1) < 1) == 138
    assert np.median(slowdowns[:, 0]) == pytest.approx(0.6785, abs=1e-4)


def test_quantiles_are_ordered_positive_and_at_most_two_for_a_pair() -> None:
    assert len(Q) == 21
    assert np.all(np.diff(Q) >= 0) and Q[0] > 0 and Q[-1] <= 2.0
    # a real spread: some pairs lose against time-slicing, most gain
    assert Q[2] < 1 < Q[10]


def test_failed_pairs_and_multi_gpu_jobs_are_left_out_and_each_order_counts(
    tmp_path: Path,
) -> None:
    a, b, a2 = "('A', 1)", "('B', 1)", "('A', 2)"
    path = _gavel(
        tmp_path / "t.json",
        {
            a: {"null": 10.0, a: [5.0, 5.0], b: [8.0, 10.0]},  # C = 1.0 and 0.8 + 0.5 = 1.3
            b: {"null": 20.0, b: [0.0, 0.0], a: [10.0, 8.0]},  # B with B failed
            a2: {"null": 100.0, a2: [1.0, 1.0]},  # a 2-GPU job: C = 0.02 if it counted
        },
    )
    q = pair_throughput_quantiles(path)
    # C over the ordered pairs (A, A), (A, B), (B, A): 1.0, 1.3, 1.3; the 25 % quantile is
    # halfway between the first two (1.075 if (A, B) counted once)
    assert (q[0], q[5], q[10], q[20]) == (1.0, 1.15, 1.3, 1.3)


@pytest.mark.parametrize(
    "text",
    [
        None,  # no file
        "not json",
        "{}",
        json.dumps({"v100": {"('A', 1)": {"null": 10.0}}}),  # no pair entry
        json.dumps({"v100": {"('A', 1)": {"null": 0.0, "('A', 1)": [1.0, 1.0]}}}),
        json.dumps({"v100": {"('A', 1)": {"null": 10.0, "('A', 1)": [1.0]}}}),
        json.dumps({"v100": {"('A', 1)": {"null": 10.0, "('A', 1)": ["x", 1.0]}}}),
    ],
)
def test_a_bad_file_is_refused_with_one_line(tmp_path: Path, text: str | None) -> None:
    path = tmp_path / "throughputs.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(InputError) as e:
        pair_throughput_quantiles(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


# --- the sampler -----------------------------------------------------------------------------


def test_draws_follow_the_quantiles() -> None:
    draws = draw_pair_throughput(100_000, np.random.default_rng(7))
    assert draws.shape == (100_000,)
    assert Q[0] <= draws.min() and draws.max() <= Q[-1]
    assert np.median(draws) == pytest.approx(Q[10], abs=0.005)
    assert np.quantile(draws, 0.1) == pytest.approx(Q[2], abs=0.01)
    # 1 lies between the 20 % and 25 % quantiles: 21.97 % below it (21.7 % of Gavel's pairs)
    below_one = 0.20 + 0.05 * (1 - Q[4]) / (Q[5] - Q[4])
    assert np.mean(draws < 1) == pytest.approx(below_one, abs=0.005)


# --- each tenant's speed ---------------------------------------------------------------------


def test_a_tenant_alone_runs_at_full_speed_whatever_it_drew() -> None:
    s = throughput_factors(np.array([300, 500]), np.array([4, 9]), np.array([0.4, 1.9]))
    np.testing.assert_array_equal(s, [1.0, 1.0])


def test_two_equal_tenants_split_the_combined_throughput() -> None:
    s = throughput_factors(np.array([500, 500]), np.array([3, 3]), np.array([1.0, 1.4]))
    np.testing.assert_allclose(s, [0.6, 0.6])  # mean C = 1.2, half each


def test_tenants_share_by_gpu_milli_and_gpus_stay_apart() -> None:
    # GPU 70: 250 + 750 milli, C = 1.2 → 0.3 and 0.9; GPU 5: three tenants at C = 0.9; GPU 2 alone
    milli = np.array([250, 300, 750, 300, 300, 600])
    gpu = np.array([70, 5, 70, 5, 5, 2])
    combined = np.array([1.0, 0.6, 1.4, 0.9, 1.2, 0.5])
    s = throughput_factors(milli, gpu, combined)
    np.testing.assert_allclose(s, [0.3, 0.3, 0.9, 0.3, 0.3, 1.0])


def test_a_tenant_never_runs_faster_than_alone() -> None:
    # 900 + 100 milli at C = 1.8: the large one would get 1.62
    s = throughput_factors(np.array([900.0, 100.0]), np.array([0, 0]), np.array([1.8, 1.8]))
    np.testing.assert_allclose(s, [1.0, 0.18])


def test_mismatched_arrays_or_a_zero_milli_are_refused() -> None:
    with pytest.raises(InputError):
        throughput_factors(np.array([500, 500]), np.array([0]), np.array([1.0, 1.0]))
    with pytest.raises(InputError):
        throughput_factors(np.array([0, 500]), np.array([0, 0]), np.array([1.0, 1.0]))
