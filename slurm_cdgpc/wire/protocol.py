"""The messages between the head and a node agent, and the progress line jobs send: one JSON object
each, version 1, at most `MAX_MESSAGE_BYTES`, parsed strictly (a `ProtocolError` line naming the
field). It reaches only the standard library, `slurm_cdgpc.errors` and the rest of `wire/`: the
progress client uses it inside training jobs (`tests/unit/test_import_graph.py`). Design:
DESIGN.md, "The exchange" (The messages); tests: `tests/unit/test_wire_protocol.py`,
`tests/security/test_fuzz.py`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, TypeGuard

from slurm_cdgpc.errors import InputError, one_line
from slurm_cdgpc.wire import names

if TYPE_CHECKING:
    from slurm_cdgpc.wire.board import BoardDescription

VERSION: Final = 1
MAX_MESSAGE_BYTES: Final = 1024 * 1024
#: the Epilog asks its node's agent to reset a finished job's GPUs here (loopback only)
RELEASE_PATH: Final = "/v1/release"
#: the Prolog asks its node's agent to hold a starting job's GPUs at the safe cap (loopback only)
HOLD_PATH: Final = "/v1/hold"
#: ... and which physical GPUs the MIG instances Slurm names are on (loopback only)
MIG_PATH: Final = "/v1/mig"
MAX_PROGRESS_LINE_BYTES: Final = 1024
MAX_GPUS: Final = 1024  # entries in setpoints/release/gpus/refused
MAX_PROGRESS_ENTRIES: Final = 4096
MAX_CLOCK_MHZ: Final = 100_000
MAX_GPU_INDEX: Final = MAX_GPUS - 1
MAX_COUNT: Final = 2**53  # steps, intervals: exact in a JSON double
MAX_TEXT_CHARS: Final = 512
MAX_UID: Final = 0xFFFFFFFE
MAX_THROTTLE: Final = 2**64 - 1
#: jobs sharing one GPU (shards, MPS clients, MIG instances) named in one setpoint
MAX_TENANTS: Final = 64


class ProtocolError(InputError):
    """A message that is not valid JSON of the expected schema (one line, names the field)."""


class MessageTooLargeError(ProtocolError):
    """A message larger than the cap (HTTP 413)."""


# -- checks: each returns the typed value or raises ProtocolError naming the field ------------


def _got(value: object) -> str:
    return f"got {one_line(repr(value), 60)}"


def _fields(
    value: object, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{where}: must be a JSON object, {_got(value)}")
    unknown = sorted(k for k in value if k not in required and k not in optional)
    if unknown:
        raise ProtocolError(f"{where}: unknown field {_got(unknown[0])[4:]}")
    missing = [k for k in required if k not in value]
    if missing:
        raise ProtocolError(f"{where}: missing field {missing[0]!r}")
    return value


def _int(value: object, where: str, lo: int, hi: int) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi:
        return value
    raise ProtocolError(f"{where}: must be an integer in {lo}..{hi}, {_got(value)}")


def _opt_int(value: object, where: str, lo: int, hi: int) -> int | None:
    return None if value is None else _int(value, where, lo, hi)


def _float(value: object, where: str, lo: float, hi: float) -> float:
    if (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and lo <= value <= hi
    ):
        return float(value)
    raise ProtocolError(f"{where}: must be a number in {lo:g}..{hi:g}, {_got(value)}")


def _opt_float(value: object, where: str, lo: float, hi: float) -> float | None:
    return None if value is None else _float(value, where, lo, hi)


def _opt_positive(value: object, where: str, hi: float, expected: str) -> float | None:
    """None, or a finite number in (0, ``hi``], else `ProtocolError`: ``where: must be
    <expected>, got ...``."""
    if value is None:
        return None
    if (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value <= hi
    ):
        return float(value)
    raise ProtocolError(f"{where}: must be {expected}, {_got(value)}")


def _is_text(value: object) -> TypeGuard[str]:
    return (
        isinstance(value, str)
        and 0 < len(value) <= MAX_TEXT_CHARS
        and value.isprintable()
        and value.isascii()
    )


def _text(value: object, where: str) -> str:
    if _is_text(value):
        return value
    raise ProtocolError(
        f"{where}: must be 1..{MAX_TEXT_CHARS} printable ASCII characters, {_got(value)}"
    )


def _opt_text(value: object, where: str) -> str | None:
    return None if value is None else _text(value, where)


def _name(parse: Callable[[object, str], str], value: object, where: str) -> str:
    """A name parsed by ``parse`` (`slurm_cdgpc.wire.names`), its refusal a `ProtocolError`."""
    try:
        return parse(value, where)
    except InputError as e:
        raise ProtocolError(str(e)) from None


def job_id(value: object, where: str = "job_id") -> str:
    """A Slurm job id (`slurm_cdgpc.wire.names.JOB_ID`), else `ProtocolError`."""
    return _name(names.job_id, value, where)


def _opt_job_id(value: object, where: str) -> str | None:
    return None if value is None else job_id(value, where)


def _list(value: object, where: str, limit: int) -> list[Any]:
    if not isinstance(value, list):
        raise ProtocolError(f"{where}: must be a JSON array, {_got(value)}")
    if len(value) > limit:
        raise ProtocolError(f"{where}: at most {limit} entries, got {len(value)}")
    return value


def gpu_indices(value: object, where: str) -> tuple[int, ...]:
    """A JSON array of GPU indices (at most `MAX_GPUS`), else `ProtocolError` naming the entry."""
    return tuple(
        _int(item, f"{where}[{i}]", 0, MAX_GPU_INDEX)
        for i, item in enumerate(_list(value, where, MAX_GPUS))
    )


def mig_names(value: object, where: str) -> tuple[str, ...]:
    """A JSON array of MIG instance names (`slurm_cdgpc.wire.names.MIG_DEVICE`, at most
    `MAX_GPUS`), else `ProtocolError` naming the entry."""
    return tuple(
        _name(names.mig_device, item, f"{where}[{i}]")
        for i, item in enumerate(_list(value, where, MAX_GPUS))
    )


def _version(data: Mapping[str, Any]) -> int:
    version = data["version"]
    if isinstance(version, int) and not isinstance(version, bool) and version == VERSION:
        return version
    raise ProtocolError(f"version: this agent speaks version {VERSION}, {_got(version)}")


def _reject_constant(name: str) -> object:
    raise ProtocolError(f"not valid JSON: {name} is not a number")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) == len(pairs):  # the common case, without a Python loop over every key
        return result
    result = {}
    for key, value in pairs:
        if key in result:
            raise ProtocolError(f"duplicate field {_got(key)[4:]}")
        result[key] = value
    return result


#: made once: ``json.loads`` and ``json.dumps`` with options build a new decoder or encoder on
#: every call, a few microseconds each on every request and answer (both are stateless between
#: calls, as the standard library's own shared default ones are)
_DECODER: Final = json.JSONDecoder(
    parse_constant=_reject_constant, object_pairs_hook=_no_duplicates
)
_ENCODER: Final = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def load_json(data: bytes | str, limit_bytes: int = MAX_MESSAGE_BYTES) -> object:
    """Decode one JSON document of at most ``limit_bytes`` UTF-8 bytes, strictly."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if not isinstance(raw, bytes | bytearray):
        raise ProtocolError(f"message must be bytes or text, {_got(type(data).__name__)}")
    if len(raw) > limit_bytes:
        raise MessageTooLargeError(f"message is {len(raw)} bytes; the limit is {limit_bytes}")
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("message is not UTF-8") from None
    try:
        return _DECODER.decode(text)
    except ProtocolError:
        raise
    except RecursionError:
        raise ProtocolError("not valid JSON: nested too deeply") from None
    except ValueError as e:
        first = (str(e).splitlines() or ["malformed"])[0][:200]
        raise ProtocolError(f"not valid JSON: {first}") from None


