"""Serving jobs in the simulator: one LLM server per GPU, its latency and power against load and
clock, calibrated on real data (`ServingReplay`).

A serving job holds one A100 for the whole replay, outside the queue, and has a latency
objective on its time per output token (TPOT) at the 99th percentile of its requests.

**Load** (`Arrivals`): the Azure LLM inference trace of 2023, code service
(``azure-llm-inference-2023/data/AzureLLMInferenceTrace_code.csv``: 8,819 requests over 3,436 s,
2.57 req/s, 27.9 generated tokens a request on average, 71.6 tok/s), replayed cyclically. Job k
of S starts k/S of the way into the trace and scales its rate by ``0.5 + k/(S − 1)`` (0.5 to
1.5; 1 for a single job), so that the jobs peak at different times and loads. Each interval is
cut into windows of about `WINDOW_S` (5 s: several mean request lifetimes, so that the tokens a
window's arrivals ask for are what the server produces in it); a window's load is its arrivals'
generated tokens per second, ρ.

**Latency against load** (`tpot_s`): ML.ENERGY leaderboard v2, code task, StarCoder2-7B on one
A100-SXM4-40GB (``data/llm_text_generation/code/A100-SXM4-40GB/bigcode/starcoder2-7b/
bs{32,...,512}+tp1+pp1.json``): at batch B the server produces ``Token tput`` tokens/s with
``Avg TPOT``; `_LEADERBOARD` holds the seven points from B = 31.7 (781 tok/s, 39.8 ms) to 503
(1,564 tok/s, 201.8 ms). The 768 batch serves no more (1,530 tok/s), so 1,564 tok/s is the
capacity. TPOT at a load is the table interpolated on throughput, from 24.3 ms at no load (the
first two points extended linearly in B to B = 0); past the capacity requests queue and the
latency grows in proportion, TPOT(cap) · ρ / cap. The 80 GB board of the simulated fleet is
taken to serve as the 40 GB one.

**Clock** (`_KNEE_FRACTION`): inference-dvfs-mertside, A100 (a PCIe 40 GB board: memory clock
1,215 MHz) LLaMA inference, ``edp_optimization_results.json``: 3,570 J in 41.75 s at 810 of
1,410 MHz, 37.07 % less energy and 1.76 % more time than at 1,410 MHz. Decode is memory-bound:
the time per token is flat in the clock down to a knee and scales as 1 / clock below it,
``T(f) = T_top · max(1, f_k / f)``, with f_k = 810 × 1.0176 = 824 MHz (0.585 of the top clock)
so that T(810) is the measured 1.76 % slower. Below the knee the server is also slower to
drain its load: at s = f_k / f it runs at batch B where tput(B) = s · ρ, and its TPOT is
s · TPOT(s · ρ).

**Power** (`power_w`): P = P_idle + u · (P_act(B) − P_idle) · (f / f_top)^α. P_act(B) is
``Energy/req`` × ``Token tput`` / ``Avg Output Tokens`` at each batch of the same files (196.5
to 214.1 W: a busy decode draws about half the board's limit whatever its batch), held at
its first point below B = 31.7; u = 1 − e^(−B) is the share of time at least one request is in
flight (B from Little's law, tput(B) = s · ρ); P_idle is the simulated board's (60 W). α = 1.29
from mertside's two clocks: 85.5 W at 810 MHz and 138.3 W at 1,410 MHz over that board's idle
35 W (the catalog's A100-PCIE-40GB), (85.5 − 35) / (138.3 − 35) = (810 / 1410)^α. A power limit
below P lowers the clock to the one that meets it (`ServingReplay.step`).

**The objective**: ``multiple`` × the job's TPOT at the top clock in its busiest window. The p99
of an interval is over its requests, each at its window's TPOT; an interval without requests
has none. Measurements carry the plant's noise (1 % power, 1.5 % latency).

Design: DESIGN.md, "Simulator" (Serving jobs); tests: `tests/unit/test_sim_serving.py`.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.gpu.catalog import GpuSpec, catalog_spec
from slurm_cdgpc.gpu.plant import NoiseModel
from slurm_cdgpc.sim.fleet import DEFAULT_GPUS_PER_NODE, FleetSpec, NodeGroup

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

#: the board serving jobs run on (the model is calibrated on the A100 alone)
SERVING_GPU: Final = "A100-SXM4-80GB"
#: the arrivals, under the third-party data directory ($CDGPC_DATA_DIR)
ARRIVALS_FILE: Final = "azure-llm-inference-2023/data/AzureLLMInferenceTrace_code.csv"
#: the objective: this multiple of the top-clock TPOT at the job's peak load, at this percentile
DEFAULT_MULTIPLE: Final = 1.5
PERCENTILE: Final = 0.99
WINDOW_S: Final = 5.0
#: job k of S scales the trace's rate by LOW + (HIGH − LOW) k / (S − 1)
LOAD_SCALES: Final = (0.5, 1.5)

# ML.ENERGY leaderboard v2 (Apache-2.0), code/A100-SXM4-40GB/bigcode/starcoder2-7b, tp1:
# Avg BS (reqs), Avg TPOT (s), Token tput (tok/s), Energy/req (J), Avg Output Tokens
_LEADERBOARD: Final = np.array(
    [
        [31.73, 0.03980, 781.0, 22.819, 90.70],
        [63.53, 0.05537, 1085.8, 17.086, 93.32],
        [127.11, 0.08164, 1394.5, 13.605, 90.50],
        [190.61, 0.10663, 1454.0, 13.217, 89.77],
        [253.94, 0.12906, 1496.6, 12.419, 89.05],
        [317.03, 0.14860, 1516.9, 12.297, 89.89],
        [502.97, 0.20181, 1564.1, 12.150, 90.24],
    ]
)
_B, _TPOT, _TPUT, _E_REQ, _OUT = _LEADERBOARD.T
# no load: TPOT extended linearly in B from the first two points to B = 0
_TPOT0 = _TPOT[0] - _B[0] * (_TPOT[1] - _TPOT[0]) / (_B[1] - _B[0])
_BATCH = np.concatenate([[0.0], _B])
_TPOT_AT = np.concatenate([[_TPOT0], _TPOT])
_TPUT_AT = np.concatenate([[0.0], _TPUT])
_ACTIVE_W = _E_REQ * _TPUT / _OUT  # P = E/req × req/s
_CAPACITY = float(_TPUT[-1])

# inference-dvfs-mertside (MIT), A100 "llama": 3,570 J in 41.75 s at 810 of 1,410 MHz, 37.07 %
# less energy and 1.76 % more time than at 1,410 MHz, on a board idling at 35 W
_MHZ, _TOP_MHZ, _E_J, _T_S, _SAVED, _SLOWER, _IDLE_W = 810, 1410, 3570.0, 41.75, 0.3707, 0.0176, 35
_KNEE_FRACTION: Final = _MHZ * (1 + _SLOWER) / _TOP_MHZ
_P_LOW_W, _P_TOP_W = _E_J / _T_S, _E_J / (1 - _SAVED) / (_T_S / (1 + _SLOWER))
_ALPHA: Final = math.log((_P_LOW_W - _IDLE_W) / (_P_TOP_W - _IDLE_W)) / math.log(_MHZ / _TOP_MHZ)


def slowdown(fraction: FloatArray) -> FloatArray:
    """s = max(1, f_k / f): how much slower a token is at the clock ``fraction`` of the top."""
    out: FloatArray = np.maximum(1.0, _KNEE_FRACTION / fraction)
    return out


def tpot_s(rate_tok_s: FloatArray, fraction: FloatArray) -> FloatArray:
    """Mean time per output token at a load of ``rate_tok_s`` and a clock ``fraction``."""
    s = slowdown(fraction)
    need = s * rate_tok_s  # the throughput at top clock that serves the load
    table = np.interp(need, _TPUT_AT, _TPOT_AT)
    queued = _TPOT_AT[-1] * need / _CAPACITY
    out: FloatArray = s * np.where(need > _CAPACITY, queued, table)
    return out


def _active(rate_tok_s: FloatArray, fraction: FloatArray) -> tuple[FloatArray, FloatArray]:
    """Busy share u and active power P_act at a load and clock."""
    batch = np.interp(slowdown(fraction) * rate_tok_s, _TPUT_AT, _BATCH)
    return 1.0 - np.exp(-batch), np.interp(batch, _B, _ACTIVE_W)


def power_w(rate_tok_s: FloatArray, fraction: FloatArray, idle_w: float) -> FloatArray:
    """Board power at a load and clock: P_idle + u (P_act − P_idle) f^α."""
    busy, active_w = _active(rate_tok_s, fraction)
    out: FloatArray = idle_w + busy * (active_w - idle_w) * fraction**_ALPHA
    return out


@dataclass(frozen=True)
class Arrivals:
    """Request arrivals (s from the first) and their generated tokens, in time order."""

    time_s: FloatArray
    tokens: FloatArray

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Arrivals:
        """The Azure LLM inference trace's CSV: ``TIMESTAMP, ContextTokens, GeneratedTokens``."""
        try:
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
            stamps = np.array([r["TIMESTAMP"] for r in rows], dtype="datetime64[ns]")
            tokens = np.array([float(r["GeneratedTokens"]) for r in rows])
        except (OSError, KeyError, ValueError) as e:
            raise InputError(f"{path}: not the Azure LLM inference trace's CSV ({e})") from None
        if stamps.size < 2:
            raise InputError(f"{path}: fewer than two requests")
        order = np.argsort(stamps, kind="stable")
        time_s = (stamps[order] - stamps[order][0]) / np.timedelta64(1, "s")
        return cls(time_s.astype(np.float64), tokens[order])

    @staticmethod
    def path(path: str | None = None) -> str:
        """``path``, else `ARRIVALS_FILE` under $CDGPC_DATA_DIR."""
        if path is not None:
            return path
        root = os.environ.get("CDGPC_DATA_DIR")
        if root is None:
            raise InputError(
                "serving jobs need the Azure LLM inference trace: give --serving-arrivals FILE "
                f"or set CDGPC_DATA_DIR (it reads $CDGPC_DATA_DIR/{ARRIVALS_FILE})"
            )
        return str(Path(root) / ARRIVALS_FILE)


