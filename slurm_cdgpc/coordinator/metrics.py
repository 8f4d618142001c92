"""Prometheus text exposition of cdgpcd (``GET /metrics``), low cardinality on purpose.

Cluster-level series only: budget, power (measured, predicted, uncontrolled), price, solve time,
jobs by state, nodes by reachability. No series per job or per GPU: a cluster runs thousands of
jobs a day, and every job id would be a new time series. Per-job detail is in ``GET /v1/jobs``
and the store's audit trail.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from slurm_cdgpc.store import ACTIVE_STATES, Job, Node

if TYPE_CHECKING:
    from slurm_cdgpc.coordinator.daemon import Coordinator


def _value(x: float | None) -> str:
    if x is None or math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x))


def _gauge(
    lines: list[str], name: str, help_text: str, samples: Iterable[tuple[str, float | None]]
) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} gauge")
    for labels, value in samples:
        lines.append(f"{name}{labels} {_value(value)}")


def render_metrics(coordinator: Coordinator, jobs: Iterable[Job], nodes: Iterable[Node]) -> str:
    """The exposition text for the last interval, the active jobs and the nodes."""
    report = coordinator.last_report
    budget = coordinator.store.current_budget()
    budget_w = budget.budget_w if budget is not None else coordinator.settings.initial_budget_w
    lines: list[str] = []
    _gauge(
        lines, "cdgpc_budget_watts", "GPU power budget in force (NaN: uncapped)", [("", budget_w)]
    )
    if report is not None:
        _gauge(
            lines,
            "cdgpc_measured_power_watts",
            "GPU power the agents reported at the last exchange",
            [("", report.measured_power_w)],
        )
        _gauge(
            lines,
            "cdgpc_predicted_power_watts",
            "power of the controlled jobs the last decision predicted",
            [("", report.predicted_power_w)],
        )
        _gauge(
            lines,
            "cdgpc_uncontrolled_power_watts",
            "power counted outside the optimisation (idle GPUs, unreachable nodes at worst case)",
            [("", report.uncontrolled_w)],
        )
        _gauge(lines, "cdgpc_price", "dual price of the last decision", [("", report.price)])
        _gauge(
            lines,
            "cdgpc_solve_seconds",
            "controller time of the last decision",
            [("", report.solve_s)],
        )
        _gauge(
            lines, "cdgpc_interval", "index of the last control interval", [("", report.interval)]
        )
        _gauge(
            lines,
            "cdgpc_jobs_controlled",
            "jobs whose clocks the last decision chose",
            [("", sum(1 for j in report.jobs if j.controlled))],
        )
    by_state = Counter(j.state for j in jobs)
    _gauge(
        lines,
        "cdgpc_jobs",
        "active jobs by state",
        [(f'{{state="{s}"}}', by_state.get(s, 0)) for s in ACTIVE_STATES],
    )
    reach = Counter("true" if n.reachable else "false" for n in nodes)
    _gauge(
        lines,
        "cdgpc_nodes",
        "known nodes by reachability at the last exchange",
        [(f'{{reachable="{r}"}}', reach.get(r, 0)) for r in ("true", "false")],
    )
    _gauge(
        lines,
        "cdgpc_shadow",
        "1 when decisions are recorded but not applied",
        [("", float(coordinator.settings.shadow))],
    )
    return "\n".join(lines) + "\n"