def dump_json(data: object) -> bytes:
    """Compact, ASCII-only JSON (NaN and Infinity are refused: they are not JSON)."""
    return _ENCODER.encode(data).encode("ascii")


# -- the exchange request ----------------------------------------------------------------------

_SETPOINT_KEYS: Final = frozenset(("gpu", "job_id", "graphics_mhz", "memory_mhz", "power_limit_w"))
#: the largest power limit a setpoint may carry (no board comes near it)
MAX_POWER_LIMIT_W: Final = 1e5


def _power_limit(value: object, where: str) -> float | None:
    """None, or a finite power in (0, `MAX_POWER_LIMIT_W`] W, else `ProtocolError`."""
    expected = f"a power in W, above 0 and at most {MAX_POWER_LIMIT_W:g}"
    return _opt_positive(value, where, MAX_POWER_LIMIT_W, expected)


@dataclass(frozen=True)
class Setpoint:
    """Cap GPU ``gpu`` (this node's index) at ``graphics_mhz`` for job ``job_id``; with
    ``power_limit_w``, hold its power limit there too (the guard rail; None: default limit). On
    a GPU in MIG mode, whose clocks cannot be locked, the limit is the setpoint: required there.
    ``tenants``: the other jobs that share the GPU, at the same clocks (written only when
    there are any: an unshared setpoint is what an older agent parses)."""

    gpu: int
    job_id: str
    graphics_mhz: int
    memory_mhz: int | None = None
    power_limit_w: float | None = None
    tenants: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "gpu": self.gpu,
            "job_id": self.job_id,
            "graphics_mhz": self.graphics_mhz,
            "memory_mhz": self.memory_mhz,
        }
        if self.power_limit_w is not None:
            data["power_limit_w"] = self.power_limit_w
        if self.tenants:
            data["tenants"] = list(self.tenants)
        return data

    @classmethod
    def from_dict(cls, value: object, where: str) -> Setpoint:
        """The setpoint in ``value``, else `ProtocolError` naming the field. A plainly valid
        one (every agent parses one per GPU per interval) takes a single pass; anything else
        the field-by-field path, which says exactly what is wrong."""
        if type(value) is dict and value.keys() <= _SETPOINT_KEYS:
            gpu, job, graphics = value.get("gpu"), value.get("job_id"), value.get("graphics_mhz")
            memory, limit = value.get("memory_mhz"), value.get("power_limit_w")
            if (
                type(gpu) is int
                and 0 <= gpu <= MAX_GPU_INDEX
                and type(graphics) is int
                and 1 <= graphics <= MAX_CLOCK_MHZ
                and (memory is None or (type(memory) is int and 1 <= memory <= MAX_CLOCK_MHZ))
                and (limit is None or (type(limit) is float and 0.0 < limit <= MAX_POWER_LIMIT_W))
                and type(job) is str
                and names.JOB_ID.fullmatch(job)
            ):
                return cls(gpu, job, graphics, memory, limit)
        return cls._checked(value, where)

    @classmethod
    def _checked(cls, value: object, where: str) -> Setpoint:
        d = _fields(
            value,
            where,
            ("gpu", "job_id", "graphics_mhz"),
            ("memory_mhz", "power_limit_w", "tenants"),
        )
        owner = job_id(d["job_id"], f"{where}.job_id")
        tenants = tuple(
            job_id(t, f"{where}.tenants[{i}]")
            for i, t in enumerate(_list(d.get("tenants", []), f"{where}.tenants", MAX_TENANTS))
        )
        if len(set(tenants) | {owner}) != len(tenants) + 1:
            raise ProtocolError(f"{where}.tenants: a job is named twice")
        return cls(
            gpu=_int(d["gpu"], f"{where}.gpu", 0, MAX_GPU_INDEX),
            job_id=owner,
            graphics_mhz=_int(d["graphics_mhz"], f"{where}.graphics_mhz", 1, MAX_CLOCK_MHZ),
            memory_mhz=_opt_int(d.get("memory_mhz"), f"{where}.memory_mhz", 1, MAX_CLOCK_MHZ),
            power_limit_w=_power_limit(d.get("power_limit_w"), f"{where}.power_limit_w"),
            tenants=tenants,
        )


