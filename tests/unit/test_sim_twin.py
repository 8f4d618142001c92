"""The digital twin (`HeadTwin`): cdgpc through the real head, beside the simulator's cdgpc.

The head must learn what the simulator measured, one interval later and only once a job's
start-up is over; every clock the plant runs must be one the head sent; and the two engines must
decide alike, within tolerances whose causes are the head's design (named where they are
asserted). The replay is 60 consecutive jobs of a real trace (ElasticFlow cluster04).
"""

from __future__ import annotations

import copy
import gc
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from click.testing import CliRunner

from slurm_cdgpc.cli.main import cli
from slurm_cdgpc.config import ControlConfig
from slurm_cdgpc.control.empc import Decision, Measurements
from slurm_cdgpc.model.estimator import JobEstimator
from slurm_cdgpc.sim.cluster import ClusterView, Policy, Setpoints, SimulationResult, Simulator
from slurm_cdgpc.sim.fleet import FleetSpec, default_fleet, parse_fleet, rack_topology
from slurm_cdgpc.sim.metrics import Metrics, compute_metrics
from slurm_cdgpc.sim.policies import Cdgpc, make_policy
from slurm_cdgpc.sim.reporting import ProgressMix
from slurm_cdgpc.sim.traces import load_trace
from slurm_cdgpc.sim.twin import HeadTwin, job_name
from slurm_cdgpc.wire.protocol import GpuReport

DATA = Path(__file__).resolve().parent.parent / "data"
WINDOW = DATA / "traces" / "elasticflow_cluster04_window60.csv"
SYNTHETIC = DATA / "sim" / "synthetic40.csv"
SEED = 0
BUDGET_SHARE = 0.7
#: A100 graphics clocks come in 15 MHz levels
LEVEL_MHZ = 15.0
TOP_MHZ = 1410.0
#: the interval at which both engines' models are compared (mid-replay, about 50 jobs running)
SNAPSHOT = 200

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Seen:
    """One interval as a policy saw it, and what it answered (copies: the view is the
    simulator's)."""

    now_s: float
    rows: IntArray  # trace rows
    power_w: FloatArray
    graphics_mhz: FloatArray
    remaining: FloatArray
    clocks_mhz: FloatArray  # what the policy returned (NaN: top clock)
    shared: IntArray  # the shared GPU of each row (−1: whole GPUs)

    @classmethod
    def of(cls, view: ClusterView, setpoints: Setpoints) -> Seen:
        assert setpoints.graphics_mhz is not None
        return cls(
            view.now_s,
            view.job_id.copy(),
            view.power_w.copy(),
            view.graphics_mhz.copy(),
            view.remaining_iterations.copy(),
            np.array(setpoints.graphics_mhz, dtype=np.float64),
            np.full(len(view), -1) if view.shared_gpu is None else view.shared_gpu.copy(),
        )


class Recorded(Policy):
    """The simulator's cdgpc, every interval recorded, its estimator copied at `SNAPSHOT`."""

    def __init__(self) -> None:
        self.inner = make_policy("cdgpc")
        assert isinstance(self.inner, Cdgpc)
        self.name = self.inner.name
        self.seen: list[Seen] = []
        self.snapshot: tuple[list[int], JobEstimator] | None = None

    def start(self, fleet: FleetSpec, budget_w: float, interval_s: float) -> None:
        self.inner.start(fleet, budget_w, interval_s)

    def decide(self, view: ClusterView) -> Setpoints:
        setpoints = self.inner.decide(view)
        self.seen.append(Seen.of(view, setpoints))
        if len(self.seen) == SNAPSHOT:
            assert isinstance(self.inner, Cdgpc)
            self.snapshot = ([int(j) for j in view.job_id], _copy(self.inner.estimator))
        return setpoints


