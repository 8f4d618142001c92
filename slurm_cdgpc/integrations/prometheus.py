"""`Scraper`: a sidecar that reads a serving job's latency histogram from the server's own
Prometheus endpoint (vLLM's ``/metrics``) and reports for it, as `LatencyReporter` would from
the serving loop: ``cdgpc-progress --scrape URL``. Standard library, the progress client and
the ground floor only (`slurm_cdgpc.agent.progress`, `slurm_cdgpc.wire`, `slurm_cdgpc.errors`,
and `slurm_cdgpc.integrations.serving`'s switch): it runs inside the serving job.
`window_quantile` is Prometheus' ``histogram_quantile`` over the buckets' increase between two
scrapes. Design: DESIGN.md, "Progress"; tests: `tests/unit/test_integrations_prometheus.py`.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Final

from slurm_cdgpc.agent.progress import JOB_ID_ENV, send_line, socket_path
from slurm_cdgpc.errors import CdgpcError, InputError, one_line
from slurm_cdgpc.integrations.serving import MIN_LATENCY_S, reports
from slurm_cdgpc.wire.protocol import MAX_LATENCY_S, MAX_RATE, ProgressLine

logger = logging.getLogger(__name__)

#: vLLM's histogram of the time per output token (TPOT), the first name present read: its
#: older name, then the one that superseded it (vLLM's ``docs/design/metrics.md``; releases
#: in between export both, alike)
DEFAULT_METRICS: Final = ("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds")
FETCH_TIMEOUT_S: Final = 2.0
MAX_BODY_BYTES: Final = 8 << 20
_NAME: Final = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_NAME_END: Final = re.compile(r"[\s{]")  # a sample line's name ends there, however malformed
#: ``name{label="value",...} value [timestamp] [# exemplar]``: Prometheus' text format
_SAMPLE: Final = re.compile(
    r'(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)[ \t]*(?:\{(?P<labels>(?:[^"}]|"(?:[^"\\]|\\.)*")*)\})?'
    r"[ \t]+(?P<value>\S+)(?:[ \t]+-?[0-9]+(?:\.[0-9]*)?)?(?:[ \t]+#.*)?"
)
_LABEL: Final = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*')
_FLOAT: Final = re.compile(
    r"[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf|nan)", re.IGNORECASE
)


@dataclass(frozen=True)
class Histogram:
    """A histogram summed over its label sets: the cumulative ``counts`` of observations at most
    each of ``bounds`` (ascending, the last +Inf), their ``count`` and ``sum``."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    count: float
    sum: float


def parse_histogram(text: str, names: Sequence[str]) -> Histogram | None:
    """The first histogram of ``names`` present in ``text`` (Prometheus' text format), summed
    over its label sets but ``le``; None when none is. One declared (``# TYPE``) without samples
    yet, as a labelled histogram of prometheus_client is before its first observation, is empty:
    its +Inf bucket alone. Raises `InputError` naming the line when a line of that histogram is
    malformed (lines of other metrics are not read)."""
    series = {f"{name}{suffix}": name for name in names for suffix in ("_bucket", "_count", "_sum")}
    found: dict[str, list[tuple[int, str]]] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        words = line.split()
        if words[:2] == ["#", "TYPE"] and words[3:] == ["histogram"]:
            found.setdefault(words[2], [])
        elif name := series.get(_NAME_END.split(line, maxsplit=1)[0]):
            found.setdefault(name, []).append((number, line))
    name = next((name for name in names if name in found), None)
    return None if name is None else _histogram(name, found[name])


def window_quantile(before: Histogram | None, after: Histogram, q: float) -> float | None:
    """The ``q``-quantile (0 < q < 1) of the observations between the scrapes ``before`` and
    ``after``, as Prometheus' ``histogram_quantile`` gives it; None when there were none. When
    a count went back (the server restarted) or the buckets changed, ``after`` alone."""
    if not 0 < q < 1:
        raise InputError(f"q: must be in (0, 1), got {q!r}")
    return _quantile(_window(before, after), q)


