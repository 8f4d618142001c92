"""Running jobs from ``squeue --json`` (Slurm 22.05+), for the head's reconcile.

`slurm/` alone runs Slurm's commands, and never reaches `agent/` or `coordinator/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Safety" (The reconcile); tests:
`tests/unit/test_coordinator_reconcile.py`, `tests/integration/test_slurm_queue.py`.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from slurm_cdgpc.errors import InputError, SoftError, one_line
from slurm_cdgpc.slurm.env import parse_gpu_indices

logger = logging.getLogger(__name__)

SQUEUE: Final = Path("/usr/bin/squeue")
DEFAULT_TIMEOUT_S: Final = 10.0
#: the states in which a job holds its GPUs
ACTIVE_STATES: Final = frozenset({"RUNNING", "COMPLETING", "CONFIGURING"})
#: a pending job's reasons that mean it waits for resources to free up
WAITING_REASONS: Final = frozenset({"Resources", "Priority"})
#: the request fields that name a job's GPUs, in the versions' JSON and pyslurm alike
GPU_REQUEST_FIELDS: Final = (
    "tres_per_node",
    "tres_per_job",
    "tres_per_socket",
    "tres_per_task",
    "tres_req_str",
    "gres_per_node",
)
#: a hostlist naming more nodes than this is not read (no cluster has that many)
MAX_HOSTS: Final = 100_000
_BRACKET: Final = re.compile(r"\[([^\[\]]*)\]")
_GRES_GPU: Final = re.compile(r"gpu(?::[^:(]*)*\(IDX:([0-9,\-]*)\)")


class SqueueError(SoftError):
    """``squeue --json`` could not run or printed something that is not its JSON."""


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    user: str
    state: str
    nodes: str
    comment: str
    start_s: float | None
    time_limit_s: float | None
    array_job_id: str | None
    submit_s: float | None = None
    #: ``sbatch --deadline``; None when not set
    deadline_s: float | None = None
    #: node → the GPU indices the job holds there; empty when Slurm did not say
    gpus: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    #: why a pending job waits (``Resources``, ``Priority``, ``Dependency`` …)
    reason: str = ""
    #: the job asks for GPUs (a GPU GRES or TRES in its request)
    wants_gpus: bool = False

    @property
    def active(self) -> bool:
        """It holds its GPUs (`ACTIVE_STATES`)."""
        return self.state in ACTIVE_STATES

    @property
    def waits_for_gpus(self) -> bool:
        """Pending for want of resources (its own, or those of a job ahead of it), with GPUs."""
        return self.state == "PENDING" and self.reason in WAITING_REASONS and self.wants_gpus


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist syntax: ``n[1-2],gpu[08-10]x,rack[1-2]-n[1-2]`` → every name, in order.

    Zero padding is kept (``[08-10]`` → ``08, 09, 10``). Raises `InputError` on text Slurm would
    not print (unbalanced brackets, a reversed range) or more than `MAX_HOSTS` names.
    """
    names: list[str] = []
    for item in _split_top_level(text):
        names.extend(_expand_one(item))
        if len(names) > MAX_HOSTS:
            raise InputError(f"hostlist {text[:40]!r} names more than {MAX_HOSTS} nodes")
    return names


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if depth not in (0, 1):
            raise InputError(f"hostlist {text[:40]!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise InputError(f"hostlist {text[:40]!r}: unbalanced brackets")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_one(item: str) -> list[str]:
    match = _BRACKET.search(item)
    if match is None:
        if "[" in item or "]" in item:
            raise InputError(f"hostlist item {item[:40]!r}: unbalanced brackets")
        return [item]
    heads: list[str] = []
    for part in match[1].split(","):
        low, _, high = part.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise InputError(f"hostlist item {item[:40]!r}: cannot read range {part!r}")
        last = int(high) if high else int(low)
        if last < int(low) or last - int(low) > MAX_HOSTS:
            raise InputError(f"hostlist item {item[:40]!r}: range {part!r} is out of order")
        prefix = item[: match.start()]
        heads.extend(f"{prefix}{n:0{len(low)}d}" for n in range(int(low), last + 1))
    # the first bracket varies slowest, as Slurm prints them
    tails = _expand_one(item[match.end() :])
    if len(heads) * len(tails) > MAX_HOSTS:
        raise InputError(f"hostlist item {item[:40]!r} names more than {MAX_HOSTS} nodes")
    return [h + t for h in heads for t in tails]


def gres_gpu_indices(detail: str) -> tuple[int, ...]:
    """``gpu:2(IDX:0-1)`` or ``gpu:a100:2(IDX:0,2),mps:0(...)`` → the GPU indices; () if none."""
    indices: set[int] = set()
    for match in _GRES_GPU.finditer(detail):
        indices.update(parse_gpu_indices(match[1]))
    return tuple(sorted(indices))


def _allocation(nodes: str, detail: object) -> dict[str, tuple[int, ...]]:
    """Node → GPU indices, pairing the hostlist with ``gres_detail`` (one entry per node)."""
    if not nodes or not isinstance(detail, Sequence) or isinstance(detail, str):
        return {}
    names = expand_hostlist(nodes)
    if len(names) != len(detail):
        return {}
    pairs = ((name, gres_gpu_indices(str(d))) for name, d in zip(names, detail, strict=True))
    return {name: gpus for name, gpus in pairs if gpus}


def _number(value: object) -> float | None:
    """22.05: a plain number; 23.02+: {"set", "infinite", "number"}; unset/infinite → None."""
    if isinstance(value, Mapping):
        if not value.get("set", True) or value.get("infinite", False):
            return None
        value = value.get("number")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _state(value: object) -> str:
    if isinstance(value, list):
        return str(value[0]) if value else ""
    return str(value) if value is not None else ""


def parse_job(d: Mapping[str, Any]) -> SlurmJob | None:
    job_id = _number(d.get("job_id"))
    if job_id is None or job_id <= 0:
        return None
    array = _number(d.get("array_job_id"))
    limit_min = _number(d.get("time_limit"))
    start = _number(d.get("start_time"))
    submit = _number(d.get("submit_time"))
    deadline = _number(d.get("deadline"))
    nodes = str(d.get("nodes") or "")
    try:
        gpus = _allocation(nodes, d.get("gres_detail"))
    except InputError as e:
        logger.info("squeue --json: job %d: GPUs not read: %s", int(job_id), e)
        gpus = {}
    return SlurmJob(
        job_id=str(int(job_id)),
        user=str(d.get("user_name") or ""),
        state=_state(d.get("job_state")),
        nodes=nodes,
        comment=str(d.get("comment") or ""),
        start_s=start if start else None,
        time_limit_s=None if limit_min is None else limit_min * 60.0,
        array_job_id=str(int(array)) if array else None,
        submit_s=submit if submit else None,
        deadline_s=deadline if deadline else None,
        gpus=gpus,
        reason=_state(d.get("state_reason")),
        wants_gpus=asks_for_gpus(d.get(k) for k in GPU_REQUEST_FIELDS),
    )


def asks_for_gpus(requests: Iterable[object]) -> bool:
    """Whether any of a job's request fields names a GPU (``gres/gpu:4``, ``gres:gpu:2``)."""
    return any("gpu" in str(r).lower() for r in requests if r)


def parse_squeue_json(text: str | bytes) -> list[SlurmJob]:
    """Every readable job in ``squeue --json`` output.

    The shapes differ between versions and are read defensively: 22.05 gives ``job_state:
    "RUNNING"`` and plain integers (``job_id``, ``start_time``, ``time_limit`` in minutes);
    23.02+ give ``job_state: ["RUNNING"]`` and numbers as ``{"set": true, "infinite": false,
    "number": N}``. Both give ``nodes`` as a Slurm hostlist (``n[1-2]``) and ``gres_detail`` as
    one string per node in that order (``gpu:2(IDX:0-1)``, ``gpu:a100:1(IDX:3)``): the GPUs the
    job holds on each node. A job that cannot be read is skipped with a log line, never an
    exception."""
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise SqueueError(f"squeue --json printed something that is not JSON: {e}") from None
    jobs = data.get("jobs") if isinstance(data, dict) else None
    if not isinstance(jobs, list):
        raise SqueueError("squeue --json: no 'jobs' list in its output")
    out = []
    for item in jobs:
        job = parse_job(item) if isinstance(item, Mapping) else None
        if job is None:
            logger.info("squeue --json: skipped a job entry that cannot be read")
            continue
        out.append(job)
    return out


def running_jobs(jobs: Iterable[SlurmJob]) -> dict[str, SlurmJob]:
    """Of ``jobs``, those Slurm runs now (RUNNING, COMPLETING, CONFIGURING), by raw job id."""
    return {j.job_id: j for j in jobs if j.active}


def read_jobs(*, squeue: Path = SQUEUE, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[SlurmJob]:
    """Every job ``squeue --json`` shows: running, pending and finishing.

    The head calls it every few intervals to finish registered jobs that Slurm no longer runs
    (an Epilog that never reached it) and to adopt running jobs that never registered
    (`slurm_cdgpc.coordinator.reconcile`)."""
    try:
        result = subprocess.run(
            [str(squeue), "--json"],
            capture_output=True,
            timeout=timeout_s,
            env={"LC_ALL": "C"},
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SqueueError(f"squeue --json failed: {e}") from e
    if result.returncode != 0:
        message = one_line(result.stderr.decode("utf-8", "replace"))
        raise SqueueError(f"squeue --json exited {result.returncode}: {message}")
    return parse_squeue_json(result.stdout)
