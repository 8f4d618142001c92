"""``cdgpc-admin demo``: the real daemons on a replayed trace, live in the terminal.

By default (and ``make demo``): ``cdgpcd`` on a SQLite file and four ``cdgpc-noded`` with eight
simulated GPUs each (A100 and A40, calibrated on real measurements), on loopback with HMAC (MUNGE
where munged runs), replaying a slice of a real trace on an accelerated clock; the admin lowers
the budget half-way; plots and a copy of the head's store go to ``--out`` (`slurm_cdgpc.demo`).

``--in-process`` runs the controller alone on a synthetic fleet, in this process (no daemons,
no sockets): the closed loop of `slurm_cdgpc.sim.closed_loop`, for a quick look at the control
law. ``--jobs``, ``--intervals`` and ``--seed`` belong to it and imply it.
"""

from __future__ import annotations

import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import numpy as np

from slurm_cdgpc.cli.output import echo_json, format_table
from slurm_cdgpc.config import load_config
from slurm_cdgpc.control.dual import StepStatus
from slurm_cdgpc.control.empc import ControllerSettings
from slurm_cdgpc.sim.closed_loop import ClosedLoop, IntervalRecord, synthetic_fleet
from slurm_cdgpc.units import format_power, parse_duration_s

if TYPE_CHECKING:
    from slurm_cdgpc.localcluster import TomlValue

COLUMNS = ("time", "budget", "power", "error", "price", "jobs", "at risk", "done", "step ms")
WIDTHS = (6, 10, 10, 8, 9, 5, 7, 5, 7)


@dataclass
class _Tally:
    """What the summary needs, kept as the run goes."""

    finished: int = 0
    finished_late: int = 0


