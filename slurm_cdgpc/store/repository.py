"""`Store`: every read and write the daemons and ``cdgpc-admin`` make, each one transaction, several
atomic together with ``store.transaction()``; it returns frozen records
(`slurm_cdgpc.store.records`), never ORM rows. It records and never decides: it never reaches
`coordinator/` (`tests/unit/test_import_graph.py`). Tests: `tests/integration/test_store.py`,
`tests/faults/test_store_faults.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any, TypeVar, cast

import numpy as np
from sqlalchemy import (
    ColumnElement,
    Connection,
    CursorResult,
    Engine,
    Row,
    Table,
    bindparam,
    delete,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, selectinload

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.estimator import JobStatics
from slurm_cdgpc.model.families import TIME_PARAMS, power_family
from slurm_cdgpc.model.rls import RlsState
from slurm_cdgpc.store.codec import decode_f64, encode_f64, vector_length
from slurm_cdgpc.store.engine import (
    NOWAIT,
    WRITE,
    StoreBusyError,
    StoreError,
    is_busy,
    translated_errors,
)
from slurm_cdgpc.store.records import (
    BudgetChange,
    DecisionRecord,
    Job,
    JobGpu,
    Measurement,
    ModelSnapshot,
    Node,
    Setpoint,
)
from slurm_cdgpc.store.schema import (
    JOB_STATES,
    STATIC_FLOATS,
    TRANSPORTS,
    Base,
    BudgetChangeRow,
    DecisionRow,
    JobGpuRow,
    JobModelRow,
    JobRow,
    MeasurementRow,
    NodeRow,
    SetpointRow,
)
from slurm_cdgpc.wire import names

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: keys per ``IN (…)`` list (SQLite allows 32766 parameters); a power of two, see `_chunks`
_CHUNK = 1024
_MAX_REASON = 1000
_JOBS: Table = cast(Table, JobRow.__table__)
_JOB_GPUS: Table = cast(Table, JobGpuRow.__table__)
_NODES: Table = cast(Table, NodeRow.__table__)
#: times a batch of registrations starts over after racing another writer on a new job id
_REGISTER_ATTEMPTS = 3


@dataclasses.dataclass(frozen=True)
class JobRegistration:
    """The arguments of one `Store.register_job` call (see there), for `Store.register_jobs`."""

    job_id: str
    user: str
    gpus: Mapping[str, Iterable[int]]
    deadline_s: float | None = None
    iterations_total: int | None = None
    adopted: bool = False
    at_s: float | None = None
    time_limit_s: float | None = None
    started_at_s: float | None = None
    slo_percentile: float | None = None
    slo_latency_s: float | None = None
    job_name: str | None = None


class _RegistrationRaceError(Exception):
    """A job id that was not in the table when the batch read it was there when it wrote."""


class Store:
    """The head's database: budget history, jobs, nodes, models, measurements, decisions."""

    def __init__(self, engine: Engine, clock: Callable[[], float] = time.time) -> None:
        self.engine = engine
        self._clock = clock
        self._session: ContextVar[Session | None] = ContextVar(f"cdgpc-store-{id(self)}")

    # -- transactions ----------------------------------------------------------------------

    @contextmanager
    def transaction(self, *, wait: bool = True) -> Iterator[Connection]:
        """Every store call inside the block commits together at its end, or not at all. Yields
        the transaction's connection, for a statement of the caller's own to join it (the
        leader lock's renewal, `LeaderLock.confirm`).

        ``wait=False`` (a thread that must not block: the API's event loop) raises
        `StoreBusyError` before the block runs, having done nothing, when another writer holds
        SQLite's write lock; on PostgreSQL, where every statement is a round trip to a server
        that may itself wait, always."""
        with self._begin(write=True, wait=wait) as session:
            yield session.connection()

    @contextmanager
    def _begin(self, *, write: bool, wait: bool = True) -> Iterator[Session]:
        joined = self._session.get(None)
        if joined is not None:
            yield joined
            return
        if not wait and self.engine.dialect.name != "sqlite":
            raise StoreBusyError(f"store: a {self.engine.dialect.name} transaction may wait")
        with (
            translated_errors("store"),
            self.engine.connect() as connection,
        ):
            connection.execution_options(**{WRITE: write, NOWAIT: not wait})  # in place
            try:
                transaction = connection.begin()
            except SQLAlchemyError as e:
                if not wait and is_busy(e):
                    raise StoreBusyError("store: another writer holds the database") from None
                raise
            with transaction, Session(bind=connection, expire_on_commit=False) as session:
                token = self._session.set(session)
                try:
                    yield session
                    session.flush()
                finally:
                    self._session.reset(token)

    def checkpoint(self) -> None:
        """SQLite: copy the write-ahead log into the database, as far as no reader needs it
        (``PASSIVE``: it waits for nobody, and writers go on meanwhile). PostgreSQL: nothing."""
        if self.engine.dialect.name != "sqlite":
            return
        with translated_errors("store checkpoint"), self.engine.connect() as connection:
            connection.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")

    def in_transaction(self) -> bool:
        """Whether this thread (context) is inside `transaction`: its writes are not durable
        until that block ends."""
        return self._session.get(None) is not None

    def _now(self, at_s: float | None) -> float:
        return self._clock() if at_s is None else _finite(at_s, "time")

    # -- budget ----------------------------------------------------------------------------

    def set_budget(
        self,
        budget_w: float,
        user: str,
        *,
        effective_at_s: float | None = None,
        reason: str = "",
        domain: str | None = None,
    ) -> BudgetChange:
        """Record a budget change, or with ``domain`` a change of that power domain's limit,
        effective now or at ``effective_at_s`` (may be in the future). Whether the domain exists
        and its limit fits its parent's and children's is the head's to check (the topology)."""
        if not (math.isfinite(budget_w) and budget_w > 0):
            what = "budget" if domain is None else f"power domain {domain!r}: limit"
            raise InputError(f"{what} must be a positive number of watts, got {budget_w!r}")
        names.account(user)
        if domain is not None:
            names.node_name(domain, "power domain")  # a domain's name is a node name's grammar
        if len(reason) > _MAX_REASON:
            raise InputError(f"reason is longer than {_MAX_REASON} characters")
        now = self._clock()
        row = BudgetChangeRow(
            effective_at_s=now if effective_at_s is None else _finite(effective_at_s, "time"),
            budget_w=float(budget_w),
            set_by=user,
            reason=reason,
            created_at_s=now,
            domain=domain,
        )
        with self._begin(write=True) as session:
            session.add(row)
            session.flush()
            logger.info(
                "%s %.0f W set by %s, effective %s",
                "budget" if domain is None else f"power domain {domain} limit",
                budget_w,
                user,
                row.effective_at_s,
            )
            return _budget(row)

    def current_budget(self, at_s: float | None = None) -> BudgetChange | None:
        """The cluster's budget change in force at ``at_s`` (default now); None if no budget was
        ever set. A power domain's limit is never the budget (`domain_limits`)."""
        at = self._now(at_s)
        query = (
            select(BudgetChangeRow)
            .where(BudgetChangeRow.domain.is_(None), BudgetChangeRow.effective_at_s <= at)
            .order_by(BudgetChangeRow.effective_at_s.desc(), BudgetChangeRow.id.desc())
            .limit(1)
        )
        with self._begin(write=False) as session:
            row = session.scalars(query).first()
            return None if row is None else _budget(row)

    def budget_history(self, since_s: float | None = None) -> list[BudgetChange]:
        """Every change of the cluster's budget in effective order (scheduled ones included),
        optionally from a time."""
        return self._changes(BudgetChangeRow.domain.is_(None), since_s)

    def domain_limits(self, at_s: float | None = None) -> dict[str, BudgetChange]:
        """Each power domain's limit in force at ``at_s`` (default now), by domain: its latest
        change effective at or before then (at the same instant, the later one set). A domain
        never set is absent: its limit is the topology file's."""
        at = self._now(at_s)
        query = (
            select(BudgetChangeRow)
            .where(BudgetChangeRow.domain.is_not(None), BudgetChangeRow.effective_at_s <= at)
            .order_by(BudgetChangeRow.effective_at_s, BudgetChangeRow.id)
        )
        with self._begin(write=False) as session:
            # the last row of each domain wins; a site sets few limits, so all rows are read
            return {row.domain: _budget(row) for row in session.scalars(query) if row.domain}

    def domain_limit_history(self, since_s: float | None = None) -> list[BudgetChange]:
        """Every change of a power domain's limit in effective order (scheduled ones included),
        optionally from a time."""
        return self._changes(BudgetChangeRow.domain.is_not(None), since_s)

    def _changes(self, which: ColumnElement[bool], since_s: float | None) -> list[BudgetChange]:
        """The budget changes ``which`` selects, in effective order, optionally from a time."""
        query = (
            select(BudgetChangeRow)
            .where(which)
            .order_by(BudgetChangeRow.effective_at_s, BudgetChangeRow.id)
        )
        if since_s is not None:
            query = query.where(BudgetChangeRow.effective_at_s >= since_s)
        with self._begin(write=False) as session:
            return [_budget(row) for row in session.scalars(query)]

    # -- jobs ------------------------------------------------------------------------------

    def register_job(
        self,
        job_id: str,
        user: str,
        gpus: Mapping[str, Iterable[int]],
        *,
        deadline_s: float | None = None,
        iterations_total: int | None = None,
        adopted: bool = False,
        at_s: float | None = None,
        time_limit_s: float | None = None,
        started_at_s: float | None = None,
        slo_percentile: float | None = None,
        slo_latency_s: float | None = None,
        job_name: str | None = None,
    ) -> Job:
        """Record a job and its GPUs on the given node(s); idempotent.

        The Prolog runs on every node of a job and registers that node's GPUs: each call
        replaces the GPU set of the nodes it names and keeps the others, so a retried Prolog
        changes nothing and a multi-node job collects its nodes. A finished job registered
        again was requeued by Slurm (same id): it starts over with only the new GPUs, unless
        ``at_s`` (when the Prolog ran, for spooled registrations) is not after it finished.
        Deadline, iteration count (from the comment: it wins over a framework's), time limit,
        start, latency objective (``slo_percentile`` with ``slo_latency_s``, both or
        neither) and Slurm's job name are updated when given.
        """
        registration = JobRegistration(
            job_id,
            user,
            gpus,
            deadline_s=deadline_s,
            iterations_total=iterations_total,
            adopted=adopted,
            at_s=at_s,
            time_limit_s=time_limit_s,
            started_at_s=started_at_s,
            slo_percentile=slo_percentile,
            slo_latency_s=slo_latency_s,
            job_name=job_name,
        )
        [outcome] = self.register_jobs([registration])
        if isinstance(outcome, InputError):
            raise outcome
        return outcome

    def register_jobs(self, registrations: Sequence[JobRegistration]) -> list[Job | InputError]:
        """`register_job` for each registration, in order, in one transaction.

        Each outcome is what `register_job` would have returned or raised, made alone in that
        order: a refused registration (another user's job id, a malformed field) changes nothing
        and is returned in its place; the others are stored. Raises `StoreError`, storing
        nothing, if the database fails.

        A fixed handful of statements per call, whatever the number of registrations: SQLAlchemy
        Core with many parameter sets, not ORM objects, because this is the head's hottest write
        (every Prolog of every job) and its cost per statement dwarfs the database's.
        """
        outcomes: list[Job | InputError | None] = [None] * len(registrations)
        checked: list[tuple[int, JobRegistration, list[dict[str, Any]], float]] = []
        for i, r in enumerate(registrations):
            try:
                names.job_id(r.job_id)
                names.account(r.user)
                new_gpus = _gpu_rows(r.job_id, r.gpus)
                if r.deadline_s is not None:
                    _finite(r.deadline_s, "deadline")
                if r.iterations_total is not None and r.iterations_total < 0:
                    raise InputError(f"iterations must be ≥ 0, got {r.iterations_total}")
                if r.time_limit_s is not None and not (
                    math.isfinite(r.time_limit_s) and r.time_limit_s > 0
                ):
                    raise InputError(f"time limit must be > 0 s, got {r.time_limit_s}")
                if r.started_at_s is not None:
                    _finite(r.started_at_s, "start time")
                _check_slo(r.slo_percentile, r.slo_latency_s)
                if r.job_name is not None:
                    names.job_name(r.job_name)
                checked.append((i, r, new_gpus, self._now(r.at_s)))
            except InputError as e:
                outcomes[i] = e
        if checked:
            with self._begin(write=True) as session:
                session.flush()  # a joined transaction's pending ORM changes come first
                sql = _JobSql.of(session)
                for attempt in range(_REGISTER_ATTEMPTS):
                    try:
                        with sql.attempt(session):
                            _register_checked(session, sql, checked, outcomes)
                        break
                    except _RegistrationRaceError:
                        # PostgreSQL: another writer inserted one of our new job ids after we
                        # looked; start over from the savepoint, now seeing that row
                        logger.info("job registration raced another writer (attempt %d)", attempt)
                        if not sql.may_race:  # no savepoint to start over from
                            raise StoreError("job registration raced another writer") from None
                else:
                    raise StoreError("job registration kept racing another writer; try again")
                if session.identity_map:  # rows a joined transaction loaded may be stale now
                    session.expire_all()
        return [o for o in outcomes if o is not None]

    def start_job(self, job_id: str) -> Job | None:
        """A registered job was seen running (its first measurements); None if unknown."""
        return self._update_job(job_id, lambda row: _set_state(row, "running", "registered"))

    def record_progress(
        self, job_id: str, iterations_done: int, iterations_total: int | None = None
    ) -> Job | None:
        """The job's own progress report; None if the job is unknown. A reported total (a
        framework's) never replaces the comment's ``iters=``."""
        self.record_progress_many([(job_id, iterations_done, iterations_total)])
        return self.job(job_id)

    def record_progress_many(self, reports: Iterable[tuple[str, int, int | None]]) -> None:
        """What `record_progress` does for each (job id, iterations done, total or None), in one
        transaction: the head records every job's new step each interval, and a transaction
        per job cost it about a millisecond each on SQLite. Unknown jobs change nothing."""
        # one lock order for every writer (by job: a total may be None, which has no order)
        rows = sorted(set(reports), key=lambda report: report[0])
        for job_id, done, total in rows:
            names.job_id(job_id)
            if done < 0 or (total is not None and total < 0):
                raise InputError("iteration counts must be ≥ 0")
        if not rows:
            return
        key = _JOBS.c.job_id == bindparam("key")
        with self._begin(write=True) as session:
            connection = session.connection()
            connection.execute(
                update(_JOBS).where(key).values(iterations_done=bindparam("done")),
                [{"key": job_id, "done": done} for job_id, done, _ in rows],
            )
            totals = [{"key": j, "total": total} for j, _, total in rows if total is not None]
            if totals:  # a framework's total never replaces the comment's iters=
                connection.execute(
                    update(_JOBS)
                    .where(key, _JOBS.c.total_source.is_distinct_from("comment"))
                    .values(iterations_total=bindparam("total"), total_source="framework"),
                    totals,
                )

    def record_time_limit(
        self, job_id: str, time_limit_s: float | None, started_at_s: float | None
    ) -> Job | None:
        """What Slurm says of a registered job's time limit and start (the reconcile); None if
        the job is unknown."""
        if time_limit_s is not None and not (math.isfinite(time_limit_s) and time_limit_s > 0):
            raise InputError(f"time limit must be > 0 s, got {time_limit_s}")

        def times(row: JobRow) -> None:
            row.time_limit_s = time_limit_s
            if started_at_s is not None:
                row.started_at_s = started_at_s

        return self._update_job(job_id, times)

    def finish_job(self, job_id: str, at_s: float | None = None) -> Job | None:
        """The Epilog ran (on any of the job's nodes) at ``at_s``; idempotent. None if the job is
        unknown. A spooled Epilog older than the job's registration (it belongs to the run
        before a requeue) changes nothing."""
        now = self._now(at_s)

        def finish(row: JobRow) -> None:
            if row.state == "finished":
                return
            if now < row.registered_at_s:
                logger.info("job %s: Epilog from before its registration ignored", job_id)
                return
            row.state, row.finished_at_s = "finished", now

        return self._update_job(job_id, finish)

    def _update_job(self, job_id: str, change: Callable[[JobRow], None]) -> Job | None:
        names.job_id(job_id)
        with self._begin(write=True) as session:
            row = session.scalars(
                select(JobRow).where(JobRow.job_id == job_id).with_for_update()
            ).one_or_none()
            if row is None:
                logger.info("job %s: not registered", job_id)
                return None
            change(row)
            session.flush()
            return _job(row)

    def job(self, job_id: str) -> Job | None:
        with self._begin(write=False) as session:
            row = session.get(JobRow, job_id, options=[selectinload(JobRow.gpus)])
            return None if row is None else _job(row)

    def jobs(self, state: str | Iterable[str] | None = None) -> list[Job]:
        """Jobs by registration time, optionally in one or several states (`ACTIVE_STATES`)."""
        query = (
            select(JobRow)
            .options(selectinload(JobRow.gpus))
            .order_by(JobRow.registered_at_s, JobRow.job_id)
        )
        if state is not None:
            states = {state} if isinstance(state, str) else set(state)
            unknown = states - set(JOB_STATES)
            if unknown:
                raise InputError(
                    f"unknown job state {sorted(unknown)[0]!r} (known: {', '.join(JOB_STATES)})"
                )
            query = query.where(JobRow.state.in_(sorted(states)))
        with self._begin(write=False) as session:
            return [_job(row) for row in session.scalars(query)]

    # -- nodes -----------------------------------------------------------------------------

    def upsert_node(
        self,
        name: str,
        url: str,
        *,
        gpu_count: int,
        gpu_type: str,
        worst_case_power_w: float,
        transport: str = "http",
        reachable: bool = True,
        last_seen_s: float | None = None,
    ) -> Node:
        """Add or update a node (an agent announced itself)."""
        names.node_name(name)
        if transport not in TRANSPORTS:
            raise InputError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if gpu_count < 0:
            raise InputError(f"GPU count must be ≥ 0, got {gpu_count}")
        if not (math.isfinite(worst_case_power_w) and worst_case_power_w >= 0):
            raise InputError(f"worst-case power must be ≥ 0 W, got {worst_case_power_w!r}")
        if last_seen_s is None and reachable:
            last_seen_s = self._clock()
        values = {
            "url": url,
            "transport": transport,
            "last_seen_s": last_seen_s,
            "reachable": reachable,
            "gpu_count": gpu_count,
            "gpu_type": gpu_type,
            "worst_case_power_w": float(worst_case_power_w),
        }
        with self._begin(write=True) as session:
            statement = _upsert(session, NodeRow).values(name=name, **values)
            session.execute(
                statement.on_conflict_do_update(
                    index_elements=["name"],
                    set_={key: statement.excluded[key] for key in values},
                )
            )
            row = session.scalars(
                select(NodeRow)
                .where(NodeRow.name == name)
                .execution_options(populate_existing=True)
            ).one()
            return _node(row)

    def add_nodes(self, nodes: Sequence[Node]) -> list[Node | InputError]:
        """Add nodes not known yet, as given; a node already known is left as it is (a job's
        first registration makes its node known). Per node, in order: the record, or the
        `InputError` that refused it alone."""
        outcomes: list[Node | InputError] = []
        rows = []
        for node in nodes:
            try:
                names.node_name(node.name)
                if node.transport not in TRANSPORTS:
                    raise InputError(f"transport must be one of {', '.join(TRANSPORTS)}")
                if node.gpu_count < 0:
                    raise InputError(f"GPU count must be ≥ 0, got {node.gpu_count}")
                if not (math.isfinite(node.worst_case_power_w) and node.worst_case_power_w >= 0):
                    raise InputError(
                        f"worst-case power must be ≥ 0 W, got {node.worst_case_power_w!r}"
                    )
            except InputError as e:
                outcomes.append(e)
                continue
            outcomes.append(node)
            rows.append(dataclasses.asdict(node))
        if rows:
            with self._begin(write=True) as session:
                session.connection().execute(
                    _upsert(session, _NODES).on_conflict_do_nothing(index_elements=["name"]), rows
                )
        return outcomes

    def name_gpu_types(self, gpu_types: Mapping[str, str]) -> None:
        """Record each node's GPU type (catalog name) unless the node already has one: a
        registration may name it before the node's agent has reported."""
        if not gpu_types:
            return
        with self._begin(write=True) as session:
            session.connection().execute(
                update(_NODES)
                .where(_NODES.c.name == bindparam("key"), _NODES.c.gpu_type == "")
                .values(gpu_type=bindparam("type")),
                [{"key": name, "type": gpu_type} for name, gpu_type in gpu_types.items()],
            )

    def mark_nodes(
        self, seen: Iterable[str], lost: Iterable[str] = (), at_s: float | None = None
    ) -> None:
        """The head's exchanges with ``seen`` succeeded (their ``last_seen_s`` moves) and those
        with ``lost`` failed: one transaction for the whole round, a statement per
        `_chunks` of names: a transaction per node cost the head about a millisecond per node
        and interval on SQLite. Unknown names change nothing."""
        now = self._now(at_s)
        reached, failed = sorted(set(seen)), sorted(set(lost))
        if not (reached or failed):
            return
        with self._begin(write=True) as session:
            connection = session.connection()
            for chunk in _chunks(reached):
                connection.execute(
                    update(_NODES)
                    .where(_NODES.c.name.in_(chunk))
                    .values(reachable=True, last_seen_s=now)
                )
            for chunk in _chunks(failed):
                connection.execute(
                    update(_NODES).where(_NODES.c.name.in_(chunk)).values(reachable=False)
                )

    def nodes(self) -> list[Node]:
        with self._begin(write=False) as session:
            return [_node(r) for r in session.scalars(select(NodeRow).order_by(NodeRow.name))]

    def nodes_named(self, names: Iterable[str]) -> dict[str, Node]:
        """The known nodes among ``names``, by name: what a registration needs, without reading
        every node of the cluster."""
        wanted = sorted(set(names))
        with self._begin(write=False) as session:
            connection = session.connection()
            return {
                row.name: _node(row)
                for chunk in _chunks(wanted)
                for row in connection.execute(select(_NODES).where(_NODES.c.name.in_(chunk)))
            }

    # -- model state -----------------------------------------------------------------------

    def save_models(self, snapshot: ModelSnapshot, at_s: float | None = None) -> int:
        """Store (replace) the models of every job in the snapshot; returns the row count."""
        now = self._now(at_s)
        with self._begin(write=True) as session:
            missing = set(snapshot.job_ids) - _existing_jobs(session, snapshot.job_ids)
            if missing:
                raise InputError(f"models for unregistered job(s): {', '.join(sorted(missing))}")
            rows = _model_rows(snapshot, now)
            if not rows:
                return 0
            statement = _upsert(session, JobModelRow)
            session.execute(
                statement.on_conflict_do_update(
                    index_elements=["job_id"],
                    set_={key: statement.excluded[key] for key in rows[0] if key != "job_id"},
                ),
                rows,
            )
            return len(rows)

    def load_models(self, family: str, job_ids: Sequence[str] | None = None) -> ModelSnapshot:
        """The stored models of ``family``, for ``job_ids`` (in that order) or for every job.

        Jobs without stored models, or with models of another family (the configuration
        changed), are left out: compare ``snapshot.job_ids`` and start those from a prior.
        """
        k_power = power_family(family).n_params
        with self._begin(write=False) as session:
            query = select(JobModelRow)
            if job_ids is None:
                found = list(session.scalars(query.order_by(JobModelRow.job_id)))
            else:
                by_id = {
                    row.job_id: row
                    for chunk in _chunks(job_ids)
                    for row in session.scalars(query.where(JobModelRow.job_id.in_(chunk)))
                }
                found = [by_id[j] for j in job_ids if j in by_id]
        rows = [row for row in found if row.family == family]
        if len(rows) < len(found):
            logger.info(
                "%d stored model(s) of another family than %s ignored",
                len(found) - len(rows),
                family,
            )
        return _snapshot(rows, family, k_power)

    # -- measurements ----------------------------------------------------------------------

    def record_measurements(self, samples: Iterable[Measurement]) -> int:
        """Append samples (all or none); NaN in an optional field is stored as None."""
        rows = [
            {
                "time_s": _number(m.time_s, "measurement time"),
                "node": m.node,
                "gpu_index": m.gpu_index,
                "job_id": m.job_id,
                "power_w": _number(m.power_w, f"power of {m.node} GPU {m.gpu_index}"),
                "energy_j": _optional(m.energy_j),
                "graphics_mhz": m.graphics_mhz,
                "memory_mhz": m.memory_mhz,
                "iterations_per_s": _optional(m.iterations_per_s),
            }
            for m in samples
        ]
        if not rows:
            return 0
        with self._begin(write=True) as session:
            session.execute(insert(MeasurementRow), rows)
        return len(rows)

    def measurements(
        self,
        since_s: float | None = None,
        *,
        until_s: float | None = None,
        job_id: str | None = None,
        node: str | None = None,
    ) -> list[Measurement]:
        query = select(MeasurementRow).order_by(
            MeasurementRow.time_s, MeasurementRow.node, MeasurementRow.gpu_index
        )
        if since_s is not None:
            query = query.where(MeasurementRow.time_s >= since_s)
        if until_s is not None:
            query = query.where(MeasurementRow.time_s < until_s)
        if job_id is not None:
            query = query.where(MeasurementRow.job_id == job_id)
        if node is not None:
            query = query.where(MeasurementRow.node == node)
        with self._begin(write=False) as session:
            return [_measurement(row) for row in session.scalars(query)]

    def prune_measurements(self, older_than_s: float, *, now_s: float | None = None) -> int:
        """Delete measurements older than ``older_than_s`` seconds; returns how many went."""
        if not (math.isfinite(older_than_s) and older_than_s >= 0):
            raise InputError(f"retention must be ≥ 0 s, got {older_than_s!r}")
        cutoff = self._now(now_s) - older_than_s
        with self._begin(write=True) as session:
            result = session.execute(
                delete(MeasurementRow)
                .where(MeasurementRow.time_s < cutoff)
                .execution_options(synchronize_session=False)
            )
            count = cast(CursorResult[Any], result).rowcount
        logger.info("pruned %d measurement(s) older than %.0f s", count, older_than_s)
        return count

    # -- decisions (the audit trail) -------------------------------------------------------

    def record_decision(
        self,
        *,
        interval_index: int,
        status: str,
        mode: str,
        price: float,
        budget_w: float,
        effective_budget_w: float,
        predicted_power_w: float,
        solve_s: float,
        setpoints: Iterable[Setpoint] = (),
        shadow: bool = False,
        measured_power_w: float | None = None,
        time_s: float | None = None,
    ) -> DecisionRecord:
        """Append one interval to the audit trail (with its setpoints, all or nothing).

        Floats may be ±inf but not NaN (SQLite cannot store NaN; refused on both databases).
        """
        points = list(setpoints)
        seen = {p.job_id for p in points}
        if len(seen) != len(points):
            raise InputError("a decision holds one setpoint per job")
        row = DecisionRow(
            time_s=self._now(time_s),
            interval_index=interval_index,
            status=status,
            mode=mode,
            shadow=shadow,
            price=_number(price, "price"),
            budget_w=_number(budget_w, "budget"),
            effective_budget_w=_number(effective_budget_w, "effective budget"),
            predicted_power_w=_number(predicted_power_w, "predicted power"),
            measured_power_w=_optional(measured_power_w),
            solve_s=_number(solve_s, "solve time"),
            setpoints=[
                SetpointRow(
                    job_id=p.job_id,
                    graphics_mhz=p.graphics_mhz,
                    memory_mhz=p.memory_mhz,
                    predicted_power_w=_number(p.predicted_power_w, f"power of job {p.job_id}"),
                )
                for p in points
            ],
        )
        with self._begin(write=True) as session:
            session.add(row)
            session.flush()
            return _decision(row)

    def set_measured_power(self, decision_id: int, measured_power_w: float) -> None:
        """What the GPUs drew over the interval the decision governed (known one interval on)."""
        _number(measured_power_w, "measured power")
        with self._begin(write=True) as session:
            result = session.execute(
                update(DecisionRow)
                .where(DecisionRow.id == decision_id)
                .values(measured_power_w=measured_power_w)
                .execution_options(synchronize_session=False)
            )
            if cast(CursorResult[Any], result).rowcount != 1:
                raise InputError(f"no decision with id {decision_id}")

    def decisions(
        self, since_s: float | None = None, limit: int | None = None
    ) -> list[DecisionRecord]:
        """Decisions in time order, from ``since_s``; with ``limit``, the latest ``limit``."""
        query = (
            select(DecisionRow)
            .options(selectinload(DecisionRow.setpoints))
            .order_by(DecisionRow.time_s.desc(), DecisionRow.id.desc())
        )
        if since_s is not None:
            query = query.where(DecisionRow.time_s >= since_s)
        if limit is not None:
            query = query.limit(limit)
        with self._begin(write=False) as session:
            return [_decision(row) for row in reversed(list(session.scalars(query)))]

    def count_rows(self) -> dict[str, int]:
        """Rows per table (status output, tests)."""
        with self._begin(write=False) as session:
            return {
                table.name: session.scalar(select(func.count()).select_from(table)) or 0
                for table in Base.metadata.sorted_tables
            }


