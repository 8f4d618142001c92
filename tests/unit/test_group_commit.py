"""`GroupCommit`: concurrent requests share batches, and each caller gets its own outcome.

Real threads; a batch function that blocks on an event lets a test hold one batch open while
the others queue behind it, so which requests share a batch is known, not timed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.store.group_commit import GroupCommit, WouldBlockError

WAIT_S = 10.0  # correctness deadline on a loaded machine, never a speed bound


class _Recorder:
    """A batch function: records each batch, squares numbers, refuses negative ones."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.release = threading.Event()
        self.release.set()
        self.fail_with: BaseException | None = None

    def __call__(self, items: Sequence[int]) -> list[int | Exception]:
        self.batches.append(list(items))
        assert self.release.wait(WAIT_S)
        if self.fail_with is not None:
            raise self.fail_with
        return [InputError(f"{i} refused") if i < 0 else i * i for i in items]


def _run_all(
    group: GroupCommit[int, int], items: Sequence[int], *, before_join: Callable[[], None]
) -> dict[int, Any]:
    results: dict[int, Any] = {}
    lock = threading.Lock()

    def call(item: int) -> None:
        try:
            outcome: Any = group.submit(item)
        except BaseException as e:
            outcome = e
        with lock:
            results[item] = outcome

    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in items]
    for t in threads:
        t.start()
    before_join()
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive(), "a caller never got its outcome"
    return results


def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def _held_first_batch(
    recorder: _Recorder, group: GroupCommit[int, int], queued: int
) -> Callable[[], None]:
    """Holds the first batch open until ``queued`` requests wait behind it, then lets go."""
    recorder.release.clear()

    def release() -> None:
        _until(lambda: len(recorder.batches) == 1 and group.waiting() == queued)
        recorder.release.set()

    return release


def test_requests_that_arrive_during_a_commit_share_the_next_one() -> None:
    recorder = _Recorder()
    group: GroupCommit[int, int] = GroupCommit(recorder)
    items = list(range(1, 41))
    results = _run_all(group, items, before_join=_held_first_batch(recorder, group, 39))
    assert results == {i: i * i for i in items}  # every caller got its own answer
    assert len(recorder.batches) == 2 and len(recorder.batches[1]) == 39
    assert sorted(i for batch in recorder.batches for i in batch) == items  # each applied once
    assert (group.batches, group.largest_batch) == (2, 39)


def test_a_refused_request_fails_alone_and_its_batch_commits() -> None:
    recorder = _Recorder()
    group: GroupCommit[int, int] = GroupCommit(recorder)
    items = [1, 2, -3, 4, 5]
    results = _run_all(group, items, before_join=_held_first_batch(recorder, group, 4))
    assert isinstance(results[-3], InputError) and str(results[-3]) == "-3 refused"
    assert {i: results[i] for i in items if i != -3} == {1: 1, 2: 4, 4: 16, 5: 25}


def test_a_failing_commit_fails_every_request_of_its_batch_and_the_next_batch_works() -> None:
    recorder = _Recorder()
    group: GroupCommit[int, int] = GroupCommit(recorder)
    recorder.fail_with = OSError("disk full")
    results = _run_all(group, range(10), before_join=_held_first_batch(recorder, group, 9))
    assert all(isinstance(r, OSError) and str(r) == "disk full" for r in results.values())
    assert len(results) == 10
    recorder.fail_with = None
    assert group.submit(7) == 49  # the lead was handed back: nothing is stuck


def test_a_batch_function_that_loses_outcomes_fails_the_whole_batch() -> None:
    group: GroupCommit[int, int] = GroupCommit(lambda items: [0] * (len(items) - 1))
    with pytest.raises(RuntimeError, match="0 outcome"):
        group.submit(1)


def test_batches_are_capped() -> None:
    recorder = _Recorder()
    group: GroupCommit[int, int] = GroupCommit(recorder, max_batch=8)
    items = list(range(1, 26))
    results = _run_all(group, items, before_join=_held_first_batch(recorder, group, 24))
    assert results == {i: i * i for i in items}
    assert [len(b) for b in recorder.batches] == [1, 8, 8, 8]


def test_max_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        GroupCommit(list, max_batch=0)


# -- submit_later: outcomes handed to a function, on the committing thread ---------------------


def _outcome(get: Callable[[], int]) -> Any:
    try:
        return get()
    except Exception as e:
        return e


