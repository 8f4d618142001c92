"""The slurmd Prolog and Epilog: register a starting job with cdgpcd, deregister a finished one.

Bounded, exit 0 whatever happens, spooled when the head is away. What they import pulls in the
standard library and this package alone, never `agent/` or `coordinator/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "The Prolog and Epilog"; tests:
`tests/unit/test_slurm_hooks.py`, `tests/security/test_slow_peers.py`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import syslog
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

from slurm_cdgpc.config import agent_url, load_config
from slurm_cdgpc.errors import CdgpcError, InputError, SoftError
from slurm_cdgpc.slurm.comment import (
    Deadline,
    deadline_warnings,
    effective_deadline,
    parse_comment,
)
from slurm_cdgpc.slurm.env import MAX_GPU_INDEX, HookEnv, hook_node, read_hook_env
from slurm_cdgpc.slurm.scontrol import SCONTROL, JobTimes, job_times
from slurm_cdgpc.slurm.spool import DEFAULT_SPOOL_DIR, JobsClient, Spool, SpoolError
from slurm_cdgpc.transport.credentials import signer_from_config
from slurm_cdgpc.transport.http import HeadClient, HeadRefusedError
from slurm_cdgpc.wire.names import MAX_JOB_NAME
from slurm_cdgpc.wire.protocol import HOLD_PATH, MIG_PATH, RELEASE_PATH

logger = logging.getLogger(__name__)

KINDS: Final = ("prolog", "epilog")
DEFAULT_TIMEOUT_S: Final = 1.0
DEFAULT_BUDGET_S: Final = 2.0
#: how long past its budget a hook runs before the backstop timer ends the step under way
BACKSTOP_MARGIN_S: Final = 0.5
#: statuses after which a request is spooled and retried later (auth, clock skew, the head's
#: database); any other refusal (400: malformed) cannot heal and is only logged
_RETRYABLE: Final = frozenset({401, 403, 408, 429})

Emit = Callable[[int, str], None]


@dataclass(frozen=True)
class HookSettings:
    """How a hook runs; the installed wrapper (`slurm_cdgpc.slurm.install`) fixes them."""

    config_path: Path | None = None
    spool_dir: Path = DEFAULT_SPOOL_DIR
    timeout_s: float = DEFAULT_TIMEOUT_S
    budget_s: float = DEFAULT_BUDGET_S
    strict: bool = False
    scontrol: Path = SCONTROL
    #: when this run's budget ends (`time.monotonic`), set by `run`: no request runs past it
    until_s: float | None = None


class HookOverrunError(SoftError):
    """The hook ran past its budget and margin: the backstop timer ended the step under way."""


@dataclass(frozen=True)
class HookOutcome:
    """What a hook did: ``registered``, ``deregistered``, ``spooled``, ``skipped`` or ``failed``;
    ``line`` is its syslog line."""

    action: str
    line: str
    priority: int = syslog.LOG_INFO

    @property
    def failed(self) -> bool:
        return self.action == "failed"


def _retryable(e: CdgpcError) -> bool:
    if isinstance(e, HeadRefusedError):
        return e.status in _RETRYABLE or e.status >= 500
    return not isinstance(e, InputError)  # unavailable head, MUNGE down: SoftError


def _until(start_s: float, budget_s: float) -> float:
    return start_s + budget_s


def _format_deadline(deadline: Deadline | None) -> str:
    if deadline is None:
        return "no deadline"
    moment = datetime.fromtimestamp(deadline.deadline_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"deadline {moment} ({deadline.source})"


def registration(
    env: HookEnv,
    *,
    now_s: float,
    times: Callable[[str], JobTimes | None],
) -> tuple[dict[str, object], list[str]]:
    """The ``POST /v1/jobs`` body for this node, and notes for the log line."""
    notes: list[str] = []
    try:
        request = parse_comment(env.comment)
    except InputError as e:
        notes.append(f"comment ignored: {e}")
        request = parse_comment(None)
    known = times(env.job_id) or JobTimes()
    deadline = effective_deadline(
        request,
        submit_s=known.submit_s if known.submit_s is not None else now_s,
        slurm_deadline_s=known.deadline_s,
        start_s=known.start_s,
        time_limit_s=known.time_limit_s,
    )
    payload: dict[str, object] = {
        "job_id": env.job_id,
        "user": env.user,
        "node": env.node,
        "gpus": list(env.gpus),
    }
    if deadline is not None:
        payload["deadline_s"] = deadline.deadline_s
        notes.extend(
            deadline_warnings(
                deadline.deadline_s,
                now_s=now_s,
                start_s=known.start_s,
                time_limit_s=known.time_limit_s,
            )
        )
    if request.iterations_total is not None:
        payload["iterations_total"] = request.iterations_total
    if request.slo is not None:
        payload["slo_percentile"] = request.slo.percentile
        payload["slo_latency_s"] = request.slo.latency_s
    if known.time_limit_s is not None and known.time_limit_s > 0:
        payload["time_limit_s"] = known.time_limit_s
    if known.start_s is not None:
        payload["start_s"] = known.start_s
    if known.name and known.name.isprintable():
        # a name the head would refuse must not cost the job its registration: a longer one
        # goes by its first characters (its kind still tells it from others)
        payload["job_name"] = known.name[:MAX_JOB_NAME]
    notes.insert(0, _format_deadline(deadline))
    return payload, notes


def run_prolog(
    env: HookEnv,
    client: JobsClient | None,
    spool: Spool,
    *,
    now_s: float,
    until_s: float,
    times: Callable[[str], JobTimes | None],
    client_error: str = "",
) -> HookOutcome:
    """Register this node's share of the job (or spool it); never raises `CdgpcError`. Then
    `hold_gpus`.

    The job comes from the environment (`slurm_cdgpc.slurm.env`), its deadline, iteration
    count and latency objective from the comment (`slurm_cdgpc.slurm.comment`), its submit
    and start times, ``--deadline`` and time limit from ``times`` (``scontrol show job``; the
    time limit bounds the work of a job that does not say its own); then ``POST /v1/jobs``
    with this node's GPUs. A multi-node job's Prolog runs on every node and each registers its
    own GPUs; the head merges them."""
    where = f"job {env.display_id} on {env.node}"
    if env.job_id != env.display_id:
        where += f" (id {env.job_id})"
    if not env.gpus:
        return HookOutcome("skipped", f"{where}: no GPUs here, not registered")
    payload, notes = registration(env, now_s=now_s, times=times)
    gpus = ",".join(map(str, env.gpus))
    detail = "; ".join(notes)
    reason = client_error
    if client is not None:
        try:
            client.post("/v1/jobs", payload)
            forwarded = _forward(client, spool, until_s)
            return HookOutcome(
                "registered", f"{where}: registered GPUs {gpus}, {detail}{forwarded}"
            )
        except CdgpcError as e:
            if not _retryable(e):
                return HookOutcome(
                    "failed", f"{where}: head refused GPUs {gpus}: {e}", syslog.LOG_ERR
                )
            reason = str(e)
    try:
        path = spool.spool("register", env.job_id, payload)
    except SpoolError as e:
        return HookOutcome("failed", f"{where}: NOT registered ({reason}) and {e}", syslog.LOG_ERR)
    return HookOutcome(
        "spooled",
        f"{where}: head unavailable ({reason}); GPUs {gpus}, {detail}; spooled as {path.name}",
        syslog.LOG_WARNING,
    )


def resolve_mig(
    env: HookEnv, resolve: Callable[[str, Sequence[str]], Mapping[str, int]] | None
) -> tuple[HookEnv, str]:
    """A job on MIG instances (``env.mig``) gets the physical GPUs they are on, as this node's
    agent knows them (``resolve``): clocks and power are the GPU's, so the jobs on its instances
    are its tenants. Names the agent does not know stay out; with none known, or no agent, the
    job has no GPUs here and is not registered (what its GPUs draw still counts against the
    budget). The note goes on the Prolog's line; never raises `CdgpcError`."""
    if not env.mig:
        return env, ""
    named = f"MIG instance(s) {','.join(env.mig)}"
    if resolve is None:
        return env, f"{named}: no local agent to find their GPUs"
    try:
        found = resolve(env.job_id, env.mig)
    except CdgpcError as e:
        return env, f"{named}: GPUs not found ({' '.join(str(e).split())})"
    gpus = tuple(sorted(set(found.values())))
    missing = [name for name in env.mig if name not in found]
    note = f"{named} on GPU(s) {','.join(map(str, gpus)) or 'none'}"
    if missing:
        note += f" ({len(missing)} not on this node's GPUs: {missing[0]})"
    return replace(env, gpus=gpus), note


