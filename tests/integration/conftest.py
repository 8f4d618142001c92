"""Database fixtures: every store test runs on SQLite (a temporary file) and on PostgreSQL.

PostgreSQL: one database with a random name per test session, created through the maintenance
database ``$CDGPC_TEST_POSTGRES_URL`` (default: the ``test`` database on 127.0.0.1 as user
postgres) and dropped at the end; every test gets its own schema in it. When PostgreSQL cannot
be reached the PostgreSQL half skips with the reason, except under ``CI=true``, where it fails.
Select one backend with ``-k sqlite`` or ``-k postgresql``.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest
from sqlalchemy import URL, Engine, create_engine, make_url
from sqlalchemy.exc import SQLAlchemyError

from slurm_cdgpc.store import Store, make_engine, upgrade
from slurm_cdgpc.store.engine import describe

POSTGRES_URL_ENV = "CDGPC_TEST_POSTGRES_URL"
DEFAULT_MAINTENANCE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
#: the wall-clock start of every store test (2026-01-01T00:00:00Z)
T0_S = 1_767_225_600.0


@dataclass
class FakeClock:
    """The store's clock in tests: set or advance it by hand."""

    now_s: float = T0_S

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> float:
        self.now_s += seconds
        return self.now_s


def _unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but PostgreSQL is needed and {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def postgres_database() -> Iterator[URL]:
    """A fresh, randomly named PostgreSQL database for this test session."""
    maintenance = make_url(os.environ.get(POSTGRES_URL_ENV, DEFAULT_MAINTENANCE_URL))
    name = f"cdgpc_test_{secrets.token_hex(6)}"
    try:
        admin = create_engine(
            maintenance, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5}
        )
    except ImportError as e:  # the driver, psycopg 3, is not installed
        _unavailable(f"PostgreSQL driver missing: {e}")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    except SQLAlchemyError as e:
        admin.dispose()
        _unavailable(f"PostgreSQL is not usable at {maintenance!r}: {describe(e)}")
    try:
        yield maintenance.set(database=name)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@pytest.fixture
def postgres_url(postgres_database: URL) -> Iterator[str]:
    """A URL whose connections work in a schema of their own, dropped after the test."""
    schema = f"t_{secrets.token_hex(6)}"
    admin = create_engine(postgres_database, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    url = postgres_database.update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The database URL of this test's backend (an empty database)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'cdgpc.db'}"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
def make_db_engine(db_url: str) -> Iterator[Callable[[], Engine]]:
    """Engines on this test's database (e.g. one per simulated process), disposed at the end."""
    engines: list[Engine] = []

    def make() -> Engine:
        engines.append(make_engine(db_url))
        return engines[-1]

    yield make
    for engine in engines:
        engine.dispose()


@pytest.fixture
def engine(make_db_engine: Callable[[], Engine]) -> Engine:
    """An engine on an empty database (no schema yet)."""
    return make_db_engine()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(engine: Engine, clock: FakeClock) -> Store:
    """A store on a freshly migrated database, on the fake clock."""
    upgrade(engine)
    return Store(engine, clock=clock)
