"""``cdgpc-admin report`` on a SQLite store written by hand, and shell completion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_cdgpc.cli.admin import parse_since_s
from slurm_cdgpc.cli.main import cli
from slurm_cdgpc.store import Measurement, Setpoint, Store, make_engine, upgrade

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


def test_report_with_nothing_in_range_is_one_line(tmp_path: Path) -> None:
    url = _store(tmp_path / "cdgpc.db")
    result = CliRunner().invoke(
        cli, ["report", "--store", url, "--out", str(tmp_path / "r"), "--since", "2099-01-01"]
    )
    assert result.exit_code != 0
    assert result.output.strip() == (
        "Error: the store holds no decisions in that time range: nothing to plot"
    )


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
