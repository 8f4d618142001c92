"""Jobs that share GPUs in the simulator: packing, one clock and one power per GPU, the head's
controller driving them as tenants."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from slurm_cdgpc.cli.simulate import simulate
from slurm_cdgpc.config import ControlConfig
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.gpu.catalog import catalog_spec
from slurm_cdgpc.gpu.plant import Plant, draw_workloads
from slurm_cdgpc.sim.cluster import ClusterView, Setpoints, Simulator
from slurm_cdgpc.sim.fleet import default_fleet, parse_fleet
from slurm_cdgpc.sim.metrics import compute_metrics, run_policies
from slurm_cdgpc.sim.policies import Cdgpc, Oracle, make_policy
from slurm_cdgpc.sim.sharing import SharedGpus, TenantTimeErrors, shared_step
from slurm_cdgpc.sim.traces import Trace, alibaba2023
from tests.unit.test_sim_cluster import Recorder
from tests.unit.test_sim_cluster import _trace as one_gpu_jobs

A100 = catalog_spec("A100-SXM4-80GB")


def _trace(submit: list[float], duration: list[float], milli: list[int]) -> Trace:
    """One-GPU jobs asking for ``milli`` thousandths of their GPU each."""
    whole = one_gpu_jobs(submit, duration, [1] * len(submit))
    return replace(whole, gpu_milli=np.array(milli))


def test_shared_gpus_take_the_oldest_with_room_and_free_with_their_last_tenant() -> None:
    gpus = SharedGpus()
    anywhere = np.ones(2, dtype=bool)
    a = gpus.open(node=1)
    gpus.join(a, 600)
    assert gpus.find(500, anywhere) is None  # 400 left
    b = gpus.open(node=0)
    gpus.join(b, 500)
    assert gpus.find(400, anywhere) == a  # the oldest with room
    assert gpus.find(400, np.array([True, False])) == b  # a is on a node the job may not use
    gpus.join(a, 400)
    assert gpus.leave(a, 600) is None  # a tenant is left
    assert gpus.leave(a, 400) == 1  # the last: node 1 has its GPU back
    assert len(gpus) == 1


def _plant(n: int) -> Plant:
    workloads = draw_workloads(n, A100, np.random.default_rng(0), model_names=["bert"] * n)
    return Plant.of(A100, workloads)


def test_a_tenant_alone_runs_as_on_a_whole_gpu() -> None:
    plant = _plant(1)
    step = shared_step(
        plant, np.zeros(1, dtype=np.int64), np.ones(1), np.full(1, 1200.0), None, None
    )
    whole = plant.step(1200.0)
    np.testing.assert_allclose(step.state.power_w, whole.power_w)
    np.testing.assert_allclose(step.state.iteration_time_s, whole.iteration_time_s)


def test_tenants_draw_their_work_rates_and_a_limit_lowers_their_one_clock() -> None:
    plant = _plant(2)
    gpu, factor = np.zeros(2, dtype=np.int64), np.array([0.7, 0.6])
    lock = np.array([900.0, 1100.0])  # the GPU runs at the higher lock
    step = shared_step(plant, gpu, factor, lock, None, None)
    alone = plant.step(1100.0)
    idle = A100.idle_power_w
    expected_w = idle + np.sum(factor * (alone.power_w - idle))
    np.testing.assert_allclose(step.state.applied_mhz, [1100.0, 1100.0])
    np.testing.assert_allclose(step.state.power_w, [expected_w, expected_w])
    np.testing.assert_allclose(step.state.iteration_time_s, alone.iteration_time_s / factor)
    assert expected_w > alone.power_w.max()  # two at work draw more than either alone
    # a limit below that: the one clock drops until the GPU fits it
    limit_w = np.full(2, 0.8 * expected_w)
    capped = shared_step(plant, gpu, factor, lock, None, limit_w)
    assert capped.state.power_capped.all()
    assert capped.state.applied_mhz[0] == capped.state.applied_mhz[1] < 1100.0
    assert capped.state.power_w[0] <= 0.97 * limit_w[0] + 1e-6
    assert capped.state.power_w[0] > 0.97 * limit_w[0] - 2.0  # the highest clock that fits


def test_fractional_jobs_pack_onto_one_gpu_which_is_freed_by_its_last_tenant() -> None:
    """j0 and j1 (500 + 400 thousandths) share a GPU; j2 (600) needs another. j3 wants every
    GPU of the node: it starts only when the shared GPUs' last tenants have left."""
    trace = _trace([0, 0, 0, 0], [600, 1200, 300, 60], [500, 400, 600, 1000])
    trace = replace(trace, num_gpu=np.array([1, 1, 1, 2]))
    fleet = parse_fleet("1x2:A100-SXM4-80GB")
    recorder = Recorder()
    result = Simulator(trace, fleet, fleet.max_power_w).run(recorder)
    first = recorder.views[0]
    assert first.shared_gpu is not None
    assert first.job_id.tolist() == [0, 1, 2]
    assert first.shared_gpu[0] == first.shared_gpu[1] != first.shared_gpu[2]
    assert first.busy_gpus == 2 and first.gpus_held.tolist() == [0.5, 0.5, 1.0]
    assert first.idle_power_w == 0.0  # both GPUs are taken
    # sharing slows j0 and j1; j3 waits for the last of them
    assert result.finish_s[0] > 600.0 and result.finish_s[1] > 1200.0
    assert result.start_s[3] >= result.finish_s[1]
    m = compute_metrics(result)
    assert m.shared_gpus_mean is not None and 1.0 <= m.tenants_per_shared_gpu <= 2.0


