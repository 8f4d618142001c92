"""``cdgpc-admin bench``: benchmarks that print one JSON object."""

from __future__ import annotations

import re

import click

from slurm_cdgpc.cli import bench_faults, bench_live, bench_soak
from slurm_cdgpc.cli.output import echo_json
from slurm_cdgpc.control.dual import MODES
from slurm_cdgpc.model.families import FAMILIES


@click.group()
def bench() -> None:
    """Benchmarks (JSON on stdout; no pass/fail, numbers to compare)."""


@bench.command("controller")
@click.option("--jobs", type=click.IntRange(min=1), required=True, help="Running jobs.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=20, show_default=True)
@click.option(
    "--budget-fraction",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=0.6,
    show_default=True,
    help="Budget as a fraction of the fleet's power at top clocks.",
)
@click.option("--mode", type=click.Choice(MODES), default="newton", show_default=True)
@click.option("--family", type=click.Choice(sorted(FAMILIES)), default="bent", show_default=True)
@click.option(
    "--topology",
    metavar="ROWSxRACKS",
    help="Power domains over the jobs' nodes: ROWS rows of RACKS racks each (e.g. 50x10), "
    "racks limited to 0.55-0.8 of their power at top clocks, rows to 0.7.",
)
@click.option("--json", "as_json", is_flag=True, help="Accepted for symmetry: output is JSON.")
def controller_cmd(
    jobs: int,
    seed: int,
    steps: int,
    budget_fraction: float,
    mode: str,
    family: str,
    topology: str | None,
    as_json: bool,
) -> None:
    """Time one full control step (RLS update, dual solve, discretisation) for N jobs.

    The controller runs with the shipped settings, every rule on (jobs wait, so the drain
    runs too); ``--mode`` and ``--family`` replace those two.

    Also checks that the dual modes agree on the price and compares the continuous solution
    with a cvxpy solve of the same problem on up to 2,000 jobs.
    """
    from slurm_cdgpc.bench.controller import bench_controller  # noqa: PLC0415 (cvxpy is slow)

    echo_json(
        bench_controller(
            jobs,
            seed=seed,
            steps=steps,
            budget_fraction=budget_fraction,
            mode=mode,
            family=family,
            topology=None if topology is None else _rows_by_racks(topology),
        )
    )


def _rows_by_racks(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"([1-9][0-9]{0,4})x([1-9][0-9]{0,4})", text.strip())
    if match is None:
        raise click.BadParameter(
            f"{text!r}: expected ROWSxRACKS, e.g. 50x10", param_hint="--topology"
        )
    return int(match[1]), int(match[2])


@bench.command("guard-rail")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--jobs", type=click.IntRange(min=1), default=120, show_default=True)
@click.option("--intervals", type=click.IntRange(min=2), default=60, show_default=True)
@click.option(
    "--budget-fraction",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=0.7,
    show_default=True,
    help="Budget as a fraction of the fleet's power at top clocks.",
)
@click.option(
    "--bias",
    type=click.FloatRange(min=0.0),
    default=0.10,
    show_default=True,
    help="Every job's power jumps by this share at --step-at (its models are that low).",
)
@click.option("--step-at", type=click.IntRange(min=1), default=20, show_default=True)
@click.option(
    "--margin",
    "margins",
    type=click.FloatRange(min=0.0, min_open=True),
    multiple=True,
    help="Margins to compare with the rail off (repeatable; default 0.02, 0.05, 0.10).",
)
@click.option("--json", "as_json", is_flag=True, help="Accepted for symmetry: output is JSON.")
def guard_rail_cmd(
    seed: int,
    jobs: int,
    intervals: int,
    budget_fraction: float,
    bias: float,
    step_at: int,
    margins: tuple[float, ...],
    as_json: bool,
) -> None:
    """The power-limit guard rail in the closed loop: overshoot after a model error, and its
    steady-state cost in clock and speed, with the rail off and at each margin."""
    from slurm_cdgpc.bench.guard_rail import bench_guard_rail  # noqa: PLC0415

    echo_json(
        bench_guard_rail(
            seed=seed,
            jobs=jobs,
            intervals=intervals,
            budget_fraction=budget_fraction,
            bias=bias,
            step_at=step_at,
            margins=(None, *(margins or (0.02, 0.05, 0.10))),
        )
    )


@bench.command("progress-hook")
@click.option("--rounds", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=2000, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=200, show_default=True)
@click.option("--width", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=64, show_default=True)
@click.option(
    "--interval-s",
    type=click.FloatRange(min=0.0),
    default=1.0,
    show_default=True,
    help="CDGPC_PROGRESS_INTERVAL of the hooked runs.",
)
@click.option("--json", "as_json", is_flag=True, help="Accepted for symmetry: output is JSON.")
def progress_hook_cmd(
    rounds: int, steps: int, warmup: int, width: int, batch: int, interval_s: float, as_json: bool
) -> None:
    """Time a small PyTorch training loop (CPU) with and without the automatic progress hook.

    Paired runs in fresh interpreters, alternating, against a real progress socket; also the
    hook's per-step and per-send cost in-process and its interpreter start-up cost.
    """
    from slurm_cdgpc.bench.progress_hook import bench_progress_hook  # noqa: PLC0415

    echo_json(
        bench_progress_hook(
            rounds=rounds,
            steps=steps,
            warmup=warmup,
            width=width,
            batch=batch,
            interval_s=interval_s,
        )
    )


for _command in bench_live.COMMANDS:
    bench.add_command(_command)
bench.add_command(bench_faults.faults_cmd)
bench.add_command(bench_soak.soak_cmd)
