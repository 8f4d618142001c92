"""The leader lock on SQLite and PostgreSQL: acquire, renew, take over after expiry, fencing.

Epochs follow the database's clock in milliseconds (and always rise), so the tests compare
them with each other, never with fixed numbers.

Leases here are a few tenths of a second of the database's clock, so the expiries are real.
The last tests run two `Coordinator`s on one store against an in-process agent: the head that
lost the lock never pushes again, the agent follows the newer epoch, and a head that lost the
lock after its last push records nothing of that interval.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sqlalchemy import Connection, Engine, text

from slurm_cdgpc.agent.node import NodeAgent
from slurm_cdgpc.config import SafeCap
from slurm_cdgpc.control.empc import ControllerSettings
from slurm_cdgpc.coordinator.daemon import Coordinator, CoordinatorSettings
from slurm_cdgpc.gpu.simulated import simulated_gpus
from slurm_cdgpc.store import Store, upgrade
from slurm_cdgpc.store.leader import LeaderLock, LeadershipLostError
from slurm_cdgpc.transport.http import NodeFailure, NodeTarget
from slurm_cdgpc.wire.protocol import ExchangeRequest, ExchangeResponse

#: long enough never to run out during a test step, even on a loaded machine
LONG_S = 30.0
#: short enough to wait out
SHORT_S = 0.3


@pytest.fixture
def engine(make_db_engine: Callable[[], Engine]) -> Engine:
    """An engine on a migrated database (the lock row comes with migration 0002)."""
    engine = make_db_engine()
    upgrade(engine)
    return engine


def _expire(lock: LeaderLock) -> None:
    """Wait until ``lock``'s lease has run out on the database's clock."""
    deadline = time.monotonic() + 10 * lock.lease_s + 5
    while lock.state().expires_in_s > 0:
        assert time.monotonic() < deadline, "the lease never ran out"
        time.sleep(0.05)


def test_the_first_head_takes_the_lock_and_the_next_one_waits(engine: Engine) -> None:
    a, b = LeaderLock(engine, "head-a:1", LONG_S), LeaderLock(engine, "head-b:2", LONG_S)
    assert a.state().holder == "" and a.state().epoch == 0
    assert a.try_acquire()
    assert a.held and a.epoch > 0
    assert abs(a.epoch / 1000 - time.time()) < 60  # the database's clock, in milliseconds
    assert not b.try_acquire()
    assert not b.held and b.epoch == 0
    state = b.state()
    assert state.holder == "head-a:1" and state.epoch == a.epoch and state.held
    assert 0 < state.expires_in_s <= LONG_S


def test_renewing_keeps_the_lock_and_its_epoch(engine: Engine) -> None:
    a, b = LeaderLock(engine, "head-a:1", 2.0), LeaderLock(engine, "head-b:2", 2.0)
    assert a.try_acquire()
    epoch = a.epoch
    for _ in range(4):  # 4 × 0.7 s: longer than the lease, renewed all along
        time.sleep(0.7)
        a.confirm()
        assert not b.try_acquire()
    assert a.epoch == epoch and a.state().epoch == epoch


def test_an_expired_lock_is_taken_over_at_a_higher_epoch(engine: Engine) -> None:
    a, b = LeaderLock(engine, "head-a:1", SHORT_S), LeaderLock(engine, "head-b:2", LONG_S)
    assert a.try_acquire()
    old = a.epoch
    assert not b.try_acquire()
    _expire(a)  # head a is paused (or cut off) past its lease
    assert b.try_acquire() and b.epoch > old
    # a wakes up: its renewal finds the lock gone, whatever its own clock says
    lost = f"lost the leader lock (epoch {old}): head-b:2 holds it at epoch {b.epoch}"
    with pytest.raises(LeadershipLostError) as info:
        a.confirm()
    assert str(info.value) == lost
    assert not a.held and a.epoch == 0
    assert not a.try_acquire()
    b.confirm()  # unaffected
    assert b.state().holder == "head-b:2"


def test_a_head_that_lost_the_lock_comes_back_only_with_a_new_epoch(engine: Engine) -> None:
    a, b = LeaderLock(engine, "head-a:1", SHORT_S), LeaderLock(engine, "head-b:2", SHORT_S)
    assert a.try_acquire()
    first = a.epoch
    _expire(a)
    assert b.try_acquire()
    with pytest.raises(LeadershipLostError):
        a.try_acquire()  # it believed it held the lock: trying again renews, and finds out
    _expire(b)
    assert a.try_acquire()
    assert a.epoch > b.epoch > first  # never its old epoch: agents that saw b's accept it
    with pytest.raises(LeadershipLostError):
        b.confirm()


def test_an_expired_lock_nobody_took_is_still_the_holders(engine: Engine) -> None:
    """No other head raised the epoch, so nobody pushed: renewing is safe, and the agents have
    seen nothing newer to refuse it for."""
    a = LeaderLock(engine, "head-a:1", SHORT_S)
    assert a.try_acquire()
    _expire(a)
    epoch = a.epoch
    a.confirm()
    assert a.epoch == epoch and a.state().held


def test_release_lets_a_standby_take_over_at_once(engine: Engine) -> None:
    a, b = LeaderLock(engine, "head-a:1", LONG_S), LeaderLock(engine, "head-b:2", LONG_S)
    assert a.try_acquire()
    first = a.epoch
    a.release()
    assert not a.held and a.state().holder == "" and a.state().epoch == first
    assert b.try_acquire() and b.epoch > first
    a.release()  # not held: a no-op, never frees b's lock
    assert b.state().holder == "head-b:2"


def test_a_confirm_without_the_lock_is_refused(engine: Engine) -> None:
    with pytest.raises(LeadershipLostError, match="does not hold"):
        LeaderLock(engine, "head-a:1", LONG_S).confirm()


def test_standbys_racing_for_an_expired_lock_make_one_leader(
    make_db_engine: Callable[[], Engine], engine: Engine
) -> None:
    """Each standby on its own connection pool, all trying at the same instant."""
    old = LeaderLock(engine, "head-old:1", SHORT_S)
    assert old.try_acquire()
    before = old.epoch
    _expire(old)
    standbys = [LeaderLock(make_db_engine(), f"standby-{i}:{i}", LONG_S) for i in range(6)]
    start = threading.Barrier(len(standbys))
    won: list[bool] = [False] * len(standbys)

    def contend(i: int) -> None:
        start.wait()
        won[i] = standbys[i].try_acquire()

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(standbys))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sum(won) == 1
    winner = standbys[won.index(True)]
    assert old.state().holder == winner.holder and old.state().epoch == winner.epoch
    assert winner.epoch > before


def test_a_store_restored_from_a_backup_still_hands_out_newer_epochs(engine: Engine) -> None:
    """A plain counter would start again below what the agents have seen, and every agent
    would refuse the head; the clock-based epoch does not go back."""
    a = LeaderLock(engine, "head-a:1", LONG_S)
    assert a.try_acquire()
    seen_by_agents = a.epoch
    a.release()
    with engine.begin() as conn:  # the backup was taken before any takeover
        conn.execute(text("UPDATE leader SET holder = '', epoch = 1, expires_at_s = 0"))
    time.sleep(0.01)
    b = LeaderLock(engine, "head-b:2", LONG_S)
    assert b.try_acquire()
    assert b.epoch > seen_by_agents


# -- two heads on one store ----------------------------------------------------------------------


@dataclass
class Recorder:
    """The agent behind the JSON wire format, noting which epoch every request came from."""

    agent: NodeAgent
    epochs: list[int] = field(default_factory=list)

    def exchange(
        self, targets: Mapping[str, NodeTarget]
    ) -> dict[str, ExchangeResponse | NodeFailure]:
        out: dict[str, ExchangeResponse | NodeFailure] = {}
        for node, target in targets.items():
            request = ExchangeRequest.from_json(target.request.to_json())
            self.epochs.append(request.epoch)
            out[node] = ExchangeResponse.from_json(self.agent.exchange(request).to_json())
        return out


def _agent(tmp_path: Path) -> NodeAgent:
    """Node n1's agent: two simulated A100s, a 5 s lease."""
    return NodeAgent(
        simulated_gpus("A100-SXM4-80GB", 2, seed=1),
        SafeCap(clock_fraction=0.6),
        tmp_path / "state.json",
        node_name="n1",
        lease_duration_s=5.0,
    )