@dataclass(frozen=True)
class ExchangeRequest:
    """What the head sends every interval (``POST /v1/exchange``): setpoints, released GPUs
    and the lease expiry::

        {"version": 1, "node": "node1", "interval": 42, "lease_expires_s": 1767225690.0,
         "setpoints": [{"gpu": 0, "job_id": "123", "graphics_mhz": 1200, "memory_mhz": null}],
         "release": [3], "epoch": 7}

    ``release`` lists GPUs whose job ended: the agent resets them to default clocks; a GPU may
    not be both set and released in one request. ``epoch`` is written only when not 0, and a
    setpoint's ``power_limit_w`` only when set, so a sender without them sends exactly what an
    older agent parses. A bad field is refused in one line, e.g. ``setpoints[2].graphics_mhz:
    must be an integer in 1..100000, got -5``.
    """

    interval: int
    lease_expires_s: float  # epoch seconds
    setpoints: tuple[Setpoint, ...] = ()
    release: tuple[int, ...] = ()
    #: the sender's leader epoch, the fencing token (0: a sender without a leader lock)
    epoch: int = 0
    version: int = VERSION
    #: the node the request is for (the agent refuses any other: a captured request is no
    #: good on another node)
    node: str = field(kw_only=True)
    #: the head asks for the node's board descriptions (`ExchangeResponse.boards`): it has
    #: none yet, or a GPU reports a board it does not know
    describe: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        check_node_name(self.node)

    def to_json(self) -> bytes:
        data: dict[str, Any] = {
            "version": self.version,
            "node": self.node,
            "interval": self.interval,
            "lease_expires_s": self.lease_expires_s,
            "setpoints": [s.to_dict() for s in self.setpoints],
            "release": list(self.release),
        }
        if self.epoch:
            data["epoch"] = self.epoch
        if self.describe:
            data["describe"] = True
        return dump_json(data)

    @classmethod
    def from_json(cls, data: bytes | str) -> ExchangeRequest:
        d = _fields(
            load_json(data),
            "request",
            ("version", "node", "interval", "lease_expires_s", "setpoints", "release"),
            ("epoch", "describe"),
        )
        describe = d.get("describe", False)
        if not isinstance(describe, bool):
            raise ProtocolError(f"describe: must be true or false, {_got(describe)}")
        version = _version(d)
        node = _name(names.node_name, d["node"], "node")
        setpoints = tuple(
            Setpoint.from_dict(item, f"setpoints[{i}]")
            for i, item in enumerate(_list(d["setpoints"], "setpoints", MAX_GPUS))
        )
        release = gpu_indices(d["release"], "release")
        seen: set[int] = set()
        for i, s in enumerate(setpoints):
            if s.gpu in seen:
                raise ProtocolError(f"setpoints[{i}].gpu: GPU {s.gpu} is listed twice")
            seen.add(s.gpu)
        if len(set(release)) != len(release):
            raise ProtocolError("release: a GPU is listed twice")
        both = sorted(seen & set(release))
        if both:
            raise ProtocolError(f"release: GPU {both[0]} is also given a setpoint")
        return cls(
            version=version,
            node=node,
            interval=_int(d["interval"], "interval", 0, MAX_COUNT),
            lease_expires_s=_float(d["lease_expires_s"], "lease_expires_s", 0.0, 1e11),
            setpoints=setpoints,
            release=release,
            epoch=_int(d.get("epoch", 0), "epoch", 0, MAX_COUNT),
            describe=describe,
        )


