"""The head ↔ agent messages: round trips, strict refusals, fuzzing."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.wire.protocol import (
    MAX_MESSAGE_BYTES,
    ExchangeRequest,
    ExchangeResponse,
    GpuReport,
    LockReport,
    MessageTooLargeError,
    ProgressLine,
    ProgressReport,
    ProtocolError,
    Refusal,
    Setpoint,
    _gpu_report_fast,
)

REQUEST = ExchangeRequest(
    interval=42,
    lease_expires_s=1_767_225_690.5,
    setpoints=(Setpoint(0, "123", 1200), Setpoint(3, "124_7", 900, 7251)),
    release=(1, 2),
    node="gpu01",
)
RESPONSE = ExchangeResponse(
    node="gpu01",
    time_s=1_767_225_600.25,
    gpus=(
        GpuReport(
            index=0,
            uuid="GPU-0000",
            name="A100-SXM4-80GB",
            power_w=312.5,
            energy_j=1.5e6,
            sm_clock_mhz=1200,
            memory_clock_mhz=1593,
            enforced_limit_w=400.0,
            throttle=0x4,
            locked=LockReport(210, 1200, None),
            job_id="123",
            error=None,
            read_s=81_234.125,
        ),
        GpuReport(
            index=1,
            uuid="GPU-0001",
            name="A100-SXM4-80GB",
            power_w=None,
            energy_j=None,
            sm_clock_mhz=None,
            memory_clock_mhz=None,
            enforced_limit_w=None,
            throttle=None,
            locked=None,
            job_id=None,
            error="read failed: GPU fell off the bus",
        ),
    ),
    progress=(ProgressReport("123", 500, 10_000, 1_767_225_599.0, 1000),),
    refused=(Refusal(3, "graphics clock 901 MHz is not supported"),),
)


def test_request_round_trip() -> None:
    assert ExchangeRequest.from_json(REQUEST.to_json()) == REQUEST
    assert ExchangeRequest.from_json(REQUEST.to_json().decode()) == REQUEST


def test_leader_epoch_round_trips_and_is_left_out_when_zero() -> None:
    """A head with a leader lock sends its epoch; a sender without one sends the version 1
    message it always did, and an agent reads a missing epoch as 0."""
    fenced = replace(REQUEST, epoch=7)
    assert json.loads(fenced.to_json())["epoch"] == 7
    assert ExchangeRequest.from_json(fenced.to_json()) == fenced
    assert "epoch" not in json.loads(REQUEST.to_json())
    assert ExchangeRequest.from_json(REQUEST.to_json()).epoch == 0


def test_response_round_trip() -> None:
    assert ExchangeResponse.from_json(RESPONSE.to_json()) == RESPONSE


def test_a_request_names_its_node_and_a_constructor_without_one_is_refused() -> None:
    """The node is part of the signed body: without it a request would be good on any node."""
    assert json.loads(REQUEST.to_json())["node"] == "gpu01"
    with pytest.raises(ProtocolError, match="node name must be a host name"):
        replace(REQUEST, node="not a host")


def test_progress_line_round_trip() -> None:
    line = ProgressLine("55_3", 7, 100)
    assert ProgressLine.from_json(line.to_json()) == line
    assert ProgressLine.from_json(b'{"job_id": "9", "step": 0}') == ProgressLine("9", 0, None)


def _request(**changes: Any) -> dict[str, Any]:
    data = json.loads(REQUEST.to_json())
    for key, value in changes.items():
        if value is _DROP:
            del data[key]
        else:
            data[key] = value
    return data


def _setpoint(**changes: Any) -> dict[str, Any]:
    sp: dict[str, Any] = {"gpu": 0, "job_id": "1", "graphics_mhz": 1200, "memory_mhz": None}
    sp.update(changes)
    return _request(setpoints=[sp], release=[])


_DROP = object()

BAD_REQUESTS: list[tuple[str, object, str]] = [
    ("not JSON", b"{", "not valid JSON"),
    ("not UTF-8", b'{"version": 1, "x": "\xff"}', "not UTF-8"),
    ("an array", b"[]", "request: must be a JSON object"),
    ("NaN", b'{"version": 1, "lease_expires_s": NaN}', "NaN is not a number"),
    ("duplicate key", b'{"version": 1, "version": 1}', "duplicate field"),
    ("deep nesting", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ("unknown field", _request(extra=1), "request: unknown field 'extra'"),
    ("missing field", _request(release=_DROP), "request: missing field 'release'"),
    ("no node", _request(node=_DROP), "request: missing field 'node'"),
    ("node not a name", _request(node="../etc"), "node: must be a host name"),
    ("node a number", _request(node=1), "node: must be a host name"),
    ("version 2", _request(version=2), "version: this agent speaks version 1"),
    ("version true", _request(version=True), "version"),
    ("negative interval", _request(interval=-1), "interval: must be an integer"),
    ("float interval", _request(interval=1.5), "interval: must be an integer"),
    ("string lease", _request(lease_expires_s="soon"), "lease_expires_s: must be a number"),
    ("setpoints object", _request(setpoints={}), "setpoints: must be a JSON array"),
    ("release strings", _request(release=["1"]), "release[0]: must be an integer"),
    ("release twice", _request(release=[1, 1], setpoints=[]), "release: a GPU is listed twice"),
    ("bool gpu", _setpoint(gpu=True), "setpoints[0].gpu"),
    ("negative gpu", _setpoint(gpu=-1), "setpoints[0].gpu"),
    ("huge clock", _setpoint(graphics_mhz=10**9), "setpoints[0].graphics_mhz"),
    ("zero clock", _setpoint(graphics_mhz=0), "setpoints[0].graphics_mhz"),
    ("string clock", _setpoint(graphics_mhz="1200"), "setpoints[0].graphics_mhz"),
    ("float memory", _setpoint(memory_mhz=1593.0), "setpoints[0].memory_mhz"),
    ("job id letters", _setpoint(job_id="abc"), "setpoints[0].job_id: must be a Slurm job id"),
    ("job id injection", _setpoint(job_id="1; rm -rf /"), "setpoints[0].job_id"),
    ("job id number", _setpoint(job_id=123), "setpoints[0].job_id"),
    ("setpoint extra", _setpoint(power_w=3), "setpoints[0]: unknown field 'power_w'"),
    (
        "set and released",
        _request(setpoints=[{"gpu": 1, "job_id": "1", "graphics_mhz": 900}], release=[1]),
        "release: GPU 1 is also given a setpoint",
    ),
    (
        "gpu twice",
        _request(
            setpoints=[
                {"gpu": 1, "job_id": "1", "graphics_mhz": 900},
                {"gpu": 1, "job_id": "2", "graphics_mhz": 900},
            ],
            release=[],
        ),
        "setpoints[1].gpu: GPU 1 is listed twice",
    ),
    ("too many setpoints", _request(setpoints=[{}] * 2000), "setpoints: at most 1024 entries"),
    ("negative epoch", _request(epoch=-1), "epoch: must be an integer"),
    ("bool epoch", _request(epoch=True), "epoch: must be an integer"),
    ("float epoch", _request(epoch=2.0), "epoch: must be an integer"),
    ("string epoch", _request(epoch="3"), "epoch: must be an integer"),
    ("huge integer", b'{"version": 1, "interval": ' + b"9" * 5000 + b"}", "not valid JSON"),
]


@pytest.mark.parametrize(
    ("data", "message"),
    [(d, m) for _, d, m in BAD_REQUESTS],
    ids=[name for name, _, _ in BAD_REQUESTS],
)
def test_bad_requests_are_refused_with_one_line(data: object, message: str) -> None:
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    with pytest.raises(ProtocolError) as info:
        ExchangeRequest.from_json(raw)
    text = str(info.value)
    assert message in text
    assert "\n" not in text and len(text) < 300
    assert isinstance(info.value, InputError)


def test_oversized_message_is_refused_before_parsing() -> None:
    data = b" " * (MAX_MESSAGE_BYTES + 1)
    with pytest.raises(MessageTooLargeError, match="limit is 1048576"):
        ExchangeRequest.from_json(data)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("power_w", 1e30),
        ("power_w", -1.0),
        ("throttle", -1),
        ("job_id", "x"),
        ("error", "two\nlines"),
        ("uuid", ""),
        ("locked", {"graphics_min_mhz": 1}),
        ("read_s", -1.0),
        ("read_s", "now"),
    ],
)
def test_bad_responses_are_refused(field: str, value: object) -> None:
    data = json.loads(RESPONSE.to_json())
    data["gpus"][0][field] = value
    with pytest.raises(ProtocolError, match=f"gpus\\[0\\]\\.{field}"):
        ExchangeResponse.from_json(json.dumps(data))


@pytest.mark.parametrize(
    "line",
    [
        b'{"job_id": "1", "step": 5, "total": 4}',
        b'{"job_id": "1", "step": -1}',
        b'{"job_id": "1", "step": 1, "uid": 0}',
        b'{"job_id": "", "step": 1}',
        b'{"job_id": "1", "step": 1, "total": 0}',
        b'{"job_id": "1", "step": "' + b"1" * 2000 + b'"}',
    ],
)
def test_bad_progress_lines_are_refused(line: bytes) -> None:
    with pytest.raises(ProtocolError):
        ProgressLine.from_json(line)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "version",
                    "node",
                    "interval",
                    "lease_expires_s",
                    "setpoints",
                    "release",
                    "gpu",
                    "x",
                ]
            )
            | st.text(max_size=5),
            children,
            max_size=6,
        )
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | _json.map(lambda v: json.dumps(v).encode()))
def test_fuzzed_requests_raise_only_input_errors(data: bytes) -> None:
    for parse in (ExchangeRequest.from_json, ExchangeResponse.from_json, ProgressLine.from_json):
        try:
            parse(data)
        except InputError as e:
            assert "\n" not in str(e)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.builds(
            Setpoint,
            gpu=st.integers(0, 1023),
            job_id=st.from_regex(r"\A[1-9][0-9]{0,5}([_+](0|[1-9][0-9]{0,2}))?\Z"),
            graphics_mhz=st.integers(1, 100_000),
            memory_mhz=st.none() | st.integers(1, 100_000),
            power_limit_w=st.none() | st.floats(1e-3, 1e5, allow_nan=False),
            tenants=st.lists(st.sampled_from(["900001", "900002_3", "900004+1"]), unique=True).map(
                tuple
            ),
        ),
        max_size=8,
        unique_by=lambda s: s.gpu,
    ),
    st.floats(0, 1e10, allow_nan=False),
)
def test_valid_requests_round_trip(setpoints: list[Setpoint], lease_s: float) -> None:
    req = ExchangeRequest(
        interval=3, lease_expires_s=lease_s, setpoints=tuple(setpoints), node="gpu01"
    )
    assert ExchangeRequest.from_json(req.to_json()) == req


# -- the head's fast path for well-formed GPU reports ------------------------------------------

_ODD_VALUES: tuple[object, ...] = (
    None,
    True,
    False,
    0,
    -1,
    1,
    7,
    2**64,
    0.0,
    -0.5,
    312.5,
    1e30,
    float("nan"),
    float("inf"),
    "",
    "x",
    "123",
    "two\nlines",
    "é",
    "A" * 513,
    [],
    {},
    {"graphics_min_mhz": 210, "graphics_max_mhz": 1200, "memory_mhz": None},
    {"graphics_min_mhz": 210, "graphics_max_mhz": 1200, "memory_mhz": True},
    {"graphics_min_mhz": 210.0, "graphics_max_mhz": 1200, "memory_mhz": None},
    {"graphics_min_mhz": 210, "graphics_max_mhz": 1200},
    {"graphics_min_mhz": 210, "graphics_max_mhz": 1200, "memory_mhz": None, "x": 1},
)


def _checked_or_none(value: object) -> GpuReport | None:
    try:
        return GpuReport._checked(value, "gpus[0]")
    except ProtocolError:
        return None


@pytest.mark.parametrize("report", [g.to_dict() for g in RESPONSE.gpus])
def test_the_fast_path_accepts_nothing_the_checked_path_refuses(report: dict[str, Any]) -> None:
    """Every field of a valid report, in turn, set to every kind of odd value (and removed, and
    joined by an unknown one): the fast path either declines or gives what the checked path
    gives, and it takes the valid reports themselves."""
    assert _gpu_report_fast(report) == _checked_or_none(report) is not None
    cases: list[dict[str, Any]] = [{**report, "unknown": 1}]
    for field in report:
        cases.append({k: v for k, v in report.items() if k != field})
        cases += [{**report, field: value} for value in _ODD_VALUES]
    taken = 0
    for case in cases:
        fast = _gpu_report_fast(case)
        if fast is not None:
            taken += 1
            assert fast == _checked_or_none(case), case
    assert taken > len(report)  # it does take valid variants, not only the one report


def test_a_setpoint_is_parsed_the_same_by_either_path() -> None:
    """`Setpoint.from_dict` takes plainly valid setpoints in one pass: for every field set to
    every kind of odd value (or removed, or joined by an unknown one) it gives what the
    field-by-field path gives, the same value or the same one-line refusal."""
    valid = {
        "gpu": 3,
        "job_id": "124_7",
        "graphics_mhz": 900,
        "memory_mhz": 7251,
        "power_limit_w": 250.5,
    }
    cases: list[object] = [valid, {**valid, "unknown": 1}, [], "x", None]
    cases += [{**valid, "power_limit_w": w} for w in (1e5, 1e5 + 0.5, 5e-324, -0.0, 250)]
    for field in valid:
        cases.append({k: v for k, v in valid.items() if k != field})
        cases += [{**valid, field: value} for value in _ODD_VALUES]

    def outcome(parse: Any, value: object) -> object:
        try:
            return parse(value, "setpoints[0]")
        except ProtocolError as e:
            return str(e)

    taken = 0
    for case in cases:
        expected = outcome(Setpoint._checked, case)
        assert outcome(Setpoint.from_dict, case) == expected, case
        taken += isinstance(expected, Setpoint)
    assert taken > len(valid)


def test_a_setpoints_power_limit_is_optional_and_checked() -> None:
    """The guard rail travels only when set (an older agent parses a head with the rail off),
    and a bad one is refused in one line that names the field."""
    plain = ExchangeRequest(3, 1e9, (Setpoint(0, "7", 1200),), node="gpu01")
    assert b"power_limit_w" not in plain.to_json()
    railed = ExchangeRequest(3, 1e9, (Setpoint(0, "7", 1200, None, 287.5),), node="gpu01")
    assert ExchangeRequest.from_json(railed.to_json()) == railed
    for bad in ("0", "-5", "1e6", "true", '"300"', "1e400"):
        text = railed.to_json().decode().replace("287.5", bad)
        with pytest.raises(ProtocolError) as caught:
            ExchangeRequest.from_json(text)
        message = str(caught.value)
        assert "\n" not in message
        assert message.startswith("setpoints[0].power_limit_w") or "not valid JSON" in message


def test_a_setpoint_names_the_jobs_sharing_its_gpu_only_when_there_are_any() -> None:
    plain = ExchangeRequest(3, 1e9, (Setpoint(0, "7", 1200),), node="gpu01")
    assert b"tenants" not in plain.to_json()  # what an older agent parses
    shared = ExchangeRequest(3, 1e9, (Setpoint(0, "7", 1200, tenants=("8", "9_1")),), node="g1")
    assert ExchangeRequest.from_json(shared.to_json()) == shared
    for bad, field in (
        ('["8", "8"]', "setpoints[0].tenants: a job is named twice"),
        ('["7"]', "setpoints[0].tenants: a job is named twice"),
        ('["x y"]', "setpoints[0].tenants[0]"),
        ('"8"', "setpoints[0].tenants: must be a JSON array"),
        (json.dumps([str(i) for i in range(1, 66)]), "setpoints[0].tenants"),
    ):
        text = shared.to_json().decode().replace('["8","9_1"]', bad)
        assert bad in text
        with pytest.raises(ProtocolError) as caught:
            ExchangeRequest.from_json(text)
        assert str(caught.value).startswith(field) and "\n" not in str(caught.value)


# -- a serving job's latency and request rate on the progress path -----------------------------


def test_a_training_jobs_line_and_report_are_the_bytes_they_were() -> None:
    """No serving field is written unless set: an older agent or head parses them."""
    assert ProgressLine("55_3", 7, 100).to_json() == b'{"job_id":"55_3","step":7,"total":100}'
    report = ProgressReport("123", 500, None, 1.5, 1000)
    assert report.to_dict() == {
        "job_id": "123",
        "step": 500,
        "total": None,
        "time_s": 1.5,
        "uid": 1000,
    }


def test_a_serving_line_and_report_round_trip() -> None:
    line = ProgressLine("9", 81_234, None, latency_s=0.212, rate=140.5)
    assert line.to_json() == (
        b'{"job_id":"9","step":81234,"total":null,"latency_s":0.212,"rate":140.5}'
    )
    assert ProgressLine.from_json(line.to_json()) == line
    idle = ProgressLine.from_json(b'{"job_id": "9", "step": 3, "rate": 0}')
    assert (idle.latency_s, idle.rate) == (None, 0.0)
    served = replace(RESPONSE, progress=(ProgressReport("9", 81_234, None, 7.0, 0, 0.25, 12.0),))
    assert ExchangeResponse.from_json(served.to_json()) == served
    assert json.loads(served.to_json())["progress"][0]["latency_s"] == 0.25


_BAD_SERVING: list[tuple[str, object]] = [
    ("latency_s", 0),
    ("latency_s", -0.1),
    ("latency_s", 3600.5),
    ("latency_s", True),
    ("latency_s", "0.25"),
    ("latency_s", float("nan")),
    ("latency_s", float("inf")),
    ("rate", -1.0),
    ("rate", 1.5e6),
    ("rate", False),
    ("rate", "5"),
    ("rate", float("nan")),
]


@pytest.mark.parametrize(("field", "value"), _BAD_SERVING)
def test_bad_serving_fields_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ProtocolError) as caught:
        ProgressLine("9", 1, **{field: value})  # type: ignore[arg-type]
    assert str(caught.value).startswith(f"{field}: ") and "\n" not in str(caught.value)
    if isinstance(value, float) and not math.isfinite(value):
        return  # JSON has no NaN or infinity: the parser refuses those before any field
    text = json.dumps({"job_id": "9", "step": 1, field: value}).encode()
    with pytest.raises(ProtocolError, match=f"^{field}: "):
        ProgressLine.from_json(text)
    data = json.loads(RESPONSE.to_json())
    data["progress"][0][field] = value
    with pytest.raises(ProtocolError, match=rf"^progress\[0\]\.{field}: "):
        ExchangeResponse.from_json(json.dumps(data))
