"""Admin commands of ``cdgpc-admin``: budget set|show (the budget and the power domains' limits),
status, jobs, nodes, db upgrade, report.

All but ``db upgrade`` and ``report`` talk to cdgpcd at ``head.url`` over HTTP, signed per
``auth.method`` (MUNGE: who you are is your uid; HMAC: the root-only key, so run them as root).
``db upgrade`` and ``report`` open the store directly (``store.url``, or ``report --store``).
Every read command takes ``--json`` (one JSON object on stdout).

Shell completion is click's own: ``eval "$(_CDGPC_ADMIN_COMPLETE=bash_source cdgpc-admin)"`` in
``~/.bashrc`` (``zsh_source`` and ``fish_source`` for those shells).
"""

from __future__ import annotations

import datetime as dt
import re
import time
from pathlib import Path
from typing import Any

import click

from slurm_cdgpc.cli.output import echo_json, format_table
from slurm_cdgpc.config import Config, load_config
from slurm_cdgpc.doctor import run_checks
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.slurm.comment import parse_deadline
from slurm_cdgpc.transport.credentials import signer_from_config
from slurm_cdgpc.transport.http import HeadClient
from slurm_cdgpc.units import format_power, parse_power_w, span_s

_config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="configuration file (default: CDGPC_CONFIG or /etc/cdgpc/cdgpc.toml)",
)
_json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")


def _config(path: Path | None) -> Config:
    return load_config(path)


def _client(config: Config) -> HeadClient:

    return HeadClient(config.head.url, signer_from_config(config))


def parse_time_s(text: str, now_s: float | None = None) -> float:
    """``+2h`` (from now), epoch seconds, or an ISO 8601 time (local time if no zone): the forms
    of a job's deadline (`slurm_cdgpc.slurm.comment.parse_deadline`)."""
    now = time.time() if now_s is None else now_s
    try:
        return parse_deadline(text.strip()).resolve(now)
    except InputError:
        raise InputError(
            f"cannot read time {text!r}: use +2h, epoch seconds or 2026-07-01T08:00"
        ) from None


def _when(epoch_s: float | None) -> str:
    if epoch_s is None:
        return "-"
    return dt.datetime.fromtimestamp(epoch_s).astimezone().isoformat(timespec="seconds")


def _power(watts: float | None) -> str:
    return "-" if watts is None else format_power(watts)


@click.group()
def budget() -> None:
    """Show or change the cluster's GPU power budget and its power domains' limits."""


#: a negative number, with its unit if any
_SIGNED = re.compile(r"-[0-9.].*")


class _SignedArgument(click.Command):
    """A command whose argument may start with a minus (``budget set -5W``): it reaches the
    argument's parser, which names it, instead of being taken for an unknown option ``-5``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        takes_value = {
            opt
            for p in self.params
            if isinstance(p, click.Option) and not p.is_flag
            for opt in p.opts
        }
        kept: list[str] = []
        signed: list[str] = []
        tokens = iter(args)
        for token in tokens:
            if token == "--":
                kept += [token, *tokens]
            elif token in takes_value:  # its value is the option's, whatever its sign
                kept += [token, *([] if (value := next(tokens, None)) is None else [value])]
            elif _SIGNED.fullmatch(token):
                signed.append(token)
            else:
                kept.append(token)
        if signed:
            kept = [*kept, *([] if "--" in kept else ["--"]), *signed]
        return super().parse_args(ctx, kept)


@budget.command("set", cls=_SignedArgument)
@click.argument("power")
@click.option("--at", "at", default=None, help="when it takes effect: +2h, epoch s, ISO time")
@click.option("--reason", default="", help="recorded in the audit trail")
@click.option(
    "--domain",
    metavar="NAME",
    default=None,
    help="set this power domain's limit (a rack, a row of head.topology), not the budget",
)
@_config_option
@_json_option
def budget_set(
    power: str,
    at: str | None,
    reason: str,
    domain: str | None,
    config_path: Path | None,
    as_json: bool,
) -> None:
    """Set the budget, or a power domain's limit (--domain), to POWER (450kW, 1.2MW, 300W), now
    or --at a time. The head refuses a domain that is not in its topology, and a limit above
    its parent's in force or below a child's."""
    budget_w = parse_power_w(power)
    payload: dict[str, Any] = {"budget_w": budget_w, "reason": reason}
    if at is not None:
        payload["effective_at_s"] = parse_time_s(at)
    if domain is not None:
        payload["domain"] = domain
    change = _client(_config(config_path)).post("/v1/budget", payload)
    if as_json:
        echo_json(change)
        return
    what = "budget" if change.get("domain") is None else f"domain {change['domain']}: limit"
    click.echo(
        f"{what} {format_power(change['budget_w'])} from {_when(change['effective_at_s'])}"
        f" (set by {change['set_by']})"
    )


def _domain_lines(domain: dict[str, Any]) -> list[str]:
    """A power domain's limit in force and where it comes from, then its scheduled changes."""
    name, change = domain["name"], domain.get("set")
    if change is None:
        source = "topology file"
    else:
        source = f"set by {change['set_by']} from {_when(change['effective_at_s'])}"
        source += f": {change['reason']}" if change["reason"] else ""
    lines = [f"domain {name}: limit {format_power(domain['limit_w'])} ({source})"]
    for later in domain.get("scheduled", []):
        lines.append(
            f"domain {name}: limit {format_power(later['budget_w'])} from "
            f"{_when(later['effective_at_s'])} (scheduled by {later['set_by']}"
            + (f": {later['reason']})" if later["reason"] else ")")
        )
    return lines


