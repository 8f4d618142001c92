"""The system clock jumps (an NTP step, a mis-set RTC) under cdgpcd and cdgpc-noded.

The machine's clock cannot be moved for one test, so each daemon runs under
`tests.faults.clockshift`, which adds a number of seconds read from a file to that process's
``time.time`` and leaves its monotonic clock alone, as a stepped system clock does.

What should hold: the head's interval runs on the monotonic clock, so a jump neither stalls nor
races the loop; a lease is a wall-clock instant (the head's "now + lease" in the exchange) that
the agent clamps to at most ``max_lease_s`` past its own now, so a head whose clock leaps ahead
cannot hand out a long lease; and an agent whose clock steps back must still fall to the safe
cap within a lease of the head's last exchange.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_cdgpc.localcluster import wait_for as _wait
from tests.faults.cluster import (
    INTERVAL_S,
    JOBS,
    LEASE_S,
    SAFE_MHZ,
    SLACK_S,
    Cluster,
    make_cluster,
    registrar,
)

pytestmark = [pytest.mark.faults, pytest.mark.live]

HOUR_S = 3600.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    yield from make_cluster(tmp_path, f"sqlite:///{tmp_path / 'cdgpc.db'}")


def _shift(path: Path, seconds: float) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{seconds}\n")
    tmp.replace(path)


@pytest.mark.parametrize("step_s", [HOUR_S, -HOUR_S], ids=["ahead", "back"])
def test_head_clock_jumps_by_an_hour(cluster: Cluster, step_s: float) -> None:
    offset = cluster.tmp_path / "head.offset"
    head = cluster.start_head(clock_offset_file=offset)
    meter = cluster.establish()
    jobs = registrar(cluster)
    jobs.register(1)
    start = cluster.status()["last_interval"]["interval"]
    _shift(offset, step_s)
    shifted_s = time.monotonic()
    # every request is signed with a time stamp the other side checks against its own clock
    # (60 s window, 10 s of skew): the agents refuse the head's exchanges, so nothing renews
    # their leases and every GPU falls to the safe cap. The head's API refuses the Prolog's
    # registrations while its clock is ahead (401: spooled) and takes them while it is behind
    # (its replay cache never lets time run backwards).
    jobs.register(2)
    _wait(
        "every GPU at the safe cap",
        lambda: all(max(cluster.locks(n).values()) <= SAFE_MHZ for n in JOBS),
        LEASE_S + 5,
        cluster.logs,
    )
    assert time.monotonic() - shifted_s < LEASE_S + SLACK_S
    assert len(jobs.spool.pending()) == (4 if step_s > 0 else 0)
    time.sleep(2.0)

    _shift(offset, 0.0)  # NTP puts it right
    _wait(
        "both jobs controlled again, by the same cdgpcd",
        lambda: all(cluster.controlled(n) for n in JOBS) and head.proc.poll() is None,
        10,
        cluster.logs,
    )
    # the loop runs on the monotonic clock: it neither stalled nor raced through the jump
    # (a third of its pace at least, on a loaded machine; a loop on the wall clock would stall
    # for the hour stepped back, or spin through the hour leapt); a registration the head
    # takes plans once out of cycle, so each may add one
    intervals = cluster.status()["last_interval"]["interval"] - start
    elapsed_s = time.monotonic() - shifted_s
    most = elapsed_s / INTERVAL_S + 2 + jobs.sent
    assert elapsed_s / INTERVAL_S / 3 <= intervals <= most, (
        intervals,
        elapsed_s,
    )
    name = "clock-jump-head-ahead" if step_s > 0 else "clock-jump-head-back"
    cluster.finish(name, meter, jobs)


def test_agent_clock_steps_back_while_the_head_is_away(cluster: Cluster) -> None:
    offsets = {}
    for name in ("node1", "node2"):  # restart both agents on shiftable clocks
        node = cluster.nodes[name]
        assert node.daemon is not None
        node.daemon.proc.send_signal(signal.SIGTERM)
        node.daemon.proc.wait(timeout=10)
        offsets[name] = cluster.tmp_path / f"{name}.offset"
        cluster.start_agent(name, clock_offset_file=offsets[name])
    head = cluster.start_head()
    meter = cluster.establish()
    jobs = registrar(cluster)

    head.proc.send_signal(signal.SIGSTOP)
    _shift(offsets["node2"], -HOUR_S)
    frozen_s = time.monotonic()
    jobs.register(1)
    _wait(
        "node1 at the safe cap",
        lambda: max(cluster.locks("node1").values()) <= SAFE_MHZ,
        LEASE_S + 5,
        cluster.logs,
    )

    def heal() -> None:
        _shift(offsets["node2"], 0.0)
        head.proc.send_signal(signal.SIGCONT)

    with cluster.failure_recorded("clock-jump-agent-back", meter, jobs, heal=heal):
        _wait(
            "node2 (clock stepped back an hour) at the safe cap",
            lambda: max(cluster.locks("node2").values()) <= SAFE_MHZ,
            LEASE_S + 5,
            cluster.logs,
        )
        # 2 s: the registration the frozen head did not answer
        assert time.monotonic() - frozen_s < LEASE_S + 2.0 + SLACK_S
    heal()
    _wait("both jobs controlled again", lambda: all(cluster.controlled(n) for n in JOBS), 10,
          cluster.logs)  # fmt: skip
    cluster.finish("clock-jump-agent-back", meter, jobs)
