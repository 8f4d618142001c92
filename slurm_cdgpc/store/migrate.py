"""Versioned schema migrations (`upgrade`): plain SQL files, ``sql/<dialect>/NNNN_name.sql``, each
applied in its own transaction with its row in ``schema_version``, so a failed one leaves the
previous version intact; running it again applies nothing. Like all of `store/`, it never reaches
`coordinator/` (`tests/unit/test_import_graph.py`). Test: `tests/integration/test_store.py`.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from sqlalchemy import Connection, Engine, inspect, text
from sqlalchemy.exc import SQLAlchemyError

from slurm_cdgpc.errors import FatalError
from slurm_cdgpc.store.engine import WRITE, describe

logger = logging.getLogger(__name__)

_FILE = re.compile(r"^(?P<version>[0-9]{4})_(?P<name>[a-z0-9_]+)\.sql$")
#: pg_advisory_xact_lock key ("cdgp"): one migrating process at a time
_PG_LOCK = 0x63646770


class MigrationError(FatalError):
    """The schema cannot be brought to this version of cdgpc."""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    path: Path


def sql_dir() -> Path:
    """The package's ``sql`` data (a wheel's copy, or the link to ``sql/`` in a source checkout
    or editable install), else ``sql/`` beside the package (a checkout without the link)."""
    candidates = (
        Path(str(resources.files("slurm_cdgpc") / "sql")).resolve(),
        Path(__file__).resolve().parents[2] / "sql",
    )
    for path in candidates:
        if path.is_dir():
            return path
    raise MigrationError(f"no migrations found (looked in {', '.join(map(str, candidates))})")


def migrations(dialect: str, root: Path | None = None) -> list[Migration]:
    """The migrations for ``dialect`` (``sqlite`` or ``postgresql``), in version order."""
    folder = (root or sql_dir()) / dialect
    if not folder.is_dir():
        raise MigrationError(f"no migrations for {dialect} in {folder}")
    found = []
    for path in sorted(folder.glob("*.sql")):
        match = _FILE.match(path.name)
        if match is None:
            raise MigrationError(f"{path}: migration file names must look like 0001_initial.sql")
        found.append(Migration(int(match["version"]), match["name"], path))
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise MigrationError(f"{folder}: versions must run 1, 2, 3, … without gaps, got {versions}")
    return found


def current_version(engine: Engine) -> int:
    """The schema version of the database (0: empty)."""
    try:
        with engine.connect() as conn:
            return _version(conn)
    except SQLAlchemyError as e:
        raise MigrationError(f"cannot read the schema version: {describe(e)}") from e


def upgrade(engine: Engine, root: Path | None = None) -> list[int]:
    """Apply the pending migrations in order; returns the versions applied (empty: up to date).
    Two processes upgrading at once are serialised (PostgreSQL: an advisory lock; SQLite: the
    write lock), and the second finds nothing left to do; PostgreSQL and SQLite both roll back
    DDL. The first migration creates ``schema_version`` itself."""
    dialect = engine.dialect.name
    available = migrations(dialect, root)
    latest = available[-1].version if available else 0
    applied: list[int] = []
    for migration in available:
        try:
            if _apply(engine, migration, latest):
                applied.append(migration.version)
        except SQLAlchemyError as e:
            raise MigrationError(
                f"{migration.path.name}: migration failed, database left at version "
                f"{migration.version - 1}: {describe(e)}"
            ) from e
    return applied


def _apply(engine: Engine, migration: Migration, latest: int) -> bool:
    """Apply one migration unless the database already has it; refuse a newer database."""
    with engine.connect() as conn:
        conn.execution_options(**{WRITE: True})  # in place (SQLAlchemy 2)
        with conn.begin():
            if engine.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK})
            version = _version(conn)
            if version > latest:
                raise MigrationError(
                    f"the database schema is at version {version}, newer than this cdgpc "
                    f"knows (up to {latest}): upgrade cdgpc"
                )
            if version >= migration.version:
                return False
            logger.info("applying migration %s", migration.path.name)
            for statement in split_statements(migration.path.read_text(encoding="utf-8")):
                conn.exec_driver_sql(statement)
            conn.execute(
                text(
                    "INSERT INTO schema_version (version, name, applied_at_s) "
                    "VALUES (:version, :name, :now)"
                ),
                {"version": migration.version, "name": migration.name, "now": time.time()},
            )
            return True


def _version(conn: Connection) -> int:
    if not inspect(conn).has_table("schema_version"):
        return 0
    return int(conn.execute(text("SELECT max(version) FROM schema_version")).scalar() or 0)


def split_statements(sql: str) -> list[str]:
    """Statements of a migration file: ``--`` comments dropped, split at ``;`` ending a line."""
    lines = [re.sub(r"--.*$", "", line).rstrip() for line in sql.splitlines()]
    statements = re.split(r";\s*\n", "\n".join(lines) + "\n")
    return [s.strip().rstrip(";") for s in statements if s.strip()]
