"""The Prolog/Epilog logic with a fake head: register, spool, forward, deregister, exit 0."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.slurm import hooks
from slurm_cdgpc.slurm.env import parse_gpu_indices, read_hook_env
from slurm_cdgpc.slurm.hooks import HookSettings, hold_gpus, run, run_epilog, run_prolog
from slurm_cdgpc.slurm.install import render_hook
from slurm_cdgpc.slurm.scontrol import JobTimes, parse_show_job
from slurm_cdgpc.slurm.spool import Spool, forward_spool
from slurm_cdgpc.slurm.squeue import parse_squeue_json
from slurm_cdgpc.transport.http import HeadRefusedError, HeadUnavailableError

REPO = Path(__file__).resolve().parents[2]
NOW_S = 1_800_000_000.0
ENV = {
    "SLURM_JOB_ID": "42",
    "SLURM_JOB_USER": "alice",
    "SLURMD_NODENAME": "n1",
    "SLURM_JOB_GPUS": "0,1",
    "SLURM_JOB_COMMENT": "deadline=+1h,iters=100 other",
}


class FakeHead:
    def __init__(self, down: bool = False) -> None:
        self.down = down
        self.jobs: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []

    def post(self, path: str, payload: dict[str, object]) -> Any:
        self.calls.append(("POST", path))
        if self.down:
            raise HeadUnavailableError("cannot reach cdgpcd")
        self.jobs[str(payload["job_id"])] = dict(payload)
        return {}

    def delete(self, path: str) -> Any:
        self.calls.append(("DELETE", path))
        if self.down:
            raise HeadUnavailableError("cannot reach cdgpcd")
        if self.jobs.pop(path.rsplit("/", 1)[1], None) is None:
            raise HeadRefusedError(404, "not registered")
        return {}


def _times(_job: str) -> JobTimes:
    return JobTimes(submit_s=NOW_S - 60)


def test_prolog_registers_gpus_deadline_and_iterations(tmp_path: Path) -> None:
    head = FakeHead()
    out = run_prolog(
        read_hook_env(ENV), head, Spool(tmp_path), now_s=NOW_S, until_s=1e18, times=_times
    )
    assert out.action == "registered" and "job 42 on n1" in out.line
    assert head.jobs["42"] == {
        "job_id": "42",
        "user": "alice",
        "node": "n1",
        "gpus": [0, 1],
        "deadline_s": NOW_S - 60 + 3600,
        "iterations_total": 100,
    }
    # the time limit and start bound the work of a job that says none: they go along
    limited = JobTimes(submit_s=NOW_S - 60, start_s=NOW_S - 1, time_limit_s=7200.0)
    run_prolog(
        read_hook_env({**ENV, "SLURM_JOB_COMMENT": "deadline=2030-01-01T00:00Z"}),
        head,
        Spool(tmp_path),
        now_s=NOW_S,
        until_s=1e18,
        times=lambda _job: limited,
    )
    assert (head.jobs["42"]["time_limit_s"], head.jobs["42"]["start_s"]) == (7200.0, NOW_S - 1)


def test_prolog_sends_a_serving_jobs_latency_objective(tmp_path: Path) -> None:
    head = FakeHead()
    env = read_hook_env({**ENV, "SLURM_JOB_COMMENT": "serve slo=p99.9:250ms deadline=+1h"})
    run_prolog(env, head, Spool(tmp_path), now_s=NOW_S, until_s=1e18, times=_times)
    assert (head.jobs["42"]["slo_percentile"], head.jobs["42"]["slo_latency_s"]) == (99.9, 0.25)
    assert head.jobs["42"]["deadline_s"] == NOW_S - 60 + 3600


def test_prolog_sends_the_job_name_slurm_shows_and_none_when_it_shows_none(
    tmp_path: Path,
) -> None:
    head = FakeHead()
    named = JobTimes(submit_s=NOW_S - 60, name="train-bert")
    run_prolog(
        read_hook_env(ENV), head, Spool(tmp_path), now_s=NOW_S, until_s=1e18, times=lambda _j: named
    )
    assert head.jobs["42"]["job_name"] == "train-bert"
    run_prolog(read_hook_env(ENV), head, Spool(tmp_path), now_s=NOW_S, until_s=1e18, times=_times)
    assert "job_name" not in head.jobs["42"]
    long = JobTimes(submit_s=NOW_S - 60, name="n" * 300)  # Slurm takes longer names than the head
    out = run_prolog(
        read_hook_env(ENV), head, Spool(tmp_path), now_s=NOW_S, until_s=1e18, times=lambda _j: long
    )
    assert out.action == "registered" and head.jobs["42"]["job_name"] == "n" * 200


def test_head_down_spools_then_forwarding_delivers_in_order(tmp_path: Path) -> None:
    head = FakeHead(down=True)
    env = read_hook_env(ENV)
    spool = Spool(tmp_path)
    assert run_prolog(env, head, spool, now_s=NOW_S, until_s=1e18, times=_times).action == "spooled"
    assert run_epilog(env, head, spool, until_s=1e18).action == "spooled"
    assert len(spool.pending()) == 2
    head.down = False
    head.calls.clear()
    result = forward_spool(head, tmp_path)
    assert (result.sent, result.left) == (2, 0)
    assert head.calls == [("POST", "/v1/jobs"), ("DELETE", "/v1/jobs/42")]
    assert spool.pending() == []


def test_epilog_deregisters_and_tolerates_404(tmp_path: Path) -> None:
    head = FakeHead()
    env = read_hook_env(ENV)
    run_prolog(env, head, Spool(tmp_path), now_s=NOW_S, until_s=1e18, times=_times)
    assert run_epilog(env, head, Spool(tmp_path), until_s=1e18).action == "deregistered"
    again = run_epilog(env, head, Spool(tmp_path), until_s=1e18)
    assert again.action == "deregistered" and "already" in again.line


def test_job_without_gpus_is_left_alone(tmp_path: Path) -> None:
    head = FakeHead()
    env = read_hook_env({**ENV, "SLURM_JOB_GPUS": ""})
    assert (
        run_prolog(env, head, Spool(tmp_path), now_s=NOW_S, until_s=1e18, times=_times).action
        == "skipped"
    )
    assert head.calls == []


def test_the_prolog_holds_the_jobs_gpus_after_registering_whatever_the_head_says(
    tmp_path: Path,
) -> None:
    order: list[str] = []
    lines: list[str] = []

    class Head(FakeHead):
        def post(self, path: str, payload: dict[str, object]) -> Any:
            order.append("register")
            return super().post(path, payload)

    def holder(_s: HookSettings, _e: object) -> Callable[[str, Sequence[int]], str]:
        def hold(job_id: str, gpus: Sequence[int]) -> str:
            order.append(f"hold {job_id} {list(gpus)}")
            return "GPU(s) [0, 1] held here (safe cap, or the head's earlier setpoint)"

        return hold

    settings = HookSettings(spool_dir=tmp_path / "spool")
    for down, action in ((False, "registered"), (True, "spooled")):
        order.clear()
        lines.clear()
        status = run(
            "prolog",
            settings,
            ENV,
            emit=lambda _p, m: lines.append(m),
            client_factory=lambda _s, _e, down=down: Head(down=down),
            hold_factory=holder,
        )
        assert status == 0 and order == ["register", "hold 42 [0, 1]"]
        [line] = lines
        assert action in line and "GPU(s) [0, 1] held here" in line


def test_a_hold_that_fails_is_noted_and_changes_nothing_else(tmp_path: Path) -> None:
    reason = "cannot reach the local agent at http://127.0.0.1:8464"

    def hold(job_id: str, gpus: Sequence[int]) -> str:
        raise HeadUnavailableError(reason)

    env = read_hook_env(ENV)
    registered = run_prolog(
        env, FakeHead(), Spool(tmp_path), now_s=NOW_S, until_s=1e18, times=_times
    )
    out = hold_gpus(env, registered, hold)
    assert out.action == "registered" and out.priority == registered.priority
    assert out.line == f"{registered.line}; local hold failed ({reason})"
    no_gpus = read_hook_env({**ENV, "SLURM_JOB_GPUS": ""})
    assert hold_gpus(no_gpus, registered, hold) == registered  # nothing to hold


def test_run_exits_0_with_one_line_unless_strict(tmp_path: Path) -> None:
    lines: list[str] = []
    settings = HookSettings(spool_dir=tmp_path / "spool")

    def down(_s: HookSettings, _e: object) -> FakeHead:
        return FakeHead(down=True)

    assert run("prolog", settings, {}, emit=lambda _p, m: lines.append(m), client_factory=down) == 0
    assert len(lines) == 1 and "not run by slurmd" in lines[0]
    lines.clear()
    assert (
        run("prolog", settings, ENV, emit=lambda _p, m: lines.append(m), client_factory=down) == 0
    )
    assert len(lines) == 1 and "spooled" in lines[0] and "job 42" in lines[0]
    blocked = tmp_path / "file"
    blocked.write_text("")
    strict = HookSettings(spool_dir=blocked / "spool", strict=True)
    assert run("prolog", strict, ENV, emit=lambda _p, m: lines.append(m), client_factory=down) == 1
    lenient = HookSettings(spool_dir=blocked / "spool")
    assert run("prolog", lenient, ENV, emit=lambda _p, m: lines.append(m), client_factory=down) == 0


def test_hook_module_imports_only_the_standard_library() -> None:
    code = (
        "import sys, slurm_cdgpc.slurm.hooks\n"
        "print(sorted(m for m in ('numpy', 'sqlalchemy', 'cvxpy', 'click') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_committed_entry_points_match_the_installer() -> None:
    for kind, path in (
        ("prolog", REPO / "prolog" / "cdgpc-prolog"),
        ("epilog", REPO / "epilog" / "cdgpc-epilog"),
        ("task-prolog", REPO / "prolog" / "cdgpc-task-prolog"),
        ("prolog-slurmctld", REPO / "prolog" / "cdgpc-prolog-slurmctld"),
    ):
        assert path.read_text() == render_hook(kind)
        assert path.stat().st_mode & 0o111
        assert path.read_text().startswith("#!/usr/bin/python3 -I\n")


def test_env_parsing() -> None:
    assert parse_gpu_indices("0,2-3") == (0, 2, 3)
    with pytest.raises(InputError):
        parse_gpu_indices("gpu0")
    env = read_hook_env(
        {
            "SLURM_JOB_ID": "7",
            "SLURM_JOB_USER": "bob",
            "CUDA_VISIBLE_DEVICES": "3",
            "SLURM_ARRAY_JOB_ID": "5",
            "SLURM_ARRAY_TASK_ID": "2",
        },
        hostname=lambda: "gpu01.example.org",
    )
    assert (env.node, env.gpus, env.display_id) == ("gpu01", (3,), "5_2")
    with pytest.raises(InputError):
        read_hook_env({"SLURM_JOB_USER": "bob"})


def test_a_job_on_mig_instances_is_named_by_them_not_by_slurms_record_positions() -> None:
    uuid = "MIG-18d45745-671c-5928-80ba-9aa8239d2892"
    older = "MIG-GPU-1f4ccf84-cd96-4554-aafa-b75ceb36a59c/8/0"
    env = read_hook_env({**ENV, "SLURM_JOB_GPUS": "3,4", "CUDA_VISIBLE_DEVICES": f"{uuid},{older}"})
    assert (env.gpus, env.mig) == ((), (uuid, older))  # 3 and 4 are no GPU's indices
    plain = read_hook_env({**ENV, "CUDA_VISIBLE_DEVICES": "0,1"})
    assert (plain.gpus, plain.mig) == ((0, 1), ())
    for bad in ("MIG-", "MIG-abc/1", "MIG-abc/../1/2", f"{uuid};reboot", "MIG-" + "a" * 97):
        with pytest.raises(InputError, match="CUDA_VISIBLE_DEVICES: must be a MIG device name"):
            read_hook_env({**ENV, "CUDA_VISIBLE_DEVICES": bad})


def test_mig_instances_the_agent_cannot_place_leave_the_job_unregistered(tmp_path: Path) -> None:
    env = read_hook_env({**ENV, "CUDA_VISIBLE_DEVICES": "MIG-abc,MIG-def"})

    def down(_job: str, _names: Sequence[str]) -> dict[str, int]:
        raise HeadUnavailableError("cannot reach the local agent at http://127.0.0.1:8464")

    for resolve, note in (
        (None, "MIG instance(s) MIG-abc,MIG-def: no local agent to find their GPUs"),
        (down, "MIG instance(s) MIG-abc,MIG-def: GPUs not found (cannot reach the local agent"),
        (lambda _j, _n: {}, "MIG instance(s) MIG-abc,MIG-def on GPU(s) none (2 not on this"),
    ):
        resolved, line = hooks.resolve_mig(env, resolve)
        assert resolved.gpus == () and line.startswith(note)
        head = FakeHead()
        out = run_prolog(resolved, head, Spool(tmp_path), now_s=NOW_S, until_s=1e18, times=_times)
        assert out.action == "skipped" and head.calls == []
    resolved, line = hooks.resolve_mig(env, lambda _j, _n: {"MIG-def": 2, "MIG-abc": 2})
    assert resolved.gpus == (2,) and line == "MIG instance(s) MIG-abc,MIG-def on GPU(s) 2"


@pytest.mark.parametrize(
    "reply",
    [
        {"gpus": {"MIG-zzz": 1}},
        {"gpus": {"MIG-abc": -1}},
        {"gpus": {"MIG-abc": True}},
        {"gpus": [1]},
        [],
    ],
)
def test_a_mig_answer_that_is_not_a_map_of_the_names_asked_is_refused(
    monkeypatch: pytest.MonkeyPatch, reply: object
) -> None:
    class Agent:
        def post(self, _path: str, _payload: object) -> object:
            return reply

    monkeypatch.setattr(hooks, "_local_agent", lambda _s, _e: Agent())
    with pytest.raises(InputError, match="not a map of names to GPU indices"):
        hooks.make_local_mig(HookSettings(), {})("51", ["MIG-abc"])


def test_the_holds_refusal_names_the_gpu_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    class Agent:
        def post(self, _path: str, _payload: object) -> object:
            return {"held": [0], "refused": [{"gpu": 1, "reason": "no GPU with index 1"}]}

    monkeypatch.setattr(hooks, "_local_agent", lambda _s, _e: Agent())
    line = hooks.make_local_hold(HookSettings(), {})("51", [0, 1])
    assert line.endswith("(1 refused: GPU 1: no GPU with index 1)")


def test_scontrol_line() -> None:
    times = parse_show_job(
        "JobId=9 JobName=wrap SubmitTime=2026-11-29T10:00:00 TimeLimit=1-01:00:00 "
        "StartTime=2026-11-29T10:00:05 Deadline=N/A Comment=deadline=+1h"
    )
    assert times.time_limit_s == 90000.0 and times.deadline_s is None
    assert times.start_s is not None and times.submit_s is not None
    assert times.start_s - times.submit_s == 5.0
    assert times.name == "wrap"
    assert parse_show_job("JobId=9 SubmitTime=2026-11-29T10:00:00").name is None


def test_squeue_json_22_05_and_24_11_shapes() -> None:
    old = (
        '{"jobs": [{"job_id": 3, "job_state": "RUNNING", "user_name": "a", "time_limit": 60,'
        ' "start_time": 100, "nodes": "n1", "comment": "deadline=+1h"}, {"job_id": "x"}]}'
    )
    new = (
        '{"jobs": [{"job_id": 4, "job_state": ["RUNNING"], "user_name": "b",'
        ' "time_limit": {"set": true, "infinite": false, "number": 30},'
        ' "start_time": {"set": true, "infinite": false, "number": 200},'
        ' "array_job_id": {"set": true, "infinite": false, "number": 0}}]}'
    )
    [a] = parse_squeue_json(old)
    [b] = parse_squeue_json(new)
    assert (a.job_id, a.state, a.time_limit_s, a.start_s) == ("3", "RUNNING", 3600.0, 100.0)
    assert (b.job_id, b.state, b.time_limit_s, b.array_job_id) == ("4", "RUNNING", 1800.0, None)


def test_the_prologs_spool_leaves_the_hold_one_timeout_of_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hook's bound: no step outlives the budget by more than one timeout. With a hold
    after it, the spool's forwarding must stop one timeout earlier."""
    budgets: list[float] = []
    began = [0.0]

    def forward(_client: object, _spool: object, until_s: float) -> str:
        # against when the run began, not now: a slow host must not eat into the bound
        budgets.append(until_s - began[0])
        return ""

    monkeypatch.setattr(hooks, "_forward", forward)
    settings = HookSettings(spool_dir=tmp_path / "spool", timeout_s=0.5, budget_s=2.0)

    def holder(_s: HookSettings, _e: object) -> Callable[[str, Sequence[int]], str]:
        return lambda _job, _gpus: "held"

    for hold_factory in (holder, None):
        began[0] = time.monotonic()
        run(
            "prolog",
            settings,
            ENV,
            emit=lambda _p, _m: None,
            client_factory=lambda _s, _e: FakeHead(),
            hold_factory=hold_factory,
        )
    with_hold, without = budgets
    # the budget's end less one timeout, and the budget's end (plus the hook's own start-up)
    assert 1.5 <= with_hold < 2.0 <= without < 2.5


