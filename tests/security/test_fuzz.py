"""Fuzzing every parser that reads what others write: no crash, no stray exception, no change.

Each target gets arbitrary input and input close to valid (the right keys with wrong values,
the right columns with odd cells) and must answer with its typed value or its own one-line
error; any other exception is counted as unhandled and fails the test. The request bodies are
fuzzed against the live head and agent, and a refused body must leave their state as it was.
Every run is deterministic (``derandomize``, no example database) and sized to finish in
seconds; the number of cases each target ran is recorded as evidence.
"""

from __future__ import annotations

import json
import math
import socket
import string
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_cdgpc.agent.progress import ProgressServer
from slurm_cdgpc.config import Config, known_keys, load_config
from slurm_cdgpc.errors import CdgpcError, InputError
from slurm_cdgpc.sim.traces import Trace, load_trace
from slurm_cdgpc.slurm.comment import parse_comment
from slurm_cdgpc.units import parse_duration_s, parse_power_w
from slurm_cdgpc.wire.protocol import (
    ExchangeRequest,
    ExchangeResponse,
    ProgressLine,
    ProtocolError,
    load_json,
)
from tests.evidence import record
from tests.security.live import Daemon, head_and_agent

pytestmark = pytest.mark.security


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@dataclass
class Tally:
    """Cases run and exceptions that were not the target's own one-line error."""

    cases: int = 0
    unhandled: int = 0

    @contextmanager
    def case(
        self, expected: type[BaseException] | tuple[type[BaseException], ...]
    ) -> Iterator[None]:
        self.cases += 1
        try:
            yield
        except expected as e:
            message = str(e)
            assert message and "\n" not in message and "Traceback" not in message, repr(message)
        except Exception:
            self.unhandled += 1
            raise


@contextmanager
def tally(target: str) -> Iterator[Tally]:
    t = Tally()
    try:
        yield t
    finally:
        record("fuzz", target, cases=t.cases, unhandled=t.unhandled)
    assert t.cases > 0 and t.unhandled == 0


# -- strategies ----------------------------------------------------------------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=20)
)
json_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
_words = st.sampled_from(
    ["deadline", "iters", "DEADLINE", "Iters", "x", "", "deadline=", "iters=", "=", ",", " ", "\n"]
)
_values = st.sampled_from(
    [
        "+6h",
        "+1.5d",
        "+0s",
        "2026-12-01T12:00",
        "2026-02-30",
        "1767225600",
        "99999999999999",
        "5",
        "0",
        "-1",
        "$(id)",
        "+",
        "T",
        "2026-12-01T12:00+25:00",
        "2026-12-01T12:00:00.1234567Z",
    ]
)
comment_texts = st.text() | st.lists(
    st.tuples(_words, _values).map("=".join) | _words | st.text(max_size=6), max_size=6
).map(",".join)


def _json_bytes(value: object) -> bytes:
    return json.dumps(value).encode()


# -- pure parsers -----------------------------------------------------------------------------


def test_fuzz_comment_parser() -> None:
    with tally("comment") as t:

        @fuzz_settings(1000)
        @given(comment_texts)
        def run(text: str) -> None:
            with t.case(InputError):
                request = parse_comment(text)
                if request.deadline is not None:
                    assert math.isfinite(request.deadline.resolve(0.0))
                if request.iterations_total is not None:
                    assert 1 <= request.iterations_total <= 2**53

        run()


_quantities = st.text() | st.builds(
    lambda n, sp, u: f"{n}{sp}{u}",
    st.one_of(
        st.floats().map(repr), st.integers().map(str), st.sampled_from(["1e308", ".", "1e999"])
    ),
    st.sampled_from(["", " ", "\t"]),
    st.sampled_from(["", "W", "kW", "MW", "mw", "s", "ms", "m", "min", "h", "d", "x", "kWh"]),
)


def test_fuzz_power_and_duration_parsers() -> None:
    with tally("units") as t:

        @fuzz_settings(1000)
        @given(_quantities)
        def run(text: str) -> None:
            for parse in (parse_power_w, parse_duration_s):
                with t.case(InputError):
                    value = parse(text)
                    assert value > 0 and math.isfinite(value)

        run()


# -- the config loader --------------------------------------------------------------------------


