"""What the daemons tell systemd, without libsystemd: notifications and log priorities.

`Notifier` and `ProgressWatchdog` (sd_notify(3)), `JournalFormatter` and `stream_is_journal`
(sd-daemon(3)). Standard library only. Design: DESIGN.md, "Under systemd" (which daemon sends
what and when); tests: `tests/unit/test_systemd.py`, `tests/integration/test_systemd_live.py`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO, Final

logger = logging.getLogger(__name__)

NOTIFY_SOCKET_ENV: Final = "NOTIFY_SOCKET"
WATCHDOG_USEC_ENV: Final = "WATCHDOG_USEC"
WATCHDOG_PID_ENV: Final = "WATCHDOG_PID"
JOURNAL_STREAM_ENV: Final = "JOURNAL_STREAM"


class Notifier:
    """sd_notify(3) over ``$NOTIFY_SOCKET`` (a path, or ``@name`` for an abstract socket):
    ``READY=1``, ``WATCHDOG=1``, ``STOPPING=1``, ``STATUS=...``.

    Every method is a no-op without a socket (not started by systemd). A message that cannot
    be sent is logged once and dropped: the service manager's bookkeeping never stops a daemon.
    """

    def __init__(
        self,
        address: str | None,
        watchdog_s: float | None = None,
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = address or None
        #: the service manager's watchdog period (``WatchdogSec=``); None: no watchdog
        self.watchdog_s = watchdog_s if self.address is not None else None
        self._monotonic = monotonic
        self._last_ping_s: float | None = None
        self._failed = False

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        """From ``NOTIFY_SOCKET``, and ``WATCHDOG_USEC`` where ``WATCHDOG_PID`` is unset or
        this process (sd_watchdog_enabled(3))."""
        env = os.environ if environ is None else environ
        watchdog_s = None
        pid = env.get(WATCHDOG_PID_ENV, "").strip()
        try:
            usec = int(env.get(WATCHDOG_USEC_ENV, ""))
            if usec > 0 and (not pid or int(pid) == os.getpid()):
                watchdog_s = usec / 1e6
        except ValueError:
            pass
        return cls(env.get(NOTIFY_SOCKET_ENV), watchdog_s)

    def send(self, *fields: str) -> bool:
        """One datagram of ``KEY=value`` lines; True if it was sent."""
        if self.address is None or not fields:
            return False
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        message = "\n".join(" ".join(f.split("\n")) for f in fields).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(message, target)
        except OSError as e:
            if not self._failed:
                logger.warning("cannot notify systemd at %s: %s", self.address, e.strerror or e)
                self._failed = True
            return False
        return True

    def ready(self, status: str) -> None:
        """Start-up is over: the daemon serves (``Type=notify`` units become active)."""
        self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        """A line ``systemctl status`` shows."""
        self.send(f"STATUS={status}")

    def stopping(self, status: str = "stopping") -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def watchdog(self) -> None:
        """Keep-alive for ``WatchdogSec=``, at most four a period (so a loop may call it on
        every pass); a no-op without a watchdog."""
        if self.watchdog_s is None:
            return
        now_s = self._monotonic()
        if self._last_ping_s is not None and now_s - self._last_ping_s < self.watchdog_s / 4:
            return
        if self.send("WATCHDOG=1"):
            self._last_ping_s = now_s


class ProgressWatchdog:
    """Keeps the watchdog fed from a thread of its own while a loop it cannot ping from shows
    progress: ``progress()`` (a counter the loop advances) changed within ``stall_s``. A loop
    that stalls longer stops the pings, and systemd restarts the daemon a watchdog period
    later; a loop that only fails, but still turns, keeps them going."""

    def __init__(
        self,
        notifier: Notifier,
        progress: Callable[[], object],
        stall_s: float,
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.notifier = notifier
        self.progress = progress
        self.stall_s = stall_s
        self._monotonic = monotonic
        self._seen = progress()
        self._moved_s = monotonic()
        self._stalled = False

    def check(self) -> bool:
        """One look: ping if the loop moved within ``stall_s``; False if it has stalled."""
        now_s = self._monotonic()
        seen = self.progress()
        if seen != self._seen:
            self._seen, self._moved_s, self._stalled = seen, now_s, False
        if now_s - self._moved_s > self.stall_s:
            if not self._stalled:
                logger.error(
                    "no progress for %gs: watchdog keep-alives stop (systemd restarts the daemon)",
                    now_s - self._moved_s,
                )
                self._stalled = True
            return False
        self.notifier.watchdog()
        return True

    def run(self, stop: threading.Event) -> None:
        """Look four times a watchdog period until ``stop``; returns at once without a watchdog."""
        if self.notifier.watchdog_s is None:
            return
        while not stop.wait(self.notifier.watchdog_s / 4):
            self.check()


def stream_is_journal(stream: IO[str], environ: Mapping[str, str] | None = None) -> bool:
    """Is ``stream`` the journal's? systemd puts ``<device>:<inode>`` of the stream it connects
    in ``$JOURNAL_STREAM``; a stream redirected elsewhere (or inherited by a child whose stderr
    was redirected) does not match."""
    env = os.environ if environ is None else environ
    device, _, inode = env.get(JOURNAL_STREAM_ENV, "").partition(":")
    try:
        info = os.fstat(stream.fileno())
        return (info.st_dev, info.st_ino) == (int(device), int(inode))
    except (OSError, ValueError, AttributeError):
        return False


def syslog_priority(levelno: int) -> int:
    """The syslog priority of a logging level: 2 critical, 3 error, 4 warning, 6 info, 7 debug."""
    if levelno >= logging.CRITICAL:
        return 2
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    if levelno >= logging.INFO:
        return 6
    return 7


class JournalFormatter(logging.Formatter):
    """Every line of a record, a traceback's too, starts with ``<priority>`` (``<3>`` for an
    error, as sd-daemon(3)'s ``SD_ERR``): journald makes each line an entry, and reads the
    priority from the prefix (and strips it)."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))
