"""The head's database: budget history, jobs, nodes, per-job models, measurements, decisions.

SQLite or PostgreSQL through SQLAlchemy 2.0. Build an engine from the configured URL, bring the
schema up to date, then pass a `Store` to whoever needs it::

    engine = make_engine(config.store.url)
    upgrade(engine)
    store = Store(engine)

The schema lives in versioned SQL files under ``sql/`` (`slurm_cdgpc.store.migrate`);
`slurm_cdgpc.store.schema` describes the same tables to the ORM.
"""

from __future__ import annotations

from slurm_cdgpc.store.engine import StoreBusyError, StoreError, make_engine
from slurm_cdgpc.store.migrate import MigrationError, current_version, upgrade
from slurm_cdgpc.store.records import (
    ACTIVE_STATES,
    BudgetChange,
    DecisionRecord,
    Job,
    JobGpu,
    Measurement,
    ModelSnapshot,
    Node,
    Setpoint,
)
from slurm_cdgpc.store.repository import Store

__all__ = [
    "ACTIVE_STATES",
    "BudgetChange",
    "DecisionRecord",
    "Job",
    "JobGpu",
    "Measurement",
    "MigrationError",
    "ModelSnapshot",
    "Node",
    "Setpoint",
    "Store",
    "StoreBusyError",
    "StoreError",
    "current_version",
    "make_engine",
    "upgrade",
]