class ProbedTwin(HeadTwin):
    """The twin, with the head's controller inputs and outputs recorded every interval."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Seen] = []
        #: per interval: the head's job ids in row order, what it measured, what it decided
        self.steps: list[tuple[tuple[str, ...], Measurements, Decision]] = []
        self.snapshot: tuple[list[int], JobEstimator] | None = None

    def start(self, fleet: FleetSpec, budget_w: float, interval_s: float) -> None:
        super().start(fleet, budget_w, interval_s)
        head = self.coordinator
        assert head is not None
        step = head.controller.step

        def recorded(*args: Any, **kwargs: Any) -> Decision:
            decision = step(*args, **kwargs)
            ids = tuple(j.job_id for j in head.running.jobs)
            self.steps.append((ids, kwargs["measured"], decision))
            return decision

        head.controller.step = recorded  # type: ignore[method-assign]

    def decide(self, view: ClusterView) -> Setpoints:
        setpoints = super().decide(view)
        self.seen.append(Seen.of(view, setpoints))
        assert len(self.steps) == len(self.seen), "one controller step per interval"
        if len(self.seen) == SNAPSHOT:
            assert self.coordinator is not None
            ids = [int(j.job_id) - 1 for j in self.coordinator.running.jobs]
            self.snapshot = (ids, _copy(self.coordinator.running.estimator))
        return setpoints


def _copy(estimator: JobEstimator) -> JobEstimator:
    return copy.deepcopy(estimator)


@dataclass(frozen=True)
class Replays:
    fast: Recorded
    head: ProbedTwin
    fast_result: SimulationResult
    head_result: SimulationResult
    fast_metrics: Metrics
    head_metrics: Metrics


@pytest.fixture(scope="module")
def replays() -> Replays:
    trace = load_trace(WINDOW)
    fleet = default_fleet(trace)
    simulator = Simulator(trace, fleet, BUDGET_SHARE * fleet.max_power_w, seed=SEED)
    reference = simulator.run(make_policy("max-clock"))
    fast, head = Recorded(), ProbedTwin()
    fast_result = simulator.run(fast)
    with head:
        head_result = simulator.run(head)
    return Replays(
        fast,
        head,
        fast_result,
        head_result,
        compute_metrics(fast_result, reference),
        compute_metrics(head_result, reference),
    )


def _clock(seen: Seen, row: int) -> float:
    """The clock a trace row's job ran at in an interval (NaN: it did not run)."""
    rows = list(seen.rows)
    return float(seen.graphics_mhz[rows.index(row)]) if row in rows else math.nan


def _first_interval(seen: list[Seen]) -> dict[int, int]:
    """Per trace row, the interval at which it first ran."""
    first: dict[int, int] = {}
    for k, s in enumerate(seen):
        for row in s.rows.tolist():
            first.setdefault(row, k)
    return first


def test_the_head_learns_what_the_simulator_measured_one_interval_later(
    replays: Replays,
) -> None:
    """Interval k's controller sees the readings of exchange k − 1, i.e. the simulator's view at
    k − 1 (the agents read before they apply; the head solves before it exchanges). A job is
    learned from its third interval on: its first reading is from before its first setpoint,
    its second is its start-up (`startup_intervals`)."""
    head = replays.head
    first = _first_interval(head.seen)
    interval_s = replays.head_result.interval_s
    learned = unlearned = 0
    for k in range(2, len(head.steps)):
        ids, measured, _ = head.steps[k]
        before, older = head.seen[k - 1], head.seen[k - 2]
        row_of = {int(r): i for i, r in enumerate(before.rows)}
        older_of = {int(r): i for i, r in enumerate(older.rows)}
        for i, job in enumerate(ids):
            row = int(job) - 1
            if first[row] > k - 3:
                assert np.isnan(measured.power_w[i]), (k, job)  # start-up: not learned
                unlearned += 1
                continue
            j = row_of[row]
            # the energy counter's mean over the interval is the simulator's measured power
            assert measured.power_w[i] == pytest.approx(before.power_w[j], rel=1e-9), (k, job)
            assert measured.graphics_mhz[i] == round(before.graphics_mhz[j]), (k, job)
            # iteration time from root's progress reports: whole iterations over the interval
            done = older.remaining[older_of[row]] - before.remaining[j]
            assert abs(interval_s / measured.iteration_s[i] - done) < 1.0, (k, job)
            learned += 1
    assert learned > 0.9 * (learned + unlearned) and unlearned > 0


