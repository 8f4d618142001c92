"""The configuration file: defaults, precedence, and one-line errors that name the key."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_cdgpc import config as config_module
from slurm_cdgpc.config import (
    Config,
    ConfigError,
    SafeCap,
    known_keys,
    load_config,
)
from slurm_cdgpc.control.dual import MODES
from slurm_cdgpc.control.tuning import Tuning
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.families import FAMILIES

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "daemon" / "cdgpc.toml"


@pytest.fixture(autouse=True)
def no_system_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Tests never read the machine's /etc/cdgpc/cdgpc.toml."""
    monkeypatch.setattr(config_module, "DEFAULT_PATH", tmp_path / "absent" / "cdgpc.toml")


def write(tmp_path: Path, text: str, name: str = "cdgpc.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(**kwargs: object) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(**kwargs)  # type: ignore[arg-type]
    message = str(caught.value)
    assert "\n" not in message
    return message


# -- defaults, file, precedence --------------------------------------------------------------


def test_defaults_without_a_file() -> None:
    config = load_config(env={})
    assert config == Config()
    assert config.path is None
    assert config.store.url == "sqlite:////var/lib/cdgpc/cdgpc.db"
    assert config.control.interval_s == 30.0
    assert config.budget.initial_w is None
    assert config.lease.safe_cap == SafeCap(clock_fraction=0.6)
    assert config.auth.method == "munge"


def test_file_values_are_typed(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[head]
url = "https://head.cluster:8443/"
listen_port = 8443
[store]
url = "postgresql+psycopg://cdgpc@db/cdgpc"
[control]
interval = "1m"
drain_pressure = 4
triage = false
dual_mode = "bisection"
model_family = "linear"
shadow = true
[budget]
initial = "450kW"
[lease]
duration = "5m"
safe_cap = "250W"
on_lapse = "reset"
[auth]
admin_users = ["alice", "bob"]
admin_groups = ["hpc-admins"]
max_clock_skew = 10
[node]
backend = "simulated"
simulated_gpu_count = 4
state_file = "/tmp/node-state.json"
[retention]
measurements = "7d"
""",
    )
    config = load_config(path, env={})
    assert config.path == path
    assert config.head.url == "https://head.cluster:8443"  # trailing slash dropped
    assert config.head.listen_port == 8443
    assert config.store.url == "postgresql+psycopg://cdgpc@db/cdgpc"
    assert (config.control.interval_s, config.control.drain_pressure) == (60.0, 4.0)
    assert config.control.triage is False
    assert (config.control.dual_mode, config.control.model_family) == ("bisection", "linear")
    assert config.control.shadow is True
    assert config.budget.initial_w == 450e3
    assert config.lease == config_module.LeaseConfig(
        duration_s=300.0, safe_cap=SafeCap(clock_fraction=None, power_w=250.0), on_lapse="reset"
    )
    assert config.auth.admin_users == ("alice", "bob")
    assert config.auth.admin_groups == ("hpc-admins",)
    assert config.auth.max_clock_skew_s == 10.0
    assert config.node.backend == "simulated" and config.node.simulated_gpu_count == 4
    assert config.node.state_file == Path("/tmp/node-state.json")
    assert config.retention.measurements_s == 7 * 86400.0
    # untouched keys keep their defaults
    assert config.control.guard_band == config_module.ControlConfig().guard_band


def test_command_line_beats_environment_beats_file_beats_default(tmp_path: Path) -> None:
    path = write(
        tmp_path, '[control]\ninterval = "20s"\ndrain_pressure = 2\n[head]\nurl = "http://f:1"\n'
    )
    env = {"CDGPC_CONTROL_INTERVAL": "15s", "CDGPC_HEAD_URL": "http://env:2"}
    overrides = {"control.interval": "10s", "head.url": None}  # None: option not given

    config = load_config(path, env=env, overrides=overrides)
    assert config.control.interval_s == 10.0  # command line
    assert config.head.url == "http://env:2"  # environment over file
    assert config.control.drain_pressure == 2  # file over default
    assert config.control.dual_mode == "newton"  # default


def test_environment_values_are_parsed_like_file_values() -> None:
    config = load_config(
        env={
            "CDGPC_AUTH_ADMIN_USERS": "alice, bob",
            "CDGPC_CONTROL_SHADOW": "yes",
            "CDGPC_CONTROL_DRAIN_PRESSURE": "3",
            "CDGPC_LEASE_SAFE_CAP": "55%",
            "CDGPC_STORE_URL": "sqlite:////tmp/x.db",
            "CDGPC_DEBUG": "1",  # not a setting: left alone
            "CDGPC_DATA_DIR": "/data",
            "PATH": "/usr/bin",
        }
    )
    assert config.auth.admin_users == ("alice", "bob")
    assert config.control.shadow is True and config.control.drain_pressure == 3
    assert config.lease.safe_cap == SafeCap(clock_fraction=0.55)
    assert config.store.url == "sqlite:////tmp/x.db"


def test_an_empty_environment_variable_clears_an_optional_value(tmp_path: Path) -> None:
    path = write(tmp_path, '[budget]\ninitial = "300kW"\n')
    assert load_config(path, env={}).budget.initial_w == 300e3
    assert load_config(path, env={"CDGPC_BUDGET_INITIAL": ""}).budget.initial_w is None


def test_config_file_from_environment_and_explicit_path(tmp_path: Path) -> None:
    a = write(tmp_path, "[control]\ndrain_pressure = 2\n", "a.toml")
    b = write(tmp_path, "[control]\ndrain_pressure = 3\n", "b.toml")
    assert load_config(env={"CDGPC_CONFIG": str(a)}).control.drain_pressure == 2
    assert load_config(b, env={"CDGPC_CONFIG": str(a)}).control.drain_pressure == 3


def test_the_default_file_is_read_when_present(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, "[control]\ndrain_pressure = 5\n")
    monkeypatch.setattr(config_module, "DEFAULT_PATH", path)
    config = load_config(env={})
    assert config.control.drain_pressure == 5 and config.path == path


def test_config_is_frozen() -> None:
    config = load_config(env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.control.interval_s = 1.0  # type: ignore[misc]


# -- one-line errors naming the key ----------------------------------------------------------


def test_the_documented_error_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path, '[control]\ninterval = "fast"\n')
    assert error_of(path=Path("cdgpc.toml"), env={}) == (
        "cdgpc.toml: control.interval: must be a duration like 30s, got 'fast'"
    )


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("head", "listen_port", "0", "must be an integer from 1 to 65535, got 0"),
        ("head", "listen_port", '"http"', "must be an integer from 1 to 65535, got 'http'"),
        ("head", "url", '"head:8463"', "must be an http(s) URL"),
        ("head", "url", '"http://head:99999"', "must be an http(s) URL"),
        ("head", "listen_address", '"not an address!"', "must be an IP address or host name"),
        ("store", "url", '"mysql://db/cdgpc"', "must be a database URL"),
        ("control", "interval", '"-5s"', "must be a duration like 30s, got '-5s'"),
        ("control", "interval", "0", "must be a duration like 30s, got 0"),
        ("control", "interval", "inf", "must be a duration like 30s, got inf"),
        ("node", "simulated_gpu_count", "0", "must be an integer from 1 to 64, got 0"),
        ("node", "simulated_gpu_count", "1.5", "must be an integer from 1 to 64, got 1.5"),
        ("control", "drain_pressure", "-1", "must be a number ≥ 0, got -1"),
        ("control", "exploration_sigmas", '"lots"', "must be a number ≥ 0, got 'lots'"),
        ("control", "triage", '"maybe"', "must be true or false, got 'maybe'"),
        ("control", "guard_per_sqrt_job", "0.5", "must be a number in [0, 0.5), got 0.5"),
        ("control", "dual_mode", '"fast"', "must be one of newton, bisection, gradient"),
        ("control", "guard_band", "0.5", "must be a number in [0, 0.5), got 0.5"),
        ("control", "offset_gain", '"high"', "must be a number in [0, 1], got 'high'"),
        ("control", "model_family", '"quadratic"', "must be one of bent, cubic, linear"),
        ("control", "power_forgetting", "0", "must be a number in (0, 1], got 0"),
        ("control", "time_forgetting", "1.01", "must be a number in (0, 1], got 1.01"),
        ("control", "default_pressure", "0", "must be a positive number, got 0"),
        ("control", "min_clock_fraction", "1.0", "must be a number in [0, 1), got 1.0"),
        ("control", "shadow", '"maybe"', "must be true or false, got 'maybe'"),
        ("budget", "initial", '"450kV"', "must be a power like 450kW, got '450kV'"),
        ("budget", "initial", "-1", "must be a power like 450kW, got -1"),
        ("lease", "duration", '"soon"', "must be a duration like 30s, got 'soon'"),
        ("lease", "safe_cap", "1.5", "must be a clock fraction in (0, 1] like 0.6 or a per-GPU"),
        ("lease", "safe_cap", '"-3W"', "must be a clock fraction in (0, 1] like 0.6 or a per-GPU"),
        ("lease", "on_lapse", '"panic"', "must be one of cap, reset, keep, got 'panic'"),
        ("auth", "method", '"kerberos"', "must be one of munge, hmac, got 'kerberos'"),
        ("auth", "hmac_key_file", '"hmac.key"', "must be an absolute path, got 'hmac.key'"),
        ("auth", "munge_socket", "3", "must be an absolute path, got 3"),
        ("auth", "max_clock_skew", '"a while"', "must be a duration like 30s"),
        ("auth", "hmac_is_admin", "1", "must be true or false, got 1"),
        ("auth", "admin_users", '["alice", "bob smith"]', "got 'bob smith'"),
        ("auth", "admin_groups", "7", "must be a list of user or group names, got 7"),
        ("auth", "slurm_user", '"slurm;rm"', "must be a user or group name, got 'slurm;rm'"),
        ("node", "backend", '"rocm"', "must be one of nvml, simulated, got 'rocm'"),
        ("node", "simulated_gpu_type", '""', "must be a non-empty string, got ''"),
        ("node", "simulated_gpu_count", "0", "must be an integer from 1 to 64, got 0"),
        ("node", "state_file", '"state.json"', "must be an absolute path"),
        ("node", "progress_socket", '""', "must be an absolute path"),
        ("node", "transport", '"rsh"', "must be one of http, ssh, got 'rsh'"),
        ("node", "listen_port", "70000", "must be an integer from 1 to 65535, got 70000"),
        ("retention", "measurements", '"forever"', "must be a duration like 30s"),
    ],
)
def test_every_bad_value_is_one_line_naming_the_key(
    tmp_path: Path, section: str, key: str, value: str, expected: str
) -> None:
    path = write(tmp_path, f"[{section}]\n{key} = {value}\n")
    message = error_of(path=path, env={})
    assert message.startswith(f"{path}: {section}.{key}: ")
    assert expected in message


def test_bad_environment_and_command_line_values_name_their_source() -> None:
    assert error_of(env={"CDGPC_CONTROL_INTERVAL": "fast"}) == (
        "CDGPC_CONTROL_INTERVAL: control.interval: must be a duration like 30s, got 'fast'"
    )
    assert error_of(env={}, overrides={"node.listen_port": 0}) == (
        "command line: node.listen_port: must be an integer from 1 to 65535, got 0"
    )


def test_a_bad_value_is_refused_even_when_a_higher_layer_overrides_it(tmp_path: Path) -> None:
    path = write(tmp_path, '[control]\ninterval = "fast"\n')
    assert "control.interval" in error_of(path=path, env={"CDGPC_CONTROL_INTERVAL": "30s"})


def test_unknown_keys_and_sections_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path, '[control]\nintervall = "30s"\n')
    message = error_of(path=path, env={})
    assert message.startswith(f"{path}: control.intervall: unknown key (did you mean interval?)")

    path = write(tmp_path, '[contrl]\ninterval = "30s"\n')
    assert error_of(path=path, env={}).startswith(
        f"{path}: [contrl]: unknown section (did you mean control?)"
    )
    assert error_of(env={"CDGPC_HEAD_PORT": "80"}).startswith(
        "CDGPC_HEAD_PORT: head.port: unknown key"
    )
    assert "unknown setting" in error_of(env={}, overrides={"interval": "30s"})
    assert "unknown key" in error_of(env={}, overrides={"control.intervl": "30s"})


def test_a_section_must_be_a_table(tmp_path: Path) -> None:
    path = write(tmp_path, 'control = "fast"\n')
    assert error_of(path=path, env={}).startswith(f"{path}: control: must be a table [control]")


def test_unreadable_or_malformed_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    assert error_of(path=missing, env={}) == f"{missing}: cannot read: No such file or directory"
    assert error_of(env={"CDGPC_CONFIG": str(missing)}).startswith(f"{missing}: cannot read")
    broken = write(tmp_path, "[control\ninterval = 30s\n")
    assert error_of(path=broken, env={}).startswith(f"{broken}: not valid TOML: ")


def test_a_file_that_is_not_utf8_is_one_line_naming_it(tmp_path: Path) -> None:
    latin1 = tmp_path / "cdgpc.toml"
    latin1.write_bytes(b'[control]\ninterval = "30s" # d\xe9faut\n')
    assert error_of(path=latin1, env={}) == f"{latin1}: not UTF-8 (byte 0xe9 at offset 30)"


def test_the_lease_must_outlast_the_interval() -> None:
    message = error_of(env={"CDGPC_CONTROL_INTERVAL": "2m", "CDGPC_LEASE_DURATION": "90s"})
    assert message == (
        "CDGPC_LEASE_DURATION: lease.duration: must be longer than control.interval (120s), got 90s"
    )


def test_config_errors_are_input_errors() -> None:
    assert issubclass(ConfigError, InputError)


# -- the HMAC key must be root-only ----------------------------------------------------------


def hmac_env(key: Path) -> dict[str, str]:
    return {"CDGPC_AUTH_METHOD": "hmac", "CDGPC_AUTH_HMAC_KEY_FILE": str(key)}


@pytest.mark.security
@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_root_only_hmac_key_is_accepted(tmp_path: Path, mode: int) -> None:
    key = tmp_path / "hmac.key"
    key.write_bytes(os.urandom(32))
    key.chmod(mode)
    assert load_config(env=hmac_env(key)).auth.hmac_key_file == key


@pytest.mark.security
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o606])
def test_an_hmac_key_others_can_read_or_write_is_refused(tmp_path: Path, mode: int) -> None:
    key = tmp_path / "hmac.key"
    key.write_bytes(os.urandom(32))
    key.chmod(mode)
    assert error_of(env=hmac_env(key)) == (
        f"CDGPC_AUTH_HMAC_KEY_FILE: auth.hmac_key_file: {key} must be readable by its owner "
        f"only (chmod 600), has mode {mode:04o}"
    )


@pytest.mark.security
def test_a_missing_or_odd_hmac_key_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "none.key"
    assert error_of(env=hmac_env(missing)) == (
        f"CDGPC_AUTH_HMAC_KEY_FILE: auth.hmac_key_file: cannot use {missing}: "
        "No such file or directory"
    )
    folder = tmp_path / "dir.key"
    folder.mkdir(mode=0o700)
    assert "must be a regular file" in error_of(env=hmac_env(folder))


@pytest.mark.security
@pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")
def test_an_hmac_key_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "hmac.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    os.chown(key, 12345, 12345)
    assert "must be owned by root, is owned by uid 12345" in error_of(env=hmac_env(key))


@pytest.mark.security
def test_the_hmac_key_is_only_checked_when_hmac_is_used(tmp_path: Path) -> None:
    key = tmp_path / "hmac.key"
    key.write_bytes(b"k")
    key.chmod(0o644)
    config = load_config(env={"CDGPC_AUTH_HMAC_KEY_FILE": str(key)})
    assert config.auth.method == "munge"


# -- the shipped example and the mirrors -----------------------------------------------------


def test_the_example_config_loads_to_the_defaults() -> None:
    config = load_config(EXAMPLE, env={})
    assert dataclasses.replace(config, path=None) == Config()


def test_the_example_config_documents_every_key() -> None:
    documented: dict[str, set[str]] = {}
    section = ""
    for line in EXAMPLE.read_text().splitlines():
        if match := re.match(r"^\[(\w+)\]$", line):
            section = match[1]
            documented[section] = set()
        elif section and (match := re.match(r"^#? ?(\w+) = ", line)):
            documented[section].add(match[1])
    assert documented == {s: set(keys) for s, keys in known_keys().items()}


def test_the_config_mirrors_the_controller_names() -> None:
    assert config_module.DUAL_MODES == MODES
    assert tuple(sorted(FAMILIES)) == config_module.MODEL_FAMILIES


def test_loading_the_config_stays_light() -> None:
    """The Prolog reads the config: it must not pull numpy or SQLAlchemy in."""
    probe = (
        "import sys, slurm_cdgpc.config as c; c.load_config(env={}); "
        "print(sorted(m for m in ('numpy', 'sqlalchemy') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "CDGPC_CONFIG": str(EXAMPLE)},
    )
    assert out.stdout.strip() == "[]"


def test_a_removed_key_says_what_became_of_it(tmp_path: Path) -> None:
    path = write(tmp_path, "[control]\nhorizon = 1\n")
    with pytest.raises(ConfigError, match=r"control\.horizon: was removed: .*delete the line"):
        load_config(path, env={})


@pytest.mark.parametrize(
    ("text", "rate"),
    [('"5kW/s"', 5000.0), ('"750 W / s"', 750.0), ("1200", 1200.0), ('"off"', math.inf)],
)
def test_a_ramp_is_a_power_per_second_or_off(tmp_path: Path, text: str, rate: float) -> None:
    path = tmp_path / "cdgpc.toml"
    path.write_text(f"[control]\nramp = {text}\n")
    config = load_config(path, env={})
    assert config.control.ramp == rate
    assert Tuning.from_config(config.control).controller.ramp_w_per_s == rate


@pytest.mark.parametrize("text", ['"fast"', "-5", '"5kW/h"', "0"])
def test_a_bad_ramp_is_refused_naming_the_key(tmp_path: Path, text: str) -> None:
    path = tmp_path / "cdgpc.toml"
    path.write_text(f"[control]\nramp = {text}\n")
    with pytest.raises(ConfigError, match=r"control\.ramp.*5kW/s") as caught:
        load_config(path, env={})
    assert "\n" not in str(caught.value)
