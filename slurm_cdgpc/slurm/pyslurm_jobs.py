"""Running jobs through pyslurm, for the head's reconcile, when pyslurm imports.

Optional (PyPI's pyslurm is built for one Slurm release); the head falls back to
`slurm_cdgpc.slurm.squeue`. `slurm/` alone imports pyslurm, and never reaches `agent/` or
`coordinator/` (`tests/unit/test_import_graph.py`). Test: `tests/unit/test_slurm_pyslurm.py`.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from slurm_cdgpc.errors import CdgpcError
from slurm_cdgpc.slurm.env import parse_gpu_indices
from slurm_cdgpc.slurm.squeue import GPU_REQUEST_FIELDS, SlurmJob, SqueueError, asks_for_gpus

logger = logging.getLogger(__name__)


def load_pyslurm() -> ModuleType | None:
    """pyslurm, or None when it does not import (not installed, or built for another Slurm).

    pyslurm talks to slurmctld through libslurm instead of starting ``squeue --json`` every
    period, which matters on a busy controller; PyPI's pyslurm is built for one Slurm release
    (25.11)."""
    try:
        return importlib.import_module("pyslurm")
    except Exception as e:  # a libslurm of another release raises ImportError or OSError alike
        logger.debug("pyslurm unavailable: %s", e)
        return None


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        return None
    return float(value)


def _gpus(layout: object) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    if not isinstance(layout, Mapping):
        return out
    for node, resources in layout.items():
        gres = resources.get("gres") if isinstance(resources, Mapping) else None
        indices: set[int] = set()
        for name, detail in (gres or {}).items():
            if str(name).split(":")[0] == "gpu" and isinstance(detail, Mapping):
                indices.update(parse_gpu_indices(str(detail.get("indexes") or "")))
        if indices:
            out[str(node)] = tuple(sorted(indices))
    return out


def parse_job(job: Any) -> SlurmJob:
    """One pyslurm ``Job`` as a `SlurmJob` (raises on a job that cannot be read).

    Reads pyslurm's documented job API: ``id``, ``user_name``, ``state``, ``allocated_nodes``,
    ``comment``, ``submit_time``, ``start_time``, ``time_limit`` in minutes, ``deadline``,
    ``array_id``, ``state_reason``, the GPU request fields of `GPU_REQUEST_FIELDS`, and
    ``get_resource_layout_per_node()``, whose ``gres`` per node reads
    ``{"gpu:a100": {"count": "2", "indexes": "0-1"}}``."""
    limit_min = _number(job.time_limit)
    array = _number(getattr(job, "array_id", None))
    return SlurmJob(
        job_id=str(int(job.id)),
        user=str(job.user_name or ""),
        state=str(job.state or ""),
        nodes=str(job.allocated_nodes or ""),
        comment=str(job.comment or ""),
        start_s=_number(job.start_time),
        time_limit_s=None if limit_min is None else limit_min * 60.0,
        array_job_id=None if array is None else str(int(array)),
        submit_s=_number(job.submit_time),
        deadline_s=_number(getattr(job, "deadline", None)),
        gpus=_gpus(job.get_resource_layout_per_node()),
        reason=str(getattr(job, "state_reason", "") or ""),
        wants_gpus=asks_for_gpus(getattr(job, f, None) for f in GPU_REQUEST_FIELDS),
    )


def read_jobs(pyslurm: ModuleType) -> list[SlurmJob]:
    """Every job slurmctld knows (``pyslurm.Jobs.load()``): running, pending and finishing.

    A job that cannot be read is skipped with a log line, never an exception."""
    try:
        jobs = pyslurm.Jobs.load()
    except Exception as e:  # pyslurm raises its own RPCError and others
        raise SqueueError(f"pyslurm could not load the jobs: {e}") from e
    out: list[SlurmJob] = []
    for key, job in dict(jobs).items():
        try:
            out.append(parse_job(job))
        except (CdgpcError, AttributeError, TypeError, ValueError) as e:
            logger.info("pyslurm: skipped job %s that cannot be read: %s", key, e)
    return out
