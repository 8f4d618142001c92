"""The demo's bundled trace slice and the pieces of its terminal table."""

from __future__ import annotations

import itertools

import pytest

from slurm_cdgpc.demo.live import JobPace, clock_text
from slurm_cdgpc.demo.trace import SLICE, load_slice
from slurm_cdgpc.gpu.plant import workload_profile


def test_the_bundled_slice_is_what_its_notice_says() -> None:
    jobs = load_slice()
    assert len(jobs) == 40
    assert [j.job_id for j in jobs] == [str(1001 + i) for i in range(40)]
    assert jobs[0].submit_s == 0 and all(
        a.submit_s <= b.submit_s for a, b in itertools.pairwise(jobs)
    )
    for j in jobs:
        assert 1 <= j.gpus <= 8 and 600 <= j.duration_s <= 10800
        assert j.deadline_s >= 1.1 * j.duration_s  # admitted with 10 % slack
        assert workload_profile(j.model).name  # every model has a calibrated profile
    assert "MIT License" in (SLICE.parent / "NOTICE").read_text()


def test_clock_text_and_pace() -> None:
    assert clock_text(0) == "00:00"
    assert clock_text(3 * 3600 + 59 * 60 + 59) == "03:59"
    assert clock_text(-120) == "-00:02"
    assert clock_text(None) == "-"
    pace = JobPace()
    pace.add(10.0, 0)
    assert pace.finish_wall_s(100) is None  # one sample: no pace yet
    pace.add(11.0, 20)
    assert pace.finish_wall_s(100) == pytest.approx(15.0)  # 80 left at 20 per second
    pace.add(11.5, 20)  # no new report since: the older sample stays
    assert pace.finish_wall_s(100) == pytest.approx(15.0)
