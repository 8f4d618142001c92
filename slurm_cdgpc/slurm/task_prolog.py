"""The Slurm TaskProlog: puts the automatic progress hook on every task's PYTHONPATH.

It never fails a task. Standard library and `slurm_cdgpc.config` only, as it runs before every
task (`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Progress"; tests:
`tests/unit/test_progress_hook.py`, `tests/integration/test_progress_hook_live.py`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

import slurm_cdgpc
from slurm_cdgpc.config import Config, NodeConfig, load_config
from slurm_cdgpc.errors import InputError

#: `slurm_cdgpc.agent.progress.SOCKET_ENV`, the variable the hook and cdgpc-progress read
SOCKET_ENV: Final = "CDGPC_NODE_PROGRESS_SOCKET"
#: the job's own switch, read by the hook too (`_cdgpc_progress_hook.OFF_VALUES`)
SWITCH_ENV: Final = "CDGPC_PROGRESS"
OFF_VALUES: Final = ("off", "0", "false", "no")


def hook_dir() -> Path:
    """The directory with the hook's ``sitecustomize.py``, inside the installed package."""
    return Path(slurm_cdgpc.__file__).resolve().parent / "hook"


def task_exports(config: Config, env: Mapping[str, str], hook: Path) -> list[tuple[str, str]]:
    """The (name, value) pairs to export into the task whose environment is ``env``::

        export PYTHONPATH=<the task's PYTHONPATH>:<slurm_cdgpc/hook>
        export CDGPC_NODE_PROGRESS_SOCKET=<node.progress_socket>    # only when not the default

    The hook directory is appended, never put first, and never twice: a ``sitecustomize`` of
    the job's own stays in force. Nothing when the site sets ``node.progress_hook = false`` or
    the job ``CDGPC_PROGRESS=off``.
    """
    if not config.node.progress_hook or env.get(SWITCH_ENV, "").strip().lower() in OFF_VALUES:
        return []
    exports = []
    current = env.get("PYTHONPATH", "")
    if str(hook) not in current.split(os.pathsep):
        exports.append(("PYTHONPATH", f"{current}{os.pathsep}{hook}" if current else str(hook)))
    if config.node.progress_socket != NodeConfig().progress_socket:
        exports.append((SOCKET_ENV, str(config.node.progress_socket)))
    for name, value in exports:
        if "\n" in value or "\r" in value:
            raise InputError(f"{name} would contain a line break; not exported")
    return exports


def main(argv: Sequence[str] | None = None) -> int:
    """``cdgpc-task-prolog [--config PATH]``: print the export lines; exit status 0 always.

    slurmd runs it (slurm.conf ``TaskProlog=``) as the job's user before each task and applies
    the ``export NAME=value`` lines it prints to the task's environment. On any error it prints
    nothing but one line on stderr."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args and (len(args) != 2 or args[0] != "--config"):
            raise InputError(f"usage: cdgpc-task-prolog [--config PATH], got {' '.join(args)}")
        config = load_config(Path(args[1]) if args else None)
        hook = hook_dir()
        if not (hook / "sitecustomize.py").is_file():
            raise InputError(f"no sitecustomize.py in {hook}")
        exports = task_exports(config, os.environ, hook)
        sys.stdout.write("".join(f"export {name}={value}\n" for name, value in exports))
        sys.stdout.flush()
    except Exception as e:  # never fail the task for its progress
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        print(f"cdgpc-task-prolog: {reason}; progress hook not set", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
