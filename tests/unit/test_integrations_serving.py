"""`LatencyReporter` against a real `ProgressServer` on a real Unix socket."""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_cdgpc.agent.progress import ProgressServer
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.integrations import progress_hook, serving
from slurm_cdgpc.integrations.serving import LatencyReporter

REPO = Path(__file__).resolve().parents[2]
PERIOD_S = 0.3
#: job_id, step, total, uid, latency_s, rate
Record = tuple[str, int, int | None, int, float | None, float | None]


class Agent:
    """A real `ProgressServer` on a short socket path, and what it recorded."""

    def __init__(self, path: Path) -> None:
        self.records: list[Record] = []
        self.server = ProgressServer(path, self._record, timeout_s=0.5)
        self.path = path

    def _record(
        self,
        job_id: str,
        step: int,
        total: int | None,
        uid: int,
        *,
        latency_s: float | None = None,
        rate: float | None = None,
    ) -> None:
        if job_id == "666":
            raise InputError("job 666: refused by the agent")
        self.records.append((job_id, step, total, uid, latency_s, rate))

    def wait(self, count: int, timeout_s: float = 5.0) -> list[Record]:
        deadline = time.monotonic() + timeout_s
        while len(self.records) < count:
            if time.monotonic() > deadline:
                pytest.fail(f"{count} report(s) expected, got {self.records}")
            time.sleep(0.01)
        return list(self.records)


@contextlib.contextmanager
def running_agent() -> Iterator[Agent]:
    """An `Agent` serving its socket until the block ends."""
    with tempfile.TemporaryDirectory(prefix="cdgpc-") as d:  # socket paths: 107 bytes at most
        found = Agent(Path(d) / "p.sock")
        found.server.start()
        try:
            yield found
        finally:
            found.server.close()


@pytest.fixture
def agent() -> Iterator[Agent]:
    with running_agent() as found:
        yield found


@pytest.fixture
def reporters() -> Iterator[list[LatencyReporter]]:
    """Reporters closed after the test, so that no sending thread outlives it."""
    made: list[LatencyReporter] = []
    yield made
    for reporter in made:
        reporter.close()


def _reporter(made: list[LatencyReporter], path: Path, **kwargs: Any) -> LatencyReporter:
    options: dict[str, Any] = {"period_s": PERIOD_S, "job_id": "77", "path": path, "env": {}}
    reporter = LatencyReporter(**(options | kwargs))
    made.append(reporter)
    return reporter


def test_the_percentile_count_and_rate_of_each_window_reach_the_agent(
    agent: Agent, reporters: list[LatencyReporter]
) -> None:
    reporter = _reporter(reporters, agent.path)
    latencies = [ms / 1000 for ms in range(1, 101)]
    random.Random(1).shuffle(latencies)
    start_s = time.monotonic()
    for latency_s in latencies:
        reporter.observe(latency_s)
    ((job, step, total, uid, latency_s, rate),) = agent.wait(1)
    assert (job, step, total, uid, latency_s) == ("77", 100, None, os.getuid(), 0.099)
    assert rate is not None
    assert 100 / (time.monotonic() - start_s) <= rate <= 100 / (PERIOD_S * 0.99)
    # a window without requests: the count stays, the rate is 0 and there is no latency
    assert agent.wait(2)[1] == ("77", 100, None, os.getuid(), None, 0.0)


def test_the_percentile_is_the_constructors(agent: Agent, reporters: list[LatencyReporter]) -> None:
    reporter = _reporter(reporters, agent.path, percentile=50)
    for ms in (40, 10, 30, 20):
        reporter.observe(ms / 1000)
    assert agent.wait(1)[0][4] == 0.02  # nearest rank: the 2nd of 4


def test_cdgpc_progress_off_turns_it_off_as_it_does_the_hook(
    agent: Agent, reporters: list[LatencyReporter]
) -> None:
    hook: Any = progress_hook()
    assert (serving.SWITCH_ENV, serving.OFF_VALUES) == (hook.SWITCH_ENV, hook.OFF_VALUES)
    for value in [*hook.OFF_VALUES, " OFF "]:
        env = {"SLURM_JOB_ID": "77", "CDGPC_PROGRESS": value}
        off = _reporter(reporters, agent.path, job_id=None, env=env)
        assert not off.enabled
        off.observe(0.1)
        assert off.served == 0
    assert not _reporter(reporters, agent.path, job_id=None, env={}).enabled  # not in a job
    on = _reporter(reporters, agent.path, job_id=None, env={"SLURM_JOB_ID": "77"})
    on.observe(0.1)
    assert on.served == 1
    assert agent.wait(1)[0][:2] == ("77", 1)


def test_an_absent_or_refusing_agent_never_reaches_the_serving_loop(
    agent: Agent, reporters: list[LatencyReporter], caplog: pytest.LogCaptureFixture
) -> None:
    absent = _reporter(reporters, agent.path.with_name("none.sock"), period_s=0.05)
    refused = _reporter(reporters, agent.path, period_s=0.05, job_id="666")
    for reporter in (absent, refused):
        for latency in (0.1, float("nan"), -1.0, "slow"):
            reporter.observe(latency)  # type: ignore[arg-type]
        assert reporter.served == 1  # only the number >= 0 counts
    deadline = time.monotonic() + 5
    while caplog.text.count("latency reports to the node agent") < 2:
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.01)
    time.sleep(0.2)  # a few more failed windows: each reporter warned once
    assert caplog.text.count("latency reports to the node agent") == 2
    assert "refused by the agent" in caplog.text and "none.sock" in caplog.text
    assert agent.records == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"percentile": 0}, "percentile: must be in (0, 100], got 0"),
        ({"percentile": 100.5}, "percentile: must be in (0, 100]"),
        ({"period_s": 0}, "period_s: must be positive"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InputError) as caught:
        LatencyReporter(**kwargs)
    assert str(caught.value).startswith(message)
