"""A GPU board as its node describes it to the head (`BoardDescription`, from
`GpuDevice.describe`), with a bounded, JSON-safe wire form whose parser refuses anything else in
one line naming the field. Standard library and `slurm_cdgpc.errors` only, like all of `wire/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Boards"; test:
`tests/unit/test_gpu_board.py`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from slurm_cdgpc.errors import CdgpcError, InputError, UnsupportedClockError

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
class ClockTable:
    """Supported clocks as the device lists them.

    ``graphics_mhz[mem]`` is the descending list of graphics clocks allowed with memory clock
    ``mem``; ``memory_mhz`` is descending too. HBM datacenter parts list one memory clock.
    """

    memory_mhz: tuple[int, ...]
    graphics_mhz: Mapping[int, tuple[int, ...]]

    def __post_init__(self) -> None:
        if not self.memory_mhz:
            raise CdgpcError("a clock table needs at least one memory clock")
        for mem in self.memory_mhz:
            if not self.graphics_mhz.get(mem):
                raise CdgpcError(f"memory clock {mem} MHz has no graphics clocks")

    @property
    def max_memory_mhz(self) -> int:
        return self.memory_mhz[0]

    def graphics_for(self, memory_mhz: int | None = None) -> tuple[int, ...]:
        """Graphics clocks (descending) allowed with ``memory_mhz`` (default: the highest)."""
        mem = self.max_memory_mhz if memory_mhz is None else memory_mhz
        try:
            return self.graphics_mhz[mem]
        except KeyError:
            raise UnsupportedClockError(
                f"memory clock {mem} MHz is not supported (supported: {_fmt(self.memory_mhz)})"
            ) from None

    def check(self, graphics_mhz: int, memory_mhz: int | None = None) -> None:
        """Raise `UnsupportedClockError` unless the pair is in the table."""
        allowed = self.graphics_for(memory_mhz)
        if graphics_mhz not in allowed:
            raise UnsupportedClockError(
                f"graphics clock {graphics_mhz} MHz is not supported with memory clock "
                f"{self.max_memory_mhz if memory_mhz is None else memory_mhz} MHz "
                f"(supported: {allowed[-1]}..{allowed[0]} MHz, {len(allowed)} levels)"
            )


def _fmt(values: Sequence[int]) -> str:
    return ", ".join(str(v) for v in values)


@dataclass(frozen=True)
class PowerLimitRange:
    min_w: float
    max_w: float
    default_w: float


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