@budget.command("show")
@_config_option
@_json_option
def budget_show(config_path: Path | None, as_json: bool) -> None:
    """The budget in force, scheduled changes, recent history, and each power domain's limit in
    force, where it comes from and its scheduled changes."""
    data = _client(_config(config_path)).get("/v1/budget")
    if as_json:
        echo_json(data)
        return
    current = data["current"]
    click.echo("budget: " + ("uncapped" if current is None else format_power(current["budget_w"])))
    for d in data.get("domains", []):
        for line in _domain_lines(d):
            click.echo(line)
    rows = [
        [_when(b["effective_at_s"]), format_power(b["budget_w"]), b["set_by"], b["reason"] or "-"]
        for b in data["history"]
    ]
    if rows:
        click.echo(format_table(["effective", "budget", "set by", "reason"], rows))


@click.command()
@_config_option
@_json_option
def status(config_path: Path | None, as_json: bool) -> None:
    """Budget, power, price and the last control interval, and each power domain's."""
    data = _client(_config(config_path)).get("/v1/status")
    if as_json:
        echo_json(data)
        return
    last = data["last_interval"] or {}
    click.echo(f"budget:       {_power(data['budget_w'])}")
    click.echo(f"measured:     {_power(last.get('measured_power_w'))}")
    click.echo(f"predicted:    {_power(last.get('predicted_power_w'))}")
    click.echo(f"uncontrolled: {_power(last.get('uncontrolled_w'))}")
    guard = last.get("guard_band")
    click.echo(f"guard band:   {'-' if guard is None else f'{100 * guard:.2f} % of the budget'}")
    offset = last.get("offset")
    click.echo(
        f"plan offset:  {'-' if offset is None else f'{100 * offset:+.2f} %'}"
        " (what settled jobs drew over their plans; scales the next plan)"
    )
    click.echo(f"price:        {last.get('price', '-')}")
    click.echo(f"status:       {last.get('status', '-')}{' (shadow)' if data['shadow'] else ''}")
    click.echo(
        f"interval:     {last.get('interval', '-')} at {_when(last.get('time_s'))}, "
        f"{last.get('jobs_controlled', 0)} job(s) controlled, "
        f"{last.get('nodes_reachable', 0)} node(s) reachable, "
        f"{last.get('nodes_unreachable', 0)} unreachable"
    )
    for d in last.get("domains", []):
        click.echo(
            f"domain {d['name']}: limit {format_power(d['limit_w'])}, "
            f"planned {format_power(d['planned_w'])}, measured {format_power(d['measured_w'])}"
        )
    for line in last.get("limited", []):
        click.echo(f"held by another limiter: {line}")
    cut = data.get("last_emergency_cut")
    if cut:
        click.echo(
            f"last emergency cut: {', '.join(cut['over'])} over its limit at "
            f"{_when(cut['time_s'])}, {len(cut['jobs'])} job(s) to their lowest clocks"
        )


