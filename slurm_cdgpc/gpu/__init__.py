"""GPU devices: one interface (`device.py`), two backends (`nvml.py`, `simulated.py`).

The GPU floor: reaches only `gpu/`, `wire/`, `errors` and `units` of the package
(`tests/unit/test_import_graph.py`).
"""