def test_every_clock_the_plant_runs_is_one_the_head_sent(replays: Replays) -> None:
    head = replays.head
    below_top = 0
    for k, seen in enumerate(head.seen):
        ids, _, decision = head.steps[k]
        decided = dict(zip(ids, decision.graphics_mhz.tolist(), strict=True))
        sent = [decided[job_name(int(r))] for r in seen.rows]  # every job is controlled
        np.testing.assert_array_equal(seen.clocks_mhz, np.array(sent, dtype=np.float64))
        below_top += int(np.sum(seen.clocks_mhz < TOP_MHZ))
        if k + 1 < len(head.seen):  # next interval: the plant ran at that lock, or below it
            after = head.seen[k + 1]
            row_of = {int(r): i for i, r in enumerate(after.rows)}
            for i, r in enumerate(seen.rows.tolist()):
                if r in row_of:
                    assert after.graphics_mhz[row_of[r]] <= seen.clocks_mhz[i] + 1e-6
    assert below_top > 0.5 * sum(len(s.rows) for s in head.seen)  # the cap binds


def test_both_engines_decide_alike_interval_by_interval(replays: Replays) -> None:
    """Same trace, same seed: the head's clocks beside the simulator's cdgpc, job by job.

    They are not all identical, by design:

    - the head's measurements are one interval older (it solves before it exchanges; the
      simulator's view is fresh), and so is the remaining work it knows;
    - it learns a job two intervals later (its first reading precedes its first setpoint, the
      second is its start-up) and counts it at its power limit meanwhile, which squeezes the
      others when several jobs start together;
    - a released GPU counts at its power limit until a reading taken after the release;
    - progress comes as whole iterations, the simulator's iteration time with noise.

    Each moves the plan a little, and the discrete plan amplifies it: the greedy fill hands
    the last watts to whichever job is the better buy, so a tiny difference in models or weights
    moves one job up a level and another down. Measured on this replay: 65 % of job-intervals
    identical, 81 % within one level (15 MHz), 94 % within three; the two engines' cluster
    power within 1.5 % of the budget of each other in 92 % of the intervals (median 0.02 %).
    """
    fast = {
        (s.now_s, int(r)): s.clocks_mhz[i] for s in replays.fast.seen for i, r in enumerate(s.rows)
    }
    head = {
        (s.now_s, int(r)): s.clocks_mhz[i] for s in replays.head.seen for i, r in enumerate(s.rows)
    }
    both = sorted(fast.keys() & head.keys())
    assert len(both) > 0.95 * len(fast)  # the replays stay aligned: same jobs, same intervals
    f = np.array([fast[k] for k in both])
    h = np.array([head[k] for k in both])
    assert not np.isnan(f).any() and not np.isnan(h).any()  # every job planned in both
    assert np.mean(f < TOP_MHZ) > 0.5 and np.mean(h < TOP_MHZ) > 0.5  # the cap binds
    gap_levels = np.abs(f - h) / LEVEL_MHZ
    assert np.mean(gap_levels == 0) > 0.55
    assert np.mean(gap_levels <= 1) > 0.75
    assert np.mean(gap_levels <= 3) > 0.88
    # the sum: the cluster's power interval by interval, against the budget
    n = min(replays.fast_result.power_w.size, replays.head_result.power_w.size)
    budget_w = replays.fast_result.budget_w
    gap_pct = 100 * np.abs(replays.fast_result.power_w[:n] - replays.head_result.power_w[:n])
    assert np.mean(gap_pct / budget_w <= 1.5) > 0.85
    assert np.median(gap_pct / budget_w) < 0.2


