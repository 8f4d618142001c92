"""The one configuration file, ``/etc/cdgpc/cdgpc.toml``, typed and validated at load.

``daemon/cdgpc.toml`` documents every key. Standard library, `errors`, `units` and `wire.names`
only: the Prolog and Epilog read the head's and the local agent's URLs from it and must start in
milliseconds (`tests/unit/test_import_graph.py`). Test: `tests/unit/test_config.py`.
"""

from __future__ import annotations

import difflib
import ipaddress
import logging
import math
import os
import re
import stat
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.units import parse_duration_s, parse_power_w, parse_ramp_w_per_s
from slurm_cdgpc.wire.names import ACCOUNT, NODE_NAME

logger = logging.getLogger(__name__)

DEFAULT_PATH = Path("/etc/cdgpc/cdgpc.toml")
#: Names the config file when no explicit path is given (before the default path).
PATH_ENV = "CDGPC_CONFIG"
ENV_PREFIX = "CDGPC_"

#: Mirrors of `slurm_cdgpc.control.dual.MODES` and `slurm_cdgpc.model.families.FAMILIES`, kept
#: here so that loading the config never imports numpy (a unit test keeps them equal).
DUAL_MODES = ("newton", "bisection", "gradient")
MODEL_FAMILIES = ("bent", "cubic", "linear")
LEASE_ACTIONS = ("cap", "reset", "keep")
#: what an agent does when another process changes the clocks it locked
OVERRIDE_ACTIONS = ("reapply", "yield")


class ConfigError(InputError):
    """A configuration value is missing, malformed or out of range (one line, names the key)."""


# -- value parsers: each returns the typed value or raises _BadValueError("must be ...") ------


class _BadValueError(Exception):
    """A value does not parse; the loader adds where it came from and the key."""


Parser = Callable[[object], Any]


def _got(value: object) -> str:
    return f"got {value!r}"


