"""Registrations under load: group commit on real databases (SQLite file and PostgreSQL).

Concurrent `Coordinator.register_job` calls share transactions; these tests hold it to what one
transaction per call guaranteed: every acknowledged registration is stored (also across a
SIGKILL of the process), a refused one fails alone, a failed commit fails every request of its
batch with one line and stores nothing, and `Store.register_jobs` gives each registration of a
batch exactly what `Store.register_job` would have given it alone, in order.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import pytest
from sqlalchemy import Engine, event

from slurm_cdgpc.coordinator.daemon import Coordinator, CoordinatorSettings
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.store import ACTIVE_STATES, Job, JobGpu, Store, StoreError, make_engine, upgrade
from slurm_cdgpc.store.repository import JobRegistration
from slurm_cdgpc.transport.http import NodeFailure, NodeTarget
from slurm_cdgpc.wire.protocol import ExchangeResponse
from tests.evidence import record
from tests.integration.conftest import FakeClock

WAIT_S = 30.0  # correctness deadline on a loaded machine, never a speed bound


class _NoAgents:
    def exchange(
        self, targets: Mapping[str, NodeTarget]
    ) -> dict[str, ExchangeResponse | NodeFailure]:
        return {node: NodeFailure("test: no agents") for node in targets}


def _coordinator(store: Store) -> Coordinator:
    coordinator = Coordinator(store, _NoAgents(), CoordinatorSettings())
    coordinator.start()
    return coordinator


def _concurrently(calls: list[Callable[[], Any]], before_join: Callable[[], None]) -> list[Any]:
    """Run each call in its own thread; each result or exception, in order."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    before_join()
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive(), "a registration never returned"
    return results


def _queue_behind_a_slow_commit(coordinator: Coordinator, queued: int) -> Callable[[], None]:
    """Holds the first batch in the store (as a slow commit would) until ``queued``
    registrations wait for the next batch: they then commit as one."""
    store = coordinator.store
    register_jobs = store.register_jobs
    go_on = threading.Event()

    def slow(registrations: list[JobRegistration]) -> list[Job | InputError]:
        go_on.wait(WAIT_S)
        return register_jobs(registrations)

    store.register_jobs = slow  # type: ignore[method-assign]

    def release() -> None:
        deadline = time.monotonic() + WAIT_S
        while coordinator.registrations.group_commit.waiting() < queued:
            assert time.monotonic() < deadline, "registrations did not queue"
            time.sleep(0.01)
        go_on.set()
        del store.register_jobs  # the store's own again

    return release


def test_concurrent_registrations_are_all_stored_in_shared_commits(store: Store) -> None:
    coordinator = _coordinator(store)
    calls: list[Callable[[], Any]] = [
        partial(coordinator.register_job, str(100 + i), "alice", f"n{i % 7}", [i % 8])
        for i in range(60)
    ]
    results = _concurrently(calls, _queue_behind_a_slow_commit(coordinator, 59))
    assert all(isinstance(r, Job) for r in results), [r for r in results if not isinstance(r, Job)]
    stored = {j.job_id: j.gpus for j in store.jobs(ACTIVE_STATES)}
    assert stored == {str(100 + i): (JobGpu(f"n{i % 7}", i % 8),) for i in range(60)}
    assert sorted(n.name for n in store.nodes()) == [f"n{i}" for i in range(7)]
    assert coordinator.registrations.group_commit.largest_batch == 59  # they did share a commit


def test_a_multi_node_job_registered_from_every_node_at_once_holds_every_node(
    store: Store,
) -> None:
    coordinator = _coordinator(store)
    calls: list[Callable[[], Any]] = [
        partial(coordinator.register_job, "77", "bob", f"gpu{n:02d}", [0, 1], gpu_type="A100")
        for n in range(8)
    ]
    results = _concurrently(calls, _queue_behind_a_slow_commit(coordinator, 7))
    assert all(isinstance(r, Job) for r in results)
    job = store.job("77")
    assert job is not None
    assert job.gpus == tuple(JobGpu(f"gpu{n:02d}", g) for n in range(8) for g in (0, 1))
    # each answer holds the nodes registered up to and including its own call
    assert sorted(len(r.gpus) for r in results) == [2 * k for k in range(1, 9)]
    assert {n.name: n.gpu_type for n in store.nodes()} == {
        f"gpu{n:02d}": "A100-SXM4-80GB" for n in range(8)
    }