def _row(r: IntervalRecord, at_risk: int, done: int) -> tuple[str, ...]:
    minutes = int(r.t_s // 60)
    return (
        f"{minutes // 60:02d}:{minutes % 60:02d}",
        format_power(r.budget_w),
        format_power(r.power_w),
        f"{r.error_pct:+.2f}%",
        {StepStatus.SLACK: "-", StepStatus.INFEASIBLE: "infeas."}.get(r.status, f"{r.price:.2e}"),
        str(r.jobs),
        str(at_risk),
        str(done),
        f"{1e3 * r.step_s:.1f}",
    )


def _line(cells: tuple[str, ...]) -> str:
    return "  ".join(c.rjust(w) for c, w in zip(cells, WIDTHS, strict=True))


def _at_risk(loop: ClosedLoop) -> int:
    """Running jobs predicted to finish after their deadline at the clocks they just ran."""
    return int(np.sum(loop.predicted_finish_s() > loop.fleet.deadline_s))


@click.command("demo")
@click.option("--duration", default="90s", show_default=True, help="How long the replay runs.")
@click.option(
    "--interval",
    "interval",
    default=None,
    help="Control interval [default: 1s; --in-process: 60s, simulated].",
)
@click.option(
    "--speed",
    type=click.FloatRange(min=0.0),
    default=None,
    help="Simulated seconds per wall-clock second [default: 180; --in-process: 240, "
    "0 there: as fast as possible].",
)
@click.option(
    "--budget-fraction",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=None,
    help="Budget as a fraction of the GPUs' summed TDP [default: 0.7; --in-process: 0.75 of "
    "the fleet's power at top clocks].",
)
@click.option(
    "--drop-to",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=None,
    help="The budget fraction the admin sets half-way through [default: 0.55; --in-process: 0.6].",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("demo-out"),
    show_default=True,
    help="Where the plots and a copy of the head's store go.",
)
@click.option("--keep-run-dir", is_flag=True, help="Keep the daemons' configs, logs and store.")
@click.option("--in-process", "in_process", is_flag=True, help="The controller alone, no daemons.")
@click.option("--jobs", type=click.IntRange(min=1), default=None, help="--in-process: jobs [48].")
@click.option(
    "--intervals", type=click.IntRange(min=2), default=None, help="--in-process: intervals [40]."
)
@click.option("--seed", type=int, default=None, help="--in-process: seed [0].")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="A cdgpc.toml whose [control] section the head runs with (less its interval) "
    "[default: the shipped settings].",
)
@click.option("--json", "as_json", is_flag=True, help="No table: print the summary as JSON.")
def demo(
    duration: str,
    interval: str | None,
    speed: float | None,
    budget_fraction: float | None,
    drop_to: float | None,
    out_dir: Path,
    keep_run_dir: bool,
    in_process: bool,
    jobs: int | None,
    intervals: int | None,
    seed: int | None,
    config_path: Path | None,
    as_json: bool,
) -> None:
    """Run a simulated GPU cluster under a power budget and watch the controller hold it."""
    interval_s = None if interval is None else parse_duration_s(interval)
    control = {} if config_path is None else control_section(config_path)
    if in_process or jobs is not None or intervals is not None or seed is not None:
        if config_path is not None:
            raise click.UsageError("--config is for the live demo, not --in-process")
        _in_process(
            jobs=48 if jobs is None else jobs,
            intervals=40 if intervals is None else intervals,
            interval_s=60.0 if interval_s is None else interval_s,
            speed=240.0 if speed is None else speed,
            budget_fraction=0.75 if budget_fraction is None else budget_fraction,
            drop_to=0.6 if drop_to is None else drop_to,
            seed=0 if seed is None else seed,
            as_json=as_json,
        )
        return
    from slurm_cdgpc.demo.run import DemoSettings, Screen, run_demo  # noqa: PLC0415

    settings = DemoSettings(
        duration_s=parse_duration_s(duration),
        speed=180.0 if speed is None else speed,
        interval_s=1.0 if interval_s is None else interval_s,
        lease_s=max(5.0, 5 * (1.0 if interval_s is None else interval_s)),
        budget_fraction=0.7 if budget_fraction is None else budget_fraction,
        drop_to=0.55 if drop_to is None else drop_to,
        out_dir=out_dir,
        keep_run_dir=keep_run_dir,
        control=control,
    )
    mode = "quiet" if as_json else "tty" if sys.stdout.isatty() else "lines"
    summary = run_demo(settings, Screen(mode, click.echo))
    if as_json:
        echo_json(summary)
        return
    _print_summary(summary)


def control_section(path: Path) -> dict[str, TomlValue]:
    """The ``[control]`` keys of the cdgpc.toml at ``path`` as written there, less the
    interval (the demo's own), once the whole file has loaded as cdgpcd would load it."""
    load_config(path, env={})  # a bad key or value: one line, nothing started
    with path.open("rb") as f:
        section = tomllib.load(f).get("control", {})
    return {k: v for k, v in section.items() if k != "interval"}


def _print_summary(s: dict[str, Any]) -> None:
    click.echo("")
    rows = [
        ("control intervals (cap binding)", f"{s['intervals']} ({s['intervals_binding']})"),
        ("worst interval over budget", f"{s['max_power_over_budget_pct']:+.2f} %"),
        ("power error where binding, mean abs", f"{s['power_mae_binding_pct']:.2f} %"),
        ("budget changes applied", str(s["budget_changes_applied"])),
        (
            "jobs registered / finished (late)",
            f"{s['jobs_registered']} / {s['jobs_finished']} ({s['jobs_finished_late']})",
        ),
        ("running, predicted to miss", str(s["jobs_running_predicted_late"])),
        (
            "daemons stopped",
            f"{len(s['pids'])} ({s['processes_killed']} killed, {s['processes_left']} left)",
        ),
    ]
    click.echo(format_table(("summary (from the head's store)", "value"), rows))
    if s["plots"]:
        click.echo(
            "\npower.png: the cluster's GPU power against the budget, every interval; "
            "jobs.png: each job from start to finish (predicted while it runs) against its deadline"
        )
        click.echo(f"plots: {', '.join(s['plots'])}; store copy: {s['store_copy']}")
        click.echo(f"again later: cdgpc-admin report --store sqlite:///{s['store_copy']} --out DIR")
    if s["interrupted"]:
        click.echo("interrupted: every daemon was stopped")


