"""The PrologSlurmctld ``cdgpc-prolog-slurmctld``: ask cdgpcd whether a starting job would meet
its deadline (``POST /v1/admission``) and write the verdict in the job's AdminComment.

Bounded, one syslog line per job, exit 0 whatever happens (head away, slow or refusing,
scontrol failing, anything malformed) unless ``[admission] enforce`` is on and the verdict is
"infeasible". Standard library and this package alone, never `agent/` or `coordinator/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Admission at job start"; tests:
`tests/unit/test_admission.py`, `tests/integration/test_slurm_e2e.py`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import syslog
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from slurm_cdgpc.config import load_config
from slurm_cdgpc.errors import CdgpcError, InputError, one_line
from slurm_cdgpc.slurm.comment import effective_deadline, parse_comment
from slurm_cdgpc.slurm.env import read_hook_env
from slurm_cdgpc.slurm.scontrol import (
    SCONTROL,
    gpu_count,
    parse_show_job,
    set_admin_comment,
    show_job,
)
from slurm_cdgpc.slurm.squeue import expand_hostlist
from slurm_cdgpc.transport.credentials import signer_from_config
from slurm_cdgpc.transport.http import HeadClient

ADMISSION_PATH: Final = "/v1/admission"
DEFAULT_TIMEOUT_S: Final = 1.0
DEFAULT_BUDGET_S: Final = 3.0
#: past the budget by this much, the backstop timer ends the hook (exit 0: the job starts)
BACKSTOP_MARGIN_S: Final = 0.5
#: the verdict that ``[admission] enforce`` turns into a failed PrologSlurmctld
INFEASIBLE: Final = "infeasible"
PREFIX: Final = "cdgpc: "

Emit = Callable[[int, str], None]
Ask = Callable[[Mapping[str, object]], Mapping[str, object]]


@dataclass(frozen=True)
class AdmissionSettings:
    """How the hook runs; the installed wrapper (`slurm_cdgpc.slurm.install`) fixes them."""

    config_path: Path | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    budget_s: float = DEFAULT_BUDGET_S
    scontrol: Path = SCONTROL


def request_body(environ: Mapping[str, str], show_line: str, *, now_s: float) -> dict[str, object]:
    """The ``POST /v1/admission`` body from the PrologSlurmctld's environment (job id, user,
    ``SLURM_JOB_NODELIST``, ``SLURM_JOB_COMMENT``) and ``scontrol show job -o``'s line (its
    GPUs, submit time, time limit, ``--deadline``); `InputError` (one line) when the job is
    not one to judge (no GPUs, not a job's hook)."""
    env = read_hook_env(environ)
    nodes = expand_hostlist(environ.get("SLURM_JOB_NODELIST", ""))
    if not nodes:
        raise InputError("SLURM_JOB_NODELIST is empty")
    gpus = gpu_count(show_line)
    if not gpus:
        raise InputError("asks for no GPUs: nothing to judge")
    times = parse_show_job(show_line)
    request = parse_comment(env.comment)  # malformed: InputError (job_submit.lua refuses it)
    deadline = effective_deadline(
        request,
        submit_s=times.submit_s if times.submit_s is not None else now_s,
        slurm_deadline_s=times.deadline_s,
        start_s=times.start_s,
        time_limit_s=times.time_limit_s,
    )
    body: dict[str, object] = {"job_id": env.job_id, "user": env.user, "gpus": gpus}
    body["nodes"] = list(dict.fromkeys(nodes))
    if deadline is not None:
        body["deadline_s"] = deadline.deadline_s
    if request.iterations_total is not None:
        body["iterations_total"] = request.iterations_total
    if times.time_limit_s is not None and times.time_limit_s > 0:
        body["time_limit_s"] = times.time_limit_s
    return body


def admin_comment(answer: Mapping[str, object]) -> str:
    """``cdgpc: <verdict>: <reason>``, as `scontrol show job` shows it."""
    return f"{PREFIX}{answer.get('verdict')}: {answer.get('reason')}"


def run(
    settings: AdmissionSettings,
    environ: Mapping[str, str],
    *,
    emit: Emit,
    ask: Ask,
    enforce: bool,
    now_s: float | None = None,
) -> int:
    """One run: ask the head (``ask``), write the verdict, emit one line. 0 unless ``enforce``
    and the verdict is "infeasible"."""
    started_s = time.monotonic()
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "?"
    status = 0
    try:
        line = show_job(job, scontrol=settings.scontrol, timeout_s=settings.timeout_s)
        if line is None:
            raise InputError("scontrol show job failed: no verdict")
        body = request_body(environ, line, now_s=time.time() if now_s is None else now_s)
        answer = ask(body)
        verdict = str(answer.get("verdict"))
        text = admin_comment(answer)
        try:
            set_admin_comment(job, text, scontrol=settings.scontrol, timeout_s=settings.timeout_s)
            note = ""
        except CdgpcError as e:
            note = f" (AdminComment not written: {e})"
        if enforce and verdict == INFEASIBLE:
            status = 1
            note += "; [admission] enforce: the job is requeued, or cancelled if not requeueable"
        message, priority = f"job {job}: {text}{note}", syslog.LOG_INFO
    except CdgpcError as e:
        message, priority = f"job {job}: no verdict, the job starts: {e}", syslog.LOG_WARNING
    elapsed_ms = (time.monotonic() - started_s) * 1000.0
    emit(priority, f"{one_line(message, 1000)} [{elapsed_ms:.0f} ms]")
    return status


def head_asker(settings: AdmissionSettings, environ: Mapping[str, str]) -> tuple[Ask, bool]:
    """``POST /v1/admission`` to the head of the config, within the budget, and whether the site
    enforces the verdict; `CdgpcError` (one line) when no request can be made."""
    config = load_config(settings.config_path, env=environ)
    client = HeadClient(
        config.head.url,
        signer_from_config(config, settings.timeout_s),
        timeout_s=settings.timeout_s,
        until_s=time.monotonic() + settings.budget_s,
    )

    def ask(body: Mapping[str, object]) -> Mapping[str, object]:
        answer = client.post(ADMISSION_PATH, body)
        if not isinstance(answer, dict) or not isinstance(answer.get("verdict"), str):
            raise InputError(f"the head's answer has no verdict: {answer!r:.80}")
        return answer

    return ask, config.admission.enforce


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cdgpc-prolog-slurmctld",
        description="Slurm PrologSlurmctld of slurm-cdgpc: the deadline verdict at job start.",
    )
    parser.add_argument("--config", type=Path, help="cdgpc.toml (default: CDGPC_CONFIG or /etc)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="per request, s")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="whole hook, s")
    return parser


def settings_from_args(argv: Sequence[str]) -> AdmissionSettings:
    args = _parser().parse_args(list(argv))
    if not 0 < args.timeout <= args.budget <= 60:
        raise InputError("need 0 < --timeout <= --budget <= 60 seconds")
    return AdmissionSettings(config_path=args.config, timeout_s=args.timeout, budget_s=args.budget)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``cdgpc-prolog-slurmctld``: never raises; 0 unless the site enforces and
    the head said "infeasible". One syslog line (ident ``cdgpc-prolog-slurmctld``, facility
    daemon) per job, also on stderr, which slurmctld logs when the hook fails."""
    syslog.openlog("cdgpc-prolog-slurmctld", syslog.LOG_PID, syslog.LOG_DAEMON)

    def emit(priority: int, line: str) -> None:
        syslog.syslog(priority, line)
        print(line, file=sys.stderr)

    job = os.environ.get("SLURM_JOB_ID", "?")
    try:
        settings = settings_from_args(sys.argv[1:] if argv is None else argv)

        def overrun(_signum: int, _frame: object) -> None:
            emit(
                syslog.LOG_ERR,
                f"job {job}: past its {settings.budget_s:g} s budget; the job starts",
            )
            os._exit(0)

        signal.signal(signal.SIGALRM, overrun)
        signal.setitimer(signal.ITIMER_REAL, settings.budget_s + BACKSTOP_MARGIN_S)
        try:
            ask, enforce = head_asker(settings, os.environ)
        except CdgpcError as e:
            emit(syslog.LOG_WARNING, f"job {job}: no verdict, the job starts: no client: {e}")
            return 0
        return run(settings, os.environ, emit=emit, ask=ask, enforce=enforce)
    except SystemExit as e:  # argparse: a wrong wrapper; say so, let the job start
        emit(syslog.LOG_ERR, f"bad arguments {argv!r}: exit {e.code}")
        return 0
    except Exception as e:  # a bug must not stop a job
        emit(syslog.LOG_ERR, f"internal error: {type(e).__name__}: {one_line(str(e))}")
        return 0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
