"""``bench slow-headers`` end to end at tiny scale: a live head, attacked, and registrations.

A smoke test only: the benchmark runs a real head, holds the attacking connections it says it
holds, is refused at the head's bound, and every registration, quiet or attacked, succeeded.
No timing is asserted.
"""

from __future__ import annotations

import json

from click.testing import CliRunner

from slurm_cdgpc.cli.bench_live import slow_headers_cmd


def test_slow_headers_attacks_a_live_head_and_registers_every_job() -> None:
    args = ["--requests", "8", "--connections", "4", "--chunk-bytes", "3000", "--period-s",
            "0.02", "--warmup-s", "0.5", "--json"]  # fmt: skip
    result = CliRunner().invoke(slow_headers_cmd, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    for key in (
        "quiet_p50_ms", "quiet_p99_ms", "attack_p50_ms", "attack_p99_ms", "attack_connections",
        "per_host_connections", "attack_held_open_min", "attack_held_open_mean",
        "attack_refused_431", "head_header_block_bytes", "head_cpu_s",
    ):  # fmt: skip
        assert key in report, key
    assert report["quiet_errors"] == 0, report["quiet_error_reasons"]
    assert report["attack_errors"] == 0, report["attack_error_reasons"]
    assert report["jobs_in_store"] == 16  # both rounds reached the store
    assert report["per_host_connections"] == 64  # cdgpcd's bound on one host (256 / 4)
    assert report["attack_connections"] == 4 and 1 <= report["attack_held_open_min"] <= 4
    # 3000 bytes every 20 ms on blocks begun 4 KiB short of the bound: each is refused
    assert report["attack_refused_431"] >= 4
