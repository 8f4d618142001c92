"""``cdgpcd [--config PATH]``: builds the head from the configuration, takes or waits for the leader
lock, and runs the control loop and the API. A clean stop tells the agents nothing: their lease
lapses. Tests: `tests/integration/test_head_live.py`, `tests/faults/test_standby.py`,
`tests/integration/test_systemd_live.py`; design: DESIGN.md, "Standby heads", "Under systemd"
and "Safety" (the head stops, dies or is cut off).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Final

from slurm_cdgpc.config import Config, load_config
from slurm_cdgpc.coordinator.api import HeadHttpServer
from slurm_cdgpc.coordinator.daemon import Coordinator, CoordinatorSettings
from slurm_cdgpc.coordinator.reconcile import reconcile_with_slurm
from slurm_cdgpc.errors import CdgpcError, FatalError, InputError
from slurm_cdgpc.service import serve, settle_heap
from slurm_cdgpc.slurm.pyslurm_jobs import load_pyslurm
from slurm_cdgpc.slurm.pyslurm_jobs import read_jobs as pyslurm_read_jobs
from slurm_cdgpc.slurm.squeue import SQUEUE, SlurmJob, SqueueError, read_jobs, running_jobs
from slurm_cdgpc.store import Store, StoreError, make_engine, upgrade
from slurm_cdgpc.store.leader import LeaderLock, LeadershipLostError, default_holder
from slurm_cdgpc.systemd import Notifier, ProgressWatchdog
from slurm_cdgpc.topology import Topology, load_topology
from slurm_cdgpc.transport.auth import (
    AccessPolicy,
)
from slurm_cdgpc.transport.credentials import signer_from_config, verifier_from_config
from slurm_cdgpc.transport.http import NodeExchanger
from slurm_cdgpc.transport.routing import RoutingExchanger
from slurm_cdgpc.transport.ssh import SshExchanger

logger = logging.getLogger(__name__)

#: the longest an exchange with one node may take, whatever the interval
MAX_EXCHANGE_TIMEOUT_S: Final = 10.0
#: a standby tries to take the leader lock this many times per leader lease
STANDBY_TRIES_PER_LEASE: Final = 10


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="cdgpcd", description="Head daemon of slurm-cdgpc: GPU power capping for Slurm."
    )
    parser.add_argument(
        "--config",
        type=Path,
        help="configuration file (default: CDGPC_CONFIG or /etc/cdgpc/cdgpc.toml)",
    )
    args = parser.parse_args(argv)
    return serve("cdgpcd", lambda: run(load_config(args.config)))


def make_policy(config: Config) -> AccessPolicy:
    """Admins and the Slurm user from ``[auth]``; a name unknown here is logged and left out."""
    auth = config.auth

    def known(kind: str, names: Sequence[str]) -> list[str]:
        kept = []
        for name in names:
            try:
                if kind == "user":
                    AccessPolicy.from_names(admin_users=[name])
                else:
                    AccessPolicy.from_names(admin_groups=[name])
                kept.append(name)
            except InputError as e:
                logger.warning("%s; ignored", e)
        return kept

    slurm = known("user", [auth.slurm_user])
    return AccessPolicy.from_names(
        slurm_user=slurm[0] if slurm else None,
        admin_users=known("user", auth.admin_users),
        admin_groups=known("group", auth.admin_groups),
        hmac_is_admin=auth.hmac_is_admin,
    )


def exchange_timeout_s(interval_s: float) -> float:
    """Per-node timeout: well inside the interval (the round may take two of them)."""
    return min(0.3 * interval_s, MAX_EXCHANGE_TIMEOUT_S)


def control_stall_s(interval_s: float) -> float:
    """How long the control loop may go without starting an interval before the watchdog
    gives up on it: a period's wait, the interval's two exchange rounds, two more periods for
    the solve and the store; never under a minute (a restart costs more than a late one)."""
    return max(3 * interval_s + 2 * exchange_timeout_s(interval_s), 60.0)


def run(config: Config) -> int:
    """Run the head until SIGTERM, SIGINT or SIGHUP (after the interval in progress); 0.

    Start-up, in this order: load the power-domain topology (``head.topology``; a bad file
    stops the head here, as a bad configuration does); open the store and bring its schema up
    to date; build the signer (the exchanges, the API's signed answers) and the verifier and
    access policy from ``[auth]``; take the leader lock (`slurm_cdgpc.store.leader`), waiting
    as a standby while another head holds it; resume the `Coordinator` from the store; start
    the API on ``head.listen_address:listen_port``; then run the control loop on this thread.
    At the stop the API closes and the lock is released. `LeadershipLostError` (another head
    took over) ends it with nothing pushed again.
    """
    stop = threading.Event()
    notifier = Notifier.from_environment()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        logger.info("%s received: stopping after this interval", signal.Signals(signum).name)
        notifier.stopping()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)

    topology = _topology(config.head.topology)
    engine = make_engine(config.store.url)
    try:
        applied = upgrade(engine)
        if applied:
            logger.info("store schema upgraded (migrations %s)", ", ".join(map(str, applied)))
        store = Store(engine)
        settings = CoordinatorSettings.from_config(config)
        timeout_s = exchange_timeout_s(config.control.interval_s)
        signer = signer_from_config(config)
        exchanger = RoutingExchanger(
            NodeExchanger(signer, timeout_s=timeout_s),
            SshExchanger(signer=signer, timeout_s=timeout_s),
        )
        leader = LeaderLock(
            engine,
            default_holder(),
            config.head.leader_lease(config.control.interval_s, config.lease.duration_s),
        )
        try:
            coordinator = Coordinator(store, exchanger, settings, leader=leader, topology=topology)
            if not wait_for_leadership(leader, stop, notifier):
                logger.info("cdgpcd stopped as a standby")
                return 0
            watchdog = ProgressWatchdog(
                notifier, lambda: coordinator.interval, control_stall_s(config.control.interval_s)
            )
            threading.Thread(
                target=watchdog.run, args=(stop,), name="watchdog", daemon=True
            ).start()
            try:
                coordinator.start()
                _serve(config, coordinator, stop, notifier)
            except LeadershipLostError:
                logger.error("another head is active: stopping without pushing again")
                raise
            finally:
                _release(leader)
        finally:
            exchanger.close()
    finally:
        engine.dispose()
    logger.info("cdgpcd stopped; the agents fall to the safe cap when their lease lapses")
    return 0


def _topology(path: Path | None) -> Topology | None:
    """The power domains of ``head.topology`` (None: unset, the budget is the only limit)."""
    if path is None:
        return None
    topology = load_topology(path)
    logger.info("%d power domain(s) below the budget, from %s", len(topology.names), path)
    return topology


def wait_for_leadership(
    leader: LeaderLock, stop: threading.Event, notifier: Notifier | None = None
) -> bool:
    """Take the leader lock, waiting as a standby while another head holds it; False if
    ``stop`` was set first. Says once who holds it, and again whenever that changes. A standby
    that knows who holds the lock is ready: it is doing its job."""
    notifier = notifier or Notifier(None)
    period_s = max(leader.lease_s / STANDBY_TRIES_PER_LEASE, 0.05)
    said = ""
    while not stop.is_set():
        notifier.watchdog()
        known = False
        try:
            if leader.try_acquire():
                logger.info(
                    "leader lock taken as %s (epoch %d, lease %gs): this head is active",
                    leader.holder,
                    leader.epoch,
                    leader.lease_s,
                )
                return True
            state = leader.state()
            news = (
                f"standby: {state.holder or 'nobody'} holds the leader lock (epoch {state.epoch})"
            )
            known = True
        except StoreError as e:
            news = f"standby: cannot reach the leader lock: {e}"
        if news != said:
            logger.info("%s; trying every %gs", news, period_s)
            if known:
                notifier.ready(news)
            else:
                notifier.status(news)
            said = news
        stop.wait(period_s)
    return False


def _release(leader: LeaderLock) -> None:
    try:
        leader.release()
    except StoreError as e:
        logger.warning("leader lock not released (a standby waits for its lease): %s", e)


def _serve(
    config: Config, coordinator: Coordinator, stop: threading.Event, notifier: Notifier
) -> None:
    address = (config.head.listen_address, config.head.listen_port)
    try:
        server = HeadHttpServer(
            address,
            coordinator,
            verifier_from_config(config),
            make_policy(config),
            signer=signer_from_config(config),
        )
    except OSError as e:
        raise FatalError(f"cannot listen on {address[0]}:{address[1]}: {e.strerror or e}") from e
    settle_heap()
    thread = threading.Thread(target=server.serve_forever, name="http", daemon=True)
    thread.start()
    if not config.head.reconcile:
        logger.info("head.reconcile = false: no reconcile with Slurm")
    elif (source := _slurm_jobs()) is not None:
        # at least two control intervals: squeue may take seconds on a busy controller
        period_s = max(config.head.reconcile_interval_s, 2 * config.control.interval_s)
        threading.Thread(
            target=_reconcile_until,
            args=(coordinator, stop, period_s, source),
            name="reconcile",
            daemon=True,
        ).start()
    else:
        logger.info("neither pyslurm nor %s: no reconcile with Slurm", SQUEUE)
    epoch = coordinator.leader.epoch if coordinator.leader is not None else 0
    try:
        logger.info(
            "cdgpcd listening on %s:%d (%s auth), interval %gs, lease %gs, leader epoch %d%s",
            address[0],
            server.port,
            config.auth.method,
            config.control.interval_s,
            config.lease.duration_s,
            epoch,
            ", SHADOW MODE: nothing is applied" if config.control.shadow else "",
        )
        notifier.ready(f"active (leader epoch {epoch}), listening on {address[0]}:{server.port}")
        coordinator.run(stop)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5.0)


def _slurm_jobs() -> Callable[[], Sequence[SlurmJob]] | None:
    """Where the jobs come from: pyslurm when it imports, else ``squeue --json``."""
    pyslurm = load_pyslurm()
    if pyslurm is not None:
        logger.info("reconcile reads jobs through pyslurm")
        return lambda: pyslurm_read_jobs(pyslurm)
    if SQUEUE.exists():
        return read_jobs
    return None


def _reconcile_until(
    coordinator: Coordinator,
    stop: threading.Event,
    period_s: float,
    source: Callable[[], Sequence[SlurmJob]],
) -> None:
    """Every ``period_s``, finish jobs Slurm no longer runs and adopt running jobs that never
    registered (`slurm_cdgpc.coordinator.reconcile`), and tell the controller whether jobs wait
    for GPUs (the drain's input), off the control thread: squeue may take seconds on a busy
    controller. The grace period is one reconcile period."""
    while not stop.wait(period_s):
        try:
            jobs = source()
        except SqueueError as e:
            logger.warning("reconcile skipped: %s", e)
            coordinator.observe_queue(None)
            continue
        coordinator.observe_queue(any(job.waits_for_gpus for job in jobs))
        running = running_jobs(jobs)
        try:
            reconcile_with_slurm(coordinator, running, now_s=time.time(), grace_s=period_s)
        except CdgpcError as e:
            logger.warning("reconcile failed, next try in %gs: %s", period_s, e)


if __name__ == "__main__":
    raise SystemExit(main())