def test_a_shared_gpu_is_one_gpu_in_the_clusters_power() -> None:
    """Two tenants on one GPU of a two-GPU node: the cluster draws that GPU once, plus the
    idle one; every tenant reads the GPU's whole power."""
    trace = _trace([0, 0], [6000, 6000], [500, 500])
    fleet = parse_fleet("1x2:A100-SXM4-80GB")
    recorder = Recorder()
    result = Simulator(trace, fleet, fleet.max_power_w).run(recorder)
    seen = recorder.views[2]
    assert seen.power_w[0] == seen.power_w[1]  # one reading of one GPU
    # the truth: one busy GPU and one idle one; the reading carries 1 % noise
    truth_w = result.power_w[2] - A100.idle_power_w
    assert seen.power_w[0] == pytest.approx(truth_w, rel=0.05)
    assert truth_w < A100.power_limit.default_w


class _Clocks(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.policy = Cdgpc()
        self.answers: list[Setpoints] = []

    def start(self, fleet, budget_w, interval_s):  # type: ignore[no-untyped-def]
        self.policy.start(fleet, budget_w, interval_s)

    def decide(self, view: ClusterView) -> Setpoints:
        self.views.append(view)
        self.answers.append(self.policy.decide(view))
        return self.answers[-1]


def crowded_trace() -> Trace:
    """40 jobs in half an hour, of 10 to 50 minutes, three in four on part of a GPU."""
    rng = np.random.default_rng(1)
    n = 40
    return _trace(
        np.sort(rng.uniform(0, 1800, n)).tolist(),
        rng.uniform(600, 3000, n).tolist(),
        rng.choice([250, 400, 500, 1000], n).tolist(),
    )


def test_cdgpc_gives_a_shared_gpu_one_clock_and_holds_the_budget() -> None:
    trace = crowded_trace()
    fleet = parse_fleet("2x4:A100-SXM4-80GB")
    budget_w = 0.45 * fleet.max_power_w
    clocks = _Clocks()
    result = Simulator(trace, fleet, budget_w).run(clocks)
    shared_views = 0
    for view, answer in zip(clocks.views, clocks.answers, strict=True):
        assert view.shared_gpu is not None and answer.graphics_mhz is not None
        for gpu in np.unique(view.shared_gpu[view.shared_gpu >= 0]):
            tenants = view.shared_gpu == gpu
            shared_views += int(tenants.sum() > 1)
            assert np.unique(answer.graphics_mhz[tenants]).size == 1
    assert shared_views > 10
    # a tiny, crowded cluster: tenants come and go every few intervals; before the offset kept
    # off a GPU whose tenants changed, 9.6 % of intervals were over and the worst by 12.5 %
    m = compute_metrics(result)
    assert m.binding_intervals > 10
    assert m.over_budget_intervals_pct < 6.0 and m.max_overshoot_pct < 8.0


def test_the_oracle_cannot_replay_shared_gpus() -> None:
    trace = _trace([0, 0], [600, 600], [500, 500])
    fleet = parse_fleet("1x2:A100-SXM4-80GB")
    with pytest.raises(InputError, match="whole GPUs"):
        Simulator(trace, fleet, fleet.max_power_w).run(Oracle())


@pytest.mark.data
def test_alibaba_pods_share_gpus_under_cdgpc(shared_data: Path) -> None:
    """The last 400 openb pods: fractional ones share GPUs, and cdgpc runs them within the
    budget (0.7 of the fleet's peak draw at top clocks)."""
    trace = alibaba2023(shared_data / "alibaba-gpu-v2023" / "openb_pod_list_default.csv")
    trace = trace.select(np.arange(len(trace)) >= len(trace) - 400)
    fleet = default_fleet(trace)
    peak = compute_metrics(Simulator(trace, fleet, 1e9).run(make_policy("max-clock")))
    budget_w = 0.7 * peak.peak_demand_w
    m = compute_metrics(Simulator(trace, fleet, budget_w).run(make_policy("cdgpc")))
    assert m.shared_gpus_mean is not None and m.tenants_per_shared_gpu > 1.0
    assert m.binding_intervals > 100
    assert m.power_mae_pct is not None and m.power_mae_pct < 10.0
    assert m.over_budget_intervals_pct < 2.0


def test_a_learned_new_job_share_narrows_the_error_on_short_pods(shared_data: Path) -> None:
    """The same 400 pods: counted at their limits until measured, the pods leave the budget
    unused; counted at the learned quantile of first readings (shipped), less so."""
    trace = alibaba2023(shared_data / "alibaba-gpu-v2023" / "openb_pod_list_default.csv")
    trace = trace.select(np.arange(len(trace)) >= len(trace) - 400)
    fleet = default_fleet(trace)
    peak = compute_metrics(Simulator(trace, fleet, 1e9).run(make_policy("max-clock")))
    budget_w = 0.7 * peak.peak_demand_w
    learned = make_policy("cdgpc")
    assert isinstance(learned, Cdgpc)
    m = compute_metrics(Simulator(trace, fleet, budget_w).run(learned))
    at_limit = make_policy("cdgpc", ControlConfig(new_job_power_quantile=1.0))
    off = compute_metrics(Simulator(trace, fleet, budget_w).run(at_limit))
    share = learned.controller.new_share.of(["A100-SXM4-80GB", "A100-SXM4-80GB shared"])
    assert 0.45 < share[0] < 0.6 < share[1] < 0.9  # alone they draw 0.47–0.55 of the limit
    assert m.power_mae_pct is not None and off.power_mae_pct is not None
    assert m.power_mae_pct < 0.6 * off.power_mae_pct  # 3.7 % against 8.1 %
    assert m.over_budget_intervals_pct < 1.0


ALI_PODS = (
    Path(__file__).resolve().parent.parent / "data" / "traces" / "alibaba2023_pods_synthetic.csv"
)


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(simulate, ["--trace", str(ALI_PODS), *args])
    return result.exit_code, result.output


def test_cli_replays_the_last_pods_shared_or_on_whole_gpus() -> None:
    """The snippet's last four pods: two of them share a GPU (250 and 500 thousandths)."""
    code, out = _cli("--last-jobs", "4", "--fleet", "2x8:A100-SXM4-80GB", "--json")
    assert code == 0, out
    shared = json.loads(out)
    assert shared["jobs"] == 4 and shared["tenants_per_shared_gpu"] > 1.0
    assert shared["peak_demand_w"] > 0
    code, out = _cli("--last-jobs", "4", "--fleet", "2x8:A100-SXM4-80GB", "--whole-gpus", "--json")
    assert code == 0, out
    whole = json.loads(out)
    assert "shared_gpus_mean" not in whole and whole["jobs"] == 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--policy", "oracle"), "--policy oracle reads the plant of whole GPUs"),
        (("--last-jobs", "2", "--limit-jobs", "2"), "give --limit-jobs or --last-jobs, not both"),
        (("--whole-gpus", "--sweep", "out"), "--whole-gpus and --mig are for one replay"),
    ],
)
def test_cli_refuses_what_shared_gpus_cannot_replay(args: tuple[str, ...], message: str) -> None:
    code, out = _cli(*args)
    lines = [line for line in out.splitlines() if line.strip()]
    assert code != 0 and len(lines) == 1 and message in lines[0], out


