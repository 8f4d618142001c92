"""The head's database (`Store`): budget history, jobs, nodes, per-job models, measurements and
decisions, on SQLite or PostgreSQL through SQLAlchemy 2.0. It records and never decides: it never
reaches `coordinator/` (`tests/unit/test_import_graph.py`). Tests:
`tests/integration/test_store.py`, `tests/faults/test_store_faults.py`.
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
