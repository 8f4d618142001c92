"""Trace loaders: recorded rows come out as written, bad files give one-line errors.

The snippets under tests/data/traces are a few real rows of each trace (see NOTICE there; the
Alibaba ones are synthetic because that trace may not be redistributed). Expected values below
were copied from the snippet rows by hand.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.sim.reporting import TimeLimitModel
from slurm_cdgpc.sim.traces import (
    FORMATS,
    Trace,
    TraceFormatError,
    alibaba2023,
    cdgpc,
    chronus,
    elasticflow,
    load_trace,
)

SNIPPETS = Path(__file__).resolve().parent.parent / "data" / "traces"
EF_DEADLINES = SNIPPETS / "elasticflow_cluster04_deadlines.csv"
EF_RAW = SNIPPETS / "elasticflow_cluster04_raw.csv"
CHRONUS = SNIPPETS / "chronus_mix2.csv"
ALI_PODS = SNIPPETS / "alibaba2023_pods_synthetic.csv"
ALI_NODES = SNIPPETS / "alibaba2023_nodes_synthetic.csv"
CDGPC_CSV = SNIPPETS / "cdgpc_jobs.csv"
SACCT = SNIPPETS / "sacct_jobs.txt"
NAN = float("nan")

# 2026-03-01T00:00:00Z: 56 years (14 leap days) and 59 days after the epoch.
MAR_1_UTC = (56 * 365 + 14 + 59) * 86400


@pytest.fixture
def utc_minus_5() -> Iterator[None]:
    """Local time 5 h behind UTC (a POSIX TZ, no tzdata needed): naive ISO times shift by 5 h."""
    old = os.environ.get("TZ")
    os.environ["TZ"] = "EST5"
    time.tzset()
    try:
        yield
    finally:
        if old is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = old
        time.tzset()


def same(actual: object, expected: list[object]) -> bool:
    """Elementwise equality where NaN equals NaN."""
    return bool(np.array_equal(np.asarray(actual), np.asarray(expected), equal_nan=True))


def check_invariants(trace: Trace) -> None:
    """What every loaded trace promises, whatever the file was."""
    assert len(trace) >= 1
    assert np.all(np.diff(trace.submit_s) >= 0)
    assert np.all(np.isfinite(trace.submit_s))
    assert np.all(np.isfinite(trace.duration_s)) and np.all(trace.duration_s >= 0)
    assert np.all(trace.num_gpu >= 1)
    assert not np.any(np.isinf(trace.deadline_s))
    assert set(trace.job_type.tolist()) <= {"strict", "soft", "best-effort", ""}
    assert len(set(trace.job_id.tolist())) == len(trace)
    assert trace.source in FORMATS


# --- the four formats on recorded snippets -------------------------------------------------------


def test_elasticflow_with_deadlines_gives_the_rows_values() -> None:
    trace = elasticflow(EF_DEADLINES)
    assert (trace.source, len(trace), trace.skipped) == ("elasticflow", 7, 0)
    # c9c620ea-...,5810,3950230,inception3,314395,64,16,288476
    assert trace.job_id[0] == "c9c620ea-4336-c1a9-8abe-e26bd13076b8"
    assert (trace.submit_s[0], trace.duration_s[0], trace.num_gpu[0]) == (5810, 288476, 16)
    assert (trace.deadline_s[0], trace.iterations[0]) == (314395, 3950230)
    assert trace.model_name[0] == "inception3"
    # 272f5443-...,1766736,4127644,gpt2,1983813,256,64,263856
    assert trace.job_id[-1] == "272f5443-8034-6aec-1156-3f5b21056f8c"
    assert (trace.num_gpu[-1], trace.deadline_s[-1], trace.model_name[-1]) == (64, 1983813, "gpt2")
    assert trace.job_type.tolist() == [""] * 7 and trace.gpu_type.tolist() == [""] * 7
    # 29fd9415 (5883 + 309226 > 268630) and 272f5443 cannot finish in time even at full speed.
    late = trace.deadline_s - trace.submit_s < trace.duration_s
    assert late.tolist() == [False, False, False, True, False, False, True]


def test_elasticflow_raw_has_no_deadlines_iterations_or_models() -> None:
    trace = elasticflow(EF_RAW)
    assert len(trace) == 6
    # d611eab8-...,10991,9946,8
    assert trace.job_id[5] == "d611eab8-5045-f270-46bb-7fc7957f8096"
    assert (trace.submit_s[5], trace.duration_s[5], trace.num_gpu[5]) == (10991, 9946, 8)
    assert np.all(np.isnan(trace.deadline_s)) and np.all(np.isnan(trace.iterations))
    assert trace.model_name.tolist() == [""] * 6


def test_chronus_converts_minutes_and_takes_the_first_deadline_after_submission() -> None:
    trace = chronus(CHRONUS)
    # Sorted by submit_time; job 224 has num_gpu 0 and is skipped.
    assert trace.job_id.tolist() == ["3", "10", "6", "4", "0", "7", "1", "5", "2"]
    assert trace.skipped == 1
    # 3,vc_6214e9,1,61,8388,inception_v3,83,18,119,10,0,strict
    assert (trace.submit_s[0], trace.duration_s[0]) == (61 * 60, 83 * 60)
    assert trace.deadline_s[0] == (61 + 119) * 60
    assert (trace.iterations[0], trace.model_name[0], trace.job_type[0]) == (
        8388,
        "inception_v3",
        "strict",
    )
    # 0,vc_ed69ec,1,5601,5530,mobilenet_v2,96,5,159-189-229-289,10-8-5-2,0,soft
    assert trace.job_type[4] == "soft" and trace.deadline_s[4] == (5601 + 159) * 60
    # 10,vc_ed69ec,1,918,6832,vgg16,146,10,918,10,1,best: the 918 is a placeholder, no deadline
    assert trace.job_type[1] == "best-effort" and np.isnan(trace.deadline_s[1])
    assert trace.num_gpu.tolist() == [1, 1, 1, 8, 1, 1, 1, 1, 4]
    assert "minutes" in trace.time_unit_note


def test_alibaba_pods_run_from_scheduling_to_deletion() -> None:
    trace = alibaba2023(ALI_PODS)
    assert trace.job_id.tolist() == [
        "synth-pod-00",
        "synth-pod-05",
        "synth-pod-02",
        "synth-pod-03",
        "synth-pod-04",
    ]
    assert trace.skipped == 1  # synth-pod-01 has no GPU
    assert trace.submit_s.tolist() == [0, 50, 100, 200, 300]
    # pod-00: 5000 - 10; pod-04 never scheduled: 420 - 300 (creation)
    assert trace.duration_s.tolist() == [4990, 4945, 3540, 60, 120]
    assert trace.num_gpu.tolist() == [1, 1, 8, 1, 2]
    assert trace.gpu_type.tolist() == ["", "G2", "V100M32", "T4|P100", ""]
    assert trace.gpu_milli.tolist() == [1000, 250, 1000, 500, 1000]  # pods 05 and 03 share
    assert np.all(np.isnan(trace.deadline_s)) and dict(trace.cluster_gpus) == {}


def test_alibaba_nodes_give_the_clusters_gpus_by_type() -> None:
    trace = alibaba2023(ALI_PODS, nodes_path=ALI_NODES)
    assert dict(trace.cluster_gpus) == {"G2": 8, "T4": 4, "P100": 2, "V100M32": 8}


def test_alibaba_pod_asking_for_a_type_the_nodes_lack_is_refused(tmp_path: Path) -> None:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text(ALI_NODES.read_text().replace(",G2\n", ",A10\n"))
    with pytest.raises(TraceFormatError) as info:
        alibaba2023(ALI_PODS, nodes_path=nodes)
    assert str(info.value).startswith("alibaba2023_pods_synthetic.csv:7: column 'gpu_spec'")
    assert "'G2' is not in nodes.csv" in str(info.value)


def test_cdgpc_csv_reads_iso_epoch_and_relative_times(utc_minus_5: None) -> None:
    trace = cdgpc(CDGPC_CSV)
    assert trace.job_id.tolist() == ["103", "102", "106", "101"]
    assert trace.skipped == 2  # 104 never started, 105 had no GPU
    hour = 3600
    assert trace.submit_s.tolist() == [
        MAR_1_UTC + 10 * hour,  # epoch seconds as written
        MAR_1_UTC + 10.5 * hour,  # explicit +00:00
        MAR_1_UTC + 14 * hour,  # naive 09:00 at UTC-5
        MAR_1_UTC + 15 * hour,  # naive 10:00 at UTC-5
    ]
    assert trace.duration_s.tolist() == [3600, 1800, 600, 7200]
    assert trace.num_gpu.tolist() == [2, 1, 8, 4]
    assert same(
        trace.deadline_s,
        [
            MAR_1_UTC + 10 * hour + 90 * 60,  # comment deadline=+90m
            MAR_1_UTC + 10.5 * hour + 6 * hour,  # column +6h
            NAN,
            MAR_1_UTC + 23 * hour,  # naive 18:00 at UTC-5
        ],
    )
    assert same(trace.iterations, [5000, NAN, NAN, NAN])
    assert trace.gpu_type.tolist() == ["", "", "h100", "a100"]
    assert trace.job_type.tolist() == ["soft", "", "best-effort", "strict"]


def test_cdgpc_deadline_column_wins_over_the_comment(tmp_path: Path) -> None:
    path = tmp_path / "jobs.csv"
    path.write_text(
        "job_id,submit,start,end,num_gpu,deadline,comment\n1,100,100,200,1,+1h,deadline=+2h\n"
    )
    assert load_trace(path).deadline_s.tolist() == [100 + 3600]


def test_sacct_output_is_read_as_it_comes(utc_minus_5: None) -> None:
    trace = load_trace(SACCT)
    assert trace.source == "cdgpc" and "sacct" in trace.time_unit_note
    assert trace.job_id.tolist() == ["2001", "2005_1"]
    assert trace.skipped == 4  # a step, a pending job, a running job, a CPU job
    mar_2 = MAR_1_UTC + 86400
    assert trace.submit_s.tolist() == [mar_2 + 13 * 3600, mar_2 + 14 * 3600]
    assert trace.duration_s.tolist() == [3600, 3600]
    assert trace.num_gpu.tolist() == [2, 16]
    assert trace.gpu_type.tolist() == ["h100", ""]
    # 2001: deadline=2026-03-02T12:00:00 (local); 2005_1: "my run | deadline=+2h30m,iters=20000"
    assert trace.deadline_s.tolist() == [mar_2 + 17 * 3600, mar_2 + 14 * 3600 + 9000]
    assert trace.iterations.tolist() == [1000, 20000]


@pytest.mark.parametrize(
    ("path", "source", "loader"),
    [
        (EF_DEADLINES, "elasticflow", elasticflow),
        (EF_RAW, "elasticflow", elasticflow),
        (CHRONUS, "chronus", chronus),
        (ALI_PODS, "alibaba2023", alibaba2023),
        (CDGPC_CSV, "cdgpc", cdgpc),
        (SACCT, "cdgpc", cdgpc),
    ],
)
def test_load_trace_detects_the_format(
    path: Path, source: str, loader: Callable[[Path], Trace]
) -> None:
    trace = load_trace(path)
    assert trace.source == source
    assert trace.job_id.tolist() == loader(path).job_id.tolist()
    assert load_trace(path, format=source).job_id.tolist() == trace.job_id.tolist()


def test_load_trace_with_the_wrong_format_names_the_missing_column() -> None:
    with pytest.raises(TraceFormatError, match=r"^chronus_mix2\.csv:1: column 'submission_time'"):
        load_trace(CHRONUS, format="elasticflow")


def test_load_trace_refuses_an_unknown_format_name() -> None:
    with pytest.raises(InputError, match="unknown trace format 'philly'"):
        load_trace(CHRONUS, format="philly")


# --- the Trace type ------------------------------------------------------------------------------


def test_head_and_select_keep_submission_order() -> None:
    trace = chronus(CHRONUS)
    assert trace.head(3).job_id.tolist() == ["3", "10", "6"]
    assert len(trace.head(100)) == len(trace) and len(trace.head(0)) == 0
    multi = trace.select(trace.num_gpu > 1)
    assert multi.job_id.tolist() == ["4", "2"] and multi.source == "chronus"
    assert multi.deadline_s.tolist() == [(5597 + 103) * 60, (12378 + 102) * 60]


def test_no_format_carries_a_time_limit_and_a_given_one_follows_its_jobs() -> None:
    trace = chronus(CHRONUS)
    assert np.isnan(trace.time_limit_s).all() and len(trace.time_limit_s) == len(trace)
    limited = replace(trace, time_limit_s=np.arange(1.0, len(trace) + 1) * 60.0)
    multi = limited.select(limited.num_gpu > 1)
    assert multi.time_limit_s.tolist() == [
        limited.time_limit_s[i] for i in np.flatnonzero(limited.num_gpu > 1)
    ]
    assert limited.head(2).time_limit_s.tolist() == [60.0, 120.0]
    for bad in (0.0, -60.0, np.inf):
        with pytest.raises(InputError, match="time_limit_s must be finite and > 0, or NaN"):
            replace(trace, time_limit_s=np.full(len(trace), bad))


def test_trace_arrays_are_read_only() -> None:
    trace = elasticflow(EF_RAW)
    with pytest.raises(ValueError, match="read-only"):
        trace.submit_s[0] = 0.0


@pytest.mark.parametrize("mask", [np.array([0, 1]), np.ones(3, dtype=bool), [True]])
def test_select_refuses_anything_but_a_full_boolean_mask(mask: npt.ArrayLike) -> None:
    trace = elasticflow(EF_RAW)
    with pytest.raises(InputError, match="boolean mask of shape"):
        trace.select(mask)


def test_head_refuses_a_negative_count() -> None:
    with pytest.raises(InputError, match="must be >= 0"):
        elasticflow(EF_RAW).head(-1)


# --- malformed files -----------------------------------------------------------------------------


def set_cell(text: str, line: int, column: str, value: str) -> str:
    """``text`` (plain CSV) with the cell of ``column`` on 1-based ``line`` replaced."""
    lines = text.split("\n")
    k = lines[0].split(",").index(column)
    cells = lines[line - 1].split(",")
    cells[k] = value
    lines[line - 1] = ",".join(cells)
    return "\n".join(lines)


def drop_column(text: str, column: str) -> str:
    lines = text.split("\n")
    k = lines[0].split(",").index(column)
    return "\n".join(",".join(c for j, c in enumerate(ln.split(",")) if j != k) for ln in lines)


def edit_line(text: str, line: int, edit: Callable[[str], str]) -> str:
    lines = text.split("\n")
    lines[line - 1] = edit(lines[line - 1])
    return "\n".join(lines)


EF = EF_DEADLINES.read_text()
CH = CHRONUS.read_text()
ALI = ALI_PODS.read_text()
CD = CDGPC_CSV.read_text()
SA = SACCT.read_text()

# (file content, format, line, column or None, what the message says)
BROKEN: dict[str, tuple[str | bytes, str | None, int, str | None, str]] = {
    "not a number": (set_cell(EF, 3, "duration", "abc"), None, 3, "duration", "as a number"),
    "negative duration": (set_cell(EF, 4, "duration", "-5"), None, 4, "duration", "negative"),
    "negative GPUs": (set_cell(EF, 5, "num_gpu", "-1"), None, 5, "num_gpu", "negative"),
    "fractional GPUs": (set_cell(EF, 5, "num_gpu", "1.5"), None, 5, "num_gpu", "whole number"),
    "NaN": (set_cell(EF, 2, "submission_time", "nan"), None, 2, "submission_time", "finite"),
    "infinity": (set_cell(EF, 6, "deadline", "inf"), None, 6, "deadline", "finite"),
    "empty cell": (set_cell(EF, 7, "deadline", ""), None, 7, "deadline", "cannot read ''"),
    "missing column": (drop_column(EF, "duration"), None, 1, "duration", "missing from the header"),
    "short row": (edit_line(EF, 5, lambda s: s.rsplit(",", 1)[0]), None, 5, "duration", "missing"),
    "long row": (edit_line(EF, 6, lambda s: s + ",7"), None, 6, None, "9 fields"),
    "not UTF-8": (
        EF.encode().replace(b"bert", b"bert\xff"),
        None,
        4,
        "model_name",
        "0xff is not UTF-8",
    ),
    "empty file": (b"", None, 1, None, "empty"),
    "blank file": ("\n  \n", "chronus", 1, None, "empty"),
    "header only": (EF.split("\n")[0] + "\n", None, 2, None, "no jobs"),
    "open quote": (set_cell(EF, 3, "job_id", '"be63'), None, 3, None, "not valid CSV"),
    "unknown header": ("foo,bar\n1,2\n", None, 1, None, "unknown trace format"),
    "reused id": (set_cell(EF, 3, "job_id", EF.split("\n")[1][:36]), None, 3, "job_id", "line 2"),
    "no GPU jobs": (
        "job_id,submission_time,duration,num_gpu\na,1,2,0\nb,1,2,0\n",
        None,
        0,
        None,
        "all 2 rows were skipped",
    ),
    "chronus job type": (set_cell(CH, 3, "job_type", "urgent"), None, 3, "job_type", "'urgent'"),
    "chronus utilities": (
        set_cell(CH, 2, "expect_value_list", "10-8"),
        None,
        2,
        "expect_value_list",
        "2 utilities for 4 deadlines",
    ),
    "chronus order": (
        set_cell(CH, 2, "expect_time_list", "159-150-229-289"),
        None,
        2,
        "expect_time_list",
        "do not increase",
    ),
    "chronus class": (set_cell(CH, 3, "best_effort", "1"), None, 3, "best_effort", "contradicts"),
    "alibaba deleted early": (
        set_cell(ALI, 2, "deletion_time", "5"),
        None,
        2,
        "deletion_time",
        "before the pod started",
    ),
    "alibaba no share": (set_cell(ALI, 6, "gpu_milli", "0"), None, 6, "gpu_milli", "1 … 1000"),
    "alibaba shares several": (
        set_cell(ALI, 4, "gpu_milli", "500"),
        None,
        4,
        "gpu_milli",
        "a pod of 8 GPUs cannot share them",
    ),
    "alibaba without times": (
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\nopenb-pod-0000,12000,16384,1,1000\n",
        None,
        1,
        "creation_time",
        "multigpu50",
    ),
    "cdgpc bad time": (
        set_cell(CD, 2, "submit", "2026-13-01T10:00:00"),
        None,
        2,
        "submit",
        "ISO 8601",
    ),
    "cdgpc end before start": (
        set_cell(CD, 3, "end", "2026-03-01T10:59:00+00:00"),
        None,
        3,
        "end",
        "before the start",
    ),
    "cdgpc bad span": (set_cell(CD, 3, "deadline", "+6x"), None, 3, "deadline", "span like +6h"),
    "cdgpc bad comment": (
        CD.replace("deadline=+90m", "deadline=tomorrow"),
        None,
        4,
        "comment",
        "'tomorrow'",
    ),
    "cdgpc job type": (set_cell(CD, 2, "job_type", "urgent"), None, 2, "job_type", "'urgent'"),
    "sacct short line": (
        edit_line(SA, 3, lambda s: "|".join(s.split("|")[:2])),
        None,
        3,
        "Start",
        "missing",
    ),
    "sacct GPU count": (SA.replace("gres/gpu=16", "gres/gpu=two"), None, 7, "AllocTRES", "'two'"),
    "sacct header": (
        SA.replace("JobID|Submit|Start", "JobID|Start|Submit"),
        None,
        1,
        None,
        "is not JobID|Submit|Start|End|AllocTRES|Comment",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_file_gives_one_line_with_file_line_and_column(tmp_path: Path, case: str) -> None:
    content, format, line, column, fragment = BROKEN[case]
    path = tmp_path / "cluster04.csv"
    if isinstance(content, str):
        content = content.encode()
    path.write_bytes(content)
    with pytest.raises(TraceFormatError) as info:
        load_trace(path, format)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"cluster04.csv:{line}:" if line else "cluster04.csv: ")
    if column is not None:
        assert f"column '{column}'" in message
    assert fragment in message


def test_the_documented_example_message(tmp_path: Path) -> None:
    path = tmp_path / "cluster04.csv"
    path.write_text(set_cell(EF, 3, "duration", "abc"))
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    assert str(info.value) == "cluster04.csv:3: column 'duration': cannot read 'abc' as a number"


@pytest.mark.parametrize("name", ["missing.csv", "."])
def test_unreadable_path_is_a_trace_format_error(tmp_path: Path, name: str) -> None:
    with pytest.raises(TraceFormatError, match="cannot read the file"):
        load_trace(tmp_path / name)


# --- fuzzing -------------------------------------------------------------------------------------

HEADERS = [
    p.read_text().split("\n")[0] for p in (EF_DEADLINES, EF_RAW, CHRONUS, ALI_PODS, CDGPC_CSV)
]
HEADERS.append("|".join(["JobID", "Submit", "Start", "End", "AllocTRES", "Comment"]))
TRICKY = [
    *("", "0", "1", "8", "-1", "1.5", "nan", "inf", "1e400", " 7 ", "1_0", "٣", "99999999999"),
    *("2026-03-01T10:00:00", "2026-02-30", "+6h", "+1h30m", "+x", "Unknown", "None"),
    *("gres/gpu=2", "gres/gpu:a100=1", "deadline=+1h", "iters=-3", "10-8", "5-5", "best"),
    *("strict", "soft", '"', '"a,b"', "a|b", "\x00", "\r", "V100M32|", "T4|T4"),
]
CELLS = st.one_of(st.sampled_from(TRICKY), st.text(max_size=8))


@st.composite
def csv_files(draw: st.DrawFn) -> str:
    """A known header, then rows of about the right width made of tricky cells."""
    header = draw(st.sampled_from(HEADERS))
    sep = "|" if "|" in header else ","
    width = header.count(sep) + 1
    rows = draw(st.lists(st.lists(CELLS, min_size=width - 1, max_size=width + 1), max_size=4))
    return "\n".join([header, *(sep.join(row) for row in rows)])


SNIPPET_TEXTS = [p.read_text() for p in (EF_DEADLINES, EF_RAW, CHRONUS, ALI_PODS, CDGPC_CSV, SACCT)]


@st.composite
def mutated_snippets(draw: st.DrawFn) -> str:
    """Some rows of a recorded snippet, about one cell in twenty replaced by a tricky one."""
    header, *rows = draw(st.sampled_from(SNIPPET_TEXTS)).rstrip("\n").split("\n")
    sep = "|" if "|" in header else ","
    picked = draw(st.lists(st.integers(0, len(rows) - 1), unique=True, max_size=len(rows)))
    out = [header]
    for k in picked:
        cells = rows[k].split(sep)
        for j in range(len(cells)):
            if draw(st.integers(0, 19)) == 0:
                cells[j] = draw(CELLS)
        out.append(sep.join(cells))
    return "\n".join(out)


FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.mark.security
@FUZZ
@given(data=st.binary(max_size=200), format=st.sampled_from([None, *FORMATS]))
def test_random_bytes_raise_nothing_but_trace_format_error(
    tmp_path: Path, data: bytes, format: str | None
) -> None:
    path = tmp_path / "fuzz.csv"
    path.write_bytes(data)
    try:
        trace = load_trace(path, format)
    except TraceFormatError as e:
        assert "\n" not in str(e)
    else:
        check_invariants(trace)


@pytest.mark.security
@FUZZ
@given(text=csv_files(), format=st.sampled_from([None, *FORMATS]))
def test_random_csv_raises_nothing_but_trace_format_error(
    tmp_path: Path, text: str, format: str | None
) -> None:
    path = tmp_path / "fuzz.csv"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        trace = load_trace(path, format)
    except TraceFormatError as e:
        assert "\n" not in str(e) and str(e).startswith("fuzz.csv:")
    else:
        check_invariants(trace)


@pytest.mark.security
@FUZZ
@given(text=mutated_snippets())
def test_damaged_snippets_load_or_say_which_cell_is_bad(tmp_path: Path, text: str) -> None:
    path = tmp_path / "fuzz.csv"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        trace = load_trace(path)
    except TraceFormatError as e:
        assert "\n" not in str(e) and str(e).startswith("fuzz.csv:")
    else:
        check_invariants(trace)


@FUZZ
@given(
    jobs=st.lists(
        st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 64)), min_size=1
    )
)
def test_every_gpu_job_comes_back_once_in_submission_order(
    tmp_path: Path, jobs: list[tuple[int, int, int]]
) -> None:
    path = tmp_path / "raw.csv"
    rows = [
        f"job-{k},{submit},{duration},{gpus}" for k, (submit, duration, gpus) in enumerate(jobs)
    ]
    path.write_text("\n".join(["job_id,submission_time,duration,num_gpu", *rows]))
    gpu_jobs = [(f"job-{k}", *job) for k, job in enumerate(jobs) if job[2] > 0]
    if not gpu_jobs:
        with pytest.raises(TraceFormatError, match=rf"all {len(jobs)} rows were skipped"):
            load_trace(path)
        return
    trace = load_trace(path)
    expected = sorted(gpu_jobs, key=lambda job: job[1])  # stable: ties keep the file's order
    assert trace.job_id.tolist() == [job[0] for job in expected]
    assert trace.duration_s.tolist() == [job[2] for job in expected]
    assert trace.num_gpu.tolist() == [job[3] for job in expected]
    assert trace.skipped == len(jobs) - len(gpu_jobs)


# --- the real traces (../shared/data) -------------------------------------------------------------


@pytest.mark.data
@pytest.mark.parametrize(("cluster", "jobs"), [("cluster04", 15_802), ("cluster07", 12_699)])
def test_real_elasticflow_clusters_have_their_job_counts_and_tight_deadlines(
    shared_data: Path, cluster: str, jobs: int
) -> None:
    folder = shared_data / "microsoft-elasticflow-itp"
    raw = load_trace(folder / "raw" / f"{cluster}.csv")
    trace = load_trace(folder / "with_deadlines" / f"{cluster}.csv")
    assert len(raw) == len(trace) == jobs and trace.skipped == 0
    assert np.array_equal(raw.duration_s, trace.duration_s)
    # About half the jobs cannot meet their deadline even when started at once at full speed.
    late = float(np.mean(trace.deadline_s - trace.submit_s < trace.duration_s))
    assert 0.45 < late < 0.55


@pytest.mark.data
@pytest.mark.parametrize(
    ("mix", "gpuless", "kinds"),
    [
        ("SLO", 205, {"strict"}),
        ("MIX1", 184, {"strict", "best-effort"}),
        ("MIX2", 194, {"strict", "soft", "best-effort"}),
    ],
)
def test_real_chronus_traces_have_30940_rows_and_relative_deadlines(
    shared_data: Path, mix: str, gpuless: int, kinds: set[str]
) -> None:
    trace = load_trace(shared_data / "chronus-philly-deadline" / f"trace_job_Philly_{mix}.csv")
    assert len(trace) + trace.skipped == 30_940 and trace.skipped == gpuless
    assert set(trace.job_type.tolist()) == kinds
    assert trace.submit_s.max() == 20_151 * 60  # 14 days in minutes
    slo = trace.job_type != "best-effort"
    assert np.all(np.isnan(trace.deadline_s[~slo]))
    # Read as offsets, every deadline leaves room for the job (read as absolute times, 94 % would
    # fall before the job was even submitted).
    slack = trace.deadline_s[slo] - trace.submit_s[slo]
    assert np.all(slack >= 1.1 * trace.duration_s[slo])


@pytest.mark.data
def test_real_alibaba_pods_and_nodes(shared_data: Path) -> None:
    folder = shared_data / "alibaba-gpu-v2023"
    nodes = folder / "openb_node_list_gpu_node.csv"
    trace = alibaba2023(folder / "openb_pod_list_default.csv", nodes_path=nodes)
    assert len(trace) == 8_152 - 1_088 and trace.skipped == 1_088
    assert sum(trace.cluster_gpus.values()) == 6_212 and trace.cluster_gpus["G2"] == 549 * 8
    assert int(np.sum(trace.gpu_milli < 1000)) == 3_078  # the pods that share a GPU
    typed = alibaba2023(folder / "openb_pod_list_gpuspec33.csv", nodes_path=nodes)
    assert 0.25 < float(np.mean(typed.gpu_type != "")) < 0.40
    with pytest.raises(TraceFormatError, match="column 'creation_time'"):
        load_trace(folder / "openb_pod_list_multigpu50.csv")


def test_the_none_time_limit_model_gives_no_job_a_limit() -> None:
    model = TimeLimitModel.parse("none")
    assert str(model) == "none" and TimeLimitModel.parse(str(model)) == model
    assert np.isnan(model.draw(np.array([60.0, 3600.0]), seed=0)).all()
