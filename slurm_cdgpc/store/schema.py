"""The store's tables as SQLAlchemy 2.0 typed ORM classes. The versioned SQL files make the schema
(`slurm_cdgpc.store.migrate`); these classes must describe the same tables and columns, which
`tests/integration/test_store.py` checks on SQLite and PostgreSQL. Times are UNIX epoch seconds
(``*_s``, float), powers watts, clocks MHz. Like all of `store/`, it never reaches
`coordinator/`.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

#: BIGINT on PostgreSQL; INTEGER on SQLite, where only ``INTEGER PRIMARY KEY`` auto-increments.
Id = BigInteger().with_variant(Integer(), "sqlite")

JOB_STATES = ("registered", "running", "finished", "adopted")
TRANSPORTS = ("http", "ssh")


class Base(DeclarativeBase):
    pass


class SchemaVersionRow(Base):
    """One row per applied migration (``sql/<dialect>/NNNN_name.sql``)."""

    __tablename__ = "schema_version"

    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    name: Mapped[str] = mapped_column(String(200))
    applied_at_s: Mapped[float] = mapped_column(Double)


class BudgetChangeRow(Base):
    """The budget history, and that of each power domain's limit set by an admin: the budget (a
    domain's limit) at time t is the latest change with no domain (that domain) effective at or
    before t."""

    __tablename__ = "budget_changes"
    __table_args__ = (
        CheckConstraint("budget_w > 0", name="budget_changes_positive"),
        Index("ix_budget_changes_effective", "effective_at_s"),
    )

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    effective_at_s: Mapped[float] = mapped_column(Double)
    budget_w: Mapped[float] = mapped_column(Double)
    set_by: Mapped[str] = mapped_column(String(64))
    reason: Mapped[str] = mapped_column(Text)
    created_at_s: Mapped[float] = mapped_column(Double)
    #: the power domain whose limit this sets (a name of the topology file); NULL: the budget
    domain: Mapped[str | None] = mapped_column(String(255))


class JobRow(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(
            "state IN ('registered', 'running', 'finished', 'adopted')", name="jobs_state"
        ),
        CheckConstraint("total_source IN ('comment', 'framework')", name="jobs_total_source"),
        Index("ix_jobs_state", "state"),
    )

    #: Slurm's job id as text (`slurm_cdgpc.wire.names.JOB_ID`)
    job_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_name: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16))
    deadline_s: Mapped[float | None] = mapped_column(Double)
    iterations_total: Mapped[int | None] = mapped_column(BigInteger)
    iterations_done: Mapped[int] = mapped_column(BigInteger)
    registered_at_s: Mapped[float] = mapped_column(Double)
    finished_at_s: Mapped[float | None] = mapped_column(Double)
    #: Slurm's time limit and start (NULL: not known); who said iterations_total (NULL: nobody)
    time_limit_s: Mapped[float | None] = mapped_column(Double)
    started_at_s: Mapped[float | None] = mapped_column(Double)
    total_source: Mapped[str | None] = mapped_column(String(16))
    #: a serving job's latency objective (slo=p99:250ms: 99, 0.25 s); both NULL: none
    slo_percentile: Mapped[float | None] = mapped_column(Double)
    slo_latency_s: Mapped[float | None] = mapped_column(Double)
    #: Slurm's JobName (None: not known): with the user and GPU type, the job's kind
    job_name: Mapped[str | None] = mapped_column(String(200))

    gpus: Mapped[list[JobGpuRow]] = relationship(
        back_populates="job",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="(JobGpuRow.node, JobGpuRow.gpu_index)",
    )


class JobGpuRow(Base):
    """The GPUs a job holds: a job may span several nodes."""

    __tablename__ = "job_gpus"

    job_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("jobs.job_id", ondelete="CASCADE"), primary_key=True
    )
    node: Mapped[str] = mapped_column(String(255), primary_key=True)
    gpu_index: Mapped[int] = mapped_column(Integer, primary_key=True)

    job: Mapped[JobRow] = relationship(back_populates="gpus")


class NodeRow(Base):
    __tablename__ = "nodes"
    __table_args__ = (CheckConstraint("transport IN ('http', 'ssh')", name="nodes_transport"),)

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    url: Mapped[str] = mapped_column(String(512))
    transport: Mapped[str] = mapped_column(String(8))
    last_seen_s: Mapped[float | None] = mapped_column(Double)
    reachable: Mapped[bool] = mapped_column(Boolean)
    gpu_count: Mapped[int] = mapped_column(Integer)
    gpu_type: Mapped[str] = mapped_column(String(64))
    #: all the node's GPUs at their power limit: what an unreachable node is counted at
    worst_case_power_w: Mapped[float] = mapped_column(Double)


class JobModelRow(Base):
    """One job's learned models (RLS state) and statics, exactly as the estimator holds them.

    Every float is stored as little-endian float64 bytes (`slurm_cdgpc.store.codec`): bit for bit,
    NaN included (SQLite would turn a NaN REAL into NULL). Shapes: ``*_theta`` (k,), ``*_cov``
    (k, k), ``*_err_var`` (1,), ``statics`` (6,) in `STATIC_FLOATS` order.
    """

    __tablename__ = "job_models"

    job_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("jobs.job_id", ondelete="CASCADE"), primary_key=True
    )
    family: Mapped[str] = mapped_column(String(16))
    updated_at_s: Mapped[float] = mapped_column(Double)
    power_theta: Mapped[bytes] = mapped_column(LargeBinary)
    power_cov: Mapped[bytes] = mapped_column(LargeBinary)
    power_err_var: Mapped[bytes] = mapped_column(LargeBinary)
    power_count: Mapped[int] = mapped_column(BigInteger)
    time_theta: Mapped[bytes] = mapped_column(LargeBinary)
    time_cov: Mapped[bytes] = mapped_column(LargeBinary)
    time_err_var: Mapped[bytes] = mapped_column(LargeBinary)
    time_count: Mapped[int] = mapped_column(BigInteger)
    gpus: Mapped[int] = mapped_column(Integer)
    statics: Mapped[bytes] = mapped_column(LargeBinary)


#: The float fields of `JobStatics` in ``job_models.statics``, in order.
STATIC_FLOATS = (
    "graphics_max_mhz",
    "memory_max_mhz",
    "knee_mhz",
    "mem_mask",
    "idle_power_w",
    "power_limit_w",
)


class MeasurementRow(Base):
    """Per-GPU samples as agents report them; pruned after the retention period."""

    __tablename__ = "measurements"
    __table_args__ = (
        Index("ix_measurements_time", "time_s"),
        Index("ix_measurements_job_time", "job_id", "time_s"),
    )

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    time_s: Mapped[float] = mapped_column(Double)
    node: Mapped[str] = mapped_column(String(255))
    gpu_index: Mapped[int] = mapped_column(Integer)
    #: None: an idle GPU, or one held by a job the head does not know
    job_id: Mapped[str | None] = mapped_column(String(64))
    power_w: Mapped[float] = mapped_column(Double)
    energy_j: Mapped[float | None] = mapped_column(Double)
    graphics_mhz: Mapped[int | None] = mapped_column(Integer)
    memory_mhz: Mapped[int | None] = mapped_column(Integer)
    iterations_per_s: Mapped[float | None] = mapped_column(Double)


class DecisionRow(Base):
    """The audit trail: what the controller decided every interval, and what came of it."""

    __tablename__ = "decisions"
    __table_args__ = (Index("ix_decisions_time", "time_s"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    time_s: Mapped[float] = mapped_column(Double)
    interval_index: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(32))
    #: the dual solver mode (newton | bisection | gradient)
    mode: Mapped[str] = mapped_column(String(16))
    #: decided but not applied (control.shadow)
    shadow: Mapped[bool] = mapped_column(Boolean)
    price: Mapped[float] = mapped_column(Double)
    budget_w: Mapped[float] = mapped_column(Double)
    effective_budget_w: Mapped[float] = mapped_column(Double)
    predicted_power_w: Mapped[float] = mapped_column(Double)
    #: what the GPUs drew over the interval the decision was applied to (filled in one later)
    measured_power_w: Mapped[float | None] = mapped_column(Double)
    solve_s: Mapped[float] = mapped_column(Double)

    setpoints: Mapped[list[SetpointRow]] = relationship(
        back_populates="decision",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="SetpointRow.job_id",
    )


class SetpointRow(Base):
    """One job's clocks in one decision."""

    __tablename__ = "decision_setpoints"

    decision_id: Mapped[int] = mapped_column(
        Id, ForeignKey("decisions.id", ondelete="CASCADE"), primary_key=True
    )
    job_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    graphics_mhz: Mapped[int] = mapped_column(Integer)
    memory_mhz: Mapped[int] = mapped_column(Integer)
    predicted_power_w: Mapped[float] = mapped_column(Double)

    decision: Mapped[DecisionRow] = relationship(back_populates="setpoints")


class LeaderRow(Base):
    """The leader lock of the active ``cdgpcd`` (one row; `slurm_cdgpc.store.leader`).

    ``epoch`` is the fencing token: it rises at every change of holder (to the database's clock
    in milliseconds, or by one), every exchange carries it, and an agent refuses one older than
    the newest it has seen.
    """

    __tablename__ = "leader"
    __table_args__ = (
        CheckConstraint("id = 1", name="leader_one_row"),
        CheckConstraint("epoch >= 0", name="leader_epoch"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    #: who holds it (``host:pid``); '' when free
    holder: Mapped[str] = mapped_column(String(255))
    epoch: Mapped[int] = mapped_column(BigInteger)
    acquired_at_s: Mapped[float] = mapped_column(Double)
    #: on the database's clock
    expires_at_s: Mapped[float] = mapped_column(Double)
