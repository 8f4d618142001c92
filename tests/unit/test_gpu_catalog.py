"""The GPU catalog: look-up by the names people and NVML use, and the clock tables it promises."""

from __future__ import annotations

import csv
import json
from itertools import pairwise
from pathlib import Path

import pytest

from slurm_cdgpc.errors import InputError, UnsupportedClockError
from slurm_cdgpc.gpu.catalog import CATALOG, catalog_spec
from slurm_cdgpc.wire.board import BoardDescription


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("A100", "A100-SXM4-80GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-SXM4-80GB"),
        ("a100-sxm4-80gb", "A100-SXM4-80GB"),
        ("  nvidia a100 sxm4 80gb ", "A100-SXM4-80GB"),
        ("Tesla V100-SXM2-32GB", "V100-SXM2"),
        ("V100", "V100-SXM2"),
        ("Tesla V100-PCIE-32GB", "V100-PCIE-32GB"),
        ("NVIDIA A40", "A40"),
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("h100", "H100-SXM"),
        ("NVIDIA H100 NVL", "H100-NVL"),
        ("NVIDIA H200", "H200"),
    ],
)
def test_lookup_accepts_aliases_and_nvml_names(name: str, canonical: str) -> None:
    assert catalog_spec(name).name == canonical


def test_every_alias_leads_to_its_own_entry() -> None:
    for spec in CATALOG.values():
        for name in (spec.name, *spec.aliases):
            assert catalog_spec(name) is spec, name


def test_unknown_gpu_is_refused_with_one_line_listing_known_names() -> None:
    with pytest.raises(InputError) as info:
        catalog_spec("GeForce RTX 4090")
    message = str(info.value)
    assert "\n" not in message
    assert "GeForce RTX 4090" in message
    for name in ("A100-SXM4-80GB", "A40", "H200", "V100-SXM2", "H100-SXM"):
        assert name in message


def test_datacenter_parts_have_the_documented_clocks() -> None:
    a100 = catalog_spec("A100")
    assert a100.clocks.memory_mhz == (1593,)
    graphics = a100.clocks.graphics_for()
    assert (graphics[0], graphics[-1]) == (1410, 210)
    assert {a - b for a, b in pairwise(graphics)} == {15}

    v100 = catalog_spec("V100-SXM2")
    assert v100.clocks.memory_mhz == (877,)
    steps = {a - b for a, b in pairwise(v100.clocks.graphics_for())}
    assert v100.max_graphics_mhz == 1530
    assert steps == {7, 8}  # 7.5 MHz on average, as Volta lists them

    assert catalog_spec("H100-SXM").clocks.memory_mhz == (2619,)
    assert catalog_spec("H100-SXM").max_graphics_mhz == 1980
    h200 = catalog_spec("H200")
    assert (h200.max_memory_mhz, h200.max_graphics_mhz, h200.tdp_w) == (3201, 1980, 700.0)


def test_a40_lists_graphics_clocks_per_memory_clock() -> None:
    a40 = catalog_spec("A40")
    assert a40.clocks.memory_mhz == (7251, 405)
    assert a40.memory_lockable
    assert a40.clocks.graphics_for(7251)[0] == 1740
    assert a40.clocks.graphics_for(405)[0] < 1740
    a40.clocks.check(1740, 7251)
    with pytest.raises(UnsupportedClockError):
        a40.clocks.check(1740, 405)


def test_power_readings_average_on_ampere_except_ga100_and_newer() -> None:
    # NVML: "On Ampere (except GA100) or newer GPUs, the API returns power averaged over 1 sec";
    # the A40 entry predates that rule and stays instantaneous, as the figures were made with it
    averaging = {"H100-SXM", "H100-NVL", "H100-PCIE", "H200", "B200", "A10G", "A10", "L4", "L40S"}
    for spec in CATALOG.values():
        assert spec.power_average_window_s == (1.0 if spec.name in averaging else 0.0), spec.name


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A10", "A10"),
        ("Tesla T4", "T4"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA A100-SXM4-40GB", "A100-SXM4-40GB"),
        ("NVIDIA H100 PCIe", "H100-PCIE"),
        ("NVIDIA B200", "B200"),
    ],
)
def test_the_simulators_boards_are_found_by_their_nvml_names(name: str, canonical: str) -> None:
    assert catalog_spec(name).name == canonical