def test_a_refused_registration_fails_alone_in_its_batch(store: Store) -> None:
    coordinator = _coordinator(store)
    coordinator.register_job("5", "alice", "n1", [0])
    calls: list[Callable[[], Any]] = [
        lambda: coordinator.register_job("6", "alice", "n1", [1]),
        lambda: coordinator.register_job("5", "mallory", "n2", [0]),  # alice's job id
        lambda: coordinator.register_job("7", "carol", "n3", [2]),
    ]
    results = _concurrently(calls, _queue_behind_a_slow_commit(coordinator, 2))
    assert isinstance(results[0], Job) and isinstance(results[2], Job)
    assert isinstance(results[1], InputError)
    assert str(results[1]) == "job 5 is registered to alice, not mallory"
    assert {j.job_id: j.user for j in store.jobs()} == {"5": "alice", "6": "alice", "7": "carol"}
    five = store.job("5")
    assert five is not None and five.gpus == (JobGpu("n1", 0),)  # untouched


def test_a_failing_commit_fails_every_request_of_the_batch_with_one_line(
    store: Store, engine: Engine
) -> None:
    coordinator = _coordinator(store)
    with engine.begin() as conn:  # the GPU table goes away: the batch's last insert fails
        conn.exec_driver_sql("ALTER TABLE job_gpus RENAME TO job_gpus_away")
    calls: list[Callable[[], Any]] = [
        partial(coordinator.register_job, str(i + 1), "alice", f"n{i}", [0]) for i in range(12)
    ]
    results = _concurrently(calls, _queue_behind_a_slow_commit(coordinator, 11))
    with engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE job_gpus_away RENAME TO job_gpus")
    assert all(isinstance(r, StoreError) for r in results), results
    assert all("\n" not in str(r) and "job_gpus" in str(r) for r in results)
    assert store.jobs() == [] and store.nodes() == []  # the whole batch was rolled back
    assert isinstance(coordinator.register_job("1", "alice", "n0", [0]), Job)  # and it recovers


def test_a_batch_gives_each_registration_what_it_would_get_alone(
    engine: Engine, clock: FakeClock
) -> None:
    """Retries, a second node, a user clash and a bad id, all in one batch, against the same
    registrations made one call at a time from the same starting point."""
    upgrade(engine)
    t = clock.now_s
    batch = [
        JobRegistration("1", "alice", {"b": [0, 1]}, deadline_s=t + 3600),  # second node
        JobRegistration("1", "alice", {"b": [1, 0]}),  # retried Prolog
        JobRegistration("3", "carol", {"c": [2]}, iterations_total=500),  # new
        JobRegistration("3", "carol", {"c": [3]}),  # its node's GPUs replaced
        JobRegistration("2", "mallory", {"a": [1]}),  # another user's id: refused
        JobRegistration("nope", "alice", {"a": [0]}),  # malformed: refused
        JobRegistration("4", "dave", {"d": [0]}, adopted=True),
    ]

    def fresh() -> Store:
        with engine.begin() as conn:
            for table in ("job_gpus", "jobs"):
                conn.exec_driver_sql(f"DELETE FROM {table}")
        store = Store(engine, clock=clock)
        store.register_job("1", "alice", {"a": [0]})
        store.register_job("2", "bob", {"a": [1]})
        return store

    alone: list[object] = []
    store = fresh()
    for r in batch:
        try:
            alone.append(
                store.register_job(
                    r.job_id,
                    r.user,
                    r.gpus,
                    deadline_s=r.deadline_s,
                    iterations_total=r.iterations_total,
                    adopted=r.adopted,
                )
            )
        except InputError as e:
            alone.append(e)
    together = fresh().register_jobs(batch)
    assert [_comparable(o) for o in together] == [_comparable(o) for o in alone]
    assert isinstance(together[4], InputError) and isinstance(together[5], InputError)
    one = together[1]
    assert isinstance(one, Job) and one.nodes == ("a", "b") and one.deadline_s == t + 3600
    assert [j.job_id for j in store.jobs()] == ["1", "2", "3", "4"]


