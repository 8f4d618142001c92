"""A small live cluster for fault tests: cdgpcd, two cdgpc-noded with busy GPUs, and a power meter.

Each node has three simulated A100s; a training job (bert) runs on GPUs 0 and 1 of each node
(the agents' `slurm_cdgpc.gpu.workloads` launch directory) and GPU 2 idles, so power really
depends on the clocks the head chooses. Jobs 101 (node1) and 102 (node2) are registered on the
busy GPUs; every fault test registers short jobs on node1's GPU 2 during the fault, the way the
Prolog and Epilog do (the real spool takes what the head refuses), and checks each one reached
the store.

The meter (`PowerMeter`) is independent of the head and the agents' reports: every 50 ms it reads
each agent's state file (the locks that exist, written before and after every clock change) and
computes the power the GPUs draw at those locks with the calibrated plant, the same physics the
agents' simulated GPUs run. A head that is frozen, dead or cut off cannot hide power from it,
and an agent reporting garbage cannot either.

Optionally each agent runs in a network namespace of its own (``ip netns``), reached over a veth
pair, so that a test can cut a node off the network without touching the processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from slurm_cdgpc.errors import CdgpcError
from slurm_cdgpc.gpu.catalog import catalog_spec
from slurm_cdgpc.gpu.simulated import ManualClock, SimulatedGpu
from slurm_cdgpc.localcluster import (
    LOOPBACK,
    Daemon,
    LocalCluster,
    Node,
    NotReadyError,
)
from slurm_cdgpc.localcluster import wait_for as _wait
from slurm_cdgpc.slurm.spool import Spool
from slurm_cdgpc.store import Store, make_engine
from slurm_cdgpc.transport.http import HeadClient, HeadRefusedError
from tests.evidence import record

INTERVAL_S = 0.5
LEASE_S = 2.0
GUARD_BAND = 0.003  # control.guard_band's default
GPU_TYPE = "A100-SXM4-80GB"
GPUS_PER_NODE = 3
BUSY_GPUS = (0, 1)
CHURN_GPU = 2
WORKLOAD = "bert"
SAFE_MHZ = 840  # highest A100 level ≤ 0.6 · 1410 MHz
#: 4 busy GPUs draw ≈ 1470 W at top clocks, ≈ 1030 W (with the idle ones) at the safe cap
BUDGET_W = 1200.0
NODES = ("node1", "node2")
JOBS = {"node1": "101", "node2": "102"}
#: refusals the Prolog spools rather than drops (slurm_cdgpc.slurm.hooks): they may heal
RETRYABLE = frozenset({401, 403, 408, 429})
#: what a loaded 2-core machine may add to a deadline (process wake-up, an interval in flight)
SLACK_S = 1.5


def _in_ci() -> bool:
    return os.environ.get("CI") == "true"


def unavailable(reason: str) -> None:
    """Skip locally, fail under CI=true (where everything a fault test needs is installed)."""
    if _in_ci():
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


# -- network namespaces ------------------------------------------------------------------------


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)


@dataclass
class Netns:
    """One namespace ``name`` holding ``inner`` (address ``address``), linked to ``outer`` here."""

    name: str
    outer: str
    inner: str
    address: str

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def cut(self) -> None:
        """Partition: the link goes down on the head's side; packets to the node go nowhere."""
        self._check(_ip("link", "set", self.outer, "down"))

    def heal(self) -> None:
        self._check(_ip("link", "set", self.outer, "up"))

    def destroy(self) -> None:
        _ip("netns", "del", self.name)
        _ip("link", "del", self.outer)

    def _check(self, done: subprocess.CompletedProcess[str]) -> None:
        if done.returncode != 0:
            raise AssertionError(f"ip: {done.stderr.strip()}")


def make_netns(index: int) -> Netns:
    """A namespace with a veth pair on 10.213.<n>.0/30 (the node at .2, this side at .1)."""
    if os.geteuid() != 0:
        unavailable("network namespaces need root")
    tag = f"{os.getpid() % 100000}x{index}"
    subnet = 1 + (os.getpid() * 7 + index) % 250
    ns = Netns(f"cdgpc{tag}", f"cdo{tag}", f"cdi{tag}", f"10.213.{subnet}.2")
    steps = [
        ("netns", "add", ns.name),
        ("link", "add", ns.outer, "type", "veth", "peer", "name", ns.inner),
        ("link", "set", ns.inner, "netns", ns.name),
        ("addr", "add", f"10.213.{subnet}.1/30", "dev", ns.outer),
        ("link", "set", ns.outer, "up"),
        ("netns", "exec", ns.name, "ip", "addr", "add", f"{ns.address}/30", "dev", ns.inner),
        ("netns", "exec", ns.name, "ip", "link", "set", ns.inner, "up"),
        ("netns", "exec", ns.name, "ip", "link", "set", "lo", "up"),
    ]
    for step in steps:
        done = _ip(*step)
        if done.returncode != 0:
            ns.destroy()
            unavailable(
                f"cannot build a network namespace (ip {' '.join(step)}): "
                f"{done.stderr.strip()} (needs iproute2 and CAP_NET_ADMIN)"
            )
    return ns


