"""One demo run: start the cluster, replay the trace, change the budget half-way, report.

The budget starts at ``budget_fraction`` of the GPUs' summed TDP (``budget.initial`` in the
head's configuration) and is lowered to ``drop_to`` of it half-way through the run, through the
head's admin API exactly as ``cdgpc-admin budget set`` does. The figures at the end are measured
from the head's store once every daemon has stopped (`slurm_cdgpc.demo.report`); the plots and
a copy of the store go to ``out_dir``.
"""

from __future__ import annotations

import logging
import shutil
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Final

from slurm_cdgpc.demo.cluster import DEFAULT_NODES, NodeSpec, create_cluster, start_cluster
from slurm_cdgpc.demo.live import LiveTable, clock_text
from slurm_cdgpc.demo.replayer import Replayer
from slurm_cdgpc.demo.report import RunData, summarize, write_plots
from slurm_cdgpc.demo.trace import load_slice
from slurm_cdgpc.errors import CdgpcError, InputError
from slurm_cdgpc.gpu.catalog import catalog_spec
from slurm_cdgpc.localcluster import LocalCluster, TomlValue
from slurm_cdgpc.store import Store, make_engine
from slurm_cdgpc.units import format_power

logger = logging.getLogger(__name__)

#: how often the replayer looks for due, finished and placeable jobs (wall seconds)
STEP_PERIOD_S: Final = 0.05


