"""The local-cluster harness's own pieces, without starting a daemon: the TOML it writes, the
environment it gives, how it waits and how it stops a process."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from slurm_cdgpc.config import load_config
from slurm_cdgpc.localcluster import (
    LocalCluster,
    NotReadyError,
    daemon_env,
    hmac_auth,
    stop_processes,
    toml_text,
    wait_for,
)


def test_toml_text_merges_layers_and_leaves_out_unset_keys() -> None:
    text = toml_text(
        {"head": {"url": "http://a", "reconcile": None}, "node": {"gpus": ["a", 'b"c']}},
        {"head": {"url": "http://b", "listen_port": 8463}, "lease": {"safe_cap": 0.6}},
    )
    assert tomllib.loads(text) == {
        "head": {"url": "http://b", "listen_port": 8463},
        "node": {"gpus": ["a", 'b"c']},
        "lease": {"safe_cap": 0.6},
    }


def test_the_configs_written_are_the_daemons_own(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("00" * 32)
    key.chmod(0o600)
    cluster = LocalCluster(tmp_path, hmac_auth(key, admin=True), interval_s=0.5)
    head = cluster.add_head(extra={"head": {"reconcile": False}})
    node = cluster.add_node("n1", gpus=3, head_url=head.url)
    head_config = load_config(head.config, env={})
    node_config = load_config(node.config, env={})
    assert (head_config.head.listen_port, head_config.head.reconcile) == (head.port, False)
    assert head_config.store.url == f"sqlite:///{tmp_path / 'cdgpc.db'}"
    assert head_config.control.interval_s == 0.5 and head_config.auth.hmac_is_admin
    assert node_config.node.simulated_gpu_type == "A100-SXM4-80GB"  # unset: the default
    assert (node_config.node.simulated_gpu_count, node_config.head.url) == (3, head.url)
    assert node_config.node.state_file == tmp_path / "n1" / "state.json"


def test_daemon_env_drops_our_settings_and_the_slurm_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDGPC_HEAD_URL", "http://elsewhere")
    monkeypatch.setenv("CDGPC_DEBUG", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = daemon_env()
    assert not {"CDGPC_HEAD_URL", "CDGPC_DEBUG", "SLURM_JOB_ID"} & set(env)
    assert env["PYTHONPATH"] == "/somewhere"
    kept = daemon_env(keep_debug=True, source_first=True)
    assert kept["CDGPC_DEBUG"] == "1" and "CDGPC_HEAD_URL" not in kept
    assert kept["PYTHONPATH"] == f"{Path(__file__).resolve().parents[2]}:/somewhere"


def test_wait_for_returns_the_first_true_result_and_says_what_it_missed() -> None:
    answers = iter([OSError("not yet"), None, 0, {"ok": True}])

    def check() -> object:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert wait_for("ready", check, 5.0, period_s=0.0) == {"ok": True}
    with pytest.raises(NotReadyError) as missed:
        wait_for("never", lambda: False, 0.1, lambda: "the log", note="logs in /x")
    assert str(missed.value) == "never: not within 0.1 s (logs in /x)\nthe log"


def test_stop_processes_kills_what_ignores_sigterm_and_says_so() -> None:
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print(1, flush=True); time.sleep(60)"
    )
    stubborn = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert stubborn.stdout is not None and stubborn.stdout.readline()  # its handler is set
    try:
        assert stop_processes([stubborn, polite], timeout_s=1.0) == [stubborn]
        assert polite.returncode == -15 and stubborn.returncode == -9
    finally:
        for p in (stubborn, polite):
            if p.poll() is None:
                p.kill()
                p.wait()
        if stubborn.stdout is not None:
            stubborn.stdout.close()
