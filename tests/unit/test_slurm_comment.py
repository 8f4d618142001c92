"""The comment grammar: deadline (ISO, relative, epoch), iters, slo, other text left alone; fuzzed;
and job_submit.lua, its twin, against it."""

from __future__ import annotations

import os
import shutil
import subprocess
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.slurm.comment import (
    CommentRequest,
    LatencyObjective,
    deadline_warnings,
    effective_deadline,
    parse_comment,
    parse_deadline,
    parse_slo,
)

SUBMIT_S = 1_800_000_000.0
UTC_PLUS_2 = timezone(timedelta(hours=2))


@pytest.mark.parametrize(
    ("text", "expected_s"),
    [
        ("deadline=2026-12-01T12:00Z", datetime(2026, 12, 1, 12, tzinfo=UTC).timestamp()),
        (
            "deadline=2026-12-01T12:00:30+02:00",
            datetime(2026, 12, 1, 10, 0, 30, tzinfo=UTC).timestamp(),
        ),
        ("deadline=2026-12-01T12:00-0130", datetime(2026, 12, 1, 13, 30, tzinfo=UTC).timestamp()),
        ("deadline=2026-12-01", datetime(2026, 12, 1, tzinfo=UTC_PLUS_2).timestamp()),
        ("deadline=2026-12-01T12:00", datetime(2026, 12, 1, 12, tzinfo=UTC_PLUS_2).timestamp()),
        ("deadline=+90m", SUBMIT_S + 5400),
        ("deadline=+6h", SUBMIT_S + 6 * 3600),
        ("DEADLINE=+2d", SUBMIT_S + 2 * 86400),
        ("deadline=+1.5H", SUBMIT_S + 5400),
        ("deadline=+1h30m", SUBMIT_S + 5400),  # a span of slurm_cdgpc.units, as in sacct traces
        ("deadline=+2d12h", SUBMIT_S + 2.5 * 86400),
        ("deadline=+250ms", SUBMIT_S + 0.25),
        ("deadline=1893456000", 1_893_456_000.0),
    ],
)
def test_deadline_forms(text: str, expected_s: float) -> None:
    request = parse_comment(text, tz=UTC_PLUS_2)
    assert request.deadline is not None
    assert request.deadline.resolve(SUBMIT_S) == pytest.approx(expected_s)


def test_other_text_is_left_alone_and_separators_mix() -> None:
    request = parse_comment("project=x run 7, deadline=+6h  iters=5000,tag=a=b", tz=UTC)
    assert request.iterations_total == 5000
    assert request.deadline is not None and request.deadline.relative_s == 6 * 3600
    assert parse_comment("just a note; owner=alice") == CommentRequest()
    assert parse_comment(None) == CommentRequest() == parse_comment("")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("deadline=tomorow", "cannot read deadline 'tomorow': use 2026-12-01T12:00 or +6h"),
        ("deadline=", "cannot read deadline '': use 2026-12-01T12:00 or +6h"),
        ("deadline=2026-13-01", "cannot read deadline '2026-13-01'"),
        ("deadline=2026-02-30T10:00", "cannot read deadline"),
        ("deadline=2026-12-01T24:00", "cannot read deadline"),
        ("deadline=2026-12-01T12:00+25:00", "cannot read deadline"),
        ("deadline=+6", "cannot read deadline '+6'"),
        ("deadline=+5.h", "cannot read deadline"),
        ("deadline=+1h30", "cannot read deadline '+1h30'"),
        ("deadline=+1hm", "cannot read deadline"),
        ("deadline=+3650d1s", "more than 3650 days away"),
        ("deadline=+4000d", "more than 3650 days away"),
        ("deadline=99999999999999", "cannot read deadline"),
        ("deadline=+1h deadline=+2h", "given twice"),
        ("iters=0", "iters must be between 1"),
        ("iters=many", "cannot read iters 'many'"),
        ("deadline=٣", "cannot read deadline"),  # Unicode digits are not digits here (nor in Lua)
        ("deadline=+5ſ", "cannot read deadline '+5ſ'"),  # "ſ" is "s" in Unicode's case folding
        ("slo=p99-250", "cannot read slo 'p99-250': use slo=p99:250ms"),
        ("slo=", "cannot read slo '': use slo=p99:250ms"),
        ("slo=99:250ms", "cannot read slo '99:250ms'"),
        ("slo=p99:250", "cannot read slo 'p99:250'"),  # a latency needs its unit
        ("slo=p99:250m", "cannot read slo 'p99:250m'"),
        ("slo=p99.:250ms", "cannot read slo 'p99.:250ms'"),
        ("slo=p99:.5s", "cannot read slo 'p99:.5s'"),
        ("slo=p99:-5ms", "cannot read slo 'p99:-5ms'"),
        ("slo=p99:250ms:x", "cannot read slo 'p99:250ms:x'"),
        ("slo=p99:1e2ms", "cannot read slo 'p99:1e2ms'"),
        ("slo=p99:2ſ", "cannot read slo 'p99:2ſ'"),
        ("slo=p49.9:250ms", "slo percentile must be between 50 and 99.99, got p49.9"),
        ("slo=p99.991:250ms", "slo percentile must be between 50 and 99.99, got p99.991"),
        ("slo=p100:250ms", "slo percentile must be between 50 and 99.99, got p100"),
        ("slo=p99:999us", "slo latency must be between 1ms and 600s, got 999us"),
        ("slo=p99:0s", "slo latency must be between 1ms and 600s, got 0s"),
        ("slo=p99:600.001s", "slo latency must be between 1ms and 600s, got 600.001s"),
        ("slo=p99:250ms SLO=p90:1s", "slo= is given twice in the comment"),
    ],
)
def test_malformed_values_are_one_line_input_errors(text: str, message: str) -> None:
    with pytest.raises(InputError, match=message.replace("+", r"\+").replace(".", r"\.")):
        parse_comment(text)


