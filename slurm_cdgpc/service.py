"""Process plumbing shared by the daemons (``cdgpcd``, ``cdgpc-noded``).

Logs go to stderr, one line per event (journald adds time stamps); ``CDGPC_DEBUG=1`` logs at
debug level and shows tracebacks. A `CdgpcError` ends the process with ``Error: <one line>``
and exit status 2 for bad input (configuration), 1 otherwise.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from slurm_cdgpc.errors import CdgpcError, InputError

DEBUG_ENV = "CDGPC_DEBUG"

logger = logging.getLogger(__name__)


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV) == "1"


def serve(prog: str, body: Callable[[], int]) -> int:
    """Set up logging, run ``body``, and turn our errors into one line and an exit status."""
    debug = debug_enabled()
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.DEBUG if debug else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return body()
    except CdgpcError as e:
        if debug:
            logger.exception("%s failed", prog)
        print(f"Error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2 if isinstance(e, InputError) else 1
