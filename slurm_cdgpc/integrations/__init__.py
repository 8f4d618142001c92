"""Callbacks that tell the node agent a framework's step and total (Lightning, Transformers,
Keras); each module imports without its framework, and its class says what to install.

They report through the automatic progress hook's one reporter (`progress_hook`): one rate
limit, one socket protocol. Design: DESIGN.md, "Progress"; tests:
`tests/unit/test_progress_hook.py`, `tests/integration/test_progress_hook_live.py`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Final, Protocol, cast

HOOK_MODULE: Final = "_cdgpc_progress_hook"
HOOK_DIR: Final = Path(__file__).resolve().parent.parent / "hook"


class ProgressHook(Protocol):
    """What the callbacks use of `_cdgpc_progress_hook`."""

    def report(self, step: int, total: int | None = None) -> None: ...

    def set_total(self, total: int | None) -> None: ...


def progress_hook() -> ProgressHook:
    """The process's one `_cdgpc_progress_hook` module (imported from ``HOOK_DIR`` if absent).

    Loaded by path when the TaskProlog did not put it in the process, so the step reported is
    the larger of the framework's and the optimizer steps the hook counts."""
    module = sys.modules.get(HOOK_MODULE)
    if module is None:
        spec = importlib.util.spec_from_file_location(HOOK_MODULE, HOOK_DIR / f"{HOOK_MODULE}.py")
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load the progress hook from {HOOK_DIR}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[HOOK_MODULE] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[HOOK_MODULE]
            raise
    return cast(ProgressHook, module)


def framework_class(modules: tuple[str, ...], name: str, install: str) -> Any:
    """``name`` from the first of ``modules`` that imports; else a class that refuses to be
    made, with an `ImportError` that says ``pip install <install>``."""
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    message = f"{' or '.join(modules)} is not installed (pip install {install})"

    class Missing:
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise ImportError(message)

    return Missing