def hold_gpus(
    env: HookEnv, outcome: HookOutcome, hold: Callable[[str, Sequence[int]], str]
) -> HookOutcome:
    """After the Prolog's registration (or spool), hold the job's GPUs here at the safe cap
    through the local agent (``hold``) until the head plans the job; the note goes on the
    Prolog's line. The job starts only when the Prolog returns, so it never runs on GPUs at
    default clocks that the head's plan for the current interval did not count. A hold that
    fails is noted and changes nothing else; never raises `CdgpcError`."""
    if not env.gpus:
        return outcome
    try:
        note = hold(env.job_id, env.gpus)
    except CdgpcError as e:
        note = f"local hold failed ({' '.join(str(e).split())})"
    return HookOutcome(outcome.action, f"{outcome.line}; {note}", outcome.priority)


def run_epilog(
    env: HookEnv,
    client: JobsClient | None,
    spool: Spool,
    *,
    until_s: float,
    client_error: str = "",
    release: Callable[[str], str] | None = None,
) -> HookOutcome:
    """Reset the job's GPUs here through the local agent (``release``), then deregister the job
    (or spool that); never raises `CdgpcError`.

    ``DELETE /v1/jobs/{id}``; the head releases the GPUs at its next exchange with the agent. A
    404 is fine: another node's Epilog was first, or the job had no GPUs. A job without GPUs on
    this node is left alone."""
    where = f"job {env.display_id} on {env.node}"
    if env.job_id != env.display_id:
        where += f" (id {env.job_id})"
    if not env.gpus and not env.mig:
        return HookOutcome("skipped", f"{where}: no GPUs here, nothing to deregister")
    if release is not None:
        # first, and whatever the head says: the GPUs must not stay capped for the next job
        try:
            where += f"; {release(env.job_id)}"
        except CdgpcError as e:
            where += f"; local reset failed ({' '.join(str(e).split())})"
    reason = client_error
    if client is not None:
        try:
            # a registration still in the spool must reach the head before its deregistration
            forwarded = _forward(client, spool, until_s)
            try:
                client.delete(f"/v1/jobs/{env.job_id}")
                done = "deregistered; the head releases its GPUs at the next exchange"
            except HeadRefusedError as e:
                if e.status != 404:
                    raise
                done = "already deregistered (another node's Epilog, or never registered)"
            return HookOutcome("deregistered", f"{where}: {done}{forwarded}")
        except CdgpcError as e:
            if not _retryable(e):
                return HookOutcome("failed", f"{where}: head refused: {e}", syslog.LOG_ERR)
            reason = str(e)
    try:
        path = spool.spool("deregister", env.job_id)
    except SpoolError as e:
        return HookOutcome(
            "failed", f"{where}: NOT deregistered ({reason}) and {e}", syslog.LOG_ERR
        )
    return HookOutcome(
        "spooled",
        f"{where}: head unavailable ({reason}); spooled as {path.name}",
        syslog.LOG_WARNING,
    )


