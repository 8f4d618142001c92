"""Job traces for the cluster simulator: the `Trace` type, one loader per format, `load_trace`.

Every loader is strict: what it cannot read is one `TraceFormatError` line, never a traceback.
Each format's columns are on its loader. Design: DESIGN.md, "Simulator" (Traces); tests:
`tests/unit/test_sim_traces.py`, `tests/security/test_fuzz.py`.
"""

from __future__ import annotations

import codecs
import csv
import io
import logging
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from itertools import chain, pairwise
from pathlib import Path
from types import MappingProxyType
from typing import Final, NamedTuple, NoReturn

import numpy as np
import numpy.typing as npt

from slurm_cdgpc.errors import InputError, one_line
from slurm_cdgpc.slurm.comment import parse_deadline
from slurm_cdgpc.units import span_s

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
StrArray = npt.NDArray[np.str_]
BoolArray = npt.NDArray[np.bool_]

#: `Trace.gpu_milli` of a job on whole GPUs
WHOLE_GPU: Final = 1000
FORMATS = ("elasticflow", "chronus", "alibaba2023", "cdgpc")
JOB_TYPES = ("strict", "soft", "best-effort", "")

_MAX_TIME_S = 1e12  # ~31,700 years: bounds every time and span, so sums of two stay finite
_MAX_COUNT = 2**31 - 1  # GPUs of one job
_SHOWN_CHARS = 43  # longest cell quoted in an error message (40 and "...")
_CHRONUS_S_PER_UNIT = 60.0  # Chronus traces are in minutes
_CHRONUS_JOB_TYPES = {"strict": "strict", "soft": "soft", "best": "best-effort"}
_CDGPC_JOB_TYPES = {"strict": "strict", "soft": "soft", "best-effort": "best-effort", "": ""}
_CDGPC_JOB_TYPES["best"] = "best-effort"
_NO_TIME = frozenset({"", "unknown", "none"})  # sacct's words for a start or end that is not there
_SACCT_FIELDS = ("JobID", "Submit", "Start", "End", "AllocTRES", "Comment")

_LINE_BREAK = re.compile(r"\r\n|\r|\n")
_LINE_BREAK_BYTES = re.compile(rb"\r\n|\r|\n")
_EPOCH = re.compile(r"[0-9]+(?:\.[0-9]+)?")
_COMMENT_ITEM = re.compile(r"(?<![\w-])(deadline|iters)\s*=([^,]*)", re.IGNORECASE)


class TraceFormatError(InputError):
    """A trace file that cannot be read; the message is one line: ``file:line: column 'c': why``."""


_COLUMNS: tuple[tuple[str, type[np.generic]], ...] = (
    ("job_id", np.str_),
    ("submit_s", np.float64),
    ("duration_s", np.float64),
    ("num_gpu", np.int64),
    ("deadline_s", np.float64),
    ("iterations", np.float64),
    ("model_name", np.str_),
    ("gpu_type", np.str_),
    ("job_type", np.str_),
    ("time_limit_s", np.float64),
    ("gpu_milli", np.int64),
)