def test_time_model_errors_are_told_apart_by_what_the_gpu_did() -> None:
    errors = TenantTimeErrors()
    ids, yes = np.array([1, 2]), np.array([True, True])
    none = np.zeros(0)
    errors.add(ids, np.array([0, 0]), none, none, yes[:0])  # 1 and 2 start on GPU 0
    for _ in range(5):  # they share: 10 % off (a job's start is no change of co-tenants)
        errors.add(ids, np.array([0, 0]), np.array([1.1, 1.1]), np.array([1.0, 1.0]), yes)
    errors.add(ids[:1], np.array([-1]), np.array([1.1]), np.array([1.0]), yes[:1])  # 2 left
    errors.add(ids[:1], np.array([-1]), np.array([2.0]), np.array([1.0]), yes[:1])  # alone
    for _ in range(4):  # it settles: 0 % off
        errors.add(ids[:1], np.array([-1]), np.array([1.0]), np.array([1.0]), yes[:1])
    trio = np.array([1, 3])
    errors.add(trio, np.array([0, 0]), np.array([1.0]), np.array([1.0]), yes[:1])  # 3 joins
    errors.add(trio, np.array([0, 0]), np.array([1.3, np.nan]), np.array([1.0, 1.0]), yes)
    summary = errors.summary()
    assert summary is not None
    assert summary["shared"] == pytest.approx((10 * 11 + 30) / 12)
    assert summary["shared_after_change"] == pytest.approx(30.0)
    assert summary["alone"] == pytest.approx(100.0 / 6)
    assert summary["alone_after_leaving"] == pytest.approx(100.0 / 4)  # its first 4 alone
    # an unsettled model, or a job never shared, is not scored; no sharing at all: no summary
    quiet = TenantTimeErrors()
    quiet.add(ids, None, none, none, yes[:0])
    quiet.add(ids, None, np.array([2.0, 2.0]), np.array([1.0, 1.0]), np.array([False, True]))
    assert quiet.summary() is None