def _forward(client: JobsClient, spool: Spool, until_s: float) -> str:
    """Forward the spool (bounded); a note for the log line when anything was waiting."""
    try:
        result = spool.forward(client, until_s=until_s)
    except (SpoolError, HookOverrunError) as e:  # what is left stays spooled
        return f"; spool: {e}"
    if not (result.sent or result.dropped or result.left):
        return ""
    return f"; spool: {result.sent} forwarded, {result.dropped} dropped, {result.left} left" + (
        " (another forwarder busy)" if result.skipped else ""
    )


def make_client(settings: HookSettings, environ: Mapping[str, str]) -> HeadClient:
    """A client for the head per the config; `CdgpcError` (one line) when that is impossible."""
    config = load_config(settings.config_path, env=environ)
    return HeadClient(
        config.head.url,
        signer_from_config(config, settings.timeout_s),
        timeout_s=settings.timeout_s,
        until_s=settings.until_s,
    )


def _local_agent(settings: HookSettings, environ: Mapping[str, str]) -> HeadClient:
    """A client for this node's agent, whose answers must be signed as this node's."""
    config = load_config(settings.config_path, env=environ)
    return HeadClient(
        agent_url(config),
        signer_from_config(config, settings.timeout_s),
        timeout_s=settings.timeout_s,
        until_s=settings.until_s,
        peer="the local agent",
        responder=hook_node(environ),
    )


def make_local_release(settings: HookSettings, environ: Mapping[str, str]) -> Callable[[str], str]:
    """Ask this node's agent to reset a finished job's GPUs now (``POST /v1/release``); the
    config is read when the release is made, so every failure surfaces as a `CdgpcError`."""

    def release(job_id: str) -> str:
        reply = _local_agent(settings, environ).post(RELEASE_PATH, {"job_id": job_id})
        released = reply.get("released", []) if isinstance(reply, dict) else []
        return f"GPU(s) {released or 'none'} reset here"

    return release