def _quantity(value: object, what: str, parse_text: Callable[[str], float]) -> float:
    """A positive finite number, or text in units that ``parse_text`` reads."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value > 0 and math.isfinite(value):
            return float(value)
    elif isinstance(value, str):
        try:
            return parse_text(value)
        except InputError:
            pass
    raise _BadValueError(f"{what}, {_got(value)}")


def _duration(value: object) -> float:
    return _quantity(value, "must be a duration like 30s", parse_duration_s)


def _power(value: object) -> float:
    return _quantity(value, "must be a power like 450kW", parse_power_w)


def _ramp(value: object) -> float:
    """A ramp rate in W/s: a positive number, text like ``5kW/s``, or ``off`` (inf:
    `parse_ramp_w_per_s`)."""
    return _quantity(value, "must be a power per second like 5kW/s, or off", parse_ramp_w_per_s)


def _optional(parse: Parser) -> Parser:
    """An empty string (e.g. ``CDGPC_BUDGET_INITIAL=``) clears the value."""

    def parse_optional(value: object) -> object:
        if value is None or value == "":
            return None
        return parse(value)

    return parse_optional


def _number(value: object) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise _BadValueError(f"must be a number, {_got(value)}")


def _in_range(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Parser:
    text = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"

    def parse_in_range(value: object) -> float:
        try:
            x = _number(value)
        except _BadValueError:
            raise _BadValueError(f"must be a number in {text}, {_got(value)}") from None
        above = x > lo if lo_open else x >= lo
        below = x < hi if hi_open else x <= hi
        if not (above and below):
            raise _BadValueError(f"must be a number in {text}, {_got(value)}")
        return x

    return parse_in_range


def _positive(value: object) -> float:
    try:
        x = _number(value)
    except _BadValueError:
        x = math.nan
    if not (x > 0 and math.isfinite(x)):
        raise _BadValueError(f"must be a positive number, {_got(value)}")
    return x


def _non_negative(value: object) -> float:
    try:
        x = _number(value)
    except _BadValueError:
        x = math.nan
    if not (x >= 0 and math.isfinite(x)):
        raise _BadValueError(f"must be a number ≥ 0, {_got(value)}")
    return x


def _integer(lo: int, hi: int | None = None) -> Parser:
    bounds = f"from {lo} to {hi}" if hi is not None else f"≥ {lo}"

    def parse_integer(value: object) -> int:
        n: int | None = None
        if isinstance(value, int) and not isinstance(value, bool):
            n = value
        elif isinstance(value, str) and re.fullmatch(r"\s*[+-]?[0-9]+\s*", value):
            n = int(value)
        if n is None or n < lo or (hi is not None and n > hi):
            raise _BadValueError(f"must be an integer {bounds}, {_got(value)}")
        return n

    return parse_integer


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def _boolean(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise _BadValueError(f"must be true or false, {_got(value)}")


def _choice(*options: str) -> Parser:
    def parse_choice(value: object) -> str:
        if isinstance(value, str) and value in options:
            return value
        raise _BadValueError(f"must be one of {', '.join(options)}, {_got(value)}")

    return parse_choice


def _text(value: object) -> str:
    if isinstance(value, str) and value.strip() and "\n" not in value:
        return value.strip()
    raise _BadValueError(f"must be a non-empty string, {_got(value)}")


def _absolute_path(value: object) -> Path:
    if isinstance(value, str) and value.startswith("/") and "\0" not in value:
        return Path(value)
    raise _BadValueError(f"must be an absolute path, {_got(value)}")


def _listen_address(value: object) -> str:
    if isinstance(value, str):
        try:
            return str(ipaddress.ip_address(value))
        except ValueError:
            if NODE_NAME.fullmatch(value):
                return value
    raise _BadValueError(f"must be an IP address or host name like 0.0.0.0, {_got(value)}")


def _http_url(value: object) -> str:
    what = "must be an http(s) URL like http://head.example:8463"
    if not isinstance(value, str):
        raise _BadValueError(f"{what}, {_got(value)}")
    try:
        parts = urlsplit(value)
        _ = parts.port  # raises ValueError on a bad port
    except ValueError:
        raise _BadValueError(f"{what}, {_got(value)}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _BadValueError(f"{what}, {_got(value)}")
    return value.rstrip("/")


_STORE_URL = re.compile(r"^(sqlite|postgresql|postgresql\+psycopg)://")


def _store_url(value: object) -> str:
    if isinstance(value, str) and _STORE_URL.match(value) and value.strip() == value:
        return value
    raise _BadValueError(
        "must be a database URL like sqlite:////var/lib/cdgpc/cdgpc.db or "
        f"postgresql+psycopg://cdgpc@dbhost/cdgpc, {_got(value)}"
    )


def _account_name(value: object) -> str:
    if isinstance(value, str) and ACCOUNT.fullmatch(value):
        return value
    raise _BadValueError(f"must be a user or group name, {_got(value)}")


def _names(value: object) -> tuple[str, ...]:
    """A TOML list of names, or a comma-separated string (``CDGPC_AUTH_ADMIN_USERS=alice,bob``)."""
    items: list[object]
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, list):
        items = value
    else:
        raise _BadValueError(f"must be a list of user or group names, {_got(value)}")
    names = []
    for item in items:
        try:
            names.append(_account_name(item))
        except _BadValueError:
            raise _BadValueError(f"must be a list of user or group names, {_got(item)}") from None
    return tuple(names)


def _safe_cap(value: object) -> SafeCap:
    """``0.6`` or ``"60%"`` → a clock fraction; ``"250W"`` → per-GPU power."""
    what = "must be a clock fraction in (0, 1] like 0.6 or a per-GPU power like 250W"
    if isinstance(value, str):
        text = value.strip()
        if text.lower().endswith("w"):
            try:
                return SafeCap(clock_fraction=None, power_w=parse_power_w(text))
            except InputError:
                raise _BadValueError(f"{what}, {_got(value)}") from None
        if text.endswith("%"):
            try:
                value = float(text[:-1]) / 100.0
            except ValueError:
                raise _BadValueError(f"{what}, {_got(value)}") from None
    try:
        fraction = _in_range(0.0, 1.0, lo_open=True)(value)
    except _BadValueError:
        raise _BadValueError(f"{what}, {_got(value)}") from None
    return SafeCap(clock_fraction=fraction, power_w=None)


def _setting(default: Any, parse: Parser) -> Any:
    """A field of a config section, the one description of its key: its default and the parser
    of a value given in the file, the environment or on the command line (`_SCHEMA`)."""
    return field(default=default, metadata={"parse": parse})


# -- the typed configuration -------------------------------------------------------------------


@dataclass(frozen=True)
class HeadConfig:
    """[head]: where ``cdgpcd`` listens and the URL that nodes, Prolog and admins use."""

    listen_address: str = _setting("0.0.0.0", _listen_address)
    listen_port: int = _setting(8463, _integer(1, 65535))
    url: str = _setting("http://localhost:8463", _http_url)
    #: how long the active head's leader lock lasts unrenewed (None: see `leader_lease`)
    leader_lease_s: float | None = _setting(None, _optional(_duration))
    #: reconcile with ``squeue --json`` (finish jobs Slurm no longer runs, adopt unregistered
    #: running ones), every ``reconcile_interval_s`` but never more often than every 2 intervals
    reconcile: bool = _setting(True, _boolean)
    reconcile_interval_s: float = _setting(30.0, _duration)
    #: the power-domain topology file (rows, racks, PDUs below the budget: `slurm_cdgpc.topology`;
    #: None: the cluster is the only domain)
    topology: Path | None = _setting(None, _optional(_absolute_path))

    def leader_lease(self, interval_s: float, agent_lease_s: float) -> float:
        """The leader lease in force: as configured, else 1.5 control intervals (renewed at
        least once an interval, with room for a slow one), kept under the agents' lease so that
        a standby takes over before they fall to the safe cap."""
        if self.leader_lease_s is not None:
            return self.leader_lease_s
        return min(1.5 * interval_s, (interval_s + agent_lease_s) / 2)


@dataclass(frozen=True)
class StoreConfig:
    """[store]: the SQLAlchemy URL of the database (SQLite file or PostgreSQL)."""

    url: str = _setting("sqlite:////var/lib/cdgpc/cdgpc.db", _store_url)


@dataclass(frozen=True)
class ControlConfig:
    """[control]: the controller solved every interval (DESIGN.md, "Controller").

    These defaults are the controller's (`slurm_cdgpc.control.empc.ControllerSettings`): cdgpcd
    and the simulator's ``cdgpc`` policy run with them.
    """

    interval_s: float = _setting(30.0, _duration)
    dual_mode: str = _setting("newton", _choice(*DUAL_MODES))
    #: ε₀: fraction of the budget held back for a hard cap
    guard_band: float = _setting(0.002, _in_range(0.0, 0.5, hi_open=True))
    #: c: the guard band is max(ε₀, c/√N) for N controlled jobs
    guard_per_sqrt_job: float = _setting(0.03, _in_range(0.0, 0.5, hi_open=True))
    #: p: ... at most the 1 − p quantile of the whole plan's measured over-draw less the
    #: emergency margin (0: c/√N alone)
    guard_tail: float = _setting(0.005, _in_range(0.0, 1.0, hi_open=True))
    #: η: gain of the model-error offset estimate
    offset_gain: float = _setting(0.3, _in_range(0.0, 1.0))
    #: each settled job learns its own offset, and a plan is scaled by its jobs' offsets
    #: weighed by their power (false: one offset, learned from whichever jobs are settled)
    offset_per_job: bool = _setting(True, _boolean)
    model_family: str = _setting("bent", _choice(*MODEL_FAMILIES))
    power_forgetting: float = _setting(0.95, _in_range(0.0, 1.0, lo_open=True))
    time_forgetting: float = _setting(0.98, _in_range(0.0, 1.0, lo_open=True))
    #: a new job of a known kind (its user, Slurm job name and GPU type) starts from the models
    #: pooled over the jobs of that kind before it (`slurm_cdgpc.model.kind_prior`)
    kind_prior: bool = _setting(True, _boolean)
    #: deadline pressure of jobs without a deadline
    default_pressure: float = _setting(0.5, _positive)
    #: a job with a deadline weighs at least as much as one without
    pressure_floor: bool = _setting(True, _boolean)
    #: lowest core clock the controller may choose, as a fraction of the top clock
    min_clock_fraction: float = _setting(0.6, _in_range(0.0, 1.0, hi_open=True))
    #: below the floor when nothing at or above it fits the budget
    floor_fallback: bool = _setting(True, _boolean)
    #: a job its power limit holds below its lock is planned where the limit holds it: locked
    #: at most one level above that clock and counted at it (false: counted at its lock)
    held_at_limit: bool = _setting(True, _boolean)
    #: jobs that cannot make their deadline even at top clocks weigh as jobs without one
    triage: bool = _setting(True, _boolean)
    #: a tenant whose GPU gains or loses a co-tenant re-anchors its time model on its first
    #: sample among the new co-tenants instead of rejecting it as an outlier
    reanchor_tenants: bool = _setting(True, _boolean)
    #: a tenant's predicted iteration time follows its co-tenants' number: a plan that puts it
    #: among more or fewer than its time model learned among scales the model by what such a
    #: change did to the tenants that went through one (learned in the head's memory)
    interference: bool = _setting(True, _boolean)
    #: pressure on the node predicted to empty first while jobs wait and GPUs are free (0: off)
    drain_pressure: float = _setting(1.0, _non_negative)
    #: a job that does not say its total work has at most its Slurm time limit of it, at top
    #: clocks: its pressure comes from that bound, capped at 1 (off: pressure 1 at any slack)
    work_from_time_limit: bool = _setting(True, _boolean)
    #: ... sharpened to this quantile of the share of their limit that ended jobs used (1: off)
    limit_share_quantile: float = _setting(0.9, _in_range(0.0, 1.0, lo_open=True))
    #: κ: budget held back, in standard errors, when the plan moves to less-known clocks
    exploration_sigmas: float = _setting(1.0, _non_negative)
    #: the guard rail: each controlled GPU's power limit at its planned power times (1 + this),
    #: so the firmware clips a model's under-prediction within a second (0: off)
    power_limit_margin: float = _setting(0.0, _non_negative)
    #: a job not yet measured is counted at this share of its power limit, and with
    #: new_job_power_quantile = 1 held there by a power limit until its model has a reading
    #: (1: counted at its limit, nothing held)
    new_job_power_share: float = _setting(1.0, _in_range(0.0, 1.0, lo_open=True))
    #: ... learned per GPU type as this quantile of new jobs' first readings, starting from
    #: new_job_power_share (1: not learned)
    new_job_power_quantile: float = _setting(0.9, _in_range(0.0, 1.0, lo_open=True))
    #: how fast the cluster's planned power may move up, and toward a lower budget scheduled
    #: ahead (DESIGN.md, "Ramp limits and the emergency cut"): W/s, e.g. "5kW/s"; off: no limit
    ramp: float = _setting(math.inf, _ramp)
    #: the emergency cut: where the nodes' answers show a limit broken by more than
    #: max(guard band, emergency_margin), its lowest-pressure jobs go to their lowest clocks in
    #: the same exchange round, before the next plan
    emergency: bool = _setting(True, _boolean)
    emergency_margin: float = _setting(0.01, _in_range(0.0, 1.0, hi_open=True))
    #: serving jobs (``slo=`` in the comment) run at the lowest clock whose learnt and measured
    #: latency stays within (1 − serving_margin) of their objective ...
    serving_margin: float = _setting(0.1, _in_range(0.0, 1.0, hi_open=True))
    #: ... coming down at most this share of the top clock an interval
    serving_step: float = _setting(0.05, _in_range(0.0, 1.0, lo_open=True))
    #: decide and record, but apply nothing
    shadow: bool = _setting(False, _boolean)


@dataclass(frozen=True)
class BudgetConfig:
    """[budget]: the budget to start with when the store holds none (None: uncapped)."""

    initial_w: float | None = _setting(None, _optional(_power))


@dataclass(frozen=True)
class SafeCap:
    """What a node falls back to when its lease lapses: exactly one of the two is set."""

    clock_fraction: float | None = 0.6
    power_w: float | None = None

    def __str__(self) -> str:
        if self.power_w is not None:
            return f"{self.power_w:g}W per GPU"
        return f"{self.clock_fraction:g} of the top clock"


@dataclass(frozen=True)
class LeaseConfig:
    """[lease]: how long a setpoint stays valid and what an agent does when it lapses."""

    duration_s: float = _setting(90.0, _duration)
    safe_cap: SafeCap = _setting(SafeCap(), _safe_cap)
    #: ``cap``: apply the safe cap; ``reset``: restore default clocks; ``keep``: keep the last ones
    on_lapse: str = _setting("cap", _choice(*LEASE_ACTIONS))


@dataclass(frozen=True)
class AuthConfig:
    """[auth]: how components prove who they are, and who may change what."""

    method: str = _setting("munge", _choice("munge", "hmac"))
    hmac_key_file: Path = _setting(Path("/etc/cdgpc/hmac.key"), _absolute_path)
    munge_socket: Path = _setting(Path("/run/munge/munge.socket.2"), _absolute_path)
    max_clock_skew_s: float = _setting(10.0, _duration)
    #: method = hmac: whether key holders may change the budget (HMAC proves no user identity)
    hmac_is_admin: bool = _setting(False, _boolean)
    admin_users: tuple[str, ...] = _setting(("root",), _names)
    admin_groups: tuple[str, ...] = _setting((), _names)
    slurm_user: str = _setting("slurm", _account_name)


@dataclass(frozen=True)
class NodeConfig:
    """[node]: the node agent ``cdgpc-noded``."""

    backend: str = _setting("nvml", _choice("nvml", "simulated"))
    simulated_gpu_type: str = _setting("A100-SXM4-80GB", _text)
    simulated_gpu_count: int = _setting(8, _integer(1, 64))
    state_file: Path = _setting(Path("/var/lib/cdgpc/node-state.json"), _absolute_path)
    progress_socket: Path = _setting(Path("/run/cdgpc/progress.sock"), _absolute_path)
    #: the TaskProlog puts the automatic progress hook (slurm_cdgpc/hook) on jobs' PYTHONPATH
    progress_hook: bool = _setting(True, _boolean)
    #: another process changed our lock: ``reapply`` ours, or ``yield`` the GPU to it
    on_override: str = _setting("reapply", _choice(*OVERRIDE_ACTIONS))
    transport: str = _setting("http", _choice("http", "ssh"))
    listen_address: str = _setting("0.0.0.0", _listen_address)
    listen_port: int = _setting(8464, _integer(1, 65535))


@dataclass(frozen=True)
class RetentionConfig:
    """[retention]: how long raw measurements are kept (budget changes and decisions stay)."""

    measurements_s: float = _setting(30 * 86400.0, _duration)


@dataclass(frozen=True)
class AdmissionConfig:
    """[admission]: the PrologSlurmctld's verdict on a starting job's deadline
    (`slurm_cdgpc.slurm.admission`; DESIGN.md, "Admission at job start")."""

    #: an "infeasible" verdict fails the PrologSlurmctld, so Slurm requeues the job (cancels it
    #: under ``--no-requeue``); false: the verdict is only written, every job starts
    enforce: bool = _setting(False, _boolean)


@dataclass(frozen=True)
class Config:
    head: HeadConfig = HeadConfig()
    store: StoreConfig = StoreConfig()
    control: ControlConfig = ControlConfig()
    budget: BudgetConfig = BudgetConfig()
    lease: LeaseConfig = LeaseConfig()
    auth: AuthConfig = AuthConfig()
    node: NodeConfig = NodeConfig()
    retention: RetentionConfig = RetentionConfig()
    admission: AdmissionConfig = AdmissionConfig()
    #: the file that was read (None: defaults and environment only)
    path: Path | None = None


#: where a node reaches its own agent when the agent listens on every address
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def agent_url(config: Config) -> str:
    """Where this node's agent listens (``node.listen_address``, ``node.listen_port``), as seen
    from this node."""
    address = config.node.listen_address
    host = _WILDCARDS.get(address, address)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{config.node.listen_port}"


# -- the schema: section → TOML key → (dataclass field, parser), read off the dataclasses ------


@dataclass(frozen=True)
class _Key:
    field: str
    parse: Parser


def _toml_key(f: Field[Any]) -> str:
    """A setting's TOML key: its field's name less the unit (``interval_s`` is ``interval``)."""
    return re.sub(r"_(s|w)$", "", f.name)


def _keys(section: type[Any]) -> dict[str, _Key]:
    return {_toml_key(f): _Key(f.name, f.metadata["parse"]) for f in fields(section)}


_SCHEMA: dict[str, tuple[type[Any], dict[str, _Key]]] = {
    name: (type(default), _keys(type(default)))
    for name, default in vars(Config()).items()
    if name != "path"
}


#: keys of earlier releases, refused with what became of them
_REMOVED: dict[tuple[str, str], str] = {
    ("control", "horizon"): (
        "was removed: a prediction horizon never changed the clocks applied (DESIGN.md, "
        '"No horizon"); delete the line'
    ),
}


def configured(section: str, name: str) -> Any:
    """A field of another settings class that is the setting ``section.name`` of `Config`, with
    its default: `configured_values` reads every such field from a loaded `Config`."""
    return field(
        default=getattr(getattr(Config, section), name), metadata={"config": (section, name)}
    )


def configured_values(cls: type[Any], config: Config) -> dict[str, Any]:
    """The `configured` fields of the dataclass ``cls``, as ``config`` has them."""
    return {
        f.name: getattr(getattr(config, f.metadata["config"][0]), f.metadata["config"][1])
        for f in fields(cls)
        if "config" in f.metadata
    }


def known_keys() -> dict[str, tuple[str, ...]]:
    """Every section and its keys, as written in the TOML file."""
    return {section: tuple(keys) for section, (_, keys) in _SCHEMA.items()}


# -- loading -----------------------------------------------------------------------------------

#: (section, key) → (parsed value, where it came from)
_Values = dict[tuple[str, str], tuple[object, str]]
_COMMAND_LINE = "command line"
_DEFAULT = "default"


def load_config(
    path: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Config:
    """Read, merge and check the configuration; raises `ConfigError` with a one-line reason.

    ``path``: the TOML file; without it ``$CDGPC_CONFIG``, else ``/etc/cdgpc/cdgpc.toml`` (which
    may be absent: defaults then). ``env``: the environment (default ``os.environ``).
    ``overrides``: command-line values keyed ``"section.key"`` (``{"control.interval": "10s"}``);
    ``None`` values mean "not given" and are skipped.

    Precedence, highest first: ``overrides`` > environment variables ``CDGPC_<SECTION>_<KEY>``
    (``CDGPC_HEAD_URL``, ``CDGPC_CONTROL_INTERVAL``) > the file > defaults. Every value given
    anywhere is checked, and every error is one line naming where the value came from and the
    key: ``cdgpc.toml: control.interval: must be a duration like 30s, got 'fast'``. Unknown
    sections and keys are errors, in the file and in ``CDGPC_<SECTION>_*`` variables alike: a
    typo must not silently fall back to a default. Other ``CDGPC_*`` variables
    (``CDGPC_DEBUG``, ``CDGPC_CONFIG``, ``CDGPC_DATA_DIR``) are not settings and are left alone.
    """
    env = os.environ if env is None else env
    values: _Values = {}
    file = _config_path(path, env)
    if file is not None:
        _merge(values, _read_file(file), str(file))
    _merge(values, _from_env(env), "environment")
    _merge(values, _from_overrides(overrides or {}), _COMMAND_LINE)
    config = _build(values, file)
    _check(config, values)
    logger.debug("configuration loaded from %s", file or "defaults and environment")
    return config


def _config_path(path: Path | None, env: Mapping[str, str]) -> Path | None:
    if path is not None:
        return path
    if env.get(PATH_ENV):
        return Path(env[PATH_ENV])
    if DEFAULT_PATH.exists():
        return DEFAULT_PATH
    logger.debug("no %s: using defaults and environment", DEFAULT_PATH)
    return None


def _read_file(path: Path) -> _Values:
    """The file's raw values keyed by (section, key), each with its origin."""
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    except UnicodeDecodeError as e:  # tomllib decodes before it parses, and says nothing of where
        raise ConfigError(
            f"{path}: not UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start})"
        ) from e
    raw: _Values = {}
    for section, table in data.items():
        if section not in _SCHEMA:
            raise ConfigError(
                f"{path}: [{section}]: unknown section{_suggest(section, _SCHEMA)}"
                f" (known: {', '.join(_SCHEMA)})"
            )
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {section}: must be a table [{section}], {_got(table)}")
        for key, value in table.items():
            raw[(section, key)] = (value, str(path))
    return raw