# -- the true power --------------------------------------------------------------------------


class _Plant:
    """Power of one A100 running the test's workload (or idling) under a clock cap, no noise."""

    def __init__(self) -> None:
        self._clock = ManualClock()
        self._gpu = SimulatedGpu(catalog_spec(GPU_TYPE), time_source=self._clock)
        self._gpu.attach(WORKLOAD)
        self._busy: dict[int | None, float] = {}
        self.idle_w = self._gpu.spec.idle_power_w

    def busy_w(self, cap_mhz: int | None) -> float:
        if cap_mhz not in self._busy:
            if cap_mhz is None:
                self._gpu.reset_locked_clocks()
            else:
                self._gpu.set_locked_clocks(cap_mhz)
            # the steady draw: past the moment after a change, when the firmware's 1 s average
            # lets the power run above the limit
            self._clock.advance(5.0)
            self._busy[cap_mhz] = self._gpu.true_power_w
        return self._busy[cap_mhz]


@dataclass
class PowerMeter:
    """Samples the cluster's true power every ``period_s`` on a thread (see the module doc)."""

    locks: Callable[[str], dict[int, int]]
    budget_w: float = BUDGET_W
    period_s: float = 0.05
    samples: list[tuple[float, float, float]] = field(default_factory=list)  # t, power, budget
    _plant: _Plant = field(default_factory=_Plant)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def power_w(self) -> float:
        total = 0.0
        for node in NODES:
            locks = self.locks(node)
            for gpu in range(GPUS_PER_NODE):
                if gpu in BUSY_GPUS:
                    total += self._plant.busy_w(locks.get(gpu))
                else:
                    total += self._plant.idle_w
        return total

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="power-meter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.samples.append((time.monotonic(), self.power_w(), self.budget_w))
            except (OSError, ValueError, KeyError):
                continue  # a state file replaced under our feet: the next sample sees it

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def over(self) -> tuple[float, float]:
        """(worst overshoot in % of the budget, longest stretch in s above budget + guard)."""
        worst_pct = 0.0
        longest_s = 0.0
        above_since: float | None = None
        for t, power_w, budget_w in self.samples:
            worst_pct = max(worst_pct, 100.0 * (power_w - budget_w) / budget_w)
            if power_w > budget_w * (1 + GUARD_BAND):
                above_since = t if above_since is None else above_since
                longest_s = max(longest_s, t - above_since)
            else:
                above_since = None
        return round(worst_pct, 3), round(longest_s, 3)


# -- the cluster -------------------------------------------------------------------------------


def _clock_shifted(offset_file: Path | None) -> tuple[str, ...]:
    """The launcher that runs a daemon on a wall clock shifted by ``offset_file`` (none: real)."""
    return () if offset_file is None else ("tests.faults.clockshift", str(offset_file))


