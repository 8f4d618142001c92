"""The demo's terminal table: what an operator watches, read from the head's API every interval.

One line per interval: simulated time, the budget and the power the head measured, the price of
power, jobs running and waiting, how many running jobs are predicted to miss their deadline, and
how many finished (late ones in brackets). On a terminal the screen is redrawn in place with the
running jobs below the lines: node and GPUs, workload, the clock the head chose, progress, and
the predicted finish against the deadline (simulated clock, hours:minutes since the start).

A job's predicted finish is now plus its remaining iterations at the pace the head saw over the
last interval (``iterations_done`` from ``GET /v1/jobs``, which comes from the job's own progress
reports); the first interval of a job has no prediction yet.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from slurm_cdgpc.demo.replayer import Placed
from slurm_cdgpc.units import format_power

COLUMNS: Final = (
    "time",
    "budget",
    "power",
    "error",
    "price",
    "running",
    "queued",
    "at risk",
    "done (late)",
)
WIDTHS: Final = (6, 10, 10, 8, 9, 7, 6, 7, 11)
JOB_COLUMNS: Final = ("job", "node:GPUs", "model", "MHz", "power", "progress", "finish", "deadline")
JOB_WIDTHS: Final = (5, 13, 11, 5, 9, 8, 7, 8)
#: rows of the per-job table on a terminal (the most pressed jobs first)
MAX_JOB_ROWS: Final = 16
HISTORY_ROWS: Final = 12


def clock_text(trace_s: float | None) -> str:
    """Simulated seconds since the start as ``hh:mm`` (``-`` when unknown)."""
    if trace_s is None or not math.isfinite(trace_s):
        return "-"
    minutes = int(trace_s // 60)
    sign = "-" if minutes < 0 else ""
    minutes = abs(minutes)
    return f"{sign}{minutes // 60:02d}:{minutes % 60:02d}"


def line(cells: Sequence[str], widths: Sequence[int] = WIDTHS) -> str:
    return "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))


@dataclass
class JobPace:
    """Iterations done at the last two polls, for the predicted finish."""

    samples: list[tuple[float, int]] = field(default_factory=list)

    def add(self, wall_s: float, done: int) -> None:
        if self.samples and self.samples[-1][1] == done and done > 0:
            return  # no new progress report since: keep the older sample for the rate
        self.samples = [*self.samples[-1:], (wall_s, done)]

    def finish_wall_s(self, total: int | None) -> float | None:
        if total is None or len(self.samples) < 2:
            return None
        (t0, d0), (t1, d1) = self.samples
        if d1 <= d0 or t1 <= t0:
            return None
        return t1 + max(total - d1, 0) * (t1 - t0) / (d1 - d0)


@dataclass
class Snapshot:
    """One interval as the table shows it."""

    trace_s: float
    budget_w: float | None
    power_w: float | None
    price: float | None
    status: str
    running: int
    queued: int
    at_risk: int
    finished: int
    finished_late: int
    jobs: list[list[str]]


class LiveTable:
    """Keeps the per-job paces and the history of interval lines."""

    def __init__(self, to_trace_s: Callable[[float], float]) -> None:
        self.to_trace_s = to_trace_s
        self.paces: dict[str, JobPace] = {}
        self.history: list[str] = []
        self.last_interval: int | None = None

    def snapshot(
        self,
        now_wall_s: float,
        status: Mapping[str, Any],
        head_jobs: Sequence[Mapping[str, Any]],
        running: Mapping[str, Placed],
        queued: int,
        finished: Sequence[Placed],
    ) -> Snapshot:
        last = status.get("last_interval") or {}
        by_id = {j["job_id"]: j for j in head_jobs}
        rows: list[tuple[float, list[str]]] = []
        at_risk = 0
        for job_id, placed in running.items():
            head = by_id.get(job_id, {})
            done = int(head.get("iterations_done") or 0)
            total = head.get("iterations_total") or placed.job.iterations
            pace = self.paces.setdefault(job_id, JobPace())
            pace.add(now_wall_s, done)
            finish = pace.finish_wall_s(total)
            late = finish is not None and finish > placed.deadline_wall_s
            at_risk += late
            slack = math.inf if finish is None else placed.deadline_wall_s - finish
            gpus = (
                ",".join(map(str, placed.gpus)) if len(placed.gpus) < 4 else f"{len(placed.gpus)}x"
            )
            rows.append(
                (
                    slack,
                    [
                        job_id,
                        f"{placed.node.name}:{gpus}",
                        placed.job.model[:11],
                        str(head.get("graphics_mhz") or "-"),
                        "-"
                        if head.get("measured_power_w") is None
                        else format_power(float(head["measured_power_w"])),
                        f"{100.0 * done / total:.0f}%" if total else "-",
                        clock_text(None if finish is None else self.to_trace_s(finish))
                        + ("!" if late else ""),
                        clock_text(self.to_trace_s(placed.deadline_wall_s)),
                    ],
                )
            )
        for job_id in list(self.paces):
            if job_id not in running:
                del self.paces[job_id]
        rows.sort(key=lambda r: r[0])
        return Snapshot(
            trace_s=self.to_trace_s(now_wall_s),
            budget_w=last.get("budget_w", status.get("budget_w")),
            power_w=last.get("measured_power_w"),
            price=last.get("price"),
            status=str(last.get("status", "-")),
            running=len(running),
            queued=queued,
            at_risk=at_risk,
            finished=len(finished),
            finished_late=sum(
                1 for p in finished if (p.finished_wall_s or 0.0) > p.deadline_wall_s
            ),
            jobs=[cells for _, cells in rows],
        )

    def interval_line(self, s: Snapshot) -> str:
        error = "-"
        if s.power_w is not None and s.budget_w:
            pct = 100.0 * (s.power_w - s.budget_w) / s.budget_w
            error = f"{pct:+.2f}%"
        price = "-"
        if s.status not in ("slack", "idle") and s.price is not None:
            price = f"{s.price:.2e}" if s.price >= 1e-9 else "~0"
        cells = (
            clock_text(s.trace_s),
            "-" if s.budget_w is None else format_power(s.budget_w),
            "-" if s.power_w is None else format_power(s.power_w),
            error,
            price,
            str(s.running),
            str(s.queued),
            str(s.at_risk),
            f"{s.finished} ({s.finished_late})",
        )
        text = line(cells)
        self.history.append(text)
        return text

    def screen(self, header: Sequence[str], s: Snapshot, events: Sequence[str]) -> str:
        """The whole terminal screen (redrawn in place every interval)."""
        out = [*header, "", line(COLUMNS), line(tuple("-" * w for w in WIDTHS))]
        out.extend(self.history[-HISTORY_ROWS:])
        out.append("")
        out.append(line(JOB_COLUMNS, JOB_WIDTHS))
        out.append(line(tuple("-" * w for w in JOB_WIDTHS), JOB_WIDTHS))
        out.extend(line(cells, JOB_WIDTHS) for cells in s.jobs[:MAX_JOB_ROWS])
        if len(s.jobs) > MAX_JOB_ROWS:
            out.append(f"... and {len(s.jobs) - MAX_JOB_ROWS} more")
        out.append("")
        out.extend(events[-4:])
        return "\n".join(out)
