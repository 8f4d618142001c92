"""The automatic progress hook over a real Unix socket: its line, its rate limit, who reports,
an agent that is not there, the sitecustomize chain (on every CPython found here), torch's
optimizer steps, the TaskProlog's export lines and the framework callbacks."""

from __future__ import annotations

import ast
import functools
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_cdgpc.agent import progress as agent_progress
from slurm_cdgpc.agent.progress import ProgressServer
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.integrations import HOOK_DIR, progress_hook
from slurm_cdgpc.slurm import install, task_prolog
from slurm_cdgpc.wire.names import JOB_ID
from slurm_cdgpc.wire.protocol import MAX_COUNT, ProgressLine

REPO = Path(__file__).resolve().parents[2]
HOOK: Any = progress_hook()  # the module, loaded by path as the callbacks load it
Record = tuple[str, int, int | None]


class Agent:
    """A real `ProgressServer` on a short socket path, and the reports it recorded."""

    def __init__(self, path: Path, refuse: bool = False) -> None:
        self.records: list[Record] = []
        self.refuse = refuse
        self.server = ProgressServer(path, self._record, timeout_s=0.5)
        self.path = str(path)

    def _record(self, job_id: str, step: int, total: int | None, uid: int) -> None:
        if self.refuse:
            raise InputError(f"job {job_id}: refused by the agent")
        self.records.append((job_id, step, total))

    def wait(self, count: int, timeout_s: float = 5.0) -> list[Record]:
        """The records, once there are ``count`` of them (fails after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while len(self.records) < count:
            if time.monotonic() > deadline:
                pytest.fail(f"{count} report(s) expected, got {self.records}")
            time.sleep(0.01)
        return list(self.records)


def _by_step(records: list[Record]) -> list[Record]:
    """Records sent back to back, in step order: the agent serves each connection on its own
    thread, so two sends a moment apart may be recorded in either order."""
    return sorted(records, key=lambda r: r[1])


class Optimizer:
    """What the post hook receives: an object it may only weakly reference."""


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory: Unix socket paths are limited to 107 bytes."""
    with tempfile.TemporaryDirectory(prefix="cdgpc-") as d:
        yield Path(d)


@pytest.fixture
def agent(short_dir: Path) -> Iterator[Agent]:
    a = Agent(short_dir / "progress.sock")
    a.server.start()
    yield a
    a.server.close()