@dataclass
class Cluster:
    """The local cluster (`slurm_cdgpc.localcluster`) with what the fault tests do to it."""

    local: LocalCluster
    db_url: str
    netns: dict[str, Netns] = field(default_factory=dict)
    head: Daemon | None = None

    @property
    def tmp_path(self) -> Path:
        return self.local.run_dir

    @property
    def nodes(self) -> dict[str, Node]:
        return self.local.nodes

    # -- processes --------------------------------------------------------------------------

    def start_head(self, *, clock_offset_file: Path | None = None) -> Daemon:
        self.head = self.local.start_head(launcher=_clock_shifted(clock_offset_file))
        return self.head

    def start_agent(self, node: str, *, clock_offset_file: Path | None = None) -> Daemon:
        n = self.nodes[node]
        env = {
            "CDGPC_SIMULATED_JOBS": str(n.jobs_dir),
            "CDGPC_SIMULATED_FAULTS": str(n.directory / "faults"),
        }
        ns = self.netns.get(node)
        return self.local.start_agent(
            node,
            env=env,
            prefix=ns.prefix if ns else (),
            launcher=_clock_shifted(clock_offset_file),
        )

    def client(self, *, signed: bool = True, timeout_s: float = 10.0) -> HeadClient:
        return self.local.client(signed=signed, timeout_s=timeout_s)

    def logs(self) -> str:
        return self.local.logs(4000)

    # -- what the nodes hold -----------------------------------------------------------------

    def locks(self, node: str) -> dict[int, int]:
        """GPU index → the highest graphics cap the state file lists for it (none: no file)."""
        return self.local.locks(node)

    def set_faults(self, node: str, text: str) -> None:
        path = self.nodes[node].directory / "faults"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    def status(self) -> dict[str, Any]:
        return self.client().get("/v1/status")  # type: ignore[no-any-return]

    def job(self, job_id: str) -> dict[str, Any] | None:
        return self.local.job(job_id)

    # -- the scenario every fault test shares -------------------------------------------------

    def establish(self, budget_w: float = BUDGET_W) -> PowerMeter:
        """Announce the nodes, set the budget, register jobs 101 and 102, wait until both are
        controlled and the true power is within the budget; start the meter."""
        client = self.client()
        self.local.announce()
        client.post("/v1/budget", {"budget_w": budget_w, "reason": "fault test"})
        for node, job_id in JOBS.items():
            client.post(
                "/v1/jobs", {"job_id": job_id, "user": "root", "node": node, "gpus": [*BUSY_GPUS]}
            )
        meter = PowerMeter(self.locks, budget_w)
        _wait(
            "jobs 101 and 102 running and controlled",
            lambda: all(
                (j := self.job(job_id)) and j["state"] == "running" and j["controlled"]
                for job_id in JOBS.values()
            ),
            20,
            self.logs,
        )
        # learned: the head has raised both jobs above the safe cap (so that a fall to the
        # safe cap is visible, and a test cannot pass on clocks that were low all along)
        _wait(
            "both jobs above the safe cap",
            lambda: all(
                min(self.locks(n).get(g, 0) for g in BUSY_GPUS) > SAFE_MHZ for n in self.nodes
            ),
            30,
            self.logs,
        )
        _wait(
            "power within the budget",
            lambda: meter.power_w() <= budget_w * (1 + GUARD_BAND),
            20,
            self.logs,
        )
        meter.start()
        return meter

    def controlled(self, node: str) -> bool:
        """The head holds the node's job at a clock of its own choice (not the safe cap)."""
        job = self.job(JOBS[node])
        return bool(job and job["controlled"]) and all(
            self.locks(node).get(g, 0) > 0 for g in BUSY_GPUS
        )

    def finish(
        self,
        name: str,
        meter: PowerMeter,
        registrar: Registrar,
        *,
        lease_s: float = LEASE_S,
        overshoot_allowed_s: float | None = None,
    ) -> dict[str, float]:
        """End the jobs, check every invariant, record the evidence, return the figures."""
        meter.stop()
        registrar.flush()
        client = self.client()
        for job_id in JOBS.values():
            client.delete(f"/v1/jobs/{job_id}")
        deadline = time.monotonic() + 4 * INTERVAL_S + LEASE_S + SLACK_S
        while time.monotonic() < deadline and any(self.locks(n) for n in self.nodes):
            time.sleep(0.05)
        left = sum(len(self.locks(n)) for n in self.nodes)
        worst_pct, longest_s = meter.over()
        stored = registrar.stored()
        figures = {
            "worst_overshoot_pct": worst_pct,
            "overshoot_s": longest_s,
            "lease_s": lease_s,
            "registrations_sent": registrar.sent,
            "registrations_stored": stored,
            "gpus_left_locked": left,
        }
        allowed_s = lease_s if overshoot_allowed_s is None else overshoot_allowed_s
        survived = (
            longest_s <= allowed_s + SLACK_S
            and stored == registrar.sent
            and left == 0
            and all(n.daemon is None or n.daemon.proc.poll() is None for n in self.nodes.values())
        )
        record("fault", name, injected=1, survived=int(survived), **figures)
        assert len(meter.samples) > 10, "the power meter took too few samples"
        assert longest_s <= allowed_s + SLACK_S, (figures, self.logs())
        assert stored == registrar.sent, (figures, registrar.missing(), self.logs())
        assert left == 0, ({n: self.locks(n) for n in self.nodes}, self.logs())
        return figures

    @contextlib.contextmanager
    def failure_recorded(
        self,
        name: str,
        meter: PowerMeter,
        registrar: Registrar,
        ended: Mapping[str, Collection[int]] | None = None,
        heal: Callable[[], None] | None = None,
    ) -> Iterator[None]:
        """Record ``name`` as not survived if the block fails (then re-raise): the evidence must
        not keep an older, better record of a fault the code no longer survives. ``ended``: the
        GPUs (per node) whose job has ended, counted in ``gpus_left_locked`` if still locked.
        ``heal``: undoes the fault first, so that spooled registrations can be forwarded and
        counted."""
        try:
            yield
        except (AssertionError, pytest.fail.Exception, NotReadyError):
            meter.stop()
            if heal is not None:
                heal()
            with contextlib.suppress(AssertionError, CdgpcError):
                registrar.flush(timeout_s=10.0)
            worst_pct, longest_s = meter.over()
            left = sum(
                len(set(self.locks(node)) & set(gpus)) for node, gpus in (ended or {}).items()
            )
            record(
                "fault",
                name,
                injected=1,
                survived=0,
                worst_overshoot_pct=worst_pct,
                overshoot_s=longest_s,
                lease_s=LEASE_S,
                registrations_sent=registrar.sent,
                registrations_stored=registrar.stored(),
                gpus_left_locked=left,
            )
            raise


