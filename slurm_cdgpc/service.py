"""Process plumbing shared by the daemons (``cdgpcd``, ``cdgpc-noded``): `serve` and `settle_heap`.

Standard library, `errors` and `systemd` only. Design: DESIGN.md, "Under systemd" (log
priorities) and "The head's API" (the collector); test: `tests/unit/test_systemd.py`.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from collections.abc import Callable

from slurm_cdgpc.errors import CdgpcError, InputError
from slurm_cdgpc.systemd import JournalFormatter, stream_is_journal, syslog_priority

DEBUG_ENV = "CDGPC_DEBUG"
#: one line per event; journald adds the time
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"

logger = logging.getLogger(__name__)


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV) == "1"


def settle_heap() -> None:
    """Once start-up is done, put what it allocated (modules, SQLAlchemy's tables and compiled
    statements, the store's jobs) out of the cyclic collector's reach (`gc.freeze`).

    The collector's full pass walks every live object, and the head's start-up leaves hundreds
    of thousands: each pass held the GIL and stalled every request in flight, and those passes
    were the registration p99 (DESIGN.md, "The head's API"). After the freeze a full pass walks
    only what was allocated since; garbage made at start-up is collected first, not kept
    forever. The price: a start-up object that later falls out of use inside a reference cycle
    is never reclaimed, a one-time cost bounded by the start-up heap."""
    gc.collect()
    gc.freeze()


def serve(prog: str, body: Callable[[], int]) -> int:
    """Set up logging, run ``body``, and turn our errors into one line and an exit status.

    Logs go to stderr, one line per event (journald adds time stamps); when stderr is the
    journal's stream, each line carries its syslog priority (`JournalFormatter`), so
    ``journalctl -p err`` finds the errors. ``CDGPC_DEBUG=1`` logs at debug level and shows
    tracebacks. A `CdgpcError` ends the process with ``Error: <one line>`` and exit status 2
    for bad input (configuration), 1 otherwise."""
    debug = debug_enabled()
    journal = stream_is_journal(sys.stderr)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JournalFormatter(LOG_FORMAT) if journal else logging.Formatter(LOG_FORMAT))
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, handlers=[handler])
    try:
        return body()
    except CdgpcError as e:
        if debug:
            logger.exception("%s failed", prog)
        prefix = f"<{syslog_priority(logging.ERROR)}>" if journal else ""
        print(f"{prefix}Error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2 if isinstance(e, InputError) else 1