@click.command()
@_config_option
@_json_option
def jobs(config_path: Path | None, as_json: bool) -> None:
    """Active jobs: clocks, power, progress, predicted finish against the deadline.

    \b
    progress: reported (the job sends its steps) or none
    work:     where its total comes from: comment (iters=), framework (a callback's total),
              time-limit (an upper bound from its Slurm time limit: an estimate) or none
    finish:   when it ends at the clocks just decided (~: from the time-limit estimate)
    shares:   the jobs on the same GPUs (shards, MPS, MIG): one clock for all of them, and
              measured power splits a shared GPU equally
    serving:  a serving job (slo=): met, missed, unmet (missed at the top clock), gave-way (to
              the budget) or waiting, its last latency against its objective, its clock floor
    """
    data = _client(_config(config_path)).get("/v1/jobs")
    if as_json:
        echo_json(data)
        return
    rows = [
        [
            j["job_id"],
            j["user"],
            j["state"],
            len(j["gpus"]),
            j["graphics_mhz"] or "-",
            _power(j["predicted_power_w"]),
            _power(j["measured_power_w"]),
            j.get("progress", "-"),
            f"{j['iterations_done']}/{j['iterations_total'] or '?'} {j.get('work', '-')}",
            ("~" if j.get("work") == "time-limit" else "") + _when(j.get("finish_s")),
            _when(j["deadline_s"]),
            ",".join(j.get("shares_with") or ()) or "-",
            _serving(j),
        ]
        for j in data["jobs"]
    ]
    headers = [
        "job",
        "user",
        "state",
        "GPUs",
        "MHz",
        "predicted",
        "measured",
        "progress",
        "work",
        "finish",
        "deadline",
        "shares",
        "serving",
    ]
    click.echo(format_table(headers, rows) if rows else "no active jobs")


def _serving(job: dict[str, Any]) -> str:
    """``met 212/250 ms, floor 885`` for a serving job, else ``-``."""
    serving, slo = job.get("serving"), job.get("slo")
    if not serving or not slo:
        return "-"
    latency = serving["latency_s"]
    seen = "?" if latency is None else f"{1e3 * latency:.0f}"
    floor = serving["floor_mhz"]
    return f"{serving['state']} {seen}/{1e3 * slo['latency_s']:.0f} ms, floor {floor or '-'}"


@click.command()
@_config_option
@_json_option
def nodes(config_path: Path | None, as_json: bool) -> None:
    """Known nodes, their agents and whether the head reaches them; each GPU's board, whether
    it is controlled (through its clocks, or its power limit for a GPU in MIG mode; if not,
    why) and its jobs (more than one: its tenants, at one setting)."""
    data = _client(_config(config_path)).get("/v1/nodes")
    if as_json:
        echo_json(data)
        return
    rows = [
        [
            n["name"],
            "yes" if n["reachable"] else "no",
            n["gpu_count"],
            n["gpu_type"] or "-",
            _power(n["worst_case_power_w"]),
            _when(n["last_seen_s"]),
            n["url"],
        ]
        for n in data["nodes"]
    ]
    headers = ["node", "reachable", "GPUs", "type", "worst case", "last seen", "agent"]
    click.echo(format_table(headers, rows) if rows else "no nodes known yet")
    gpus = [
        [
            n["name"],
            g["index"],
            g["board"],
            (g["type"] or "-") + (" (estimated prior)" if g["estimated"] else ""),
            _controlled(g),
            ",".join(g.get("jobs") or ()) or "-",
        ]
        for n in data["nodes"]
        for g in n.get("gpus", [])
    ]
    if gpus:
        click.echo()
        click.echo(format_table(["node", "GPU", "board", "type", "controlled", "jobs"], gpus))


def _controlled(gpu: dict[str, Any]) -> str:
    """A GPU's "controlled" cell: how, or why not (an older head names no lever)."""
    if not gpu["controlled"]:
        return f"no: {gpu['why']}"
    return "yes, by its power limit" if gpu.get("lever") == "power limit" else "yes"


@click.group()
def db() -> None:
    """The head's database."""


@db.command("upgrade")
@_config_option
def db_upgrade(config_path: Path | None) -> None:
    """Create the schema or apply pending migrations (store.url)."""
    from slurm_cdgpc.store import current_version, make_engine, upgrade  # noqa: PLC0415

    engine = make_engine(_config(config_path).store.url)
    try:
        applied = upgrade(engine)
        version = current_version(engine)
    finally:
        engine.dispose()
    if applied:
        click.echo(f"applied migration(s) {', '.join(map(str, applied))}; schema at {version}")
    else:
        click.echo(f"schema up to date at version {version}")


