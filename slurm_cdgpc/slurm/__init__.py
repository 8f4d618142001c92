"""The Slurm seam: the job comment grammar, the Prolog/Epilog, the spool, and Slurm's commands.

Only `slurm/` runs Slurm's commands and imports pyslurm, and it never reaches `agent/` or
`coordinator/`; what the Prolog and Epilog import pulls in the standard library and this package
alone, so they start in milliseconds with an empty ``PATH`` (`tests/unit/test_import_graph.py`).
Design: DESIGN.md, "The Prolog and Epilog".
"""
