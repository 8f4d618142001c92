"""``simulate --report DIR``: the metrics as JSON, three PNG plots and a Markdown summary.

matplotlib is imported only here, lazily (the ``report`` extra), with the Agg backend. Test:
`tests/unit/test_sim_cluster.py`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.sim.metrics import PolicyRun, slowdown

logger = logging.getLogger(__name__)

_SUMMARY_COLUMNS = (
    ("violations", "violations"),
    ("violations_induced", "induced"),
    ("power_mae_pct", "MAE %"),
    ("over_budget_intervals_pct", "over %"),
    ("max_overshoot_pct", "max over %"),
    ("energy_kwh", "energy kWh"),
    ("mean_jct_s", "mean JCT s"),
    ("controller_ms_p50", "ctl ms"),
)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def write_report(
    directory: str | Path, runs: Mapping[str, PolicyRun], meta: Mapping[str, Any]
) -> list[Path]:
    """Write metrics.json, power.png, deadlines.png, slowdown_cdf.png and summary.md."""
    try:
        import matplotlib  # noqa: PLC0415 (optional: the ``report`` extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise InputError("--report needs matplotlib: pip install 'slurm-cdgpc[report]'") from None
    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot create report directory {out}: {e.strerror}") from e
    written = []
    payload = {"meta": dict(meta), "policies": {k: r.metrics.as_dict() for k, r in runs.items()}}
    path = out / "metrics.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    written.append(path)

    fig, ax = plt.subplots(figsize=(10, 4))
    for name, run in runs.items():
        r = run.result
        ax.plot((r.t_s - r.t_s[0]) / 3600.0, r.power_w / 1e3, lw=0.6, label=name)
    first = next(iter(runs.values())).result
    ax.axhline(first.budget_w / 1e3, color="k", ls="--", lw=1, label="budget")
    ax.set(xlabel="hours since first interval", ylabel="cluster power (kW)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    written.append(_save(fig, out / "power.png", plt))

    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(runs)
    pos = np.arange(len(names))
    ax.bar(pos - 0.2, [runs[n].metrics.violations for n in names], 0.4, label="violations")
    ax.bar(
        pos + 0.2,
        [runs[n].metrics.violations_induced or 0 for n in names],
        0.4,
        label="induced (vs max-clock)",
    )
    ax.set_xticks(pos, names, rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="deadline jobs")
    ax.legend()
    fig.tight_layout()
    written.append(_save(fig, out / "deadlines.png", plt))

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, run in runs.items():
        s = np.sort(slowdown(run.result))
        if s.size:
            ax.plot(s, np.arange(1, s.size + 1) / s.size, label=name)
    ax.set(xscale="log", xlabel="slowdown (JCT / duration at max clocks)", ylabel="CDF")
    ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(_save(fig, out / "slowdown_cdf.png", plt))

    lines = [
        "# Simulation summary",
        "",
        *(f"- {k}: {v}" for k, v in meta.items()),
        "",
        "| policy | " + " | ".join(h for _, h in _SUMMARY_COLUMNS) + " |",
        "|---|" + "---:|" * len(_SUMMARY_COLUMNS),
    ]
    for name, run in runs.items():
        d = run.metrics.as_dict()
        lines.append(f"| {name} | " + " | ".join(_cell(d[k]) for k, _ in _SUMMARY_COLUMNS) + " |")
    lines += [
        "",
        "Plots: power.png (cluster power vs budget), deadlines.png (deadline outcomes),",
        "slowdown_cdf.png (CDF of job slowdown). Definitions: slurm_cdgpc/sim/metrics.py.",
    ]
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    written.append(path)
    return written


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
