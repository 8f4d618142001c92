"""``cdgpc-admin simulate``: replay a job trace on a simulated cluster under a power budget."""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import click
import numpy as np

from slurm_cdgpc.cli.output import echo_json, format_table, format_value
from slurm_cdgpc.cli.sweep import BACKENDS, run_sweep, run_sweep_cell
from slurm_cdgpc.config import ControlConfig, load_config
from slurm_cdgpc.errors import CdgpcError, InputError, one_line
from slurm_cdgpc.sim.cluster import SimulationResult, Simulator
from slurm_cdgpc.sim.fleet import (
    default_fleet,
    parse_budget_w,
    parse_fleet,
    parse_racks,
    with_domains,
)
from slurm_cdgpc.sim.metrics import PolicyRun, compute_metrics, run_policies
from slurm_cdgpc.sim.policies import POLICIES, READS_PLANT, make_policy
from slurm_cdgpc.sim.reporting import DEFAULT_TIME_LIMITS, SOURCES, ProgressMix, TimeLimitModel
from slurm_cdgpc.sim.serving import ARRIVALS_FILE, DEFAULT_MULTIPLE, Arrivals, Serving
from slurm_cdgpc.sim.sweep import parse_mixes
from slurm_cdgpc.sim.traces import WHOLE_GPU, load_trace
from slurm_cdgpc.sim.twin import HeadTwin
from slurm_cdgpc.topology import Topology, load_topology
from slurm_cdgpc.units import parse_duration_s

#: fast: the policy decides on the simulator's view; head: cdgpc through the head's interval
ENGINES = ("fast", "head")

_TABLE = (
    ("policy", "policy"),
    ("violations", "violations"),
    ("violations_induced", "induced"),
    ("dvr", "dvr"),
    ("power_mae_pct", "MAE %"),
    ("over_budget_intervals_pct", "over %"),
    ("max_overshoot_pct", "max over %"),
    ("domain_over_limit_intervals_pct", "domain over %"),
    ("energy_kwh", "kWh"),
    ("mean_jct_s", "mean JCT s"),
    ("controller_ms_p50", "ctl ms"),
)
#: columns shown when jobs serve
_SERVING_TABLE = (
    ("slo_attainment", "SLO met"),
    ("serving_energy_kwh", "serving kWh"),
    ("serving_mean_w", "serving W"),
    ("serving_clock_fraction", "serving clock"),
)


