"""The head's power accounting (`PowerLedger`): the power outside the plan, the plans the measured
power is judged against, and the decisions' record (what each planned, and what its GPUs then
drew). It writes only the store's decisions. Rules: DESIGN.md, "Safety" (the rows counted at a
limit); test: `tests/unit/test_coordinator_daemon.py`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence

import numpy as np

from slurm_cdgpc.control.empc import Decision
from slurm_cdgpc.control.overdraw import ClusterDraw
from slurm_cdgpc.coordinator.jobs import GpuRef, JobInfo, RunningJobs
from slurm_cdgpc.coordinator.nodes import NodeBook, NodeState, catalog_max_w
from slurm_cdgpc.model.families import FloatArray
from slurm_cdgpc.store import Job, Setpoint, Store


class PowerLedger:
    """Power outside the plan, the plans in force and their record (the loop's thread)."""

    def __init__(self, *, mode: str, shadow: bool) -> None:
        self._mode = mode  # the controller's objective and whether decisions are applied,
        self._shadow = shadow  # as each decision's record says
        self._planned_w: dict[str, float] = {}  # last decision's planned power per job
        #: the plan in force over the interval the node reports describe: the decision before
        #: the last (the agents read before they apply), what their power is judged against
        self._planned_reported_w: dict[str, float] = {}
        #: the same two decisions' whole-plan expectation and budget (`Decision.expected_w`;
        #: None: no plan, or one uncapped, a shadow's or overridden by the emergency cut)
        self._expected: tuple[float, float] | None = None
        self._expected_reported: tuple[float, float] | None = None
        #: the last recorded decision and its GPUs: what they drew is filled in at the next
        self._last_decision: tuple[int, tuple[GpuRef, ...]] | None = None

    def uncontrolled_by_node_w(
        self,
        nodes: NodeBook,
        known: Mapping[str, Job],
        running: RunningJobs,
        held_out: Collection[str],
        releasing: Collection[GpuRef],
    ) -> dict[str, float]:
        """Per node, what its GPUs outside the plan may draw over the next interval (the total
        is the sum): GPUs of unreachable nodes at their worst case (never zero), GPUs of jobs
        waiting to be controlled and GPUs being released at their limit, every other GPU
        outside the plan at its latest reading (at its limit when unreadable). A GPU never
        controlled (MIG mode) waits for no plan: its jobs count at their limit only until their
        node has answered since they registered (`NodeBook.read_with_job`)."""
        controlled = {g for j in running.jobs for g in j.gpus}
        waiting = {
            ref
            for j in known.values()
            if j.job_id not in running and j.job_id not in held_out
            for g in j.gpus
            if not nodes.read_with_job(ref := GpuRef(g.node, g.gpu_index), j.registered_at_s)
        }
        by_node: dict[str, float] = {}
        named: dict[str, int] | None = None  # node -> GPUs its jobs name, once one is away
        for name, node in nodes.items():
            if node.reachable is False:
                if named is None:
                    named = _gpus_named(known)
                by_node[name] = _worst_case_w(nodes, node, named.get(name, 0))  # never zero
                continue
            node_w = 0.0
            for r in node.reports:
                ref = GpuRef(name, r.index)
                if ref in controlled:
                    continue
                limit_w = r.enforced_limit_w or nodes.limit_w(r.name)
                if ref in waiting or ref in releasing or r.power_w is None:
                    node_w += limit_w
                else:
                    node_w += r.power_w
            by_node[name] = node_w
        return by_node

    def planned_reported_w(self, jobs: Sequence[JobInfo]) -> FloatArray:
        """Per job (in ``jobs``' order), the power planned for the interval the reports describe
        (NaN: none)."""
        plan = self._planned_reported_w
        return np.array([plan.get(j.job_id, np.nan) for j in jobs])

    def planned(
        self, decision: Decision | None, jobs: Sequence[JobInfo], *, capped: bool = True
    ) -> None:
        """The decision just sent: the one before it is what the next reports measure.
        ``capped``: planned under a budget (an uncapped plan's over-draw is no share of one)."""
        self._planned_reported_w = self._planned_w
        self._expected_reported = self._expected
        self._expected = (
            (decision.expected_w, decision.budget_w)
            if decision is not None and capped and not self._shadow
            else None
        )
        self._planned_w = (
            {}
            if decision is None
            else {j.job_id: float(decision.planned_power_w[i]) for i, j in enumerate(jobs)}
        )

    def overridden(self, job_ids: Iterable[str]) -> None:
        """The jobs just sent other clocks than planned (the emergency cut): what they draw next
        is judged against no plan."""
        for job_id in job_ids:
            if job_id in self._planned_w:
                self._planned_w[job_id] = math.nan
                self._expected = None

    def cluster_draw(self, drawn_w: float | None) -> ClusterDraw | None:
        """What the cluster drew over the interval the reports describe (``drawn_w``: every GPU
        that answered) against the plan in force over it (`Overdraw`); None without either, or
        when that plan was uncapped, a shadow's, or overridden by the emergency cut."""
        if drawn_w is None or self._expected_reported is None:
            return None
        return ClusterDraw(drawn_w, *self._expected_reported)

    def fill_measured(self, store: Store, power_by_gpu: Mapping[GpuRef, float]) -> None:
        """Fill in what the last recorded decision's GPUs drew (inside the interval's store
        transaction)."""
        if self._last_decision is not None:
            decision_id, refs = self._last_decision
            drawn = [power_by_gpu[g] for g in refs if g in power_by_gpu]
            if drawn:
                store.set_measured_power(decision_id, float(sum(drawn)))
        self._last_decision = None

    def record(
        self,
        store: Store,
        k: int,
        now_s: float,
        budget_w: float | None,
        decision: Decision,
        jobs: Sequence[JobInfo],
    ) -> None:
        """Record interval ``k``'s decision for ``jobs`` with its setpoints (inside the
        interval's store transaction); what their GPUs draw is filled in at the next."""
        record = store.record_decision(
            interval_index=k,
            status=decision.status.value,
            mode=self._mode,
            price=decision.price,
            budget_w=math.inf if budget_w is None else budget_w,
            effective_budget_w=decision.effective_budget_w,
            predicted_power_w=decision.predicted_power_w,
            solve_s=decision.solve_s,
            setpoints=[
                Setpoint(
                    j.job_id,
                    int(decision.graphics_mhz[i]),
                    int(decision.memory_mhz[i]),
                    float(decision.job_power_w[i]),
                )
                for i, j in enumerate(jobs)
            ],
            shadow=self._shadow,
            time_s=now_s,
        )
        # a GPU its tenants share is drawn from once
        self._last_decision = (record.id, tuple(dict.fromkeys(g for j in jobs for g in j.gpus)))


def _gpus_named(known: Mapping[str, Job]) -> dict[str, int]:
    """Per node, how many GPUs its active jobs imply (the highest index named, plus one)."""
    named: dict[str, int] = {}
    for job in known.values():
        for g in job.gpus:
            named[g.node] = max(named.get(g.node, 0), g.gpu_index + 1)
    return named


def _worst_case_w(nodes: NodeBook, node: NodeState, named: int) -> float:
    """What an unreachable node may draw: its reported GPUs at their maximum power limit,
    and at least the ``named`` GPUs its jobs imply (one, if none) at the limit of its GPU
    type, or at the largest of the catalog while its type is unknown: a node the head never
    reached (announced, or first seen in a registration) is never counted at zero."""
    per_gpu_w = catalog_max_w() if node.gpu_type is None else nodes.limit_w(node.gpu_type)
    return max(node.worst_case_w, max(named, 1) * per_gpu_w)
