"""What a run did, from the head's store alone: the summary figures and two PNG plots.

Used by ``cdgpc-admin demo`` at the end of a run and by ``cdgpc-admin report`` on any store.
Cluster power under decision k is the sum of every GPU's power the head recorded at the next
interval (the agents read their GPUs before they apply a decision, so the measurements written
with decision k + 1 describe the interval decision k's clocks ran), compared with the budget
decision k was made for. A job's predicted finish is its recorded finish once its Epilog ran;
for a job still running it is the last interval's time plus its remaining iterations at its
average pace so far (``iterations_done`` since registration).

matplotlib is imported lazily, with the Agg backend (the ``report`` extra).
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.store import BudgetChange, DecisionRecord, Job, Store

#: who the head records as the setter of ``budget.initial`` (`slurm_cdgpc.coordinator.daemon`)
CONFIG_USER = "cdgpcd"


@dataclass(frozen=True)
class RunData:
    """The part of the store one report covers."""

    decisions: list[DecisionRecord]
    power_w: dict[float, float]  # interval time → every GPU's recorded power, summed
    budgets: list[BudgetChange]
    jobs: list[Job]
    since_s: float | None

    @classmethod
    def load(cls, store: Store, since_s: float | None = None) -> RunData:
        totals: dict[float, float] = defaultdict(float)
        for m in store.measurements(since_s):
            totals[m.time_s] += m.power_w
        jobs = [
            j
            for j in store.jobs()
            if since_s is None
            or j.registered_at_s >= since_s
            or j.finished_at_s is None
            or j.finished_at_s >= since_s
        ]
        return cls(
            decisions=store.decisions(since_s),
            power_w=dict(totals),
            budgets=store.budget_history(),
            jobs=jobs,
            since_s=since_s,
        )

    @property
    def end_s(self) -> float | None:
        return self.decisions[-1].time_s if self.decisions else None

    def over_budget_pct(self) -> list[tuple[DecisionRecord, float, float]]:
        """(decision, cluster power, % over its budget) for every decision with both."""
        out = []
        times = sorted(self.power_w)
        for d in self.decisions:
            after = bisect.bisect_right(times, d.time_s)  # the next interval's readings
            if after == len(times) or not math.isfinite(d.budget_w) or d.budget_w <= 0:
                continue
            power_w = self.power_w[times[after]]
            out.append((d, power_w, 100.0 * (power_w - d.budget_w) / d.budget_w))
        return out

    def predicted_finish_s(self, job: Job) -> float | None:
        """When the job finished, else when it will at its average pace so far (None: unknown)."""
        if job.finished_at_s is not None:
            return job.finished_at_s
        end_s = self.end_s
        if end_s is None or not job.iterations_total or job.iterations_done <= 0:
            return None
        elapsed_s = end_s - job.registered_at_s
        if elapsed_s <= 0:
            return None
        remaining = max(job.iterations_total - job.iterations_done, 0)
        return end_s + remaining * elapsed_s / job.iterations_done

    def budget_changes_applied(self) -> int:
        """Budget changes made through the API (not ``budget.initial``) in the window that a
        later decision was made for."""
        applied = 0
        for change in self.budgets:
            if change.set_by == CONFIG_USER:
                continue
            if self.since_s is not None and change.created_at_s < self.since_s:
                continue
            if any(
                d.time_s >= change.effective_at_s and d.budget_w == change.budget_w
                for d in self.decisions
            ):
                applied += 1
        return applied


def summarize(data: RunData) -> dict[str, Any]:
    """The figures of a run, each measured from the store."""
    over = data.over_budget_pct()
    binding = [pct for d, _, pct in over if d.status == "binding"]
    finished = [j for j in data.jobs if j.state == "finished"]
    late = [
        j
        for j in finished
        if j.deadline_s is not None
        and j.finished_at_s is not None
        and j.finished_at_s > j.deadline_s
    ]
    at_risk = 0
    for j in data.jobs:
        if j.state == "finished" or j.deadline_s is None:
            continue
        predicted = data.predicted_finish_s(j)
        if predicted is not None and predicted > j.deadline_s:
            at_risk += 1
    return {
        "intervals": len(data.decisions),
        "intervals_binding": sum(1 for d in data.decisions if d.status == "binding"),
        "max_power_over_budget_pct": round(max((p for _, _, p in over), default=0.0), 4),
        "power_mae_binding_pct": round(
            sum(abs(p) for p in binding) / len(binding) if binding else 0.0, 4
        ),
        "jobs_registered": len(data.jobs),
        "jobs_finished": len(finished),
        "jobs_finished_late": len(late),
        "jobs_running_predicted_late": at_risk,
        "budget_changes_applied": data.budget_changes_applied(),
    }


def _pyplot() -> Any:
    try:
        import matplotlib  # noqa: PLC0415 (optional: the ``report`` extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise InputError("plots need matplotlib: pip install 'slurm-cdgpc[report]'") from None
    return plt


def write_plots(
    data: RunData,
    directory: str | Path,
    *,
    time_scale: float = 1.0,
    time_label: str = "hours since the first interval",
) -> list[Path]:
    """``power.png`` (cluster power against the budget) and ``jobs.png`` (every job's finish,
    predicted while it runs, against its deadline). ``time_scale``: displayed seconds per
    recorded second (the demo's simulated seconds per wall-clock second)."""
    if not data.decisions:
        raise InputError("the store holds no decisions in that time range: nothing to plot")
    plt = _pyplot()
    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot create report directory {out}: {e.strerror or e}") from e
    origin = data.decisions[0].time_s

    def hours(t_s: float) -> float:
        return (t_s - origin) * time_scale / 3600.0

    written = [_power_plot(plt, data, out / "power.png", hours, time_label)]
    written.append(_jobs_plot(plt, data, out / "jobs.png", hours, time_label))
    return written


def _power_plot(plt: Any, data: RunData, path: Path, hours: Any, time_label: str) -> Path:
    over = data.over_budget_pct()
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(10, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    t = [hours(d.time_s) for d, _, _ in over]
    top.plot(t, [p / 1e3 for _, p, _ in over], lw=1.2, color="tab:blue", label="cluster power")
    top.step(
        [hours(d.time_s) for d in data.decisions],
        [d.budget_w / 1e3 if math.isfinite(d.budget_w) else math.nan for d in data.decisions],
        where="post",
        color="k",
        ls="--",
        lw=1,
        label="budget",
    )
    start = data.decisions[0].time_s
    for change in data.budgets:
        if change.set_by != CONFIG_USER and change.effective_at_s >= start:
            x = hours(change.effective_at_s)
            top.axvline(x, color="tab:red", lw=0.8, alpha=0.6)
            top.annotate(
                f"budget set {change.budget_w / 1e3:.1f} kW",
                (x, top.get_ylim()[1]),
                xytext=(4, -12),
                textcoords="offset points",
                fontsize=8,
                color="tab:red",
            )
    worst = max((p for _, _, p in over), default=0.0)
    top.set(ylabel="GPU power (kW)", title=f"power against the budget (worst {worst:+.2f} %)")
    top.legend(loc="lower right", fontsize=8)
    bottom.step(
        [hours(d.time_s) for d in data.decisions],
        [len(d.setpoints) for d in data.decisions],
        where="post",
        color="tab:green",
    )
    bottom.set(xlabel=time_label, ylabel="jobs controlled")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _jobs_plot(plt: Any, data: RunData, path: Path, hours: Any, time_label: str) -> Path:
    jobs: Sequence[Job] = data.jobs
    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.22 * len(jobs) + 1.2)))
    colours = {"met": "tab:green", "late": "tab:red", "unknown": "tab:gray"}
    seen: set[str] = set()
    for y, job in enumerate(jobs):
        finish = data.predicted_finish_s(job)
        done = job.finished_at_s is not None
        verdict = "unknown"
        if finish is not None:
            verdict = "late" if job.deadline_s is not None and finish > job.deadline_s else "met"
        end = finish if finish is not None else data.end_s or job.registered_at_s
        label = f"{'finished' if done else 'predicted'}, {verdict}"
        ax.plot(
            [hours(job.registered_at_s), hours(end)],
            [y, y],
            color=colours[verdict],
            lw=4 if done else 2,
            ls="-" if done else ":",
            solid_capstyle="butt",
            label=None if label in seen else label,
        )
        seen.add(label)
        if job.deadline_s is not None:
            ax.plot(
                [hours(job.deadline_s)],
                [y],
                marker="|",
                color="k",
                ms=10,
                mew=2,
                ls="none",
                label=None if "deadline" in seen else "deadline",
            )
            seen.add("deadline")
    if data.end_s is not None:
        ax.axvline(hours(data.end_s), color="k", lw=0.6, alpha=0.4)
    ax.set_yticks(range(len(jobs)))
    ax.set_yticklabels([j.job_id for j in jobs], fontsize=6)
    ax.invert_yaxis()
    ax.set(
        xlabel=time_label,
        ylabel="job",
        title="each job: start to finish (dotted: predicted at its pace so far) and deadline",
    )
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