def test_a_requeue_and_a_late_prolog_in_one_batch(store: Store, clock: FakeClock) -> None:
    store.register_job("9", "erin", {"a": [0]}, at_s=clock.now_s)
    clock.advance(60)
    store.finish_job("9")
    finished_at = clock.now_s
    clock.advance(60)
    late, requeued, again = store.register_jobs(
        [
            JobRegistration("9", "erin", {"b": [1]}, at_s=finished_at - 1),  # before the end
            JobRegistration("9", "erin", {"c": [2]}),  # a real requeue: starts over
            JobRegistration("9", "erin", {"d": [3]}),  # its second node
        ]
    )
    assert isinstance(late, Job) and late.state == "finished" and late.gpus == (JobGpu("a", 0),)
    assert isinstance(requeued, Job) and requeued.state == "registered"
    assert requeued.gpus == (JobGpu("c", 2),) and requeued.finished_at_s is None
    assert isinstance(again, Job) and again.gpus == (JobGpu("c", 2), JobGpu("d", 3))
    assert store.job("9") == again


def _comparable(outcome: object) -> object:
    return str(outcome) if isinstance(outcome, Exception) else outcome


_CHILD = textwrap.dedent(
    """
    import sys, threading
    from slurm_cdgpc.coordinator.daemon import Coordinator, CoordinatorSettings
    from slurm_cdgpc.store import Store, make_engine, upgrade

    class NoAgents:
        def exchange(self, targets):
            return {}

    engine = make_engine(sys.argv[1])
    upgrade(engine)
    coordinator = Coordinator(Store(engine), NoAgents(), CoordinatorSettings())
    coordinator.start()
    out = threading.Lock()

    def prolog(first):
        for job in range(first, 10**9, 16):
            coordinator.register_job(str(job), "alice", f"n{job % 50}", [job % 8])
            with out:  # acknowledged: the registration has committed
                sys.stdout.write(f"{job}\\n")
                sys.stdout.flush()

    threads = [threading.Thread(target=prolog, args=(i + 1,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    """
)


@pytest.mark.faults
@pytest.mark.live
def test_every_acknowledged_registration_survives_a_sigkill(db_url: str) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, db_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    acked: list[str] = []
    try:
        assert child.stdout is not None
        deadline = time.monotonic() + WAIT_S
        while len(acked) < 300:
            line = child.stdout.readline()
            assert line, f"the registering process died: {child.stderr.read()!r}"  # type: ignore[union-attr]
            acked.append(line.decode().strip())
            assert time.monotonic() < deadline, "too few registrations acknowledged"
        os.kill(child.pid, signal.SIGKILL)  # mid-stream: batches are being committed right now
        acked += [line.strip() for line in child.stdout.read().decode().splitlines()]
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(WAIT_S)
    assert child.returncode == -signal.SIGKILL
    engine = make_engine(db_url)
    try:
        stored = {j.job_id for j in Store(engine).jobs()}
    finally:
        engine.dispose()
    missing = set(acked) - stored
    record(
        "fault",
        f"sigkill-during-registrations-{db_url.split(':', 1)[0]}",
        injected=1,
        survived=int(not missing),
        registrations_sent=len(acked),
        registrations_stored=len(set(acked) & stored),
    )
    assert not missing, f"{len(missing)} acknowledged registration(s) lost: {sorted(missing)[:5]}"


@pytest.mark.postgres
def test_a_job_id_inserted_by_another_writer_meanwhile_is_registered_over_it(
    postgres_url: str, clock: FakeClock
) -> None:
    """PostgreSQL (SQLite has one writer at a time): another connection commits job 8 after
    the batch looked for it and before the batch inserts it. The batch starts over from its
    savepoint and treats job 8 as known: same user, its GPUs join; another user's, refused."""
    engine, other = make_engine(postgres_url), make_engine(postgres_url)
    try:
        upgrade(engine)
        store, intruder = Store(engine, clock=clock), Store(other, clock=clock)
        raced: list[str] = []

        @event.listens_for(engine, "before_cursor_execute")
        def _insert_first(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if statement.startswith("INSERT INTO jobs") and not raced:
                raced.append(statement)
                intruder.register_job("8", "alice", {"a": [0]})
                intruder.register_job("9", "zoe", {"z": [0]})

        eight, nine = store.register_jobs(
            [JobRegistration("8", "alice", {"b": [1]}), JobRegistration("9", "yann", {"y": [1]})]
        )
        assert raced  # the race did happen
        assert isinstance(eight, Job) and eight.gpus == (JobGpu("a", 0), JobGpu("b", 1))
        assert isinstance(nine, InputError) and str(nine) == "job 9 is registered to zoe, not yann"
        assert store.job("8") == eight
    finally:
        engine.dispose()
        other.dispose()
