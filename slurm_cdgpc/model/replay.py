"""Replay a measured clock or power-limit sweep through the online estimator (``model replay``).

The controller's math: never reaches `store/`, `transport/`, `agent/`, `coordinator/` or `cli/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Models" (the power family); test:
`tests/unit/test_model_replay.py`.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.gpu.catalog import GpuSpec, catalog_spec
from slurm_cdgpc.model.estimator import EstimatorSettings, JobEstimator, JobStatics
from slurm_cdgpc.model.families import FloatArray

FORMATS = ("perseus", "zeus")


@dataclass(frozen=True)
class Sweep:
    """Series padded to a common length: knob (descending), power and time; NaN = no point."""

    names: list[str]
    knob: FloatArray  # (S, M)
    power_w: FloatArray  # (S, M)
    time_s: FloatArray  # (S, M)

    @property
    def points(self) -> int:
        return int(np.isfinite(self.knob).sum())


@dataclass(frozen=True)
class ReplayResult:
    model_family: str
    gpu: str
    series: int
    points: int
    scored_points: int
    power_mape_pct: float
    time_mape_pct: float

    def as_dict(self) -> dict[str, object]:
        return {
            "model_family": self.model_family,
            "gpu": self.gpu,
            "series": self.series,
            "points": self.points,
            "scored_points": self.scored_points,
            "power_mape_pct": round(self.power_mape_pct, 4),
            "time_mape_pct": round(self.time_mape_pct, 4),
        }


def detect_format(header: list[str]) -> str:
    cols = set(header)
    if {"stage", "instruction", "frequency", "time", "energy"} <= cols:
        return "perseus"
    if {"power_limit", "time_per_epoch", "average_power"} <= cols:
        return "zeus"
    raise InputError(f"unknown sweep format (columns: {', '.join(header)})")


def load_sweep(path: Path, fmt: str | None = None) -> tuple[Sweep, str]:
    """Read a sweep CSV; returns the padded series and the format name.

    - ``perseus``: columns stage, instruction, frequency (locked SM clock, MHz), time (s per
      micro-batch instruction), energy (J); power = energy / time. A series is one stage and
      instruction.
    - ``zeus``: columns dataset, network, batch_size, optimizer, power_limit (W), time_per_epoch
      (s), average_power (W); a series is one training configuration. The knob is the power
      limit, normalised by the series' highest limit, in place of the clock.
    """
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            fmt = fmt or detect_format(list(reader.fieldnames or []))
            if fmt not in FORMATS:
                raise InputError(f"unknown sweep format {fmt!r} (known: {', '.join(FORMATS)})")
            groups: dict[str, list[tuple[float, float, float]]] = {}
            for line, row in enumerate(reader, start=2):
                key, point = _parse_row(fmt, row, path, line)
                groups.setdefault(key, []).append(point)
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise InputError(f"{path.name}: not a UTF-8 text file") from e
    if not groups:
        raise InputError(f"{path.name}: no data rows")
    width = max(len(pts) for pts in groups.values())
    shape = (len(groups), width)
    knob, power, time = np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan)
    for s, pts in enumerate(groups.values()):
        pts.sort(key=lambda p: -p[0])  # descending knob: from the top, as a controller starts
        arr = np.array(pts)
        knob[s, : len(pts)], power[s, : len(pts)], time[s, : len(pts)] = arr.T
    return Sweep(list(groups), knob, power, time), fmt


def _parse_row(
    fmt: str, row: dict[str, str], path: Path, line: int
) -> tuple[str, tuple[float, float, float]]:
    def num(col: str) -> float:
        raw = row.get(col)
        try:
            value = float(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise InputError(
                f"{path.name}:{line}: column {col!r}: cannot read {raw!r} as a number"
            ) from None
        if not np.isfinite(value) or value <= 0:
            raise InputError(f"{path.name}:{line}: column {col!r}: {raw!r} must be positive")
        return value

    if fmt == "perseus":
        t = num("time")
        return f"stage{row['stage']}/{row['instruction']}", (num("frequency"), num("energy") / t, t)
    key = "/".join(row[c] for c in ("dataset", "network", "batch_size", "optimizer"))
    return key, (num("power_limit"), num("average_power"), num("time_per_epoch"))


def gpu_for(path: Path) -> GpuSpec:
    """Guess the GPU type from a sweep file name (``bloom+a100_sxm_bf16.csv``, ``…_v100.csv``)."""
    name = path.stem.lower()
    for token, spec_name in (
        ("a100", "A100-SXM4-80GB"),
        ("a40", "A40"),
        ("v100", "V100-PCIE-32GB"),  # the Zeus V100 sweeps ran on a 250 W PCIe card
        ("h100", "H100-SXM"),
        ("h200", "H200"),
    ):
        if token in name:
            return catalog_spec(spec_name)
    raise InputError(f"cannot tell the GPU type from {path.name}: pass --gpu")


def replay(
    sweep: Sweep,
    spec: GpuSpec,
    fmt: str,
    settings: EstimatorSettings | None = None,
    skip: int = 3,
) -> ReplayResult:
    """Predict each point before learning it; MAPE over the points after the first ``skip``.

    Each series becomes one job of a `JobEstimator`; all series step together, points in
    descending knob order from the top, as a controller walking a job down from its top clock
    would see them. The score is the mean absolute percentage error of those predictions.
    """
    est = JobEstimator(settings)
    s_count, width = sweep.knob.shape
    one = np.ones(s_count)
    if fmt == "perseus":
        top = np.full(s_count, float(spec.clocks.graphics_for()[0]))
        knee = np.full(s_count, float(spec.knee_mhz))
    else:  # the knob is the power limit: normalise by each series' top limit, no knee
        top = sweep.knob[:, 0].copy()
        knee = top.copy()
    est.add_jobs(
        JobStatics(
            gpus=np.ones(s_count, dtype=np.int64),
            graphics_max_mhz=top,
            memory_max_mhz=one,
            knee_mhz=knee,
            mem_mask=np.zeros(s_count),
            idle_power_w=np.full(s_count, spec.idle_power_w),
            power_limit_w=np.full(s_count, spec.power_limit.default_w),
        )
    )
    p_err: list[FloatArray] = []
    t_err: list[FloatArray] = []
    for k in range(width):
        have = np.isfinite(sweep.knob[:, k])
        x = np.where(have, sweep.knob[:, k], top) / top
        p_hat = est.predict_power_w(x, one)
        t_hat = est.predict_iteration_s(x, one)
        if k >= skip:
            p_err.append(np.abs(p_hat - sweep.power_w[:, k])[have] / sweep.power_w[have, k])
            t_err.append(np.abs(t_hat - sweep.time_s[:, k])[have] / sweep.time_s[have, k])
        est.observe(x, one, sweep.power_w[:, k], sweep.time_s[:, k], mask=have)
    pe = np.concatenate(p_err) if p_err else np.zeros(0)
    te = np.concatenate(t_err) if t_err else np.zeros(0)
    return ReplayResult(
        model_family=est.family.name,
        gpu=spec.name,
        series=s_count,
        points=sweep.points,
        scored_points=int(pe.size),
        power_mape_pct=100.0 * float(pe.mean()) if pe.size else float("nan"),
        time_mape_pct=100.0 * float(te.mean()) if te.size else float("nan"),
    )