def make_local_mig(
    settings: HookSettings, environ: Mapping[str, str]
) -> Callable[[str, Sequence[str]], dict[str, int]]:
    """Ask this node's agent which physical GPUs the job's MIG instances are on
    (``POST /v1/mig``); failures, and an answer that is not a map of names to indices, surface
    as a `CdgpcError`."""

    def resolve(job_id: str, names: Sequence[str]) -> dict[str, int]:
        reply = _local_agent(settings, environ).post(
            MIG_PATH, {"job_id": job_id, "names": list(names)}
        )
        gpus = reply.get("gpus") if isinstance(reply, dict) else None
        if not isinstance(gpus, dict) or not all(
            name in names and type(index) is int and 0 <= index <= MAX_GPU_INDEX
            for name, index in gpus.items()
        ):
            raise InputError("the local agent's MIG answer is not a map of names to GPU indices")
        return dict(gpus)

    return resolve


def make_local_hold(
    settings: HookSettings, environ: Mapping[str, str]
) -> Callable[[str, Sequence[int]], str]:
    """Ask this node's agent to hold a starting job's GPUs at the safe cap (``POST /v1/hold``)
    until the head's first setpoint for the job; failures surface as a `CdgpcError`."""

    def hold(job_id: str, gpus: Sequence[int]) -> str:
        reply = _local_agent(settings, environ).post(
            HOLD_PATH, {"job_id": job_id, "gpus": list(gpus)}
        )
        held = reply.get("held", []) if isinstance(reply, dict) else []
        refused = reply.get("refused", []) if isinstance(reply, dict) else []
        line = f"GPU(s) {held or 'none'} held here (safe cap, or the head's earlier setpoint)"
        if refused:
            first = refused[0]
            if isinstance(first, dict) and {"gpu", "reason"} <= first.keys():
                first = f"GPU {first['gpu']}: {first['reason']}"
            line += f" ({len(refused)} refused: {' '.join(str(first).split())[:120]})"
        return line

    return hold


def _parser(kind: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"cdgpc-{kind}", description=f"Slurm node {kind.title()} of slurm-cdgpc."
    )
    parser.add_argument("--config", type=Path, help="cdgpc.toml (default: CDGPC_CONFIG or /etc)")
    parser.add_argument("--spool-dir", type=Path, default=DEFAULT_SPOOL_DIR)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="per request, s")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="whole hook, s")
    parser.add_argument("--strict", action="store_true", help="exit 1 when nothing was recorded")
    return parser


def settings_from_args(kind: str, argv: Sequence[str]) -> HookSettings:
    args = _parser(kind).parse_args(list(argv))
    if not 0 < args.timeout <= args.budget <= 60:
        raise InputError("need 0 < --timeout <= --budget <= 60 seconds")
    return HookSettings(
        config_path=args.config,
        spool_dir=args.spool_dir,
        timeout_s=args.timeout,
        budget_s=args.budget,
        strict=args.strict,
    )


def _syslog_emit(kind: str) -> Emit:
    syslog.openlog(f"cdgpc-{kind}", syslog.LOG_PID, syslog.LOG_DAEMON)
    return syslog.syslog


