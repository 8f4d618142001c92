"""GPU devices: one interface (`device.py`), two backends (`nvml.py`, `simulated.py`)."""
