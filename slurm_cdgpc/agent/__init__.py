"""The node agent ``cdgpc-noded``: `node` (the core), `server` (its HTTP routes), `progress` (the
jobs' socket and its client), `metrics` and `main`. It never reaches `control/`
(`tests/unit/test_import_graph.py`). Nothing is imported here: the progress client must start
without numpy or the GPU backends. Design: DESIGN.md, "Safety" and "The exchange".
"""

from __future__ import annotations
