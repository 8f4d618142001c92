"""The one parser of what a user asks in ``sbatch --comment``: a deadline, an iteration count and
a serving job's latency objective.

`parse_deadline` is the one deadline grammar (the simulator's traces and ``cdgpc-admin`` read
times with it too); ``daemon/job_submit.lua`` is its twin at submit time. Standard library and
`errors`/`units` only: the Prolog imports it (`tests/unit/test_import_graph.py`). Tests:
`tests/unit/test_slurm_comment.py`, `tests/security/test_fuzz.py`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from typing import Final

from slurm_cdgpc.errors import InputError, one_line
from slurm_cdgpc.units import latency_s, span_s

logger = logging.getLogger(__name__)

DEADLINE_KEY: Final = "deadline"
ITERS_KEY: Final = "iters"
SLO_KEY: Final = "slo"
DEADLINE_HINT: Final = "use 2026-12-01T12:00 or +6h"
MAX_ITERATIONS: Final = 2**53
#: 9999-12-31T23:59:59Z: the last second ISO 8601 dates (and the head's store) can hold
MAX_EPOCH_S: Final = 253_402_300_799
MAX_RELATIVE_S: Final = 3650 * 86400.0
#: the percentiles and latencies an ``slo=`` may ask, both ends included
MIN_SLO_PERCENTILE: Final = 50.0
MAX_SLO_PERCENTILE: Final = 99.99
MIN_SLO_LATENCY_S: Final = 1e-3
MAX_SLO_LATENCY_S: Final = 600.0

_SEPARATORS: Final = re.compile(r"[,\t\n\v\f\r ]+")
_EPOCH: Final = re.compile(r"[0-9]{1,12}")
_ISO: Final = re.compile(
    r"(?P<y>[0-9]{4})-(?P<mo>[0-9]{2})-(?P<d>[0-9]{2})"
    r"(?:T(?P<h>[0-9]{2}):(?P<mi>[0-9]{2})(?::(?P<s>[0-9]{2})(?:\.(?P<f>[0-9]{1,6}))?)?)?"
    r"(?P<zone>Z|[+-][0-9]{2}(?::?[0-9]{2})?)?"
)
_COUNT: Final = re.compile(r"[0-9]{1,16}")
_SLO: Final = re.compile(
    r"p(?P<p>[0-9]+(?:\.[0-9]+)?):(?P<n>[0-9]+(?:\.[0-9]+)?)(?P<unit>us|ms|s)",
    re.IGNORECASE | re.ASCII,
)
_CLIP_CHARS: Final = 43  # 40 and "...", as job_submit.lua shows them


@dataclass(frozen=True)
class DeadlineSpec:
    """A deadline as written: absolute (ISO or epoch) or relative to the submit time."""

    text: str
    absolute_s: float | None = None
    relative_s: float | None = None

    @property
    def is_relative(self) -> bool:
        return self.relative_s is not None

    def resolve(self, submit_s: float) -> float:
        """Seconds since the epoch; a relative deadline counts from ``submit_s``."""
        if self.relative_s is not None:
            return submit_s + self.relative_s
        return submit_s if self.absolute_s is None else self.absolute_s


@dataclass(frozen=True)
class LatencyObjective:
    """A serving job's objective: its ``percentile`` (99.0: p99) of request latencies stays
    within ``latency_s``. The controller gives such a job the lowest clock that keeps it."""

    percentile: float
    latency_s: float


@dataclass(frozen=True)
class CommentRequest:
    """What a job comment asks of cdgpc (all None: nothing; the rest of the text is ignored)."""

    deadline: DeadlineSpec | None = None
    iterations_total: int | None = None
    slo: LatencyObjective | None = None


@dataclass(frozen=True)
class Deadline:
    """The deadline in force and where it came from: comment, slurm-deadline or time-limit."""

    deadline_s: float
    source: str


def _clip(value: str) -> str:
    return one_line(value, _CLIP_CHARS, empty="")


def _bad_deadline(value: str) -> InputError:
    return InputError(f"cannot read deadline '{_clip(value)}': {DEADLINE_HINT}")


def parse_deadline(value: str, *, tz: tzinfo | None = None) -> DeadlineSpec:
    """One ``deadline=`` value; ``tz`` is the zone of an ISO time without one (default: local)."""
    seconds = span_s(value[1:]) if value.startswith("+") else None
    if seconds is not None:
        if seconds > MAX_RELATIVE_S:
            raise InputError(f"deadline '{_clip(value)}' is more than 3650 days away")
        return DeadlineSpec(value, relative_s=seconds)
    if _EPOCH.fullmatch(value):
        epoch_s = int(value)
        if epoch_s > MAX_EPOCH_S:
            raise _bad_deadline(value)
        return DeadlineSpec(value, absolute_s=float(epoch_s))
    iso = _ISO.fullmatch(value)
    if iso is None:
        raise _bad_deadline(value)
    try:
        moment = datetime(
            int(iso["y"]),
            int(iso["mo"]),
            int(iso["d"]),
            int(iso["h"] or 0),
            int(iso["mi"] or 0),
            int(iso["s"] or 0),
            int((iso["f"] or "0").ljust(6, "0")),
            tzinfo=_zone(iso["zone"]) or tz,
        )
        # no zone and no tz: datetime.timestamp() reads the naive time as local time
        return DeadlineSpec(value, absolute_s=moment.timestamp())
    except (ValueError, OverflowError):
        raise _bad_deadline(value) from None


def _zone(text: str | None) -> tzinfo | None:
    if text is None:
        return None
    if text == "Z":
        return UTC
    digits = text[1:].replace(":", "")
    hours, minutes = int(digits[:2]), int(digits[2:] or 0)
    if hours > 23 or minutes > 59:
        raise ValueError("zone offset out of range")
    offset = timedelta(hours=hours, minutes=minutes)
    return timezone(-offset if text[0] == "-" else offset)


def parse_iterations(value: str) -> int:
    if _COUNT.fullmatch(value) is None:
        raise InputError(f"cannot read iters '{_clip(value)}': use a whole number like iters=50000")
    count = int(value)
    if not 1 <= count <= MAX_ITERATIONS:
        raise InputError(f"iters must be between 1 and {MAX_ITERATIONS}, got {count}")
    return count


def parse_slo(value: str) -> LatencyObjective:
    """One ``slo=`` value, ``p99:250ms``: a percentile and a latency in us, ms or s."""
    slo = _SLO.fullmatch(value)
    if slo is None:
        raise InputError(f"cannot read slo '{_clip(value)}': use slo=p99:250ms")
    percentile = float(slo["p"])
    if not MIN_SLO_PERCENTILE <= percentile <= MAX_SLO_PERCENTILE:
        raise InputError(f"slo percentile must be between 50 and 99.99, got p{_clip(slo['p'])}")
    seconds = latency_s(slo["n"], slo["unit"])
    if not MIN_SLO_LATENCY_S <= seconds <= MAX_SLO_LATENCY_S:
        latency = _clip(slo["n"] + slo["unit"])
        raise InputError(f"slo latency must be between 1ms and 600s, got {latency}")
    return LatencyObjective(percentile, seconds)


def parse_comment(text: str | None, *, tz: tzinfo | None = None) -> CommentRequest:
    """The deadline, iteration count and latency objective in a job comment (None or empty:
    nothing asked).

    The grammar, the same in ``job_submit.lua`` (which refuses a malformed value at submit
    time)::

        comment  := token ((',' | ASCII whitespace)+ token)*
        token    := 'deadline=' deadline | 'iters=' count | 'slo=' slo
                  | anything else (left alone)
        deadline := ISO 8601   YYYY-MM-DD[THH:MM[:SS[.ffffff]]][Z | ±HH[[:]MM]]
                               (no zone: local time of the machine that parses, the head's zone)
                  | relative   '+' span (6h, 90m, 1h30m: `slurm_cdgpc.units`)  after submission
                  | epoch      digits                                 seconds since 1970 UTC
        count    := digits (1 .. 2**53)
        slo      := 'p' percentile ':' latency          a serving job's latency objective
                    percentile: decimal, 50 .. 99.99 (p50, p99, p99.9)
                    latency:    decimal ('us' | 'ms' | 's'), 1ms .. 600s (1500us, 250ms, 1.5s)
        decimal  := digits ['.' digits]

    Keys, units and the ``p`` are case-insensitive; other text and other ``key=value`` pairs are
    left alone, since sites use ``--comment`` for other things too. A key given twice, an empty
    or malformed value is an `InputError` with one line such as ``cannot read deadline
    'tomorow': use 2026-12-01T12:00 or +6h``. Nothing else is ever raised, whatever the text.
    """
    if not text:
        return CommentRequest()
    deadline: DeadlineSpec | None = None
    iterations: int | None = None
    slo: LatencyObjective | None = None
    for token in _SEPARATORS.split(text):
        key, sep, value = token.partition("=")
        if not sep or not key.isascii():
            continue
        key = key.lower()
        if key == DEADLINE_KEY:
            if deadline is not None:
                raise InputError("deadline= is given twice in the comment")
            deadline = parse_deadline(value, tz=tz)
        elif key == ITERS_KEY:
            if iterations is not None:
                raise InputError("iters= is given twice in the comment")
            iterations = parse_iterations(value)
        elif key == SLO_KEY:
            if slo is not None:
                raise InputError("slo= is given twice in the comment")
            slo = parse_slo(value)
    return CommentRequest(deadline, iterations, slo)


def effective_deadline(
    request: CommentRequest,
    *,
    submit_s: float,
    slurm_deadline_s: float | None = None,
    start_s: float | None = None,
    time_limit_s: float | None = None,
) -> Deadline | None:
    """The deadline in force: the comment's, else ``sbatch --deadline``, else start + time limit.

    ``slurm_deadline_s`` and ``time_limit_s`` are None (or ≤ 0) when not set (UNLIMITED).
    """
    if request.deadline is not None:
        return Deadline(request.deadline.resolve(submit_s), "comment")
    if slurm_deadline_s is not None and slurm_deadline_s > 0:
        return Deadline(float(slurm_deadline_s), "slurm-deadline")
    if time_limit_s is not None and time_limit_s > 0:
        begin_s = submit_s if start_s is None else start_s
        return Deadline(begin_s + time_limit_s, "time-limit")
    return None


def deadline_warnings(
    deadline_s: float, *, now_s: float, start_s: float | None = None, time_limit_s: float | None
) -> list[str]:
    """Why a deadline is odd but allowed: already past, or after the job would be killed."""
    warnings = []
    if deadline_s <= now_s:
        warnings.append("the deadline is in the past: the job runs at full speed")
    if time_limit_s is not None and time_limit_s > 0:
        end_s = (now_s if start_s is None else start_s) + time_limit_s
        if deadline_s > end_s:
            warnings.append("the deadline is after the time limit: Slurm ends the job first")
    return warnings
