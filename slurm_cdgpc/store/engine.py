"""Connecting to the database (`make_engine`: SQLite or PostgreSQL, no module-level engine) and
translating its errors, once; on SQLite every write takes the write lock up front. Like all of
`store/`, it never reaches `coordinator/` (`tests/unit/test_import_graph.py`). Design:
DESIGN.md, "The head's API" and "Standby heads"; test: `tests/integration/test_store.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, SQLAlchemyError

from slurm_cdgpc.errors import InputError, SoftError, one_line

logger = logging.getLogger(__name__)

#: Connection execution option: this transaction writes (SQLite: ``BEGIN IMMEDIATE``).
WRITE = "cdgpc_write"
#: Connection execution option: this write transaction takes the write lock now or fails
#: (SQLite's busy timeout is 0 for its ``BEGIN IMMEDIATE`` alone); see `Store.transaction`.
NOWAIT = "cdgpc_nowait"
#: Seconds a SQLite connection waits for another writer before giving up.
SQLITE_BUSY_TIMEOUT_S = 30.0
#: SQLite: a connection's own commit checkpoints the write-ahead log only once it holds this
#: many pages (about 40 MB; SQLite's default is 1,000). cdgpcd checkpoints once an interval
#: from its control loop (`Store.checkpoint`), so that the API's event loop, which commits
#: registrations itself, is not the one copying the log into the database (see DESIGN.md,
#: "The head's API"); this is the backstop should the control loop stop.
WAL_AUTOCHECKPOINT_PAGES = 10_000
#: PostgreSQL ends a session whose transaction sat idle this long (a head paused mid-write, its
#: locks held: the leader row, a job's row); no transaction of ours waits on the client
IDLE_IN_TRANSACTION_S = 30


class StoreError(SoftError):
    """The database could not be reached or refused a write; nothing was changed."""


class StoreBusyError(StoreError):
    """A transaction that was not to wait found another writer holding the database: it did
    nothing, and the same transaction may be run by a thread that can wait."""


def make_engine(url: str, *, echo: bool = False) -> Engine:
    """An engine for a ``sqlite:///…`` or ``postgresql[+psycopg]://…`` URL (no connection yet).

    SQLite: foreign keys on and WAL (readers never block the writer) on every new connection;
    the driver's own transaction handling (it does not wrap DDL, and begins lazily) is replaced
    by an explicit ``BEGIN``, or ``BEGIN IMMEDIATE`` for writes, so two writers wait for each
    other instead of failing on a lock upgrade. PostgreSQL: psycopg 3 (``postgresql://`` means
    ``postgresql+psycopg://``), and a session whose transaction sits idle for
    `IDLE_IN_TRANSACTION_S` is ended by the server, its locks released.
    """
    try:
        parsed = make_url(url)
    except ArgumentError as e:
        raise InputError("store URL is not a database URL like sqlite:////path/cdgpc.db") from e
    backend, driver = parsed.get_backend_name(), parsed.get_driver_name()
    try:
        if backend == "sqlite" and driver == "pysqlite":
            engine = create_engine(
                parsed, echo=echo, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S}
            )
            event.listen(engine, "connect", _sqlite_connect)
            event.listen(engine, "begin", _sqlite_begin)
            return engine
        if parsed.drivername in ("postgresql", "postgresql+psycopg"):
            # plain postgresql:// would pick psycopg2 in SQLAlchemy; this project uses psycopg 3
            engine = create_engine(
                parsed.set(drivername="postgresql+psycopg"), echo=echo, pool_pre_ping=True
            )
            event.listen(engine, "connect", _postgresql_connect)
            return engine
    except (NoSuchModuleError, ImportError) as e:
        raise InputError(f"store URL {parsed!r}: database driver not installed ({e})") from e
    raise InputError(
        f"store URL {parsed!r}: only sqlite:// and postgresql+psycopg:// are supported"
    )


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    # no implicit BEGIN/COMMIT from the sqlite3 module: `_sqlite_begin` emits our own
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute(f"PRAGMA wal_autocheckpoint = {WAL_AUTOCHECKPOINT_PAGES}")
    finally:
        cursor.close()


def _postgresql_connect(dbapi_connection: Any, _record: Any) -> None:
    # a session setting, not a startup ``options`` parameter: the URL's own options stay as they
    # are, and connection poolers that refuse unknown startup parameters still connect
    autocommit = dbapi_connection.autocommit
    dbapi_connection.autocommit = True
    try:
        with dbapi_connection.cursor() as cursor:
            cursor.execute(f"SET idle_in_transaction_session_timeout = '{IDLE_IN_TRANSACTION_S}s'")
    finally:
        dbapi_connection.autocommit = autocommit


def _sqlite_begin(connection: Connection) -> None:
    options = connection.get_execution_options()
    if not options.get(NOWAIT, False):
        connection.exec_driver_sql("BEGIN IMMEDIATE" if options.get(WRITE, False) else "BEGIN")
        return
    connection.exec_driver_sql("PRAGMA busy_timeout = 0")
    try:
        connection.exec_driver_sql("BEGIN IMMEDIATE")
    finally:  # the pooled connection waits again, inside this transaction and after it
        connection.exec_driver_sql(f"PRAGMA busy_timeout = {round(SQLITE_BUSY_TIMEOUT_S * 1000)}")


def is_busy(error: SQLAlchemyError) -> bool:
    """Whether ``error`` is SQLite's: another connection holds the lock asked for."""
    return getattr(getattr(error, "orig", None), "sqlite_errorname", "") in {
        "SQLITE_BUSY",
        "SQLITE_BUSY_SNAPSHOT",
    }


@contextmanager
def translated_errors(what: str) -> Iterator[None]:
    """Turn SQLAlchemy and driver errors into a one-line `StoreError` (``raise … from e``)."""
    try:
        yield
    except SQLAlchemyError as e:
        raise StoreError(f"{what}: {describe(e)}") from e


def describe(error: SQLAlchemyError) -> str:
    """The first line of the database's own message, without SQLAlchemy's SQL echo."""
    cause: BaseException = error
    if isinstance(error, DBAPIError) and error.orig is not None:
        cause = error.orig
    return f"{type(cause).__name__}: {one_line(cause, keep='first')}"
