"""The bundled trace slice (``data/elasticflow_cluster04_slice.csv``, see ``data/NOTICE``)."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from slurm_cdgpc.errors import InputError

DATA_DIR: Final = Path(__file__).resolve().parent / "data"
SLICE: Final = DATA_DIR / "elasticflow_cluster04_slice.csv"
#: Slurm job ids of the replayed jobs start here, in submission order
FIRST_JOB_ID: Final = 1001


@dataclass(frozen=True)
class TraceJob:
    """One job of the slice; times in trace seconds, relative to the slice's first submission."""

    job_id: str
    trace_id: str
    submit_s: float
    gpus: int
    duration_s: float  # measured, at full speed
    iterations: int
    deadline_s: float  # relative to submit_s
    model: str

    @property
    def iteration_time_s(self) -> float:
        return self.duration_s / self.iterations


def load_slice(path: Path = SLICE) -> list[TraceJob]:
    """The jobs of an ElasticFlow ``with_deadlines`` CSV, in submission order."""
    try:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise InputError(f"cannot read the demo trace {path}: {e.strerror or e}") from e
    try:
        rows.sort(key=lambda r: int(r["submission_time"]))
        start = int(rows[0]["submission_time"]) if rows else 0
        return [
            TraceJob(
                job_id=str(FIRST_JOB_ID + i),
                trace_id=r["job_id"],
                submit_s=float(int(r["submission_time"]) - start),
                gpus=int(r["num_gpu"]),
                duration_s=float(r["duration"]),
                iterations=int(r["num_iteration"]),
                deadline_s=float(int(r["deadline"]) - int(r["submission_time"])),
                model=r["model_name"],
            )
            for i, r in enumerate(rows)
        ]
    except (KeyError, ValueError) as e:
        raise InputError(f"{path}: not an ElasticFlow trace with deadlines: {e}") from None
