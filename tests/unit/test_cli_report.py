"""``cdgpc-admin report`` on a SQLite store written by hand (the cluster's figures, and each
power domain's with a topology), and shell completion."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from slurm_cdgpc.cli.admin import parse_since_s
from slurm_cdgpc.cli.main import cli
from slurm_cdgpc.demo.report import DomainPower, RunData, summarize
from slurm_cdgpc.store import Measurement, Setpoint, Store, make_engine, upgrade
from slurm_cdgpc.topology import parse_topology

T0_S = 1_767_225_600.0
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _store(path: Path) -> str:
    """Four intervals of a two-node cluster: a budget cut after the second, one job finishing
    (late) and one still running; GPU powers chosen so that interval 3 is 1.5 % over."""
    url = f"sqlite:///{path}"
    engine = make_engine(url)
    clock = [T0_S]
    store = Store(engine, clock=lambda: clock[0])
    try:
        upgrade(engine)
        store.set_budget(1000.0, "cdgpcd", reason="budget.initial")
        store.register_job("11", "root", {"n1": [0]}, deadline_s=T0_S + 100, iterations_total=800)
        store.register_job("12", "root", {"n2": [0, 1]}, deadline_s=T0_S + 60, iterations_total=90)
        powers = {0: (450.0, 300.0), 1: (500.0, 450.0), 2: (400.0, 412.0), 3: (390.0, 400.0)}
        for k, (p1, p2) in powers.items():
            clock[0] = T0_S + 30.0 * k
            if k == 2:
                store.set_budget(800.0, "root", reason="cut")
            budget = store.current_budget()
            assert budget is not None
            store.record_decision(
                interval_index=k,
                status="binding",
                mode="newton",
                price=1e-3,
                budget_w=budget.budget_w,
                effective_budget_w=budget.budget_w,
                predicted_power_w=p1 + p2,
                solve_s=0.001,
                setpoints=[Setpoint("11", 1200, 1593, p1), Setpoint("12", 1100, 1593, p2)],
                time_s=clock[0],
            )
            read_s = clock[0] + 30.0  # read at the next interval, before its clocks applied
            store.record_measurements(
                [
                    Measurement(read_s, "n1", 0, p1, "11"),
                    Measurement(read_s, "n2", 0, p2 / 2, "12"),
                    Measurement(read_s, "n2", 1, p2 / 2, "12"),
                ]
            )
            store.record_progress("11", 100 * (k + 1), 800)
        store.finish_job("12", at_s=T0_S + 75.0)
    finally:
        engine.dispose()
    return url


def test_report_writes_plots_and_measures_the_store(tmp_path: Path) -> None:
    url = _store(tmp_path / "cdgpc.db")
    out = tmp_path / "report"
    result = CliRunner().invoke(cli, ["report", "--store", url, "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    for name in ("power.png", "jobs.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name
    assert sorted(summary["plots"]) == sorted(str(out / n) for n in ("jobs.png", "power.png"))
    assert summary["intervals"] == 4
    assert summary["max_power_over_budget_pct"] == pytest.approx(1.5)  # (400 + 412) / 800
    assert summary["budget_changes_applied"] == 1  # the cut; budget.initial is not a change
    assert summary["jobs_registered"] == 2 and summary["jobs_finished"] == 1
    assert summary["jobs_finished_late"] == 1  # job 12: finished at +75 s, deadline +60 s
    # job 11: 400 of 800 iterations in 90 s -> predicted at +180 s, deadline +100 s
    assert summary["jobs_running_predicted_late"] == 1
    assert "domains" not in summary  # no topology: the cluster's figures alone
    assert not (out / "domains.png").exists()


def test_report_with_nothing_in_range_is_one_line(tmp_path: Path) -> None:
    url = _store(tmp_path / "cdgpc.db")
    result = CliRunner().invoke(
        cli, ["report", "--store", url, "--out", str(tmp_path / "r"), "--since", "2099-01-01"]
    )
    assert result.exit_code != 0
    assert result.output.strip() == (
        "Error: the store holds no decisions in that time range: nothing to plot"
    )


#: row1 (2 kW) holds rackA (1 kW: a1, a2) and rackB (800 W: b1); c1 is under the cluster alone
TOPOLOGY = """
[[domain]]
name = "row1"
limit = "2kW"

[[domain]]
name = "rackA"
parent = "row1"
limit = "1kW"
nodes = "a[1-2]"