def test_both_engines_learn_the_same_models(replays: Replays) -> None:
    """Mid-replay, the head has learned each job from exactly two samples fewer (the interval
    its readings lag, and the start-up) plus the intervals the job started later in its replay;
    and where both engines ran a job at about the same clock (within two levels) in each of
    the last three intervals, its power model predicts the same power there in both (within
    2 %). Farther apart each model extrapolates from the clocks it saw, and they need not
    agree: one engine's last move, which its model has not yet learned from, does not make
    the two comparable."""
    assert replays.fast.snapshot is not None and replays.head.snapshot is not None
    fast_rows, fast_model = replays.fast.snapshot
    head_rows, head_model = replays.head.snapshot
    fast_first, head_first = _first_interval(replays.fast.seen), _first_interval(replays.head.seen)
    recent = range(SNAPSHOT - 3, SNAPSHOT)
    counted = compared = 0
    for row in sorted(set(fast_rows) & set(head_rows)):
        i, j = fast_rows.index(row), head_rows.index(row)
        if head_model.power.count[j] == 0:
            continue
        late = head_first[row] - fast_first[row]
        assert fast_model.power.count[i] - head_model.power.count[j] == 2 + late, row
        counted += 1
        clocks = [
            (_clock(replays.fast.seen[k], row), _clock(replays.head.seen[k], row)) for k in recent
        ]
        if any(not abs(f - h) <= 2 * LEVEL_MHZ for f, h in clocks):  # NaN: not running then
            continue
        for mhz in clocks[-1]:
            x = np.full(len(fast_rows), mhz / TOP_MHZ)
            p_fast = fast_model.predict_power_w(x, np.ones_like(x))[i]
            x = np.full(len(head_rows), mhz / TOP_MHZ)
            p_head = head_model.predict_power_w(x, np.ones_like(x))[j]
            assert p_head == pytest.approx(p_fast, rel=0.02), (row, mhz)
        compared += 1
    assert counted > 40 and compared > 30


def test_both_engines_hold_the_budget_alike(replays: Replays) -> None:
    f, h = replays.fast_metrics, replays.head_metrics
    assert f.binding_intervals > 0.3 * replays.fast_result.t_s.size  # the cap binds
    assert f.power_mae_pct is not None and h.power_mae_pct is not None
    # measured: MAE 0.93 % (fast) and 1.29 % (head): the head's older measurements and its
    # released GPUs counted at their limit leave it a little further below the budget
    assert h.power_mae_pct < 2.0 and abs(h.power_mae_pct - f.power_mae_pct) < 1.0
    assert f.over_budget_intervals_pct < 1.0 and h.over_budget_intervals_pct < 1.0
    assert f.max_overshoot_pct < 1.0 and h.max_overshoot_pct < 1.0
    assert h.energy_kwh == pytest.approx(f.energy_kwh, rel=0.01)
    assert abs(h.violations - f.violations) <= 2 and h.finished == f.finished == h.jobs


# -- the twin's own duties, on a small synthetic trace ----------------------------------------


def _small() -> Simulator:
    """Two jobs on four 4-GPU nodes: the second, of 8 GPUs, spans two nodes."""
    fleet = parse_fleet("4x4:A100-SXM4-80GB")
    return Simulator(load_trace(SYNTHETIC).head(2), fleet, 0.4 * fleet.max_power_w, seed=SEED)


def test_the_twin_removes_its_store_closed_or_dropped(tmp_path: Path) -> None:
    simulator = _small()
    with HeadTwin(directory=tmp_path) as twin:
        simulator.run(twin)
        assert twin.store_path is not None and twin.store_path.is_file()
        first = twin.store_path.parent
        twin.start(simulator.fleet, simulator.budget_w, simulator.interval_s)  # a second replay
        assert not first.exists() and twin.store_path.is_file()  # a fresh store, the first gone
    assert list(tmp_path.iterdir()) == []
    twin.close()  # idempotent
    dropped = HeadTwin(directory=tmp_path)
    dropped.start(simulator.fleet, simulator.budget_w, simulator.interval_s)
    assert len(list(tmp_path.iterdir())) == 1
    del dropped
    gc.collect()
    assert list(tmp_path.iterdir()) == []


