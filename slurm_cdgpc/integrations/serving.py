"""`LatencyReporter`: an inference server run as a Slurm job tells the node agent its latency at
its objective's percentile and its request rate, so the head can give it the lowest clock that
keeps its objective. Standard library and the progress client only (`slurm_cdgpc.agent.progress`,
`slurm_cdgpc.wire`): it runs inside the serving job. Design: DESIGN.md, "Progress"; tests:
`tests/unit/test_integrations_serving.py`.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from slurm_cdgpc.agent.progress import JOB_ID_ENV, send_line, socket_path
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.wire.names import JOB_ID
from slurm_cdgpc.wire.protocol import MAX_LATENCY_S, MAX_RATE, ProgressLine

logger = logging.getLogger(__name__)

#: the hook's switch, read as `_cdgpc_progress_hook.job_id_of` reads it (a test keeps them equal)
SWITCH_ENV: Final = "CDGPC_PROGRESS"
OFF_VALUES: Final = ("off", "0", "false", "no")
#: the least latency sent: a percentile below the clock's resolution is not 0 s
MIN_LATENCY_S: Final = 1e-6
#: latencies kept per window (the first ones), bounding memory however fast requests come
MAX_WINDOW: Final = 100_000
_STARTING: Final = threading.Lock()


def reports(job_id: str, env: Mapping[str, str]) -> bool:
    """A job-side reporter is on: inside a Slurm job (``job_id``) and not ``CDGPC_PROGRESS=off``
    in ``env``."""
    return bool(JOB_ID.fullmatch(job_id)) and (
        env.get(SWITCH_ENV, "").strip().lower() not in OFF_VALUES
    )


class LatencyReporter:
    """Collects each request's latency (`observe`) and sends, every ``period_s`` from a daemon
    thread, the ``percentile`` (nearest rank) of the latencies observed since the last send as
    ``latency_s``, the requests served so far as the step and the requests per second over
    that window as ``rate`` (a window without requests: rate 0, no latency). The serving loop
    never waits on the agent and nothing is raised into it; a send the agent does not take is
    dropped (the first one logged). One process per job on a node reports: two would send two
    counts.

    Off, and `observe` does nothing, outside a Slurm job or with ``CDGPC_PROGRESS=off``. The
    thread starts at the first `observe` in a process (again in a forked child that observes).
    """

    def __init__(
        self,
        percentile: float = 99.0,
        *,
        period_s: float = 1.0,
        job_id: str | None = None,
        path: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if not 0 < percentile <= 100:
            raise InputError(f"percentile: must be in (0, 100], got {percentile!r}")
        if not period_s > 0:
            raise InputError(f"period_s: must be positive, got {period_s!r}")
        env = os.environ if env is None else env
        self.job_id = env.get(JOB_ID_ENV, "") if job_id is None else job_id
        self.percentile = percentile
        self.period_s = period_s
        self.path = Path(path) if path is not None else socket_path(env)
        self.enabled = reports(self.job_id, env)
        self.served = 0
        self._window: list[float] = []  # guarded by _lock, as served is
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid: int | None = None
        self._warned = False

    def observe(self, latency_s: float) -> None:
        """One request served in ``latency_s`` seconds (not a number >= 0: not counted)."""
        if not self.enabled:
            return
        try:
            if self._pid != os.getpid():
                self._start()
            if 0.0 <= latency_s < math.inf:
                with self._lock:
                    self.served += 1
                    if len(self._window) < MAX_WINDOW:
                        self._window.append(latency_s)
        except Exception:  # never into the serving loop
            pass

    def close(self) -> None:
        """Stop observing and sending (what was observed since the last send is not sent)."""
        self.enabled = False
        self._stop.set()
        if self._thread is not None and self._pid == os.getpid():
            self._thread.join()

    def _start(self) -> None:
        """This process's sending thread, with a fresh lock and window: in a forked child a
        thread of the parent may have held the old lock."""
        with _STARTING:
            if self._pid == os.getpid():
                return  # another thread of this process started it meanwhile
            self._lock = threading.Lock()
            self._window = []
            self._thread = threading.Thread(target=self._run, name="cdgpc-latency", daemon=True)
            self._thread.start()
            self._pid = os.getpid()

    def _run(self) -> None:
        since_s, before = time.monotonic(), self.served
        while not self._stop.wait(self.period_s):
            now_s = time.monotonic()
            with self._lock:
                window, self._window = self._window, []
                served = self.served
            try:
                self._send(served, window, (served - before) / (now_s - since_s))
            except Exception as e:  # an agent that is down or slow: the next window
                self._warn(str(e))
            since_s, before = now_s, served

    def _send(self, served: int, window: list[float], rate: float) -> None:
        latency_s = None
        if window:
            window.sort()
            rank = math.ceil(self.percentile / 100 * len(window))
            latency_s = min(max(window[rank - 1], MIN_LATENCY_S), MAX_LATENCY_S)
        line = ProgressLine(self.job_id, served, None, latency_s, min(rate, MAX_RATE))
        answer = send_line(line, self.path)
        if answer != "ok":
            self._warn(answer)

    def _warn(self, reason: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(
                "cdgpc: latency reports to the node agent at %s fail: %s", self.path, reason
            )
