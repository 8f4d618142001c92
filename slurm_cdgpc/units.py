"""Reading and printing the quantities people type: power (``450kW``) and durations (``90s``)."""

from __future__ import annotations

import math
import re

from slurm_cdgpc.errors import InputError

_POWER_UNITS = {"w": 1.0, "kw": 1e3, "mw": 1e6}
_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
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


def parse_duration_s(text: str) -> float:
    """``90s``, ``5m``, ``1.5h``, ``2d``, ``250ms`` → seconds (a bare number is seconds)."""
    value, unit = _split(text, "duration")
    scale = _DURATION_UNITS.get(unit.lower() if unit else "s")
    if scale is None:
        raise InputError(f"cannot read duration {text!r}: use e.g. 90s, 5m, 1.5h or 2d")
    seconds = value * scale
    if not seconds > 0 or not math.isfinite(seconds):
        raise InputError(f"duration must be positive, got {text!r}")
    return seconds


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
