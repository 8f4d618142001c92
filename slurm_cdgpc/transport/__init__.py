"""Everything that crosses a process or machine boundary: request and reply authentication, HTTP,
SSH. Only `transport/` runs ``munge``, ``unmunge`` and ``ssh``, and it never reaches `agent/` or
`coordinator/` (`tests/unit/test_import_graph.py`). Nothing is imported here, so that the Prolog
and Epilog pay only for the modules they use.
"""

from __future__ import annotations
