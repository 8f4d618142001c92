"""``python -m tests.faults.clockshift OFFSET_FILE MODULE [ARGS...]``: MODULE on a shifted clock.

The fault tests cannot move the machine's clock (every other process on it would jump too) and
libfaketime breaks Python's ``time.sleep`` on this interpreter, so this launcher shifts the wall
clock of one Python process only: ``time.time`` (and ``time.time_ns``) return the real time plus
the number of seconds in OFFSET_FILE, re-read whenever the file changes (a missing file: 0). The
monotonic clock is left alone, as a real NTP step leaves it. Then it runs MODULE as ``__main__``.

Everything in cdgpcd and cdgpc-noded that reads the wall clock does so through ``time.time`` at
call time, so the daemons see the jump as they would a stepped system clock.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time
from pathlib import Path

_real_time = time.time
_real_time_ns = time.time_ns


class _Offset:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._seen: tuple[int, int] | None = None
        self._offset_s = 0.0

    def seconds(self) -> float:
        with self._lock:
            try:
                st = os.stat(self.path)
                seen = (st.st_mtime_ns, st.st_size)
            except FileNotFoundError:
                seen = (0, 0)
            if seen != self._seen:
                self._seen = seen
                try:
                    self._offset_s = float(self.path.read_text().strip() or 0)
                except (OSError, ValueError):
                    self._offset_s = 0.0 if seen == (0, 0) else self._offset_s
            return self._offset_s


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: python -m tests.faults.clockshift OFFSET_FILE MODULE [ARGS...]")
    offset = _Offset(Path(sys.argv[1]))
    module = sys.argv[2]
    time.time = lambda: _real_time() + offset.seconds()
    time.time_ns = lambda: _real_time_ns() + int(offset.seconds() * 1e9)
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
