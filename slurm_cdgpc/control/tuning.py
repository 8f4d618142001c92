"""The controller as configured: ``[control]`` → the settings cdgpcd and the simulator share.

`shipped` is the default configuration's; `paper` is the method as published (Kang et al. 2022).
The controller's math: never reaches `store/`, `transport/`, `agent/`, `coordinator/` or `cli/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Controller" (One brain); test:
`tests/unit/test_one_brain.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from slurm_cdgpc.config import ControlConfig
from slurm_cdgpc.control.empc import ControllerSettings
from slurm_cdgpc.model.estimator import EstimatorSettings
from slurm_cdgpc.model.rls import RlsSettings


@dataclass(frozen=True)
class Tuning:
    """Everything that decides clocks: the controller's rules and the models' settings."""

    controller: ControllerSettings
    estimator: EstimatorSettings

    @classmethod
    def from_config(cls, control: ControlConfig) -> Tuning:
        return cls(
            controller=ControllerSettings(
                mode=control.dual_mode,
                interval_s=control.interval_s,
                guard_band=control.guard_band,
                guard_per_sqrt_job=control.guard_per_sqrt_job,
                guard_tail=control.guard_tail,
                offset_gain=control.offset_gain,
                offset_per_job=control.offset_per_job,
                default_pressure=control.default_pressure,
                pressure_floor=control.pressure_floor,
                exploration_sigmas=control.exploration_sigmas,
                min_clock_fraction=control.min_clock_fraction,
                floor_fallback=control.floor_fallback,
                # the guard rail sets every limit from the plan: a clock it held a job at is
                # no ceiling for the next plan, which would otherwise ratchet down on it
                held_at_limit=control.held_at_limit and control.power_limit_margin == 0,
                triage=control.triage,
                reanchor_tenants=control.reanchor_tenants,
                interference=control.interference,
                drain_pressure=control.drain_pressure,
                work_from_time_limit=control.work_from_time_limit,
                limit_share_quantile=control.limit_share_quantile,
                ramp_w_per_s=control.ramp,
                emergency=control.emergency,
                emergency_margin=control.emergency_margin,
                serving_margin=control.serving_margin,
                serving_step=control.serving_step,
                new_job_power_share=control.new_job_power_share,
                new_job_power_quantile=control.new_job_power_quantile,
            ),
            estimator=EstimatorSettings(
                family=control.model_family,
                power=RlsSettings(forgetting=control.power_forgetting),
                time=RlsSettings(forgetting=control.time_forgetting),
                kind_prior=control.kind_prior,
            ),
        )

    def with_interval(self, interval_s: float) -> Tuning:
        return replace(self, controller=replace(self.controller, interval_s=interval_s))


def shipped(interval_s: float | None = None) -> Tuning:
    """The default configuration's tuning (``interval_s``: the run's own control interval)."""
    tuning = Tuning.from_config(ControlConfig())
    return tuning if interval_s is None else tuning.with_interval(interval_s)


def paper(interval_s: float | None = None) -> Tuning:
    """The method as published: linear power model, fixed guard band, one model-error offset,
    clock floor 0.5 of max, new jobs counted at their power limits, no kind prior, triage,
    pressure floor, drain, floor fallback, plan at the clock a power limit holds a job at,
    time-limit work estimate, exploration margin or re-anchoring of tenants' time models."""
    config = ControlConfig(
        model_family="linear",
        kind_prior=False,
        guard_per_sqrt_job=0.0,
        guard_tail=0.0,
        offset_per_job=False,
        min_clock_fraction=0.5,
        floor_fallback=False,
        held_at_limit=False,
        triage=False,
        pressure_floor=False,
        reanchor_tenants=False,
        interference=False,
        drain_pressure=0.0,
        work_from_time_limit=False,
        exploration_sigmas=0.0,
        new_job_power_share=1.0,
        new_job_power_quantile=1.0,
    )
    tuning = Tuning.from_config(config)
    return tuning if interval_s is None else tuning.with_interval(interval_s)
