"""The head's reconcile with Slurm's queue (`reconcile_with_slurm`): it finishes jobs Slurm no
longer runs, updates time limits and starts, and adopts jobs that never registered. What Slurm
runs is the truth. Slurm is reached only through `slurm/`, the one layer that runs its programs
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Safety" (The reconcile); test:
`tests/unit/test_coordinator_reconcile.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import tzinfo

from slurm_cdgpc.coordinator.daemon import Coordinator
from slurm_cdgpc.errors import CdgpcError
from slurm_cdgpc.slurm.comment import CommentRequest, effective_deadline, parse_comment
from slurm_cdgpc.slurm.squeue import SlurmJob
from slurm_cdgpc.store import ACTIVE_STATES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReconcileResult:
    finished: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)


def _request(job: SlurmJob, tz: tzinfo | None) -> CommentRequest:
    try:
        return parse_comment(job.comment, tz=tz)
    except CdgpcError as e:
        logger.warning("job %s: adopted without a deadline: its comment: %s", job.job_id, e)
        return CommentRequest()


def adoptable(job: SlurmJob, *, now_s: float, grace_s: float) -> bool:
    """Running long enough that its Prolog would have registered it, and holding GPUs."""
    return (
        job.state == "RUNNING"
        and bool(job.gpus)
        and job.start_s is not None
        and now_s - job.start_s > grace_s
    )


def adopt(coordinator: Coordinator, job: SlurmJob, *, tz: tzinfo | None = None) -> list[str]:
    """Register ``job`` on every node and GPU Slurm placed it, as its Prolog would have, with
    the deadline its comment asks for (else ``--deadline``, else its time limit:
    `effective_deadline`; none when the comment cannot be read) and its latency objective;
    returns the nodes registered."""
    request = _request(job, tz)
    submit_s = job.submit_s if job.submit_s is not None else job.start_s
    deadline = effective_deadline(
        request,
        submit_s=submit_s if submit_s is not None else 0.0,
        slurm_deadline_s=job.deadline_s,
        start_s=job.start_s,
        time_limit_s=job.time_limit_s,
    )
    registered = []
    for node, gpus in sorted(job.gpus.items()):
        try:
            coordinator.register_job(
                job.job_id,
                job.user,
                node,
                gpus,
                deadline_s=None if deadline is None else deadline.deadline_s,
                iterations_total=request.iterations_total,
                adopted=True,
                time_limit_s=job.time_limit_s,
                started_at_s=job.start_s,
                slo=request.slo,
            )
        except CdgpcError as e:
            logger.warning("job %s: cannot adopt on %s: %s", job.job_id, node, e)
            continue
        registered.append(node)
    if registered:
        logger.warning(
            "job %s: running in Slurm but never registered (no Prolog reached the head); "
            "adopted on %s (deadline from %s)",
            job.job_id,
            "; ".join(f"{n} GPUs {','.join(map(str, job.gpus[n]))}" for n in registered),
            "nothing" if deadline is None else deadline.source,
        )
    return registered


def deregister_gone(
    coordinator: Coordinator, slurm_running: Collection[str], *, grace_s: float
) -> list[str]:
    """Deregister active jobs that Slurm no longer runs: their Epilog never reached us (a
    node crashed, the head was away and the spool was lost). A job registered less than
    ``grace_s`` ago is left alone: squeue may not list it yet. Returns the ids removed."""
    now_s = coordinator.now_s()
    gone = [
        job.job_id
        for job in coordinator.store.jobs(ACTIVE_STATES)
        if job.job_id not in slurm_running and now_s - job.registered_at_s > grace_s
    ]
    for job_id in gone:
        logger.warning("job %s: no longer running in Slurm; deregistered", job_id)
        coordinator.deregister_job(job_id)
    return gone


def reconcile_with_slurm(
    coordinator: Coordinator,
    running: Mapping[str, SlurmJob],
    *,
    now_s: float,
    grace_s: float,
    tz: tzinfo | None = None,
) -> ReconcileResult:
    """One reconcile pass: finish what Slurm no longer runs, take Slurm's time limit and start
    where they differ from the registration's (they bound the work of a job that does not say
    its own), and adopt what it runs unregistered for longer than ``grace_s``."""
    finished = deregister_gone(coordinator, running.keys(), grace_s=grace_s)
    # one read for the jobs registered now; only the rest (rare) are looked up one by one,
    # for a finished job must not be adopted again either
    registered = {job.job_id: job for job in coordinator.store.jobs(ACTIVE_STATES)}
    for job_id, job in registered.items():
        slurm = running.get(job_id)
        if slurm is not None and (
            (slurm.time_limit_s, slurm.start_s) != (job.time_limit_s, job.started_at_s)
        ):
            # a limit the Prolog could not read, or one changed since (scontrol update)
            coordinator.store.record_time_limit(job_id, slurm.time_limit_s, slurm.start_s)
    active = registered.keys()
    adopted = [
        job.job_id
        for job in running.values()
        if job.job_id not in active
        and adoptable(job, now_s=now_s, grace_s=grace_s)
        and coordinator.store.job(job.job_id) is None
        and adopt(coordinator, job, tz=tz)
    ]
    return ReconcileResult(finished, adopted)
