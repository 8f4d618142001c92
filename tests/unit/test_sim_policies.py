"""Policies: budget holding on a small synthetic trace, isolation from the plant, hand checks."""

from __future__ import annotations

import gc
from pathlib import Path
from types import FunctionType, ModuleType

import numpy as np
import pytest

from slurm_cdgpc.config import ControlConfig
from slurm_cdgpc.control.empc import Decision, JobState
from slurm_cdgpc.gpu.plant import Plant, WorkloadArrays
from slurm_cdgpc.sim.cluster import ClusterView, PlantPolicy, Policy, Setpoints, Simulator
from slurm_cdgpc.sim.fleet import parse_fleet
from slurm_cdgpc.sim.metrics import PolicyRun, run_policies
from slurm_cdgpc.sim.policies import (
    POLICIES,
    READS_PLANT,
    Cdgpc,
    StaticGpuFreq,
    make_policy,
    uniform_limit_w,
)
from slurm_cdgpc.sim.traces import load_trace

DATA = Path(__file__).resolve().parent.parent / "data" / "sim"
#: capping policies that must hold the budget; cdgpc-paper is the published method, whose linear
#: power model misprices marginal power around the A100 knee and overshoots (a finding, reported
#: by the metrics, not a property to test)
HOLDERS = ("cdgpc", "uniform-power-cap", "uniform-clock", "ear-greedy", "static-gpu-freq", "oracle")


@pytest.fixture(scope="module")
def runs() -> dict[str, PolicyRun]:
    trace = load_trace(DATA / "synthetic40.csv")
    fleet = parse_fleet("4x8:A100-SXM4-80GB")
    return run_policies(Simulator(trace, fleet, 0.6 * fleet.max_power_w, seed=3), POLICIES)


@pytest.mark.parametrize("name", HOLDERS)
def test_capping_policies_hold_the_budget(runs: dict[str, PolicyRun], name: str) -> None:
    m = runs[name].metrics
    assert m.binding_intervals > 50  # the cap binds for a good part of the run
    assert m.over_budget_intervals_pct < 1.0
    # every job leaves, done or ended by Slurm at its time limit (at least 1.5 × its run time
    # at top clocks): static-gpu-freq's one-off clock, under the power-limit backstop, can
    # stretch a job that far (1 of 40 here); the others never do
    assert m.finished + m.killed_at_time_limit == m.jobs
    assert m.killed_at_time_limit <= (1 if name == "static-gpu-freq" else 0)


def test_max_clock_breaks_the_budget_that_the_others_hold(runs: dict[str, PolicyRun]) -> None:
    assert runs["max-clock"].metrics.over_budget_intervals_pct > 20.0
    assert runs["max-clock"].metrics.violations_induced == 0


def test_cdgpc_tracks_the_budget_closer_than_power_limit_splits(
    runs: dict[str, PolicyRun],
) -> None:
    mae = {k: r.metrics.power_mae_pct for k, r in runs.items()}
    # 32 GPUs, few jobs: one job's model error is a large share of the sum. Measured: 1.94 %
    # without the drain, 2.04 % with it (it moves whole nodes' jobs to top clocks at once)
    assert mae["cdgpc"] is not None and mae["cdgpc"] < 2.5
    assert all(mae["cdgpc"] < mae[k] for k in ("uniform-power-cap", "ear-greedy"))  # type: ignore[operator]


def test_only_max_clock_and_oracle_may_read_the_plant() -> None:
    assert set(READS_PLANT) == {"max-clock", "oracle"}
    for name in POLICIES:
        reads = isinstance(make_policy(name), PlantPolicy)
        assert reads == (name == "oracle"), name


def _reachable(root: object, limit: int = 200_000) -> list[object]:
    """Objects reachable from ``root`` by references, not crossing classes, modules, functions."""
    seen: dict[int, object] = {}
    stack = [root]
    while stack and len(seen) < limit:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type | ModuleType | FunctionType):
            continue
        seen[id(obj)] = obj
        stack.extend(gc.get_referents(obj))
    return list(seen.values())


