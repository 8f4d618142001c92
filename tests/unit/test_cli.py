from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_cdgpc.cli.main import cli


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.output


def test_bench_controller_prints_one_json_object_with_the_promised_keys() -> None:
    code, out = _run("bench", "controller", "--jobs", "60", "--steps", "2", "--json")
    assert code == 0, out
    report = json.loads(out)
    for key in (
        "jobs", "step_ms_p50", "step_ms_p99", "dual_iterations_p50", "modes_agree",
        "budget_error_pct", "reference_gap_pct", "reference_ms",
    ):  # fmt: skip
        assert key in report
    assert report["jobs"] == 60
    assert report["modes_agree"] is True
    assert -0.5 < report["budget_error_pct"] <= 0
    assert abs(report["reference_gap_pct"]) < 0.1


def test_bench_controller_with_racks_checks_every_domain_price() -> None:
    code, out = _run(
        "bench", "controller", "--jobs", "400", "--steps", "2", "--topology", "2x3",
        "--budget-fraction", "0.9", "--json",
    )  # fmt: skip
    assert code == 0, out
    report = json.loads(out)
    assert report["domains"] == 2 + 6
    # the budget does not bind; racks at 0.55-0.8 and rows at 0.7 of their top-clock power do
    assert report["domains_binding"] >= 2
    assert report["modes_agree"] is True
    assert abs(report["reference_gap_pct"]) < 0.1


@pytest.mark.parametrize("topology", ["0x3", "2", "2x3x4", "-1x2"])
def test_bench_controller_refuses_a_topology_it_cannot_read(topology: str) -> None:
    code, out = _run("bench", "controller", "--jobs", "10", "--topology", topology)
    assert code == 2
    assert "expected ROWSxRACKS" in out


def test_demo_holds_the_budget_and_applies_the_budget_change() -> None:
    code, out = _run(
        "demo", "--in-process", "--jobs", "16", "--intervals", "12", "--speed", "0", "--json"
    )
    assert code == 0, out
    summary = json.loads(out)
    assert summary["intervals"] == 12
    assert summary["budget_changes_applied"] == 1
    assert summary["max_power_over_budget_pct"] < 1.0
    assert summary["jobs_registered"] == 16


def test_demo_table_is_readable() -> None:
    code, out = _run("demo", "--in-process", "--jobs", "8", "--intervals", "4", "--speed", "0")
    assert code == 0, out
    assert "budget" in out and "power" in out and "admin: budget set" in out
    assert "summary" in out


@pytest.mark.data
def test_model_replay_json(shared_data: Path) -> None:
    path = shared_data / "perseus-sosp24/stage_profile/bloom+a100_sxm_bf16.csv"
    code, out = _run("model", "replay", "--csv", str(path), "--json")
    assert code == 0, out
    report = json.loads(out)
    assert report["model_family"] == "bent" and report["points"] == 608
    assert report["power_mape_pct"] < 1.5 and report["time_mape_pct"] < 1.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("demo", "--interval", "soon"), "Error: cannot read duration 'soon'"),
        (("model", "replay", "--csv", "/nonexistent/sweep.csv"), "Error: cannot read"),
        (("model", "replay", "--csv", "/nonexistent/x.csv", "--gpu", "B300"), "Error: "),
    ],
)
def test_bad_input_is_one_line_and_non_zero(args: tuple[str, ...], message: str) -> None:
    code, out = _run(*args)
    assert code != 0
    assert message in out
    assert "Traceback" not in out
    assert len(out.strip().splitlines()) == 1


def test_the_live_demo_takes_a_control_section_from_a_config_file(tmp_path: Path) -> None:
    from slurm_cdgpc.cli.demo import control_section  # noqa: PLC0415

    good = tmp_path / "good.toml"
    good.write_text('[control]\ninterval = "5s"\nnew_job_power_share = 0.6\nemergency = false\n')
    assert control_section(good) == {"new_job_power_share": 0.6, "emergency": False}
    bad = tmp_path / "bad.toml"
    bad.write_text("[control]\nnew_job_power_share = 1.5\n")
    code, out = _run("demo", "--config", str(bad), "--duration", "1s")
    assert code != 0 and "new_job_power_share" in out and "Traceback" not in out
    assert len(out.strip().splitlines()) == 1
    code, out = _run("demo", "--config", str(good), "--in-process")
    assert code != 0 and "--config is for the live demo" in out
