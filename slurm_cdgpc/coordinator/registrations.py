"""The API's write path (`Registrations`): nodes and jobs into the store, jobs in group commits, so
that a burst of Prologs pays one durable commit and each is answered once its own has committed.
It writes the store and nothing else. Design: DESIGN.md, "The head's API" (Group commit); tests:
`tests/integration/test_registration_commit.py`, `tests/unit/test_coordinator_api.py`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from slurm_cdgpc.coordinator.nodes import catalog_max_w
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.gpu.catalog import GpuSpec, catalog_spec
from slurm_cdgpc.slurm.comment import LatencyObjective
from slurm_cdgpc.store import Job, Node, Store, StoreBusyError
from slurm_cdgpc.store.group_commit import GroupCommit, WouldBlockError
from slurm_cdgpc.store.repository import JobRegistration
from slurm_cdgpc.transport.ssh import ssh_url

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Registration:
    """One `Registrations.register_job` call, checked, waiting for its batch."""

    job_id: str
    user: str
    node: str
    gpus: tuple[int, ...]
    spec: GpuSpec | None
    deadline_s: float | None
    iterations_total: int | None
    adopted: bool = False
    #: who sent it (the API's authenticated principal), for the log line
    sender: object = None
    #: Slurm's time limit and start time, when the Prolog (or squeue) said
    time_limit_s: float | None = None
    started_at_s: float | None = None
    #: a serving job's latency objective (the comment's ``slo=``)
    slo: LatencyObjective | None = None
    #: Slurm's JobName, when the Prolog read it
    job_name: str | None = None

    @classmethod
    def checked(
        cls,
        job_id: str,
        user: str,
        node: str,
        gpus: Sequence[int],
        *,
        gpu_type: str | None = None,
        deadline_s: float | None = None,
        iterations_total: int | None = None,
        adopted: bool = False,
        sender: object = None,
        time_limit_s: float | None = None,
        started_at_s: float | None = None,
        slo: LatencyObjective | None = None,
        job_name: str | None = None,
    ) -> Registration:
        """The registration, or `InputError` (no GPUs, an unknown GPU type) before it queues."""
        if not gpus:
            raise InputError(f"job {job_id}: no GPUs on node {node}")
        spec = None if gpu_type is None else catalog_spec(gpu_type)
        return cls(
            job_id,
            user,
            node,
            tuple(gpus),
            spec,
            deadline_s,
            iterations_total,
            adopted,
            sender,
            time_limit_s,
            started_at_s,
            slo,
            job_name,
        )

    def for_store(self) -> JobRegistration:
        """What the store keeps of it: this node's GPUs, the objective as its two numbers."""
        slo = self.slo
        return JobRegistration(
            self.job_id,
            self.user,
            {self.node: self.gpus},
            deadline_s=self.deadline_s,
            iterations_total=self.iterations_total,
            adopted=self.adopted,
            time_limit_s=self.time_limit_s,
            started_at_s=self.started_at_s,
            slo_percentile=None if slo is None else slo.percentile,
            slo_latency_s=None if slo is None else slo.latency_s,
            job_name=self.job_name,
        )

    def log(self) -> None:
        """One line per registration, with its sender when it came through the API."""
        logger.info(
            "job %s: registered by %s on %s GPU(s) %s (deadline %s, %s iterations%s)%s%s",
            self.job_id,
            self.user,
            self.node,
            ",".join(map(str, self.gpus)),
            self.deadline_s,
            self.iterations_total,
            ""
            if self.slo is None
            else f", p{self.slo.percentile:g} within {self.slo.latency_s:g} s",
            "" if self.sender is None else ", sent by ",
            "" if self.sender is None else self.sender,
        )


