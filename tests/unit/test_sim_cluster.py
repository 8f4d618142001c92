"""The cluster simulator on hand-checkable tiny traces: FIFO, placement, finish times."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.sim.cluster import ClusterView, Policy, Setpoints, Simulator
from slurm_cdgpc.sim.fleet import parse_fleet
from slurm_cdgpc.sim.metrics import compute_metrics, run_policies
from slurm_cdgpc.sim.policies import POLICIES, MaxClock
from slurm_cdgpc.sim.reporting import (
    NONE,
    REALISTIC,
    REPORTED,
    SOURCES,
    STEPS,
    TIME_LIMIT,
    ProgressMix,
    TimeLimitModel,
)
from slurm_cdgpc.sim.traces import Trace, load_trace

DATA = Path(__file__).resolve().parent.parent / "data" / "sim"


def _trace(submit: list[float], duration: list[float], gpus: list[int]) -> Trace:
    n = len(submit)
    return Trace(
        job_id=np.array([f"j{i}" for i in range(n)]),
        submit_s=np.array(submit, dtype=float),
        duration_s=np.array(duration, dtype=float),
        num_gpu=np.array(gpus),
        deadline_s=np.full(n, np.nan),
        iterations=np.full(n, np.nan),
        model_name=np.full(n, "resnet50"),
        gpu_type=np.full(n, ""),
        job_type=np.full(n, ""),
        source="cdgpc",
        time_unit_note="s",
    )


class Recorder(Policy):
    """Max clocks, keeping every view it was shown."""

    name = "recorder"

    def __init__(self) -> None:
        self.views: list[ClusterView] = []

    def decide(self, view: ClusterView) -> Setpoints:
        self.views.append(view)
        return Setpoints()


def test_tiny_trace_fifo_blocking_and_finish_times_by_hand() -> None:
    # one node of 8: a(4 GPUs, 600 s) and b(4, 300 s) start at 0; c(8, 120 s) waits for both;
    # d(1 GPU, submitted at 10 s) could start at 300 s when b leaves, but strict FIFO keeps it
    # behind c: it starts when c is done
    trace = load_trace(DATA / "tiny.csv")
    fleet = parse_fleet("1x8:A100-SXM4-80GB")
    result = Simulator(trace, fleet, 0.7 * fleet.max_power_w).run(MaxClock())
    np.testing.assert_allclose(result.start_s, [0.0, 0.0, 600.0, 720.0])
    np.testing.assert_allclose(result.finish_s, [600.0, 300.0, 720.0, 780.0], atol=1e-6)
    assert not result.rejected.any()


def test_a_job_finishes_inside_an_interval() -> None:
    # 90 s of work from t = 0 at max clocks: finishes at 90 s, not at a boundary
    fleet = parse_fleet("1x8:A100-SXM4-80GB")
    result = Simulator(_trace([0.0], [90.0], [2]), fleet, fleet.max_power_w).run(MaxClock())
    assert result.finish_s[0] == pytest.approx(90.0, abs=1e-6)


def test_multi_node_job_takes_whole_free_nodes_and_the_remainder() -> None:
    fleet = parse_fleet("3x8:A100-SXM4-80GB")
    trace = _trace([0.0, 0.0], [600.0, 600.0], [3, 12])
    rec = Recorder()
    Simulator(trace, fleet, fleet.max_power_w).run(rec)
    # the 3-GPU job on node 0; the 12-GPU one needs 2 fully free nodes: 8 on node 1, 4 on node 2
    assert rec.views[0].job_nodes.tolist() == [[3, 0, 0], [0, 8, 4]]
    assert rec.views[0].idle_power_w == pytest.approx(9 * 60.0)


def test_small_job_fills_the_first_node_with_room() -> None:
    fleet = parse_fleet("2x8:A100-SXM4-80GB")
    trace = _trace([0.0, 0.0, 0.0], [600.0] * 3, [6, 4, 2])
    rec = Recorder()
    Simulator(trace, fleet, fleet.max_power_w).run(rec)
    assert rec.views[0].job_nodes.tolist() == [[6, 0], [0, 4], [2, 0]]


def test_job_larger_than_the_fleet_is_rejected_and_does_not_block() -> None:
    fleet = parse_fleet("1x8:A100-SXM4-80GB")
    trace = _trace([0.0, 0.0], [600.0, 60.0], [16, 1])
    result = Simulator(trace, fleet, fleet.max_power_w).run(MaxClock())
    assert result.rejected.tolist() == [True, False]
    assert np.isnan(result.finish_s[0])
    assert result.finish_s[1] == pytest.approx(60.0, abs=1e-6)


def test_jobs_that_name_gpu_types_run_only_on_those_nodes() -> None:
    # node 0 is A100, node 1 is V100; "v" asks for a V100 (Alibaba-style alternatives), "any" for
    # nothing, "t4" for a type this fleet lacks: it runs anywhere rather than never
    fleet = parse_fleet("1x8:A100-SXM4-80GB,1x8:V100-SXM2")
    trace = replace(
        _trace([0.0] * 4, [600.0] * 4, [2, 2, 2, 12]),
        gpu_type=np.array(["V100|P100", "", "T4", "V100"]),
    )
    rec = Recorder()
    result = Simulator(trace, fleet, fleet.max_power_w).run(rec)
    assert rec.views[0].job_nodes.tolist() == [[0, 2], [2, 0], [2, 0]]
    # 12 V100s do not exist: rejected, although the fleet has 16 GPUs
    assert result.rejected.tolist() == [False, False, False, True]


def test_view_rows_stay_aligned_when_jobs_leave() -> None:
    fleet = parse_fleet("1x8:A100-SXM4-80GB")
    trace = _trace([0.0, 0.0, 0.0, 200.0], [120.0, 600.0, 300.0, 60.0], [2, 2, 2, 2])
    rec = Recorder()
    Simulator(trace, fleet, fleet.max_power_w).run(rec)
    previous = None
    for view in rec.views:
        if previous is not None:
            kept_ids = previous.job_id[view.kept]
            assert view.job_id[: len(kept_ids)].tolist() == kept_ids.tolist()
            assert len(view) == len(kept_ids) + view.started
        previous = view
    # j0 leaves after 120 s: the view at 120 s keeps j1 and j2 only
    at_120 = next(v for v in rec.views if v.now_s == 120.0)
    assert at_120.job_id.tolist() == [1, 2]
    # measurements: jobs that ran report power and time; a new job reports NaN
    at_240 = next(v for v in rec.views if v.now_s == 240.0)
    assert at_240.job_id.tolist() == [1, 2, 3]
    assert np.isfinite(at_240.power_w[:2]).all() and np.isnan(at_240.power_w[2])


def test_power_counts_idle_gpus_and_max_clock_overshoots_a_low_budget() -> None:
    fleet = parse_fleet("2x8:A100-SXM4-80GB")
    trace = _trace([0.0], [600.0], [8])
    result = Simulator(trace, fleet, 0.3 * fleet.max_power_w).run(MaxClock())
    # 8 busy A100s at max clocks plus 8 idle ones at 60 W
    assert result.power_w[0] > 8 * 60.0 + 8 * 200.0
    assert (result.demand_w > result.budget_w).all()
    assert result.energy_j == pytest.approx(float(np.sum(result.power_w * 60.0)))


def test_bad_budget_is_refused() -> None:
    fleet = parse_fleet("1x8:A100-SXM4-80GB")
    with pytest.raises(InputError):
        Simulator(_trace([0.0], [60.0], [1]), fleet, 0.0)


# --- the CLI ----------------------------------------------------------------------------------

METRIC_KEYS = {
    "policy",
    "fleet_gpus",
    "budget_w",
    "jobs",
    "finished",
    "deadline_jobs",
    "violations",
    "dvr",
    "violations_induced",
    "dvr_induced",
    "feasible_jobs",
    "violations_feasible",
    "power_mae_pct",
    "binding_intervals",
    "over_budget_intervals_pct",
    "max_overshoot_pct",
    "energy_kwh",
    "mean_jct_s",
    "makespan_s",
    "controller_ms_p50",
}


def _cli(*args: str) -> tuple[int, str]:
    from click.testing import CliRunner  # noqa: PLC0415

    from slurm_cdgpc.cli.simulate import simulate  # noqa: PLC0415

    result = CliRunner().invoke(simulate, list(args))
    return result.exit_code, result.output


def test_cli_json_is_deterministic_under_a_seed() -> None:
    args = ("--trace", str(DATA / "synthetic40.csv"), "--limit-jobs", "12", "--json")
    outputs = []
    for _ in range(2):
        code, out = _cli(*args, "--seed", "5", "--policy", "cdgpc", "--budget", "0.5")
        assert code == 0, out
        payload = json.loads(out)
        assert set(payload) >= METRIC_KEYS
        payload.pop("controller_ms_p50")  # wall-clock time
        outputs.append(payload)
    assert outputs[0] == outputs[1]
    _, other = _cli(*args, "--seed", "6", "--policy", "cdgpc", "--budget", "0.5")
    assert json.loads(other)["energy_kwh"] != outputs[0]["energy_kwh"]


def test_cli_all_policies_keyed_json_and_table() -> None:
    code, out = _cli("--trace", str(DATA / "tiny.csv"), "--policy", "all", "--json")
    assert code == 0, out
    payload = json.loads(out)
    assert list(payload) == list(POLICIES)
    assert payload["max-clock"]["violations_induced"] == 0
    code, out = _cli("--trace", str(DATA / "tiny.csv"), "--policy", "all", "--budget", "200kW")
    assert code == 0, out
    assert "uniform-power-cap" in out and "induced" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--policy", "fastest"), "unknown policy"),
        (("--format", "slurmish"), "unknown trace format"),
        (("--fleet", "8xA100"), "cannot read fleet group"),
        (("--budget", "0"), "budget"),
        (("--budget", "-3kW"), "power"),
        (("--budget", "1.5"), "fraction"),
        (("--interval", "soon"), "duration"),
    ],
)
def test_cli_bad_input_is_a_one_line_error(args: tuple[str, ...], message: str) -> None:
    code, out = _cli("--trace", str(DATA / "tiny.csv"), *args)
    assert code != 0
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], out


def test_cli_report_writes_json_plots_and_summary(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    code, out = _cli(
        "--trace", str(DATA / "tiny.csv"), "--policy", "uniform-clock", "--report", str(tmp_path)
    )
    assert code == 0, out
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {"metrics.json", "power.png", "deadlines.png", "slowdown_cdf.png", "summary.md"}
    assert "uniform-clock" in (tmp_path / "summary.md").read_text()
    assert (tmp_path / "power.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.data
def test_real_trace_head_replays_and_max_clock_is_the_reference(shared_data: Path) -> None:
    path = shared_data / "microsoft-elasticflow-itp" / "with_deadlines" / "cluster04.csv"
    head = load_trace(path).head(300)
    short = head.select(head.duration_s < 3 * 3600.0)  # keep it quick: short jobs only
    trace = short.head(20)
    fleet = parse_fleet("4x8:A100-SXM4-80GB")
    runs = run_policies(Simulator(trace, fleet, 0.7 * fleet.max_power_w), ["cdgpc", "max-clock"])
    assert runs["cdgpc"].metrics.finished == 20 - runs["cdgpc"].metrics.rejected
    assert runs["cdgpc"].metrics.over_budget_intervals_pct < 1.0
    assert runs["max-clock"].metrics.violations_induced == 0


def test_a_policy_cannot_write_into_the_simulator_through_its_view() -> None:
    class Vandal(Policy):
        def decide(self, view: ClusterView) -> Setpoints:
            view.job_gpus[:] = 0
            return Setpoints()

    fleet = parse_fleet("1x8:A100-SXM4-80GB")
    with pytest.raises(ValueError, match="read-only"):
        Simulator(_trace([0.0], [60.0], [1]), fleet, fleet.max_power_w).run(Vandal())


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_jobs_outside_the_progress_share_show_no_progress(share: float) -> None:
    fleet = parse_fleet("2x8:A100-SXM4-80GB")
    n = 40
    trace = _trace([0.0] * n, [600.0] * n, [1] * n)
    trace = replace(trace, iterations=np.full(n, 1000.0))
    rec = Recorder()
    sim = Simulator(trace, fleet, fleet.max_power_w, seed=3, progress_share=share)
    sim.run(rec)
    silent = {int(j) for j in np.flatnonzero(~sim.reports_progress)}
    assert len(silent) == {0.0: n, 1.0: 0}.get(share, len(silent))
    assert 0 < len(silent) < n or share in (0.0, 1.0)
    view = next(v for v in rec.views if v.now_s == 120.0 and len(v))
    for row, job in enumerate(view.job_id.tolist()):
        seen = (view.iteration_s[row], view.remaining_iterations[row], view.iterations[row])
        assert np.isnan(seen).all() == (job in silent)
        assert np.isfinite(view.power_w[row])  # power is measured whether it reports or not
    again = Simulator(trace, fleet, fleet.max_power_w, seed=3, progress_share=share)
    assert np.array_equal(again.reports_progress, sim.reports_progress)  # same for every policy


def test_a_progress_share_outside_zero_to_one_is_refused() -> None:
    fleet = parse_fleet("1x8:A100-SXM4-80GB")
    with pytest.raises(InputError, match="progress share"):
        Simulator(_trace([0.0], [60.0], [1]), fleet, fleet.max_power_w, progress_share=1.5)


def _reporting_trace(n: int = 400) -> Trace:
    trace = _trace([0.0] * n, [600.0 + 37.0 * i for i in range(n)], [1] * n)
    return replace(trace, iterations=np.full(n, 1000.0))


def test_progress_sources_are_drawn_per_seed_in_the_stated_shares() -> None:
    fleet = parse_fleet("1x8:A100-SXM4-80GB")
    trace = _reporting_trace(4000)
    mix = ProgressMix.parse("reported=0.2,steps=0.5,time-limit=0.2,none=0.1")
    sim = Simulator(trace, fleet, fleet.max_power_w, seed=5, progress_mix=mix)
    counts = np.bincount(sim.source, minlength=len(SOURCES)) / len(trace)
    np.testing.assert_allclose(counts, mix.shares, atol=0.03)
    # the same for every policy (a new simulator of the same seed), another for another seed
    again = Simulator(trace, fleet, fleet.max_power_w, seed=5, progress_mix=mix)
    assert np.array_equal(again.source, sim.source)
    other = Simulator(trace, fleet, fleet.max_power_w, seed=6, progress_mix=mix)
    assert not np.array_equal(other.source, sim.source)
    # --progress-share P is reported P, time-limit 1 − P, on the draw it always had
    share = Simulator(trace, fleet, fleet.max_power_w, seed=5, progress_share=0.3)
    assert share.progress_mix == ProgressMix.parse("reported=0.3,time-limit=0.7")
    assert set(np.unique(share.source).tolist()) == {REPORTED, TIME_LIMIT}
    u = np.random.default_rng([5, 2]).random(len(trace))
    assert np.array_equal(share.reports_progress, u < 0.3)
    assert REALISTIC.shares == (0.2, 0.6, 0.2, 0.0)


def test_each_source_shows_what_the_head_would_know() -> None:
    fleet = parse_fleet("2x8:A100-SXM4-80GB")
    n = 16
    trace = _reporting_trace(n)
    mix = ProgressMix.parse("reported=0.25,steps=0.25,time-limit=0.25,none=0.25")
    rec = Recorder()
    sim = Simulator(trace, fleet, fleet.max_power_w, seed=1, progress_mix=mix)
    sim.run(rec)
    assert set(np.unique(sim.source).tolist()) == set(range(len(SOURCES)))
    view = next(v for v in rec.views if v.now_s == 120.0)
    assert len(view) == n
    for row, job in enumerate(view.job_id.tolist()):
        source = int(sim.source[job])
        total = (view.iterations[row], view.remaining_iterations[row])
        assert np.isfinite(total).all() == (source == REPORTED)
        assert np.isfinite(view.iteration_s[row]) == (source in (REPORTED, STEPS))
        assert np.isfinite(view.iterations_done[row]) == (source in (REPORTED, STEPS))
        assert np.isfinite(view.time_limit_s[row]) == (source != NONE)
        assert view.start_s[row] == 0.0
        assert np.isfinite(view.power_w[row])  # power is measured whatever the job reports


def test_time_limits_are_drawn_within_the_model_and_rounded_up_to_minutes() -> None:
    fleet = parse_fleet("1x8:A100-SXM4-80GB")
    trace = _reporting_trace(2000)
    sim = Simulator(trace, fleet, fleet.max_power_w, seed=2)
    limit_s, run_s = sim.time_limit_s, trace.duration_s
    assert np.all(limit_s % 60.0 == 0.0)
    assert np.all(limit_s >= 1.5 * run_s) and np.all(limit_s < 3.0 * run_s + 60.0)
    ratio = limit_s / run_s
    assert ratio.min() < 1.6 and ratio.max() > 2.9  # the whole range is drawn
    again = Simulator(trace, fleet, fleet.max_power_w, seed=2, progress_share=0.5)
    assert np.array_equal(again.time_limit_s, limit_s)  # the mix leaves the limits alone
    narrow = Simulator(trace, fleet, fleet.max_power_w, seed=2, time_limits=TimeLimitModel(2, 2))
    np.testing.assert_array_equal(narrow.time_limit_s, 60.0 * np.ceil(2 * run_s / 60.0))
    # a trace's own limit wins over the model's
    own = replace(trace, time_limit_s=np.full(len(trace), 7200.0))
    assert np.all(Simulator(own, fleet, fleet.max_power_w, seed=2).time_limit_s == 7200.0)


def test_slurm_kills_a_job_at_its_time_limit_and_its_deadline_is_missed() -> None:
    # one node: a (600 s at top clocks, limit 900 s) runs at half clock, so it would take
    # more than 900 s: killed at 900 s; b (1 GPU, limit 3600 s) finishes
    fleet = parse_fleet("1x8:A100-SXM4-80GB")
    trace = replace(
        _trace([0.0, 0.0], [600.0, 600.0], [4, 1]),
        deadline_s=np.array([5000.0, 5000.0]),
        time_limit_s=np.array([900.0, 3600.0]),
    )

    class HalfClock(Policy):
        def decide(self, view: ClusterView) -> Setpoints:
            top = np.array([float(s.max_graphics_mhz) for s in view.specs])[view.job_type]
            return Setpoints(graphics_mhz=0.4 * top)

    result = Simulator(trace, fleet, fleet.max_power_w).run(HalfClock())
    assert result.killed.tolist() == [True, False]
    assert np.isnan(result.finish_s[0]) and np.isfinite(result.finish_s[1])
    m = compute_metrics(result)
    assert m.killed_at_time_limit == 1 and m.violations == 1 and m.finished == 1
    # at top clocks neither reaches its limit
    assert not Simulator(trace, fleet, fleet.max_power_w).run(MaxClock()).killed.any()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("reported=0.5,steps=0.4", "the shares sum to 0.9, not 1"),
        ("report=1", "use SOURCE=SHARE"),
        ("reported=x", "not a number"),
        ("reported=1.5,none=-0.5", "not in [0, 1]"),
        ("reported=0.5,reported=0.5", "given twice"),
        ("", "use SOURCE=SHARE"),
    ],
)
def test_a_bad_progress_mix_is_refused_in_one_line(text: str, message: str) -> None:
    with pytest.raises(InputError, match=re.escape(message)) as e:
        ProgressMix.parse(text)
    assert "\n" not in str(e.value)


def test_a_mix_reads_back_from_its_text() -> None:
    for mix in (ProgressMix(), REALISTIC, ProgressMix.of_share(0.3)):
        assert ProgressMix.parse(str(mix)) == mix
    assert ProgressMix.parse("realistic") == REALISTIC
    assert ProgressMix.parse("reported=1,steps=0") == ProgressMix()  # a zero share is allowed
    with pytest.raises(InputError, match="uniform:LOW:HIGH"):
        TimeLimitModel.parse("normal:1:2")
    with pytest.raises(InputError, match="0 < LOW <= HIGH"):
        TimeLimitModel.parse("uniform:3:1.5")
    assert TimeLimitModel.parse(str(TimeLimitModel(1.25, 4))) == TimeLimitModel(1.25, 4)