@dataclass
class Registrar:
    """Registers and ends short jobs on node1's GPU 2 as the Prolog and Epilog do: a request the
    head does not take (unreachable, 5xx) goes to the spool and is forwarded later."""

    cluster: Cluster
    spool: Spool
    first_id: int = 1000
    sent: int = 0
    job_ids: list[str] = field(default_factory=list)

    def register(self, count: int = 1) -> None:
        client = self.cluster.client(timeout_s=3.0)
        for _ in range(count):
            job_id = str(self.first_id + self.sent)
            self.sent += 1
            self.job_ids.append(job_id)
            payload: dict[str, object] = {
                "job_id": job_id,
                "user": "root",
                "node": "node1",
                "gpus": [CHURN_GPU],
            }
            path = f"/v1/jobs/{job_id}"
            self._send("register", job_id, partial(client.post, "/v1/jobs", payload), payload)
            self._send("deregister", job_id, partial(client.delete, path), None)

    def _send(
        self, op: str, job_id: str, call: Callable[[], object], payload: dict[str, object] | None
    ) -> None:
        if self.spool.pending():  # keep the order: behind what is already spooled
            self.spool.spool(op, job_id, payload)
            return
        try:
            call()
        except HeadRefusedError as e:
            if e.status not in RETRYABLE and e.status < 500:
                raise
            self.spool.spool(op, job_id, payload)
        except CdgpcError:
            self.spool.spool(op, job_id, payload)

    def flush(self, timeout_s: float = 20.0) -> None:
        """Forward the spool until it is empty (the head is back)."""
        deadline = time.monotonic() + timeout_s
        while self.spool.pending():
            self.spool.forward(self.cluster.client(timeout_s=3.0))
            if time.monotonic() > deadline:
                raise AssertionError(f"spool not forwarded: {self.spool.pending()}")
            time.sleep(0.1)

    def stored(self) -> int:
        engine = make_engine(self.cluster.db_url)
        try:
            store = Store(engine)
            return sum(1 for job_id in self.job_ids if store.job(job_id) is not None)
        finally:
            engine.dispose()

    def missing(self) -> list[str]:
        engine = make_engine(self.cluster.db_url)
        try:
            store = Store(engine)
            return [j for j in self.job_ids if store.job(j) is None]
        finally:
            engine.dispose()


def make_cluster(tmp_path: Path, db_url: str, *, netns: bool = False) -> Iterator[Cluster]:
    """The head's config and two agents (started, busy GPUs); the head is not started yet."""
    local = LocalCluster.with_hmac(
        tmp_path,
        interval_s=INTERVAL_S,
        lease_s=LEASE_S,
        unavailable=unavailable,
        start_timeout_s=30,
    )
    local.add_head(store_url=db_url)
    cluster = Cluster(local, db_url)
    try:
        for i, name in enumerate(NODES):
            ns = make_netns(i) if netns else None
            if ns is not None:
                cluster.netns[name] = ns
            node = local.add_node(
                name,
                gpu_type=GPU_TYPE,
                gpus=GPUS_PER_NODE,
                address=ns.address if ns else LOOPBACK,
            )
            launch = {
                "job_id": JOBS[name],
                "gpus": list(BUSY_GPUS),
                "workload": WORKLOAD,
                "iterations": 10**9,
            }
            (node.jobs_dir / f"{JOBS[name]}.json").write_text(json.dumps(launch))
            cluster.start_agent(name)
        yield cluster
    finally:
        local.stop(timeout_s=10)  # a frozen process gets SIGCONT with its SIGTERM
        for ns in cluster.netns.values():
            ns.destroy()


def registrar(cluster: Cluster) -> Registrar:
    return Registrar(cluster, Spool(cluster.tmp_path / "spool"))
