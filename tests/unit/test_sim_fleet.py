"""Fleet specs: parsing, errors, and the default size from a trace's concurrent demand."""

from __future__ import annotations

import numpy as np
import pytest

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.sim.fleet import concurrent_demand_quantile, default_fleet, parse_fleet
from slurm_cdgpc.sim.traces import Trace


def _trace(submit: list[float], duration: list[float], gpus: list[int]) -> Trace:
    n = len(submit)
    return Trace(
        job_id=np.array([str(i) for i in range(n)]),
        submit_s=np.array(submit, dtype=float),
        duration_s=np.array(duration, dtype=float),
        num_gpu=np.array(gpus),
        deadline_s=np.full(n, np.nan),
        iterations=np.full(n, np.nan),
        model_name=np.full(n, ""),
        gpu_type=np.full(n, ""),
        job_type=np.full(n, ""),
        source="cdgpc",
        time_unit_note="s",
    )


def test_parse_groups_in_order_with_aliases() -> None:
    fleet = parse_fleet("2x8:A100, 1x4:V100-SXM2")
    assert [(g.nodes, g.gpus_per_node, g.spec.name) for g in fleet.groups] == [
        (2, 8, "A100-SXM4-80GB"),
        (1, 4, "V100-SXM2"),
    ]
    assert fleet.total_gpus == 20
    assert fleet.node_type.tolist() == [0, 0, 1]
    assert fleet.max_power_w == 16 * 400.0 + 4 * 300.0
    assert str(fleet) == "2x8:A100-SXM4-80GB,1x4:V100-SXM2"


@pytest.mark.parametrize(
    "text", ["", "8:A100", "2x:A100", "0x8:A100", "2x8", "2x8:Z9000", "2x8:A100,"]
)
def test_malformed_specs_are_one_line_errors(text: str) -> None:
    with pytest.raises(InputError) as e:
        parse_fleet(text)
    assert "\n" not in str(e.value)


def test_demand_quantile_is_time_weighted() -> None:
    # 0–100 s: 8 GPUs; 100–1000 s: 2 GPUs → 90 % of the time at ≤ 2 GPUs... 10 % at 8
    q = concurrent_demand_quantile(
        np.array([0.0, 0.0]), np.array([100.0, 1000.0]), np.array([6, 2]), 0.9
    )
    assert q == 2.0
    q95 = concurrent_demand_quantile(
        np.array([0.0, 0.0]), np.array([100.0, 1000.0]), np.array([6, 2]), 0.95
    )
    assert q95 == 8.0


def test_default_fleet_rounds_up_to_whole_a100_nodes() -> None:
    # 20 GPUs busy the whole time → p90 = 20 → 3 nodes of 8
    fleet = default_fleet(_trace([0.0, 0.0], [1000.0, 1000.0], [12, 8]))
    assert [(g.nodes, g.gpus_per_node, g.spec.name) for g in fleet.groups] == [
        (3, 8, "A100-SXM4-80GB")
    ]
