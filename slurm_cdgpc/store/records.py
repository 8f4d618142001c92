"""What the store hands out and takes in: small frozen dataclasses, never ORM rows. Times are UNIX
epoch seconds, powers watts, clocks MHz. Like all of `store/`, it never reaches `coordinator/`
(`tests/unit/test_import_graph.py`). Test: `tests/integration/test_store.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.estimator import EstimatorSettings, JobEstimator, JobStatics
from slurm_cdgpc.model.rls import RlsState

#: Jobs that hold GPUs now.
ACTIVE_STATES = ("registered", "running", "adopted")


@dataclass(frozen=True)
class BudgetChange:
    """A change of the cluster's budget, or of one power domain's limit (``domain``)."""

    id: int
    effective_at_s: float
    #: the budget, or the domain's limit
    budget_w: float
    set_by: str
    reason: str
    created_at_s: float
    #: the power domain whose limit this sets; None: the cluster's budget
    domain: str | None = None


@dataclass(frozen=True, order=True)
class JobGpu:
    node: str
    gpu_index: int


@dataclass(frozen=True)
class Job:
    job_id: str
    user: str
    #: registered (Prolog ran) | running (measured) | finished (Epilog ran) | adopted (found
    #: running without a registration, e.g. after a head outage)
    state: str
    deadline_s: float | None
    iterations_total: int | None
    iterations_done: int
    registered_at_s: float
    finished_at_s: float | None
    gpus: tuple[JobGpu, ...]
    #: Slurm's time limit and start time (None: not known)
    time_limit_s: float | None = None
    started_at_s: float | None = None
    #: who said ``iterations_total``: ``comment`` (iters=, which wins) or ``framework`` (a
    #: progress report's total); None when nobody did
    total_source: str | None = None
    #: a serving job's latency objective (``slo=p99:250ms``: 99.0, 0.25): this percentile of its
    #: request latencies stays within this many seconds; both None: not a serving job
    slo_percentile: float | None = None
    slo_latency_s: float | None = None
    #: Slurm's JobName (None: not known), from the Prolog
    job_name: str | None = None

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(sorted({g.node for g in self.gpus}))

    @property
    def work_source(self) -> str:
        return work_source(self.iterations_total, self.total_source, self.time_limit_s)

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)


@dataclass(frozen=True)
class Node:
    name: str
    url: str
    transport: str
    last_seen_s: float | None
    reachable: bool
    gpu_count: int
    gpu_type: str
    #: all the node's GPUs at their power limit: what an unreachable node is counted at
    worst_case_power_w: float


@dataclass(frozen=True)
class Measurement:
    """One GPU over one reporting period (the mean power, the energy counter at its end)."""

    time_s: float
    node: str
    gpu_index: int
    power_w: float
    job_id: str | None = None
    energy_j: float | None = None
    graphics_mhz: int | None = None
    memory_mhz: int | None = None
    iterations_per_s: float | None = None


@dataclass(frozen=True)
class Setpoint:
    """One job's clocks in one decision."""

    job_id: str
    graphics_mhz: int
    memory_mhz: int
    predicted_power_w: float


@dataclass(frozen=True)
class DecisionRecord:
    """One interval of the audit trail."""

    id: int
    time_s: float
    interval_index: int
    status: str
    mode: str
    shadow: bool
    price: float
    budget_w: float
    effective_budget_w: float
    predicted_power_w: float
    #: None until the next interval measured what the GPUs drew under this decision
    measured_power_w: float | None
    solve_s: float
    setpoints: tuple[Setpoint, ...]


# -- the model state that survives a restart ---------------------------------------------------


@dataclass(frozen=True, eq=False)
class ModelSnapshot:
    """Every job's models as `JobEstimator` holds them, row n belonging to ``job_ids[n]``."""

    job_ids: tuple[str, ...]
    family: str
    power: RlsState
    time: RlsState
    statics: JobStatics

    def __len__(self) -> int:
        return len(self.job_ids)

    @classmethod
    def of(cls, job_ids: tuple[str, ...] | list[str], estimator: JobEstimator) -> ModelSnapshot:
        if len(job_ids) != len(estimator):
            raise InputError(f"{len(job_ids)} job ids for an estimator of {len(estimator)} jobs")
        if len(set(job_ids)) != len(job_ids):
            raise InputError("job ids of a model snapshot must be unique")
        return cls(
            job_ids=tuple(job_ids),
            family=estimator.family.name,
            power=estimator.power.state(),
            time=estimator.time.state(),
            statics=estimator.statics.select(np.ones(len(estimator), dtype=bool)),
        )

    def restore(self, settings: EstimatorSettings | None = None) -> JobEstimator:
        """A new estimator in exactly the stored state (same family required)."""
        estimator = JobEstimator(settings)
        if estimator.family.name != self.family:
            raise InputError(
                f"stored models are of family {self.family!r}, the estimator uses "
                f"{estimator.family.name!r}"
            )
        estimator.add_jobs(self.statics)
        estimator.restore(self.power, self.time)
        return estimator


def work_source(
    iterations_total: int | None, total_source: str | None, time_limit_s: float | None
) -> str:
    """Where a job's total work comes from: ``comment`` (iters=), ``framework`` (a progress
    report's total), ``time-limit`` (bounded by its Slurm time limit) or ``none``."""
    if iterations_total is not None:
        return total_source or "comment"
    return "time-limit" if time_limit_s is not None else "none"
