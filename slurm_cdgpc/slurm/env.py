"""What slurmd hands the node Prolog and Epilog in their environment (`read_hook_env`).

Standard library, `errors` and `wire.names` only: the Prolog imports it
(`tests/unit/test_import_graph.py`). Tests: `tests/unit/test_slurm_hooks.py`, and
`tests/integration/test_slurm_e2e.py` against a real slurmd.
"""

from __future__ import annotations

import logging
import pwd
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.wire import names

logger = logging.getLogger(__name__)

MAX_GPU_INDEX: Final = 1023
_GPU_ITEM: Final = re.compile(r"([0-9]{1,4})(?:-([0-9]{1,4}))?")


@dataclass(frozen=True)
class HookEnv:
    """One Prolog or Epilog run: the job, its user, this node and the job's GPUs here."""

    job_id: str
    user: str
    node: str
    gpus: tuple[int, ...]
    comment: str = ""
    array_job_id: str | None = None
    array_task_id: str | None = None
    context: str | None = None
    #: the MIG instances Slurm gave the job here (``CUDA_VISIBLE_DEVICES``); ``gpus`` then
    #: holds none until the local agent names their physical GPUs (`slurm.hooks.resolve_mig`)
    mig: tuple[str, ...] = ()

    @property
    def display_id(self) -> str:
        """``123_4`` for an array task (for logs), else the job id."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id


def parse_gpu_indices(text: str) -> tuple[int, ...]:
    """``0,1,3`` or ``0-3`` (Slurm's forms) → sorted unique indices; empty text → ()."""
    indices: set[int] = set()
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        match = _GPU_ITEM.fullmatch(item)
        if match is None:
            raise InputError(f"SLURM_JOB_GPUS: cannot read GPU index {item[:20]!r}")
        low = int(match[1])
        high = int(match[2]) if match[2] is not None else low
        if high < low or high > MAX_GPU_INDEX:
            raise InputError(f"SLURM_JOB_GPUS: GPU range {item!r} is out of order or too large")
        indices.update(range(low, high + 1))
    return tuple(sorted(indices))


def _user(environ: Mapping[str, str]) -> str:
    user = environ.get("SLURM_JOB_USER", "")
    if user:
        return user
    uid = environ.get("SLURM_JOB_UID", "")
    if uid.isdigit():
        try:
            return pwd.getpwuid(int(uid)).pw_name
        except KeyError:
            return f"uid{uid}"
    raise InputError("neither SLURM_JOB_USER nor SLURM_JOB_UID is set")


def hook_node(
    environ: Mapping[str, str], *, hostname: Callable[[], str] = socket.gethostname
) -> str:
    """This node's name as slurmd gives it (``SLURMD_NODENAME``), else the short host name."""
    return environ.get("SLURMD_NODENAME") or hostname().split(".", 1)[0]


def read_hook_env(
    environ: Mapping[str, str], *, hostname: Callable[[], str] = socket.gethostname
) -> HookEnv:
    """The job as slurmd describes it; `InputError` (one line) when it is not a job's hook.

    Measured on Slurm 22.05, the Prolog and Epilog see ``SLURM_JOB_ID``,
    ``SLURM_JOB_USER``/``SLURM_JOB_UID``, ``SLURMD_NODENAME``, ``SLURM_JOB_GPUS`` (the node's GPU
    indices, ``0,1``), ``CUDA_VISIBLE_DEVICES`` and ``SLURM_JOB_COMMENT``; an array task also
    ``SLURM_ARRAY_JOB_ID``/``SLURM_ARRAY_TASK_ID``. ``PATH`` is unset. The raw ``SLURM_JOB_ID``
    is registered, also for array tasks (each task has its own raw id; ``123_4`` is only a
    display form), so the Epilog, ``scancel``, ``squeue --json`` (``job_id``) and the head's
    reconcile all name a task the same way.

    A job on MIG instances is different (Slurm's source, not measured: no MIG here): Slurm
    lists each instance as a GRES record of its own and puts the record's position in
    ``SLURM_JOB_GPUS``, and its UUID (``MIG-…``) in ``CUDA_VISIBLE_DEVICES``, in the Prolog and
    Epilog too (gres/common ``gres_common_prep_set_env``). Those are taken (``mig``), and no
    index: the position is no GPU's index.
    """
    job_id = names.job_id(
        environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "", "SLURM_JOB_ID"
    )
    node = hook_node(environ, hostname=hostname)
    visible = environ.get("CUDA_VISIBLE_DEVICES", "")
    mig = tuple(
        names.mig_device(item.strip(), "CUDA_VISIBLE_DEVICES")
        for item in visible.split(",")
        if item.strip().startswith("MIG-")
    )
    gpus_text = environ.get("SLURM_JOB_GPUS")
    if mig:
        # Slurm numbers its GRES records, one per MIG instance, in SLURM_JOB_GPUS and in the
        # rest of CUDA_VISIBLE_DEVICES: positions in its list, not NVML's GPU indices
        gpus_text = ""
    elif gpus_text is None:
        # older slurmd or a gres plugin that does not set it: CUDA_VISIBLE_DEVICES holds the same
        # indices in the Prolog (no cgroup renumbering happens there)
        gpus_text = environ.get("CUDA_VISIBLE_DEVICES", "")
        if gpus_text in ("NoDevFiles", "-1"):
            gpus_text = ""
    return HookEnv(
        job_id=job_id,
        user=_user(environ),
        node=node,
        gpus=parse_gpu_indices(gpus_text),
        comment=environ.get("SLURM_JOB_COMMENT", ""),
        array_job_id=environ.get("SLURM_ARRAY_JOB_ID") or None,
        array_task_id=environ.get("SLURM_ARRAY_TASK_ID") or None,
        context=environ.get("SLURM_SCRIPT_CONTEXT") or None,
        mig=tuple(dict.fromkeys(mig)),
    )