class Spy(Policy):
    """Wraps a policy and keeps the last view it was handed."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.name = inner.name
        self.view: ClusterView | None = None

    def start(self, fleet: object, budget_w: float, interval_s: float) -> None:  # type: ignore[override]
        self.inner.start(fleet, budget_w, interval_s)  # type: ignore[arg-type]

    def decide(self, view: ClusterView) -> Setpoints:
        self.view = view
        return self.inner.decide(view)


@pytest.mark.parametrize("name", [p for p in POLICIES if p not in READS_PLANT])
def test_no_path_from_a_policy_or_its_view_to_the_plant(name: str) -> None:
    trace = load_trace(DATA / "synthetic40.csv").head(8)
    fleet = parse_fleet("2x8:A100-SXM4-80GB")
    spy = Spy(make_policy(name))
    Simulator(trace, fleet, 0.6 * fleet.max_power_w).run(spy)
    assert spy.view is not None
    found = [o for o in _reachable(spy) if isinstance(o, Plant | WorkloadArrays)]
    assert found == []


def test_the_reachability_check_would_find_a_plant() -> None:
    # the check above is only worth something if it sees a plant handed to a policy
    class Leaky(Policy):
        def decide(self, view: ClusterView) -> Setpoints:
            return Setpoints()

    leaky = Leaky()
    leaky.stash = [{"p": Plant.of(parse_fleet("1x8:A100").specs[0], WorkloadArrays.of([]))}]  # type: ignore[attr-defined]
    assert any(isinstance(o, Plant) for o in _reachable(leaky))


def _view(**changes: object) -> ClusterView:
    fleet = parse_fleet("2x8:A100-SXM4-80GB")
    n = 2
    base = dict(
        now_s=0.0,
        interval_s=60.0,
        budget_w=2000.0,
        specs=fleet.specs,
        kept=np.zeros(0, dtype=bool),
        started=n,
        job_id=np.arange(n),
        job_gpus=np.array([4, 2]),
        job_type=np.zeros(n, dtype=np.int64),
        job_nodes=np.array([[4, 0], [0, 2]]),
        submit_s=np.zeros(n),
        start_s=np.zeros(n),
        deadline_s=np.array([1000.0, np.nan]),
        time_limit_s=np.full(n, 3600.0),
        iterations=np.array([100.0, 100.0]),
        remaining_iterations=np.array([100.0, 100.0]),
        iterations_done=np.zeros(n),
        graphics_mhz=np.full(n, np.nan),
        memory_mhz=np.full(n, np.nan),
        power_w=np.full(n, np.nan),
        iteration_s=np.full(n, np.nan),
        power_capped=np.zeros(n, dtype=bool),
        node_type=fleet.node_type,
        node_gpus=fleet.node_gpus,
        node_power_w=np.full(2, np.nan),
        idle_power_w=10 * 60.0,
        queued_jobs=0,
        queued_gpus=0,
    )
    base.update(changes)
    return ClusterView(**base)  # type: ignore[arg-type]


def test_uniform_power_cap_splits_what_idle_gpus_leave() -> None:
    # (2000 W − 10 idle GPUs × 60 W) / 6 busy GPUs = 233.3 W each, inside A100's 100–400 W
    np.testing.assert_allclose(uniform_limit_w(_view()), [1400.0 / 6] * 2)
    # a budget below the floor is clipped to the lowest limit the GPU accepts
    np.testing.assert_allclose(uniform_limit_w(_view(budget_w=900.0)), [100.0, 100.0])


def test_static_gpu_freq_picks_the_lowest_clock_that_meets_the_deadline() -> None:
    fleet = parse_fleet("2x8:A100-SXM4-80GB")
    policy = StaticGpuFreq()
    policy.start(fleet, 2000.0, 60.0)
    policy.decide(_view())  # first interval: measures at top clock
    # measured 2 s per iteration at 1410 MHz; 100 iterations in 1000 − 500 = 500 s of slack
    # need T ≤ 5 s ⇒ f ≥ 1410 · 2 / 5 = 564 MHz, but never below 0.5 × 1410 = 705 (a level)
    measured = _view(
        now_s=500.0,
        kept=np.ones(2, dtype=bool),
        started=0,
        graphics_mhz=np.full(2, 1410.0),
        iteration_s=np.array([2.0, 2.0]),
    )
    sp = policy.decide(measured)
    assert sp.graphics_mhz is not None
    assert sp.graphics_mhz[0] == 705.0
    assert np.isnan(sp.graphics_mhz[1]) or sp.graphics_mhz[1] == 1410.0  # no deadline: top
    # tighter: 100 iterations in 250 s ⇒ f ≥ 1410 · 2 / 2.5 = 1128 → 1140 (15 MHz levels)
    policy.start(fleet, 2000.0, 60.0)
    policy.decide(_view())
    sp = policy.decide(
        _view(
            now_s=750.0,
            kept=np.ones(2, dtype=bool),
            started=0,
            graphics_mhz=np.full(2, 1410.0),
            iteration_s=np.array([2.0, 2.0]),
        )
    )
    assert sp.graphics_mhz is not None and sp.graphics_mhz[0] == 1140.0


def test_cdgpc_passes_the_time_limit_and_start_into_the_controllers_job_state() -> None:
    fleet = parse_fleet("2x8:A100-SXM4-80GB")
    policy = Cdgpc()
    policy.start(fleet, 2000.0, 60.0)
    seen: list[JobState] = []
    step = policy.controller.step

    def spy(estimator: object, jobs: JobState, *args: object, **kwargs: object) -> object:
        seen.append(jobs)
        return step(estimator, jobs, *args, **kwargs)  # type: ignore[arg-type]

    policy.controller.step = spy  # type: ignore[method-assign,assignment]
    hour = 3600.0
    # neither job says its total; both have a deadline 5 h away; only the first has a limit
    policy.decide(
        _view(
            now_s=hour,
            start_s=np.zeros(2),
            deadline_s=np.full(2, 6 * hour),
            time_limit_s=np.array([4 * hour, np.nan]),
            iterations=np.full(2, np.nan),
            remaining_iterations=np.full(2, np.nan),
        )
    )
    [jobs] = seen
    np.testing.assert_array_equal(jobs.start_s, [0.0, 0.0])
    np.testing.assert_array_equal(jobs.time_limit_s, [4 * hour, np.nan])
    est = policy.estimator
    t_top = est.predict_iteration_s(np.ones(2), np.ones(2))
    pressure = policy.controller.weights(est, jobs, now_s=hour)[0] * t_top
    # at most start + 4 h − now = 3 h of work left over 5 h of slack; no limit: pressure 1
    np.testing.assert_allclose(pressure, [3 / 5, 1.0])


def test_cdgpc_sends_the_guard_rails_limits_as_the_head_does() -> None:
    fleet = parse_fleet("2x8:A100-SXM4-80GB")
    off, on = Cdgpc(), make_policy("cdgpc", ControlConfig(power_limit_margin=0.05))
    assert isinstance(on, Cdgpc)
    for policy in (off, on):
        policy.start(fleet, 2000.0, 60.0)
    assert off.decide(_view()).limit_w is None  # shipped: no rail
    decisions: list[Decision] = []
    step = on.controller.step

    def spy(*args: object, **kwargs: object) -> Decision:
        decisions.append(step(*args, **kwargs))  # type: ignore[arg-type]
        return decisions[-1]

    on.controller.step = spy  # type: ignore[method-assign,assignment]
    view = _view()
    sp = on.decide(view)
    [d] = decisions
    spec = fleet.specs[0]
    per_gpu = d.job_power_w / view.job_gpus * 1.05  # planned power per GPU, plus the margin
    expected = np.clip(per_gpu, spec.power_limit.min_w, spec.power_limit.default_w)
    assert sp.limit_w is not None
    np.testing.assert_allclose(sp.limit_w, expected)
