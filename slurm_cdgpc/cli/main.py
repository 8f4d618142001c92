"""Entry point of ``cdgpc-admin``. Errors print ``Error: <one line>``; ``CDGPC_DEBUG=1`` shows
the traceback."""

from __future__ import annotations

import logging
import os
from typing import Any

import click

from slurm_cdgpc import __version__
from slurm_cdgpc.cli import admin, bench, demo, model, simulate
from slurm_cdgpc.errors import CdgpcError, one_line


class _Cli(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CdgpcError as e:
            if os.environ.get("CDGPC_DEBUG") == "1":
                raise
            raise click.ClickException(
                one_line(e, 1000, keep="first", empty=type(e).__name__)
            ) from None


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cdgpc-admin")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def cli(verbose: int) -> None:
    """Cooperative GPU power capping for Slurm: budget, status, simulation and benchmarks."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


for _group in (*admin.COMMANDS, bench.bench, model.model, demo.demo, simulate.simulate):
    cli.add_command(_group)


def main() -> None:
    cli(prog_name="cdgpc-admin")
