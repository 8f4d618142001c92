"""``cdgpc-admin simulate``: replay a job trace on a simulated cluster under a power budget."""

from __future__ import annotations

import io
import os
import sys
from typing import Any

import click

from slurm_cdgpc.cli.output import echo_json, format_table
from slurm_cdgpc.errors import CdgpcError, InputError
from slurm_cdgpc.sim.cluster import Simulator
from slurm_cdgpc.sim.fleet import FleetSpec, default_fleet, parse_fleet
from slurm_cdgpc.sim.metrics import PolicyRun, run_policies
from slurm_cdgpc.sim.policies import POLICIES
from slurm_cdgpc.sim.traces import load_trace
from slurm_cdgpc.units import parse_duration_s, parse_power_w

_TABLE = (
    ("policy", "policy"),
    ("violations", "violations"),
    ("violations_induced", "induced"),
    ("dvr", "dvr"),
    ("power_mae_pct", "MAE %"),
    ("over_budget_intervals_pct", "over %"),
    ("max_overshoot_pct", "max over %"),
    ("energy_kwh", "kWh"),
    ("mean_jct_s", "mean JCT s"),
    ("controller_ms_p50", "ctl ms"),
)


def parse_budget_w(text: str, fleet: FleetSpec) -> float:
    """``0.6`` → 0.6 × the fleet's Σ max power limit; ``450kW`` → 450,000 W."""
    try:
        fraction = float(text)
    except ValueError:
        return parse_power_w(text)
    if not 0.0 < fraction <= 1.0:
        raise InputError(
            f"budget {text!r}: a bare number is a fraction of the fleet's maximum power in "
            "(0, 1]; give watts with a unit (e.g. 450kW)"
        )
    return fraction * fleet.max_power_w


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


@click.command("simulate")
@click.option("--trace", "trace_path", required=True, type=click.Path(dir_okay=False))
@click.option("--format", "trace_format", default=None, help="Trace format (default: detect).")
@click.option("--fleet", "fleet_text", default=None, help="e.g. 64x8:A100-SXM4-80GB,32x8:V100-SXM2")
@click.option("--budget", default="0.7", show_default=True, help="Fraction (0.6) or power (450kW).")
@click.option("--policy", default="cdgpc", show_default=True, help=f"{', '.join(POLICIES)} or all.")
@click.option("--interval", default="60s", show_default=True, help="Control interval.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--limit-jobs", type=click.IntRange(min=1), default=None, help="First N jobs only.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
@click.option("--report", "report_dir", default=None, type=click.Path(file_okay=False))
def simulate(
    trace_path: str,
    trace_format: str | None,
    fleet_text: str | None,
    budget: str,
    policy: str,
    interval: str,
    seed: int,
    limit_jobs: int | None,
    as_json: bool,
    report_dir: str | None,
) -> None:
    """Replay a job trace on a simulated GPU cluster under a power budget.

    Jobs are placed strict-FIFO first-fit on whole GPUs; every interval the policy sets clocks
    or power limits from what it measured; the calibrated plant says what the GPUs do. The
    default fleet covers the trace's 90th-percentile concurrent demand with 8-GPU A100 nodes.
    """
    try:
        _simulate(
            trace_path,
            trace_format,
            fleet_text,
            budget,
            policy,
            interval,
            seed,
            limit_jobs,
            as_json,
            report_dir,
        )
    except CdgpcError as e:
        if os.environ.get("CDGPC_DEBUG") == "1":
            raise
        lines = str(e).strip().splitlines() or [type(e).__name__]
        raise click.ClickException(lines[0]) from None


def _simulate(
    trace_path: str,
    trace_format: str | None,
    fleet_text: str | None,
    budget: str,
    policy: str,
    interval: str,
    seed: int,
    limit_jobs: int | None,
    as_json: bool,
    report_dir: str | None,
) -> None:
    names = list(POLICIES) if policy == "all" else [policy]
    if policy != "all" and policy not in POLICIES:
        raise InputError(f"unknown policy {policy!r} (known: {', '.join(POLICIES)}, all)")
    interval_s = parse_duration_s(interval)
    fleet = parse_fleet(fleet_text) if fleet_text is not None else None
    trace = load_trace(trace_path, trace_format)
    if limit_jobs is not None:
        trace = trace.head(limit_jobs)
    if len(trace) == 0:
        raise InputError(f"{trace_path}: no jobs to replay")
    fleet = fleet or default_fleet(trace)
    budget_w = parse_budget_w(budget, fleet)
    simulator = Simulator(trace, fleet, budget_w, interval_s=interval_s, seed=seed)
    show = not as_json or sys.stderr.isatty()
    replays = len(names) + (0 if "max-clock" in names else 1)
    with click.progressbar(
        length=replays * len(trace), label="simulating", file=sys.stderr if show else io.StringIO()
    ) as bar:
        last: dict[str, int] = {}

        def tick(name: str, done: int) -> None:
            bar.update(done - last.get(name, 0))
            last[name] = done

        runs = run_policies(simulator, names, tick)
    meta = {
        "trace": os.path.basename(trace_path),
        "jobs": len(trace),
        "fleet": str(fleet),
        "budget_w": budget_w,
        "interval_s": interval_s,
        "seed": seed,
    }
    if report_dir is not None:
        from slurm_cdgpc.sim.report import write_report  # noqa: PLC0415 (matplotlib is optional)

        for path in write_report(report_dir, runs, meta):
            click.echo(f"wrote {path}", err=True)
    _print(runs, as_json, policy == "all")


def _print(runs: dict[str, PolicyRun], as_json: bool, keyed: bool) -> None:
    if as_json:
        if keyed:
            echo_json({k: r.metrics.as_dict() for k, r in runs.items()})
        else:
            echo_json(next(iter(runs.values())).metrics.as_dict())
        return
    rows = [[_fmt(r.metrics.as_dict()[k]) for k, _ in _TABLE] for r in runs.values()]
    click.echo(format_table([h for _, h in _TABLE], rows))
