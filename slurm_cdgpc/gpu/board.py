"""A GPU board as its node describes it, and the controller's GPU type for it.

`BoardDescription` is what an agent sends the head about each GPU (`GpuDevice.describe`): NVML's
own name, clock table and power-limit range. Its wire format (`to_dict`/`from_dict`) is JSON-safe
and bounded; `from_dict` refuses anything else with one line naming the field. `spec_from_board`
turns a description into a `GpuSpec`, so a board the catalog lacks is still controlled.
`board_from_nvidia_smi_xml` reads the same facts from ``nvidia-smi -q -x`` output (recorded
fixtures and tests). No I/O and no NVML here.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Final

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.gpu.catalog import CATALOG, GpuSpec, catalog_spec
from slurm_cdgpc.gpu.device import ClockTable, PowerLimitRange

MAX_MEMORY_CLOCKS: Final = 16
MAX_GRAPHICS_CLOCKS: Final = 512
MAX_NAME_CHARS: Final = 96
MAX_UUID_CHARS: Final = 96
MIN_CLOCK_MHZ: Final = 1
MAX_CLOCK_MHZ: Final = 10_000
MAX_LIMIT_W: Final = 100_000.0

_FIELDS: Final = ("name", "uuid", "clocks", "power_limit_w", "enforced_limit_w", "mig_mode")
_LIMIT_FIELDS: Final = ("min_w", "max_w", "default_w")
_CLOCK_FIELDS: Final = ("memory_mhz", "graphics_mhz")


@dataclass(frozen=True)
class BoardDescription:
    """One GPU board: NVML's name and UUID, its supported clocks and power-limit range.

    ``enforced_limit_w`` is the limit enforced when it was described (None: unreadable);
    ``mig_mode`` is None when the board is not MIG-capable or could not say.
    """

    name: str
    uuid: str
    clocks: ClockTable
    power_limit: PowerLimitRange
    enforced_limit_w: float | None = None
    mig_mode: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        """The wire format: clocks descending, one entry per memory clock."""
        return {
            "name": self.name,
            "uuid": self.uuid,
            "clocks": [
                {"memory_mhz": mem, "graphics_mhz": list(self.clocks.graphics_for(mem))}
                for mem in self.clocks.memory_mhz
            ],
            "power_limit_w": {
                "min_w": self.power_limit.min_w,
                "max_w": self.power_limit.max_w,
                "default_w": self.power_limit.default_w,
            },
            "enforced_limit_w": self.enforced_limit_w,
            "mig_mode": self.mig_mode,
        }

    @classmethod
    def from_dict(cls, value: object, where: str = "board") -> BoardDescription:
        """The description in ``value``, else `InputError` naming the field (``where``: where)."""
        d = _object(value, where, _FIELDS)
        return cls(
            name=_text(d["name"], f"{where}.name", MAX_NAME_CHARS),
            uuid=_text(d["uuid"], f"{where}.uuid", MAX_UUID_CHARS),
            clocks=_clock_table(d["clocks"], f"{where}.clocks"),
            power_limit=_limits(d["power_limit_w"], f"{where}.power_limit_w"),
            enforced_limit_w=None
            if d["enforced_limit_w"] is None
            else _watts(d["enforced_limit_w"], f"{where}.enforced_limit_w"),
            mig_mode=_optional_bool(d["mig_mode"], f"{where}.mig_mode"),
        )

    def type_dict(self) -> dict[str, Any]:
        """What makes the board's type: `to_dict` without UUID, enforced limit and MIG mode."""
        full = self.to_dict()
        return {key: full[key] for key in ("name", "clocks", "power_limit_w")}

    def digest(self) -> str:
        """16 hex digits of sha256 over the canonical JSON of `type_dict`.

        Two boards of one model and firmware share it (UUIDs, enforced limits and MIG mode do
        not enter), so the head can key clock grids by it.
        """
        text = json.dumps(self.type_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _got(value: object) -> str:
    text = repr(value)
    return f"got {text[:40]}{'…' if len(text) > 40 else ''}"


def _object(value: object, where: str, fields: tuple[str, ...]) -> Mapping[str, object]:
    if not isinstance(value, dict):
        raise InputError(f"{where}: expected an object, {_got(value)}")
    unknown = sorted(str(k) for k in value if k not in fields)
    if unknown:
        raise InputError(f"{where}: unknown field {unknown[0][:40]!r}")
    missing = [k for k in fields if k not in value]
    if missing:
        raise InputError(f"{where}.{missing[0]}: missing")
    return value


def _text(value: object, where: str, max_chars: int) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InputError(f"{where}: expected a non-empty string, {_got(value)}")
    if len(value) > max_chars:
        raise InputError(f"{where}: longer than {max_chars} characters")
    if not value.isprintable():
        raise InputError(f"{where}: contains control characters")
    return value


def _clock(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{where}: expected an integer MHz, {_got(value)}")
    if not MIN_CLOCK_MHZ <= value <= MAX_CLOCK_MHZ:
        raise InputError(f"{where}: {value} MHz is outside {MIN_CLOCK_MHZ}..{MAX_CLOCK_MHZ}")
    return value


def _clock_table(value: object, where: str) -> ClockTable:
    if not isinstance(value, list) or not value:
        raise InputError(f"{where}: expected a non-empty list, {_got(value)}")
    if len(value) > MAX_MEMORY_CLOCKS:
        raise InputError(f"{where}: more than {MAX_MEMORY_CLOCKS} memory clocks")
    graphics: dict[int, tuple[int, ...]] = {}
    for i, entry in enumerate(value):
        here = f"{where}[{i}]"
        d = _object(entry, here, _CLOCK_FIELDS)
        memory_mhz = _clock(d["memory_mhz"], f"{here}.memory_mhz")
        if memory_mhz in graphics:
            raise InputError(f"{here}.memory_mhz: {memory_mhz} MHz listed twice")
        listed = d["graphics_mhz"]
        if not isinstance(listed, list) or not listed:
            raise InputError(f"{here}.graphics_mhz: expected a non-empty list, {_got(listed)}")
        if len(listed) > MAX_GRAPHICS_CLOCKS:
            raise InputError(f"{here}.graphics_mhz: more than {MAX_GRAPHICS_CLOCKS} clocks")
        clocks = [_clock(g, f"{here}.graphics_mhz[{j}]") for j, g in enumerate(listed)]
        if len(set(clocks)) != len(clocks):
            raise InputError(f"{here}.graphics_mhz: a clock is listed twice")
        graphics[memory_mhz] = tuple(sorted(clocks, reverse=True))
    ordered = dict(sorted(graphics.items(), reverse=True))
    return ClockTable(memory_mhz=tuple(ordered), graphics_mhz=MappingProxyType(ordered))


def _watts(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputError(f"{where}: expected a number of watts, {_got(value)}")
    watts = float(value)
    if not (math.isfinite(watts) and 0.0 < watts <= MAX_LIMIT_W):
        raise InputError(f"{where}: {watts:g} W is not a finite power in (0, {MAX_LIMIT_W:g}] W")
    return watts


def _limits(value: object, where: str) -> PowerLimitRange:
    d = _object(value, where, _LIMIT_FIELDS)
    limits = PowerLimitRange(*(_watts(d[k], f"{where}.{k}") for k in _LIMIT_FIELDS))
    if not limits.min_w <= limits.default_w <= limits.max_w:
        raise InputError(
            f"{where}: needs min_w <= default_w <= max_w, got {limits.min_w:g}, "
            f"{limits.default_w:g}, {limits.max_w:g} W"
        )
    return limits


def _optional_bool(value: object, where: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise InputError(f"{where}: expected true, false or null, {_got(value)}")
    return value


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