@dataclass(frozen=True, eq=False, repr=False)
class Trace:
    """The jobs of one trace, one row per job, sorted by submission (ties keep the file's order).

    The arrays are read-only copies. Times are seconds on the trace's own clock
    (`time_unit_note` says which); NaN and "" mean "not in the trace".
    """

    job_id: StrArray
    submit_s: FloatArray
    duration_s: FloatArray  # measured run time; the simulator's duration at max clocks
    num_gpu: IntArray  # >= 1
    deadline_s: FloatArray  # absolute, on the clock of submit_s; NaN: none
    iterations: FloatArray  # NaN: unknown
    model_name: StrArray  # "": unknown
    gpu_type: StrArray  # "": any; "T4|P100": either
    job_type: StrArray  # "strict", "soft", "best-effort"; "": the trace has no classes
    source: str  # the format, one of FORMATS
    time_unit_note: str
    skipped: int = 0  # rows of the file that are not jobs here (no GPUs, never ran, job steps)
    cluster_gpus: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    #: Slurm's time limit per job, from its start (NaN: not in the trace; empty: none has one).
    #: No format read here carries one: the simulator draws them (`slurm_cdgpc.sim.reporting`)
    time_limit_s: FloatArray = field(default_factory=lambda: np.zeros(0))
    #: per job, the thousandths of one GPU it asks for: 1000 for whole GPUs (empty: all),
    #: less for a one-GPU job that shares its GPU with others (Alibaba's ``gpu_milli``)
    gpu_milli: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def __post_init__(self) -> None:
        n = len(np.atleast_1d(self.job_id))
        if np.size(self.time_limit_s) == 0:
            object.__setattr__(self, "time_limit_s", np.full(n, np.nan))
        if np.size(self.gpu_milli) == 0:
            object.__setattr__(self, "gpu_milli", np.full(n, WHOLE_GPU, dtype=np.int64))
        for name, dtype in _COLUMNS:
            column = np.array(getattr(self, name), dtype=dtype)
            if column.shape != (n,):
                raise InputError(f"Trace.{name} has shape {column.shape}, job_id has ({n},)")
            column.setflags(write=False)
            object.__setattr__(self, name, column)
        object.__setattr__(self, "cluster_gpus", MappingProxyType(dict(self.cluster_gpus)))
        if not np.all(np.isfinite(self.submit_s)) or np.any(np.diff(self.submit_s) < 0):
            raise InputError("Trace.submit_s must be finite and sorted")
        if not np.all(np.isfinite(self.duration_s)) or np.any(self.duration_s < 0):
            raise InputError("Trace.duration_s must be finite and >= 0")
        if np.any(self.num_gpu < 1):
            raise InputError("Trace.num_gpu must be >= 1")
        shared = self.gpu_milli != WHOLE_GPU
        if np.any(
            (self.gpu_milli < 1) | (self.gpu_milli > WHOLE_GPU) | (shared & (self.num_gpu > 1))
        ):
            raise InputError("Trace.gpu_milli must be 1 … 1000, and 1000 for a job of several GPUs")
        limit_s = self.time_limit_s
        if np.any(~(np.isfinite(limit_s) & (limit_s > 0)) & ~np.isnan(limit_s)):
            raise InputError("Trace.time_limit_s must be finite and > 0, or NaN")
        if np.any(np.isinf(self.deadline_s)) or np.any(self.iterations < 0):
            raise InputError("Trace.deadline_s must be finite or NaN, iterations >= 0 or NaN")
        unknown = set(np.unique(self.job_type).tolist()) - set(JOB_TYPES)
        if unknown:
            raise InputError(f"Trace.job_type has {sorted(unknown)}; allowed: {JOB_TYPES}")

    def __len__(self) -> int:
        return len(self.job_id)

    def __repr__(self) -> str:
        return f"Trace(source={self.source!r}, jobs={len(self)}, skipped={self.skipped})"

    def head(self, n: int) -> Trace:
        """The first ``n`` jobs by submission (all of them if there are fewer)."""
        if n < 0:
            raise InputError(f"head({n}): the number of jobs must be >= 0")
        return self._take(slice(0, n))

    def select(self, mask: npt.ArrayLike) -> Trace:
        """The jobs where the boolean ``mask`` (one entry per job) is true, in order."""
        keep = np.asarray(mask)
        if keep.dtype != np.bool_ or keep.shape != (len(self),):
            raise InputError(
                f"select() needs a boolean mask of shape ({len(self)},), "
                f"got {keep.dtype} of shape {keep.shape}"
            )
        return self._take(keep)

    def _take(self, index: slice | BoolArray) -> Trace:
        return replace(self, **{name: getattr(self, name)[index] for name, _ in _COLUMNS})


# --- public loaders -----------------------------------------------------------------------------


def load_trace(path: str | os.PathLike[str], format: str | None = None) -> Trace:
    """Read a trace file; ``format`` (one of `FORMATS`) is detected from the header when None.

    ``duration_s`` is the run time the trace measured; the simulator treats it as the duration
    at maximum clocks. Jobs without GPUs are not jobs here: they are skipped, logged and counted
    in `Trace.skipped`.
    """
    if format is not None and format not in FORMATS:
        raise InputError(f"unknown trace format {format!r}; known: {', '.join(FORMATS)}")
    name, text = _read_text(Path(path))
    return _PARSERS[format or _detect(name, text)](name, text)


def elasticflow(path: str | os.PathLike[str]) -> Trace:
    """Microsoft ITP jobs from microsoft/elasticflow-traces (``raw/`` or ``with_deadlines/``).

    As published by ElasticFlow (MIT). ``raw/clusterNN.csv``: ``job_id, submission_time,
    duration, num_gpu``. ``with_deadlines/clusterNN.csv`` and ``195job.csv`` add
    ``num_iteration, model_name, deadline, batch_size`` (columns in any order), made up by the
    ElasticFlow authors; ``batch_size`` is not kept. Seconds since the start of collection;
    ``deadline`` is absolute, on the same clock. No job classes.
    """
    return _elasticflow(*_read_text(Path(path)))


def chronus(path: str | os.PathLike[str]) -> Trace:
    """Philly jobs with SLOs from ChronusArtifact; minutes in the file, seconds in the trace.

    S-Lab-System-Group/ChronusArtifact (MIT; Philly CC-BY-4.0),
    ``trace_job_Philly_{SLO,MIX1,MIX2}.csv``. Why the unit is minutes and the deadline an offset:
    DESIGN.md, "Simulator" (Traces). ``expect_time_list`` holds '-'-separated deadlines,
    ``expect_value_list`` the utility of meeting each (soft jobs: four deadlines worth
    10-8-5-2); the job's deadline is the first one, added to ``submit_time`` as Chronus does.
    For best-effort jobs the list holds ``submit_time`` itself, a placeholder: they get no
    deadline (NaN). ``job_type`` strict / soft / best becomes "strict" / "soft" / "best-effort".
    """
    return _chronus(*_read_text(Path(path)))


