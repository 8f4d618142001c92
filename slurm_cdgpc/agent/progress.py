"""Training and serving progress over a local Unix socket: `ProgressServer` in the agent, and
the ``cdgpc-progress`` client with `report_progress` (a serving job's latency and request rate
ride on the same line: `ProgressLine`; ``--scrape`` reads them from the server's Prometheus
endpoint with `slurm_cdgpc.integrations.prometheus`). The client reaches only the standard
library and the ground floor (`slurm_cdgpc.errors`, `slurm_cdgpc.wire`, `slurm_cdgpc.units`),
and the scraper these and the client, because they run inside jobs, and it never fails a job.
Tests: `tests/unit/test_agent_progress.py`, `tests/unit/test_integrations_prometheus.py`,
`tests/security/test_progress_spoofing.py`; design: DESIGN.md, "Progress" and "Safety".
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final, Protocol

from slurm_cdgpc.errors import CdgpcError, FatalError, InputError
from slurm_cdgpc.units import latency_s, parse_duration_s
from slurm_cdgpc.wire.protocol import MAX_PROGRESS_LINE_BYTES, ProgressLine, ProtocolError

logger = logging.getLogger(__name__)

DEFAULT_SOCKET: Final = Path("/run/cdgpc/progress.sock")
SOCKET_ENV: Final = "CDGPC_NODE_PROGRESS_SOCKET"
JOB_ID_ENV: Final = "SLURM_JOB_ID"
CLIENT_TIMEOUT_S: Final = 1.0
_PEERCRED: Final = struct.Struct("3i")  # struct ucred: pid, uid, gid
_LATENCY: Final = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(us|ms|s)?")


class Recorder(Protocol):
    """``record(job_id, step, total, uid)``, and a serving job's ``latency_s`` and ``rate`` as
    keywords only when its line has them, so a recorder of training progress takes the four;
    raises `CdgpcError` to refuse."""

    def __call__(
        self,
        job_id: str,
        step: int,
        total: int | None,
        uid: int,
        /,
        *,
        latency_s: float | None = None,
        rate: float | None = None,
    ) -> None: ...


# -- client ------------------------------------------------------------------------------------


def socket_path(env: Mapping[str, str] | None = None) -> Path:
    """``$CDGPC_NODE_PROGRESS_SOCKET``, else `DEFAULT_SOCKET` (the ``node.progress_socket``
    default: the client does not read the config file)."""
    env = os.environ if env is None else env
    return Path(env.get(SOCKET_ENV) or DEFAULT_SOCKET)


def report_progress(
    step: int,
    total: int | None = None,
    *,
    job_id: str | None = None,
    path: str | os.PathLike[str] | None = None,
    timeout_s: float = CLIENT_TIMEOUT_S,
    latency_s: float | None = None,
    rate: float | None = None,
) -> bool:
    """Report ``step`` (of ``total``) for ``job_id`` (default ``$SLURM_JOB_ID``), as in
    ``report_progress(500, total=10_000)``. PyTorch jobs need not: the TaskProlog's hook
    (`slurm_cdgpc/hook`) sends their optimizer steps. A serving job reports the requests served
    so far as ``step``, with ``latency_s`` (at its objective's percentile) and ``rate``
    (requests per second) over the window since its last report; `LatencyReporter`
    (`slurm_cdgpc.integrations.serving`) does it from the serving loop.

    Returns True when the agent recorded it; False, with a warning, when the socket is missing,
    the connection is refused or slow, or the agent refused the report. Raises `ProtocolError`
    for a missing/bad job id or bad numbers.
    """
    job = os.environ.get(JOB_ID_ENV) if job_id is None else job_id
    if not job:
        raise ProtocolError(f"{JOB_ID_ENV} is not set (run this inside a Slurm job)")
    line = ProgressLine(job, step, total, latency_s, rate)  # validates: ProtocolError
    where = Path(path) if path is not None else socket_path()
    try:
        answer = send_line(line, where, timeout_s)
    except FileNotFoundError:
        logger.warning("cdgpc-progress: no node agent socket at %s; progress not reported", where)
        return False
    except OSError as e:
        logger.warning("cdgpc-progress: cannot reach the node agent at %s: %s", where, e)
        return False
    if answer != "ok":
        logger.warning("cdgpc-progress: the node agent refused the report: %s", answer[:200])
        return False
    return True


def send_line(line: ProgressLine, path: Path, timeout_s: float = CLIENT_TIMEOUT_S) -> str:
    """Send ``line`` to the agent listening at ``path``; its one-line answer, ``ok`` or
    ``error: <reason>``. Raises `OSError` when the agent cannot be reached within ``timeout_s``
    in all (`FileNotFoundError`: no socket)."""
    until_s = time.monotonic() + timeout_s
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(os.fspath(path))
        sock.sendall(line.to_json() + b"\n")
        sock.shutdown(socket.SHUT_WR)
        return _read_line(sock, 1024, until_s).decode("ascii", "replace").strip()


def socket_reporter(path: Path) -> Callable[..., bool]:
    """``report(job_id, step, total[, latency_s=])`` to the agent listening at ``path``: how
    the simulated jobs of `slurm_cdgpc.gpu.workloads` report, as a training or serving job
    would."""

    def report(
        job_id: str, step: int, total: int | None, /, *, latency_s: float | None = None
    ) -> bool:
        if not path.exists():
            return False  # the agent is starting or stopping: report at the next poll
        return report_progress(step, total, job_id=job_id, path=path, latency_s=latency_s)

    return report


def main(argv: Sequence[str] | None = None) -> int:
    """``cdgpc-progress STEP [TOTAL] [--latency DURATION] [--rate FLOAT]``: report progress of
    ``$SLURM_JOB_ID`` to the node agent (a serving job: requests served, latency and rate).
    ``cdgpc-progress --scrape URL``: report them for a serving job from its server's
    Prometheus endpoint every ``--every`` until SIGTERM or SIGINT (`Scraper`).

    Exit status 0 whatever the agent does (a warning on stderr when it is down or refuses), and
    when scraping is off (outside a Slurm job, ``CDGPC_PROGRESS=off``); 2, with ``Error: <one
    line>``, only for a usage error (no or bad ``SLURM_JOB_ID``, bad numbers, STEP and
    ``--scrape`` both or neither).
    """
    parser = argparse.ArgumentParser(
        prog="cdgpc-progress",
        description="Report training or serving progress of this Slurm job to the node agent. "
        "Never fails the job: if the agent is down, warns and exits 0.",
    )
    parser.add_argument(
        "step",
        type=_count,
        nargs="?",
        help="steps (iterations) done so far, or requests served, >= 0",
    )
    parser.add_argument("total", type=_count, nargs="?", help="total steps of the job, if known")
    parser.add_argument(
        "--latency",
        type=_latency,
        metavar="DURATION",
        help="a serving job's latency at its objective's percentile since its last report: "
        "250ms, 0.25s, 800us or seconds",
    )
    parser.add_argument(
        "--rate", type=float, metavar="FLOAT", help="a serving job's requests per second since then"
    )
    scrape = parser.add_argument_group(
        "a serving job's Prometheus endpoint, instead of step",
        "Runs until SIGTERM or SIGINT; off (exits 0) outside a Slurm job or with "
        "CDGPC_PROGRESS=off.",
    )
    scrape.add_argument(
        "--scrape",
        metavar="URL",
        help="read the server's latency histogram there (vLLM: http://127.0.0.1:8000/metrics) "
        "and report its count, the percentile since the last scrape and the count per second",
    )
    scrape.add_argument(
        "--metric",
        action="append",
        metavar="NAME",
        help="the histogram, repeatable: the first present is read (default: vLLM's "
        "time per output token, vllm:time_per_output_token_seconds or "
        "vllm:inter_token_latency_seconds)",
    )
    scrape.add_argument(
        "--percentile",
        type=float,
        metavar="P",
        help="the objective's percentile, as in --comment=slo=p99:250ms (default: 99)",
    )
    scrape.add_argument(
        "--every", metavar="DURATION", help="scrape period: 5s, 500ms, ... (default: 5s)"
    )
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, format="%(message)s", level=logging.WARNING)
    usage = _usage_error(args)
    if usage:
        print(f"Error: {usage}", file=sys.stderr)
        return 2
    if args.scrape is not None:
        return _scrape(args)
    try:
        report_progress(args.step, args.total, latency_s=args.latency, rate=args.rate)
    except ProtocolError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    return 0


def _usage_error(args: argparse.Namespace) -> str:
    """Why the arguments do not make one mode, else ""."""
    scraping = args.scrape is not None
    if scraping and args.step is not None:
        return "give step or --scrape URL, not both"
    if not scraping and args.step is None:
        return "nothing to report: give step or --scrape URL"
    if scraping and (args.latency is not None or args.rate is not None):
        return "--latency and --rate go with step, not with --scrape"
    if not scraping and any(v is not None for v in (args.metric, args.percentile, args.every)):
        return "--metric, --percentile and --every go with --scrape"
    return ""


def _scrape(args: argparse.Namespace) -> int:
    """Scrape until SIGTERM or SIGINT: the main thread scrapes, a thread takes the signals."""
    from slurm_cdgpc.integrations.prometheus import (  # noqa: PLC0415 - it imports this module
        DEFAULT_METRICS,
        Scraper,
    )

    try:
        every_s = parse_duration_s(args.every or "5s")
    except InputError as e:
        print(f"Error: --every: {e}", file=sys.stderr)
        return 2
    try:
        percentile = 99.0 if args.percentile is None else args.percentile
        scraper = Scraper(args.scrape, percentile, names=args.metric or DEFAULT_METRICS)
    except InputError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    if not scraper.enabled:
        print(
            f"cdgpc-progress: off (outside a Slurm job, or CDGPC_PROGRESS=off): "
            f"not scraping {args.scrape}",
            file=sys.stderr,
        )
        return 0
    stop = threading.Event()
    signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)  # so in the waiter too, which takes them

    def wait_for_signal() -> None:
        signal.sigwait(signals)
        stop.set()

    threading.Thread(target=wait_for_signal, name="cdgpc-signals", daemon=True).start()
    scraper.run(every_s, stop)
    return 0


def _count(text: str) -> int:
    if not text.isdigit() or len(text) > 16:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return int(text)


def _latency(text: str) -> float:
    """``250ms``, ``0.25s``, ``800us`` or a bare number of seconds (the range: `ProgressLine`)."""
    match = _LATENCY.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"must be a duration like 250ms, 0.25s, 800us or 0.25, got {text!r}"
        )
    return latency_s(match[1], match[2])


def _read_line(sock: socket.socket, limit: int, until_s: float) -> bytes:
    """Bytes up to the first newline (or EOF), at most ``limit + 1`` of them, by ``until_s``
    (`time.monotonic`): each wait is for what is left, so a peer that trickles bytes gets no
    longer than a silent one (`TimeoutError`)."""
    data = bytearray()
    while len(data) <= limit and b"\n" not in data:
        left_s = until_s - time.monotonic()
        if left_s <= 0:
            raise TimeoutError("timed out")
        sock.settimeout(left_s)
        chunk = sock.recv(limit + 1 - len(data))
        if not chunk:
            break
        data.extend(chunk)
    return bytes(data)


# -- server ------------------------------------------------------------------------------------


class ProgressServer:
    """Accepts progress lines on a Unix socket and passes them to ``record``.

    The socket is mode 0666, so that every job can write. Each connection carries one JSON line
    (`ProgressLine`, at most `MAX_PROGRESS_LINE_BYTES`) and is answered ``ok`` or ``error:
    <reason>``; the sender's uid comes from the kernel (``SO_PEERCRED``), so a sender cannot lie
    about it, and goes to ``record`` (`NodeAgent.record_progress`) with the report (a serving
    job's latency and rate as keywords, `Recorder`). Connections
    are served on their own threads, at most ``max_connections`` at once and ``max_per_uid``
    from one uid (root included), each for at most ``timeout_s`` in all however slowly it
    writes; one over a bound is answered ``error: ...`` and closed at once.
    """

    def __init__(
        self,
        path: Path,
        record: Recorder,
        *,
        timeout_s: float = 2.0,
        max_connections: int = 16,
        max_per_uid: int = 4,
    ) -> None:
        if not 1 <= max_per_uid <= max_connections:
            raise FatalError(
                f"need 1 <= max_per_uid <= max_connections, got {max_per_uid}, {max_connections}"
            )
        self.path = Path(path)
        self._record = record
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self.max_per_uid = max_per_uid
        self._lock = threading.Lock()
        self._open_by_uid: dict[int, int] = {}  # connections being served, per sender uid
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind the socket (replacing a stale one), make it world-writable, start accepting."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                mode = self.path.lstat().st_mode
            except FileNotFoundError:
                pass
            else:
                if not stat.S_ISSOCK(mode):
                    raise FatalError(
                        f"{self.path} exists and is not a socket; refusing to remove it"
                    )
                self.path.unlink()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(os.fspath(self.path))
                os.chmod(self.path, 0o666)  # every job may report; SO_PEERCRED says who
                sock.listen(64)
                sock.settimeout(0.2)
            except BaseException:
                sock.close()
                raise
        except OSError as e:
            raise FatalError(f"cannot listen for progress on {self.path}: {e.strerror or e}") from e
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="progress", daemon=True)
        self._thread.start()
        logger.info("progress socket listening on %s", self.path)

    def close(self) -> None:
        """Stop accepting and remove the socket file."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(OSError):
                self.path.unlink()

    def _serve(self) -> None:
        sock = self._sock
        assert sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._stop.is_set():
                    return
                logger.error("progress socket: accept failed: %s", e)
                self._stop.wait(0.2)
                continue
            until_s = time.monotonic() + self.timeout_s  # the connection's whole life
            try:
                raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
                pid, uid, _gid = _PEERCRED.unpack(raw)
            except OSError as e:
                _answer_and_close(conn, f"error: cannot identify the sender: {e.strerror or e}")
                continue
            refusal = self._take_slot(uid)
            if refusal:
                logger.warning("progress socket: pid %d uid %d refused: %s", pid, uid, refusal)
                _answer_and_close(conn, f"error: {refusal}")
                continue
            threading.Thread(
                target=self._handle, args=(conn, pid, uid, until_s), daemon=True
            ).start()

    def _take_slot(self, uid: int) -> str:
        """Count one more connection from ``uid``; the reason it may not have one, else ""."""
        with self._lock:
            if sum(self._open_by_uid.values()) >= self.max_connections:
                return f"too many reports in flight (at most {self.max_connections})"
            held = self._open_by_uid.get(uid, 0)
            if held >= self.max_per_uid:
                return f"uid {uid} has {held} reports in flight (at most {self.max_per_uid})"
            self._open_by_uid[uid] = held + 1
            return ""

    def _release_slot(self, uid: int) -> None:
        with self._lock:
            held = self._open_by_uid.pop(uid) - 1
            if held:
                self._open_by_uid[uid] = held

    def _handle(self, conn: socket.socket, pid: int, uid: int, until_s: float) -> None:
        try:
            with conn:
                try:
                    answer = self._answer(conn, pid, uid, until_s)
                finally:
                    self._release_slot(uid)  # what is left cannot wait on the sender
                _answer_and_close(conn, answer)
        except Exception:
            logger.exception("progress socket: internal error")

    def _answer(self, conn: socket.socket, pid: int, uid: int, until_s: float) -> str:
        try:
            data = _read_line(conn, MAX_PROGRESS_LINE_BYTES, until_s)
        except OSError as e:
            logger.info("progress socket: pid %d uid %d: %s", pid, uid, e)
            return "error: no complete line received in time"
        if len(data) > MAX_PROGRESS_LINE_BYTES:
            return f"error: line longer than {MAX_PROGRESS_LINE_BYTES} bytes"
        try:
            line = ProgressLine.from_json(data.split(b"\n", 1)[0])
            self._record(line.job_id, line.step, line.total, uid, **line.serving())
        except CdgpcError as e:
            logger.warning("progress from pid %d uid %d refused: %s", pid, uid, e)
            return f"error: {e}"
        logger.debug(
            "progress: job %s step %d/%s (uid %d)", line.job_id, line.step, line.total, uid
        )
        return "ok"


def _answer_and_close(conn: socket.socket, answer: str) -> None:
    """Send the one-line answer without waiting (it fits the socket's empty buffer), close."""
    with conn, contextlib.suppress(OSError):
        conn.setblocking(False)
        conn.send(answer.encode("ascii", "replace") + b"\n")


if __name__ == "__main__":
    raise SystemExit(main())