def test_a_cdgpc_replay_of_shared_gpus_reports_its_time_models_errors() -> None:
    trace = crowded_trace()
    fleet = parse_fleet("2x4:A100-SXM4-80GB")
    sim = Simulator(trace, fleet, 0.45 * fleet.max_power_w)
    runs = run_policies(sim, ["cdgpc", "uniform-clock"])
    errors = runs["cdgpc"].metrics.time_model_error_pct
    assert errors is not None and runs["uniform-clock"].metrics.time_model_error_pct is None
    # a model learns its job's speed with the co-tenants it has: a change costs it most
    assert errors["shared_after_change"] > errors["shared"]
    assert errors["alone_after_leaving"] > errors["alone"]
    assert "time_model_error_pct" in runs["cdgpc"].metrics.as_dict()


def test_a_tenant_re_anchored_among_new_co_tenants_is_predicted_better() -> None:
    """The same crowded replay with `reanchor_tenants` on and off: a time model that takes the
    first sample among new co-tenants for an outlier stays off for intervals."""
    trace = crowded_trace()
    fleet = parse_fleet("2x4:A100-SXM4-80GB")
    sim = Simulator(trace, fleet, 0.45 * fleet.max_power_w)
    errors = {}
    for on in (True, False):
        runs = run_policies(sim, ["cdgpc"], control=ControlConfig(reanchor_tenants=on))
        errors[on] = runs["cdgpc"].metrics.time_model_error_pct
    on, off = errors[True], errors[False]
    assert on is not None and off is not None
    assert on["shared_after_change"] < 0.8 * off["shared_after_change"], (on, off)
    assert on["shared"] < off["shared"], (on, off)


def test_the_interference_term_predicts_a_change_of_co_tenants_and_decides_alike() -> None:
    """The crowded replay with `interference` on and off: a tenant whose co-tenants changed is
    predicted at what such changes did to the others, well before its own first sample among
    them; no job here has a deadline, so the plans' weights carry the factor on both sides
    of w·T and the decisions are the same."""
    trace = crowded_trace()
    fleet = parse_fleet("2x4:A100-SXM4-80GB")
    sim = Simulator(trace, fleet, 0.45 * fleet.max_power_w)
    runs = {
        on: run_policies(sim, ["cdgpc"], control=ControlConfig(interference=on))["cdgpc"]
        for on in (True, False)
    }
    on, off = (runs[k].metrics.time_model_error_pct for k in (True, False))
    assert on is not None and off is not None
    # 40 jobs teach few changes of each kind (ten make a cell count): 9.3 % → 8.3 % after a
    # change; no tenant here is left alone often enough for that kind to count
    assert on["shared_after_change"] < 0.95 * off["shared_after_change"], (on, off)
    assert on["alone_after_leaving"] <= off["alone_after_leaving"], (on, off)
    assert runs[True].result.power_w.tolist() == runs[False].result.power_w.tolist()
