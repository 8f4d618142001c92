from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_cdgpc.cli.main import cli
from slurm_cdgpc.config import AuthConfig, Config, HeadConfig, NodeConfig
from slurm_cdgpc.doctor import run_checks


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"ok": True}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def health_url() -> Iterator[str]:
    server = HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _config(tmp_path: Path, head_url: str, backend: str = "simulated") -> Config:
    key = tmp_path / "hmac.key"
    key.write_bytes(b"s" * 32)
    key.chmod(0o600)
    return replace(
        Config(),
        head=HeadConfig(url=head_url),
        auth=AuthConfig(method="hmac", hmac_key_file=key),
        node=NodeConfig(backend=backend, listen_address="127.0.0.1", listen_port=1),
    )


def test_a_healthy_head_and_credentials_pass_and_a_missing_agent_says_what_to_do(
    tmp_path: Path, health_url: str
) -> None:
    checks = {c.name: c for c in run_checks(_config(tmp_path, health_url))}
    assert checks["auth"].ok and "verifies as uid" in checks["auth"].detail
    assert checks["head"].ok
    assert checks["gpus"].ok and checks["clock control"].ok
    assert not checks["agent"].ok and "start cdgpc-noded" in checks["agent"].fix


def test_a_bad_key_file_fails_with_a_fix(tmp_path: Path, health_url: str) -> None:
    config = _config(tmp_path, health_url)
    (tmp_path / "hmac.key").chmod(0o644)  # readable by others: refused
    [auth] = [c for c in run_checks(config) if c.name == "auth"]
    assert not auth.ok and "mode 0600" in auth.fix


@pytest.mark.parametrize(
    ("cap_eff", "missing"),
    [("0000000000000000", "CAP_SYS_ADMIN"), ("000001ffffffffff", "/dev/nvidiactl")],
)
def test_clock_control_needs_cap_sys_admin_and_the_control_device(
    tmp_path: Path, health_url: str, cap_eff: str, missing: str
) -> None:
    status = tmp_path / "status"
    status.write_text(f"Name:\tx\nCapEff:\t{cap_eff}\n")
    checks = run_checks(_config(tmp_path, health_url, backend="nvml"), status_path=status)
    [clock] = [c for c in checks if c.name == "clock control"]
    if missing == "/dev/nvidiactl" and Path(missing).exists():
        pytest.skip("a machine with an NVIDIA driver: /dev/nvidiactl is there")
    # without the capability that is what it says; with it, a GPU-less machine lacks nvidiactl
    assert not clock.ok and missing in clock.detail
    [gpus] = [c for c in checks if c.name == "gpus"]
    if not Path("/dev/nvidiactl").exists():  # no driver: NVML cannot answer, and doctor says so
        assert not gpus.ok and "driver" in gpus.fix


def test_doctor_exits_non_zero_and_prints_json(tmp_path: Path, health_url: str) -> None:
    config = tmp_path / "cdgpc.toml"
    key = tmp_path / "hmac.key"
    key.write_bytes(b"s" * 32)
    key.chmod(0o600)
    config.write_text(
        f'[head]\nurl = "{health_url}"\n[auth]\nmethod = "hmac"\nhmac_key_file = "{key}"\n'
        '[node]\nbackend = "simulated"\nlisten_address = "127.0.0.1"\nlisten_port = 1\n'
    )
    result = CliRunner().invoke(cli, ["doctor", "--config", str(config), "--json"])
    assert result.exit_code == 1  # the agent is not running
    report = json.loads(result.output)
    assert report["ok"] is False
    assert {c["name"] for c in report["checks"] if not c["ok"]} == {"agent"}


def test_doctor_names_the_other_limiters_it_finds(tmp_path: Path, health_url: str) -> None:
    proc = tmp_path / "proc"
    for pid, name in ((1, "systemd"), (812, "nvidia-powerd"), (813, "nv-hostengine")):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "comm").write_text(name + "\n")
    (proc / "self").mkdir()  # not a process number: not read
    checks = {c.name: c for c in run_checks(_config(tmp_path, health_url), proc_root=proc)}
    found = checks["other limiters"]
    assert not found.ok and "on_override" in found.fix
    assert found.detail == (
        "nvidia-powerd runs: NVIDIA Dynamic Power Boost (moves power between CPU and GPU); "
        "nv-hostengine runs: the DCGM host engine (its power policies set limits)"
    )
    (proc / "812" / "comm").unlink()
    (proc / "813" / "comm").unlink()
    checks = {c.name: c for c in run_checks(_config(tmp_path, health_url), proc_root=proc)}
    assert checks["other limiters"].ok
