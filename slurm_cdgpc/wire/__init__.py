"""The contract between the head and a node agent: messages, the id grammars and the paths.

Standard library (and `slurm_cdgpc.errors`) only: both parties, the transports and the progress
client inside training jobs import it. `tests/unit/test_import_graph.py` keeps it so.
"""