def _in_process(
    *,
    jobs: int,
    intervals: int,
    interval_s: float,
    speed: float,
    budget_fraction: float,
    drop_to: float,
    seed: int,
    as_json: bool,
) -> None:
    """The controller alone on a synthetic fleet, in this process."""
    rng = np.random.default_rng(seed)
    # jobs of 10–90 minutes at top clocks, so that some finish during the run
    fleet = synthetic_fleet(jobs, rng, hours=(10 / 60, 1.5))
    p_max = fleet.max_power_w()
    loop = ClosedLoop(fleet, rng, ControllerSettings(interval_s=interval_s))
    change_at = intervals // 2
    if not as_json:
        click.echo(
            f"{jobs} jobs on {int(fleet.gpus.sum())} simulated GPUs "
            f"({', '.join(s.name for s in fleet.specs)}); top-clock power "
            f"{format_power(p_max)}; control interval {interval_s:g} s\n"
        )
        click.echo(_line(COLUMNS))
        click.echo(_line(tuple("-" * w for w in WIDTHS)))
    records: list[IntervalRecord] = []
    tally = _Tally()
    for k in range(intervals):
        fraction = budget_fraction if k < change_at else drop_to
        if k == change_at and not as_json:
            click.echo(f"-- admin: budget set {format_power(fraction * p_max)} --")
        deadlines = loop.fleet.deadline_s.copy()
        t_start = time.monotonic()
        record = loop.step(fraction * p_max)
        finished = deadlines[~np.isin(deadlines, loop.fleet.deadline_s)]
        tally.finished += record.finished
        tally.finished_late += int(np.sum(finished < record.t_s))
        records.append(record)
        if not as_json:
            click.echo(_line(_row(record, _at_risk(loop), tally.finished)))
            if speed > 0:
                time.sleep(max(0.0, interval_s / speed - (time.monotonic() - t_start)))
    summary = _summary(records, tally, loop, change_at)
    if as_json:
        echo_json(summary)
        return
    click.echo("")
    click.echo(
        format_table(
            ("summary", "value"),
            [
                ("intervals (cap binding)", f"{summary['intervals']} ({summary['binding']})"),
                ("power error where binding, mean abs", f"{summary['power_mae_pct']:.2f} %"),
                ("worst interval over budget", f"{summary['max_power_over_budget_pct']:+.2f} %"),
                ("jobs finished (after deadline)", f"{tally.finished} ({tally.finished_late})"),
                ("running, predicted to miss", str(summary["at_risk_at_end"])),
                ("controller step, median", f"{summary['controller_ms_p50']:.1f} ms"),
            ],
        )
    )


def _summary(
    records: list[IntervalRecord], tally: _Tally, loop: ClosedLoop, change_at: int
) -> dict[str, Any]:
    binding = [r for r in records[2:] if r.status is StepStatus.BINDING]
    errors = np.array([r.error_pct for r in binding]) if binding else np.zeros(1)
    return {
        "intervals": len(records),
        "binding": len(binding),
        "power_mae_pct": round(float(np.mean(np.abs(errors))), 4),
        "max_power_over_budget_pct": round(max(r.error_pct for r in records), 4),
        "budget_changes_applied": 1,
        "budget_change_interval": change_at,
        "jobs_registered": len(loop.fleet) + tally.finished,
        "jobs_finished": tally.finished,
        "jobs_finished_late": tally.finished_late,
        "at_risk_at_end": _at_risk(loop),
        "controller_ms_p50": round(float(np.median([1e3 * r.step_s for r in records])), 3),
    }
