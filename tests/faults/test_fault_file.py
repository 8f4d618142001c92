"""The simulated backend's fault file: what the live fault tests inject through a running agent."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from slurm_cdgpc.errors import GpuError, GpuLostError, InputError
from slurm_cdgpc.gpu.simulated import ManualClock, install_faults, parse_faults, simulated_gpus

pytestmark = pytest.mark.faults


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_rules_parse_with_comments_and_wildcards() -> None:
    assert parse_faults("# none\n\n") == {}
    assert parse_faults("1 fail_clock_writes  # GPU 1\n* garbage_power\n1 fail_reads\n") == {
        1: frozenset({"fail_clock_writes", "fail_reads"}),
        None: frozenset({"garbage_power"}),
    }
    for bad in ("1 melt", "x fail_reads", "1", "1 fail_reads now", "-1 fail_reads"):
        with pytest.raises(InputError, match="line 1"):
            parse_faults(bad)


def test_gpus_follow_the_file_as_it_is_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "faults"
    gpus = simulated_gpus("A100", 2, seed=1, time_source=ManualClock())
    install_faults(gpus, path)  # absent: nothing injected
    gpu0, gpu1 = gpus[0], gpus[1]
    gpu1.set_locked_clocks(1005)

    _write(path, "1 fail_clock_writes\n0 garbage_power\n")
    with pytest.raises(GpuError, match="injected"):
        gpu1.set_locked_clocks(1200)
    with pytest.raises(GpuError, match="injected"):
        gpu1.reset_locked_clocks()
    assert gpu1.locked is not None and gpu1.locked.graphics_max_mhz == 1005  # nothing changed
    readings = [gpu0.read().power_w for _ in range(4)]
    assert math.isnan(readings[0]) and readings[1:] == [0.0, -1.0, 4_294_967.295]
    assert gpu1.read().power_w > 0  # only GPU 0 reports garbage

    _write(path, "* fail_reads\n")
    with pytest.raises(GpuLostError):
        gpu0.read()
    gpu1.set_locked_clocks(1200)  # writes work again

    _write(path, "1 not-a-mode\n")  # a bad rewrite keeps the rules in force
    with pytest.raises(GpuLostError):
        gpu1.read()
    path.unlink()  # gone: healed
    assert gpu0.read().power_w > 0


def test_a_malformed_file_refuses_to_start(tmp_path: Path) -> None:
    path = tmp_path / "faults"
    path.write_text("0 explode\n")
    with pytest.raises(InputError, match="simulated faults file"):
        install_faults(simulated_gpus("A100", 1, seed=1, time_source=ManualClock()), path)