def alibaba2023(
    path: str | os.PathLike[str], nodes_path: str | os.PathLike[str] | None = None
) -> Trace:
    """GPU pods of Alibaba's 2023 trace; ``nodes_path`` adds the cluster's GPUs by type.

    alibaba/clusterdata, cluster-trace-gpu-v2023 (research or study use only; Weng et al.,
    ATC'23), ``openb_pod_list_*.csv``. Read: ``name, num_gpu, creation_time, deletion_time,
    scheduled_time, gpu_spec`` (seconds since the start of the trace). Submission is
    ``creation_time``; duration is ``deletion_time - scheduled_time``, or ``deletion_time -
    creation_time`` for pods never scheduled (how long they waited before deletion); pods alive
    at the end of the trace are cut there. ``gpu_spec`` (allowed GPU types, '|'-separated, empty
    = any) becomes ``gpu_type``. ``gpu_milli`` (thousandths of a GPU, below 1000 for a pod that
    shares its one GPU) becomes `Trace.gpu_milli`: the simulator packs such pods onto shared
    GPUs. The resampled lists without times (``openb_pod_list_multigpu50.csv``
    and kin) cannot be replayed. ``nodes_path`` (``openb_node_list_gpu_node.csv``) fills
    `Trace.cluster_gpus` and checks that every GPU type a pod asks for exists.
    """
    nodes = None if nodes_path is None else _alibaba_nodes(*_read_text(Path(nodes_path)))
    return _alibaba2023(*_read_text(Path(path)), nodes=nodes)


def cdgpc(path: str | os.PathLike[str]) -> Trace:
    """Our CSV of finished Slurm jobs, or ``sacct --parsable2`` output, for any Slurm cluster.

    The CSV: a header, then one row per job. Required columns: ``job_id, submit, start, end,
    num_gpu``. Optional: ``deadline, comment, gpu_type, job_type, model_name, iterations``.
    Others are ignored.

    * Times (``submit``, ``start``, ``end``, an absolute ``deadline``) are ISO 8601
      (``2026-03-01T10:00:00``, with or without a UTC offset) or a bare number of seconds since
      the Unix epoch; the trace holds epoch seconds. An ISO time without an offset is read in
      the local time zone of the machine that loads it, as ``sacct`` prints local times: set
      ``TZ`` to the cluster's zone.
    * ``duration_s = end - start``. A job whose ``start`` or ``end`` is empty, ``Unknown`` or
      ``None`` never ran or has not finished and is skipped, as is a job with ``num_gpu`` 0.
    * ``deadline``: empty (none), or a deadline as ``sbatch --comment=deadline=`` takes it
      (`slurm_cdgpc.slurm.comment.parse_deadline`): an ISO 8601 time (without an offset: local
      time), epoch seconds, or ``+`` a span after submission: ``+6h``, ``+90m``, ``+1h30m``,
      ``+3600s``, ``+2d`` (m is minutes).
    * ``comment``: the job's Slurm comment with ``key=value`` items, as users give them to
      ``sbatch --comment=deadline=2026-12-01T12:00,iters=5000``. ``deadline`` (same forms) and
      ``iters`` are read where the ``deadline`` / ``iterations`` columns are absent or empty.
      An item runs to the next comma; text around the items is ignored.
    * ``job_type``: strict, soft, best-effort (or best), or empty.

    ``sacct`` output is read without conversion (it is recognised by its '|' separators)::

        sacct --parsable2 --noheader -X --allusers --starttime 2026-01-01 --endtime now \\
              --format=JobID,Submit,Start,End,AllocTRES,Comment > jobs.txt

    The six fields must come in this order (Comment last, so that it may hold '|'); a header
    line (without ``--noheader``) is skipped. The GPU count is ``gres/gpu=N`` in AllocTRES, the
    GPU type comes from ``gres/gpu:TYPE=N``; Slurm records them only with
    ``AccountingStorageTRES=gres/gpu`` in slurm.conf. The Comment is read like the ``comment``
    column. Job steps (a '.' in the JobID) and jobs that never started, are still running or had
    no GPUs are skipped.
    """
    return _cdgpc(*_read_text(Path(path)))


# --- reading a file -----------------------------------------------------------------------------


def _quote(text: str) -> str:
    """``text`` in quotes for an error message: cut short, always one printable line."""
    return f"'{one_line(text, _SHOWN_CHARS, empty='')}'"


def _read_text(path: Path) -> tuple[str, str]:
    """The file's name (for messages) and its text; not UTF-8 or blank is an error."""
    name = path.name or str(path)
    if not name.isprintable():
        name = ascii(name)[1:-1]
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TraceFormatError(f"{name}: cannot read the file: {e.strerror or e}") from e
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        where = _where_in_bytes(data, e.start)
        raise TraceFormatError(f"{name}:{where}byte 0x{data[e.start]:02x} is not UTF-8 text") from e
    if not text.strip():
        raise TraceFormatError(f"{name}:1: the file is empty (no header, no jobs)")
    return name, text


def _where_in_bytes(data: bytes, offset: int) -> str:
    """``line: column 'c': `` for a byte offset, the column guessed by counting separators."""
    breaks = [m.end() for m in _LINE_BREAK_BYTES.finditer(data, 0, offset)]
    line = len(breaks) + 1
    first = _LINE_BREAK_BYTES.split(data, maxsplit=1)[0]
    sacct = b"|" in first
    if line == 1 and not sacct:
        return "1: header: "
    names = _SACCT_FIELDS if sacct else first.decode("utf-8", "replace").split(",")
    k = data[breaks[-1] if breaks else 0 : offset].count(b"|" if sacct else b",")
    return f"{line}: column {_quote(names[k].strip())}: " if k < len(names) else f"{line}: "


