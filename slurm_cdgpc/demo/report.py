"""What a run did, from the head's store alone: the summary figures and the PNG plots.

Used by ``cdgpc-admin demo`` at the end of a run and by ``cdgpc-admin report`` on any store.
Cluster power under decision k is the sum of every GPU's power the head recorded at the next
interval (the agents read their GPUs before they apply a decision, so the measurements written
with decision k + 1 describe the interval decision k's clocks ran), compared with the budget
decision k was made for. With a topology, each power domain's is the same sum over its nodes,
compared with its limit in force when decision k was made (`DomainPower`). A job's predicted
finish is its recorded finish once its Epilog ran; for a job still running it is the last
interval's time plus its remaining iterations at its average pace so far (``iterations_done``
since registration).

matplotlib is imported lazily, with the Agg backend (the ``report`` extra).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.families import FloatArray
from slurm_cdgpc.store import BudgetChange, DecisionRecord, Job, Store
from slurm_cdgpc.topology import Topology

#: who the head records as the setter of ``budget.initial`` (`slurm_cdgpc.coordinator.daemon`)
CONFIG_USER = "cdgpcd"
#: a domain's interval counts as over its limit above this share of it (the simulator's rule)
OVER_LIMIT = 1.01
#: the most domains ``domains.png`` draws (those that came closest to or went furthest over)
PLOTTED_DOMAINS = 12


def _next_reading_s(times_s: Sequence[float], decision_s: float) -> float | None:
    """The first reading after a decision: what its GPUs drew under it (None: not yet read)."""
    after = bisect.bisect_right(times_s, decision_s)
    return None if after == len(times_s) else times_s[after]


@dataclass(frozen=True, eq=False)
class DomainPower:
    """The power domains over a report's decisions: row d is domain ``names[d]``, column k the
    report's decision k."""

    names: tuple[str, ...]
    #: (D, K) the limit in force when decision k was made: the latest change an admin set by
    #: then (`Store.domain_limit_history`), else the topology file's
    limit_w: FloatArray
    #: (D, K) decision k's setpoints' power under each domain, each job's shared over its GPUs
    #: (s_dn P_n); the power outside the plan, which the store does not keep per node, is not in it
    planned_w: FloatArray
    #: (D, K) what each domain's GPUs drew under decision k (the next interval's readings summed
    #: over its nodes, its descendants' included); NaN: not read
    measured_w: FloatArray

    @classmethod
    def of(
        cls,
        topology: Topology,
        decisions: Sequence[DecisionRecord],
        jobs: Sequence[Job],
        limit_changes: Sequence[BudgetChange],
        node_w: Mapping[float, Mapping[str, float]],
    ) -> DomainPower:
        """``limit_changes``: every domain limit change, in effective order (ties: as set);
        ``node_w``: reading time → each node's GPUs' power, summed."""
        size = (len(topology), len(decisions))
        times_s = np.array([d.time_s for d in decisions], dtype=np.float64)
        # the limit in force at t: the last change effective by t, else the file's
        limit_w = np.repeat(topology.limits_w[:, None], len(decisions), axis=1)
        index = {name: i for i, name in enumerate(topology.names)}
        for change in limit_changes:
            row = index.get(change.domain or "")
            if row is not None:  # a domain the file no longer has is not reported
                limit_w[row, times_s >= change.effective_at_s] = change.budget_w
        # planned_dk = Σ_n s_dn P_nk, s_dn = job n's GPUs under d / its GPUs
        shares = {j.job_id: _shares(topology, j) for j in jobs}
        planned_w = np.zeros(size)
        for k, decision in enumerate(decisions):
            for point in decision.setpoints:
                share = shares.get(point.job_id)
                if share is not None:
                    planned_w[:, k] += share * point.predicted_power_w
        readings = sorted(node_w)
        measured_w = np.full(size, math.nan)
        for k, decision in enumerate(decisions):
            read_s = _next_reading_s(readings, decision.time_s)
            if read_s is not None:
                measured_w[:, k] = topology.node_power_w(node_w[read_s])
        return cls(topology.names, limit_w, planned_w, measured_w)

    def over_limit_pct(self) -> FloatArray:
        """(D, K) how far each domain's measured power was over its limit, %; NaN: not read."""
        return 100.0 * (self.measured_w - self.limit_w) / self.limit_w

    def plotted(self, most: int = PLOTTED_DOMAINS) -> list[int]:
        """The rows ``domains.png`` draws, in the topology's order: all, or the ``most`` that
        came closest to their limits or went furthest over."""
        if len(self.names) <= most:
            return list(range(len(self.names)))
        over = self.over_limit_pct()
        worst = np.full(len(self.names), -math.inf)
        for d, row in enumerate(over):
            seen = row[~np.isnan(row)]
            if seen.size:
                worst[d] = seen.max()
        return sorted(np.argsort(-worst, kind="stable")[:most].tolist())


def _shares(topology: Topology, job: Job) -> FloatArray:
    """(D,) the share of ``job``'s GPUs under each domain (`Topology.limits`' s_dn)."""
    share = np.zeros(len(topology))
    for node, count in Counter(g.node for g in job.gpus).items():
        for d in topology.path(node):
            share[d] += count
    return share / max(len(job.gpus), 1)


