"""Admission at job start (`judge`): would a starting job meet its deadline under the plan in
force? Read-only: it reads the last interval's prices and the controller's rules, writes
nothing, and never decides whether a job runs (the PrologSlurmctld, `slurm.admission`, and the
site's ``[admission] enforce`` do). Rule: DESIGN.md, "Admission at job start"; tests:
`tests/unit/test_admission.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import numpy as np

from slurm_cdgpc.control.empc import JobState
from slurm_cdgpc.coordinator.jobs import GpuRef
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.estimator import JobEstimator, JobStatics

if TYPE_CHECKING:
    from slurm_cdgpc.coordinator.daemon import Coordinator

FEASIBLE: Final = "feasible"
IF_OTHERS_SLOW: Final = "feasible if others slow"
INFEASIBLE: Final = "infeasible"
NO_DEADLINE: Final = "no deadline"
UNKNOWN: Final = "unknown"
VERDICTS: Final = (FEASIBLE, IF_OTHERS_SLOW, INFEASIBLE, NO_DEADLINE, UNKNOWN)


@dataclass(frozen=True)
class AdmissionRequest:
    """A starting job as the PrologSlurmctld sees it: its GPUs in all (``gpus``) over
    ``nodes``, its deadline (None: none), and what bounds its work."""

    job_id: str
    user: str
    gpus: int
    nodes: tuple[str, ...]
    deadline_s: float | None = None
    gpu_type: str | None = None
    iterations_total: int | None = None
    time_limit_s: float | None = None

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise InputError(f"job {self.job_id}: a job to admit needs at least one GPU")
        if not self.nodes:
            raise InputError(f"job {self.job_id}: a job to admit needs its nodes")


@dataclass(frozen=True)
class Admission:
    """`judge`'s answer. ``work_top_s``: the work the verdict rests on, in seconds at top
    clocks; ``finish_s`` / ``top_finish_s``: when that work ends at the clock the current price
    gives the job (``clock_mhz``) and at its top clock; ``price``: the job's price (the
    cluster's plus its power domains'). None where the verdict needed no such number."""

    verdict: str
    reason: str
    deadline_s: float | None = None
    work_top_s: float | None = None
    finish_s: float | None = None
    top_finish_s: float | None = None
    clock_mhz: int | None = None
    top_clock_mhz: int | None = None
    price: float | None = None
    gpu_type: str | None = None

    def to_dict(self) -> dict[str, object]:
        def finite(x: float | None) -> float | None:
            return x if x is not None and math.isfinite(x) else None

        return {
            "verdict": self.verdict,
            "reason": self.reason,
            "deadline_s": self.deadline_s,
            "work_top_s": self.work_top_s,
            "predicted_finish_s": finite(self.finish_s),
            "top_finish_s": finite(self.top_finish_s),
            "clock_mhz": self.clock_mhz,
            "top_clock_mhz": self.top_clock_mhz,
            "price": finite(self.price),
            "gpu_type": self.gpu_type,
        }


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h"


def job_price(coordinator: Coordinator, nodes: Sequence[str]) -> float | None:
    """The price a job on ``nodes`` pays in the last plan: the cluster's plus, for each power
    domain, its price times the share of the job's nodes under it (GPUs taken as spread evenly
    over the nodes). None: no plan yet, or the last interval planned no job."""
    report = coordinator.last_report
    if report is None or report.price is None:
        return None
    price = float(report.price)
    if not math.isfinite(price):
        return math.inf
    topology = coordinator.topology
    if report.domains and topology.names:
        under = np.zeros(len(topology))
        for node in nodes:
            for d in topology.path(node):
                under[d] += 1.0
        prices = np.array([v.price for v in report.domains], dtype=np.float64)
        if prices.shape == under.shape:
            price += float(np.sum(prices * under / len(nodes)))
    return price


def judge(coordinator: Coordinator, request: AdmissionRequest) -> Admission:
    """Would ``request``'s job meet its deadline with the plan as it stands now?

    The job is the controller's own: its prior models for its GPU type (standing for the
    models it will learn), its weight from the controller's rules (`EconomicMPC.weights`), its
    clocks bounded as the controller bounds them (the clock floor, the power limit). Its work
    W at top clocks is the time-limit rule's bound, s·L (`LimitShare`: s = 1 until 20 jobs have
    ended, 1 with ``work_from_time_limit`` off); ``iters=`` alone says steps, not seconds, until
    the job reports them. With T(x) its time model and x* its best response to the price it
    would pay now (`job_price`; 0 when nothing is planned yet: nothing competes), and slack
    D − t:

    - ``feasible``: W · T(x*) / T(top) ≤ D − t (it makes it at the clock the price gives it);
    - ``feasible if others slow``: only W · T(x_hi) / T(top) ≤ D − t (at its highest clock,
      which it gets only if the others give up power);
    - ``infeasible``: not even then;
    - ``no deadline``: nothing to check; ``unknown``: no time limit, or a GPU type the head
      does not know (its nodes have not reported).
    """
    now_s = coordinator.now_s()
    if request.deadline_s is None:
        return Admission(NO_DEADLINE, "no deadline: nothing to check")
    deadline_s = request.deadline_s
    gpu_type = request.gpu_type or coordinator.nodes.gpu_type(GpuRef(request.nodes[0], 0))
    if gpu_type is None or gpu_type not in coordinator.specs:
        where = request.gpu_type or f"the GPUs of {request.nodes[0]}"
        return Admission(UNKNOWN, f"{where}: type not known to the head yet", deadline_s=deadline_s)
    limit_s = request.time_limit_s
    if limit_s is None or not limit_s > 0:
        said = "" if request.iterations_total is None else " (iters= counts steps, not seconds)"
        return Admission(
            UNKNOWN,
            f"no time limit to bound its work{said}",
            deadline_s=deadline_s,
            gpu_type=gpu_type,
        )
    controller = coordinator.controller
    settings = controller.settings
    share = controller.limit_share.share if settings.work_from_time_limit else 1.0
    work_top_s = share * limit_s

    spec = coordinator.specs[gpu_type]
    estimator = JobEstimator(coordinator.settings.estimator)
    estimator.add_jobs(
        JobStatics.of([spec], np.zeros(1, dtype=np.intp), np.array([request.gpus], np.int64))
    )
    # the prior stands for the model the job will have: priced as a measured job, not as an
    # unmeasured one (counted at a share of its power limit, at its top clock)
    estimator.power.count[:] = 1
    nan = np.array([math.nan])
    jobs = JobState(
        gpu_type=np.array([controller.grid.type_index(gpu_type)], dtype=np.int64),
        remaining_iterations=nan
        if request.iterations_total is None
        else np.array([float(request.iterations_total)]),
        deadline_s=np.array([deadline_s]),
        time_limit_s=np.array([limit_s]),
        start_s=np.array([now_s]),
    )
    problem = controller.problem(estimator, jobs, now_s, budget_w=1e12)
    price = job_price(coordinator, request.nodes)
    x, x_m = problem.best_response(np.array([0.0 if price is None else price]))
    one = np.ones(1)
    t_top = float(estimator.predict_iteration_s(one, one)[0])
    t_price = float(estimator.predict_iteration_s(x[0], x_m[0])[0])
    t_hi = float(estimator.predict_iteration_s(problem.x_hi, problem.xm_hi)[0])
    finish_s = now_s + work_top_s * t_price / t_top
    top_finish_s = now_s + work_top_s * t_hi / t_top
    clock_mhz = round(float(x[0, 0]) * spec.max_graphics_mhz)
    top_clock_mhz = round(float(problem.x_hi[0]) * spec.max_graphics_mhz)
    work = f"work ≤ {_hours(work_top_s)} at top clocks ({share:.2f} of its {_hours(limit_s)} limit)"
    slack = f"{_hours(deadline_s - now_s)} to its deadline"
    if price is not None:
        plan = f"price {price:.3g}"
    else:
        plan = "no plan yet" if coordinator.last_report is None else "nothing else planned"
    if finish_s <= deadline_s:
        verdict = FEASIBLE
        why = f"{work} takes {_hours(finish_s - now_s)} at {clock_mhz} MHz ({plan}); {slack}"
    elif top_finish_s <= deadline_s:
        verdict = IF_OTHERS_SLOW
        why = (
            f"{work} takes {_hours(finish_s - now_s)} at {clock_mhz} MHz ({plan}), "
            f"{_hours(top_finish_s - now_s)} at {top_clock_mhz} MHz; {slack}"
        )
    else:
        verdict = INFEASIBLE
        why = f"{work} takes {_hours(top_finish_s - now_s)} even at {top_clock_mhz} MHz; {slack}"
    return Admission(
        verdict,
        why,
        deadline_s=deadline_s,
        work_top_s=work_top_s,
        finish_s=finish_s,
        top_finish_s=top_finish_s,
        clock_mhz=clock_mhz,
        top_clock_mhz=top_clock_mhz,
        price=price,
        gpu_type=gpu_type,
    )