@dataclass
class _Table:
    """The rows of one file as text, with the line each starts on; reads its columns strictly."""

    name: str
    header: tuple[str, ...]
    header_line: int
    rows: list[list[str]]
    lines: list[int]

    def __post_init__(self) -> None:
        self.index = {column: k for k, column in enumerate(self.header)}
        self._columns: list[tuple[str, ...]] | None = None

    def fail(self, i: int, column: str, why: str) -> NoReturn:
        raise TraceFormatError(f"{self.name}:{self.lines[i]}: column {_quote(column)}: {why}")

    def has(self, column: str) -> bool:
        return column in self.index

    def require(self, *columns: str, hint: str = "") -> None:
        for column in columns:
            if column not in self.index:
                raise TraceFormatError(
                    f"{self.name}:{self.header_line}: column {_quote(column)}: missing from the "
                    f"header {_quote(','.join(self.header))}{hint}"
                )

    def text(self, column: str) -> list[str]:
        if self._columns is None:
            self._columns = list(zip(*self.rows, strict=True))
        return list(self._columns[self.index[column]])

    def numbers(
        self,
        column: str,
        *,
        low: float = 0.0,
        high: float = _MAX_TIME_S,
        empty: float | None = None,
    ) -> FloatArray:
        """Column as floats in [low, high]; an empty cell is ``empty``, or an error when None."""
        cells = self.text(column)
        if empty is None:  # fast path, when every cell is good; the loop below says which is not
            try:
                out = np.array(list(map(float, cells)), dtype=np.float64)
            except ValueError:
                pass
            else:
                if np.all((out >= low) & (out <= high)):  # NaN fails both
                    return out
        out = np.empty(len(cells))
        for i, cell in enumerate(cells):
            if empty is not None and not cell.strip():
                out[i] = empty
                continue
            out[i] = self.number(i, column, cell, low=low, high=high)
        return out

    def number(self, i: int, column: str, cell: str, *, low: float, high: float) -> float:
        try:
            value = float(cell)
        except ValueError:
            self.fail(i, column, f"cannot read {_quote(cell)} as a number")
        if not math.isfinite(value):
            self.fail(i, column, f"{_quote(cell)} is not a finite number")
        if value < low:
            self.fail(i, column, f"{_quote(cell)} is {'negative' if low == 0 else 'too small'}")
        if value > high:
            self.fail(i, column, f"{_quote(cell)} is too large")
        return value

    def counts(self, column: str) -> IntArray:
        """Column as whole numbers >= 0 (GPU counts)."""
        cells = self.text(column)
        try:  # fast path, as in numbers()
            values = list(map(int, cells))
        except ValueError:
            pass
        else:
            if min(values) >= 0 and max(values) <= _MAX_COUNT:
                return np.array(values, dtype=np.int64)
        out = np.empty(len(cells), dtype=np.int64)
        for i, cell in enumerate(cells):
            out[i] = self.count(i, column, cell)
        return out

    def count(self, i: int, column: str, cell: str) -> int:
        try:
            value = int(cell)
        except ValueError:
            self.fail(i, column, f"cannot read {_quote(cell)} as a whole number")
        if value < 0:
            self.fail(i, column, f"{_quote(cell)} is negative")
        if value > _MAX_COUNT:
            self.fail(i, column, f"{_quote(cell)} is too large")
        return value

    def time(self, i: int, column: str, cell: str) -> float:
        """ISO 8601 (naive: local time) or epoch seconds, as epoch seconds."""
        text = cell.strip()
        if _EPOCH.fullmatch(text):
            value = float(text)
        else:
            try:
                value = datetime.fromisoformat(text).timestamp()
            except (ValueError, OverflowError, OSError):
                self.fail(i, column, f"cannot read {_quote(cell)} as an ISO 8601 time")
        if not -_MAX_TIME_S <= value <= _MAX_TIME_S:
            self.fail(i, column, f"{_quote(cell)} is out of range")
        return value


def _csv_table(name: str, text: str) -> _Table:
    """Split CSV text into header and rows; every row must have one field per header column."""
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    header: tuple[str, ...] | None = None
    header_line = 0
    rows: list[list[str]] = []
    lines: list[int] = []
    previous = 0
    try:
        for row in reader:
            line, previous = previous + 1, reader.line_num
            if header is not None and len(row) == len(header) and row[0].strip():
                rows.append(row)  # the common case, first
                lines.append(line)
                continue
            if not any(cell.strip() for cell in row):
                continue  # blank line, or a spreadsheet's row of empty cells
            if header is None:
                header, header_line = tuple(cell.strip() for cell in row), line
                _check_header(name, line, header)
                continue
            if len(row) != len(header):
                _wrong_width(name, line, header, row)
            rows.append(row)
            lines.append(line)
    except csv.Error as e:  # reported on the line where the broken record starts
        raise TraceFormatError(f"{name}:{previous + 1}: not valid CSV: {e}") from e
    if header is None:
        raise TraceFormatError(f"{name}:1: the file is empty (no header, no jobs)")
    if not rows:
        raise TraceFormatError(f"{name}:{header_line + 1}: no jobs, only a header")
    return _Table(name, header, header_line, rows, lines)


def _check_header(name: str, line: int, header: tuple[str, ...]) -> None:
    seen: set[str] = set()
    for column in header:
        if column and column in seen:
            raise TraceFormatError(f"{name}:{line}: column {_quote(column)}: named twice")
        seen.add(column)