class _Watched(HeadTwin):
    """Checks after every interval that a job holds one clock on all its GPUs and nodes."""

    def __init__(self, tamper: Callable[[GpuReport], GpuReport] | None = None) -> None:
        super().__init__()
        self.tamper = tamper  # rewrites every GPU report the agents send
        self.spanning = 0  # intervals a job was set on two nodes at once
        self.learned = 0  # the most samples a job's power model has had

    def start(self, fleet: FleetSpec, budget_w: float, interval_s: float) -> None:
        super().start(fleet, budget_w, interval_s)
        transport, tamper = self.transport, self.tamper
        if transport is not None and tamper is not None:
            read = transport._read
            transport._read = lambda *args: tamper(read(*args))  # type: ignore[method-assign]

    def decide(self, view: ClusterView) -> Setpoints:
        setpoints = super().decide(view)
        assert self.transport is not None and self.coordinator is not None
        held: dict[str, set[tuple[str, int | None]]] = {}
        for node, gpus in self.transport.gpus.items():
            for gpu in gpus:
                if gpu.job_id is not None and gpu.locked is not None:
                    held.setdefault(gpu.job_id, set()).add((node, gpu.locked.graphics_max_mhz))
        for job, locks in held.items():
            assert len({mhz for _, mhz in locks}) == 1, job
            self.spanning += len({node for node, _ in locks}) > 1
        assert setpoints.graphics_mhz is not None
        for row, job in enumerate(view.job_id.tolist()):
            locks = held.get(job_name(job), set())
            if locks:
                assert setpoints.graphics_mhz[row] == next(iter(locks))[1]
        count = self.coordinator.running.estimator.power.count
        self.learned = max(self.learned, int(count.max()) if count.size else 0)
        return setpoints


def test_a_job_on_two_nodes_gets_one_clock_and_its_model_learns() -> None:
    with _Watched() as twin:
        result = _small().run(twin)
    assert twin.spanning > 10
    assert twin.learned > 10
    assert np.isfinite(result.finish_s).all()


def test_the_head_learns_nothing_from_gpus_that_do_not_hold_its_setpoint() -> None:
    """A control for the tests above: agents that report no lock teach the head nothing (a twin
    whose exchange dropped the setpoints would show this, not the alignment asserted above)."""
    with _Watched(tamper=lambda r: replace(r, locked=None)) as twin:
        _small().run(twin)
    assert twin.learned == 0


class _Registered(HeadTwin):
    """Records the job state the head's controller gets, and the view's rows, each interval."""

    def __init__(self) -> None:
        super().__init__()
        self.states: list[tuple[ClusterView, Any, Measurements]] = []
        self._view: ClusterView | None = None

    def start(self, fleet: FleetSpec, budget_w: float, interval_s: float) -> None:
        super().start(fleet, budget_w, interval_s)
        head = self.coordinator
        assert head is not None
        step = head.controller.step

        def recorded(*args: Any, **kwargs: Any) -> Decision:
            assert self._view is not None
            self.states.append((self._view, args[1], kwargs["measured"]))
            return step(*args, **kwargs)

        head.controller.step = recorded  # type: ignore[method-assign]

    def decide(self, view: ClusterView) -> Setpoints:
        self._view = view
        return super().decide(view)


