"""The contract between the head and a node agent: messages, the id grammars and the paths. Both
parties, the transports and the progress client inside training jobs import it, so it reaches
only the standard library and `slurm_cdgpc.errors` (`tests/unit/test_import_graph.py`). Design:
DESIGN.md, "Data flow" and "The exchange" (The messages).
"""
