"""Group commit: writes that arrive together share one transaction, and so one disk flush.

Each durable commit costs a flush of the write-ahead log (SQLite) or of the WAL to disk
(PostgreSQL), and a database has one writer at a time either way. When many Prologs register at
once, one transaction per request queues every request behind every other one's flush; one
transaction for all the requests waiting at that moment pays the flush once.

No thread of its own: the first caller to find no batch in progress leads one. It takes every
request queued so far (its own included), applies them in one call, hands each caller its own
outcome, and passes the lead to the first request that queued meanwhile. A caller returns only
once the batch holding its request has committed (or failed), so nothing is acknowledged before
it is durable, and a caller's exception never reaches another caller unless the whole batch
failed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


@dataclass(eq=False)
class _Ticket(Generic[T, R]):
    item: T
    ready: threading.Event = field(default_factory=threading.Event)
    lead: bool = False
    value: R | None = None
    error: BaseException | None = None
    done: bool = False

    def outcome(self) -> R:
        if self.error is not None:
            raise self.error
        assert self.done
        return self.value  # type: ignore[return-value]  # R may itself allow None


class GroupCommit(Generic[T, R]):
    """Runs ``apply(items) -> outcomes`` on batches of concurrently submitted items.

    ``apply`` must commit before it returns (its result is what the callers are told), return one
    outcome per item in order, and raise only when nothing of the batch was committed: every
    caller of that batch then gets the exception.
    """

    def __init__(
        self, apply: Callable[[Sequence[T]], Sequence[R | Exception]], *, max_batch: int = 1000
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._apply = apply
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._queue: list[_Ticket[T, R]] = []
        self._busy = False
        #: batches applied and the largest one (metrics, tests)
        self.batches = 0
        self.largest_batch = 0

    def waiting(self) -> int:
        """Requests queued for the next batch (not those of a batch being applied)."""
        with self._lock:
            return len(self._queue)

    def submit(self, item: T) -> R:
        """Apply ``item`` (with whatever else is waiting) and return its outcome once committed."""
        ticket: _Ticket[T, R] = _Ticket(item)
        with self._lock:
            self._queue.append(ticket)
            if not self._busy:
                self._busy = ticket.lead = True
        if not ticket.lead:
            ticket.ready.wait()
            if not ticket.lead:
                return ticket.outcome()
        self._lead()
        return ticket.outcome()

    def _lead(self) -> None:
        with self._lock:
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
        try:
            self._run(batch)
        finally:
            with self._lock:
                following = self._queue[0] if self._queue else None
                if following is None:
                    self._busy = False
                else:
                    following.lead = True
            if following is not None:
                following.ready.set()

    def _run(self, batch: list[_Ticket[T, R]]) -> None:
        try:
            outcomes = self._apply([t.item for t in batch])
            if len(outcomes) != len(batch):
                raise RuntimeError(
                    f"group commit: {len(outcomes)} outcome(s) for {len(batch)} request(s)"
                )
        except BaseException as e:
            for t in batch:
                t.error, t.done = e, True
        else:
            for t, outcome in zip(batch, outcomes, strict=True):
                if isinstance(outcome, Exception):
                    t.error = outcome
                else:
                    t.value = outcome
                t.done = True
        finally:
            self.batches += 1
            self.largest_batch = max(self.largest_batch, len(batch))
            for t in batch:
                if not t.lead:
                    t.ready.set()