def _wrong_width(name: str, line: int, header: tuple[str, ...], row: list[str]) -> NoReturn:
    if len(row) < len(header):
        raise TraceFormatError(
            f"{name}:{line}: column {_quote(header[len(row)])}: missing "
            f"(the row has {len(row)} fields, the header {len(header)})"
        )
    raise TraceFormatError(
        f"{name}:{line}: {len(row)} fields, but the header names {len(header)} columns"
    )


def _detect(name: str, text: str) -> str:
    """The format whose signature columns the first non-blank line holds."""
    lines = _LINE_BREAK.split(text)
    line_no, first = next((k, s) for k, s in enumerate(lines, start=1) if s.strip())
    if "|" in first:
        return "cdgpc"  # sacct --parsable2
    columns = {cell.strip() for cell in first.split(",")}
    if "submission_time" in columns:
        return "elasticflow"
    if "expect_time_list" in columns or "submit_time" in columns:
        return "chronus"
    if columns & {"creation_time", "gpu_milli", "pod_phase"}:
        return "alibaba2023"
    if {"job_id", "submit"} <= columns:
        return "cdgpc"
    hint = ""
    if {"sn", "model"} <= columns:
        hint = "; it looks like an Alibaba node list: pass it as nodes_path to alibaba2023()"
    raise TraceFormatError(
        f"{name}:{line_no}: unknown trace format: header {_quote(first)} is none of "
        f"{', '.join(FORMATS)}{hint}"
    )


def _trace(
    table: _Table,
    source: str,
    note: str,
    keep: BoolArray,
    *,
    id_column: str,
    job_id: Sequence[str],
    submit_s: FloatArray,
    duration_s: FloatArray,
    num_gpu: IntArray,
    deadline_s: FloatArray | None = None,
    iterations: FloatArray | None = None,
    model_name: Sequence[str] | None = None,
    gpu_type: Sequence[str] | None = None,
    job_type: Sequence[str] | None = None,
    cluster_gpus: Mapping[str, int] | None = None,
    gpu_milli: IntArray | None = None,
    skipped_why: str = "no GPUs",
) -> Trace:
    """Keep the rows ``keep``, check their ids, sort them by submission, and build the Trace."""
    rows = np.flatnonzero(keep)
    if rows.size == 0:
        raise TraceFormatError(
            f"{table.name}: no jobs left: all {len(keep)} rows were skipped ({skipped_why})"
        )
    job_id = [cell.strip() for cell in job_id]
    first_line: dict[str, int] = {}
    for i in rows.tolist():
        key = job_id[i]
        if not key:
            table.fail(i, id_column, "empty job id")
        if key in first_line:
            table.fail(i, id_column, f"{_quote(key)} was used on line {first_line[key]}")
        first_line[key] = table.lines[i]
    order = rows[np.argsort(submit_s[rows], kind="stable")]
    skipped = len(keep) - rows.size
    if skipped:
        logger.info("%s: skipped %d of %d rows (%s)", table.name, skipped, len(keep), skipped_why)

    def strings(values: Sequence[str] | None) -> StrArray:
        if values is None:
            return np.full(order.size, "", dtype=np.str_)
        return np.array([cell.strip() for cell in values], dtype=np.str_)[order]

    def floats(values: FloatArray | None) -> FloatArray:
        return np.full(order.size, np.nan) if values is None else values[order]

    return Trace(
        job_id=strings(job_id),
        submit_s=submit_s[order],
        duration_s=duration_s[order],
        num_gpu=num_gpu[order],
        deadline_s=floats(deadline_s),
        iterations=floats(iterations),
        model_name=strings(model_name),
        gpu_type=strings(gpu_type),
        job_type=strings(job_type),
        source=source,
        time_unit_note=note,
        skipped=skipped,
        cluster_gpus=cluster_gpus or {},
        gpu_milli=np.zeros(0, dtype=np.int64) if gpu_milli is None else gpu_milli[order],
    )


# --- ElasticFlow --------------------------------------------------------------------------------


def _elasticflow(name: str, text: str) -> Trace:
    table = _csv_table(name, text)
    table.require("job_id", "submission_time", "duration", "num_gpu")
    note = "seconds since the start of collection (2021-03-04)"
    deadline_s = None
    if table.has("deadline"):
        deadline_s = table.numbers("deadline")
        note += "; deadline absolute on the same clock, synthetic (ElasticFlow authors)"
    num_gpu = table.counts("num_gpu")
    return _trace(
        table,
        "elasticflow",
        note,
        num_gpu > 0,
        id_column="job_id",
        job_id=table.text("job_id"),
        submit_s=table.numbers("submission_time"),
        duration_s=table.numbers("duration"),
        num_gpu=num_gpu,
        deadline_s=deadline_s,
        iterations=table.numbers("num_iteration") if table.has("num_iteration") else None,
        model_name=table.text("model_name") if table.has("model_name") else None,
    )


# --- Chronus ------------------------------------------------------------------------------------