@dataclass(frozen=True)
class Serving:
    """``jobs`` serving jobs, each with an objective of ``multiple`` × its top-clock TPOT at
    peak load, loaded from ``arrivals``."""

    jobs: int
    multiple: float
    arrivals: Arrivals

    def __post_init__(self) -> None:
        if self.jobs < 1 or not 1.0 <= self.multiple < math.inf:
            raise InputError("serving needs at least one job and an objective multiple ≥ 1")

    @staticmethod
    def parse(text: str) -> tuple[int, float]:
        """``N[:MULTIPLE]`` → (N, multiple): N ≥ 1 jobs, a multiple ≥ 1."""
        count, _, multiple = text.partition(":")
        try:
            jobs = int(count)
            factor = float(multiple) if multiple else DEFAULT_MULTIPLE
        except ValueError:
            jobs, factor = 0, math.nan
        if jobs < 1 or not 1.0 <= factor < math.inf:
            raise InputError(
                f"--serving {text!r}: use N[:MULTIPLE], N ≥ 1 serving jobs whose p99 objective "
                f"is MULTIPLE ≥ 1 × their top-clock latency at peak load (default "
                f"{DEFAULT_MULTIPLE})"
            )
        return jobs, factor

    def fleet(self, fleet: FleetSpec) -> FleetSpec:
        """``fleet`` with ⌈jobs / 8⌉ nodes of 8 `SERVING_GPU` after its own: the serving jobs
        take the last ``jobs`` GPUs (`Simulator`), beside the training pool."""
        nodes = -(-self.jobs // DEFAULT_GPUS_PER_NODE)
        group = NodeGroup(nodes, DEFAULT_GPUS_PER_NODE, catalog_spec(SERVING_GPU))
        return replace(fleet, groups=(*fleet.groups, group))


@dataclass(frozen=True)
class ServingState:
    """One interval of the serving jobs, (S,) each: the clock they ran at, their mean power,
    their true p99 TPOT (NaN: no request) and whether a power limit held the clock down."""

    applied_mhz: FloatArray
    power_w: FloatArray
    latency_s: FloatArray
    power_capped: BoolArray


class ServingReplay:
    """The serving jobs of one replay: their load per window (S, windows of one cycle of the
    trace), objectives, and what each interval at given clocks and limits gives."""

    def __init__(self, serving: Serving, spec: GpuSpec, interval_s: float) -> None:
        if spec.name != SERVING_GPU:
            raise InputError(f"serving jobs run on {SERVING_GPU}, the board the model fits")
        arrivals = serving.arrivals
        self.jobs = serving.jobs
        self.idle_w = spec.idle_power_w
        self.top_mhz = float(spec.max_graphics_mhz)
        self.memory_mhz = float(spec.max_memory_mhz)
        self.default_w = spec.power_limit.default_w
        self.per_interval = max(1, round(interval_s / WINDOW_S))
        self.window_s = interval_s / self.per_interval
        windows = max(1, math.ceil(arrivals.time_s[-1] / self.window_s))
        slot = np.minimum((arrivals.time_s // self.window_s).astype(np.int64), windows - 1)
        tokens = np.bincount(slot, weights=arrivals.tokens, minlength=windows)
        requests = np.bincount(slot, minlength=windows).astype(np.float64)
        low, high = LOAD_SCALES
        k = np.arange(self.jobs)
        scale = low + (high - low) * k / (self.jobs - 1) if self.jobs > 1 else np.ones(1)
        #: (S, windows): the window each job is at when the replay starts is its offset
        shift = (k * windows) // self.jobs
        rows = (np.arange(windows)[None, :] + shift[:, None]) % windows
        self.rate_tok_s = scale[:, None] * tokens[rows] / self.window_s
        self.requests = requests[rows]
        peak = tpot_s(self.rate_tok_s.max(axis=1), np.ones(self.jobs))
        self.objective_s: FloatArray = serving.multiple * peak
        self.noise = NoiseModel()

    def _windows(self, interval: int) -> tuple[FloatArray, FloatArray]:
        """Load and requests (S, windows of the interval) of interval number ``interval``."""
        cols = (interval * self.per_interval + np.arange(self.per_interval)) % (
            self.rate_tok_s.shape[1]
        )
        return self.rate_tok_s[:, cols], self.requests[:, cols]

    def step(self, interval: int, clock_mhz: FloatArray, limit_w: FloatArray) -> ServingState:
        """Interval number ``interval`` at the clocks and per-GPU power limits set (NaN: top
        clock, default limit). A limit below the power at the clock set lowers the clock in
        each window to the one that meets it (u and P_act of the clock set)."""
        rate, requests = self._windows(interval)
        top = self.top_mhz
        clock = np.where(np.isfinite(clock_mhz), np.minimum(clock_mhz, top), top)[:, None]
        limit = np.where(np.isfinite(limit_w), limit_w, self.default_w)[:, None]
        x = np.broadcast_to(clock / top, rate.shape)
        busy, active_w = _active(rate, x)
        dynamic = busy * (active_w - self.idle_w)
        with np.errstate(divide="ignore", invalid="ignore"):
            room = np.clip((limit - self.idle_w) / dynamic, 0.0, None)
            x_cap = np.where(dynamic > 0, room ** (1.0 / _ALPHA), np.inf)
        capped = np.asarray(np.any(x_cap < x, axis=1), dtype=np.bool_)
        x = np.maximum(np.minimum(x, x_cap), 1e-3)
        latency = tpot_s(rate, x)
        return ServingState(
            applied_mhz=top * x.mean(axis=1),
            power_w=power_w(rate, x, self.idle_w).mean(axis=1),
            latency_s=_weighted_quantile(latency, requests, PERCENTILE),
            power_capped=capped,
        )

    def observe(self, state: ServingState, rng: np.random.Generator) -> ServingState:
        """``state`` as the job and its node report it, with the plant's noise."""
        z = rng.standard_normal((2, self.jobs))
        return replace(
            state,
            power_w=state.power_w * (1.0 + self.noise.power_rel * z[0]),
            latency_s=state.latency_s * (1.0 + self.noise.time_rel * z[1]),
        )


def _weighted_quantile(values: FloatArray, weights: FloatArray, q: float) -> FloatArray:
    """Per row, the smallest value whose weight at or below it is at least q of the row's
    (NaN for a row of zero weight)."""
    order = np.argsort(values, axis=1)
    ordered = np.take_along_axis(values, order, axis=1)
    cum = np.cumsum(np.take_along_axis(weights, order, axis=1), axis=1)
    total = cum[:, -1]
    first = np.argmax(cum >= q * total[:, None] - 1e-9, axis=1)
    picked = ordered[np.arange(values.shape[0]), first]
    out: FloatArray = np.where(total > 0, picked, np.nan)
    return out
