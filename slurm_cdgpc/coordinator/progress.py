"""Whose progress reports count (`ProgressGate`): root's or the job's user's, from one of the job's
nodes. It writes only a job's progress to the store. Rule: DESIGN.md, "Safety" (progress for
another user's job); tests: `tests/unit/test_coordinator_daemon.py`,
`tests/security/test_progress_spoofing.py`.
"""

from __future__ import annotations

import logging
import pwd
from collections.abc import Collection, Iterable, Mapping

from slurm_cdgpc.store import Job, Store
from slurm_cdgpc.wire.protocol import ExchangeResponse, ProgressReport

logger = logging.getLogger(__name__)


class ProgressGate:
    """The progress reports that count, and the last step of each job in the store.

    The agent relays any local user's report with the uid the kernel gave it; Slurm clusters
    share uids, so the job's user name maps to one here (`pwd`). Of a job's nodes, the first to
    report is the one whose steps count (each agent times its own reports, and a job's nodes are
    a step or two apart).
    """

    def __init__(self) -> None:
        self._uids: dict[str, int | None] = {}  # job user -> uid on this host
        self._spoof_logged: set[tuple[str, str, int]] = set()  # refused progress, logged once
        #: per job, the node whose progress counts: the first to report
        self._reporter: dict[str, str] = {}
        self._recorded: dict[str, int] = {}  # per job, the last step in the store

    @property
    def refused_senders(self) -> frozenset[tuple[str, str, int]]:
        """(job, node, uid) of progress refused so far (each logged once) for active jobs."""
        return frozenset(self._spoof_logged)

    def keep(self, active: Collection[str]) -> None:
        """Forget what is kept per job for jobs no longer ``active`` (a head runs for months
        of job ids)."""
        self._spoof_logged = {s for s in self._spoof_logged if s[0] in active}
        self._reporter = {j: n for j, n in self._reporter.items() if j in active}

    def ended(self, job_id: str) -> None:
        self._recorded.pop(job_id, None)

    def allowed(
        self, node: str, result: ExchangeResponse, known: Mapping[str, Job]
    ) -> list[ProgressReport]:
        """The progress reports of ``result`` (from ``node``) that count, of ``known`` jobs."""
        allowed: list[ProgressReport] = []
        for p in result.progress:
            job = known.get(p.job_id)
            if job is None:
                continue
            if node in job.nodes and p.uid in (0, self._uid(job.user)):
                if self._reporter.setdefault(p.job_id, node) == node:
                    allowed.append(p)
            elif (p.job_id, node, p.uid) not in self._spoof_logged:
                self._spoof_logged.add((p.job_id, node, p.uid))
                logger.warning(
                    "job %s: progress from uid %d on node %s ignored: only root or the job's "
                    "user %s on the job's node(s) may report it",
                    p.job_id,
                    p.uid,
                    node,
                    job.user,
                )
        return allowed

    def record(self, store: Store, allowed: Iterable[ProgressReport]) -> None:
        """Store each job's new steps (``allowed``, as `allowed` returned them), in one write."""
        new: dict[str, tuple[str, int, int | None]] = {}
        for p in allowed:
            if self._recorded.get(p.job_id) != p.step:
                new[p.job_id] = (p.job_id, p.step, p.total)
        store.record_progress_many(new.values())
        for job_id, step, _total in new.values():
            self._recorded[job_id] = step

    def _uid(self, user: str) -> int | None:
        """The uid of ``user`` on this host (None: unknown here; then only root may report)."""
        if user not in self._uids:
            try:
                self._uids[user] = pwd.getpwnam(user).pw_uid
            except KeyError:
                logger.warning(
                    "user %s is unknown on the head: only root may report progress", user
                )
                self._uids[user] = None
        return self._uids[user]