def test_the_head_gets_each_jobs_time_limit_and_start_and_step_reports_without_a_total() -> None:
    fleet = parse_fleet("4x4:A100-SXM4-80GB")
    simulator = Simulator(
        load_trace(SYNTHETIC).head(2),
        fleet,
        0.4 * fleet.max_power_w,
        seed=SEED,
        progress_mix=ProgressMix.parse("steps=1"),
    )
    with _Registered() as twin:
        simulator.run(twin)
    view, jobs, measured = twin.states[-1]
    assert twin.coordinator is None and len(view) == len(jobs.start_s) > 0
    np.testing.assert_array_equal(jobs.time_limit_s, view.time_limit_s)
    np.testing.assert_allclose(jobs.start_s, view.start_s + twin.offset_s)
    assert np.isnan(jobs.remaining_iterations).all()  # steps, never a total
    # the head times the steps it is told of, as the simulator measured them
    assert np.isfinite(view.iteration_s).all() and np.isfinite(measured.iteration_s).all()


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["simulate", *args])
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--policy", "max-clock"), "Error: --engine head runs cdgpc only, not --policy max-clock"),
        (("--policy", "all"), "Error: --engine head runs cdgpc only, not --policy all"),
        (("--sweep", "out"), "Error: --engine head replays one trace: not with --sweep"),
    ],
)
def test_the_head_engine_runs_cdgpc_only(args: tuple[str, ...], message: str) -> None:
    code, out = _cli("--trace", str(SYNTHETIC), "--engine", "head", *args)
    assert code != 0
    assert out.strip() == message


def test_the_head_engine_prints_the_metrics_and_its_speed() -> None:
    common = ("--trace", str(SYNTHETIC), "--limit-jobs", "2", "--fleet", "2x8:A100-SXM4-80GB")
    code, out = _cli(*common, "--engine", "head", "--json")
    assert code == 0, out
    head = json.loads(out)
    code, out = _cli(*common, "--json")
    assert code == 0, out
    fast = json.loads(out)
    assert set(head) == set(fast) | {"engine", "intervals_per_s"}
    assert head["engine"] == "head" and head["policy"] == "head"
    assert head["intervals_per_s"] > 0 and head["finished"] == head["jobs"] == 2


def test_the_head_engine_holds_each_racks_limit() -> None:
    """Two racks of two nodes, each limited to 0.6 of its nodes' maximum, under a budget that
    does not bind: the head replays them (its `Coordinator` with the fleet's topology) and
    both engines keep the racks at their limits, over them by more than 1 % only while jobs
    start (a new job counts at its power limit until measured): the fast engine 2 of 264
    intervals, at most +1.5 %; the head, which learns a new job an interval later ("Known
    gaps": bursts of job starts), 4 of 267, at most +3.7 %."""
    fleet = parse_fleet("4x4:A100-SXM4-80GB")
    fleet = fleet.with_topology(rack_topology(fleet, 2, 0.6))
    simulator = Simulator(load_trace(SYNTHETIC).head(6), fleet, fleet.max_power_w, seed=SEED)
    with HeadTwin() as twin:
        head = compute_metrics(simulator.run(twin))
        assert twin.coordinator is not None
        assert twin.coordinator.topology.names == ("rack001", "rack002")
    fast = compute_metrics(simulator.run(make_policy("cdgpc")))
    for metrics in (head, fast):
        assert metrics.domains == 2
        over, worst = metrics.domain_over_limit_intervals_pct, metrics.domain_max_overshoot_pct
        assert over is not None and worst is not None
        assert over < 2.0 and -10.0 < worst < 5.0, metrics  # the racks bind, and hold


# -- shared GPUs through the head --------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_replays() -> tuple[Recorded, ProbedTwin, Metrics, Metrics]:
    """40 jobs, three in four of them on part of a GPU (`test_sim_sharing._trace`), on eight
    A100s under 0.6 of their power: both engines."""
    from tests.unit.test_sim_sharing import crowded_trace  # noqa: PLC0415

    fleet = parse_fleet("2x4:A100-SXM4-80GB")
    simulator = Simulator(crowded_trace(), fleet, 0.6 * fleet.max_power_w, seed=SEED)
    fast, head = Recorded(), ProbedTwin()
    fast_metrics = compute_metrics(simulator.run(fast))
    with head:
        head_metrics = compute_metrics(simulator.run(head))
    return fast, head, fast_metrics, head_metrics