#: a Prolog whose every request blocks in Python far past any timeout (a stand-in for a step
#: that no socket bound reaches)
_STUCK_PROLOG = """
import sys, time
from slurm_cdgpc.slurm import hooks
from slurm_cdgpc.transport import http
http._request = lambda *args, **kwargs: time.sleep(60)
sys.exit(hooks.main("prolog"))
"""


def test_a_prolog_stuck_past_its_budget_spools_and_exits_0_at_its_backstop(
    tmp_path: Path,
) -> None:
    """The backstop timer ends the stuck registration as an unreachable head (spooled), and
    the stuck hold after it by exiting, one margin later."""
    key = tmp_path / "hmac.key"
    key.write_bytes(b"k" * 32)
    key.chmod(0o600)
    config = tmp_path / "cdgpc.toml"
    config.write_text(
        f'[auth]\nmethod = "hmac"\nhmac_key_file = "{key}"\n[head]\nurl = "http://127.0.0.1:9"\n'
    )
    spool_dir = tmp_path / "spool"
    args = ["--config", str(config), "--spool-dir", str(spool_dir)]
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-c", _STUCK_PROLOG, *args],
            env={**ENV, "SLURM_JOB_COMMENT": "", "PYTHONPATH": str(REPO)},
            capture_output=True,
            timeout=30,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the stuck Prolog was still running 30 s after it started")
    took_s = time.monotonic() - started
    assert (done.returncode, done.stdout, done.stderr) == (0, b"", b"")
    # budget, two margins, and the interpreter's start
    assert took_s < hooks.DEFAULT_BUDGET_S + 2 * hooks.BACKSTOP_MARGIN_S + 2.0, took_s
    [record] = Spool(spool_dir).pending()
    assert record.name.endswith("-register-42.json")