@pytest.fixture
def fresh_hook(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The hook module with no reporter made yet (restored after the test)."""
    for name in ("_reporter", "_finder", "_handle"):
        monkeypatch.setattr(HOOK, name, None)
    return HOOK


def _job_env(**extra: str) -> dict[str, str]:
    """This environment, outside any job and without our settings, plus ``extra``."""
    drop = ("SLURM_", "CDGPC_", "PYTHON")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.pop("LOCAL_RANK", None)
    env.update(extra)
    return env


def _python(python: str, code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@functools.cache
def _interpreters() -> list[str]:
    """This Python and one CPython of every other version >= 3.8 found here (PATH, pyenv)."""
    found: dict[tuple[int, ...], str] = {sys.version_info[:2]: sys.executable}
    candidates = [shutil.which(f"python3.{minor}") for minor in range(8, 15)]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.*/bin/python3")))
    for path in filter(None, candidates):
        probe = [path, "-c", "import sys; print(*sys.version_info[:2])"]
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30, check=False)
        if done.returncode == 0 and len(version := tuple(map(int, done.stdout.split()))) == 2:
            found.setdefault(version, path)
    return [path for version, path in sorted(found.items()) if version >= (3, 8)]


# -- the line, the environment -----------------------------------------------------------------


def test_the_line_is_the_wire_contract() -> None:
    for job, step, total in [
        ("7", 0, None),
        ("123_4", 500, 10_000),
        ("9999999999", MAX_COUNT, MAX_COUNT),
    ]:
        line = HOOK.progress_line(job, step, total)
        assert line == ProgressLine(job, step, total).to_json() + b"\n"
        parsed = ProgressLine.from_json(line.rstrip(b"\n"))
        assert (parsed.job_id, parsed.step, parsed.total) == (job, step, total)
        assert parsed.to_json() + b"\n" == line
    assert HOOK.MAX_COUNT == MAX_COUNT
    assert str(agent_progress.DEFAULT_SOCKET) == HOOK.DEFAULT_SOCKET
    assert HOOK.SOCKET_ENV == agent_progress.SOCKET_ENV == task_prolog.SOCKET_ENV
    assert HOOK.OFF_VALUES == task_prolog.OFF_VALUES and HOOK.SWITCH_ENV == task_prolog.SWITCH_ENV


def test_job_ids_follow_the_protocols_grammar() -> None:
    for text in ["1", "123_4", "9999999999", "9999999999_1234567890", "0", "01", "12_", "_1",
                 "1_2_3", "12345678901", "1a", "١٢", "", " 1", "1_01", "123+1", "123+0",
                 "123_0", "123+01", "1+2+3", "1_2+3", "1+2_3", "+1", "1+", "0123",
                 "1_12345678901"]:  # fmt: skip
        assert HOOK.valid_job_id(text) == bool(JOB_ID.fullmatch(text)), text


def test_switches_and_ranks() -> None:
    assert HOOK.job_id_of({"SLURM_JOB_ID": "7"}) == "7"
    assert HOOK.job_id_of({}) is None
    assert HOOK.job_id_of({"SLURM_JOB_ID": "abc"}) is None
    for off in ("off", "OFF", " False ", "0", "no"):
        assert HOOK.job_id_of({"SLURM_JOB_ID": "7", "CDGPC_PROGRESS": off}) is None
    assert HOOK.job_id_of({"SLURM_JOB_ID": "7", "CDGPC_PROGRESS": "on"}) == "7"
    assert HOOK.first_local_task({}) and HOOK.first_local_task({"LOCAL_RANK": "0"})
    assert HOOK.first_local_task({"LOCAL_RANK": "0", "SLURM_LOCALID": "0"})
    assert not HOOK.first_local_task({"LOCAL_RANK": "1"})
    assert not HOOK.first_local_task({"SLURM_LOCALID": "3"})
    assert HOOK.interval_of({"CDGPC_PROGRESS_INTERVAL": "0.05"}) == 0.05
    for bad in ("fast", "-1", "nan", "inf"):
        assert HOOK.interval_of({"CDGPC_PROGRESS_INTERVAL": bad}) == 1.0


def test_the_hook_is_python_38_and_standard_library_only() -> None:
    for path in sorted(HOOK_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(), feature_version=(3, 8))
        imported = {
            a.name.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.Import)
            for a in n.names
        }
        imported |= {
            n.module.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module and n.level == 0
        }
        imported -= {"__future__", "_cdgpc_progress_hook"}
        assert imported <= sys.stdlib_module_names, (path.name, imported - sys.stdlib_module_names)
    assert sorted(p.name for p in HOOK_DIR.iterdir() if p.suffix == ".py") == [
        "_cdgpc_progress_hook.py",
        "sitecustomize.py",
    ]


# -- counting and sending ----------------------------------------------------------------------


def test_many_steps_within_an_interval_make_one_report(agent: Agent) -> None:
    reporter = HOOK.Reporter("7", agent.path, 5.0, env={})
    optimizer = Optimizer()
    for _ in range(1000):
        reporter.count_step(optimizer, (), {})
    assert reporter.step == 1000 and reporter.attempts == 1
    assert agent.wait(1) == [("7", 1, None)]  # the first step, at once
    time.sleep(0.2)
    assert len(agent.records) == 1
    reporter.flush()  # at exit: what the rate limit held back
    assert _by_step(agent.wait(2))[-1] == ("7", 1000, None)
    reporter.flush()
    time.sleep(0.1)
    assert len(agent.records) == 2  # nothing new, nothing sent


def test_a_short_interval_reports_at_most_once_per_interval(agent: Agent) -> None:
    interval_s = HOOK.interval_of({"CDGPC_PROGRESS_INTERVAL": "0.05"})
    reporter = HOOK.Reporter("7", agent.path, interval_s, env={})
    optimizer = Optimizer()
    started = time.monotonic()
    while time.monotonic() - started < 0.5:
        reporter.count_step(optimizer)
        time.sleep(0.002)
    elapsed_s = time.monotonic() - started
    assert 2 <= reporter.attempts <= elapsed_s / interval_s + 1
    steps = [step for _, step, _ in agent.wait(reporter.attempts)]
    assert steps == sorted(steps) and steps[0] == 1


def test_the_step_is_the_most_any_optimizer_took(agent: Agent) -> None:
    reporter = HOOK.Reporter("7", agent.path, 60.0, env={})
    generator, discriminator = Optimizer(), Optimizer()
    for _ in range(30):  # a GAN: each steps once an iteration
        reporter.count_step(generator)
        reporter.count_step(discriminator)
    assert reporter.step == 30
    reporter.set_total(100)
    reporter.report(40)  # a framework's step that is ahead (a resumed run) wins
    assert reporter.step == 40
    reporter.report(10, total=35)  # never behind, and never past the total on the wire
    reporter.flush()
    assert _by_step(agent.wait(2))[-1] == ("7", 35, 35)


def test_only_the_first_local_task_reports(agent: Agent) -> None:
    for env in (
        {"LOCAL_RANK": "1"},
        {"SLURM_LOCALID": "2"},
        {"LOCAL_RANK": "0", "SLURM_LOCALID": "1"},
    ):
        reporter = HOOK.Reporter("7", agent.path, 0.0, env=env)
        for _ in range(5):
            reporter.count_step(reporter)
        reporter.flush()
        assert reporter.attempts == 0
    first = HOOK.Reporter("8", agent.path, 60.0, env={"LOCAL_RANK": "0", "SLURM_LOCALID": "0"})
    first.count_step(first)
    assert agent.wait(1) == [("8", 1, None)]


def test_off_or_outside_a_job_the_hook_does_nothing(
    fresh_hook: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    finders = list(sys.meta_path)
    for env in ({}, {"SLURM_JOB_ID": "7", "CDGPC_PROGRESS": "off"}, {"SLURM_JOB_ID": "x"}):
        for name in ("SLURM_JOB_ID", "CDGPC_PROGRESS"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert fresh_hook.install() is False
        fresh_hook.report(5, 10)
        fresh_hook.set_total(10)
        assert fresh_hook.get_reporter() is None and not fresh_hook.counting()
    assert sys.meta_path == finders


@pytest.mark.parametrize("kind", ["absent", "file", "not-listening", "backlog-full", "refusing"])
def test_an_agent_that_is_not_there_costs_a_failed_call(kind: str, short_dir: Path) -> None:
    path = short_dir / "progress.sock"
    held: list[socket.socket] = []
    refusing = Agent(path, refuse=True)
    if kind == "file":
        path.write_text("")
    elif kind in ("not-listening", "backlog-full"):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        if kind == "backlog-full":
            listener.listen(0)  # and never accepts
        held.append(listener)
    elif kind == "refusing":
        refusing.server.start()
    try:
        reporter = HOOK.Reporter("7", str(path), 0.0, env={})
        started = time.perf_counter()
        for _ in range(200):
            reporter.count_step(reporter)
        reporter.flush()
        elapsed_s = time.perf_counter() - started
    finally:
        refusing.server.close()
        for s in held:
            s.close()
    assert reporter.attempts >= 200
    assert elapsed_s < 2.0  # 200 tries; one that waited would take the agent's 0.5 s or forever
    if kind in ("absent", "file", "not-listening"):
        assert reporter.sent is None
    assert refusing.records == []


def test_a_sender_that_does_not_wait_for_the_answer_is_normal_to_the_agent(
    agent: Agent, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="slurm_cdgpc.agent.progress")
    for step in range(1, 31):
        reporter = HOOK.Reporter("7", agent.path, 0.0, env={})
        reporter.step = step
        assert reporter.send()
        time.sleep(0.01)  # one at a time: the agent's per-uid bound is another test's subject
    assert [s for _, s, _ in agent.wait(30)] == list(range(1, 31))
    time.sleep(0.2)
    assert [r.getMessage() for r in caplog.records if r.levelname != "DEBUG"] == []


# -- sitecustomize, in the job's own Python ----------------------------------------------------

PROBE = """
import sys
hook = sys.modules.get("_cdgpc_progress_hook")
first = type(sys.meta_path[0]).__name__
print(hook is not None, first, sys.modules["sitecustomize"].__file__, sys.path.count(sys.argv[-1]))
"""


def _site_env(*path: Path, **extra: str) -> dict[str, str]:
    return _job_env(PYTHONPATH=os.pathsep.join(map(str, path)), **extra)


def _theirs(directory: Path, runs: Path, body: str = "") -> Path:
    directory.mkdir()
    (directory / "sitecustomize.py").write_text(
        f"with open({str(runs)!r}, 'a') as f:\n    f.write('ran\\n')\n{body}"
    )
    return directory / "sitecustomize.py"


@pytest.mark.parametrize("python", _interpreters())
def test_a_later_sitecustomize_still_runs_once(python: str, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    theirs = _theirs(tmp_path / "later", runs)
    env = _site_env(HOOK_DIR, tmp_path / "later", SLURM_JOB_ID="7")
    done = subprocess.run(
        [python, "-c", PROBE, str(HOOK_DIR)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.split() == ["True", "_ImportWatcher", str(theirs), "1"]
    assert runs.read_text() == "ran\n"


@pytest.mark.parametrize("python", _interpreters())
def test_a_sitecustomize_earlier_on_pythonpath_wins(python: str, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    theirs = _theirs(tmp_path / "user", runs)
    env = _site_env(tmp_path / "user", HOOK_DIR, SLURM_JOB_ID="7")
    done = subprocess.run(
        [python, "-c", PROBE, str(HOOK_DIR)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.split()[0::2] == ["False", str(theirs)]
    assert runs.read_text() == "ran\n"


def test_a_failing_later_sitecustomize_fails_as_it_would_have(tmp_path: Path) -> None:
    _theirs(tmp_path / "later", tmp_path / "runs", body="raise RuntimeError('broken site')\n")
    alone = _python(sys.executable, "print('job')", _site_env(tmp_path / "later"))
    chained = _python(sys.executable, "print('job')", _site_env(HOOK_DIR, tmp_path / "later"))
    assert "RuntimeError: broken site" in alone.stderr
    assert (chained.returncode, chained.stdout, chained.stderr) == (0, "job\n", alone.stderr)


@pytest.mark.parametrize("python", _interpreters())
def test_the_hook_watches_imports_and_reports_in_every_python(python: str, agent: Agent) -> None:
    code = """
    import sys, _cdgpc_progress_hook as hook
    seen = []
    hook.watch_import("colorsys", seen.append)
    import colorsys, json
    loader = type(colorsys.__loader__).__name__, type(colorsys.__spec__.loader).__name__
    print(len(seen), seen[0] is colorsys, loader[0] == loader[1] != "_Loader", hook.counting())
    hook.set_total(10)
    hook.report(4)
    """
    env = _site_env(HOOK_DIR, SLURM_JOB_ID="9", CDGPC_NODE_PROGRESS_SOCKET=agent.path)
    done = _python(python, code, env)
    assert (done.returncode, done.stderr, done.stdout) == (0, "", "1 True True False\n")
    assert agent.wait(1) == [("9", 4, 10)]


# -- torch's optimizer steps -------------------------------------------------------------------

TRAIN = """
import sys, threading
started = threading.active_count(), "torch" in sys.modules
import torch
hook = sys.modules["_cdgpc_progress_hook"]
model = torch.nn.Linear(4, 1)
g, d = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.Adam(model.parameters())
for _ in range(30):
    g.zero_grad(); model(torch.ones(2, 4)).sum().backward(); g.step(); d.step()
loaders = type(torch.__loader__).__name__, type(torch.__spec__.loader).__name__
print(started, hook.counting(), *loaders)
"""


def test_a_torch_job_reports_its_optimizer_steps(agent: Agent) -> None:
    pytest.importorskip("torch")
    env = _site_env(HOOK_DIR, SLURM_JOB_ID="7", CDGPC_NODE_PROGRESS_SOCKET=agent.path)
    env["CDGPC_PROGRESS_INTERVAL"] = "60"
    done = _python(sys.executable, TRAIN, env)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == "(1, False) True SourceFileLoader SourceFileLoader\n"
    # the first step, then at exit
    assert _by_step(agent.wait(2)) == [("7", 1, None), ("7", 30, None)]


def test_other_local_ranks_and_torch_imported_first(agent: Agent) -> None:
    pytest.importorskip("torch")
    env = _site_env(HOOK_DIR, SLURM_JOB_ID="7", CDGPC_NODE_PROGRESS_SOCKET=agent.path)
    done = _python(sys.executable, TRAIN, env | {"LOCAL_RANK": "1"})
    assert (done.returncode, done.stderr) == (0, "")
    late = """
    import sys, torch
    sys.path.append(sys.argv[-1])
    import _cdgpc_progress_hook as hook
    print(hook.install(), hook.counting())
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    opt.step()
    """
    env = _job_env(SLURM_JOB_ID="8", CDGPC_NODE_PROGRESS_SOCKET=agent.path)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(late), str(HOOK_DIR)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert (done.returncode, done.stderr, done.stdout) == (0, "", "True True\n")
    assert agent.wait(1) == [("8", 1, None)]  # and nothing from LOCAL_RANK 1's job 7


# -- the TaskProlog ----------------------------------------------------------------------------


@pytest.fixture
def run_task_prolog(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., tuple[str, str]]:
    """Run `task_prolog.main` with a config file and a task environment: (stdout, stderr)."""

    def run(config: str = "", argv: list[str] | None = None, **env: str) -> tuple[str, str]:
        for name in list(os.environ):
            if name.startswith("CDGPC_") or name == "PYTHONPATH":
                monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        path = tmp_path / "cdgpc.toml"
        path.write_text(config)
        assert task_prolog.main(["--config", str(path)] if argv is None else argv) == 0
        out = capsys.readouterr()
        return out.out, out.err

    return run


def test_the_task_prolog_appends_the_hook(run_task_prolog: Callable[..., tuple[str, str]]) -> None:
    hook = task_prolog.hook_dir()
    assert hook == HOOK_DIR and (hook / "sitecustomize.py").is_file()
    assert run_task_prolog(PYTHONPATH="/a:/b") == (f"export PYTHONPATH=/a:/b:{hook}\n", "")
    assert run_task_prolog() == (f"export PYTHONPATH={hook}\n", "")
    assert run_task_prolog(PYTHONPATH=f"/a:{hook}") == ("", "")  # never twice
    custom = '[node]\nprogress_socket = "/run/site/progress.sock"\n'
    assert run_task_prolog(custom, PYTHONPATH="/a") == (
        f"export PYTHONPATH=/a:{hook}\nexport CDGPC_NODE_PROGRESS_SOCKET=/run/site/progress.sock\n",
        "",
    )
    default = '[node]\nprogress_socket = "/run/cdgpc/progress.sock"\n'
    assert run_task_prolog(default) == (f"export PYTHONPATH={hook}\n", "")


def test_the_task_prolog_stays_quiet_when_off_or_broken(
    run_task_prolog: Callable[..., tuple[str, str]],
) -> None:
    assert run_task_prolog("[node]\nprogress_hook = false\n", PYTHONPATH="/a") == ("", "")
    assert run_task_prolog(CDGPC_PROGRESS="OFF") == ("", "")
    out, err = run_task_prolog('[node]\nprogress_hook = "maybe"\n')
    assert out == "" and err.count("\n") == 1 and "node.progress_hook" in err
    out, err = run_task_prolog(argv=["--strict"])
    assert out == "" and err.count("\n") == 1 and "usage" in err
    out, err = run_task_prolog(PYTHONPATH="/a\nexport LD_PRELOAD=/x")
    assert out == "" and "line break" in err


# -- the framework callbacks -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "blocked", "install"),
    [
        ("lightning", ("lightning", "lightning.pytorch", "pytorch_lightning"), "lightning"),
        ("transformers", ("transformers",), "transformers"),
        ("keras", ("keras", "tensorflow"), "keras"),
    ],
)
def test_callbacks_import_without_their_framework(
    module: str, blocked: tuple[str, ...], install: str
) -> None:
    code = f"""
    import sys
    for name in {blocked!r}:
        sys.modules[name] = None  # as if not installed
    from slurm_cdgpc.integrations.{module} import CdgpcProgress
    try:
        CdgpcProgress()
    except ImportError as e:
        print(e)
    """
    done = _python(sys.executable, code, _job_env(PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1 and f"(pip install {install})" in done.stdout


def test_the_transformers_callback_reports_step_and_total(
    agent: Agent, fresh_hook: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    transformers = pytest.importorskip("transformers")
    from slurm_cdgpc.integrations.transformers import CdgpcProgress  # noqa: PLC0415

    monkeypatch.setenv("SLURM_JOB_ID", "12")
    monkeypatch.setenv("CDGPC_NODE_PROGRESS_SOCKET", agent.path)
    for name in ("LOCAL_RANK", "SLURM_LOCALID", "CDGPC_PROGRESS", "CDGPC_PROGRESS_INTERVAL"):
        monkeypatch.delenv(name, raising=False)
    callback = CdgpcProgress()
    assert isinstance(callback, transformers.TrainerCallback)
    state = transformers.TrainerState(max_steps=50)
    control = transformers.TrainerControl()
    callback.on_train_begin(None, state, control)
    for step in range(1, 21):
        state.global_step = step
        callback.on_step_end(None, state, control)
    fresh_hook.get_reporter().flush()
    assert _by_step(agent.wait(2)) == [("12", 0, 50), ("12", 20, 50)]


# -- the benchmark -----------------------------------------------------------------------------


def test_the_benchmark_runs_tiny() -> None:
    pytest.importorskip("torch")
    from slurm_cdgpc.bench.progress_hook import bench_progress_hook  # noqa: PLC0415

    result = bench_progress_hook(rounds=1, steps=5, warmup=1, width=8, batch=4, interval_s=0.0)
    assert {
        "step_ms_p50_without",
        "step_ms_p50_with",
        "overhead_pct",
        "post_hook_us",
        "send_us_p50",
        "startup_ms_p50_without",
        "startup_ms_p50_with",
    } <= set(result)
    assert result["reports_received"] >= 1  # the hooked run did report, to the real socket


def test_the_installer_writes_the_task_prolog_with_its_config_only(tmp_path: Path) -> None:
    argv = ["--dest", str(tmp_path), "--python", sys.executable, "--config", "/etc/c.toml"]
    assert install.main([*argv, "--spool-dir", "/var/spool/cdgpc", "--strict"]) == 0
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == [
        "cdgpc-epilog",
        "cdgpc-prolog",
        "cdgpc-prolog-slurmctld",
        "cdgpc-task-prolog",
    ]
    # the PrologSlurmctld has no spool and never --strict: only the config, as given
    assert (tmp_path / "cdgpc-prolog-slurmctld").read_text() == install.render_hook(
        "prolog-slurmctld", sys.executable, ["--config", "/etc/c.toml"]
    )
    text = (tmp_path / "cdgpc-task-prolog").read_text()
    assert text == install.render_hook("task-prolog", sys.executable, ["--config", "/etc/c.toml"])
    assert text.startswith(f"#!{sys.executable} -I\n") and "--strict" not in text
    assert (tmp_path / "cdgpc-task-prolog").stat().st_mode & 0o111
