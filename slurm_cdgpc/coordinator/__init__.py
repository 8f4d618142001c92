"""The head, ``cdgpcd``: its control loop (`daemon`), the rooms each stage keeps its state in, the
API and the reconcile with Slurm. `store/`, `transport/`, `slurm/`, `control/` and `model/`
never reach it (`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Data flow".
"""
