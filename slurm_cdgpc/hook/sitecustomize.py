"""slurm-cdgpc's sitecustomize: installs the automatic progress hook (`_cdgpc_progress_hook`),
then runs the next ``sitecustomize`` on sys.path, as Python would have without this one.

A job's own sitecustomize earlier on PYTHONPATH wins and this one never runs: it never replaces
theirs. Standard library only, Python 3.8 syntax, nothing printed, no thread
(`tests/unit/test_import_graph.py`). Test: `tests/unit/test_progress_hook.py`.
"""

# no "from __future__ import annotations": an older Python (3.6) then still runs the next
# sitecustomize, and only the hook's import fails (silently)
import importlib
import os
import sys

NAME = "sitecustomize"


def _install() -> None:
    try:
        importlib.import_module("_cdgpc_progress_hook").install()
    except Exception:  # the job runs unchanged, without automatic progress
        pass


def _same_dir(entry: str, here: str) -> bool:
    try:
        return os.path.realpath(entry or os.curdir) == here
    except Exception:
        return False


def _chain() -> None:
    """Import the next sitecustomize (the distribution's, a later PYTHONPATH entry's,
    site-packages') with this directory off sys.path. Its own errors reach site.py, which
    reports them as it would have (one line on stderr)."""
    try:
        here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
        ours = [(i, entry) for i, entry in enumerate(sys.path) if _same_dir(entry, here)]
    except Exception:
        return
    for i, _ in reversed(ours):
        del sys.path[i]
    this = sys.modules.pop(NAME, None)
    try:
        importlib.import_module(NAME)
    except ImportError as e:
        if e.name != NAME:
            raise
    finally:
        for i, entry in ours:
            sys.path.insert(i, entry)
        if NAME not in sys.modules and this is not None:
            sys.modules[NAME] = this


_install()
_chain()