# -- checks --------------------------------------------------------------------------------


def _finite(value: float, what: str) -> float:
    if not math.isfinite(value):
        raise InputError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _check_slo(percentile: float | None, latency_s: float | None) -> None:
    """A latency objective is both numbers or neither; their policy (p50..p99.99, up to 600 s)
    is the comment's and the API's, the store only keeps them meaningful."""
    if (percentile is None) != (latency_s is None):
        raise InputError(
            f"a latency objective needs a percentile and a latency, got {percentile} and "
            f"{latency_s}"
        )
    if percentile is not None and not 0 < percentile < 100:
        raise InputError(f"slo percentile must be in (0, 100), got {percentile}")
    if latency_s is not None and not (math.isfinite(latency_s) and latency_s > 0):
        raise InputError(f"slo latency must be > 0 s, got {latency_s}")


def _number(value: float, what: str) -> float:
    """A float for a NOT NULL column: ±inf is fine, NaN is not (SQLite would store NULL)."""
    if math.isnan(value):
        raise InputError(f"{what} must be a number, got NaN")
    return float(value)


def _optional(value: float | None) -> float | None:
    """A float for a nullable column: NaN ("not measured") becomes NULL on both databases."""
    return None if value is None or math.isnan(value) else float(value)


def _gpu_rows(job_id: str, gpus: Mapping[str, Iterable[int]]) -> list[dict[str, Any]]:
    rows = []
    for node, indices in gpus.items():
        names.node_name(node)
        for index in sorted(set(indices)):
            if not 0 <= index < 1024:
                raise InputError(f"GPU index on {node} must be in [0, 1024), got {index!r}")
            rows.append({"job_id": job_id, "node": node, "gpu_index": int(index)})
    return rows


