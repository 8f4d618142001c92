"""``cdgpc-admin simulate --sweep OUTDIR``: a resumable sweep on a local pool or a Slurm array.

The sweep itself (definition, cells, reference replays, the table's rows) is
`slurm_cdgpc.sim.sweep`; Slurm is reached only through `slurm_cdgpc.slurm.array`. Each array
task runs the hidden ``cdgpc-admin simulate --sweep-cell OUTDIR I,J,...``.
"""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import click

from slurm_cdgpc.cli.output import echo_json, format_table, format_value
from slurm_cdgpc.errors import FatalError, InputError
from slurm_cdgpc.sim.reporting import ProgressMix, TimeLimitModel
from slurm_cdgpc.sim.sweep import (
    Cell,
    Sweep,
    aggregate,
    define_sweep,
    format_seeds,
    mix_label,
    parse_budgets,
    parse_mixes,
    parse_policies,
    parse_seeds,
    run_cells,
    run_local,
    write_atomically,
)
from slurm_cdgpc.slurm.array import array_active, array_script, submit_array, wait_for_array
from slurm_cdgpc.units import parse_duration_s

BACKENDS: Final = ("local", "slurm")
SLURM_DIR: Final = "slurm"
#: the last job array submitted for this sweep: {"job_id", "cells"}
ARRAY_FILE: Final = "array.json"
_TABLE: Final = (
    ("trace", "trace"),
    ("budget", "budget"),
    ("progress_mix", "progress"),
    ("policy", "policy"),
    ("seeds", "seeds"),
    ("violations", "violations"),
    ("violations_induced", "induced"),
    ("power_mae_pct", "max MAE %"),
    ("over_budget_intervals_pct", "max over %"),
    ("killed_at_time_limit", "killed"),
    ("energy_kwh", "mean kWh"),
)


def run_sweep_cell(ctx: click.Context, _param: click.Parameter, value: Any) -> None:
    """``--sweep-cell OUTDIR I,J``: run those cells here, then exit (an array task's work)."""
    if value is None or ctx.resilient_parsing:
        return
    directory, indices = value
    try:
        numbers = [int(i) for i in indices.split(",")]
    except ValueError:
        raise InputError(f"--sweep-cell {indices!r}: cell numbers, comma-separated") from None
    ran = run_cells(Path(directory), numbers)
    click.echo(f"ran {ran} of {len(numbers)} cells", err=True)
    ctx.exit(0)


def run_sweep(
    directory: str,
    trace_paths: Sequence[str],
    *,
    trace_format: str | None,
    fleet_text: str | None,
    budget: str,
    policy: str,
    interval: str,
    seed: str,
    progress_share: str | None,
    progress_mixes: Sequence[str],
    time_limit_model: str,
    limit_jobs: int | None,
    racks: str | None,
    topology_path: str | None,
    serving: str | None,
    serving_arrivals: str | None,
    as_json: bool,
    backend: str,
    workers: int | None,
    cells_per_task: int,
    sbatch_args: Sequence[str],
    wait: bool,
) -> None:
    """Define (or resume) the sweep in ``directory``, run what is missing, print the table."""
    definition = define_sweep(
        trace_paths,
        trace_format=trace_format,
        budgets=parse_budgets(budget),
        progress_mixes=parse_mixes(progress_share, progress_mixes),
        policies=parse_policies(policy),
        seeds=parse_seeds(seed),
        limit_jobs=limit_jobs,
        fleet=fleet_text,
        interval_s=parse_duration_s(interval),
        time_limits=TimeLimitModel.parse(time_limit_model),
        racks=racks,
        topology_path=topology_path,
        serving=serving,
        serving_arrivals=serving_arrivals,
    )
    sweep = Sweep.create(Path(directory).resolve(), definition)
    pending = sweep.pending()
    total = len(definition.cells())
    click.echo(
        f"sweep {sweep.directory}: {total} cells, {total - len(pending)} on disk, "
        f"{len(pending)} to run",
        err=True,
    )
    if backend == "local":
        show = not as_json or sys.stderr.isatty()
        with click.progressbar(
            length=len(pending), label="sweep", file=sys.stderr if show else io.StringIO()
        ) as bar:
            run_local(sweep, pending, workers or os.cpu_count() or 1, lambda: bar.update(1))
    elif not _run_on_slurm(sweep, pending, cells_per_task, sbatch_args, wait):
        return
    _print(sweep, as_json)


