"""The leader lock (`LeaderLock`): which ``cdgpcd`` may push, and the epoch that fences out the
others, at the agents and in the store's own transaction. Expiry runs on the database's clock,
never a head's. Like all of `store/`, it never reaches `coordinator/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Standby heads"; tests:
`tests/unit/test_head_standby.py`, `tests/integration/test_leader.py`.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

from sqlalchemy import Connection, Engine, text

from slurm_cdgpc.errors import FatalError, InputError
from slurm_cdgpc.store.engine import WRITE, StoreError, translated_errors

logger = logging.getLogger(__name__)

#: the one row's key
_ROW: Final = 1
_MAX_HOLDER_CHARS: Final = 255

#: the database's clock, in UNIX epoch seconds
_NOW: Final = {
    "postgresql": "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}
#: the next epoch: the database's clock in milliseconds, or one more than the last, if more
_NEXT_EPOCH: Final = {
    "postgresql": "GREATEST(epoch + 1, CAST(FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000) "
    "AS BIGINT))",
    "sqlite": "MAX(epoch + 1, CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER))",
}


class LeadershipLostError(FatalError):
    """Another head holds the leader lock now: this one must not push another setpoint."""


@dataclass(frozen=True)
class LeaderState:
    """The lock as the database sees it now."""

    holder: str  # '' when free
    epoch: int
    #: seconds until the lease expires, on the database's clock (≤ 0: expired)
    expires_in_s: float

    @property
    def held(self) -> bool:
        return bool(self.holder) and self.expires_in_s > 0


def default_holder() -> str:
    """``host:pid``: unique among live processes, and tells an operator where the leader runs."""
    return f"{socket.gethostname().split('.')[0] or 'localhost'}:{os.getpid()}"


class LeaderLock:
    """One process's handle on the leader lock (not thread safe: the control loop owns it):
    the single row of the ``leader`` table (migration 0002). ``lease_s`` should be shorter than
    the agents' lease, so that a standby takes over before the agents fall to their safe cap."""

    def __init__(self, engine: Engine, holder: str, lease_s: float) -> None:
        if not (0 < len(holder) <= _MAX_HOLDER_CHARS and holder.isprintable()):
            raise InputError(f"leader holder must be 1..{_MAX_HOLDER_CHARS} printable characters")
        if not lease_s > 0:
            raise InputError(f"leader lease must be positive, got {lease_s}")
        dialect = engine.dialect.name
        if dialect not in _NOW:
            raise InputError(f"no leader lock on {dialect} (only {', '.join(_NOW)})")
        self.engine = engine
        self.holder = holder
        self.lease_s = float(lease_s)
        self._now = _NOW[dialect]
        self._next_epoch = _NEXT_EPOCH[dialect]
        self._epoch: int | None = None

    @property
    def epoch(self) -> int:
        """The fencing token of this tenure (0 while the lock is not held)."""
        return self._epoch or 0

    @property
    def held(self) -> bool:
        """Whether this process believes it holds the lock (`confirm` checks it)."""
        return self._epoch is not None

    def try_acquire(self) -> bool:
        """Take the lock if it is free or expired (a new, higher epoch); True if held now."""
        if self._epoch is not None:
            self.confirm()
            return True
        with self._write("leader lock: acquire") as conn:
            row = conn.execute(
                text(
                    f"UPDATE leader SET holder = :holder, epoch = {self._next_epoch}, "
                    f"acquired_at_s = {self._now}, expires_at_s = {self._now} + :lease "
                    f"WHERE id = :row AND (holder = '' OR expires_at_s <= {self._now}) "
                    "RETURNING epoch"
                ),
                {"holder": self.holder, "lease": self.lease_s, "row": _ROW},
            ).first()
        if row is None:
            return False
        self._epoch = int(row[0])
        return True

    def confirm(self, within: Connection | None = None) -> None:
        """Renew the lease, or raise `LeadershipLostError` if another head took the lock.

        ``within``: renew inside that connection's transaction (the caller's write), which then
        commits only while this head holds the lock; the error is raised inside it, so it rolls
        back. Otherwise the renewal is a transaction of its own.

        A database that cannot be reached raises `StoreError`: leadership is then unproven and
        the caller must not push either, but it has not been lost yet.
        """
        if self._epoch is None:
            raise LeadershipLostError("this head does not hold the leader lock")
        if within is not None:
            with translated_errors("leader lock: renew"):
                renewed = self._renew(within)
        else:
            with self._write("leader lock: renew") as conn:
                renewed = self._renew(conn)
        if renewed == 1:
            return
        mine, self._epoch = self._epoch, None
        try:
            now = self.state()
            by = f"{now.holder or 'nobody'} holds it at epoch {now.epoch}"
        except StoreError as e:
            by = f"the holder is unknown: {e}"
        raise LeadershipLostError(f"lost the leader lock (epoch {mine}): {by}")

    def _renew(self, conn: Connection) -> int:
        assert self._epoch is not None
        return conn.execute(
            text(
                f"UPDATE leader SET expires_at_s = {self._now} + :lease "
                "WHERE id = :row AND holder = :holder AND epoch = :epoch"
            ),
            {"holder": self.holder, "epoch": self._epoch, "lease": self.lease_s, "row": _ROW},
        ).rowcount

    def release(self) -> None:
        """Free the lock if this process still holds it (a standby then takes it at once). The
        epoch stays: the next holder raises it."""
        if self._epoch is None:
            return
        epoch, self._epoch = self._epoch, None
        with self._write("leader lock: release") as conn:
            conn.execute(
                text(
                    f"UPDATE leader SET holder = '', expires_at_s = {self._now} "
                    "WHERE id = :row AND holder = :holder AND epoch = :epoch"
                ),
                {"holder": self.holder, "epoch": epoch, "row": _ROW},
            )

    def state(self) -> LeaderState:
        """Who holds the lock, at which epoch, and for how long yet."""
        with translated_errors("leader lock: read"), self.engine.connect() as conn:
            row = conn.execute(
                text(
                    f"SELECT holder, epoch, expires_at_s - {self._now} FROM leader WHERE id = :row"
                ),
                {"row": _ROW},
            ).first()
        if row is None:
            raise StoreError("leader lock: the leader row is missing (run cdgpc-admin db upgrade)")
        return LeaderState(str(row[0]), int(row[1]), float(row[2]))

    @contextmanager
    def _write(self, what: str) -> Iterator[Connection]:
        """One write transaction (SQLite: ``BEGIN IMMEDIATE``), committed at the end of the
        block; database errors become a one-line `StoreError`."""
        with translated_errors(what), self.engine.connect() as conn:
            conn.execution_options(**{WRITE: True})  # in place (SQLAlchemy 2)
            with conn.begin():
                yield conn