def run(
    kind: str,
    settings: HookSettings,
    environ: Mapping[str, str],
    *,
    emit: Emit,
    client_factory: Callable[[HookSettings, Mapping[str, str]], JobsClient] = make_client,
    release_factory: Callable[[HookSettings, Mapping[str, str]], Callable[[str], str]]
    | None = make_local_release,
    hold_factory: Callable[[HookSettings, Mapping[str, str]], Callable[[str, Sequence[int]], str]]
    | None = make_local_hold,
    mig_factory: Callable[
        [HookSettings, Mapping[str, str]], Callable[[str, Sequence[str]], Mapping[str, int]]
    ]
    | None = make_local_mig,
) -> int:
    """One hook run: the exit status (0 unless strict and nothing recorded); one ``emit`` line.

    When the head cannot be reached (down, timeout, MUNGE down, 5xx), or its answer does not
    carry its reply credential for this request (`HeadClient`), the request is spooled
    (`slurm_cdgpc.slurm.spool`) and the hook returns at once; the local agent's answers to the
    hold and the release must be signed by this node's agent likewise. After every request the
    head did answer, the hook forwards whatever the spool holds, within its budget."""
    start_s = time.monotonic()
    until_s = _until(start_s, settings.budget_s)
    settings = replace(settings, until_s=until_s)
    try:
        env = read_hook_env(environ)
    except InputError as e:
        emit(syslog.LOG_ERR, f"not run by slurmd for a job: {e}")
        return 1 if settings.strict else 0
    client: JobsClient | None = None
    client_error = ""
    try:
        client = client_factory(settings, environ)
    except CdgpcError as e:
        client_error = f"no client: {e}"
    spool = Spool(settings.spool_dir)
    if kind == "prolog":
        mig_note = ""
        if env.mig:
            resolve = None if mig_factory is None else mig_factory(settings, environ)
            env, mig_note = resolve_mig(env, resolve)
        # the hold comes last and may take one request timeout: the spool gets that much less
        # (a job on MIG instances is held on their GPUs by a power limit: `NodeAgent.hold_job`)
        hold = None if hold_factory is None else hold_factory(settings, environ)
        outcome = run_prolog(
            env,
            client,
            spool,
            now_s=time.time(),
            until_s=until_s if hold is None else until_s - settings.timeout_s,
            times=lambda job: job_times(
                job, scontrol=settings.scontrol, timeout_s=min(0.5, settings.timeout_s)
            ),
            client_error=client_error,
        )
        if hold is not None:
            outcome = hold_gpus(env, outcome, hold)
        if mig_note:
            outcome = replace(outcome, line=f"{outcome.line}; {mig_note}")
    else:
        release = None if release_factory is None else release_factory(settings, environ)
        outcome = run_epilog(
            env, client, spool, until_s=until_s, client_error=client_error, release=release
        )
    elapsed_ms = (time.monotonic() - start_s) * 1000.0
    emit(outcome.priority, f"{' '.join(outcome.line.split())} [{elapsed_ms:.0f} ms]")
    return 1 if settings.strict and outcome.failed else 0


def _arm_backstop(settings: HookSettings, emit: Emit, job: str) -> None:
    """At the budget plus `BACKSTOP_MARGIN_S`, raise `HookOverrunError` in whatever step is under
    way (it fails as an unreachable head does, so its request is spooled); one margin later,
    exit at once (1 under ``--strict``, which cannot tell then what was recorded). A wait is cut
    at once; a name lookup or a write to a stuck disk when the call returns."""
    fired = 0

    def overrun(_signum: int, _frame: object) -> None:
        nonlocal fired
        fired += 1
        if fired == 1:
            raise HookOverrunError(
                f"the hook ran {BACKSTOP_MARGIN_S:g} s past its {settings.budget_s:g} s budget"
            )
        emit(syslog.LOG_ERR, f"job {job}: still running past the backstop; exiting")
        os._exit(1 if settings.strict else 0)

    signal.signal(signal.SIGALRM, overrun)
    signal.setitimer(signal.ITIMER_REAL, settings.budget_s + BACKSTOP_MARGIN_S, BACKSTOP_MARGIN_S)


def main(kind: str, argv: Sequence[str] | None = None) -> int:
    """Entry point of ``cdgpc-prolog`` / ``cdgpc-epilog``: never raises, 0 unless strict.

    Each run writes one syslog line (ident ``cdgpc-prolog`` or ``cdgpc-epilog``, facility
    daemon) naming the job; nothing is printed."""
    if kind not in KINDS:
        raise InputError(f"hook kind must be one of {KINDS}, got {kind!r}")
    emit = _syslog_emit(kind)
    strict = False
    job = os.environ.get("SLURM_JOB_ID", "?")
    try:
        settings = settings_from_args(kind, sys.argv[1:] if argv is None else argv)
        strict = settings.strict
        _arm_backstop(settings, emit, job)
        return run(kind, settings, os.environ, emit=emit)
    except SystemExit as e:  # argparse: a wrong wrapper; say so, keep the node up
        emit(syslog.LOG_ERR, f"bad arguments {argv!r}: exit {e.code}")
        return 0
    except HookOverrunError as e:  # out of time outside any request: nothing more is done
        emit(syslog.LOG_ERR, f"job {job}: {e}; stopped")
        return 1 if strict else 0
    except Exception as e:  # a bug must not drain the node
        emit(syslog.LOG_ERR, f"internal error: {type(e).__name__}: {' '.join(str(e).split())}")
        return 1 if strict else 0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