def _chronus(name: str, text: str) -> Trace:
    table = _csv_table(name, text)
    table.require(
        "job_id",
        "num_gpu",
        "submit_time",
        "iterations",
        "model_name",
        "duration",
        "expect_time_list",
        "expect_value_list",
        "job_type",
    )
    job_type = []
    for i, cell in enumerate(table.text("job_type")):
        kind = _CHRONUS_JOB_TYPES.get(cell.strip())
        if kind is None:
            table.fail(i, "job_type", f"{_quote(cell)} is not strict, soft or best")
        job_type.append(kind)
    if table.has("best_effort"):
        for i, cell in enumerate(table.text("best_effort")):
            if cell.strip() != ("1" if job_type[i] == "best-effort" else "0"):
                table.fail(i, "best_effort", f"{_quote(cell)} contradicts job_type {job_type[i]}")
    # Chronus's unit is the minute: t_s = 60 * t_file. The first expected time is an offset from
    # submission: deadline = submit + expect_time[0]; best-effort jobs carry a placeholder.
    submit = table.numbers("submit_time")
    first = _first_deadlines(table)
    strict_or_soft = np.array([kind != "best-effort" for kind in job_type])
    deadline = np.where(strict_or_soft, submit + first, np.nan)
    num_gpu = table.counts("num_gpu")
    return _trace(
        table,
        "chronus",
        "minutes in the file (undocumented; Chronus counts 60 units to the hour), converted to "
        "seconds; deadline = submit + the first expect_time (an offset); best-effort: none",
        num_gpu > 0,
        id_column="job_id",
        job_id=table.text("job_id"),
        submit_s=submit * _CHRONUS_S_PER_UNIT,
        duration_s=table.numbers("duration") * _CHRONUS_S_PER_UNIT,
        num_gpu=num_gpu,
        deadline_s=deadline * _CHRONUS_S_PER_UNIT,
        iterations=table.numbers("iterations"),
        model_name=table.text("model_name"),
        job_type=job_type,
    )


def _first_deadlines(table: _Table) -> FloatArray:
    """expect_time_list[0] of every row, after checking both '-'-separated lists."""
    cells, values = table.text("expect_time_list"), table.text("expect_value_list")
    try:  # fast path, when every row is good; the loop below says which is not
        parts = [cell.split("-") for cell in cells]
        n_times = np.array(list(map(len, parts)))
        n_worth = np.array([cell.count("-") + 1 for cell in values])
        flat = np.array(list(map(float, chain.from_iterable(parts))), dtype=np.float64)
        flat_worth = np.array(list(map(float, "-".join(values).split("-"))), dtype=np.float64)
    except ValueError:
        pass
    else:
        starts = np.cumsum(n_times) - n_times
        within = np.ones(max(flat.size - 1, 0), dtype=np.bool_)  # pairs inside one row
        within[starts[1:] - 1] = False
        if (
            np.all((flat >= 0) & (flat <= _MAX_TIME_S))
            and np.all((flat_worth >= 0) & (flat_worth <= _MAX_TIME_S))
            and np.array_equal(n_times, n_worth)
            and np.all(np.diff(flat)[within] > 0)
        ):
            first: FloatArray = flat[starts]
            return first
    out = np.empty(len(cells))
    for i, cell in enumerate(cells):
        times = [_non_negative(table, i, "expect_time_list", t) for t in cell.split("-")]
        worth = [_non_negative(table, i, "expect_value_list", v) for v in values[i].split("-")]
        if len(worth) != len(times):
            table.fail(i, "expect_value_list", f"{len(worth)} utilities for {len(times)} deadlines")
        if any(later <= earlier for earlier, later in pairwise(times)):
            table.fail(i, "expect_time_list", f"deadlines {_quote(cell)} do not increase")
        out[i] = times[0]
    return out


def _non_negative(table: _Table, i: int, column: str, cell: str) -> float:
    return table.number(i, column, cell, low=0.0, high=_MAX_TIME_S)


# --- Alibaba 2023 -------------------------------------------------------------------------------


def _alibaba2023(name: str, text: str, nodes: tuple[str, dict[str, int]] | None = None) -> Trace:
    table = _csv_table(name, text)
    table.require("name", "num_gpu")
    table.require(
        "creation_time",
        "deletion_time",
        "scheduled_time",
        hint=" (the resampled pod lists such as openb_pod_list_multigpu50.csv carry no times; "
        "replay openb_pod_list_default.csv or gpuspec33)",
    )
    created = table.numbers("creation_time")
    scheduled = table.numbers("scheduled_time", empty=np.nan)
    deleted = table.numbers("deletion_time")
    # A pod runs from scheduling (creation if never scheduled) to deletion.
    start = np.where(np.isnan(scheduled), created, scheduled)
    for i in np.flatnonzero(scheduled < created).tolist():
        table.fail(i, "scheduled_time", f"{scheduled[i]:g} is before creation at {created[i]:g}")
    for i in np.flatnonzero(deleted < start).tolist():
        table.fail(i, "deletion_time", f"{deleted[i]:g} is before the pod started at {start[i]:g}")
    gpu_type = _gpu_specs(table, nodes) if table.has("gpu_spec") else None
    num_gpu = table.counts("num_gpu")
    milli = None
    if table.has("gpu_milli"):
        milli = table.counts("gpu_milli")
        for i in np.flatnonzero((num_gpu > 0) & ((milli < 1) | (milli > WHOLE_GPU))).tolist():
            table.fail(i, "gpu_milli", f"{milli[i]} is not 1 … {WHOLE_GPU} thousandths of a GPU")
        for i in np.flatnonzero((num_gpu > 1) & (milli != WHOLE_GPU)).tolist():
            table.fail(i, "gpu_milli", f"a pod of {num_gpu[i]} GPUs cannot share them ({milli[i]})")
    return _trace(
        table,
        "alibaba2023",
        "seconds since the start of the trace; duration = deletion - scheduling (- creation for "
        "pods never scheduled); pods alive at the end are cut there",
        num_gpu > 0,
        id_column="name",
        job_id=table.text("name"),
        submit_s=created,
        duration_s=deleted - start,
        num_gpu=num_gpu,
        gpu_type=gpu_type,
        cluster_gpus=None if nodes is None else nodes[1],
        gpu_milli=milli,
        skipped_why="CPU-only pods, num_gpu 0",
    )