# -- the exchange response ---------------------------------------------------------------------


@dataclass(frozen=True)
class LockReport:
    """The clock lock the agent set on a GPU (NVML cannot read one back)."""

    graphics_min_mhz: int
    graphics_max_mhz: int
    memory_mhz: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "graphics_min_mhz": self.graphics_min_mhz,
            "graphics_max_mhz": self.graphics_max_mhz,
            "memory_mhz": self.memory_mhz,
        }

    @classmethod
    def from_dict(cls, value: object, where: str) -> LockReport:
        d = _fields(value, where, ("graphics_min_mhz", "graphics_max_mhz", "memory_mhz"))
        return cls(
            graphics_min_mhz=_int(
                d["graphics_min_mhz"], f"{where}.graphics_min_mhz", 0, MAX_CLOCK_MHZ
            ),
            graphics_max_mhz=_int(
                d["graphics_max_mhz"], f"{where}.graphics_max_mhz", 0, MAX_CLOCK_MHZ
            ),
            memory_mhz=_opt_int(d["memory_mhz"], f"{where}.memory_mhz", 0, MAX_CLOCK_MHZ),
        )


_MAX_POWER_W: Final = 1e7
_MAX_ENERGY_J: Final = 1e18
_MAX_READ_S: Final = 1e11
_FLOAT_FIELDS: Final = (
    ("power_w", _MAX_POWER_W),
    ("energy_j", _MAX_ENERGY_J),
    ("enforced_limit_w", _MAX_POWER_W),
    ("read_s", _MAX_READ_S),
)