[[domain]]
name = "rackB"
parent = "row1"
limit = "800W"
nodes = "b1"
"""


def _domain_store(path: Path) -> str:
    """Two intervals of jobs under two racks of one row: job 21 on a1's two GPUs, job 22 split
    over a2 (one GPU) and b1 (two), job 23 on c1 outside every domain. An admin lowers rackB to
    600 W from the second decision on; rackA's 900 W is scheduled after the run, and a limit of
    a domain the file does not have is ignored."""
    url = f"sqlite:///{path}"
    engine = make_engine(url)
    clock = [T0_S - 30.0]
    store = Store(engine, clock=lambda: clock[0])
    try:
        upgrade(engine)
        store.set_budget(3000.0, "cdgpcd", reason="budget.initial")
        store.set_budget(600.0, "root", effective_at_s=T0_S + 30.0, domain="rackB")
        store.set_budget(900.0, "root", effective_at_s=T0_S + 3600.0, domain="rackA")
        store.set_budget(10.0, "root", domain="gone")
        store.register_job("21", "root", {"a1": [0, 1]}, deadline_s=T0_S + 600)
        store.register_job("22", "root", {"a2": [0], "b1": [0, 1]}, deadline_s=T0_S + 600)
        store.register_job("23", "root", {"c1": [0]}, deadline_s=T0_S + 600)
        # what the head read before the first decision: not what any decision ran under
        store.record_measurements(
            [Measurement(T0_S, n, 0, 999.0) for n in ("a1", "a2", "b1", "c1")]
        )
        # (job 21, 22, 23) planned; then per GPU (a1 0, a1 1, a2 0, b1 0, b1 1, c1 0) read
        plans = {0: (600.0, 900.0, 200.0), 1: (500.0, 600.0, 250.0)}
        drawn = {
            0: (350.0, 350.0, 305.0, 303.0, 303.0, 200.0),  # rackA 1005 W: 0.5 % over, not 1 %
            1: (250.0, 250.0, 200.0, 310.0, 310.0, 250.0),  # rackB 620 W over its new 600 W
        }
        gpus = [("a1", 0, "21"), ("a1", 1, "21"), ("a2", 0, "22")]
        gpus += [("b1", 0, "22"), ("b1", 1, "22"), ("c1", 0, "23")]
        for k, (p21, p22, p23) in plans.items():
            clock[0] = T0_S + 30.0 * k
            store.record_decision(
                interval_index=k,
                status="binding",
                mode="newton",
                price=1e-3,
                budget_w=3000.0,
                effective_budget_w=3000.0,
                predicted_power_w=p21 + p22 + p23,
                solve_s=0.001,
                setpoints=[
                    Setpoint("21", 1200, 1593, p21),
                    Setpoint("22", 1200, 1593, p22),
                    Setpoint("23", 1200, 1593, p23),
                ],
                time_s=clock[0],
            )
            read_s = clock[0] + 30.0
            store.record_measurements(
                [
                    Measurement(read_s, node, index, power_w, job)
                    for (node, index, job), power_w in zip(gpus, drawn[k], strict=True)
                ]
            )
    finally:
        engine.dispose()
    return url


#: planned: rackA = P21 + P22/3, rackB = 2 P22/3, row1 = P21 + P22; measured: the next reading
DOMAINS = [
    {
        "name": "row1",
        "limit_w": 2000.0,
        "intervals_measured": 2,
        "intervals_over_limit": 0,
        "max_power_over_limit_pct": -19.45,  # (1611 - 2000) / 2000
        "planned_mean_w": 1300.0,  # (1500 + 1100) / 2
        "measured_mean_w": 1465.5,  # (1611 + 1320) / 2
    },
    {
        "name": "rackA",
        "limit_w": 1000.0,  # its 900 W comes after the run
        "intervals_measured": 2,
        "intervals_over_limit": 0,  # 1005 W is over by 0.5 %: within the 1 %
        "max_power_over_limit_pct": 0.5,
        "planned_mean_w": 800.0,  # (900 + 700) / 2
        "measured_mean_w": 852.5,  # (1005 + 700) / 2
    },
    {
        "name": "rackB",
        "limit_w": 600.0,  # the admin's, from the second decision
        "intervals_measured": 2,
        "intervals_over_limit": 1,  # 620 W against 600 W; 606 W was under the file's 800 W
        "max_power_over_limit_pct": 3.3333,
        "planned_mean_w": 500.0,  # (600 + 400) / 2
        "measured_mean_w": 613.0,  # (606 + 620) / 2
    },
]


def test_domains_per_interval_from_the_store(tmp_path: Path) -> None:
    engine = make_engine(_domain_store(tmp_path / "cdgpc.db"))
    try:
        data = RunData.load(Store(engine), topology=parse_topology(TOPOLOGY))
    finally:
        engine.dispose()
    domains = data.domains
    assert domains is not None and domains.names == ("row1", "rackA", "rackB")
    assert domains.limit_w.tolist() == [[2000.0, 2000.0], [1000.0, 1000.0], [800.0, 600.0]]
    np.testing.assert_allclose(
        domains.planned_w, [[1500, 1100], [900, 700], [600, 400]], rtol=1e-12
    )
    assert domains.measured_w.tolist() == [[1611.0, 1320.0], [1005.0, 700.0], [606.0, 620.0]]
    summary = summarize(data)
    assert summary["domains"] == DOMAINS
    assert summary["intervals"] == 2  # the cluster's figures are as without domains
    # 1611 W in row1 and 200 W on c1 under the first decision
    assert summary["max_power_over_budget_pct"] == round(100 * (1811 - 3000) / 3000, 4)


def test_domain_not_yet_read_is_not_judged(tmp_path: Path) -> None:
    """The last decision's power is read at the next interval: before then it counts nowhere."""
    engine = make_engine(_domain_store(tmp_path / "cdgpc.db"))
    store = Store(engine)
    try:
        store.record_decision(
            interval_index=2,
            status="binding",
            mode="newton",
            price=1e-3,
            budget_w=3000.0,
            effective_budget_w=3000.0,
            predicted_power_w=100.0,
            solve_s=0.001,
            setpoints=[Setpoint("22", 1200, 1593, 3000.0)],
            time_s=T0_S + 60.0,
        )
        data = RunData.load(store, topology=parse_topology(TOPOLOGY))
    finally:
        engine.dispose()
    assert data.domains is not None
    assert data.domains.planned_w[:, 2].tolist() == [3000.0, 1000.0, 2000.0]
    rack_b = summarize(data)["domains"][2]
    assert rack_b["intervals_measured"] == 2 and rack_b["intervals_over_limit"] == 1