def test_the_head_learns_every_tenant_of_a_shared_gpu(
    shared_replays: tuple[Recorded, ProbedTwin, Metrics, Metrics],
) -> None:
    """A shared GPU holds one setpoint, named for one tenant; its readings teach every tenant
    (before, only the job the head listed last for the GPU could learn, and only when the
    setpoint named it: most tenants ran at their power limit's count for good)."""
    _, head, _, _ = shared_replays
    learned: dict[str, int] = {}
    for k, (ids, measured, _) in enumerate(head.steps):
        for i, job in enumerate(ids):
            if np.isfinite(measured.power_w[i]):
                learned.setdefault(job, k)
    first = {job_name(r): k for r, k in _first_interval(head.seen).items()}
    ran = {job for job, k in first.items() if k + 4 < len(head.steps)}
    late = {job: learned.get(job, len(head.steps)) - first[job] for job in ran}
    assert late and max(late.values()) <= 3, late  # the start-up, then learned


def test_the_head_gives_a_shared_gpu_one_clock(
    shared_replays: tuple[Recorded, ProbedTwin, Metrics, Metrics],
) -> None:
    fast, head, _, _ = shared_replays
    for recorded in (fast, head):
        shared = 0
        for seen in recorded.seen:
            by_gpu: dict[int, set[float]] = {}
            for i, gpu in enumerate(seen.shared.tolist()):
                if gpu >= 0:
                    by_gpu.setdefault(gpu, set()).add(float(seen.clocks_mhz[i]))
            assert all(len(clocks) == 1 for clocks in by_gpu.values())
            shared += sum(1 for gpu in by_gpu if int(np.sum(seen.shared == gpu)) > 1)
        assert shared > 50


def test_both_engines_hold_the_budget_alike_with_shared_gpus(
    shared_replays: tuple[Recorded, ProbedTwin, Metrics, Metrics],
) -> None:
    """Measured: fast MAE 2.00 %, 1.6 % of intervals over by more than 1 %, worst +3.0 %;
    head 4.23 %, 4.1 %, +8.8 %. The head learns a tenant two intervals later and counts it at
    its GPU's limit meanwhile, which on eight GPUs swings the plan from interval to interval:
    over seeds 0–5 the head's worst interval is +4.8 to +15.2 % (+4.4 to +16.6 % with jobs
    held by their power limit counted at their locks, `held_at_limit = false`; +6.2 to
    +39.1 % without re-anchoring tenants' time models). Before a cut took a shared GPU's other
    tenants with it (and kept their plans from teaching the offset), the head was over in 18 %
    of intervals."""
    _, _, f, h = shared_replays
    assert f.binding_intervals > 100 and h.binding_intervals > 100
    assert f.power_mae_pct is not None and h.power_mae_pct is not None
    assert h.power_mae_pct < 5.0 and abs(h.power_mae_pct - f.power_mae_pct) < 3.0
    assert f.over_budget_intervals_pct < 6.0 and h.over_budget_intervals_pct < 8.0
    assert f.max_overshoot_pct < 5.0 and h.max_overshoot_pct < 10.0
    assert h.energy_kwh == pytest.approx(f.energy_kwh, rel=0.05)


# -- GPUs in MIG mode through the head ---------------------------------------------------------


def test_the_head_holds_gpus_in_mig_mode_by_their_limits_as_the_fast_engine_does() -> None:
    """The same 40 jobs with every GPU in MIG mode (`slurm_cdgpc.sim.mig`): the twin's agents
    describe MIG boards, refuse a clock, and apply the limit the head sends. Measured: fast MAE
    2.15 %, never over by more than 1 %, worst +0.2 %; head 3.12 %, never, +0.59 % (seeds 1
    and 2: 3.11 %, 0.72 %, +1.42 %; 3.15 %, never, −0.45 %). With the GPUs at their top clock
    freed rather than held just above their plan, the head went +11 to +12 % over on seeds
    0–2: a model learned under limits says least about the top clock."""
    from tests.unit.test_sim_sharing import crowded_trace  # noqa: PLC0415

    fleet = parse_fleet("2x4:A100-SXM4-80GB")
    simulator = Simulator(crowded_trace(), fleet, 0.6 * fleet.max_power_w, seed=SEED, mig=True)
    fast = compute_metrics(simulator.run(make_policy("cdgpc")))
    with HeadTwin() as twin:
        head = compute_metrics(simulator.run(twin))
        assert twin.coordinator is not None and twin.transport is not None
        nodes = twin.coordinator.nodes
        levers = {v["lever"] for name in nodes for v in nodes.gpu_views(name)}
        gpus = [g for per_node in twin.transport.gpus.values() for g in per_node]
    assert levers == {"power limit"} and all(g.locked is None for g in gpus)
    assert fast.binding_intervals > 100 and head.binding_intervals > 100
    assert fast.power_mae_pct is not None and head.power_mae_pct is not None
    assert fast.power_mae_pct < 3.0 and head.power_mae_pct < 5.0
    assert fast.over_budget_intervals_pct < 1.0 and fast.max_overshoot_pct < 1.0
    assert head.over_budget_intervals_pct < 2.0 and head.max_overshoot_pct < 3.0
    assert head.energy_kwh == pytest.approx(fast.energy_kwh, rel=0.05)