@dataclass(frozen=True)
class GpuReport:
    """One GPU's state. Measurements are None where they could not be trusted (see ``error``)."""

    index: int
    uuid: str
    name: str
    power_w: float | None
    energy_j: float | None
    sm_clock_mhz: int | None
    memory_clock_mhz: int | None
    enforced_limit_w: float | None
    throttle: int | None  # NVML clocks-event-reason bitmask
    locked: LockReport | None
    job_id: str | None
    error: str | None
    #: when the GPU was read: the agent's monotonic clock in seconds (None: the read failed).
    #: Only differences between two reports of one agent mean anything.
    read_s: float | None = None
    #: `BoardDescription.digest` of the GPU's board (None: not described; an older agent)
    board: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "name": self.name,
            "power_w": self.power_w,
            "energy_j": self.energy_j,
            "sm_clock_mhz": self.sm_clock_mhz,
            "memory_clock_mhz": self.memory_clock_mhz,
            "enforced_limit_w": self.enforced_limit_w,
            "throttle": self.throttle,
            "locked": None if self.locked is None else self.locked.to_dict(),
            "job_id": self.job_id,
            "error": self.error,
            "read_s": self.read_s,
            "board": self.board,
        }

    @classmethod
    def from_dict(cls, value: object, where: str) -> GpuReport:
        """The report in ``value``, else `ProtocolError` naming the field (``where``: its place).

        The head parses one of these per GPU per interval, a thousand nodes' worth in one
        round: a well-formed report takes `_gpu_report_fast`; anything that one declines is
        parsed field by field below, which says exactly what is wrong."""
        fast = _gpu_report_fast(value)
        return fast if fast is not None else cls._checked(value, where)

    @classmethod
    def _checked(cls, value: object, where: str) -> GpuReport:
        d = _fields(value, where, _GPU_REPORT_FIELDS, ("board",))
        board = d.get("board")
        if board is not None and not (isinstance(board, str) and _DIGEST_RE.fullmatch(board)):
            raise ProtocolError(f"{where}.board: must be 16 hex digits, {_got(board)}")
        return cls(
            index=_int(d["index"], f"{where}.index", 0, MAX_GPU_INDEX),
            uuid=_text(d["uuid"], f"{where}.uuid"),
            name=_text(d["name"], f"{where}.name"),
            power_w=_opt_float(d["power_w"], f"{where}.power_w", 0.0, _MAX_POWER_W),
            energy_j=_opt_float(d["energy_j"], f"{where}.energy_j", 0.0, _MAX_ENERGY_J),
            sm_clock_mhz=_opt_int(d["sm_clock_mhz"], f"{where}.sm_clock_mhz", 0, MAX_CLOCK_MHZ),
            memory_clock_mhz=_opt_int(
                d["memory_clock_mhz"], f"{where}.memory_clock_mhz", 0, MAX_CLOCK_MHZ
            ),
            enforced_limit_w=_opt_float(
                d["enforced_limit_w"], f"{where}.enforced_limit_w", 0.0, _MAX_POWER_W
            ),
            throttle=_opt_int(d["throttle"], f"{where}.throttle", 0, MAX_THROTTLE),
            locked=None
            if d["locked"] is None
            else LockReport.from_dict(d["locked"], f"{where}.locked"),
            job_id=_opt_job_id(d["job_id"], f"{where}.job_id"),
            error=_opt_text(d["error"], f"{where}.error"),
            read_s=_opt_float(d["read_s"], f"{where}.read_s", 0.0, _MAX_READ_S),
            board=board,
        )


