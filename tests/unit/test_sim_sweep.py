"""``cdgpc-admin simulate --sweep``: the same numbers as separate plain runs, resumable, refusing
another definition, and the same on a pool; the job-array seam with stand-in sbatch/squeue."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from slurm_cdgpc.cli.main import cli
from slurm_cdgpc.sim.reporting import REALISTIC, ProgressMix, TimeLimitModel
from slurm_cdgpc.sim.sweep import SweepDefinition, format_seeds, parse_seeds
from slurm_cdgpc.slurm.array import (
    SbatchError,
    array_active,
    array_script,
    submit_array,
    wait_for_array,
)

DATA = Path(__file__).resolve().parent.parent / "data"
SYNTHETIC = DATA / "sim" / "synthetic40.csv"
MIX2 = DATA / "traces" / "chronus_mix2.csv"
#: six jobs a trace: each replay well under a second
LIMIT = ("--limit-jobs", "6")
#: and five-minute intervals: a tenth of a second
SMALL = (*LIMIT, "--interval", "300s")
GRID = {"budget": ("0.45", "6kW"), "policy": ("cdgpc", "max-clock"), "seed": (0, 1)}
SHARES = ("0.5", "1.0")
#: what differs between two replays of the same cell: how long they took
TIMING = {"controller_ms_p50", "wall_s"}


def _run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def _sweep(outdir: Path, *extra: str) -> list[str]:
    return [
        "simulate", "--sweep", str(outdir), "--trace", str(SYNTHETIC), "--trace", str(MIX2),
        *SMALL, "--budget", ",".join(GRID["budget"]), "--policy", ",".join(GRID["policy"]),
        "--seed", "0-1", "--progress-share", ",".join(SHARES), *extra,
    ]  # fmt: skip


def _cells(outdir: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in (outdir / "cells").glob("*.json")}


def _untimed(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in TIMING}


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One sweep (2 traces × 2 budgets × 2 shares × 2 policies × 2 seeds), run in this process."""
    outdir = tmp_path_factory.mktemp("sweep") / "out"
    result = _run(*_sweep(outdir, "--workers", "1", "--json"))
    assert result.exit_code == 0, result.output
    return outdir, json.loads(result.stdout)


def test_the_table_is_what_separate_plain_runs_print(swept: tuple[Path, dict[str, Any]]) -> None:
    outdir, report = swept
    assert report["missing"] == [] and len(report["cells"]) == 32
    plain: dict[tuple[str, str, float, str, int], dict[str, Any]] = {}
    for trace in (SYNTHETIC, MIX2):
        for budget in GRID["budget"]:
            for share in SHARES:
                for policy in GRID["policy"]:
                    for seed in GRID["seed"]:
                        result = _run(
                            "simulate", "--trace", str(trace), *SMALL, "--budget", budget,
                            "--policy", str(policy), "--seed", str(seed),
                            "--progress-share", share, "--json",
                        )  # fmt: skip
                        assert result.exit_code == 0, result.output
                        name = trace.stem.replace("_", "-")
                        canonical = "6000W" if budget == "6kW" else budget
                        plain[(name, canonical, float(share), str(policy), int(seed))] = json.loads(
                            result.stdout
                        )
    by_coordinates = {
        (c["trace"], c["budget"], c["progress_share"], c["policy"], c["seed"]): c
        for c in report["cells"]
    }
    assert by_coordinates.keys() == plain.keys()
    for key, metrics in plain.items():
        cell = by_coordinates[key]
        assert _untimed({k: cell[k] for k in metrics}) == _untimed(metrics), key
    # the sweep's reference replays are real: some cells miss deadlines that max clocks meet
    assert sum(m["violations_induced"] for m in plain.values()) > 0
    rows = {(r["trace"], r["budget"], r["progress_share"], r["policy"]): r for r in report["rows"]}
    assert len(rows) == 16
    for (trace, budget, share, policy), row in rows.items():
        seeds = [plain[(trace, budget, share, policy, s)] for s in (0, 1)]
        maes = [m["power_mae_pct"] for m in seeds if m["power_mae_pct"] is not None]
        assert row["seeds"] == [0, 1]
        assert row["violations"] == sum(m["violations"] for m in seeds)
        assert row["violations_induced"] == sum(m["violations_induced"] for m in seeds)
        assert row["power_mae_pct"] == (max(maes) if maes else None)
        assert row["over_budget_intervals_pct"] == max(
            m["over_budget_intervals_pct"] for m in seeds
        )
        assert row["energy_kwh"] == pytest.approx(sum(m["energy_kwh"] for m in seeds) / 2)
    # the text table: one line per row, in the order trace, budget, share, policy
    text = _run(*_sweep(outdir))
    assert text.exit_code == 0, text.output
    lines = text.stdout.splitlines()
    assert lines[0].split()[:5] == ["trace", "budget", "progress", "policy", "seeds"]
    assert len(lines) == 2 + 16
    first = report["rows"][0]
    assert lines[2].split()[:6] == [
        "synthetic40", "0.45", "0.5", "cdgpc", "0-1", str(first["violations"]),
    ]  # fmt: skip