def _from_env(env: Mapping[str, str]) -> _Values:
    raw: _Values = {}
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :]
        for section in _SCHEMA:
            prefix = section.upper() + "_"
            if rest.startswith(prefix):
                raw[(section, rest[len(prefix) :].lower())] = (env[name], name)
                break
    return raw


def _from_overrides(overrides: Mapping[str, object]) -> _Values:
    raw: _Values = {}
    for dotted, value in overrides.items():
        if value is None:
            continue
        section, _, key = dotted.partition(".")
        if section not in _SCHEMA or not key:
            raise ConfigError(
                f"{_COMMAND_LINE}: {dotted}: unknown setting"
                " (use section.key, e.g. control.interval)"
            )
        raw[(section, key)] = (value, _COMMAND_LINE)
    return raw


def _merge(values: _Values, raw: _Values, where: str) -> None:
    """Check every value of one layer, then let it override the layers below."""
    for (section, key), (value, origin) in raw.items():
        keys = _SCHEMA[section][1]
        if (section, key) in _REMOVED:
            raise ConfigError(f"{origin}: {section}.{key}: {_REMOVED[section, key]}")
        if key not in keys:
            raise ConfigError(
                f"{origin}: {section}.{key}: unknown key{_suggest(key, keys)}"
                f" (known in [{section}]: {', '.join(keys)})"
            )
        try:
            parsed = keys[key].parse(value)
        except _BadValueError as e:
            raise ConfigError(f"{origin}: {section}.{key}: {e}") from None
        values[(section, key)] = (parsed, origin)
    logger.debug("%s: %d setting(s)", where, len(raw))