@dataclass(frozen=True)
class DemoSettings:
    duration_s: float = 90.0
    speed: float = 180.0
    interval_s: float = 1.0
    lease_s: float = 5.0
    budget_fraction: float = 0.7
    drop_to: float = 0.55
    out_dir: Path = Path("demo-out")
    keep_run_dir: bool = False
    nodes: tuple[NodeSpec, ...] = DEFAULT_NODES
    #: ``[control]`` keys for the head on top of the shipped settings (``cdgpc-admin demo
    #: --config``)
    control: Mapping[str, TomlValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.duration_s > 0:
            raise InputError(f"duration must be positive, got {self.duration_s:g} s")
        if not self.speed > 0:
            raise InputError(f"speed must be positive, got {self.speed:g}")
        if not self.lease_s > self.interval_s > 0:
            raise InputError("need 0 < interval < lease")

    def fleet_tdp_w(self) -> float:
        return sum(catalog_spec(n.gpu_type).tdp_w * n.gpus for n in self.nodes)


class Screen:
    """Where the run is shown: redrawn in place on a terminal, one line per interval elsewhere,
    nothing with ``--json``."""

    def __init__(self, mode: str, write: Callable[[str], None]) -> None:
        self.mode = mode  # "tty", "lines" or "quiet"
        self.write = write
        self.events: list[str] = []

    def note(self, text: str) -> None:
        if self.mode != "quiet":
            self.write(text)

    def event(self, text: str) -> None:
        self.events.append(text)
        if self.mode == "lines" and not text.startswith("job "):
            self.write(f"-- {text} --")


def run_demo(settings: DemoSettings, screen: Screen) -> dict[str, Any]:
    """Run the demo; the summary (the JSON of ``--json``). Every daemon is stopped on return."""
    jobs = load_slice()
    tdp_w = settings.fleet_tdp_w()
    budget_w = settings.budget_fraction * tdp_w
    lowered_w = settings.drop_to * tdp_w
    cluster = create_cluster(
        interval_s=settings.interval_s,
        lease_s=settings.lease_s,
        initial_budget_w=budget_w,
        nodes=settings.nodes,
        control=settings.control,
    )
    gpus = sum(n.gpus for n in settings.nodes)
    types = sorted({n.gpu_type for n in settings.nodes})
    auth = cluster.auth_method.upper()
    header = [
        f"cdgpcd + {len(settings.nodes)} cdgpc-noded on loopback ({auth} auth), "
        f"{gpus} simulated GPUs ({', '.join(types)}), store {cluster.head.store_url}",
        f"replaying {len(jobs)} jobs of the ElasticFlow cluster04 trace at {settings.speed:g}x "
        f"(1 s = {settings.speed / 60:g} simulated min); interval {settings.interval_s:g} s; "
        f"budget {format_power(budget_w)}, lowered to {format_power(lowered_w)} half-way",
    ]
    if screen.mode != "quiet":
        screen.write(header[0])
        screen.write(header[1])
    interrupted = False
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    for sig in previous:  # stopped by kill or a closed terminal: clean up as on Ctrl-C
        signal.signal(sig, _interrupt)
    replayer = Replayer(cluster, jobs, settings.speed, on_event=screen.event)
    start_wall_s = time.time()
    try:
        start_cluster(cluster, speed=settings.speed, on_step=screen.note)
        client = cluster.client(timeout_s=5.0)
        replayer.start()
        start_wall_s = replayer.start_wall_s
        table = LiveTable(replayer.trace_s)
        if screen.mode == "lines":
            from slurm_cdgpc.demo.live import COLUMNS, WIDTHS, line  # noqa: PLC0415

            screen.write("")
            screen.write(line(COLUMNS))
            screen.write(line(tuple("-" * w for w in WIDTHS)))
        end_wall_s = start_wall_s + settings.duration_s
        change_wall_s = start_wall_s + settings.duration_s / 2
        changed = False
        next_poll_s = start_wall_s
        while (now := time.time()) < end_wall_s:
            replayer.step(now)
            if not changed and now >= change_wall_s:
                client.post(
                    "/v1/budget",
                    {"budget_w": lowered_w, "reason": "demo: the admin lowers the budget"},
                )
                changed = True
                screen.event(
                    f"{clock_text(replayer.trace_s(now))} admin: budget set "
                    f"{format_power(lowered_w)}"
                )
            if now >= next_poll_s:  # a few polls per interval: one line per new interval
                next_poll_s = now + settings.interval_s / 4
                cluster.check_alive()
                _show(screen, table, header, client, replayer, now)
            time.sleep(STEP_PERIOD_S)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        killed = cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    left = [d.name for d in cluster.daemons if d.proc.poll() is None]
    if killed:
        logger.warning("had to SIGKILL %s", ", ".join(killed))
    try:
        summary = _report(settings, cluster)
    finally:
        if not settings.keep_run_dir:
            cluster.remove()
    summary.update(
        {
            "interrupted": interrupted,
            "duration_s": settings.duration_s,
            "speed": settings.speed,
            "interval_s": settings.interval_s,
            "auth": cluster.auth_method,
            "nodes": len(settings.nodes),
            "gpus": gpus,
            "budget_w_initial": round(budget_w, 1),
            "budget_w_after_change": round(lowered_w, 1),
            "jobs_submitted": replayer.submitted,
            "hook_failures": replayer.hook_failures,
            "pids": cluster.pids,
            "processes_left": len(left),
            "processes_killed": len(killed),
            "run_dir": str(cluster.run_dir) if settings.keep_run_dir else None,
        }
    )
    return summary


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _show(
    screen: Screen,
    table: LiveTable,
    header: list[str],
    client: Any,
    replayer: Replayer,
    now: float,
) -> None:
    if screen.mode == "quiet":
        return
    try:
        status = client.get("/v1/status")
        last = status.get("last_interval") or {}
        if last.get("interval") is None or last["interval"] == table.last_interval:
            return
        table.last_interval = last["interval"]
        head_jobs = client.get("/v1/jobs")["jobs"]
    except CdgpcError as e:
        screen.event(f"cdgpcd did not answer: {e}")
        return
    snap = table.snapshot(
        now, status, head_jobs, replayer.running, len(replayer.queue), replayer.finished
    )
    text = table.interval_line(snap)
    if screen.mode == "tty":
        screen.write("\x1b[H\x1b[2J" + table.screen(header, snap, screen.events))
    else:
        screen.write(text)


def _report(settings: DemoSettings, cluster: LocalCluster) -> dict[str, Any]:
    """Measure the run from the store, write the plots and a copy of the store."""
    data = RunData([], {}, [], [], None)
    if (cluster.run_dir / "cdgpc.db").exists():  # not when stopped before cdgpcd started
        engine = make_engine(cluster.head.store_url)
        try:
            data = RunData.load(Store(engine))
        except CdgpcError as e:  # stopped before cdgpcd created its schema
            logger.warning("the head's store is unreadable: %s", e)
        finally:
            engine.dispose()
    summary = summarize(data)
    summary["out_dir"] = str(settings.out_dir)
    plots: list[str] = []
    if data.decisions:
        try:
            plots = [
                str(p)
                for p in write_plots(
                    data,
                    settings.out_dir,
                    time_scale=settings.speed,
                    time_label="simulated hours since the first interval",
                )
            ]
        except InputError as e:
            logger.warning("no plots: %s", e)
    try:
        settings.out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(cluster.run_dir / "cdgpc.db", settings.out_dir / "cdgpc.db")
    except OSError as e:
        logger.warning("store not copied to %s: %s", settings.out_dir, e)
    summary["plots"] = plots
    summary["store_copy"] = str(settings.out_dir / "cdgpc.db")
    summary["daemons_with_tracebacks"] = [
        d.name for d in cluster.daemons if "Traceback" in d.tail(1_000_000)
    ]
    return summary