@dataclass(frozen=True)
class RunData:
    """The part of the store one report covers."""

    decisions: list[DecisionRecord]
    power_w: dict[float, float]  # interval time → every GPU's recorded power, summed
    budgets: list[BudgetChange]
    jobs: list[Job]
    since_s: float | None
    #: the power domains, with a topology (None: the report is the cluster's alone)
    domains: DomainPower | None = None

    @classmethod
    def load(
        cls, store: Store, since_s: float | None = None, topology: Topology | None = None
    ) -> RunData:
        """The store's decisions, measurements and jobs from ``since_s``; with ``topology``,
        each of its domains' limit, planned and measured power per decision too."""
        totals: dict[float, float] = defaultdict(float)
        node_w: dict[float, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for m in store.measurements(since_s):
            totals[m.time_s] += m.power_w
            if topology is not None:
                node_w[m.time_s][m.node] += m.power_w
        every_job = store.jobs()
        jobs = [
            j
            for j in every_job
            if since_s is None
            or j.registered_at_s >= since_s
            or j.finished_at_s is None
            or j.finished_at_s >= since_s
        ]
        decisions = store.decisions(since_s)
        domains = None
        if topology is not None:
            changes = store.domain_limit_history() if topology.names else []
            domains = DomainPower.of(topology, decisions, every_job, changes, node_w)
        return cls(
            decisions=decisions,
            power_w=dict(totals),
            budgets=store.budget_history(),
            jobs=jobs,
            since_s=since_s,
            domains=domains,
        )

    @property
    def end_s(self) -> float | None:
        return self.decisions[-1].time_s if self.decisions else None

    def over_budget_pct(self) -> list[tuple[DecisionRecord, float, float]]:
        """(decision, cluster power, % over its budget) for every decision with both."""
        out = []
        times = sorted(self.power_w)
        for d in self.decisions:
            read_s = _next_reading_s(times, d.time_s)
            if read_s is None or not math.isfinite(d.budget_w) or d.budget_w <= 0:
                continue
            power_w = self.power_w[read_s]
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
    summary: dict[str, Any] = {
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
    if data.domains is not None:
        summary["domains"] = summarize_domains(data.domains)
    return summary


def summarize_domains(domains: DomainPower) -> list[dict[str, Any]]:
    """Per domain, judged as the cluster is: its limit at the last interval, the intervals its
    measured power was read and more than 1 % over the limit in force, the largest overshoot
    (%, negative: always under), and its mean planned and measured power over the intervals
    read."""
    out: list[dict[str, Any]] = []
    over_pct = domains.over_limit_pct()
    for d, name in enumerate(domains.names):
        read = ~np.isnan(domains.measured_w[d])
        limit_w, planned_w, measured_w = (
            domains.limit_w[d, read],
            domains.planned_w[d, read],
            domains.measured_w[d, read],
        )
        seen = bool(read.any())
        out.append(
            {
                "name": name,
                "limit_w": float(domains.limit_w[d, -1]) if domains.limit_w.shape[1] else None,
                "intervals_measured": int(read.sum()),
                "intervals_over_limit": int((measured_w > OVER_LIMIT * limit_w).sum()),
                "max_power_over_limit_pct": round(float(over_pct[d, read].max()), 4)
                if seen
                else 0.0,
                "planned_mean_w": round(float(planned_w.mean()), 1) if seen else None,
                "measured_mean_w": round(float(measured_w.mean()), 1) if seen else None,
            }
        )
    return out


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
    """``power.png`` (cluster power against the budget), ``jobs.png`` (every job's finish,
    predicted while it runs, against its deadline) and, with power domains, ``domains.png``
    (each one's measured power against its limit). ``time_scale``: displayed seconds per
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
    if data.domains is not None and data.domains.names:
        written.append(
            _domains_plot(plt, data.decisions, data.domains, out / "domains.png", hours, time_label)
        )
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


def _domains_plot(
    plt: Any,
    decisions: Sequence[DecisionRecord],
    domains: DomainPower,
    path: Path,
    hours: Any,
    time_label: str,
) -> Path:
    rows = domains.plotted()
    columns = min(3, len(rows))
    lines = math.ceil(len(rows) / columns)
    fig, axes = plt.subplots(
        lines, columns, figsize=(4.0 * columns, 2.4 * lines + 0.8), sharex=True, squeeze=False
    )
    t = [hours(d.time_s) for d in decisions]
    for ax, d in zip(axes.flat, rows, strict=False):
        ax.plot(t, domains.measured_w[d] / 1e3, lw=1.2, color="tab:blue", label="measured")
        ax.plot(t, domains.planned_w[d] / 1e3, lw=0.8, color="tab:gray", label="planned (jobs)")
        ax.step(t, domains.limit_w[d] / 1e3, where="post", color="k", ls="--", lw=1, label="limit")
        ax.set_title(domains.names[d], fontsize=9)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(rows) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel(time_label, fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("GPU power (kW)", fontsize=8)
    axes[0, 0].legend(loc="lower right", fontsize=7)
    title = "each power domain's measured power against its limit"
    if len(rows) < len(domains.names):
        title += (
            f" ({len(rows)} of {len(domains.names)} domains: those that came closest to or "
            "went furthest over their limits)"
        )
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