def _build(values: _Values, path: Path | None) -> Config:
    sections: dict[str, Any] = {}
    for section, (cls, keys) in _SCHEMA.items():
        given = {
            spec.field: values[(section, key)][0]
            for key, spec in keys.items()
            if (section, key) in values
        }
        sections[section] = cls(**given)
    return Config(**sections, path=path)


def _origin(values: _Values, section: str, key: str) -> str:
    return values.get((section, key), (None, _DEFAULT))[1]


def _check(config: Config, values: _Values) -> None:
    """Checks that involve more than one key (each names the key to change)."""
    if config.lease.duration_s <= config.control.interval_s:
        raise ConfigError(
            f"{_origin(values, 'lease', 'duration')}: lease.duration: must be longer than "
            f"control.interval ({config.control.interval_s:g}s), got {config.lease.duration_s:g}s"
        )
    leader_s = config.head.leader_lease_s
    if leader_s is not None and not config.control.interval_s < leader_s < config.lease.duration_s:
        raise ConfigError(
            f"{_origin(values, 'head', 'leader_lease')}: head.leader_lease: must be longer than "
            f"control.interval ({config.control.interval_s:g}s) and shorter than lease.duration "
            f"({config.lease.duration_s:g}s), got {leader_s:g}s"
        )
    if config.auth.method == "hmac":
        where = f"{_origin(values, 'auth', 'hmac_key_file')}: auth.hmac_key_file"
        check_secret_file(config.auth.hmac_key_file, where)


def check_secret_file(path: Path, where: str) -> None:
    """Refuse a secret that others can read or write: a regular file, owned by root (or by us),
    mode 0600 or stricter. Only its metadata is read here."""
    try:
        st = path.stat()
    except OSError as e:
        raise ConfigError(f"{where}: cannot use {path}: {e.strerror or e}") from e
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{where}: {path} must be a regular file")
    if st.st_uid not in (0, os.geteuid()):
        raise ConfigError(f"{where}: {path} must be owned by root, is owned by uid {st.st_uid}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise ConfigError(
            f"{where}: {path} must be readable by its owner only (chmod 600), has mode {mode:04o}"
        )


def _suggest(word: str, known: Mapping[str, object]) -> str:
    close = difflib.get_close_matches(word, list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""
