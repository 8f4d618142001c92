"""Reading and printing the quantities people type: power (``450kW``) and durations (``90s``).

The one duration grammar (`span_s`), mirrored by ``daemon/job_submit.lua``. The ground floor:
standard library and `errors` only, as the GPU floor and the Prolog import it
(`tests/unit/test_import_graph.py`). Test: `tests/unit/test_units.py`.
"""

from __future__ import annotations

import math
import re
from typing import Final

from slurm_cdgpc.errors import InputError

_POWER_UNITS = {"w": 1.0, "kw": 1e3, "mw": 1e6}
_SPAN_UNITS: Final = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_DECIMAL: Final = r"[0-9]+(?:\.[0-9]+)?"
#: ASCII: else "ſ" (long s) matches "s" ignoring case, and is no unit of _SPAN_UNITS
_SPAN_PART: Final = re.compile(rf"({_DECIMAL})[ \t]*(ms|min|[smhd])", re.IGNORECASE | re.ASCII)
SPAN: Final = re.compile(rf"(?:{_SPAN_PART.pattern})+", re.IGNORECASE | re.ASCII)
_SECONDS: Final = re.compile(_DECIMAL)
_NUMBER = r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
_QUANTITY = re.compile(rf"^\s*(?P<num>{_NUMBER})\s*(?P<unit>[a-zA-Z]*)\s*$")


def parse_power_w(text: str) -> float:
    """``450kW`` → 450000.0. Units W, kW, MW (a bare number is watts); must be positive.

    ``MW`` is megawatts: nobody budgets a cluster in milliwatts.
    """
    value, unit = _split(text, "power")
    scale = _POWER_UNITS.get(unit.lower() if unit else "w")
    if scale is None:
        raise InputError(f"cannot read power {text!r}: unit must be W, kW or MW (e.g. 450kW)")
    watts = value * scale
    if not watts > 0 or not math.isfinite(watts):
        raise InputError(f"power must be a positive number of watts, got {text!r}")
    return watts


def parse_ramp_w_per_s(text: str) -> float:
    """``5kW/s`` → 5000.0 W/s: a power per second (``/s`` may be left out; a bare number is W/s),
    positive; ``off`` → inf (no ramp limit)."""
    stripped = text.strip()
    if stripped.lower() == "off":
        return math.inf
    power = re.sub(r"\s*/\s*s$", "", stripped)
    try:
        return parse_power_w(power)
    except InputError:
        raise InputError(
            f"cannot read ramp {text!r}: use a power per second (e.g. 5kW/s) or off"
        ) from None


def span_s(text: str) -> float | None:
    """The seconds of a span (``90s``, ``1.5h``, ``1h30m``, ``250ms``); None if ``text`` is none.

    A span is one or more parts ``<digits>[.<digits>] <unit>``, units ``ms s m min h d`` in any
    case."""
    if SPAN.fullmatch(text) is None:
        return None
    return sum(float(n) * _SPAN_UNITS[unit.lower()] for n, unit in _SPAN_PART.findall(text))


def parse_duration_s(text: str) -> float:
    """A span (``90s``, ``5m``, ``1.5h``, ``1h30m``, ``2d``, ``250ms``) or a bare number of
    seconds (``60``) → seconds, which must be positive."""
    stripped = text.strip()
    seconds = float(stripped) if _SECONDS.fullmatch(stripped) else span_s(stripped)
    if seconds is None:
        raise InputError(f"cannot read duration {text!r}: use e.g. 90s, 5m, 1.5h or 2d")
    if not seconds > 0 or not math.isfinite(seconds):
        raise InputError(f"duration must be positive, got {text!r}")
    return seconds


#: a latency's units, as counts per second: divided by, not multiplied (800 / 1e6 is 0.0008,
#: 800 * 1e-6 is not), so that 1000us is 1ms exactly
_PER_SECOND: Final = {"us": 1e6, "ms": 1e3, "s": 1.0}


def latency_s(number: str, unit: str | None) -> float:
    """A latency a grammar has read as ``number`` and ``unit`` (``us``, ``ms``, ``s`` in any
    case; None: seconds) → seconds."""
    return float(number) / _PER_SECOND[(unit or "s").lower()]


def format_power(watts: float) -> str:
    """450000 → ``450 kW``; three significant digits, the largest unit that keeps it ≥ 1."""
    for unit, scale in (("MW", 1e6), ("kW", 1e3)):
        if abs(watts) >= scale:
            return f"{watts / scale:.4g} {unit}"
    return f"{watts:.4g} W"


def _split(text: str, what: str) -> tuple[float, str]:
    match = _QUANTITY.match(text)
    if match is None:
        raise InputError(f"cannot read {what} {text!r}")
    return float(match.group("num")), match.group("unit")
