"""``cdgpc-admin demo``: the real daemons replay the bundled trace; the figures it prints are
consistent with each other, and no process it started outlives it, on a normal end or Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_cdgpc.transport.credentials import munge_works

pytestmark = pytest.mark.live

ADMIN = [sys.executable, "-c", "from slurm_cdgpc.cli.main import main; main()"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("CDGPC_")}


def _needs_credentials() -> None:
    if os.geteuid() != 0 and not munge_works():
        pytest.skip("the demo needs root (the daemons' HMAC key) or a running munged")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive: its parent just has not reaped it yet
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _with_cmdline(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry.name))
    return found


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().split(")")[-1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def test_demo_json_is_consistent_and_leaves_no_process(tmp_path: Path) -> None:
    _needs_credentials()
    out = tmp_path / "out"
    result = subprocess.run(
        [*ADMIN, "demo", "--duration", "10s", "--json", "--out", str(out), "--keep-run-dir"],
        env=_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    s = json.loads(result.stdout)
    run_dir = s["run_dir"]
    try:
        assert s["intervals"] > 0
        # one decision per interval, and at most one out of cycle per registration
        assert s["intervals"] <= 10 / s["interval_s"] + 1 + s["jobs_registered"]
        assert s["jobs_registered"] > 0
        assert s["jobs_registered"] >= s["jobs_finished"]
        assert s["jobs_submitted"] >= s["jobs_registered"]
        assert s["budget_changes_applied"] == 1
        # the cap holds: a budget cut half-way, jobs starting at top clocks, models learning
        assert s["max_power_over_budget_pct"] < 3.0
        assert s["hook_failures"] == 0
        assert s["daemons_with_tracebacks"] == []
        assert len(s["pids"]) == 5 and s["processes_left"] == 0 and s["processes_killed"] == 0
        assert not any(_alive(pid) for pid in s["pids"])
        assert _with_cmdline(run_dir) == []
        for name in ("power.png", "jobs.png", "cdgpc.db"):
            assert (out / name).stat().st_size > 0
        # the head's own log agrees on the budget change and on every daemon stopping cleanly
        head_log = (Path(run_dir) / "cdgpcd.log").read_text()
        assert "budget change by" in head_log and "cdgpcd stopped" in head_log
        for node in ("node1", "node2", "node3", "node4"):
            assert "cdgpc-noded stopped" in (Path(run_dir) / f"{node}.log").read_text()
    finally:
        subprocess.run(["rm", "-rf", run_dir], check=False)


def test_ctrl_c_stops_every_daemon(tmp_path: Path) -> None:
    _needs_credentials()
    demo = subprocess.Popen(
        [*ADMIN, "demo", "--duration", "120s", "--json", "--out", str(tmp_path / "out")],
        env=_env(),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        daemons: list[int] = []
        while len(daemons) < 5 and time.monotonic() < deadline:
            time.sleep(0.5)
            daemons = _children(demo.pid)
        assert len(daemons) == 5, "the demo did not start its five daemons"
        time.sleep(8)  # let the replay run: jobs placed, registered and running
        demo.send_signal(signal.SIGINT)  # what Ctrl-C sends (here to the demo alone)
        stdout, stderr = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert demo.returncode == 0, stderr[-3000:]
    s = json.loads(stdout)
    assert s["interrupted"] is True
    assert sorted(s["pids"]) == sorted(daemons)
    assert s["processes_left"] == 0
    assert not any(_alive(pid) for pid in daemons)