def test_the_head_engine_scores_its_time_models_as_the_fast_engine_does(
    shared_replays: tuple[Recorded, ProbedTwin, Metrics, Metrics],
) -> None:
    """The head's models against the samples it learns from, one view late (it learns from
    the exchange before): every kind of interval is scored. Measured: alone 2.9 %, shared
    1.8 %, after a change 7.8 %, alone after the co-tenants left 25.1 %; without
    re-anchoring tenants' time models 22.6, 5.6, 21.2 and 95.0 %; keyed on the jobs that
    held the GPU when the head read it, leaving out those that left within the interval
    (re-anchored on a sample half with them), 9.8, 2.6, 12.0 and 48.2 %."""
    _, head, _, _ = shared_replays
    errors = head.time_errors.summary()
    assert errors is not None
    assert set(errors) == {"alone", "shared", "shared_after_change", "alone_after_leaving"}
    assert errors["shared"] < 4.0 and errors["alone"] < 6.0, errors
    assert errors["shared_after_change"] > errors["shared"], errors


class _Limits(HeadTwin):
    """The twin, keeping every interval's per-row power limits."""

    def __init__(self, control: ControlConfig) -> None:
        super().__init__(control=control)
        self.limits: list[dict[int, float]] = []

    def decide(self, view: ClusterView) -> Setpoints:
        sp = super().decide(view)
        limit = np.full(len(view), np.nan) if sp.limit_w is None else sp.limit_w
        self.limits.append({int(view.job_id[r]): float(w) for r, w in enumerate(limit)})
        return sp


@pytest.mark.parametrize("engine", ["head", "fast"])
def test_a_new_job_runs_held_at_its_share_until_measured(engine: str) -> None:
    """With ``new_job_power_share = 0.6`` each job starts held at 240 W per A100 (0.6 of its
    400 W), through the head's setpoints as through the fast engine's, and the limit is lifted
    once its model has readings (the head's start-up interval, then one)."""
    control = ControlConfig(new_job_power_share=0.6, new_job_power_quantile=1.0)
    simulator = _small()
    limits: list[dict[int, float]]
    if engine == "head":
        with _Limits(control) as twin:
            simulator.run(twin)
        limits = twin.limits
    else:
        policy = make_policy("cdgpc", control)
        limits = []
        decide = policy.decide

        def watched(view: ClusterView) -> Setpoints:
            sp = decide(view)
            limit = np.full(len(view), np.nan) if sp.limit_w is None else sp.limit_w
            limits.append({int(view.job_id[r]): float(w) for r, w in enumerate(limit)})
            return sp

        policy.decide = watched  # type: ignore[method-assign]
        simulator.run(policy)
    for job in (0, 1):
        # NaN or 400 W: the default (the fast engine sends every GPU's limit when any is held)
        seen = [step[job] for step in limits if job in step]
        held = [w for w in seen if w < 400.0]
        assert held and held == pytest.approx([240.0] * len(held)), seen
        assert len(held) <= (3 if engine == "head" else 1)
        assert all(not w < 400.0 for w in seen[len(held) :]), seen  # lifted, and for good
