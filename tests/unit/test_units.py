from __future__ import annotations

import pytest

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.units import format_power, parse_duration_s, parse_power_w


@pytest.mark.parametrize(
    ("text", "watts"),
    [("450kW", 450e3), ("450 kW", 450e3), ("1.2MW", 1.2e6), ("300", 300.0), ("250W", 250.0),
     ("0.5kw", 500.0), ("1e3W", 1000.0)],
)  # fmt: skip
def test_power_units(text: str, watts: float) -> None:
    assert parse_power_w(text) == pytest.approx(watts)


@pytest.mark.parametrize("text", ["-5W", "0", "5 GW", "kW", "", "450 k W", "nan", "1e400W"])
def test_bad_power_is_a_one_line_error(text: str) -> None:
    with pytest.raises(InputError) as err:
        parse_power_w(text)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90.0),
        ("5m", 300.0),
        ("1.5h", 5400.0),
        ("2d", 172800.0),
        ("250ms", 0.25),
        ("60", 60.0),
    ],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration_s(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["-1s", "5 weeks", "soon", "0s"])
def test_bad_duration_is_refused(text: str) -> None:
    with pytest.raises(InputError):
        parse_duration_s(text)


def test_format_power_picks_the_unit() -> None:
    assert format_power(450e3) == "450 kW"
    assert format_power(1.25e6) == "1.25 MW"
    assert format_power(312.5) == "312.5 W"