@pytest.mark.parametrize(
    ("text", "percentile", "latency_s"),
    [
        ("slo=p99:250ms", 99.0, 0.25),
        ("SLO=P99.9:1.5S", 99.9, 1.5),
        ("slo=p50:1500us", 50.0, 1.5e-3),
        ("slo=p99.99:1000us", 99.99, 1e-3),  # both ends are in
        ("slo=p95:1ms", 95.0, 1e-3),
        ("slo=p90:600s", 90.0, 600.0),
        ("slo=p090:0600000ms", 90.0, 600.0),
    ],
)
def test_latency_objectives(text: str, percentile: float, latency_s: float) -> None:
    assert parse_comment(text).slo == LatencyObjective(percentile, latency_s)


def test_a_serving_job_may_also_have_a_deadline() -> None:
    request = parse_comment("serve llama, slo=p99:250ms deadline=+6h", tz=UTC)
    assert request.slo == LatencyObjective(99.0, 0.25)
    assert request.deadline is not None and request.deadline.relative_s == 6 * 3600
    assert request.iterations_total is None


def test_fallbacks_slurm_deadline_then_time_limit() -> None:
    none = CommentRequest()
    assert effective_deadline(none, submit_s=SUBMIT_S) is None
    d = effective_deadline(none, submit_s=SUBMIT_S, slurm_deadline_s=SUBMIT_S + 60, time_limit_s=9)
    assert d is not None and (d.deadline_s, d.source) == (SUBMIT_S + 60, "slurm-deadline")
    d = effective_deadline(none, submit_s=SUBMIT_S, start_s=SUBMIT_S + 10, time_limit_s=3600)
    assert d is not None and (d.deadline_s, d.source) == (SUBMIT_S + 3610, "time-limit")
    given_ = parse_comment("deadline=+1h")
    d = effective_deadline(given_, submit_s=SUBMIT_S, slurm_deadline_s=1.0, time_limit_s=60)
    assert d is not None and (d.deadline_s, d.source) == (SUBMIT_S + 3600, "comment")


def test_warnings_for_past_and_beyond_the_time_limit() -> None:
    assert deadline_warnings(SUBMIT_S + 100, now_s=SUBMIT_S, time_limit_s=None) == []
    [past] = deadline_warnings(SUBMIT_S - 1, now_s=SUBMIT_S, time_limit_s=None)
    assert "in the past" in past
    [late] = deadline_warnings(SUBMIT_S + 7200, now_s=SUBMIT_S, time_limit_s=3600)
    assert "after the time limit" in late