def _gpu_specs(table: _Table, nodes: tuple[str, dict[str, int]] | None) -> list[str]:
    """gpu_spec without blanks and repeats ('V100M32|V100M32' -> 'V100M32'), checked on nodes."""
    out = []
    for i, cell in enumerate(table.text("gpu_spec")):
        if not cell.strip():
            out.append("")
            continue
        types = [t.strip() for t in cell.split("|")]
        if "" in types:
            table.fail(i, "gpu_spec", f"{_quote(cell)} has an empty GPU type")
        if nodes is not None:
            for t in types:
                if t not in nodes[1]:
                    table.fail(
                        i,
                        "gpu_spec",
                        f"GPU type {_quote(t)} is not in {nodes[0]} ({', '.join(nodes[1])})",
                    )
        out.append("|".join(dict.fromkeys(types)))
    return out


def _alibaba_nodes(name: str, text: str) -> tuple[str, dict[str, int]]:
    """GPUs per type in an openb node list: {'G2': 4392, 'T4': 842, ...}."""
    table = _csv_table(name, text)
    table.require("gpu", "model")
    gpus = table.counts("gpu")
    total: dict[str, int] = {}
    for i, cell in enumerate(table.text("model")):
        model = cell.strip()
        if gpus[i] == 0:
            continue
        if not model or "|" in model:
            table.fail(i, "model", f"{_quote(cell)} is no GPU type for a node with GPUs")
        total[model] = total.get(model, 0) + int(gpus[i])
    if not total:
        raise TraceFormatError(f"{name}: no node has GPUs")
    return name, total


# --- cdgpc CSV and sacct ------------------------------------------------------------------------


class _SlurmColumns(NamedTuple):
    """Where each field of a Slurm job is, in a cdgpc CSV or in sacct output."""

    job_id: str
    submit: str
    start: str
    end: str
    comment: str | None
    deadline: str | None = None
    iterations: str | None = None
    job_type: str | None = None
    model_name: str | None = None


def _cdgpc(name: str, text: str) -> Trace:
    first = next(line for line in _LINE_BREAK.split(text) if line.strip())
    if "|" in first:
        table = _sacct_table(name, text)
        gpus = [_tres_gpus(table, i, cell) for i, cell in enumerate(table.text("AllocTRES"))]
        num_gpu = np.array([count for count, _ in gpus], dtype=np.int64)
        where = _SlurmColumns("JobID", "Submit", "Start", "End", "Comment")
        note = "sacct --parsable2 output"
        return _slurm_trace(table, where, num_gpu, [kind for _, kind in gpus], note, steps=True)
    table = _csv_table(name, text)
    table.require("job_id", "submit", "start", "end", "num_gpu")
    optional = ("comment", "deadline", "iterations", "job_type", "model_name")
    where = _SlurmColumns(
        "job_id",
        "submit",
        "start",
        "end",
        *(column if table.has(column) else None for column in optional),
    )
    gpu_type = table.text("gpu_type") if table.has("gpu_type") else [""] * len(table.rows)
    num_gpu = table.counts("num_gpu")
    return _slurm_trace(table, where, num_gpu, gpu_type, "cdgpc CSV", steps=False)


def _sacct_table(name: str, text: str) -> _Table:
    """sacct --parsable2 lines as rows of the six fields, Comment last and free to hold '|'."""
    rows: list[list[str]] = []
    lines: list[int] = []
    seen_first = False
    header_line = 0
    for line_no, line in enumerate(_LINE_BREAK.split(text), start=1):
        if not line.strip():
            continue
        fields = line.split("|", len(_SACCT_FIELDS) - 1)
        if not seen_first:
            seen_first = True
            if fields[0].strip().lower() == "jobid":
                if [f.strip().lower() for f in fields] != [f.lower() for f in _SACCT_FIELDS]:
                    raise TraceFormatError(
                        f"{name}:{line_no}: sacct header {_quote(line)} is not "
                        f"{'|'.join(_SACCT_FIELDS)} (this order; use --format)"
                    )
                header_line = line_no
                continue
        if len(fields) < len(_SACCT_FIELDS):
            raise TraceFormatError(
                f"{name}:{line_no}: column {_quote(_SACCT_FIELDS[len(fields)])}: missing (sacct "
                f"lines need --format={','.join(_SACCT_FIELDS)}, in this order)"
            )
        rows.append(fields)
        lines.append(line_no)
    if not rows:
        raise TraceFormatError(f"{name}:{header_line + 1}: no jobs, only a header")
    return _Table(name, _SACCT_FIELDS, header_line, rows, lines)


