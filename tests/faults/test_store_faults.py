"""The database goes away under a running cdgpcd: PostgreSQL stopped, SQLite locked.

What the code does (and these tests hold it to): every interval starts by reading the store
(active jobs, nodes, the budget). While PostgreSQL is down that read fails, the interval is
logged as failed and *no exchange is sent*: the head does not steer from a memory that may be
stale (a budget cut or an Epilog it cannot see), so the agents' leases lapse and every GPU falls
to the safe cap within one lease. Registrations meanwhile get 503, which the Prolog spools and
forwards later; none is acknowledged without being stored. When the database is back the same
process carries on (SQLAlchemy's pre-ping replaces the dead connections): control of both jobs
returns without a restart.

A SQLite file locked by another process (``BEGIN EXCLUSIVE``) blocks writers, not readers
(WAL): the interval's exchange still goes out, then its store transaction waits for the lock
(busy timeout 30 s), so the loop stalls for as long as the lock is held, and a stall longer than
the lease lets the agents fall to the safe cap, as above. Registrations wait for the lock too:
the client gives up first and spools, the head commits when the lock goes; the spool's resend
is idempotent.

The PostgreSQL server here is a private one (``initdb`` into a temporary directory, run as the
``postgres`` user on a free port), never the machine's shared server.
"""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from slurm_cdgpc.localcluster import free_port as _free_port
from slurm_cdgpc.localcluster import wait_for as _wait
from tests.faults.cluster import (
    JOBS,
    LEASE_S,
    SAFE_MHZ,
    SLACK_S,
    Cluster,
    make_cluster,
    registrar,
    unavailable,
)

pytestmark = [pytest.mark.faults, pytest.mark.live]


@dataclass
class PrivatePostgres:
    bin_dir: Path
    directory: Path
    port: int

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/cdgpc"

    def _pg_ctl(self, *args: str) -> None:
        done = subprocess.run(
            ["runuser", "-u", "postgres", "--", str(self.bin_dir / "pg_ctl"), *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if done.returncode != 0:
            log = (self.directory / "server.log").read_text(errors="replace")[-2000:]
            raise AssertionError(f"pg_ctl {args[-1]}: {done.stdout}{done.stderr}\n{log}")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._pg_ctl(
            "-D", str(self.directory / "data"), "-l", str(self.directory / "server.log"),
            "-w", "-o", options, "start",
        )  # fmt: skip

    def stop(self) -> None:
        self._pg_ctl("-D", str(self.directory / "data"), "-m", "fast", "-w", "stop")


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    """A PostgreSQL server of this test's own, with an empty database ``cdgpc``."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    if not found or shutil.which("runuser") is None:
        unavailable("the PostgreSQL server binaries (/usr/lib/postgresql/*/bin) are not installed")
    try:
        subprocess.run(["id", "postgres"], capture_output=True, check=True, timeout=10)
    except subprocess.CalledProcessError:
        unavailable("there is no postgres user to run a private PostgreSQL server as")
    bin_dir = found[-1].parent
    directory = Path(tempfile.mkdtemp(prefix="cdgpc-pg-"))
    shutil.chown(directory, "postgres", "postgres")
    done = subprocess.run(
        ["runuser", "-u", "postgres", "--", str(bin_dir / "initdb"), "-D",
         str(directory / "data"), "-A", "trust", "-U", "postgres", "--no-sync"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        shutil.rmtree(directory, ignore_errors=True)
        raise AssertionError(f"initdb failed: {done.stderr[-2000:]}")
    server = PrivatePostgres(bin_dir, directory, _free_port())
    server.start()
    try:
        admin = create_engine(
            f"postgresql+psycopg://postgres@127.0.0.1:{server.port}/postgres",
            isolation_level="AUTOCOMMIT",
        )
        with admin.connect() as conn:
            conn.exec_driver_sql("CREATE DATABASE cdgpc")
        admin.dispose()
        yield server
    finally:
        with contextlib.suppress(AssertionError):  # already stopped by a failed test
            server.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def pg_cluster(tmp_path: Path, private_postgres: PrivatePostgres) -> Iterator[Cluster]:
    yield from make_cluster(tmp_path, private_postgres.url)


@pytest.fixture
def sqlite_cluster(tmp_path: Path) -> Iterator[Cluster]:
    yield from make_cluster(tmp_path, f"sqlite:///{tmp_path / 'cdgpc.db'}")


def _all_at_safe_cap(cluster: Cluster) -> bool:
    return all(
        len(locks := cluster.locks(n)) == 3 and max(locks.values()) <= SAFE_MHZ for n in JOBS
    )


@pytest.mark.postgres
def test_postgresql_stopped_and_started_under_the_daemon(
    pg_cluster: Cluster, private_postgres: PrivatePostgres
) -> None:
    cluster = pg_cluster
    head = cluster.start_head()
    meter = cluster.establish()
    jobs = registrar(cluster)
    jobs.register(1)

    private_postgres.stop()
    stopped_s = time.monotonic()
    jobs.register(3)  # refused with 503 (or unanswered): spooled, none acknowledged
    assert len(jobs.spool.pending()) == 6, head.text()[-3000:]
    _wait("every GPU at the safe cap", lambda: _all_at_safe_cap(cluster), LEASE_S + 5, cluster.logs)
    assert time.monotonic() - stopped_s < LEASE_S + 2 * SLACK_S
    time.sleep(1.0)
    assert head.proc.poll() is None, head.text()[-3000:]
    assert "failed" in head.text()

    private_postgres.start()
    _wait(
        "both jobs controlled again, by the same cdgpcd",
        lambda: all(cluster.controlled(n) for n in JOBS) and head.proc.poll() is None,
        15,
        cluster.logs,
    )
    cluster.finish("db-postgresql-stopped", meter, jobs)
    assert head.proc.poll() is None


def test_sqlite_locked_by_another_process(sqlite_cluster: Cluster) -> None:
    cluster = sqlite_cluster
    head = cluster.start_head()
    meter = cluster.establish()
    jobs = registrar(cluster)
    jobs.register(1)

    locker = sqlite3.connect(cluster.tmp_path / "cdgpc.db", isolation_level=None, timeout=10)
    try:
        locker.execute("BEGIN EXCLUSIVE")
        jobs.register(2)  # waits for the lock, times out, spooled; the head commits later
        time.sleep(1.5)
    finally:
        locker.execute("COMMIT")
        locker.close()
    _wait(
        "both jobs controlled again, by the same cdgpcd",
        lambda: all(cluster.controlled(n) for n in JOBS) and head.proc.poll() is None,
        15,
        cluster.logs,
    )
    cluster.finish("db-sqlite-locked", meter, jobs)
    assert head.proc.poll() is None