@given(st.text(max_size=200))
def test_fuzz_any_text_parses_or_gives_one_line_input_error(text: str) -> None:
    try:
        parse_comment(text)
    except InputError as e:
        assert "\n" not in str(e) and len(str(e)) < 200


@given(st.text(alphabet="0123456789-+:TZ.smhd", max_size=30))
def test_fuzz_deadline_alphabet(value: str) -> None:
    try:
        spec = parse_deadline(value, tz=UTC)
    except InputError as e:
        assert "\n" not in str(e)
    else:
        assert (spec.absolute_s is None) != (spec.relative_s is None)
        assert 0 <= spec.resolve(SUBMIT_S) < 1e12


@given(st.text(alphabet="0123456789.:pPumsS", max_size=20))
def test_fuzz_slo_alphabet(value: str) -> None:
    try:
        slo = parse_slo(value)
    except InputError as e:
        assert "\n" not in str(e)
    else:
        assert 50 <= slo.percentile <= 99.99 and 1e-3 <= slo.latency_s <= 600


LUA = shutil.which("lua5.1") or shutil.which("lua")
JOB_SUBMIT = Path(__file__).resolve().parents[2] / "daemon" / "job_submit.lua"
#: runs job_submit.lua's slurm_job_submit on each line of stdin: "ok" or "refused<TAB>message"
LUA_DRIVER = """
local said
slurm = { SUCCESS = 0, ERROR = -1, NO_VAL = 4294967294, INFINITE = 4294967295,
          log_user = function(fmt, ...) said = said or string.format(fmt, ...) end }
dofile(arg[1])
for line in io.lines() do
  said = nil
  local rc = slurm_job_submit({ comment = line }, {}, 0)
  print(rc == 0 and "ok" or ("refused\t" .. said))
end
"""
COMMENTS = [
    *("deadline=+6h", "deadline=+1h30m", "my run | deadline=+2h30m,iters=20000", "deadline=+1.5H"),
    *("deadline=+250ms", "deadline=+5min", "deadline=+6", "deadline=+5.h", "deadline=+1h30"),
    *("deadline=+1hm", "deadline=+", "deadline=+4000d", "deadline=+3650d1s", "deadline=tomorow"),
    *("deadline=2026-12-01T12:00Z", "deadline=1893456000", "deadline=99999999999999", "iters=0"),
    *("iters=many", "deadline=+1h deadline=+2h", "deadline=" + "x" * 43, "deadline=" + "x" * 44),
    *("slo=p99:250ms", "SLO=P99.9:1.5S", "slo=p50:1500us", "slo=p99.99:1000us"),
    *("slo=p90:600s", "slo=p99:250ms,deadline=+6h iters=9", "slo=p99-250", "slo=", "slo=p99:250"),
    *("slo=p99:250m", "slo=p99.:250ms", "slo=p99:.5s", "slo=p49.9:250ms"),
    *("slo=p99.991:250ms", "slo=p100:250ms", "slo=p99:999us", "slo=p99:0s", "slo=p99:600.001s"),
    *("slo=p99:250ms slo=p90:1s", "slo=p" + "9" * 50 + ":1s", "slo=p99:" + "1" * 400 + "ms"),
    *("slo=p99:250ms" + "x" * 40,),
]


def test_job_submit_lua_accepts_and_refuses_what_the_prolog_does(tmp_path: Path) -> None:
    if LUA is None:  # tests/prepare.sh installs it; under CI=true its absence is a failure
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but there is no Lua interpreter (apt-get install lua5.1)")
        pytest.skip("no Lua interpreter (apt-get install lua5.1)")
    driver = tmp_path / "driver.lua"
    driver.write_text(LUA_DRIVER)
    assert LUA is not None
    lua = subprocess.run(
        [LUA, str(driver), str(JOB_SUBMIT)],
        input="\n".join(COMMENTS) + "\n",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for comment, answer in zip(COMMENTS, lua, strict=True):
        try:
            parse_comment(comment)
            expected = "ok"
        except InputError as e:
            expected = f"refused\tcdgpc: {e}"
        assert answer == expected, comment