def _tres_gpus(table: _Table, i: int, cell: str) -> tuple[int, str]:
    """GPUs from AllocTRES ``billing=8,cpu=8,gres/gpu:a100=2,gres/gpu=2,mem=64G,node=1``."""
    total: int | None = None
    typed: dict[str, int] = {}
    for item in cell.split(","):
        key, sep, value = item.strip().partition("=")
        if not key:
            continue
        if not sep:
            table.fail(i, "AllocTRES", f"cannot read {_quote(item)} as name=count")
        if key == "gres/gpu":
            total = table.count(i, "AllocTRES", value)
        elif key.startswith("gres/gpu:"):
            typed[key.removeprefix("gres/gpu:")] = table.count(i, "AllocTRES", value)
    count = sum(typed.values()) if total is None else total
    return count, "|".join(kind for kind, n in typed.items() if n > 0)


def _slurm_trace(
    table: _Table,
    where: _SlurmColumns,
    num_gpu: IntArray,
    gpu_type: Sequence[str],
    what: str,
    *,
    steps: bool,
) -> Trace:
    """Finished GPU jobs of a cdgpc CSV or sacct table; deadlines from a column or the comment."""
    n = len(table.rows)
    job_ids = [cell.strip() for cell in table.text(where.job_id)]
    starts, ends = table.text(where.start), table.text(where.end)
    keep = np.zeros(n, dtype=np.bool_)
    submit, duration = np.zeros(n), np.zeros(n)
    deadline, iterations = np.full(n, np.nan), np.full(n, np.nan)
    job_type, model_name = [""] * n, [""] * n
    why = {"job steps": 0, "never started": 0, "not finished": 0, "no GPUs": 0}
    for i in range(n):
        if steps and "." in job_ids[i]:
            why["job steps"] += 1
        elif starts[i].strip().lower() in _NO_TIME:  # pending jobs have no AllocTRES either
            why["never started"] += 1
        elif ends[i].strip().lower() in _NO_TIME:
            why["not finished"] += 1
        elif num_gpu[i] == 0:
            why["no GPUs"] += 1
        else:
            keep[i] = True
    row: list[str]
    for i in np.flatnonzero(keep).tolist():
        row = table.rows[i]
        submit[i] = table.time(i, where.submit, row[table.index[where.submit]])
        start = table.time(i, where.start, starts[i])
        end = table.time(i, where.end, ends[i])
        if end < start:
            table.fail(i, where.end, f"{_quote(ends[i])} is before the start {_quote(starts[i])}")
        duration[i] = end - start
        # A column's value wins; the comment's item fills in where the column is absent or empty.
        items = {} if where.comment is None else _comment(table, i, where.comment)
        for column, key, out in (
            (where.deadline, "deadline", deadline),
            (where.iterations, "iters", iterations),
        ):
            cell = "" if column is None else row[table.index[column]].strip()
            if column is not None and cell:
                out[i] = _value(table, i, column, key, cell, submit[i])
            elif where.comment is not None and key in items:
                out[i] = _value(table, i, where.comment, key, items[key], submit[i])
        if where.job_type is not None:
            cell = row[table.index[where.job_type]]
            kind = _CDGPC_JOB_TYPES.get(cell.strip().lower())
            if kind is None:
                table.fail(i, where.job_type, f"{_quote(cell)} is not strict, soft or best-effort")
            job_type[i] = kind
        if where.model_name is not None:
            model_name[i] = row[table.index[where.model_name]].strip()
    skipped = ", ".join(f"{count} {reason}" for reason, count in why.items() if count)
    epoch_note = "Unix epoch seconds (ISO times without an offset read in local time)"
    return _trace(
        table,
        "cdgpc",
        f"{what}; {epoch_note}",
        keep,
        id_column=where.job_id,
        job_id=job_ids,
        submit_s=submit,
        duration_s=duration,
        num_gpu=num_gpu,
        deadline_s=deadline,
        iterations=iterations,
        model_name=model_name,
        gpu_type=[cell.strip() for cell in gpu_type],
        job_type=job_type,
        skipped_why=skipped or "none",
    )


def _comment(table: _Table, i: int, column: str) -> dict[str, str]:
    """``deadline`` and ``iters`` of a Slurm comment ``deadline=+6h,iters=5000``.

    An item starts at the key (after the start, a comma, a space or other punctuation) and runs to
    the next comma, so ``deadline=2026-12-01 12:00`` keeps its time and free text around the
    items is ignored.
    """
    items: dict[str, str] = {}
    for match in _COMMENT_ITEM.finditer(table.rows[i][table.index[column]]):
        key = match.group(1).lower()
        if key in items:
            table.fail(i, column, f"{key}= is given twice")
        items[key] = match.group(2).strip()
    return items


def _value(table: _Table, i: int, column: str, key: str, cell: str, submit_s: float) -> float:
    """A deadline (absolute, or ``+6h`` after ``submit_s``) or an iteration count."""
    if key == "iters":
        return table.number(i, column, cell, low=0.0, high=_MAX_TIME_S)
    if cell.startswith("+") and span_s(cell[1:]) is None:
        table.fail(i, column, f"cannot read {_quote(cell)} as a span like +6h, +90m or +1h30m")
    try:
        return parse_deadline(cell).resolve(submit_s)
    except InputError as e:
        table.fail(i, column, str(e))


_PARSERS: dict[str, Callable[[str, str], Trace]] = {
    "elasticflow": _elasticflow,
    "chronus": _chronus,
    "alibaba2023": _alibaba2023,
    "cdgpc": _cdgpc,
}