_DIGEST_RE: Final = re.compile(r"[0-9a-f]{16}")
_GPU_REPORT_FIELDS: Final = (
    "index",
    "uuid",
    "name",
    "power_w",
    "energy_j",
    "sm_clock_mhz",
    "memory_clock_mhz",
    "enforced_limit_w",
    "throttle",
    "locked",
    "job_id",
    "error",
    "read_s",
)
_GPU_REPORT_KEYS: Final = frozenset((*_GPU_REPORT_FIELDS, "board"))
_LOCK_REPORT_KEYS: Final = frozenset(("graphics_min_mhz", "graphics_max_mhz", "memory_mhz"))


def _gpu_report_fast(value: object) -> GpuReport | None:
    """`GpuReport.from_dict` for a report every field of which is plainly valid (floats as
    floats, integers as integers, in range); None for anything else, which the checked path
    then refuses or accepts with its exact rules. Accepts nothing the checked path refuses
    (tests/unit/test_wire_protocol.py compares the two on every kind of wrong value)."""
    if type(value) is not dict or value.keys() != _GPU_REPORT_KEYS:
        return None
    v = value
    index, throttle = v["index"], v["throttle"]
    if not (type(index) is int and 0 <= index <= MAX_GPU_INDEX):
        return None
    if throttle is not None and not (type(throttle) is int and 0 <= throttle <= MAX_THROTTLE):
        return None
    for name in ("sm_clock_mhz", "memory_clock_mhz"):
        clock = v[name]
        if clock is not None and not (type(clock) is int and 0 <= clock <= MAX_CLOCK_MHZ):
            return None
    for name, hi in _FLOAT_FIELDS:
        number = v[name]
        if number is not None and not (type(number) is float and 0.0 <= number <= hi):
            return None
    error = v["error"]
    if not (_is_text(v["uuid"]) and _is_text(v["name"]) and (error is None or _is_text(error))):
        return None
    job = v["job_id"]
    if job is not None and not (type(job) is str and names.JOB_ID.fullmatch(job)):
        return None
    board = v["board"]
    if board is not None and not (type(board) is str and _DIGEST_RE.fullmatch(board)):
        return None
    locked = v["locked"]
    lock = None
    if locked is not None:
        if type(locked) is not dict or locked.keys() != _LOCK_REPORT_KEYS:
            return None
        low, high, memory = (
            locked[k] for k in ("graphics_min_mhz", "graphics_max_mhz", "memory_mhz")
        )
        if not (
            type(low) is int
            and 0 <= low <= MAX_CLOCK_MHZ
            and type(high) is int
            and 0 <= high <= MAX_CLOCK_MHZ
            and (memory is None or (type(memory) is int and 0 <= memory <= MAX_CLOCK_MHZ))
        ):
            return None
        lock = LockReport(low, high, memory)
    return GpuReport(
        index=index,
        uuid=v["uuid"],
        name=v["name"],
        power_w=v["power_w"],
        energy_j=v["energy_j"],
        sm_clock_mhz=v["sm_clock_mhz"],
        memory_clock_mhz=v["memory_clock_mhz"],
        enforced_limit_w=v["enforced_limit_w"],
        throttle=throttle,
        locked=lock,
        job_id=job,
        error=error,
        read_s=v["read_s"],
        board=board,
    )