def _program() -> list[str]:
    """How an array task starts this cdgpc-admin (the one beside this Python, if any)."""
    beside = Path(sys.executable).with_name("cdgpc-admin")
    if beside.is_file():
        return [str(beside)]
    return [sys.executable, "-c", "from slurm_cdgpc.cli.main import main; main()"]


def _run_on_slurm(
    sweep: Sweep, pending: list[Cell], cells_per_task: int, sbatch_args: Sequence[str], wait: bool
) -> bool:
    """Submit the pending cells as a job array; True when they are done (``wait``)."""
    slurm_dir = sweep.directory / SLURM_DIR
    slurm_dir.mkdir(exist_ok=True)
    state = slurm_dir / ARRAY_FILE
    if state.exists():
        previous = str(json.loads(state.read_text())["job_id"])
        if array_active(previous):
            if not wait:
                raise InputError(
                    f"job array {previous} of this sweep is still queued or running: "
                    f"add --wait to wait for it, or scancel {previous}"
                )
            click.echo(f"waiting for job array {previous}", err=True)
            wait_for_array(previous)
            pending = sweep.pending()
    if not pending:
        return True
    chunks = [pending[i : i + cells_per_task] for i in range(0, len(pending), cells_per_task)]
    program = _program()
    commands = [
        [
            *program,
            "simulate",
            "--sweep-cell",
            str(sweep.directory),
            ",".join(str(c.index) for c in chunk),
        ]
        for chunk in chunks
    ]
    script = slurm_dir / "sweep.sh"
    text = array_script(
        commands,
        job_name="cdgpc-sweep",
        output=slurm_dir / "%A_%a.out",
        comment=f"cdgpc-admin simulate --sweep {sweep.directory}: task i runs chunk i of cells",
    )
    write_atomically(script, lambda f: f.write(text.encode()))
    job_id = submit_array(script, len(chunks), sbatch_args=sbatch_args)
    record = {"job_id": job_id, "cells": [c.key for c in pending]}
    write_atomically(state, lambda f: f.write(json.dumps(record).encode()))
    click.echo(
        f"submitted job array {job_id}: {len(chunks)} tasks for {len(pending)} cells "
        f"(logs: {slurm_dir}/{job_id}_*.out)",
        err=True,
    )
    if not wait:
        click.echo("when it is done, run the same command again for the table", err=True)
        return False
    wait_for_array(job_id)
    return True


def _text(key: str, value: Any) -> str:
    if key == "seeds":
        return format_seeds(value)
    if key == "progress_mix":  # a share as it was given, a mix by its shares
        mix = ProgressMix.parse(value)
        return f"{mix.share:g}" if mix.share is not None else mix_label(mix)
    return format_value(value)


def _print(sweep: Sweep, as_json: bool) -> None:
    records, missing = sweep.records()
    rows = aggregate(records)
    if as_json:
        echo_json(
            {
                "sweep": str(sweep.directory),
                "cells": records,
                "rows": rows,
                "missing": [c.key for c in missing],
            }
        )
    else:
        table = [[_text(key, row[key]) for key, _ in _TABLE] for row in rows]
        click.echo(format_table([h for _, h in _TABLE], table))
    if missing:
        raise FatalError(
            f"{len(missing)} of {len(missing) + len(records)} cells did not come back "
            f"(first: {missing[0].key}); see {sweep.directory / SLURM_DIR}/*.out, then run "
            "the same command again"
        )
