"""`cdgpc-admin bench faults` on hand-made evidence: newest wins, nothing is invented."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_cdgpc.bench.faults import (
    EvidenceError,
    load_evidence,
    render_text,
    summarise,
    summarise_dir,
)
from slurm_cdgpc.cli.bench_faults import faults_cmd
from tests.evidence import record


def _write(directory: Path, name: str, *records: dict[str, object], extra: str = "") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in records]
    (directory / name).write_text("\n".join(lines) + "\n" + extra)


def _attack(name: str, t_s: float, **fields: object) -> dict[str, object]:
    return {"kind": "attack", "name": name, "t_s": t_s, **fields}


def test_the_newest_record_of_each_name_wins_whatever_the_file_order(tmp_path: Path) -> None:
    # the newer run's file sorts first: time, not file order, decides
    _write(tmp_path, "a.jsonl", _attack("forged:x", 200.0, tried=3, refused=3))
    _write(tmp_path, "b.jsonl", _attack("forged:x", 100.0, tried=3, refused=1))
    newest, unreadable = load_evidence(tmp_path)
    assert unreadable == 0
    assert newest[("attack", "forged:x")]["refused"] == 3
    attacks = summarise(newest)["attacks"]
    assert attacks["classes"]["forged"] == {
        "records": 1,
        "tried": 3,
        "refused": 3,
        "accepted": 0,
        "state_changed": 0,
    }
    assert attacks["accepted_in"] == []


def test_attack_classes_add_up_and_acceptances_are_named(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "1.jsonl",
        _attack("forged:head POST /v1/budget", 1.0, tried=3, refused=3, state_changed=0),
        _attack("forged:agent POST /v1/exchange", 1.0, tried=3, refused=3, state_changed=0),
        _attack("replayed:agent POST /v1/exchange", 1.0, tried=1, refused=1, state_changed=0),
        # no "accepted" field: tried - refused
        _attack("replayed:to another node", 1.0, tried=2, refused=1, state_changed=1),
        _attack("injection:urls", 1.0, tried=4, refused=4, accepted=0, state_changed=0),
    )
    summary = summarise_dir(tmp_path)
    attacks = summary["attacks"]
    assert attacks["classes"]["forged"]["tried"] == 6
    assert attacks["classes"]["forged"]["records"] == 2
    assert attacks["classes"]["replayed"] == {
        "records": 2,
        "tried": 3,
        "refused": 2,
        "accepted": 1,
        "state_changed": 1,
    }
    assert (attacks["tried"], attacks["refused"], attacks["accepted"]) == (13, 12, 1)
    assert attacks["accepted_in"] == ["replayed:to another node"]
    assert "ACCEPTED: replayed:to another node" in render_text(summary)


def test_missing_kinds_and_fields_are_absent_never_invented(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "1.jsonl",
        {"kind": "fault", "name": "head-sigkill", "t_s": 1.0, "injected": 1, "survived": 1},
        {"kind": "fuzz", "name": "comment", "t_s": 1.0, "cases": 1500, "unhandled": 0},
    )
    summary = summarise_dir(tmp_path)
    assert summary["absent"] == ["attack", "soak", "takeover"]
    assert summary["attacks"] is None and summary["soak"] is None and summary["takeover"] is None
    faults = summary["faults"]
    assert (faults["injected"], faults["survived"]) == (1, 1)
    assert faults["worst_overshoot_pct"] is None and faults["registrations_sent"] is None
    text = render_text(summary)
    assert "worst overshoot absent" in text and "absent: attack, soak, takeover" in text


def test_faults_fuzz_soak_and_takeover_figures(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "1.jsonl",
        {
            "kind": "fault",
            "name": "frozen-head",
            "t_s": 1.0,
            "injected": 1,
            "survived": 1,
            "worst_overshoot_pct": 2.5,
            "overshoot_s": 1.2,
            "registrations_sent": 100,
            "registrations_stored": 100,
        },
        {
            "kind": "fault",
            "name": "frozen-agent",
            "t_s": 1.0,
            "injected": 1,
            "survived": 0,
            "worst_overshoot_pct": 7.0,
            "overshoot_s": 0.5,
            "registrations_sent": 50,
            "registrations_stored": 49,
        },
        {"kind": "fuzz", "name": "comment", "t_s": 1.0, "cases": 1500, "unhandled": 0},
        {"kind": "fuzz", "name": "config", "t_s": 1.0, "cases": 1000, "unhandled": 2},
        {
            "kind": "soak",
            "name": "1000-nodes",
            "t_s": 1.0,
            "nodes": 1000,
            "gpus": 8000,
            "sim_minutes": 60,
            "rss_start_mb": 100.0,
            "rss_end_mb": 112.5,
        },
        {"kind": "takeover", "name": "a", "t_s": 1.0, "kills": 2, "takeover_s": [1.0, 3.0]},
        {"kind": "takeover", "name": "b", "t_s": 1.0, "kills": 1, "takeover_s": [2.0]},
    )
    summary = summarise_dir(tmp_path)
    faults = summary["faults"]
    assert (faults["injected"], faults["survived"], faults["not_survived"]) == (
        2,
        1,
        ["frozen-agent"],
    )
    assert (faults["worst_overshoot_pct"], faults["worst_overshoot_s"]) == (7.0, 0.5)
    assert faults["worst_overshoot_in"] == "frozen-agent" and faults["longest_overshoot_s"] == 1.2
    assert (faults["registrations_sent"], faults["registrations_stored"]) == (150, 149)
    assert summary["fuzz"]["cases"] == 2500 and summary["fuzz"]["unhandled"] == 2
    run = summary["soak"]["runs"]["1000-nodes"]
    assert (run["rss_start_mb"], run["rss_end_mb"], run["rss_growth_mb"]) == (100.0, 112.5, 12.5)
    assert summary["takeover"] == {"kills": 3, "count": 3, "p50_s": 2.0, "max_s": 3.0}
    assert summary["absent"] == ["attack"]


def test_unreadable_lines_are_counted_and_skipped(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "1.jsonl",
        {"kind": "fuzz", "name": "units", "t_s": 1.0, "cases": 10, "unhandled": 0},
        {"kind": "rumour", "name": "x", "t_s": 1.0},
        {"kind": "fuzz", "name": 5, "t_s": 1.0},
        {"kind": "fuzz", "name": "no time"},
        extra='{"kind": "fuzz", "name": "cut sh',
    )
    summary = summarise_dir(tmp_path)
    assert summary["unreadable_lines"] == 4
    assert summary["fuzz"]["targets"] == {"units": {"cases": 10, "unhandled": 0}}


@pytest.mark.parametrize("content", [None, "", "\n\n{broken\n"])
def test_no_evidence_is_a_one_line_error_with_the_way_out(
    tmp_path: Path, content: str | None
) -> None:
    if content is not None:
        (tmp_path / "1.jsonl").write_text(content)
    with pytest.raises(EvidenceError, match="pytest -m 'faults or security'"):
        summarise_dir(tmp_path / "missing" if content is None else tmp_path)


def test_reads_what_the_tests_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDGPC_EVIDENCE_DIR", str(tmp_path))
    record("attack", "forged:head GET /v1/jobs", tried=3, refused=3, state_changed=0)
    record("takeover", "kill-leader", kills=1, takeover_s=[4.5])
    result = CliRunner().invoke(faults_cmd, ["--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["evidence_dir"] == str(tmp_path)
    assert summary["attacks"]["classes"]["forged"]["refused"] == 3
    assert summary["takeover"]["max_s"] == 4.5


def test_the_command_prints_text_or_json_and_refuses_an_empty_directory(tmp_path: Path) -> None:
    _write(tmp_path / "ev", "1.jsonl", _attack("expired:x", 1.0, tried=2, refused=2))
    text = CliRunner().invoke(faults_cmd, ["--evidence-dir", str(tmp_path / "ev")])
    assert text.exit_code == 0 and "expired: 2/2 refused, 0 accepted" in text.output
    as_json = CliRunner().invoke(faults_cmd, ["--evidence-dir", str(tmp_path / "ev"), "--json"])
    assert json.loads(as_json.output)["attacks"]["refused"] == 2
    empty = CliRunner().invoke(faults_cmd, ["--evidence-dir", str(tmp_path / "none")])
    assert empty.exit_code == 1
    [line] = empty.output.strip().splitlines()
    assert line.startswith("Error: no evidence in") and "pytest -m 'faults or security'" in line