def _toml(value: object) -> str:
    """A TOML literal for a scalar or a list (TOML's basic strings take JSON's escapes)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    assert isinstance(value, list), value
    return "[" + ", ".join(_toml(v) for v in value) + "]"


_KNOWN = known_keys()
_toml_values = st.recursive(
    st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats()
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=5,
)
_typed_values = _toml_values | st.sampled_from(
    [
        "30s",
        "0s",
        "-1s",
        "1e999s",
        "450kW",
        "0W",
        "hmac",
        "munge",
        "simulated",
        "/tmp/x",
        "x",
        "http://head:8463",
        "sqlite:///x.db",
        "0.0.0.0",
        "::1",
        "newton",
        "0.6",
        "200W",
        "root",
    ]
)
_settings_tables = st.dictionaries(
    st.sampled_from(sorted(_KNOWN)),
    st.dictionaries(
        st.sampled_from(sorted({k for keys in _KNOWN.values() for k in keys}))
        | st.text(max_size=6),
        _typed_values,
        max_size=4,
    ),
    max_size=3,
)


def _config_text(tables: dict[str, dict[str, Any]]) -> str:
    lines = []
    for section, table in tables.items():
        lines.append(f"[{section}]")
        lines += [f"{json.dumps(k)} = {_toml(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="cdgpc-fuzz-") as directory:
        yield Path(directory)


def _load(path: Path, text: str | bytes, env: dict[str, str] | None = None) -> Config:
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    return load_config(path, env=env or {})


def test_fuzz_config_loader(scratch: Path) -> None:
    path = scratch / "cdgpc.toml"
    with tally("config") as t:

        @fuzz_settings(300)
        @given(st.one_of(st.text(max_size=200), _settings_tables.map(_config_text)))
        def run_file(text: str | bytes) -> None:
            with t.case(CdgpcError):
                assert isinstance(_load(path, text), Config)

        @fuzz_settings(200)
        @given(
            st.dictionaries(
                st.sampled_from(
                    [f"CDGPC_{s.upper()}_{k.upper()}" for s, keys in _KNOWN.items() for k in keys]
                    + ["CDGPC_NOPE_X", "CDGPC_CONTROL_", "CDGPC_HEAD_URLS"]
                ),
                st.text(max_size=30).filter(lambda s: "\x00" not in s),
                max_size=4,
            ),
            st.dictionaries(st.text(max_size=20), _typed_values | st.none(), max_size=3),
        )
        def run_env(env: dict[str, str], overrides: dict[str, Any]) -> None:
            with t.case(CdgpcError):
                path.write_text("")
                assert isinstance(load_config(path, env=env, overrides=overrides), Config)

        run_file()
        run_env()


def test_a_config_file_that_is_not_utf8_is_a_config_error(scratch: Path) -> None:
    with pytest.raises(CdgpcError, match=r"cdgpc\.toml"):
        _load(scratch / "cdgpc.toml", b'[control]\ninterval = "\x80"\n')


# -- the trace loaders -----------------------------------------------------------------------

_HEADERS = [
    "job_id,submission_time,duration,num_gpu",
    "job_id,submission_time,num_iteration,model_name,deadline,batch_size,num_gpu,duration",
    "job_id,user,num_gpu,submit_time,iterations,model_name,duration,interval,expect_time_list,"
    "expect_value_list,best_effort,job_type",
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,"
    "deletion_time,scheduled_time",
    "job_id,submit,start,end,num_gpu,gpu_type,deadline,job_type,comment",
    "JobID|Submit|Start|End|AllocTRES|Comment",
]
_cells = st.one_of(
    st.integers(min_value=-(10**15), max_value=10**15).map(str),
    st.floats().map(repr),
    st.sampled_from(
        [
            "",
            "0",
            "1",
            "8",
            "Unknown",
            "None",
            "2026-03-01T10:00:00",
            "2026-03-01T10:00:00+01:00",
            "+6h",
            "+1h30m",
            "strict",
            "soft",
            "best",
            "deadline=+2h,iters=5",
            "159-189",
            "10-8",
            "gres/gpu=2",
            "gres/gpu:h100=2,gres/gpu=2",
            "1.5",
            "-",
            '"',
            "a,b",
            "a|b",
            "é",
        ]
    ),
    st.text(alphabet=string.printable, max_size=8),
)


def _trace_text(header: str, rows: list[list[str]]) -> str:
    sep = "|" if "|" in header else ","
    width = header.count(sep) + 1
    lines = [header]
    for row in rows:
        lines.append(sep.join((row + [""] * width)[: width + (len(row) % 3 == 2)]))
    return "\n".join(lines) + "\n"


def test_fuzz_trace_loaders(scratch: Path) -> None:
    with tally("traces") as t:

        def check(path: Path) -> None:
            with t.case(InputError):
                try:
                    assert isinstance(load_trace(path), Trace)
                except InputError as e:
                    assert str(e).startswith(path.name) or str(e).startswith(str(path)), str(e)
                    raise

        @fuzz_settings(300)
        @given(
            st.sampled_from(_HEADERS),
            st.lists(st.lists(_cells, max_size=13), min_size=0, max_size=5),
        )
        def run_rows(header: str, rows: list[list[str]]) -> None:
            path = scratch / "trace.csv"
            path.write_text(_trace_text(header, rows), encoding="utf-8")
            check(path)

        @fuzz_settings(200)
        @given(st.sampled_from(_HEADERS).map(str.encode), st.binary(max_size=300))
        def run_bytes(header: bytes, tail: bytes) -> None:
            path = scratch / "trace.csv"
            path.write_bytes(header + b"\n" + tail)
            check(path)

        run_rows()
        run_bytes()


# -- the wire protocol, in process ------------------------------------------------------------

_exchange_like = st.fixed_dictionaries(
    {
        "version": st.sampled_from([1, 2, True, "1"]) | json_values,
        # this agent's name, or no host name at all (another node's name is a 401, not a 400)
        "node": st.sampled_from(["node1", "", "../etc", "a b", 1, None, True, ["node1"]]),
        "interval": st.integers(min_value=-5, max_value=2**60) | json_values,
        "lease_expires_s": st.floats() | st.integers() | json_values,
        "setpoints": st.lists(
            st.fixed_dictionaries(
                {
                    "gpu": st.integers(min_value=-2, max_value=1100) | json_values,
                    "job_id": st.sampled_from(["1", "12_3", "0", "1;id", ""]) | json_values,
                    "graphics_mhz": st.integers(min_value=-1, max_value=200_000) | json_values,
                },
                optional={"memory_mhz": st.integers() | st.none() | json_values, "x": json_values},
            ),
            max_size=4,
        )
        | json_values,
        "release": st.lists(st.integers(min_value=-1, max_value=1100), max_size=4) | json_values,
    }
)


def test_fuzz_protocol_decoders() -> None:
    decoders: list[Callable[[bytes], object]] = [
        load_json,
        ExchangeRequest.from_json,
        ExchangeResponse.from_json,
        ProgressLine.from_json,
    ]
    with tally("protocol") as t:

        @fuzz_settings(500)
        @given(
            st.one_of(
                st.binary(max_size=300),
                json_values.map(_json_bytes),
                _exchange_like.map(_json_bytes),
            )
        )
        def run(data: bytes) -> None:
            for decode in decoders:
                with t.case(ProtocolError):
                    decoded = decode(data)
                    if isinstance(decoded, ExchangeRequest):
                        assert ExchangeRequest.from_json(decoded.to_json()) == decoded

        run()


def test_fuzz_progress_socket(scratch: Path) -> None:
    """Lines to a real progress socket: every answer is "ok" or one "error: ..." line."""
    got: list[tuple[str, int, int | None, int]] = []
    server = ProgressServer(
        scratch / "progress.sock", lambda j, s, total, uid: got.append((j, s, total, uid))
    )
    server.start()
    try:
        with tally("progress-socket") as t:

            @fuzz_settings(200)
            @given(
                st.one_of(
                    st.binary(max_size=1100),
                    st.fixed_dictionaries(
                        {
                            "job_id": st.sampled_from(["7", "7_1", "x"]) | json_values,
                            "step": json_values,
                        }
                    ).map(_json_bytes),
                )
            )
            def run(line: bytes) -> None:
                t.cases += 1
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(5.0)
                    s.connect(str(scratch / "progress.sock"))
                    s.sendall(line + b"\n")
                    s.shutdown(socket.SHUT_WR)
                    answer = s.recv(4096).decode("ascii")
                if not (
                    answer == "ok\n" or (answer.startswith("error: ") and answer.count("\n") == 1)
                ):
                    t.unhandled += 1
                    raise AssertionError(answer)

            run()
    finally:
        server.close()
    assert all(job in ("7", "7_1") for job, *_ in got)


# -- request bodies against the live daemons -----------------------------------------------------


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    with head_and_agent(tmp_path_factory.mktemp("fuzz")) as (head, agent, _):
        yield head, agent


def _head_state(head: Daemon) -> object:
    return (
        head.ok("GET", "/v1/jobs")["jobs"],
        [(n["name"], n["url"], n["gpu_type"]) for n in head.ok("GET", "/v1/nodes")["nodes"]],
        head.ok("GET", "/v1/budget"),
    )


def _agent_state(agent: Daemon) -> object:
    path = Path(agent.extra["state"])
    return json.loads(path.read_text())["locks"] if path.exists() else None


def _renew(agent: Daemon) -> None:
    lease = {"version": 1, "node": "node1", "interval": 1, "lease_expires_s": time.time() + 3600}
    agent.ok("POST", "/v1/exchange", {**lease, "setpoints": [], "release": []})


_names = st.sampled_from(["node1", "n-2.x", "", "-x", "../etc", "a b", "ñ"]) | json_values
_BODIES: dict[str, st.SearchStrategy[Any]] = {
    "head POST /v1/jobs": st.fixed_dictionaries(
        {
            "job_id": st.sampled_from(["5", "6_1", "0", "x"]) | json_values,
            "user": st.sampled_from(["root", "a$", "", "$(id)"]) | json_values,
            "node": _names,
            "gpus": st.lists(st.integers(min_value=-1, max_value=1100), max_size=3) | json_values,
        },
        optional={
            "deadline_s": st.floats() | json_values,
            "iterations_total": st.integers() | json_values,
            "gpu_type": st.sampled_from(["A100-SXM4-80GB", "x"]) | json_values,
            "extra": json_values,
        },
    ),
    "head POST /v1/nodes": st.fixed_dictionaries(
        {
            "node": _names,
            "url": st.sampled_from(["http://127.0.0.1:9", "ssh://n1", "ftp://x", "http://"])
            | json_values,
        },
        optional={"gpu_type": st.sampled_from(["A40", "nope"]) | json_values},
    ),
    "head POST /v1/budget": st.fixed_dictionaries(
        {"budget_w": st.floats() | st.integers() | json_values},
        optional={
            "effective_at_s": st.floats() | json_values,
            "reason": json_values,
            "domain": st.sampled_from(["rack1", "cluster", "rack99", ""]) | json_values,
        },
    ),
    "agent POST /v1/exchange": _exchange_like,
    "agent POST /v1/release": st.fixed_dictionaries(
        {"job_id": st.sampled_from(["5", "x"]) | json_values}
    ),
}


@pytest.mark.live
@pytest.mark.parametrize("target", sorted(_BODIES))
def test_fuzz_request_bodies(daemons: tuple[Daemon, Daemon], target: str) -> None:
    head, agent = daemons
    server, method, path = target.split()
    daemon = head if server == "head" else agent
    state: Callable[[], object] = (
        (lambda: _head_state(head)) if server == "head" else (lambda: _agent_state(agent))
    )
    with tally(f"body {target}") as t:

        @fuzz_settings(80)
        @given(
            st.one_of(
                _BODIES[target].map(_json_bytes),
                json_values.map(_json_bytes),
                st.binary(max_size=80),
            )
        )
        def run(body: bytes) -> None:
            t.cases += 1
            before = state()
            reply = daemon.request(method, path, body)
            if reply.status == 200:
                if target == "agent POST /v1/exchange":
                    # an accepted lease may be short: renew it, or the agent's own lapse
                    # (the safe cap) would look like a change made by the next case
                    _renew(agent)
                return
            if reply.status != 400 or state() != before:
                t.unhandled += 1
            assert reply.status == 400, (reply.status, body[:200], reply.body[:200])
            reply.error()
            assert state() == before, body[:200]

        run()
    for d in (head, agent):
        assert d.proc.poll() is None and "Traceback" not in d.text(), d.text()[-3000:]
