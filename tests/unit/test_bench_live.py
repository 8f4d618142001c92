"""``bench exchange`` and ``bench register`` end to end at tiny scale: live servers on loopback.

Smoke tests only: they check that each benchmark runs real agents or a real head, reports the
promised keys, and that every exchange and registration succeeded. No timing is asserted.
"""

from __future__ import annotations

import json

from click.testing import CliRunner

from slurm_cdgpc.cli.bench_live import exchange_cmd, register_cmd


def _json(command: object, *args: str) -> dict[str, object]:
    result = CliRunner().invoke(command, list(args))  # type: ignore[arg-type]
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert isinstance(report, dict)
    return report


def test_exchange_reaches_every_live_agent_and_reports_the_promised_keys() -> None:
    report = _json(
        exchange_cmd, "--nodes", "4", "--gpus-per-node", "2", "--processes", "2",
        "--intervals", "2", "--json",
    )  # fmt: skip
    for key in (
        "nodes", "gpus", "processes", "intervals", "interval_ms_p50", "interval_ms_p99",
        "failures", "exchange_timeout_s", "exchanger_max_in_flight", "refused_setpoints",
        "head_cpu_ms_per_interval", "agents_cpu_ms_per_interval",
    ):  # fmt: skip
        assert key in report, key
    assert (report["nodes"], report["gpus"], report["processes"]) == (4, 8, 2)
    assert report["intervals"] == 2 and report["exchange_timeout_s"] == 2.0
    assert report["failures"] == 0, report["failure_reasons"]
    assert report["refused_setpoints"] == 0
    agents_cpu = report["agents_cpu_ms_per_interval"]
    # measured from the agents' processes (clock ticks: two short intervals may read 0)
    assert isinstance(agents_cpu, float) and agents_cpu >= 0


def test_register_stores_every_job_and_reports_the_promised_keys() -> None:
    report = _json(register_cmd, "--concurrency", "4", "--requests", "8", "--json")
    for key in (
        "concurrency", "requests", "p50_ms", "p99_ms", "max_ms", "errors", "requests_per_s",
        "jobs_in_store", "head_cpu_ms_per_request", "registration_batches", "largest_batch",
    ):  # fmt: skip
        assert key in report, key
    assert (report["concurrency"], report["requests"]) == (4, 8)
    assert report["errors"] == 0, report["error_reasons"]
    assert report["jobs_in_store"] == 8  # every registration reached the store
    batches, largest = report["registration_batches"], report["largest_batch"]
    assert isinstance(batches, int) and isinstance(largest, int)
    assert 1 <= batches <= 8 and 1 <= largest <= 4  # at most one per client waits at a time