def _head(store: Store, transport: Recorder, lock: LeaderLock) -> Coordinator:
    settings = CoordinatorSettings(
        interval_s=1.0, lease_s=5.0, controller=ControllerSettings(interval_s=1.0)
    )
    return Coordinator(store, transport, settings, leader=lock)


def test_the_head_that_lost_the_lock_pushes_nothing_more(engine: Engine, tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    transport = Recorder(agent)
    store = Store(engine)
    store.upsert_node("n1", "http://n1:8464", gpu_count=0, gpu_type="", worst_case_power_w=0.0)
    lock_a = LeaderLock(engine, "head-a:1", SHORT_S)
    lock_b = LeaderLock(engine, "head-b:2", LONG_S)
    assert lock_a.try_acquire()
    a = _head(store, transport, lock_a)
    a.start()
    a.run_interval()
    old, new = lock_a.epoch, 0
    assert transport.epochs == [old] and agent.epoch == old

    _expire(lock_a)  # head a is paused past its leader lease; b takes over and resumes
    assert lock_b.try_acquire()
    b = _head(store, transport, lock_b)
    b.start()
    b.run_interval()
    new = lock_b.epoch
    assert new > old
    assert transport.epochs == [old, new] and agent.epoch == new

    # a wakes up: its renewal before the push fails, so nothing is sent
    with pytest.raises(LeadershipLostError):
        a.run_interval()
    assert transport.epochs == [old, new]
    # run() does not swallow it either (other interval errors are logged and survived)
    with pytest.raises(LeadershipLostError):
        a.run(threading.Event())
    assert transport.epochs == [old, new]
    b.run_interval()
    assert transport.epochs == [old, new, new]


class PausingStore(Store):
    """A `Store` whose next write transaction, once armed, starts only after the head's lease
    has run out and another head took the lock: the head was paused after its last renewal on
    its own and before it began to record its interval."""

    armed: tuple[LeaderLock, LeaderLock] | None = None

    @contextmanager
    def transaction(self, *, wait: bool = True) -> Iterator[Connection]:
        if self.armed is not None:
            (paused, taker), self.armed = self.armed, None
            _expire(paused)
            assert taker.try_acquire()
        with super().transaction(wait=wait) as connection:
            yield connection


def test_a_head_paused_before_it_records_its_interval_records_nothing(
    engine: Engine, tmp_path: Path
) -> None:
    agent = _agent(tmp_path)
    transport = Recorder(agent)
    store = PausingStore(engine)
    store.upsert_node("n1", "http://n1:8464", gpu_count=0, gpu_type="", worst_case_power_w=0.0)
    lock_a = LeaderLock(engine, "head-a:1", SHORT_S)
    assert lock_a.try_acquire()
    a = _head(store, transport, lock_a)
    a.start()
    a.register_job("7", "root", "n1", [0, 1])
    for _ in range(3):
        lock_a.confirm()  # a loaded machine must not expire the short lease between intervals
        a.run_interval()
    recorded = [(d.interval_index, d.price) for d in store.decisions(limit=50)]
    assert recorded, "the head recorded no decision while it led"
    models = store.load_models(a.settings.estimator.family, ["7"])

    store.armed = (lock_a, LeaderLock(engine, "head-b:2", LONG_S))
    lock_a.confirm()
    with pytest.raises(LeadershipLostError):
        a.run_interval()  # pushed under its lock, then lost it before it recorded anything
    assert store.armed is None, "the interval was never recorded"
    assert [(d.interval_index, d.price) for d in store.decisions(limit=50)] == recorded
    again = store.load_models(a.settings.estimator.family, ["7"])
    assert again.job_ids == models.job_ids
    for before, after in ((models.power, again.power), (models.time, again.time)):
        assert (before.theta == after.theta).all() and (before.count == after.count).all()
