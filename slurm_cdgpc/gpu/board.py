"""The controller's GPU type for a board its node describes, and boards from ``nvidia-smi`` dumps.

No I/O and no NVML. Reaches only `gpu/`, `wire/`, `errors` and `units` of the package
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Boards"; tests:
`tests/unit/test_gpu_board.py`, `tests/unit/test_coordinator_boards.py`.
"""

from __future__ import annotations

import statistics
import xml.etree.ElementTree as ET
from dataclasses import replace
from typing import Any, Final

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.gpu.catalog import CATALOG, GpuSpec, catalog_spec
from slurm_cdgpc.wire.board import BoardDescription

# --- the controller's type for a board ---------------------------------------------------------


def _median_ratio(pairs: list[tuple[float, float]]) -> float:
    return statistics.median(a / b for a, b in pairs)


#: Generic priors, computed from CATALOG at import: the median knee / max-clock ratio and the
#: median idle-power / default-limit ratio over every catalog entry.
GENERIC_KNEE_SHARE: Final = _median_ratio(
    [(s.knee_mhz, s.max_graphics_mhz) for s in CATALOG.values()]
)
GENERIC_IDLE_SHARE: Final = _median_ratio(
    [(s.idle_power_w, s.power_limit.default_w) for s in CATALOG.values()]
)


#: a described board's type name is at most this, ``#`` and 8 hex digits: 64 characters, what
#: the store keeps of a node's GPU type
TYPE_NAME_CHARS: Final = 55


def spec_from_board(board: BoardDescription) -> GpuSpec:
    """The controller's GPU type for ``board``; the board's clocks and limits always win.

    A board the catalog knows (by name or alias, as `catalog_spec`) keeps the catalog's idle
    power, knee, idle clock and averaging window, with TDP = the board's default limit (as in
    every catalog entry). Any other board gets generic priors: knee at `GENERIC_KNEE_SHARE` of
    its top clock, idle power `GENERIC_IDLE_SHARE` × its default limit, idle clock its lowest
    listed, no power averaging (the architecture is unknown), ``estimated=True``.

    Naming: the catalog's name when the board's clocks and limits equal the catalog's (so a
    catalog board maps to the type the head already knows); otherwise ``"<name>#<digest[:8]>"``
    with the catalog's name (known board, other firmware or limits) or NVML's (unknown board).
    The digest covers name, clocks and limits only, so identical boards share one type name.
    """
    try:
        known: GpuSpec | None = catalog_spec(board.name)
    except InputError:
        known = None
    graphics = board.clocks.graphics_for()
    if known is not None:
        if known.clocks == board.clocks and known.power_limit == board.power_limit:
            return known
        # the catalog's idle clock and knee, unless this board's list cannot hold them
        idle_mhz = known.idle_graphics_mhz if known.idle_graphics_mhz in graphics else graphics[-1]
        knee_mhz = known.knee_mhz
        if not graphics[-1] < knee_mhz < graphics[0]:
            knee_mhz = GENERIC_KNEE_SHARE * graphics[0]
        return replace(
            known,
            name=f"{known.name}#{board.digest()[:8]}",
            clocks=board.clocks,
            power_limit=board.power_limit,
            tdp_w=board.power_limit.default_w,
            knee_mhz=knee_mhz,
            idle_graphics_mhz=idle_mhz,
            aliases=(),
        )
    return GpuSpec(
        name=f"{board.name[:TYPE_NAME_CHARS]}#{board.digest()[:8]}",
        clocks=board.clocks,
        power_limit=board.power_limit,
        idle_power_w=GENERIC_IDLE_SHARE * board.power_limit.default_w,
        tdp_w=board.power_limit.default_w,
        knee_mhz=max(GENERIC_KNEE_SHARE * graphics[0], float(graphics[-1])),
        idle_graphics_mhz=graphics[-1],
        estimated=True,
    )


# --- nvidia-smi -q -x ----------------------------------------------------------------------


def _mhz(text: str | None, where: str) -> int:
    words = (text or "").split()
    if len(words) != 2 or words[1] != "MHz" or not words[0].isdigit():
        raise InputError(f"{where}: expected '<n> MHz', got {text!r:.40}")
    return int(words[0])


def _xml_watts(text: str | None, where: str) -> float:
    words = (text or "").split()
    try:
        if len(words) == 2 and words[1] == "W":
            return float(words[0])
    except ValueError:
        pass
    raise InputError(f"{where}: expected '<x> W', got {text!r:.40}")


def _find_text(gpu: ET.Element, paths: tuple[str, ...]) -> str | None:
    """The text of the first of ``paths`` present and not N/A."""
    for path in paths:
        found = gpu.find(path)
        if found is not None and found.text and found.text.strip() not in ("N/A", ""):
            return found.text.strip()
    return None


def board_from_nvidia_smi_xml(text: str, index: int = 0) -> BoardDescription:
    """GPU ``index`` of an ``nvidia-smi -q -x`` dump as NVML would describe it.

    Reads schema v11 (``power_readings``, ``enforced_power_limit``) and v12+
    (``gpu_power_readings``, where ``current_power_limit`` is the enforced one).
    """
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        raise InputError(f"not an nvidia-smi XML dump: {e}") from None
    gpus = root.findall("gpu")
    if not 0 <= index < len(gpus):
        raise InputError(f"nvidia-smi dump has {len(gpus)} GPU(s), no GPU {index}")
    gpu = gpus[index]
    where = f"gpu[{index}]"
    clocks: list[dict[str, Any]] = []
    for entry in gpu.findall("supported_clocks/supported_mem_clock"):
        memory_mhz = _mhz(entry.findtext("value"), f"{where}.supported_mem_clock.value")
        graphics = [
            _mhz(g.text, f"{where}.supported_graphics_clock")
            for g in entry.findall("supported_graphics_clock")
        ]
        clocks.append({"memory_mhz": memory_mhz, "graphics_mhz": graphics})

    def watts(*paths: str) -> float | None:
        found = _find_text(gpu, paths)
        return None if found is None else _xml_watts(found, f"{where}.{paths[0]}")

    power = ("gpu_power_readings", "power_readings")
    limits = {
        key: watts(*(f"{p}/{key}_power_limit" for p in power)) for key in ("min", "max", "default")
    }
    enforced = watts(
        "gpu_power_readings/current_power_limit", "power_readings/enforced_power_limit"
    )
    mig = _find_text(gpu, ("mig_mode/current_mig",))
    return BoardDescription.from_dict(
        {
            "name": _find_text(gpu, ("product_name",)),
            "uuid": _find_text(gpu, ("uuid",)),
            "clocks": clocks,
            "power_limit_w": {
                "min_w": limits["min"],
                "max_w": limits["max"],
                "default_w": limits["default"],
            },
            "enforced_limit_w": enforced,
            "mig_mode": None if mig is None else mig == "Enabled",
        },
        where,
    )
