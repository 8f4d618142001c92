"""A standby cdgpcd: the leader lease it runs with, and how it waits for the lock (SQLite file)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from slurm_cdgpc.config import ConfigError, load_config
from slurm_cdgpc.coordinator.main import wait_for_leadership
from slurm_cdgpc.store import make_engine, upgrade
from slurm_cdgpc.store.leader import LeaderLock


@pytest.fixture(autouse=True)
def no_system_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("slurm_cdgpc.config.DEFAULT_PATH", tmp_path / "absent.toml")


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = make_engine(f"sqlite:///{tmp_path / 'cdgpc.db'}")
    upgrade(engine)
    yield engine
    engine.dispose()


def test_the_leader_lease_is_one_and_a_half_intervals_below_the_agents_lease() -> None:
    head = load_config(env={}).head
    assert head.leader_lease_s is None
    assert head.leader_lease(30.0, 90.0) == 45.0
    # a lease only a little longer than the interval keeps a valid configuration valid
    assert head.leader_lease(30.0, 40.0) == 35.0
    config = load_config(env={"CDGPC_HEAD_LEADER_LEASE": "50s"})
    assert config.head.leader_lease(config.control.interval_s, config.lease.duration_s) == 50.0


@pytest.mark.parametrize("lease", ["30s", "20s", "90s", "2m"])
def test_a_leader_lease_outside_interval_and_agent_lease_is_refused(lease: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={"CDGPC_HEAD_LEADER_LEASE": lease})
    assert str(info.value).startswith(
        "CDGPC_HEAD_LEADER_LEASE: head.leader_lease: must be longer than control.interval (30s) "
        "and shorter than lease.duration (90s), got "
    )


def test_a_standby_waits_for_the_lock_and_takes_it_when_freed(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    active = LeaderLock(engine, "head-a:1", 30.0)
    standby = LeaderLock(engine, "head-b:2", 0.5)  # tries every 0.05 s
    assert active.try_acquire()
    first = active.epoch
    stop = threading.Event()
    took: list[bool] = []
    caplog.set_level(logging.INFO, logger="slurm_cdgpc.coordinator.main")
    waiter = threading.Thread(target=lambda: took.append(wait_for_leadership(standby, stop)))
    waiter.start()
    try:
        time.sleep(0.5)  # ten tries: the lease is live, it keeps waiting
        assert waiter.is_alive() and not standby.held
        active.release()  # the active head stops cleanly
        waiter.join(timeout=10)
        assert took == [True]
        assert standby.epoch > first
    finally:
        stop.set()
        waiter.join(timeout=10)
    said = [r.getMessage() for r in caplog.records]
    waiting = f"standby: head-a:1 holds the leader lock (epoch {first}); trying every 0.05s"
    assert said.count(waiting) == 1
    assert (
        f"leader lock taken as head-b:2 (epoch {standby.epoch}, lease 0.5s): this head is active"
        in said
    )


def test_a_standby_told_to_stop_returns_without_the_lock(engine: Engine) -> None:
    assert LeaderLock(engine, "head-a:1", 30.0).try_acquire()
    standby = LeaderLock(engine, "head-b:2", 30.0)
    stop = threading.Event()
    stop.set()
    assert not wait_for_leadership(standby, stop)
    assert not standby.held
