"""Group commit (`GroupCommit`): writes that arrive together share one transaction, and so one
flush. It has no thread of its own, and nothing is acknowledged before it is durable. It imports
nothing of the package; like all of `store/`, it never reaches `coordinator/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "The head's API" (Group commit); tests:
`tests/unit/test_group_commit.py`, `tests/integration/test_registration_commit.py`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class WouldBlockError(Exception):
    """Raised by a batch function given to `GroupCommit.lead_queued` when it could start only
    by waiting (for a lock another writer holds); it has done nothing of the batch."""


@dataclass(eq=False)
class _Ticket(Generic[T, R]):
    item: T
    #: set when a waiting caller (`GroupCommit.submit`) has its outcome or the lead; None for
    #: `GroupCommit.submit_later`, where nobody waits (an Event per request costs the head's
    #: CPU under a burst: DESIGN.md, "The head's API")
    ready: threading.Event | None = None
    lead: bool = False
    #: called with the outcome by the leading thread (`GroupCommit.submit_later`)
    then: Callable[[_Ticket[T, R]], None] | None = None
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
    caller of that batch then gets the exception; no other caller's exception reaches one.

    The first caller to find no batch in progress leads one: it takes every request queued so
    far (its own included), applies them in one call, hands each caller its own outcome, and
    passes the lead to the first request that queued meanwhile. A caller returns only once the
    batch holding its request has committed (or failed). `submit_later` queues a request with a
    function to call with its outcome instead (nobody waits on it, so whoever leads keeps
    leading through it). A thread that must never block (an event loop's) queues with
    ``lead=False`` and commits at a moment of its choosing with `lead_queued`, giving a batch
    function that refuses to wait (`WouldBlockError`, before it has done anything): the batch
    then stays queued as it was, and a thread that may wait commits it.
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

    @property
    def busy(self) -> bool:
        """A batch is being applied (its leader may be waiting for the store)."""
        with self._lock:
            return self._busy

    def submit(self, item: T) -> R:
        """Apply ``item`` (with whatever else is waiting) and return its outcome once committed."""
        ticket: _Ticket[T, R] = _Ticket(item, threading.Event())
        with self._lock:
            self._queue.append(ticket)
            if not self._busy:
                self._busy = ticket.lead = True
        if not ticket.lead:
            assert ticket.ready is not None
            ticket.ready.wait()
            if not ticket.lead:
                return ticket.outcome()
        self._lead(self._apply)
        return ticket.outcome()

    def submit_later(
        self, item: T, then: Callable[[Callable[[], R]], None], *, lead: bool = True
    ) -> None:
        """Queue ``item``; once its batch has committed or failed, ``then(outcome)`` is called on
        the thread that applied the batch (this one, when no batch was in progress), where
        ``outcome()`` returns the result or raises the error. ``then`` must not block.

        With ``lead=False`` this only queues, even with no batch in progress: the caller then
        has what it queued committed by `lead_queued`."""
        ticket: _Ticket[T, R] = _Ticket(item, then=lambda t: then(t.outcome))
        with self._lock:
            self._queue.append(ticket)
            if self._busy or not lead:
                return
            self._busy = ticket.lead = True
        self._lead(self._apply)

    def lead_queued(
        self, apply: Callable[[Sequence[T]], Sequence[R | Exception]] | None = None
    ) -> bool:
        """Commit what is queued, batch after batch, unless a batch is in progress (its leader
        takes it). ``apply`` stands in for the batch function; when it raises `WouldBlockError`,
        its batch goes back to the head of the queue as it was and this returns False: the
        caller must then have it committed by a thread that may wait (``lead_queued()`` there)."""
        if not self._queue:  # unlocked: a request queued just now is its submitter's to lead
            return True
        with self._lock:
            if self._busy or not self._queue:
                return True
            self._busy = True
        return self._lead(self._apply if apply is None else apply)

    def _lead(self, apply: Callable[[Sequence[T]], Sequence[R | Exception]]) -> bool:
        """Lead batches until nobody is left for whom this thread must; False when ``apply``
        would block (its batch is queued again, first)."""
        while True:
            with self._lock:
                batch = self._queue[: self.max_batch]
                self._queue = self._queue[self.max_batch :]
            try:
                applied = self._run(batch, apply)
            except BaseException:
                self._pass_lead(keep=False)
                raise
            if not applied:
                with self._lock:
                    self._queue[:0] = batch
                self._pass_lead(keep=False)
                return False
            if not self._pass_lead(keep=True):
                return True

    def _pass_lead(self, *, keep: bool) -> bool:
        """After a batch, hand the lead to the caller waiting on the next one; True when nobody
        waits on it (`submit_later`) and this thread, if it may ``keep`` the lead, leads it."""
        with self._lock:
            following = self._queue[0] if self._queue else None
            if following is None or (following.then is not None and not keep):
                self._busy = False  # the next submit leads whatever is queued
                return False
            if following.then is not None:
                return True
            following.lead = True
        assert following.ready is not None
        following.ready.set()
        return False

    def _run(
        self,
        batch: list[_Ticket[T, R]],
        apply: Callable[[Sequence[T]], Sequence[R | Exception]],
    ) -> bool:
        """Apply ``batch`` and hand each request its outcome; False, nothing done, when
        ``apply`` would block."""
        try:
            outcomes = apply([t.item for t in batch])
            if len(outcomes) != len(batch):
                raise RuntimeError(
                    f"group commit: {len(outcomes)} outcome(s) for {len(batch)} request(s)"
                )
        except WouldBlockError:
            return False
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
        self._finish(batch)
        return True

    def _finish(self, batch: list[_Ticket[T, R]]) -> None:
        self.batches += 1
        self.largest_batch = max(self.largest_batch, len(batch))
        for t in batch:
            if t.then is not None:
                try:
                    t.then(t)
                except Exception:
                    logger.exception("group commit: an outcome's consumer failed")
            elif not t.lead:
                assert t.ready is not None
                t.ready.set()