def parse_since_s(text: str, now_s: float | None = None) -> float:
    """``2h`` (that long ago: a span, `slurm_cdgpc.units`), epoch seconds, or an ISO 8601 time."""
    now = time.time() if now_s is None else now_s
    ago_s = span_s(text.strip())
    return parse_time_s(text, now) if ago_s is None else now - ago_s


@click.command()
@click.option("--since", default=None, help="from when: 2h (that long ago), epoch s or ISO time")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="directory for power.png, jobs.png and, with power domains, domains.png",
)
@click.option("--store", "store_url", default=None, help="database URL (default: store.url)")
@click.option(
    "--topology",
    "topology_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="power-domain topology file (default: head.topology)",
)
@_config_option
@_json_option
def report(
    since: str | None,
    out_dir: Path,
    store_url: str | None,
    topology_path: Path | None,
    config_path: Path | None,
    as_json: bool,
) -> None:
    """Plot power against the budget and each job's finish against its deadline (PNG).

    Read from the head's store (the decisions audit trail, the measurements, the jobs), so run
    it where the database is reachable. Prints the run's figures too. With a topology
    (--topology or head.topology), also each power domain's: its limit in force per interval
    (an admin's change, else the file's), its planned power (the setpoints' share under it,
    without the power outside the plan) and its measured power, in domains.png and one line
    per domain.
    """
    from slurm_cdgpc.demo.report import RunData, summarize, write_plots  # noqa: PLC0415
    from slurm_cdgpc.store import Store, make_engine  # noqa: PLC0415
    from slurm_cdgpc.topology import load_topology  # noqa: PLC0415

    since_s = None if since is None else parse_since_s(since)
    config = None if store_url and topology_path else _config(config_path)
    url = store_url or (config.store.url if config else "")
    topology_path = topology_path or (config.head.topology if config else None)
    topology = None if topology_path is None else load_topology(topology_path)
    engine = make_engine(url)
    try:
        data = RunData.load(Store(engine), since_s, topology)
    finally:
        engine.dispose()
    plots = write_plots(data, out_dir)
    summary = summarize(data) | {"plots": [str(p) for p in plots]}
    if as_json:
        echo_json(summary)
        return
    for key, value in summary.items():
        if key not in ("plots", "domains"):
            click.echo(f"{key.replace('_', ' ')}: {value}")
    for d in summary.get("domains", []):
        click.echo(_domain_report_line(d))
    click.echo(f"wrote {', '.join(summary['plots'])}")


def _domain_report_line(domain: dict[str, Any]) -> str:
    """One power domain's figures over the report's period (`summarize_domains`)."""
    return (
        f"domain {domain['name']}: limit {_power(domain['limit_w'])}, "
        f"{domain['intervals_over_limit']} of {domain['intervals_measured']} interval(s) "
        f"measured more than 1 % over, worst {domain['max_power_over_limit_pct']:+.2f} %, "
        f"mean planned {_power(domain['planned_mean_w'])}, "
        f"measured {_power(domain['measured_mean_w'])}"
    )


#: what ``cdgpc-admin`` registers from this module
@click.command()
@_config_option
@_json_option
@click.pass_context
def doctor(ctx: click.Context, config_path: Path | None, as_json: bool) -> None:
    """Check this node's setup and say what to fix (reads only; sets no clock).

    Credentials (MUNGE or HMAC), the head, the GPUs (NVML), the privileges clock locks need, the
    local agent, and Prolog/Epilog records waiting in the spool. Exit status 1 if any fails.
    """
    checks = run_checks(_config(config_path))
    healthy = all(c.ok for c in checks)
    if as_json:
        echo_json({"ok": healthy, "checks": [c.as_dict() for c in checks]})
    else:
        for c in checks:
            click.echo(f"{'ok ' if c.ok else 'BAD'}  {c.name:<14} {c.detail}")
            if not c.ok and c.fix:
                click.echo(f"     {'':<14} fix: {c.fix}")
    if not healthy:
        ctx.exit(1)


COMMANDS = (budget, status, jobs, nodes, db, doctor, report)