def test_later_requests_share_the_batch_of_a_waiting_caller_and_get_their_outcomes() -> None:
    recorder = _Recorder()
    group: GroupCommit[int, int] = GroupCommit(recorder)
    recorder.release.clear()
    outcomes: dict[int, tuple[Any, str]] = {}

    def record(item: int) -> Callable[[Callable[[], int]], None]:
        return lambda get: outcomes.__setitem__(
            item, (_outcome(get), threading.current_thread().name)
        )

    blocker = threading.Thread(target=group.submit, args=(1,), name="waiting-caller", daemon=True)
    blocker.start()
    deadline = time.monotonic() + WAIT_S
    while not recorder.batches and time.monotonic() < deadline:
        time.sleep(0.01)
    for item in (2, -3, 4):  # queued behind the open batch: nobody waits on them
        group.submit_later(item, record(item))
    assert outcomes == {}
    recorder.release.set()
    blocker.join(WAIT_S)
    assert recorder.batches == [[1], [2, -3, 4]]
    # the caller that led the first batch led theirs too, and handed each its own outcome
    assert outcomes[2] == (4, "waiting-caller") and outcomes[4] == (16, "waiting-caller")
    assert isinstance(outcomes[-3][0], InputError)


def test_a_later_request_with_nothing_in_progress_commits_on_its_own_thread() -> None:
    group: GroupCommit[int, int] = GroupCommit(_Recorder())
    seen: list[Any] = []
    group.submit_later(5, lambda get: seen.append(_outcome(get)))
    assert seen == [25]  # before submit_later returned
    assert group.submit(6) == 36  # and the lead was given back


def test_a_failed_batch_reaches_every_later_request_and_a_bad_consumer_harms_nobody() -> None:
    recorder = _Recorder()
    recorder.fail_with = RuntimeError("disk full")
    group: GroupCommit[int, int] = GroupCommit(recorder)
    seen: list[Any] = []

    def broken(get: Callable[[], int]) -> None:
        raise ValueError("a consumer's own bug")

    group.submit_later(1, broken)
    group.submit_later(2, lambda get: seen.append(_outcome(get)))
    assert [str(e) for e in seen] == ["disk full"]
    recorder.fail_with = None
    assert group.submit(3) == 9  # the group still works


# -- lead=False and lead_queued: a thread that must not block (an event loop's) ----------------


def _busy(items: Sequence[int]) -> list[int | Exception]:
    raise WouldBlockError


def test_requests_queued_without_leading_commit_together_when_their_thread_leads() -> None:
    recorder = _Recorder()
    group: GroupCommit[int, int] = GroupCommit(recorder)
    seen: dict[int, Any] = {}
    for item in (1, -2, 3):
        group.submit_later(
            item, lambda get, item=item: seen.__setitem__(item, _outcome(get)), lead=False
        )
    assert recorder.batches == [] and group.waiting() == 3  # queued, nothing applied
    assert group.lead_queued() is True
    assert recorder.batches == [[1, -2, 3]]
    assert seen[1] == 1 and seen[3] == 9 and isinstance(seen[-2], InputError)
    assert group.lead_queued() is True and recorder.batches == [[1, -2, 3]]  # nothing left


def test_a_batch_that_would_block_stays_queued_as_it_was_for_a_thread_that_may_wait() -> None:
    recorder = _Recorder()
    group: GroupCommit[int, int] = GroupCommit(recorder)
    seen: list[tuple[int, Any]] = []
    for item in (4, 5, 6):
        group.submit_later(
            item, lambda get, item=item: seen.append((item, _outcome(get))), lead=False
        )
    assert group.lead_queued(_busy) is False
    assert seen == [] and recorder.batches == [] and group.waiting() == 3
    assert group.batches == 0  # a batch that would block is no batch
    group.submit_later(7, lambda get: seen.append((7, _outcome(get))), lead=False)
    waiter = threading.Thread(target=group.lead_queued, name="may-wait", daemon=True)
    waiter.start()
    waiter.join(WAIT_S)
    assert recorder.batches == [[4, 5, 6, 7]]  # in the order they came, none lost or doubled
    assert seen == [(4, 16), (5, 25), (6, 36), (7, 49)]
    assert group.submit(2) == 4  # the lead was given back


def test_leading_what_is_queued_while_a_batch_is_in_progress_leaves_it_to_that_leader() -> None:
    recorder = _Recorder()
    group: GroupCommit[int, int] = GroupCommit(recorder)
    recorder.release.clear()
    leader = threading.Thread(target=group.submit, args=(1,), daemon=True)
    leader.start()
    _until(lambda: len(recorder.batches) == 1)
    seen: list[Any] = []
    group.submit_later(2, lambda get: seen.append(_outcome(get)), lead=False)
    assert group.lead_queued() is True  # at once: the batch in progress holds the lead
    assert seen == []
    recorder.release.set()
    leader.join(WAIT_S)
    assert recorder.batches == [[1], [2]] and seen == [4]