class Registrations:
    """Node and job registrations into one `Store`; ``committed`` is called (on the committing
    thread) after each batch that registered a job. Any thread may call; writes that read then
    write the store hold one lock. The loop takes the jobs from the store at its next interval."""

    def __init__(
        self,
        store: Store,
        *,
        node_transport: str,
        agent_port: int,
        committed: Callable[[], None],
    ) -> None:
        self.store = store
        #: how agents of nodes first seen in a registration are reached: http or ssh
        self._node_transport = node_transport
        self._agent_port = agent_port
        self._committed = committed
        self._write_lock = threading.Lock()  # API writes that read-then-write the store
        #: the job registrations' batches (`GroupCommit.batches`, `largest_batch`: metrics)
        self.group_commit = GroupCommit(self._register_batch)
        self._typed_nodes: dict[str, str] = {}  # committed nodes with a GPU type (registration)

    def agent_url(self, node: str) -> str:
        """The agent URL of a node first seen in a registration: ``http://<node>:<listen_port>``,
        or `ssh_url` with ``node.transport = ssh``; an announce (`register_node`) names its own."""
        if self._node_transport == "ssh":
            return ssh_url(node)
        return f"http://{node}:{self._agent_port}"

    def register_node(self, name: str, url: str, gpu_type: str | None = None) -> Node:
        """Announce a node's agent URL (and optionally its GPU type until it reports)."""
        spec = None if gpu_type is None else catalog_spec(gpu_type)
        with self._write_lock:
            known = {n.name: n for n in self.store.nodes()}.get(name)
            node = self.store.upsert_node(
                name,
                url,
                gpu_count=known.gpu_count if known else 0,
                gpu_type=(known.gpu_type if known and known.gpu_type else "")
                or (spec.name if spec else ""),
                worst_case_power_w=known.worst_case_power_w if known else 0.0,
                reachable=known.reachable if known else False,
                last_seen_s=known.last_seen_s if known else None,
            )
        logger.info("node %s: agent at %s", name, url)
        return node

    def register_job(self, registration: Registration) -> Job:
        """Commit ``registration`` (with whatever else is queued) and return its job; a
        registration refused on its own (another user's job id) fails alone."""
        if self.store.in_transaction():  # the caller's transaction commits it, not a batch
            [outcome] = self._register_batch([registration])
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        return self.group_commit.submit(registration)

    def register_job_later(
        self,
        then: Callable[[Callable[[], Job]], None],
        registration: Registration,
        *,
        lead: bool = True,
    ) -> None:
        """`register_job` without waiting: once committed (or refused), ``then(outcome)`` is
        called, where ``outcome()`` returns the job or raises, on the thread that committed the
        batch (this one when none was in progress). ``then`` must not block. ``lead=False``:
        only queue it, even with no batch in progress, for `commit_queued`."""
        self.group_commit.submit_later(registration, then, lead=lead)

    def commit_queued(self, *, wait: bool) -> bool:
        """Commit the registrations queued with ``lead=False``, unless a batch is in progress
        (its leader takes them). ``wait=False`` (an event loop's thread): if another writer
        holds the store, commit nothing and return False; they are then to be committed by a
        thread that may wait, with ``wait=True``."""
        if wait:
            return self.group_commit.lead_queued()
        return self.group_commit.lead_queued(self._register_batch_now)

    def _register_batch_now(self, batch: Sequence[Registration]) -> list[Job | Exception]:
        return self._register_batch(batch, wait=False)

    def _register_batch(
        self, batch: Sequence[Registration], *, wait: bool = True
    ) -> list[Job | Exception]:
        """Register ``batch`` in one transaction; a refusal (`InputError`) is returned in place of
        its job and changes nothing of it. Raises, committing nothing, if the store fails.
        ``wait=False``: raises `WouldBlockError`, having done nothing, rather than wait for
        another writer (this head's, or another process's)."""
        outcomes: list[Job | Exception | None] = [None] * len(batch)
        if not self._write_lock.acquire(blocking=wait):
            raise WouldBlockError
        try:
            with self.store.transaction(wait=wait):
                refused, typed = self._register_nodes(batch)
                accepted = [i for i, r in enumerate(batch) if r.node not in refused]
                for i, r in enumerate(batch):
                    if r.node in refused:
                        outcomes[i] = refused[r.node]
                registered = self.store.register_jobs([batch[i].for_store() for i in accepted])
                for i, outcome in zip(accepted, registered, strict=True):
                    outcomes[i] = outcome
            if not self.store.in_transaction():  # committed: later batches may rely on it
                self._typed_nodes.update(typed)
        except StoreBusyError:
            raise WouldBlockError from None
        finally:
            self._write_lock.release()
        for r, o in zip(batch, outcomes, strict=True):
            if isinstance(o, Job):
                r.log()
                self._committed()
        return [o for o in outcomes if o is not None]

    def _register_nodes(
        self, batch: Sequence[Registration]
    ) -> tuple[dict[str, InputError], dict[str, str]]:
        """Make the batch's nodes known (the agent URL by convention) and name the GPU type of
        those that have none yet. Returns the nodes the store refused (with why), and the nodes
        now known with a GPU type: a node never loses its type, so a later batch on them needs
        no read at all (`_typed_nodes`)."""
        unseen = {r.node for r in batch if r.node not in self._typed_nodes}
        known = self.store.nodes_named(unseen) if unseen else {}
        typed = {name: node.gpu_type for name, node in known.items() if node.gpu_type}
        new: dict[str, Node] = {}
        named: dict[str, str] = {}
        for r in batch:
            node, spec = known.get(r.node), r.spec
            if r.node in unseen and node is None and r.node not in new:
                limit_w = spec.power_limit.max_w if spec else catalog_max_w()
                new[r.node] = Node(
                    name=r.node,
                    url=self.agent_url(r.node),
                    transport="http",
                    last_seen_s=None,
                    reachable=False,
                    gpu_count=0,
                    gpu_type=spec.name if spec else "",
                    worst_case_power_w=limit_w * (max(r.gpus) + 1),
                )
                continue
            if spec is None:
                continue
            gpu_type = self._typed_nodes.get(r.node) or typed.get(r.node) or named.get(r.node)
            if r.node in new:
                gpu_type = gpu_type or new[r.node].gpu_type
            if not gpu_type:
                named[r.node] = spec.name
                logger.info("node %s: GPU type %s named by job %s", r.node, spec.name, r.job_id)
            elif gpu_type != spec.name:
                logger.warning(
                    "job %s: registration names %s GPUs, node %s reports %s: using %s",
                    r.job_id,
                    spec.name,
                    r.node,
                    gpu_type,
                    gpu_type,
                )
        added = self.store.add_nodes(list(new.values()))
        refused = {
            name: outcome
            for name, outcome in zip(new, added, strict=True)
            if isinstance(outcome, InputError)
        }
        typed.update(
            (n.name, n.gpu_type) for n in new.values() if n.gpu_type and n.name not in refused
        )
        named = {name: gpu_type for name, gpu_type in named.items() if name not in refused}
        self.store.name_gpu_types(named)
        typed.update(named)
        return refused, typed
