"""What each simulated job tells the head: its progress source and its Slurm time limit.

Both are drawn once per (trace job, seed), so every policy replays the same jobs. The realistic
mix and the limit model are assumptions: DESIGN.md, "Progress"; tests:
`tests/unit/test_sim_cluster.py`, `tests/unit/test_sim_traces.py`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from slurm_cdgpc.errors import InputError

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: progress sources, in the order their shares are written and drawn: ``reported`` (steps and
#: total: ``iters=N`` in the comment, or a framework callback that reports its total);
#: ``steps`` (the automatic PyTorch hook: optimizer steps, so the iteration time is measured, but
#: no total); ``time-limit`` (nothing reported, only Slurm's time limit known: a non-Python job,
#: or the hook off); ``none`` (nothing reported and no time limit: an UNLIMITED partition)
SOURCES: Final = ("reported", "steps", "time-limit", "none")
REPORTED, STEPS, TIME_LIMIT, NONE = range(len(SOURCES))
#: shares must sum to 1 within this
_SUM_TOLERANCE: Final = 1e-6
_UNIFORM: Final = re.compile(r"uniform:([^:]+):([^:]+)")


@dataclass(frozen=True)
class ProgressMix:
    """Shares of jobs per progress source (`SOURCES` order), summing to 1."""

    shares: tuple[float, float, float, float] = (1.0, 0.0, 0.0, 0.0)

    @classmethod
    def parse(cls, text: str) -> ProgressMix:
        """``reported=0.2,steps=0.6,time-limit=0.2,none=0`` (absent sources: 0) or a preset
        name (``realistic``, ``all-reported``)."""
        name = text.strip()
        if name in PRESETS:
            return PRESETS[name]
        shares = dict.fromkeys(SOURCES, 0.0)
        seen: set[str] = set()
        for item in name.split(","):
            key, sep, value = item.strip().partition("=")
            key = key.strip()
            if not sep or key not in shares:
                raise InputError(
                    f"progress mix item {item.strip()!r}: use SOURCE=SHARE with SOURCE one of "
                    f"{', '.join(SOURCES)}, or a preset ({', '.join(PRESETS)})"
                )
            if key in seen:
                raise InputError(f"progress mix {text!r}: {key} is given twice")
            seen.add(key)
            try:
                share = float(value)
            except ValueError:
                raise InputError(f"progress mix {key}={value.strip()!r}: not a number") from None
            if not 0.0 <= share <= 1.0:
                raise InputError(f"progress mix {key}={value.strip()}: not in [0, 1]")
            shares[key] = share
        total = sum(shares.values())
        if abs(total - 1.0) > _SUM_TOLERANCE:
            raise InputError(f"progress mix {text!r}: the shares sum to {total:g}, not 1")
        r, s, t, n = (shares[k] for k in SOURCES)
        return cls((r, s, t, n))

    @classmethod
    def of_share(cls, share: float) -> ProgressMix:
        """``--progress-share P``: reported P, time-limit 1 − P."""
        if not 0.0 <= share <= 1.0:
            raise InputError(f"the progress share must be in [0, 1], got {share}")
        return cls((share, 0.0, 1.0 - share, 0.0))

    @property
    def share(self) -> float | None:
        """P when this is ``--progress-share P`` (reported and time-limit only), else None."""
        r, s, _, n = self.shares
        return r if s == 0.0 and n == 0.0 else None

    def __str__(self) -> str:
        """What `parse` reads back: the sources with a share, in `SOURCES` order."""
        return ",".join(f"{k}={v!r}" for k, v in zip(SOURCES, self.shares, strict=True) if v)

    def draw(self, n: int, seed: int) -> IntArray:
        """Per job, its source (an index into `SOURCES`); the draw of ``--progress-share``
        before sources existed (u < P reports), so old replays read the same."""
        u = np.random.default_rng([seed, 2]).random(n)
        edges = np.cumsum(self.shares)[:-1]
        return np.searchsorted(edges, u, side="right").astype(np.int64)


#: an assumption (DESIGN.md, "Progress"): PyTorch ≈ 0.8 of jobs, a quarter of them say their
#: total; every partition sets a limit
REALISTIC: Final = ProgressMix((0.2, 0.6, 0.2, 0.0))
PRESETS: Final = {"all-reported": ProgressMix(), "realistic": REALISTIC}


@dataclass(frozen=True)
class TimeLimitModel:
    """L = U(low, high) × run time at top clocks, rounded up to whole minutes (at least one);
    ``none`` (low = high = ∞): no job has a limit, and none is killed (replays made before the
    simulator modelled limits)."""

    low: float = 1.5
    high: float = 3.0

    @classmethod
    def parse(cls, text: str) -> TimeLimitModel:
        """``uniform:1.5:3`` or ``none``."""
        if text.strip() == "none":
            return cls(math.inf, math.inf)
        match = _UNIFORM.fullmatch(text.strip())
        if match is None:
            raise InputError(
                f"time-limit model {text!r}: use uniform:LOW:HIGH (e.g. uniform:1.5:3) or none"
            )
        try:
            low, high = float(match[1]), float(match[2])
        except ValueError:
            raise InputError(f"time-limit model {text!r}: LOW and HIGH must be numbers") from None
        if not (0.0 < low <= high and math.isfinite(high)):
            raise InputError(f"time-limit model {text!r}: needs 0 < LOW <= HIGH")
        return cls(low, high)

    def __str__(self) -> str:
        return "none" if math.isinf(self.low) else f"uniform:{self.low:g}:{self.high:g}"

    def draw(self, run_top_s: FloatArray, seed: int) -> FloatArray:
        """Per job, its time limit in seconds (NaN: none)."""
        if math.isinf(self.low):
            return np.full(run_top_s.shape, np.nan)
        factor = np.random.default_rng([seed, 3]).uniform(self.low, self.high, run_top_s.shape)
        minutes = np.maximum(np.ceil(factor * run_top_s / 60.0 - 1e-9), 1.0)
        limit_s: FloatArray = 60.0 * minutes
        return limit_s


DEFAULT_TIME_LIMITS: Final = TimeLimitModel()
