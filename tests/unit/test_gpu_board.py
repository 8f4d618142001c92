"""Board descriptions: the wire format, the controller's type for a board, nvidia-smi dumps."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.gpu.board import (
    GENERIC_IDLE_SHARE,
    GENERIC_KNEE_SHARE,
    board_from_nvidia_smi_xml,
    spec_from_board,
)
from slurm_cdgpc.gpu.catalog import CATALOG, catalog_spec
from slurm_cdgpc.wire.board import BoardDescription

DATA = Path(__file__).resolve().parent.parent / "data" / "nvml"
DUMPS = {
    "rtx-4000-sff-ada": "rtx-4000-sff-ada-v13.xml",
    "a10g": "a10g.xml",
    "tesla-t4": "tesla-t4.xml",
    "a100-sxm4-80gb-mig": "a100-sxm4-v12.xml",
}


def recorded(name: str) -> BoardDescription:
    return BoardDescription.from_dict(json.loads((DATA / f"{name}.board.json").read_text()))


def test_recorded_ada_board_is_what_nvidia_smi_showed() -> None:
    board = recorded("rtx-4000-sff-ada")
    assert board.name == "NVIDIA RTX 4000 SFF Ada Generation"
    assert board.clocks.memory_mhz == (7001, 6801, 5001, 810, 405)
    assert [len(board.clocks.graphics_for(m)) for m in board.clocks.memory_mhz] == [194] * 4 + [14]
    assert board.clocks.graphics_for(7001)[:2] == (3105, 3090)
    assert (board.power_limit.min_w, board.power_limit.default_w) == (30.0, 70.0)
    assert (board.enforced_limit_w, board.mig_mode) == (70.0, None)
    assert recorded("a100-sxm4-80gb-mig").mig_mode is True


@pytest.mark.parametrize("name", list(DUMPS))
def test_wire_format_round_trips_through_json(name: str) -> None:
    board = recorded(name)
    again = BoardDescription.from_dict(json.loads(json.dumps(board.to_dict())))
    assert again == board
    assert again.digest() == board.digest()


def test_digest_ignores_uuid_enforced_limit_and_mig_but_not_the_tables() -> None:
    board = recorded("a10g")
    twin = BoardDescription(
        "NVIDIA A10G", "GPU-other", board.clocks, board.power_limit, 150.0, False
    )
    assert twin.digest() == board.digest()
    assert len(board.digest()) == 16
    other = BoardDescription.from_dict(_edited(board, ["power_limit_w", "min_w"], 150.0))
    assert other.digest() != board.digest()


def _edited(board: BoardDescription, path: list[Any], value: object) -> dict[str, Any]:
    d = copy.deepcopy(board.to_dict())
    target: Any = d
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return d


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (["name"], "x" * 97, r"board\.name: longer than 96"),
        (["name"], "", r"board\.name: expected a non-empty string"),
        (["uuid"], "GPU-\n", r"board\.uuid: contains control"),
        (["clocks", 0, "memory_mhz"], 0, r"board\.clocks\[0\]\.memory_mhz: 0 MHz is outside"),
        (["clocks", 0, "graphics_mhz", 3], 10_001, r"graphics_mhz\[3\]: 10001 MHz"),
        (["clocks", 0, "graphics_mhz", 3], 1.5, r"graphics_mhz\[3\]: expected an integer"),
        (["clocks", 0, "graphics_mhz"], list(range(1000, 1513)), r"more than 512 clocks"),
        (["clocks", 0, "graphics_mhz"], [1710, 1710], r"listed twice"),
        (["clocks", 1, "memory_mhz"], 6251, r"clocks\[1\]\.memory_mhz: 6251 MHz listed twice"),
        (["clocks", 0, "extra"], 1, r"board\.clocks\[0\]: unknown field 'extra'"),
        (["power_limit_w", "min_w"], float("nan"), r"power_limit_w\.min_w: nan W is not"),
        (["power_limit_w", "default_w"], 350.0, r"needs min_w <= default_w <= max_w"),
        (["power_limit_w", "max_w"], True, r"max_w: expected a number"),
        (["enforced_limit_w"], -1.0, r"enforced_limit_w: -1 W"),
        (["mig_mode"], 1, r"board\.mig_mode: expected true, false or null"),
    ],
)
def test_malformed_descriptions_are_refused_naming_the_field(
    path: list[Any], value: object, message: str
) -> None:
    bad = _edited(recorded("a10g"), path, value)
    with pytest.raises(InputError, match=message) as info:
        BoardDescription.from_dict(bad)
    assert "\n" not in str(info.value)


def test_too_many_memory_clocks_and_missing_fields_are_refused() -> None:
    d = recorded("a10g").to_dict()
    d["clocks"] = [{"memory_mhz": m, "graphics_mhz": [210]} for m in range(100, 117)]
    with pytest.raises(InputError, match="more than 16 memory clocks"):
        BoardDescription.from_dict(d)
    del d["mig_mode"]
    with pytest.raises(InputError, match=r"board\.mig_mode: missing"):
        BoardDescription.from_dict(d, "board")
    with pytest.raises(InputError, match="expected an object"):
        BoardDescription.from_dict([1, 2])


def test_catalog_boards_map_to_their_catalog_type() -> None:
    for name in ("a10g", "tesla-t4"):
        spec = spec_from_board(recorded(name))
        assert spec is catalog_spec(recorded(name).name)
        assert not spec.estimated


def test_a_known_board_with_other_limits_keeps_the_priors_but_takes_its_own_limits() -> None:
    board = recorded("a100-sxm4-80gb-mig")  # a 500 W board; the catalog's is 400 W
    spec = spec_from_board(board)
    known = catalog_spec("A100-SXM4-80GB")
    assert spec.name == f"A100-SXM4-80GB#{board.digest()[:8]}"
    assert spec.power_limit.max_w == 500.0 and spec.tdp_w == 500.0
    assert spec.clocks == board.clocks
    assert (spec.knee_mhz, spec.idle_power_w, spec.idle_graphics_mhz) == (
        known.knee_mhz,
        known.idle_power_w,
        known.idle_graphics_mhz,
    )
    assert not spec.estimated


def test_an_unknown_board_gets_generic_priors_from_its_own_tables() -> None:
    board = recorded("rtx-4000-sff-ada")
    spec = spec_from_board(board)
    assert spec.estimated
    assert spec.name == f"NVIDIA RTX 4000 SFF Ada Generation#{board.digest()[:8]}"
    assert spec.clocks == board.clocks and spec.power_limit == board.power_limit
    assert spec.knee_mhz == pytest.approx(GENERIC_KNEE_SHARE * 3105)
    assert spec.idle_power_w == pytest.approx(GENERIC_IDLE_SHARE * 70.0)
    assert (spec.tdp_w, spec.idle_graphics_mhz) == (70.0, 210)
    # a second board of the same model (another UUID, another enforced limit) is the same type
    twin = BoardDescription(board.name, "GPU-twin", board.clocks, board.power_limit, 50.0)
    assert spec_from_board(twin) == spec
    # the generic shares are the catalog's medians, and sensible
    assert 0.6 < GENERIC_KNEE_SHARE < 0.8 and 0.05 < GENERIC_IDLE_SHARE < 0.25
    knees = sorted(s.knee_mhz / s.max_graphics_mhz for s in CATALOG.values())
    assert knees[0] <= GENERIC_KNEE_SHARE <= knees[-1]


def test_nvidia_smi_parser_refuses_what_it_cannot_read() -> None:
    with pytest.raises(InputError, match="not an nvidia-smi XML dump"):
        board_from_nvidia_smi_xml("<nvidia_smi_log>")
    with pytest.raises(InputError, match="has 0 GPU"):
        board_from_nvidia_smi_xml("<nvidia_smi_log></nvidia_smi_log>")


@pytest.mark.data
@pytest.mark.parametrize(("fixture", "dump"), list(DUMPS.items()))
def test_recorded_fixtures_equal_what_the_dumps_say(
    shared_data: Path, fixture: str, dump: str
) -> None:
    path = shared_data / "nvidia-smi-dumps" / "plugins" / "inputs" / "nvidia_smi" / "testdata"
    board = board_from_nvidia_smi_xml((path / dump).read_text(encoding="utf-8"))
    assert board == recorded(fixture)
    assert board.to_dict() == json.loads((DATA / f"{fixture}.board.json").read_text())
