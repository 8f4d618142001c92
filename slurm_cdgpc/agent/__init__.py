"""The node agent ``cdgpc-noded``: applies the head's clocks to this node's GPUs, safely.

- `node`: `NodeAgent`, the core (setpoints, lease watchdog, state file); no sockets.
- `server`: the authenticated HTTP listener (``POST /v1/exchange``, ``GET /v1/health``).
- `progress`: the Unix socket training jobs report progress on, and its stdlib-only client
  ``cdgpc-progress``.
- `main`: the ``cdgpc-noded`` entry point.

Nothing is imported here: the progress client must start without numpy or the GPU backends.
"""

from __future__ import annotations
