"""Progress reports over a real Unix socket: server, client helper and ``cdgpc-progress``."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_cdgpc.agent.node import NodeAgent
from slurm_cdgpc.agent.progress import ProgressServer, main, report_progress, socket_reporter
from slurm_cdgpc.config import SafeCap
from slurm_cdgpc.errors import FatalError, InputError
from slurm_cdgpc.gpu.simulated import ManualClock, simulated_gpus
from slurm_cdgpc.wire.protocol import (
    ExchangeRequest,
    ExchangeResponse,
    ProgressReport,
    ProtocolError,
)

REPO = Path(__file__).resolve().parents[2]
Record = tuple[str, int, int | None, int]


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory: Unix socket paths are limited to 107 bytes."""
    with tempfile.TemporaryDirectory(prefix="cdgpc-") as d:
        yield Path(d)


@pytest.fixture
def server(short_dir: Path) -> Iterator[tuple[ProgressServer, list[Record]]]:
    """A recorder of the four arguments a training report has always had."""
    records: list[Record] = []

    def record(job_id: str, step: int, total: int | None, uid: int) -> None:
        if job_id == "666":
            raise InputError("job 666: refused by the agent")
        records.append((job_id, step, total, uid))

    srv = ProgressServer(short_dir / "run" / "progress.sock", record, timeout_s=0.5)
    srv.start()
    yield srv, records
    srv.close()


def _send(path: Path, data: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(path))
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        return s.recv(1024)


def test_report_reaches_the_agent_with_the_senders_uid(
    server: tuple[ProgressServer, list[Record]],
) -> None:
    srv, records = server
    assert stat.S_IMODE(srv.path.stat().st_mode) == 0o666
    assert report_progress(10, total=100, job_id="123", path=srv.path)
    assert report_progress(11, job_id="123_4", path=srv.path)
    assert records == [("123", 10, 100, os.getuid()), ("123_4", 11, None, os.getuid())]


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b"not json\n", b"not valid JSON"),
        (b'{"job_id": "1", "step": 5, "total": 4}\n', b"must not exceed total"),
        (b'{"job_id": "1; rm", "step": 1}\n', b"Slurm job id"),
        (b'{"job_id": "1", "step": 1, "uid": 0}\n', b"unknown field 'uid'"),
        (b'{"job_id": "1", "step": 1, "pad": "' + b"x" * 2000 + b'"}\n', b"longer than 1024"),
        (b'{"job_id": "666", "step": 1}\n', b"refused by the agent"),
        (b"", b"not valid JSON"),
    ],
)
def test_malformed_lines_are_refused(
    server: tuple[ProgressServer, list[Record]], line: bytes, reason: bytes
) -> None:
    srv, records = server
    answer = _send(srv.path, line)
    assert answer.startswith(b"error: ") and reason in answer and answer.count(b"\n") == 1
    assert records == []


def test_silent_client_times_out_without_blocking_others(
    server: tuple[ProgressServer, list[Record]],
) -> None:
    srv, records = server
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle:
        idle.connect(str(srv.path))  # sends nothing
        assert report_progress(1, job_id="5", path=srv.path)
        idle.settimeout(5)
        assert idle.recv(100).startswith(b"error: no complete line")
    assert records == [("5", 1, None, os.getuid())]


def test_stale_socket_is_replaced_but_a_regular_file_is_not(short_dir: Path) -> None:
    path = short_dir / "p.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(str(path))
    srv = ProgressServer(path, lambda *_: None)
    srv.start()
    srv.close()
    assert not path.exists()
    path.write_text("precious")
    with pytest.raises(FatalError, match="not a socket"):
        ProgressServer(path, lambda *_: None).start()
    assert path.read_text() == "precious"


def test_absent_agent_is_a_warning_not_a_failure(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert not report_progress(1, job_id="1", path=short_dir / "nothing.sock")
    assert "no node agent socket" in caplog.text


def test_the_simulated_jobs_reporter_waits_for_the_socket(
    server: tuple[ProgressServer, list[Record]], short_dir: Path
) -> None:
    srv, records = server
    assert not socket_reporter(short_dir / "not-yet.sock")("7", 1, 10)
    report = socket_reporter(srv.path)
    assert report("7", 3, 10) and report("7", 4, 10)
    assert not report("666", 5, 10)  # refused by the agent: sent again at the next poll
    assert records == [("7", 3, 10, os.getuid()), ("7", 4, 10, os.getuid())]


def test_helper_refuses_a_missing_job_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ProtocolError, match="SLURM_JOB_ID is not set"):
        report_progress(1)


def test_cli_reports_through_the_socket(
    server: tuple[ProgressServer, list[Record]], monkeypatch: pytest.MonkeyPatch
) -> None:
    srv, records = server
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("CDGPC_NODE_PROGRESS_SOCKET", str(srv.path))
    assert main(["7", "9"]) == 0
    assert records == [("42", 7, 9, os.getuid())]


