"""One brain: cdgpcd and the simulator build the same controller from the same settings."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from sqlalchemy import Engine

from slurm_cdgpc.cli.main import cli
from slurm_cdgpc.config import Config, ControlConfig, load_config
from slurm_cdgpc.control.empc import ControllerSettings, EconomicMPC
from slurm_cdgpc.control.tuning import Tuning, paper, shipped
from slurm_cdgpc.coordinator.daemon import Coordinator, CoordinatorSettings
from slurm_cdgpc.model.estimator import EstimatorSettings
from slurm_cdgpc.sim.fleet import parse_fleet
from slurm_cdgpc.sim.policies import make_policy
from slurm_cdgpc.store import Store, make_engine, upgrade

REPO = Path(__file__).resolve().parents[2]
SHIPPED_FILE = REPO / "daemon" / "cdgpc.toml"


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    engine = make_engine(f"sqlite:///{tmp_path / 'head.db'}")
    upgrade(engine)
    yield engine
    engine.dispose()


def _head(engine: Engine, settings: CoordinatorSettings) -> Coordinator:
    return Coordinator(Store(engine), transport=None, settings=settings)  # type: ignore[arg-type]


def _simulated(name: str, interval_s: float) -> tuple[EconomicMPC, EstimatorSettings]:
    policy = make_policy(name)
    policy.start(parse_fleet("2x8:A100-SXM4-80GB,1x8:A40"), 1e4, interval_s)
    controller: EconomicMPC = policy.controller  # type: ignore[attr-defined]
    return controller, policy.estimator.settings  # type: ignore[attr-defined]


def test_cdgpcd_with_the_shipped_file_runs_the_simulators_cdgpc(engine: Engine) -> None:
    config = load_config(SHIPPED_FILE, env={})
    head = _head(engine, CoordinatorSettings.from_config(config))
    controller, estimator = _simulated("cdgpc", config.control.interval_s)
    assert head.controller.settings == controller.settings
    assert head.running.estimator.settings == estimator
    # both hand the controller every supported clock and let it apply its own floor
    assert (
        head.grid.bottom_mhz(np.array([head.grid.type_index("A100-SXM4-80GB")]))[0][0]
        == (controller.grid.bottom_mhz(np.array([0]))[0][0])
    )


def test_one_set_of_defaults() -> None:
    # the dataclass, the configuration's defaults and the shipped file are one and the same
    from_defaults = Tuning.from_config(ControlConfig())
    assert from_defaults.controller == ControllerSettings()
    assert from_defaults.estimator == EstimatorSettings()
    assert from_defaults == shipped()
    assert Tuning.from_config(load_config(SHIPPED_FILE, env={}).control) == shipped()
    assert CoordinatorSettings().controller == shipped().controller


def test_a_site_setting_reaches_the_head_and_the_simulator_alike(engine: Engine) -> None:
    control = ControlConfig(drain_pressure=0.0, triage=False, min_clock_fraction=0.5)
    tuning = Tuning.from_config(control)
    head = _head(engine, CoordinatorSettings(controller=tuning.controller))
    assert head.controller.settings.triage is False
    assert head.controller.settings.drain_pressure == 0.0
    assert head.controller.floor_grid.bottom_mhz(np.array([0]))[0][0] < 0.6 * 1410


def test_the_paper_is_the_same_controller_without_the_rules() -> None:
    controller, estimator = _simulated("cdgpc-paper", 60.0)
    assert type(controller) is EconomicMPC
    assert controller.settings == paper(60.0).controller
    assert estimator.family == "linear"
    s = controller.settings
    assert (s.triage, s.floor_fallback, s.drain_pressure, s.exploration_sigmas) == (
        False,
        False,
        0.0,
        0.0,
    )
    assert (s.guard_per_sqrt_job, s.guard_tail, s.min_clock_fraction) == (0.0, 0.0, 0.5)
    assert s.offset_per_job is False  # one offset, as published
    assert (s.new_job_power_share, s.new_job_power_quantile) == (1.0, 1.0)  # new jobs at TDP
    assert s.reanchor_tenants is False and s.interference is False
    assert s.held_at_limit is False  # a held job counted at its lock, as published


def test_a_sites_control_section_is_what_the_simulator_runs(engine: Engine) -> None:
    control = ControlConfig(triage=False, drain_pressure=0.0, guard_band=0.004)
    policy = make_policy("cdgpc", control)
    policy.start(parse_fleet("1x8:A100-SXM4-80GB"), 1e4, 30.0)
    head = _head(engine, CoordinatorSettings.from_config(replace(Config(), control=control)))
    assert policy.controller.settings == head.controller.settings  # type: ignore[attr-defined]
    assert head.controller.settings.triage is False


def test_simulate_config_runs_the_files_control_section(tmp_path: Path) -> None:
    trace = REPO / "tests" / "data" / "sim" / "synthetic40.csv"
    site = tmp_path / "site.toml"
    site.write_text("[control]\nmin_clock_fraction = 0.9\nfloor_fallback = false\n")
    args = ["simulate", "--trace", str(trace), "--limit-jobs", "12", "--budget", "0.45", "--json"]
    runner = CliRunner()
    shipped_run = runner.invoke(cli, args)
    site_run = runner.invoke(cli, [*args, "--config", str(site)])
    assert shipped_run.exit_code == 0 and site_run.exit_code == 0, site_run.output
    # a 0.9 floor cannot hold a 0.45 budget: the file's settings, not the shipped ones, ran
    shipped_over = json.loads(shipped_run.stdout)["over_budget_intervals_pct"]
    assert json.loads(site_run.stdout)["over_budget_intervals_pct"] > shipped_over
    site.write_text("[control]\ntriage = maybe\n")
    bad = runner.invoke(cli, [*args, "--config", str(site)])
    assert bad.exit_code != 0 and bad.output.count("\n") == 1 and "Error:" in bad.output


def test_the_guard_rail_turns_planning_at_the_limit_clock_off() -> None:
    """The rail sets every limit from the plan: the clock it held a job at is no ceiling for
    the next plan (planned there, the plans ratchet down: DESIGN.md, "Controller", Clocks)."""
    assert Tuning.from_config(ControlConfig()).controller.held_at_limit is True
    railed = Tuning.from_config(ControlConfig(power_limit_margin=0.05)).controller
    assert railed.held_at_limit is False