@pytest.mark.parametrize(("fixture", "name"), [("a10g", "A10G"), ("tesla-t4", "T4")])
def test_measured_boards_reproduce_the_recorded_nvidia_smi_tables(fixture: str, name: str) -> None:
    path = Path(__file__).resolve().parent.parent / "data" / "nvml" / f"{fixture}.board.json"
    board = BoardDescription.from_dict(json.loads(path.read_text()))
    spec = catalog_spec(name)
    assert spec.clocks == board.clocks
    assert spec.power_limit == board.power_limit


def test_estimated_ada_tables_follow_the_recorded_ada_structure() -> None:
    path = Path(__file__).resolve().parent.parent / "data" / "nvml" / "rtx-4000-sff-ada.board.json"
    ada = BoardDescription.from_dict(json.loads(path.read_text())).clocks
    for name in ("L4", "L40S"):
        clocks = catalog_spec(name).clocks
        assert len(clocks.memory_mhz) == len(ada.memory_mhz), name
        assert clocks.memory_mhz[2:] == ada.memory_mhz[2:]  # 5001, 810, 405 as on the Ada dump
        assert clocks.graphics_for(405) == ada.graphics_for(405)
        full = {clocks.graphics_for(m) for m in clocks.memory_mhz[:-1]}
        assert len(full) == 1 and min(next(iter(full))) == 210


def test_existing_entries_keep_their_values() -> None:
    # figures and golden tests were made with these; new boards must not move them
    a100 = catalog_spec("A100-SXM4-80GB")
    assert (a100.power_limit.max_w, a100.idle_power_w, a100.knee_mhz) == (400.0, 60.0, 1100.0)
    assert catalog_spec("A40").power_average_window_s == 0.0
    assert list(CATALOG)[:8] == [
        "V100-SXM2",
        "V100-PCIE-32GB",
        "A100-SXM4-80GB",
        "A100-PCIE-40GB",
        "A40",
        "H100-SXM",
        "H100-NVL",
        "H200",
    ]
    assert not any(spec.estimated for spec in CATALOG.values())


def test_entries_are_self_consistent() -> None:
    for spec in CATALOG.values():
        graphics = spec.clocks.graphics_for()
        assert list(graphics) == sorted(graphics, reverse=True), spec.name
        assert spec.min_graphics_mhz < spec.knee_mhz < spec.max_graphics_mhz, spec.name
        assert spec.idle_graphics_mhz in graphics, spec.name
        limits = spec.power_limit
        assert limits.min_w < limits.default_w <= limits.max_w, spec.name
        assert spec.idle_power_w < limits.min_w, spec.name
        assert spec.memory_lockable == (len(spec.clocks.memory_mhz) > 1)


@pytest.mark.data
@pytest.mark.parametrize(
    "nvml_name", ["Tesla V100-PCIE-32GB", "NVIDIA A100-PCIE-40GB", "NVIDIA H100 NVL (94GB)"]
)
def test_generated_clock_lists_equal_what_the_devices_reported(
    shared_data: Path, nvml_name: str
) -> None:
    path = shared_data / "gpu-clock-tables" / "supported_clocks.csv"
    with path.open(newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["gpu"] == nvml_name]
    spec = catalog_spec(nvml_name)
    measured: dict[int, list[int]] = {}
    for row in rows:
        measured.setdefault(int(row["memory_clock_mhz"]), []).append(int(row["graphics_clock_mhz"]))
    assert set(measured) == set(spec.clocks.memory_mhz)
    for memory_mhz, graphics in measured.items():
        assert spec.clocks.graphics_for(memory_mhz) == tuple(graphics)