@pytest.mark.parametrize(
    ("job_id", "args", "code", "message"),
    [
        (None, ["1"], 2, "Error: SLURM_JOB_ID is not set"),
        ("abc", ["1"], 2, "Error: job_id: must be a Slurm job id"),
        ("42", ["-3"], 2, "must be a non-negative integer"),
        ("42", ["5", "4"], 2, "Error: step: must not exceed total"),
        ("42", ["5", "--latency", "fast"], 2, "must be a duration like 250ms"),
        ("42", ["5", "--latency", "0ms"], 2, "Error: latency_s: must be a number of seconds"),
        ("42", ["5", "--rate", "-1"], 2, "Error: rate: must be a number"),
        ("42", ["5", "--rate", "nan"], 2, "Error: rate: must be a number"),
        ("42", ["5"], 0, "no node agent socket"),
    ],
)
def test_cli_exit_codes(
    short_dir: Path, job_id: str | None, args: list[str], code: int, message: str
) -> None:
    env = {"PYTHONPATH": str(REPO), "CDGPC_NODE_PROGRESS_SOCKET": str(short_dir / "none.sock")}
    if job_id is not None:
        env["SLURM_JOB_ID"] = job_id
    done = subprocess.run(
        [sys.executable, "-m", "slurm_cdgpc.agent.progress", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == code
    assert message in done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize(
    "module",
    [
        "slurm_cdgpc.agent.progress",
        "slurm_cdgpc.integrations.serving",
        "slurm_cdgpc.integrations.prometheus",
    ],
)
def test_what_jobs_import_imports_nothing_heavy(module: str) -> None:
    """The progress client and the serving reporter run inside users' jobs."""
    code = (
        f"import sys, {module}\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('numpy', 'pynvml', 'sqlalchemy',"
        " 'cvxpy', 'torch') or m.startswith(('slurm_cdgpc.gpu', 'slurm_cdgpc.config',"
        " 'slurm_cdgpc.agent.node', 'slurm_cdgpc.agent.server', 'slurm_cdgpc.transport'))]\n"
        "print(sorted(heavy))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert done.stdout.strip() == "[]"


# -- a serving job's latency and request rate, through a real agent ----------------------------


@pytest.fixture
def agent_socket(short_dir: Path) -> Iterator[tuple[NodeAgent, ManualClock, Path]]:
    """A `NodeAgent` on simulated GPUs recording from a real `ProgressServer`."""
    clock = ManualClock(1_767_225_600.0)
    agent = NodeAgent(
        simulated_gpus("A100-SXM4-80GB", 1, seed=1, time_source=clock),
        node_name="gpu01",
        lease_duration_s=90.0,
        safe_cap=SafeCap(clock_fraction=0.6),
        state_file=short_dir / "state.json",
        clock=clock,
    )
    srv = ProgressServer(short_dir / "p.sock", agent.record_progress, timeout_s=0.5)
    srv.start()
    yield agent, clock, srv.path
    srv.close()


def _relayed(agent: NodeAgent, clock: ManualClock) -> tuple[ProgressReport, ...]:
    """The progress of the agent's exchange response, as the head parses it."""
    response = agent.exchange(ExchangeRequest(1, clock() + 90.0, (), node="gpu01"))
    return ExchangeResponse.from_json(response.to_json()).progress


def test_a_serving_report_reaches_the_head_with_its_latency_and_rate(
    agent_socket: tuple[NodeAgent, ManualClock, Path],
) -> None:
    agent, clock, path = agent_socket
    assert report_progress(120, job_id="77", path=path, latency_s=0.25, rate=40.0)
    clock.advance(1.0)
    # the same count again, with a new latency and rate: it replaces the first
    assert report_progress(120, job_id="77", path=path, latency_s=0.3, rate=0.5)
    assert report_progress(5, job_id="78", path=path)  # a training job alongside: no fields
    uid = os.getuid()
    assert _relayed(agent, clock) == (
        ProgressReport("77", 120, None, clock(), uid, latency_s=0.3, rate=0.5),
        ProgressReport("78", 5, None, clock(), uid),
    )


@pytest.mark.parametrize(
    ("latency", "seconds"),
    [("250ms", 0.25), ("0.25s", 0.25), ("800us", 0.0008), ("0.25", 0.25), (" .5 ", 0.5)],
)
def test_cli_reports_a_serving_jobs_latency_and_rate(
    agent_socket: tuple[NodeAgent, ManualClock, Path],
    monkeypatch: pytest.MonkeyPatch,
    latency: str,
    seconds: float,
) -> None:
    agent, clock, path = agent_socket
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("CDGPC_NODE_PROGRESS_SOCKET", str(path))
    assert main(["9000", "--latency", latency, "--rate", "12.5"]) == 0
    (p,) = _relayed(agent, clock)
    assert (p.job_id, p.step, p.latency_s, p.rate) == ("42", 9000, seconds, 12.5)