def test_report_prints_each_domain_with_a_topology(tmp_path: Path) -> None:
    url = _domain_store(tmp_path / "cdgpc.db")
    topology = tmp_path / "topology.toml"
    topology.write_text(TOPOLOGY, encoding="utf-8")
    out = tmp_path / "report"
    args = ["report", "--store", url, "--topology", str(topology), "--out", str(out)]
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["domains"] == DOMAINS
    assert str(out / "domains.png") in summary["plots"]
    assert (out / "domains.png").read_bytes().startswith(PNG_MAGIC)
    text = CliRunner().invoke(cli, args)
    assert text.exit_code == 0, text.output
    lines = [line for line in text.output.splitlines() if line.startswith("domain ")]
    assert lines == [
        "domain row1: limit 2 kW, 0 of 2 interval(s) measured more than 1 % over, "
        "worst -19.45 %, mean planned 1.3 kW, measured 1.466 kW",
        "domain rackA: limit 1 kW, 0 of 2 interval(s) measured more than 1 % over, "
        "worst +0.50 %, mean planned 800 W, measured 852.5 W",
        "domain rackB: limit 600 W, 1 of 2 interval(s) measured more than 1 % over, "
        "worst +3.33 %, mean planned 500 W, measured 613 W",
    ]


def test_report_reads_the_topology_that_the_configuration_names(tmp_path: Path) -> None:
    url = _domain_store(tmp_path / "cdgpc.db")
    topology = tmp_path / "topology.toml"
    topology.write_text(TOPOLOGY, encoding="utf-8")
    config = tmp_path / "cdgpc.toml"
    config.write_text(f'[head]\ntopology = "{topology}"\n', encoding="utf-8")
    out = str(tmp_path / "report")
    args = ["report", "--store", url, "--config", str(config), "--out", out, "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert [d["name"] for d in json.loads(result.output)["domains"]] == ["row1", "rackA", "rackB"]
    bad = tmp_path / "bad.toml"
    bad.write_text('[[domain]]\nname = "r"\nlimit = "-1W"\n', encoding="utf-8")
    result = CliRunner().invoke(cli, [*args[:-3], "--topology", str(bad), "--out", out])
    assert result.exit_code != 0
    assert (
        result.output.startswith(f"Error: {bad}: domain 'r': limit")
        and len(result.output.splitlines()) == 1
    )


def test_domains_plot_draws_at_most_twelve_the_closest_to_their_limits() -> None:
    names = tuple(f"rack{i:02d}" for i in range(14))
    limit_w = np.full((14, 1), 1000.0)
    measured_w = np.array([[900.0 + 10.0 * i] for i in range(14)])
    measured_w[0, 0] = 1500.0  # the first rack is the furthest over
    measured_w[5, 0] = math.nan  # never read: drawn last, if at all
    domains = DomainPower(names, limit_w, np.zeros((14, 1)), measured_w)
    # the two left out: rack05 (never read) and rack01 (the furthest under its limit after it)
    assert domains.plotted() == [0, *range(2, 5), *range(6, 14)]
    assert len(domains.plotted()) == 12


def test_since_reads_ago_epoch_and_iso() -> None:
    assert parse_since_s("2h", now_s=10_000.0) == 10_000.0 - 7200.0
    assert parse_since_s("1767225600", now_s=0.0) == T0_S
    assert parse_since_s("2026-01-01T00:00:00+00:00", now_s=0.0) == T0_S


def test_bash_completion_script_comes_from_click() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CDGPC_")}
    env["_CDGPC_ADMIN_COMPLETE"] = "bash_source"
    result = subprocess.run(
        [sys.executable, "-c", "from slurm_cdgpc.cli.main import main; main()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "_cdgpc_admin_completion()" in result.stdout
    assert "complete -o nosort -F _cdgpc_admin_completion cdgpc-admin" in result.stdout
    # and the script's own request for words completes subcommands, e.g. "rep" -> report
    env.update(_CDGPC_ADMIN_COMPLETE="bash_complete", COMP_WORDS="cdgpc-admin rep", COMP_CWORD="1")
    words = subprocess.run(
        [sys.executable, "-c", "from slurm_cdgpc.cli.main import main; main()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "plain,report" in words.stdout.splitlines()