class Scraper:
    """Scrapes ``url`` and sends the node agent, each `step` after the first, the count of the
    first histogram of ``names`` present (as the step: requests, or tokens, served; past a
    restart of the server the count goes on from the one before, as the head takes only a
    step that grew), the ``percentile`` of its observations since the last scrape
    (`window_quantile`) as ``latency_s`` and their number per second as ``rate``. Nothing is
    raised for an endpoint, a histogram or an agent that fails: the first failure of each kind
    is logged.

    Off, as `LatencyReporter` is, outside a Slurm job or with ``CDGPC_PROGRESS=off``. ``fetch``
    (the body at a URL; default: `http_get`) and ``clock`` (seconds, for `run`) are for tests.
    """

    def __init__(
        self,
        url: str,
        percentile: float = 99.0,
        *,
        names: Sequence[str] = DEFAULT_METRICS,
        job_id: str | None = None,
        path: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        fetch: Callable[[str], str] | None = None,
    ) -> None:
        if not 0 < percentile < 100:
            raise InputError(f"percentile: must be in (0, 100), got {percentile!r}")
        if not names or not all(_NAME.fullmatch(name) for name in names):
            raise InputError(f"names: must be Prometheus metric names, got {list(names)!r}")
        if not _is_http_url(url):
            raise InputError(f"url: must be an http:// or https:// URL, got {url!r}")
        env = os.environ if env is None else env
        self.url = url
        self.percentile = percentile
        self.names = tuple(names)
        self.job_id = env.get(JOB_ID_ENV, "") if job_id is None else job_id
        self.path = Path(path) if path is not None else socket_path(env)
        self.enabled = reports(self.job_id, env)
        self._clock = clock
        self._fetch = http_get if fetch is None else fetch
        self.served = 0.0  # the count, and past a restart of the server the count before it
        self._last: Histogram | None = None
        self._last_s = 0.0
        self._warned: set[str] = set()

    def step(self, now_s: float) -> ProgressLine | None:
        """Scrape at ``now_s`` (seconds of ``clock``): the line the agent took; None when off,
        at the first scrape (the baseline) and when the scrape or the agent failed."""
        if not self.enabled:
            return None
        try:
            text = self._fetch(self.url)
        except Exception as e:  # whatever the endpoint does: the next period
            self._warn("fetch", f"cannot scrape {self.url}: {one_line(e)}")
            return None
        try:
            after = parse_histogram(text, self.names)
            if after is None:
                raise InputError(f"no histogram {' or '.join(self.names)}")
        except InputError as e:
            self._warn("histogram", f"{self.url}: {e}")
            return None
        before, since_s = self._last, self._last_s
        self._last, self._last_s = after, now_s
        if before is None:
            self.served = after.count
            return None
        window = _window(before, after)
        self.served += window.count
        latency_s = _quantile(window, self.percentile / 100)
        if latency_s is not None:
            latency_s = min(max(latency_s, MIN_LATENCY_S), MAX_LATENCY_S)
        rate = min(window.count / (now_s - since_s), MAX_RATE) if now_s > since_s else None
        try:
            line = ProgressLine(self.job_id, int(self.served), None, latency_s, rate)
            answer = send_line(line, self.path)
        except (OSError, CdgpcError) as e:
            answer = one_line(e)
        else:
            if answer == "ok":
                return line
        self._warn("agent", f"reports to the node agent at {self.path} fail: {answer}")
        return None

    def run(self, every_s: float, stop: threading.Event) -> None:
        """`step` now and every ``every_s`` seconds until ``stop`` is set (at once when off)."""
        while self.enabled and not stop.is_set():
            self.step(self._clock())
            stop.wait(every_s)

    def _warn(self, kind: str, reason: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("cdgpc: %s (not logged again)", reason)


def http_get(url: str) -> str:
    """The body at ``url``, at most `MAX_BODY_BYTES`, within `FETCH_TIMEOUT_S` per read; no
    proxy (the server is the job's own). Raises `OSError` (`urllib.error.HTTPError` for a
    status that is not 2xx) when it cannot be read."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=FETCH_TIMEOUT_S) as response:
            body: bytes = response.read(MAX_BODY_BYTES + 1)
    except urllib.error.HTTPError as e:
        e.close()  # its body is not read
        raise
    if len(body) > MAX_BODY_BYTES:
        raise OSError(f"the body is longer than {MAX_BODY_BYTES >> 20} MiB")
    return body.decode("utf-8", "replace")


def _is_http_url(url: str) -> bool:
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # an unclosed IPv6 bracket
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _histogram(name: str, lines: list[tuple[int, str]]) -> Histogram:
    """``name``'s ``_bucket``, ``_count`` and ``_sum`` ``lines`` (number, text), summed."""
    if not lines:
        return Histogram((math.inf,), (0.0,), 0.0, 0.0)
    by_labels: dict[tuple[tuple[str, str], ...], dict[float, float]] = {}
    totals = {"_count": 0.0, "_sum": 0.0}
    seen: set[str] = set()
    for number, line in lines:
        match = _SAMPLE.fullmatch(line)
        if match is None:
            raise InputError(f"line {number}: cannot read {one_line(line, 80)!r}")
        labels = _labels(match["labels"] or "", number)
        value = _number(match["value"], number, "the value")
        suffix = match["name"].removeprefix(name)
        seen.add(suffix)
        if suffix != "_sum" and not 0 <= value < math.inf:
            raise InputError(f"line {number}: a count must be a number >= 0, got {value!r}")
        if suffix != "_bucket":
            totals[suffix] += value
            continue
        if "le" not in labels:
            raise InputError(f"line {number}: a bucket with no le label")
        bound = _number(labels.pop("le"), number, "le")
        buckets = by_labels.setdefault(tuple(sorted(labels.items())), {})
        if bound in buckets:
            raise InputError(f"line {number}: a second bucket le={bound!r}")
        buckets[bound] = value
    if missing := {"_bucket", "_count", "_sum"} - seen:
        raise InputError(f"{name}: no {name}{min(missing)} line")
    bounds = sorted(next(iter(by_labels.values())))
    if any(sorted(buckets) != bounds for buckets in by_labels.values()):
        raise InputError(f"{name}: its label sets have different buckets")
    if bounds[-1] != math.inf:
        raise InputError(f'{name}: no le="+Inf" bucket')
    counts = tuple(sum(buckets[bound] for buckets in by_labels.values()) for bound in bounds)
    if not _ascending(counts):
        raise InputError(f"{name}: its bucket counts are not cumulative")
    return Histogram(tuple(bounds), counts, totals["_count"], totals["_sum"])


def _labels(text: str, number: int) -> dict[str, str]:
    """``a="1",b="x\\"y",`` → {a: 1, b: x\\"y} (values as written: they only tell sets apart)."""
    labels: dict[str, str] = {}
    at = 0
    while at < len(text):
        match = _LABEL.match(text, at)
        if match is None or (match.end() < len(text) and text[match.end()] != ","):
            raise InputError(f"line {number}: cannot read the labels {one_line(text, 80)!r}")
        labels[match[1]] = match[2]
        at = match.end() + 1
    return labels


def _number(text: str, number: int, what: str) -> float:
    value = float(text) if _FLOAT.fullmatch(text) else math.nan
    if math.isnan(value):
        raise InputError(f"line {number}: {what} must be a number, got {one_line(text, 40)!r}")
    return value


def _window(before: Histogram | None, after: Histogram) -> Histogram:
    """``after − before``: the observations between them; ``after`` when a count went back."""
    if before is None or before.bounds != after.bounds:
        return after
    counts = tuple(a - b for a, b in zip(after.counts, before.counts, strict=True))
    if after.count < before.count or not _ascending((0.0, *counts)):
        return after  # a counter reset: the server restarted
    return Histogram(after.bounds, counts, after.count - before.count, after.sum - before.sum)


def _quantile(h: Histogram, q: float) -> float | None:
    """Prometheus' ``bucketQuantile``: rank r = q·n of the n observations, in the first bucket
    (lo, hi] whose cumulative count c_hi reaches it; lo + (hi − lo)·(r − c_lo)/(c_hi − c_lo),
    lo = 0 for the first bucket; the largest finite bound when r falls in the +Inf bucket."""
    n = h.counts[-1]
    if not n > 0 or len(h.bounds) < 2:
        return None
    rank = q * n
    b = bisect.bisect_left(h.counts, rank, hi=len(h.counts) - 1)
    if b == len(h.bounds) - 1:
        return h.bounds[-2]
    if b == 0 and h.bounds[0] <= 0:
        return h.bounds[0]
    lo, below = (h.bounds[b - 1], h.counts[b - 1]) if b > 0 else (0.0, 0.0)
    return lo + (h.bounds[b] - lo) * (rank - below) / (h.counts[b] - below)


def _ascending(values: Sequence[float]) -> bool:
    return all(a <= b for a, b in pairwise(values))