def test_a_resumed_sweep_runs_only_the_missing_cell(
    swept: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    outdir = tmp_path / "out"
    shutil.copytree(swept[0], outdir)
    before = {p.name: p.stat().st_mtime_ns for p in outdir.glob("*/*") if p.suffix != ".lock"}
    gone = outdir / "cells" / "chronus-mix2_b6000W_share0.5_cdgpc_seed1.json"
    old = json.loads(gone.read_text())
    gone.unlink()
    result = _run(*_sweep(outdir, "--workers", "1"))
    assert result.exit_code == 0, result.output
    assert "32 cells, 31 on disk, 1 to run" in result.stderr
    after = {p.name: p.stat().st_mtime_ns for p in outdir.glob("*/*") if p.suffix != ".lock"}
    changed = {name for name in after if after[name] != before.get(name)}
    assert changed == {gone.name}  # not another cell, not a reference replay
    assert _untimed(json.loads(gone.read_text())) == _untimed(old)


def test_another_definition_in_the_same_directory_is_refused(
    swept: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    outdir = tmp_path / "out"
    shutil.copytree(swept[0], outdir)
    definition = (outdir / "sweep.json").read_text()
    args = _sweep(outdir)
    args[args.index("--seed") + 1] = "0-2"
    result = _run(*args)
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"Error: {outdir} holds another sweep (its seeds differ): use a new directory, "
        "or the definition that started it"
    ]
    assert (outdir / "sweep.json").read_text() == definition
    assert len(list((outdir / "cells").iterdir())) == 32


def test_two_workers_give_the_numbers_of_one(
    swept: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    result = _run(*_sweep(tmp_path / "out", "--workers", "2", "--json"))
    assert result.exit_code == 0, result.output
    pooled = json.loads(result.stdout)
    assert [_untimed(c) for c in pooled["cells"]] == [_untimed(c) for c in swept[1]["cells"]]
    assert pooled["rows"] == swept[1]["rows"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("--policy", "cdgpc,fastest"), "Error: unknown policy 'fastest'"),
        (("--seed", "4-1"), "Error: seed range '4-1' runs backwards"),
        (("--seed", "0,0"), "Error: seed 0 is listed twice"),
        (("--progress-share", "0"), "Error: progress share '0' is not in (0, 1]"),
        (("--progress-share", "1,1.5"), "Error: progress share '1.5' is not in (0, 1]"),
        (("--budget", "0.5,1.2"), "Error: budget '1.2': a bare number is a fraction"),
        (("--trace", "no-such-trace.csv"), "Error: no-such-trace.csv: cannot read the file"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    args = _sweep(tmp_path / "out")
    args[args.index(change[0]) + 1] = change[1]
    result = _run(*args)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.output
    assert not (tmp_path / "out").exists()


def test_without_sweep_lists_and_sweep_options_are_refused() -> None:
    for args, message in [
        (("--seed", "0-4"), "Error: seed '0-4' is not an integer"),
        (("--budget", "0.5,0.6"), "Error: --budget '0.5,0.6': a list needs --sweep"),
        (("--trace", str(MIX2)), "Error: more than one --trace needs --sweep"),
        (("--workers", "2"), "Error: --backend, --workers,"),
    ]:
        result = _run("simulate", "--trace", str(SYNTHETIC), *LIMIT, *args)
        assert result.exit_code == 1
        assert result.output.strip().startswith(message), result.output


@pytest.mark.parametrize("workers", ["1", "2"])
def test_an_interrupted_sweep_leaves_whole_cells_and_resumes(tmp_path: Path, workers: str) -> None:
    outdir = tmp_path / "out"
    args = [
        "simulate", "--sweep", str(outdir), "--trace", str(SYNTHETIC), *LIMIT,
        "--budget", "0.4,0.45,0.5,0.55,0.6", "--policy", "cdgpc",
    ]  # fmt: skip
    main = "from slurm_cdgpc.cli.main import main; main()"
    proc = subprocess.Popen(
        [sys.executable, "-c", main, *args, "--workers", workers],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while not list((outdir / "cells").glob("*.json")) and proc.poll() is None:
        assert time.monotonic() < deadline, "no cell within 60 s"
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0, "the sweep ended before it was interrupted"
    done = _cells(outdir)
    assert 1 <= len(done) < 5, err
    for key, record in done.items():  # every cell file whole
        assert record["key"] == key and record["jobs"] == 6
    result = _run(*args, "--workers", "1")
    assert result.exit_code == 0, result.output
    assert f"5 cells, {len(done)} on disk, {5 - len(done)} to run" in result.stderr
    assert len(_cells(outdir)) == 5


def test_seed_lists_read_back() -> None:
    assert parse_seeds("0-2, 4,7-8") == (0, 1, 2, 4, 7, 8)
    assert format_seeds([8, 0, 1, 2, 4, 7]) == "0-2,4,7-8"
    assert parse_seeds(format_seeds([3, 5, 6])) == (3, 5, 6)


# --- the job-array seam, with stand-ins for sbatch and squeue ---------------------------------


def _program(path: Path, body: str) -> str:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_array_task_i_runs_command_i(tmp_path: Path) -> None:
    commands: Sequence[Sequence[str]] = [["echo", "first task"], ["echo", "it's", "the second"]]
    script = tmp_path / "array.sh"
    script.write_text(array_script(commands, job_name="t", output=tmp_path / "%A_%a.out"))
    out = []
    for task in ("0", "1", "2"):
        env = {**os.environ, "SLURM_ARRAY_TASK_ID": task}
        done = subprocess.run(
            ["bash", str(script)], env=env, capture_output=True, text=True, check=False
        )
        out.append((done.returncode, done.stdout.strip()))
    assert out == [(0, "first task"), (0, "it's the second"), (2, "")]
    assert f"#SBATCH --output={tmp_path}/%A_%a.out" in script.read_text()


def test_submit_array_returns_the_job_id_or_sbatchs_own_words(tmp_path: Path) -> None:
    args = tmp_path / "args"
    ok = _program(tmp_path / "sbatch-ok", f'echo "$@" >{args}; echo "4242;cluster"')
    assert submit_array(tmp_path / "s.sh", 3, sbatch_args=["-p", "cpu"], sbatch=ok) == "4242"
    assert args.read_text().split() == [
        "--parsable",
        "--array=0-2",
        "-p",
        "cpu",
        f"{tmp_path}/s.sh",
    ]
    refused = _program(
        tmp_path / "sbatch-no", 'echo "sbatch: error: invalid partition specified: x" >&2; exit 1'
    )
    with pytest.raises(SbatchError, match="exited 1: sbatch: error: invalid partition"):
        submit_array(tmp_path / "s.sh", 1, sbatch=refused)


def test_an_array_is_active_while_any_task_may_still_run(tmp_path: Path) -> None:
    states = tmp_path / "states"
    squeue = _program(tmp_path / "squeue", f"cat {states}")
    states.write_text("COMPLETED\nRUNNING\nPENDING\n")
    assert array_active("7", squeue=squeue)
    states.write_text("COMPLETED\nFAILED\nCANCELLED\n")
    assert not array_active("7", squeue=squeue)
    gone = _program(
        tmp_path / "squeue-gone",
        'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1',
    )
    assert not array_active("7", squeue=gone)
    polls = iter([True, True, False])
    slept: list[float] = []
    wait_for_array("7", poll_s=2.0, active=lambda _: next(polls), sleep=slept.append)
    assert slept == [2.0, 2.0]


def test_a_mix_sweep_gives_the_plain_runs_numbers_and_keeps_its_time_limit_model(
    tmp_path: Path,
) -> None:
    outdir = tmp_path / "out"
    args = [
        "simulate", "--sweep", str(outdir), "--trace", str(MIX2), *SMALL, "--budget", "0.45",
        "--policy", "cdgpc", "--seed", "0", "--progress-mix", "realistic",
        "--progress-mix", "time-limit=1", "--time-limit-model", "uniform:1.5:2", "--workers", "1",
    ]  # fmt: skip
    result = _run(*args, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    cells = {c["progress_mix"]: c for c in report["cells"]}
    assert set(cells) == {str(REALISTIC), "time-limit=1.0"}
    assert cells[str(REALISTIC)]["key"] == "chronus-mix2_b0.45_progress0.2-0.6-0.2-0.0_cdgpc_seed0"
    assert cells[str(REALISTIC)]["progress_share"] is None
    assert cells["time-limit=1.0"]["progress_share"] == 0.0  # --progress-share 0 by another name
    plain = _run(
        "simulate", "--trace", str(MIX2), *SMALL, "--budget", "0.45", "--policy", "cdgpc",
        "--seed", "0", "--progress-mix", "realistic", "--time-limit-model", "uniform:1.5:2",
        "--json",
    )  # fmt: skip
    assert plain.exit_code == 0, plain.output
    record = cells[str(REALISTIC)]
    assert {k: record[k] for k in json.loads(plain.stdout)} | {"controller_ms_p50": 0} == (
        json.loads(plain.stdout) | {"controller_ms_p50": 0}
    )
    # another time-limit model is another sweep
    args[args.index("--time-limit-model") + 1] = "uniform:2:4"
    refused = _run(*args)
    assert refused.exit_code == 1
    assert "(its time_limit_model differ)" in refused.output.strip().splitlines()[0]


def test_a_definition_from_before_mixes_reads_the_same_with_the_same_keys() -> None:
    old = {
        "version": 1,
        "traces": [{"name": "t", "path": "/t.csv", "sha256": "0" * 64}],
        "trace_format": None,
        "budgets": ["0.7"],
        "progress_shares": [0.5, 1.0],
        "policies": ["cdgpc"],
        "seeds": [0],
        "limit_jobs": None,
        "fleet": None,
        "interval_s": 60.0,
    }
    definition = SweepDefinition.from_dict(old)
    assert definition.progress_mixes == (ProgressMix.of_share(0.5), ProgressMix())
    assert definition.time_limits == TimeLimitModel()
    assert [c.key for c in definition.cells()] == [
        "t_b0.7_share0.5_cdgpc_seed0",
        "t_b0.7_share1.0_cdgpc_seed0",
    ]
    assert SweepDefinition.from_dict(definition.as_dict()) == definition


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ("--progress-mix", "reported=0.5,steps=0.4"),
            "Error: progress mix 'reported=0.5,steps=0.4': the shares sum to 0.9, not 1",
        ),
        (("--progress-mix", "all"), "Error: progress mix item 'all': use SOURCE=SHARE"),
        (
            ("--progress-share", "0.5", "--progress-mix", "realistic"),
            "Error: give --progress-share or --progress-mix, not both",
        ),
        (("--time-limit-model", "uniform:2"), "Error: time-limit model 'uniform:2': use"),
    ],
)
def test_a_bad_mix_or_time_limit_model_is_one_line(
    tmp_path: Path, extra: tuple[str, ...], message: str
) -> None:
    for sweep in (("--sweep", str(tmp_path / "out")), ()):
        result = _run("simulate", *sweep, "--trace", str(SYNTHETIC), *LIMIT, *extra)
        assert result.exit_code == 1
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(message), result.output
    assert not (tmp_path / "out").exists()
