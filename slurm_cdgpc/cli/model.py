"""``cdgpc-admin model``: inspect the online models."""

from __future__ import annotations

from pathlib import Path

import click

from slurm_cdgpc.cli.output import echo_json
from slurm_cdgpc.gpu.catalog import catalog_spec
from slurm_cdgpc.model.estimator import EstimatorSettings
from slurm_cdgpc.model.families import FAMILIES
from slurm_cdgpc.model.replay import FORMATS, gpu_for, load_sweep, replay


@click.group()
def model() -> None:
    """Online power and iteration-time models."""


@model.command("replay")
@click.option(
    "--csv",
    "csv_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="A measured clock or power-limit sweep.",
)
@click.option("--format", "fmt", type=click.Choice(FORMATS), help="Default: from the header.")
@click.option("--gpu", help="GPU type of the sweep (default: from the file name).")
@click.option(
    "--family",
    type=click.Choice(sorted(FAMILIES)),
    default=EstimatorSettings().family,
    show_default=True,
    help="Power model family.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def replay_cmd(
    csv_path: Path, fmt: str | None, gpu: str | None, family: str, as_json: bool
) -> None:
    """Replay a sweep through the online estimator, predicting each point before learning it.

    Points run from the top clock (or power limit) down, as a controller walking a job down
    would see them; the error is averaged over every point after the first three of a series.
    """
    sweep, fmt = load_sweep(csv_path, fmt)
    spec = catalog_spec(gpu) if gpu else gpu_for(csv_path)
    result = replay(sweep, spec, fmt, EstimatorSettings(family=family))
    if as_json:
        echo_json(result.as_dict())
        return
    click.echo(
        f"{csv_path.name}: {result.series} series, {result.points} points on {result.gpu}, "
        f"family {result.model_family}\n"
        f"  power MAPE {result.power_mape_pct:.2f} %   time MAPE {result.time_mape_pct:.2f} %"
        f"   ({result.scored_points} predictions scored)"
    )
