"""How commands print: one JSON object for scripts, aligned tables for people."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click


def echo_json(payload: dict[str, Any]) -> None:
    """One JSON object on stdout (the contract of every ``--json`` flag)."""
    click.echo(json.dumps(payload))


def format_value(value: Any) -> str:
    """A table cell: ``-`` for None, three decimals below 100, whole numbers above."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Right-aligned columns (numbers line up), a header and a rule."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
