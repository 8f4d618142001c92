"""`one_line`: any text made one printable, clipped line for a log or an error message."""

from __future__ import annotations

from slurm_cdgpc.errors import one_line


def test_lines_and_whitespace_runs_become_one_line() -> None:
    assert one_line("  sbatch: error:\n\n  bad\tpartition \r\n") == "sbatch: error: bad partition"
    assert one_line("\nfirst\n\nsecond\n", keep="first") == "first"
    assert one_line("first\nsecond\n  \n", keep="last") == "second"


def test_unprintable_characters_are_replaced_and_long_text_cut() -> None:
    assert one_line("a\x00b\x1b[31m") == "a?b?[31m"
    assert one_line("caf\u00e9 \u2264 1") == "caf\u00e9 \u2264 1"
    assert one_line("caf\u00e9 \u2264 1", ascii_only=True) == "caf? ? 1"
    assert one_line("x" * 50, 43) == "x" * 40 + "..."
    assert one_line("x" * 43, 43) == "x" * 43


def test_nothing_left_says_so() -> None:
    assert one_line("") == "no message"
    assert one_line(" \n\t", empty="") == ""
    assert one_line(ValueError(), empty="ValueError") == "ValueError"