#: a serving job's latency at its objective's percentile, in seconds: above 0, at most an hour
MAX_LATENCY_S: Final = 3600.0
#: a serving job's requests per second
MAX_RATE: Final = 1e6
_SERVING: Final = ("latency_s", "rate")


def _opt_latency(value: object, where: str) -> float | None:
    """A latency in seconds in (0, `MAX_LATENCY_S`]: no request is served in no time."""
    return _opt_positive(
        value, where, MAX_LATENCY_S, f"a number of seconds in (0, {MAX_LATENCY_S:g}]"
    )


def _serving(latency_s: float | None, rate: float | None) -> dict[str, float]:
    """The serving fields that are set: a training job's line and report leave them out, so
    they are what they were before serving jobs and an older agent or head reads them."""
    return {k: v for k, v in (("latency_s", latency_s), ("rate", rate)) if v is not None}


@dataclass(frozen=True)
class ProgressReport:
    """The latest progress a job reported on this node (``uid``: the sender, from the kernel);
    a serving job's also has its latency and request rate (`ProgressLine`)."""

    job_id: str
    step: int
    total: int | None
    time_s: float
    uid: int
    latency_s: float | None = None
    rate: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "step": self.step,
            "total": self.total,
            "time_s": self.time_s,
            "uid": self.uid,
            **_serving(self.latency_s, self.rate),
        }

    @classmethod
    def from_dict(cls, value: object, where: str) -> ProgressReport:
        d = _fields(value, where, ("job_id", "step", "total", "time_s", "uid"), _SERVING)
        return cls(
            job_id=job_id(d["job_id"], f"{where}.job_id"),
            step=_int(d["step"], f"{where}.step", 0, MAX_COUNT),
            total=_opt_int(d["total"], f"{where}.total", 1, MAX_COUNT),
            time_s=_float(d["time_s"], f"{where}.time_s", 0.0, 1e11),
            uid=_int(d["uid"], f"{where}.uid", 0, MAX_UID),
            latency_s=_opt_latency(d.get("latency_s"), f"{where}.latency_s"),
            rate=_opt_float(d.get("rate"), f"{where}.rate", 0.0, MAX_RATE),
        )


@dataclass(frozen=True)
class Refusal:
    """A setpoint the agent did not apply, and why (one line)."""

    gpu: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "reason": self.reason}

    @classmethod
    def from_dict(cls, value: object, where: str) -> Refusal:
        d = _fields(value, where, ("gpu", "reason"))
        return cls(
            gpu=_int(d["gpu"], f"{where}.gpu", 0, MAX_GPU_INDEX),
            reason=_text(d["reason"], f"{where}.reason"),
        )


def _parse_list(
    value: object, where: str, limit: int, parse: Callable[[object, str], Any]
) -> tuple[Any, ...]:
    return tuple(parse(item, f"{where}[{i}]") for i, item in enumerate(_list(value, where, limit)))