@click.command("simulate")
@click.option(
    "--trace",
    "trace_paths",
    required=True,
    multiple=True,
    type=click.Path(dir_okay=False),
    help="Trace file (with --sweep: repeat for several).",
)
@click.option("--format", "trace_format", default=None, help="Trace format (default: detect).")
@click.option("--fleet", "fleet_text", default=None, help="e.g. 64x8:A100-SXM4-80GB,32x8:V100-SXM2")
@click.option(
    "--budget",
    default="0.7",
    show_default=True,
    help="Fraction (0.6) or power (450kW); with --sweep a list (0.6,0.7,450kW).",
)
@click.option(
    "--policy",
    default="cdgpc",
    show_default=True,
    help=f"{', '.join(POLICIES)} or all; with --sweep a list.",
)
@click.option("--interval", default="60s", show_default=True, help="Control interval.")
@click.option("--seed", default="0", show_default=True, help="With --sweep a list: 0,3,5-9.")
@click.option(
    "--progress-share",
    default=None,
    help="Share P of jobs that report steps and total; the others report nothing, only their "
    "time limit is known: --progress-mix reported=P,time-limit=1-P. With --sweep a list, each "
    "in (0, 1].",
)
@click.option(
    "--progress-mix",
    "progress_mixes",
    multiple=True,
    help=f"Shares of jobs per progress source ({', '.join(SOURCES)}), e.g. "
    "reported=0.2,steps=0.6,time-limit=0.2,none=0 (absent: 0; they sum to 1), or realistic "
    "(those shares, an assumption: slurm_cdgpc.sim.reporting) [default: all reported]. "
    "With --sweep, repeat for several.",
)
@click.option(
    "--time-limit-model",
    default=str(DEFAULT_TIME_LIMITS),
    show_default=True,
    help="Slurm time limits: uniform:LOW:HIGH × the run time at top clocks, rounded up to "
    "minutes (a trace's own limits win); a job still running at its limit is killed. none: no "
    "limits (replays as before the simulator modelled them).",
)
@click.option("--limit-jobs", type=click.IntRange(min=1), default=None, help="First N jobs only.")
@click.option(
    "--last-jobs",
    type=click.IntRange(min=1),
    default=None,
    help="Last N jobs only (by submission), e.g. where Alibaba's pods crowd. Not with "
    "--limit-jobs or --sweep.",
)
@click.option(
    "--whole-gpus",
    is_flag=True,
    help="Every job on whole GPUs: a pod that asks for part of one gets all of it (what if the "
    "site stopped sharing GPUs).",
)
@click.option(
    "--mig",
    is_flag=True,
    help="Every GPU in MIG mode: a pod that asks for part of one gets the smallest A100 "
    "instance with its share, running at that slice's measured speed; no clock can be "
    "locked, so only power limits act (slurm_cdgpc.sim.mig).",
)
@click.option(
    "--racks",
    default=None,
    help="Power domains: racks of K consecutive nodes (the last holds what is left), each "
    "limited to F × its GPUs' highest power limits, as K:F (e.g. 4:0.75).",
)
@click.option(
    "--topology",
    "topology_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="Power domains from a site's topology TOML (daemon/topology.toml's format) whose "
    "nodes are the simulator's: node0001, node0002, ... in --fleet order. Not with --racks.",
)
@click.option(
    "--serving",
    default=None,
    metavar="N[:MULTIPLE]",
    help="Add N serving jobs, one A100 each, on nodes added after the fleet's (the budget "
    "fraction counts them), loaded from the Azure LLM inference trace; each one's p99 latency "
    f"objective is MULTIPLE × its top-clock latency at its peak load [{DEFAULT_MULTIPLE}]. "
    "Not with the oracle or --engine head.",
)
@click.option(
    "--serving-arrivals",
    default=None,
    type=click.Path(dir_okay=False, exists=True),
    help=f"--serving: the arrivals CSV [default: $CDGPC_DATA_DIR/{ARRIVALS_FILE}].",
)
@click.option(
    "--engine",
    type=click.Choice(ENGINES),
    default="fast",
    show_default=True,
    help="fast: the policy on the simulator's view; head: cdgpc through the real head "
    "(store, exchange with node agents), slower.",
)
@click.option(
    "--config",
    "config_path",
    default=None,
    type=click.Path(dir_okay=False, exists=True),
    help="A cdgpc.toml whose [control] section cdgpc runs with, as cdgpcd would "
    "[default: the shipped settings].",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
@click.option("--report", "report_dir", default=None, type=click.Path(file_okay=False))
@click.option(
    "--sweep",
    "sweep_dir",
    default=None,
    type=click.Path(file_okay=False),
    help="Replay every combination of the lists, resumably, keeping each cell in this directory.",
)
@click.option(
    "--backend",
    type=click.Choice(BACKENDS),
    default="local",
    show_default=True,
    help="--sweep: a local process pool, or a Slurm job array.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="--sweep, local: processes [default: CPUs].",
)
@click.option(
    "--cells-per-task",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="--sweep, slurm: cells per array task.",
)
@click.option(
    "--sbatch-arg",
    "sbatch_args",
    multiple=True,
    help="--sweep, slurm: an sbatch option (repeat), e.g. --sbatch-arg=--partition=cpu.",
)
@click.option("--wait", is_flag=True, help="--sweep, slurm: wait for the array, print the table.")
@click.option(
    "--sweep-cell",
    nargs=2,
    hidden=True,
    is_eager=True,
    expose_value=False,
    callback=run_sweep_cell,
    help="OUTDIR I,J: run these cells of a sweep here (a job array task).",
)
def simulate(
    trace_paths: tuple[str, ...],
    trace_format: str | None,
    fleet_text: str | None,
    budget: str,
    policy: str,
    interval: str,
    seed: str,
    progress_share: str | None,
    progress_mixes: tuple[str, ...],
    time_limit_model: str,
    limit_jobs: int | None,
    last_jobs: int | None,
    whole_gpus: bool,
    mig: bool,
    racks: str | None,
    topology_path: str | None,
    serving: str | None,
    serving_arrivals: str | None,
    engine: str,
    config_path: str | None,
    as_json: bool,
    report_dir: str | None,
    sweep_dir: str | None,
    backend: str,
    workers: int | None,
    cells_per_task: int,
    sbatch_args: tuple[str, ...],
    wait: bool,
) -> None:
    """Replay a job trace on a simulated GPU cluster under a power budget.

    Jobs are placed strict-FIFO first-fit on whole GPUs, and pods that ask for part of one
    (Alibaba's gpu_milli) share GPUs; every interval the policy sets clocks or power limits
    from what it measured; the calibrated plant says what the GPUs do. The default fleet covers
    the trace's 90th-percentile concurrent demand with 8-GPU A100 nodes. peak_demand_w in the
    metrics is the most the jobs would have drawn at top clocks: max-clock's is the fleet's
    peak draw, to set a budget against.

    With --sweep OUTDIR, every combination of the traces, budgets, policies, seeds and progress
    mixes (or shares) is one replay (a cell) whose metrics land in OUTDIR/cells; cells already
    there are not run again, and the table aggregates each trace, budget, mix and policy over
    seeds. The time-limit model is one per sweep.

    With --engine head, cdgpc runs through the head's own interval (cdgpcd's code, a SQLite
    store, node agents answered from the simulator): a digital twin of the product.

    With --racks or --topology, every power domain's limit holds too, and the metrics add
    how often and how far the worst domain's true power went over its limit.

    With --serving, the metrics add the share of serving-job intervals that met their
    objective (slo_attainment), the serving GPUs' energy and mean power, and their mean clock
    over the top; cdgpc-serving-top is cdgpc with the serving jobs left at their top clocks.
    """
    try:
        if racks is not None and topology_path is not None:
            raise InputError("give --racks or --topology, not both")
        if racks is not None:
            parse_racks(racks)
        if serving is None and serving_arrivals is not None:
            raise InputError("--serving-arrivals needs --serving")
        if last_jobs is not None and limit_jobs is not None:
            raise InputError("give --limit-jobs or --last-jobs, not both")
        if sweep_dir is not None:
            if last_jobs is not None or whole_gpus or mig:
                raise InputError(
                    "--last-jobs, --whole-gpus and --mig are for one replay: not with --sweep"
                )
            if engine != "fast":
                raise InputError("--engine head replays one trace: not with --sweep")
            if config_path is not None:
                raise InputError("--config is for one replay; a --sweep runs the shipped settings")
            if report_dir is not None:
                raise InputError("--report draws one replay; a --sweep has many")
            run_sweep(
                sweep_dir,
                trace_paths,
                trace_format=trace_format,
                fleet_text=fleet_text,
                budget=budget,
                policy=policy,
                interval=interval,
                seed=seed,
                progress_share=progress_share,
                progress_mixes=progress_mixes,
                time_limit_model=time_limit_model,
                limit_jobs=limit_jobs,
                racks=racks,
                topology_path=topology_path,
                serving=serving,
                serving_arrivals=serving_arrivals,
                as_json=as_json,
                backend=backend,
                workers=workers,
                cells_per_task=cells_per_task,
                sbatch_args=sbatch_args,
                wait=wait,
            )
            return
        if backend != "local" or workers is not None or cells_per_task != 1 or sbatch_args or wait:
            raise InputError(
                "--backend, --workers, --cells-per-task, --sbatch-arg and --wait need --sweep"
            )
        if len(trace_paths) > 1:
            raise InputError("more than one --trace needs --sweep OUTDIR")
        for name, text in (
            ("--budget", budget),
            ("--policy", policy),
            ("--seed", seed),
            ("--progress-share", progress_share or ""),
        ):
            if "," in text:
                raise InputError(f"{name} {text!r}: a list needs --sweep OUTDIR")
        if len(progress_mixes) > 1:
            raise InputError("more than one --progress-mix needs --sweep OUTDIR")
        [mix] = (
            parse_mixes(progress_share, progress_mixes)
            if progress_share is None or progress_mixes
            else [ProgressMix.of_share(_one_share(progress_share))]
        )
        _simulate(
            trace_paths[0],
            trace_format,
            fleet_text,
            budget,
            policy,
            interval,
            _one_seed(seed),
            mix,
            TimeLimitModel.parse(time_limit_model),
            limit_jobs,
            last_jobs,
            whole_gpus,
            mig,
            racks,
            None if topology_path is None else load_topology(Path(topology_path)),
            None
            if serving is None
            else Serving(*Serving.parse(serving), Arrivals.load(Arrivals.path(serving_arrivals))),
            engine,
            None if config_path is None else load_config(Path(config_path), env={}).control,
            as_json,
            report_dir,
        )
    except CdgpcError as e:
        if os.environ.get("CDGPC_DEBUG") == "1":
            raise
        raise click.ClickException(
            one_line(e, 1000, keep="first", empty=type(e).__name__)
        ) from None


def _one_seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InputError(f"seed {text!r} is not an integer (ranges need --sweep OUTDIR)") from None


def _one_share(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise InputError(f"progress share {text!r} is not a number") from None


def _without_plant_readers(names: list[str], policy: str, why: str) -> list[str]:
    """``names`` less the policies that read the plant (but max-clock, which only runs it);
    ``policy`` itself being one of them is refused, ``why`` saying why."""
    if policy != "max-clock" and policy in READS_PLANT:  # ("all" is none of them)
        raise InputError(f"--policy {policy} {why}")
    return [p for p in names if p == "max-clock" or p not in READS_PLANT]


def _simulate(
    trace_path: str,
    trace_format: str | None,
    fleet_text: str | None,
    budget: str,
    policy: str,
    interval: str,
    seed: int,
    mix: ProgressMix,
    time_limits: TimeLimitModel,
    limit_jobs: int | None,
    last_jobs: int | None,
    whole_gpus: bool,
    mig: bool,
    racks: str | None,
    topology: Topology | None,
    serving: Serving | None,
    engine: str,
    control: ControlConfig | None,
    as_json: bool,
    report_dir: str | None,
) -> None:
    names = list(POLICIES) if policy == "all" else [policy]
    if policy != "all" and policy not in POLICIES:
        raise InputError(f"unknown policy {policy!r} (known: {', '.join(POLICIES)}, all)")
    if engine == "head" and policy != "cdgpc":
        raise InputError(f"--engine head runs cdgpc only, not --policy {policy}")
    if serving is not None:
        if engine == "head":
            raise InputError("--engine head does not replay serving jobs")
        names = _without_plant_readers(
            names, policy, "reads the training plant: not with --serving"
        )
    interval_s = parse_duration_s(interval)
    fleet = parse_fleet(fleet_text) if fleet_text is not None else None
    trace = load_trace(trace_path, trace_format)
    if limit_jobs is not None:
        trace = trace.head(limit_jobs)
    if last_jobs is not None:
        trace = trace.select(np.arange(len(trace)) >= len(trace) - last_jobs)
    if len(trace) == 0:
        raise InputError(f"{trace_path}: no jobs to replay")
    if whole_gpus:
        trace = replace(trace, gpu_milli=np.full(len(trace), WHOLE_GPU))
    if np.any(trace.gpu_milli < WHOLE_GPU):  # jobs share GPUs: the plant is per whole GPU
        names = _without_plant_readers(
            names, policy, "reads the plant of whole GPUs: not with shared ones"
        )
    if mig:
        names = _without_plant_readers(names, policy, "locks clocks: not with --mig")
    fleet = fleet or default_fleet(trace)
    fleet = with_domains(fleet if serving is None else serving.fleet(fleet), racks, topology)
    budget_w = parse_budget_w(budget, fleet)
    simulator = Simulator(
        trace,
        fleet,
        budget_w,
        interval_s=interval_s,
        seed=seed,
        progress_mix=mix,
        time_limits=time_limits,
        serving=serving,
        mig=mig,
    )
    show = not as_json or sys.stderr.isatty()
    replays = 2 if engine == "head" else len(names) + (0 if "max-clock" in names else 1)
    with click.progressbar(
        length=replays * len(trace), label="simulating", file=sys.stderr if show else io.StringIO()
    ) as bar:
        last: dict[str, int] = {}

        def tick(name: str, done: int) -> None:
            bar.update(done - last.get(name, 0))
            last[name] = done

        runs = (
            _replay_head(simulator, tick, control)
            if engine == "head"
            else run_policies(simulator, names, tick, control)
        )
    meta = {
        "trace": os.path.basename(trace_path),
        "jobs": len(trace),
        "fleet": str(fleet),
        "budget_w": budget_w,
        "interval_s": interval_s,
        "seed": seed,
        "progress_share": mix.share,
        "progress_mix": str(mix),
        "time_limit_model": str(time_limits),
        **({} if racks is None else {"racks": racks}),
        **({} if topology is None else {"domains": len(topology)}),
        **({} if serving is None else {"serving": f"{serving.jobs}:{serving.multiple:g}"}),
    }
    if report_dir is not None:
        from slurm_cdgpc.sim.report import write_report  # noqa: PLC0415 (matplotlib is optional)

        for path in write_report(report_dir, runs, meta):
            click.echo(f"wrote {path}", err=True)
    _print(runs, as_json, policy == "all", engine)


def _replay_head(
    simulator: Simulator, tick: Callable[[str, int], None], control: ControlConfig | None
) -> dict[str, PolicyRun]:
    """The max-clock reference on the simulator, then cdgpc through the head (`HeadTwin`)."""
    reference = simulator.run(make_policy("max-clock"), lambda done: tick("max-clock", done))
    with HeadTwin(control=control) as twin:
        result = simulator.run(twin, lambda done: tick(twin.name, done))
    metrics = compute_metrics(result, reference)
    errors = twin.time_errors.summary()
    if errors is not None:
        metrics = replace(metrics, time_model_error_pct=errors)
    return {twin.name: PolicyRun(result, metrics)}


def _intervals_per_s(result: SimulationResult) -> float:
    """Simulated intervals per second of the replay's wall time."""
    return result.t_s.size / result.wall_s if result.wall_s > 0 else 0.0


def _print(runs: dict[str, PolicyRun], as_json: bool, keyed: bool, engine: str = "fast") -> None:
    def record(r: PolicyRun) -> dict[str, object]:
        out = r.metrics.as_dict()
        if engine == "head":  # the fast engine's JSON stays what sweeps compare cell by cell
            out.update(engine=engine, intervals_per_s=_intervals_per_s(r.result))
        return out

    if as_json:
        if keyed:
            echo_json({k: record(r) for k, r in runs.items()})
        else:
            echo_json(record(next(iter(runs.values()))))
        return
    columns = [
        (k, h)
        for k, h in _TABLE
        if k != "domain_over_limit_intervals_pct" or any(r.metrics.domains for r in runs.values())
    ]
    if any(r.metrics.serving_jobs for r in runs.values()):
        columns += _SERVING_TABLE
    rows = [[format_value(r.metrics.as_dict()[k]) for k, _ in columns] for r in runs.values()]
    click.echo(format_table([h for _, h in columns], rows))
    if engine == "head":
        for r in runs.values():
            click.echo(
                f"head engine: {r.result.t_s.size} intervals in {r.result.wall_s:.1f} s "
                f"({_intervals_per_s(r.result):.1f} intervals/s)"
            )
