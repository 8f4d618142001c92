"""What the daemons tell systemd: sd_notify datagrams on a real socket, and log priorities."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_cdgpc.systemd import (
    JournalFormatter,
    Notifier,
    ProgressWatchdog,
    stream_is_journal,
    syslog_priority,
)

REPO = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _received(sock: socket.socket) -> list[str]:
    """The datagrams waiting on ``sock`` (a send to a Unix socket has arrived when it returns)."""
    got = []
    while True:
        try:
            got.append(sock.recv(4096).decode())
        except BlockingIOError:
            return got


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    """A datagram socket at a path, as systemd's ``$NOTIFY_SOCKET``."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.setblocking(False)
        yield str(path), sock


def test_ready_status_and_stopping_reach_a_socket_at_a_path(
    listener: tuple[str, socket.socket],
) -> None:
    address, sock = listener
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": address})
    notifier.ready("active, listening on 127.0.0.1:8700")
    notifier.status("a line\nwith a newline")
    notifier.stopping()
    assert _received(sock) == [
        "READY=1\nSTATUS=active, listening on 127.0.0.1:8700",
        "STATUS=a line with a newline",
        "STOPPING=1\nSTATUS=stopping",
    ]


def test_an_abstract_socket_name_starts_with_an_at_sign() -> None:
    name = f"cdgpc-test-{secrets.token_hex(6)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.setblocking(False)
        assert Notifier.from_environment({"NOTIFY_SOCKET": "@" + name}).send("READY=1")
        assert _received(sock) == ["READY=1"]


def test_without_a_socket_nothing_is_sent() -> None:
    notifier = Notifier.from_environment({"WATCHDOG_USEC": "30000000"})
    assert notifier.watchdog_s is None
    assert not notifier.send("READY=1")
    notifier.watchdog()  # no error either


def test_a_socket_nobody_reads_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    notifier = Notifier(str(tmp_path / "absent"))
    assert not notifier.send("READY=1")
    assert not notifier.send("STATUS=again")
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"cannot notify systemd at {tmp_path / 'absent'}: No such file or directory"
    ]


def test_watchdog_pings_at_most_four_times_a_period(listener: tuple[str, socket.socket]) -> None:
    address, sock = listener
    clock = Clock()
    watchdog_s = Notifier.from_environment(
        {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "20000000", "WATCHDOG_PID": str(os.getpid())}
    ).watchdog_s
    assert watchdog_s == 20.0
    notifier = Notifier(address, watchdog_s, monotonic=clock)
    notifier.watchdog()
    clock.now_s += 4.9
    notifier.watchdog()  # within a quarter period of the last: dropped
    assert _received(sock) == ["WATCHDOG=1"]
    clock.now_s += 0.1
    notifier.watchdog()
    assert _received(sock) == ["WATCHDOG=1"]


def test_a_watchdog_meant_for_another_process_is_not_ours(
    listener: tuple[str, socket.socket],
) -> None:
    address, sock = listener
    env = {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "1"}
    notifier = Notifier.from_environment(env)
    assert notifier.watchdog_s is None
    notifier.watchdog()
    assert _received(sock) == []


def test_progress_watchdog_stops_pinging_when_the_loop_stalls(
    listener: tuple[str, socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    address, sock = listener
    clock = Clock()
    interval = [0]
    watchdog = ProgressWatchdog(
        Notifier(address, 4.0, monotonic=clock), lambda: interval[0], 10.0, monotonic=clock
    )
    for _ in range(3):  # the loop turns every 6 s
        clock.now_s += 6.0
        interval[0] += 1
        assert watchdog.check()
    assert _received(sock) == ["WATCHDOG=1"] * 3
    clock.now_s += 10.0  # 10 s since the last interval began: still in time
    assert watchdog.check()
    clock.now_s += 1.0
    assert not watchdog.check()
    clock.now_s += 5.0
    assert not watchdog.check()
    assert _received(sock) == ["WATCHDOG=1"]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        "no progress for 11s: watchdog keep-alives stop (systemd restarts the daemon)"
    ]
    interval[0] += 1  # it came back before systemd acted
    assert watchdog.check()
    assert _received(sock) == ["WATCHDOG=1"]


def _journal_env(path: Path) -> dict[str, str]:
    info = path.stat()
    return {"JOURNAL_STREAM": f"{info.st_dev}:{info.st_ino}"}


def test_the_journal_stream_is_recognised_by_device_and_inode(tmp_path: Path) -> None:
    journal, other = tmp_path / "journal", tmp_path / "other"
    journal.touch()
    other.touch()
    with journal.open("w") as j, other.open("w") as o:
        assert stream_is_journal(j, _journal_env(journal))
        assert not stream_is_journal(o, _journal_env(journal))
        assert not stream_is_journal(j, {})
        assert not stream_is_journal(j, {"JOURNAL_STREAM": "garbage"})


def test_each_line_carries_its_syslog_priority() -> None:
    formatter = JournalFormatter("%(levelname)s %(name)s: %(message)s")
    assert [syslog_priority(level) for level in (50, 40, 30, 20, 10)] == [2, 3, 4, 6, 7]

    def line(level: int, message: str, exc_info: Any = None) -> str:
        record = logging.LogRecord("x", level, __file__, 1, message, None, exc_info)
        return formatter.format(record)

    assert line(logging.ERROR, "lost") == "<3>ERROR x: lost"
    assert line(logging.WARNING, "slow") == "<4>WARNING x: slow"
    assert line(logging.INFO, "up") == "<6>INFO x: up"
    assert line(logging.DEBUG, "detail") == "<7>DEBUG x: detail"
    try:
        raise ValueError("boom")
    except ValueError:
        lines = line(logging.ERROR, "failed", sys.exc_info()).split("\n")
    assert lines[0] == "<3>ERROR x: failed" and lines[-1] == "<3>ValueError: boom"
    assert all(entry.startswith("<3>") for entry in lines)


SERVE = """
import logging
from slurm_cdgpc.errors import FatalError
from slurm_cdgpc.service import serve

def body():
    logging.getLogger("slurm_cdgpc.x").warning("store slow")
    raise FatalError("cannot listen")

raise SystemExit(serve("cdgpcd", body))
"""


@pytest.mark.parametrize("journal", [True, False])
def test_a_daemon_logging_to_the_journal_prefixes_priorities(tmp_path: Path, journal: bool) -> None:
    stderr = tmp_path / "stderr"
    stderr.touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CDGPC_", "JOURNAL_"))}
    env["PYTHONPATH"] = str(REPO)
    if journal:
        env.update(_journal_env(stderr))
    with stderr.open("w") as err:
        done = subprocess.run(
            [sys.executable, "-c", SERVE], stderr=err, env=env, timeout=60, check=False
        )
    assert done.returncode == 1
    expected = ["WARNING slurm_cdgpc.x: store slow", "Error: cannot listen"]
    if journal:
        expected = [f"<4>{expected[0]}", f"<3>{expected[1]}"]
    assert stderr.read_text().splitlines() == expected