@dataclass(frozen=True)
class ExchangeResponse:
    """What the agent answers: readings of every GPU, job progress, refused setpoints.

    Each `GpuReport` is read BEFORE the request's setpoints and releases were applied, so it
    describes the interval that just ended, with the ``locked`` clocks and ``job_id`` in force
    during it and ``read_s``, the agent's monotonic time of the reading (the head divides
    energy-counter differences by it); its measurements are null when the GPU could not be read
    or a value was implausible, and ``error`` says why. ``progress`` holds the latest report of
    each job and reporting uid, ``refused`` the setpoints refused with the reason.
    """

    node: str
    time_s: float  # epoch seconds on the agent
    gpus: tuple[GpuReport, ...] = ()
    progress: tuple[ProgressReport, ...] = ()
    refused: tuple[Refusal, ...] = ()
    version: int = VERSION
    #: every GPU's board as NVML describes it, when the request asked (`describe`)
    boards: tuple[BoardDescription, ...] = ()

    def to_json(self) -> bytes:
        data: dict[str, Any] = {
            "version": self.version,
            "node": self.node,
            "time_s": self.time_s,
            "gpus": [g.to_dict() for g in self.gpus],
            "progress": [p.to_dict() for p in self.progress],
            "refused": [r.to_dict() for r in self.refused],
        }
        if self.boards:
            data["boards"] = [b.to_dict() for b in self.boards]
        return dump_json(data)

    @classmethod
    def from_json(cls, data: bytes | str) -> ExchangeResponse:
        d = _fields(
            load_json(data),
            "response",
            ("version", "node", "time_s", "gpus", "progress", "refused"),
            ("boards",),
        )
        version = _version(d)
        node = _name(names.node_name, d["node"], "node")
        return cls(
            version=version,
            node=node,
            time_s=_float(d["time_s"], "time_s", 0.0, 1e11),
            gpus=_parse_list(d["gpus"], "gpus", MAX_GPUS, GpuReport.from_dict),
            progress=_parse_list(
                d["progress"], "progress", MAX_PROGRESS_ENTRIES, ProgressReport.from_dict
            ),
            refused=_parse_list(d["refused"], "refused", MAX_GPUS, Refusal.from_dict),
            boards=_parse_list(d.get("boards", []), "boards", MAX_GPUS, _board),
        )


def _board(value: object, where: str) -> BoardDescription:
    # only when described: the progress client need not load hashlib
    from slurm_cdgpc.wire.board import BoardDescription  # noqa: PLC0415

    try:
        return BoardDescription.from_dict(value, where)
    except InputError as e:
        raise ProtocolError(str(e)) from None


def check_node_name(name: str) -> str:
    """A host name usable as ``node`` in a response (`names.NODE_NAME`), else `ProtocolError`."""
    if isinstance(name, str) and names.NODE_NAME.fullmatch(name):
        return name
    raise ProtocolError(f"node name must be a host name, {_got(name)}")


# -- the progress line (job → agent, over the Unix socket) -------------------------------------


@dataclass(frozen=True)
class ProgressLine:
    """``{"job_id": "123", "step": 500, "total": 10000}``: one line per connection.

    A serving job's ``step`` counts the requests it served so far, and it adds ``latency_s``,
    its latency at its objective's percentile over the window since its last line, and
    ``rate``, the requests per second over that window: ``{"job_id": "9", "step": 81234,
    "total": null, "latency_s": 0.212, "rate": 140.5}``."""

    job_id: str
    step: int
    total: int | None = None
    latency_s: float | None = None
    rate: float | None = None

    def __post_init__(self) -> None:
        job_id(self.job_id)
        _int(self.step, "step", 0, MAX_COUNT)
        _opt_int(self.total, "total", 1, MAX_COUNT)
        if self.total is not None and self.step > self.total:
            raise ProtocolError(f"step: must not exceed total ({self.total}), got {self.step}")
        _opt_latency(self.latency_s, "latency_s")
        _opt_float(self.rate, "rate", 0.0, MAX_RATE)

    def serving(self) -> dict[str, float]:
        """``latency_s`` and ``rate`` where set: none for a training job."""
        return _serving(self.latency_s, self.rate)

    def to_json(self) -> bytes:
        return dump_json(
            {"job_id": self.job_id, "step": self.step, "total": self.total, **self.serving()}
        )

    @classmethod
    def from_json(cls, data: bytes | str) -> ProgressLine:
        d = _fields(
            load_json(data, MAX_PROGRESS_LINE_BYTES),
            "progress",
            ("job_id", "step"),
            ("total", *_SERVING),
        )
        return cls(
            job_id=d["job_id"],
            step=d["step"],
            total=d.get("total"),
            latency_s=d.get("latency_s"),
            rate=d.get("rate"),
        )