def _chunks(items: Sequence[T]) -> Iterator[Sequence[T]]:
    """``items`` in lists of keys for ``IN (…)``, each padded to a power of two by repeating its
    last key (which changes no result): a statement's text depends on how many keys it lists,
    and the driver keeps up to 128 compiled statements per connection. With a list of every
    length up to a batch's size, those were megabytes of native memory per pooled connection,
    which a soak saw as cdgpcd's resident memory creeping up for hours."""
    for start in range(0, len(items), _CHUNK):
        chunk = list(items[start : start + _CHUNK])
        yield chunk + chunk[-1:] * (_power_of_two(len(chunk)) - len(chunk))


def _runs(items: Sequence[T], most: int) -> Iterator[Sequence[T]]:
    """``items`` in consecutive runs of power-of-two lengths, at most ``most``: rows for
    multi-row statements, in a handful of shapes (see `_chunks`)."""
    start = 0
    while start < len(items):
        size = min(most, _power_of_two(len(items) - start + 1) // 2)
        yield items[start : start + size]
        start += size


def _power_of_two(n: int) -> int:
    """The least power of two at or above ``n`` (1 for 0)."""
    return 1 << max(0, n - 1).bit_length()


def _existing_jobs(session: Session, job_ids: Sequence[str]) -> set[str]:
    return {
        job_id
        for chunk in _chunks(job_ids)
        for job_id in session.scalars(select(JobRow.job_id).where(JobRow.job_id.in_(chunk)))
    }


def _upsert(session: Session, row: type[Any] | Table) -> Any:
    """INSERT … ON CONFLICT for this dialect (both spell it the same way)."""
    dialect = session.get_bind().dialect.name
    return (postgresql.insert if dialect == "postgresql" else sqlite.insert)(row)


def _set_state(row: JobRow, new: str, only_from: str) -> None:
    if row.state == only_from:
        row.state = new


# -- rows → records ------------------------------------------------------------------------


def _budget(row: BudgetChangeRow) -> BudgetChange:
    return BudgetChange(
        id=row.id,
        effective_at_s=row.effective_at_s,
        budget_w=row.budget_w,
        set_by=row.set_by,
        reason=row.reason,
        created_at_s=row.created_at_s,
        domain=row.domain,
    )


def _job(row: JobRow) -> Job:
    return Job(
        job_id=row.job_id,
        user=row.user_name,
        state=row.state,
        deadline_s=row.deadline_s,
        iterations_total=row.iterations_total,
        iterations_done=row.iterations_done,
        registered_at_s=row.registered_at_s,
        finished_at_s=row.finished_at_s,
        gpus=tuple(sorted(JobGpu(g.node, g.gpu_index) for g in row.gpus)),
        time_limit_s=row.time_limit_s,
        started_at_s=row.started_at_s,
        total_source=row.total_source,
        slo_percentile=row.slo_percentile,
        slo_latency_s=row.slo_latency_s,
        job_name=row.job_name,
    )


_JOB_COLUMNS: tuple[str, ...] = tuple(c.name for c in _JOBS.columns)
#: rows per multi-row INSERT, at most (a power of two, see `_runs`): 14 columns each stays far
#: under either database's bind limit
_INSERT_ROWS = 512


@dataclasses.dataclass(frozen=True)
class _JobSql:
    """The registration's three hot statements as the driver's own SQL, for one dialect.

    Through SQLAlchemy Core each statement cost more than the database's work on it (building
    the statement, its cache key, the per-row parameter processing; for how much, see
    DESIGN.md, "The head's API"). They still run on the session's
    connection, in its transaction, with SQLAlchemy's error handling. The columns are plain
    text, floats and integers, which both drivers bind and return as they are.
    """

    placeholder: str
    #: another writer can insert a job id between our read and our write (PostgreSQL); SQLite's
    #: ``BEGIN IMMEDIATE`` shuts every other writer out until the commit
    may_race: bool

    @staticmethod
    def of(session: Session) -> _JobSql:
        dialect = session.get_bind().dialect
        placeholder = "?" if dialect.paramstyle == "qmark" else "%s"
        return _JobSql(placeholder, may_race=dialect.name != "sqlite")

    def attempt(self, session: Session) -> AbstractContextManager[object]:
        """A savepoint to start over from where a race is possible; nothing where it is not
        (two statements a batch)."""
        return session.begin_nested() if self.may_race else nullcontext()

    def select_jobs(self, count: int) -> str:
        lock = " FOR UPDATE" if self.may_race else ""
        marks = ", ".join([self.placeholder] * count)
        return f"SELECT {', '.join(_JOB_COLUMNS)} FROM jobs WHERE job_id IN ({marks}){lock}"

    def insert_jobs(self, count: int) -> str:
        row = "(" + ", ".join([self.placeholder] * len(_JOB_COLUMNS)) + ")"
        return (
            f"INSERT INTO jobs ({', '.join(_JOB_COLUMNS)}) VALUES {', '.join([row] * count)} "
            "ON CONFLICT (job_id) DO NOTHING RETURNING job_id"
        )

    def insert_gpus(self) -> str:
        marks = ", ".join([self.placeholder] * 3)
        return f"INSERT INTO job_gpus (job_id, node, gpu_index) VALUES ({marks})"


def _register_checked(
    session: Session,
    sql: _JobSql,
    checked: Sequence[tuple[int, JobRegistration, list[dict[str, Any]], float]],
    outcomes: list[Job | InputError | None],
) -> None:
    """`Store.register_jobs` on checked registrations: read the jobs they name, apply each
    registration in order to that picture in memory, then write what changed."""
    connection = session.connection()
    jobs, job_gpus = _JOBS, _JOB_GPUS
    ids = sorted({r.job_id for _, r, _, _ in checked})
    rows: dict[str, dict[str, Any]] = {}
    for chunk in _chunks(ids):
        found = connection.exec_driver_sql(sql.select_jobs(len(chunk)), tuple(chunk))
        rows.update((row[0], dict(zip(_JOB_COLUMNS, row, strict=True))) for row in found)
    held: dict[str, dict[str, set[int]]] = {job_id: {} for job_id in rows}
    for chunk in _chunks(sorted(rows)):
        query = select(job_gpus).where(job_gpus.c.job_id.in_(chunk))
        for job_id, node, index in connection.execute(query):
            held[job_id].setdefault(node, set()).add(index)
    new_ids: list[str] = []
    changed: set[str] = set()
    for i, r, new_gpus, now in checked:
        state = "adopted" if r.adopted else "registered"
        row = rows.get(r.job_id)
        if row is None:
            row = rows[r.job_id] = {
                "job_id": r.job_id,
                "user_name": r.user,
                "state": state,
                "deadline_s": r.deadline_s,
                "iterations_total": r.iterations_total,
                "iterations_done": 0,
                "registered_at_s": now,
                "finished_at_s": None,
                "time_limit_s": r.time_limit_s,
                "started_at_s": r.started_at_s,
                "total_source": None if r.iterations_total is None else "comment",
                "slo_percentile": r.slo_percentile,
                "slo_latency_s": r.slo_latency_s,
                "job_name": r.job_name,
            }
            held[r.job_id] = {}
            new_ids.append(r.job_id)
        else:
            if row["finished_at_s"] is not None and now <= row["finished_at_s"]:
                # a spooled registration delivered after the run it belongs to ended
                logger.info("job %s: registration from before it finished ignored", r.job_id)
                outcomes[i] = _job_record(row, held[r.job_id])
                continue
            if row["state"] == "finished":
                logger.info("job %s: registered again after it finished (requeued)", r.job_id)
                row.update(
                    state=state,
                    user_name=r.user,
                    finished_at_s=None,
                    registered_at_s=now,
                    iterations_done=0,
                    started_at_s=None,  # the new run's start, when Slurm says it
                )
                held[r.job_id] = {}  # a new allocation: drop every old GPU
            elif row["user_name"] != r.user:
                outcomes[i] = InputError(
                    f"job {r.job_id} is registered to {row['user_name']}, not {r.user}"
                )
                continue
            if r.deadline_s is not None:
                row["deadline_s"] = r.deadline_s
            if r.iterations_total is not None:
                row["iterations_total"] = r.iterations_total
                row["total_source"] = "comment"
            if r.time_limit_s is not None:
                row["time_limit_s"] = r.time_limit_s
            if r.started_at_s is not None:
                row["started_at_s"] = r.started_at_s
            if r.slo_percentile is not None:
                row.update(slo_percentile=r.slo_percentile, slo_latency_s=r.slo_latency_s)
            if r.job_name is not None:
                row["job_name"] = r.job_name
        for g in new_gpus:  # each named node's GPU set is replaced, the others kept
            held[r.job_id][g["node"]] = set()
        for g in new_gpus:
            held[r.job_id][g["node"]].add(g["gpu_index"])
        changed.add(r.job_id)
        outcomes[i] = _job_record(row, held[r.job_id])
    for chunk in _runs(new_ids, _INSERT_ROWS):
        values = tuple(rows[job_id][c] for job_id in chunk for c in _JOB_COLUMNS)
        inserted = connection.exec_driver_sql(sql.insert_jobs(len(chunk)), values).all()
        if len(inserted) != len(chunk):
            raise _RegistrationRaceError()
    known = sorted(changed.difference(new_ids))
    if known:
        columns = [c for c in rows[known[0]] if c != "job_id"]
        connection.execute(
            update(jobs)
            .where(jobs.c.job_id == bindparam("key"))
            .values({c: bindparam(c) for c in columns}),
            [{"key": job_id, **{c: rows[job_id][c] for c in columns}} for job_id in known],
        )
        for chunk in _chunks(known):
            connection.execute(delete(job_gpus).where(job_gpus.c.job_id.in_(chunk)))
    gpu_rows = [
        (job_id, node, index)
        for job_id in sorted(changed)
        for node, indices in held[job_id].items()
        for index in indices
    ]
    if gpu_rows:
        connection.exec_driver_sql(sql.insert_gpus(), gpu_rows)


def _job_record(values: Mapping[str, Any], held: Mapping[str, Iterable[int]]) -> Job:
    return Job(
        job_id=values["job_id"],
        user=values["user_name"],
        state=values["state"],
        deadline_s=values["deadline_s"],
        iterations_total=values["iterations_total"],
        iterations_done=values["iterations_done"],
        registered_at_s=values["registered_at_s"],
        finished_at_s=values["finished_at_s"],
        gpus=tuple(sorted(JobGpu(node, i) for node, indices in held.items() for i in indices)),
        time_limit_s=values["time_limit_s"],
        started_at_s=values["started_at_s"],
        total_source=values["total_source"],
        slo_percentile=values["slo_percentile"],
        slo_latency_s=values["slo_latency_s"],
        job_name=values["job_name"],
    )


def _node(row: NodeRow | Row[Any]) -> Node:
    return Node(
        name=row.name,
        url=row.url,
        transport=row.transport,
        last_seen_s=row.last_seen_s,
        reachable=row.reachable,
        gpu_count=row.gpu_count,
        gpu_type=row.gpu_type,
        worst_case_power_w=row.worst_case_power_w,
    )


def _measurement(row: MeasurementRow) -> Measurement:
    return Measurement(
        time_s=row.time_s,
        node=row.node,
        gpu_index=row.gpu_index,
        power_w=row.power_w,
        job_id=row.job_id,
        energy_j=row.energy_j,
        graphics_mhz=row.graphics_mhz,
        memory_mhz=row.memory_mhz,
        iterations_per_s=row.iterations_per_s,
    )


def _decision(row: DecisionRow) -> DecisionRecord:
    return DecisionRecord(
        id=row.id,
        time_s=row.time_s,
        interval_index=row.interval_index,
        status=row.status,
        mode=row.mode,
        shadow=row.shadow,
        price=row.price,
        budget_w=row.budget_w,
        effective_budget_w=row.effective_budget_w,
        predicted_power_w=row.predicted_power_w,
        measured_power_w=row.measured_power_w,
        solve_s=row.solve_s,
        setpoints=tuple(
            Setpoint(p.job_id, p.graphics_mhz, p.memory_mhz, p.predicted_power_w)
            for p in sorted(row.setpoints, key=lambda p: p.job_id)
        ),
    )


# -- model state ↔ rows ---------------------------------------------------------------------


def _model_rows(snapshot: ModelSnapshot, now: float) -> list[dict[str, Any]]:
    statics = snapshot.statics
    floats = np.stack([getattr(statics, name) for name in STATIC_FLOATS], axis=1)
    rows = []
    for n, job_id in enumerate(snapshot.job_ids):
        row: dict[str, Any] = {"job_id": job_id, "family": snapshot.family, "updated_at_s": now}
        for prefix, state in (("power", snapshot.power), ("time", snapshot.time)):
            row[f"{prefix}_theta"] = encode_f64(state.theta[n])
            row[f"{prefix}_cov"] = encode_f64(state.cov[n])
            row[f"{prefix}_err_var"] = encode_f64(state.err_var[n : n + 1])
            row[f"{prefix}_count"] = int(state.count[n])
        row["gpus"] = int(statics.gpus[n])
        row["statics"] = encode_f64(floats[n])
        rows.append(row)
    return rows


def _snapshot(rows: list[JobModelRow], family: str, k_power: int) -> ModelSnapshot:
    def bank(prefix: str, k_default: int) -> RlsState:
        k = vector_length(getattr(rows[0], f"{prefix}_theta"), "model") if rows else k_default
        theta = np.empty((len(rows), k))
        cov = np.empty((len(rows), k, k))
        err_var = np.empty(len(rows))
        for n, r in enumerate(rows):
            what = f"job {r.job_id} {prefix} model"
            theta[n] = decode_f64(getattr(r, f"{prefix}_theta"), (k,), what)
            cov[n] = decode_f64(getattr(r, f"{prefix}_cov"), (k, k), what)
            err_var[n] = decode_f64(getattr(r, f"{prefix}_err_var"), (1,), what)[0]
        count = np.array([getattr(r, f"{prefix}_count") for r in rows], dtype=np.int64)
        return RlsState(theta=theta, cov=cov, err_var=err_var, count=count)

    floats = np.empty((len(rows), len(STATIC_FLOATS)))
    for n, r in enumerate(rows):
        floats[n] = decode_f64(r.statics, (len(STATIC_FLOATS),), f"job {r.job_id} statics")
    statics = JobStatics(
        gpus=np.array([r.gpus for r in rows], dtype=np.int64),
        **{name: floats[:, i].copy() for i, name in enumerate(STATIC_FLOATS)},
    )
    return ModelSnapshot(
        job_ids=tuple(r.job_id for r in rows),
        family=family,
        power=bank("power", k_power),
        time=bank("time", TIME_PARAMS),
        statics=statics,
    )
