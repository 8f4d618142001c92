"""``cdgpc-admin demo``: the control loop on a simulated cluster, live in the terminal.

Jobs with deadlines run on simulated GPUs (calibrated on real A100/H100/A40/V100 measurements);
every interval the controller learns from the last interval's measurements, prices the budget
and sets clocks. Half-way through, the admin lowers the budget. The table shows what an operator
would watch: power against the budget, the price of power, and how many jobs are predicted to
miss their deadline at the clocks they were given.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import click
import numpy as np

from slurm_cdgpc.cli.output import echo_json, format_table
from slurm_cdgpc.control.dual import StepStatus
from slurm_cdgpc.control.empc import ControllerSettings
from slurm_cdgpc.sim.closed_loop import ClosedLoop, IntervalRecord, synthetic_fleet
from slurm_cdgpc.units import format_power, parse_duration_s

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
@click.option("--jobs", type=click.IntRange(min=1), default=48, show_default=True)
@click.option("--intervals", type=click.IntRange(min=2), default=40, show_default=True)
@click.option("--interval", "interval", default="60s", show_default=True, help="Control interval.")
@click.option(
    "--speed",
    type=click.FloatRange(min=0.0),
    default=240.0,
    show_default=True,
    help="Simulated seconds per wall-clock second (0: as fast as possible).",
)
@click.option(
    "--budget-fraction",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=0.75,
    show_default=True,
    help="Budget as a fraction of the fleet's power at top clocks.",
)
@click.option(
    "--drop-to",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=0.6,
    show_default=True,
    help="The budget fraction the admin sets half-way through.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="No table: print the summary as JSON.")
def demo(
    jobs: int,
    intervals: int,
    interval: str,
    speed: float,
    budget_fraction: float,
    drop_to: float,
    seed: int,
    as_json: bool,
) -> None:
    """Run the controller on a simulated GPU cluster and watch it hold the budget."""
    interval_s = parse_duration_s(interval)
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
