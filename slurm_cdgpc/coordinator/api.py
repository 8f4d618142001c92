"""cdgpcd's HTTP API (`_Handler`): ``POST /v1/jobs``, ``DELETE /v1/jobs/{id}``, ``GET /v1/jobs``,
``POST /v1/admission``, ``POST /v1/nodes``, ``GET /v1/nodes``, ``POST /v1/budget``,
``GET /v1/budget``, ``GET /v1/status``, ``GET /v1/decisions``, ``GET /metrics`` and
``GET /v1/health``. All but the
last two are authenticated, every authenticated answer is signed, and a refused request changes
nothing. Tests: `tests/unit/test_coordinator_api.py`, `tests/security/test_live_attacks.py`;
design: DESIGN.md, "The head's API" and "Authentication".
"""

from __future__ import annotations

import ipaddress
import logging
import math
import re
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

from slurm_cdgpc.coordinator.admission import AdmissionRequest, judge
from slurm_cdgpc.coordinator.daemon import Coordinator
from slurm_cdgpc.coordinator.jobs import GpuRef, jobs_on
from slurm_cdgpc.coordinator.metrics import CONTENT_TYPE
from slurm_cdgpc.coordinator.registrations import Registration
from slurm_cdgpc.coordinator.report import IntervalReport, JobView, gpu_refs
from slurm_cdgpc.errors import CdgpcError, InputError, one_line
from slurm_cdgpc.slurm.comment import (
    MAX_SLO_LATENCY_S,
    MAX_SLO_PERCENTILE,
    MIN_SLO_PERCENTILE,
    LatencyObjective,
)
from slurm_cdgpc.store import ACTIVE_STATES, BudgetChange, DecisionRecord, Job, Node, StoreError
from slurm_cdgpc.transport.auth import (
    HEAD_RESPONDER,
    REPLY_HEADER,
    AccessPolicy,
    AuthError,
    AuthUnavailableError,
    ForbiddenError,
    Operation,
    Principal,
    Reply,
    Signer,
    Verifier,
)
from slurm_cdgpc.transport.evented import EventedHttpServer
from slurm_cdgpc.transport.server import JsonHandler
from slurm_cdgpc.wire import names
from slurm_cdgpc.wire.protocol import (
    ProtocolError,
    check_node_name,
    dump_json,
    load_json,
)

logger = logging.getLogger(__name__)

MAX_BODY_BYTES: Final = 64 * 1024
MAX_GPUS_PER_NODE: Final = 1024
#: the most GPUs, and nodes, one admission request may name
MAX_GPUS_PER_JOB: Final = 1_000_000
DEFAULT_DECISIONS: Final = 20
MAX_DECISIONS: Final = 1000
_JOB_PATH: Final = re.compile(r"/v1/jobs/(?P<job_id>[^/?]+)")
_URL: Final = re.compile(
    r"(https?://[A-Za-z0-9.\-\[\]:]+(/[\x21-\x7e]*)?|ssh://[A-Za-z0-9.\-]+(:[0-9]+)?)"
)


class _HttpError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class HeadHttpServer(EventedHttpServer):
    """The API's server (one event loop, a few workers) over one `Coordinator`, `Verifier` and
    `AccessPolicy`. A registration is answered once its group commit is durable, without
    holding a worker meanwhile.

    When checking a credential blocks on nothing (HMAC: `Verifier` ``in_process``), the loop's
    own thread checks each registration as it reads it, and commits those of each turn together
    when the turn ends (`turn_ended`). One thread does it all, with no hand-over between threads
    nor a lock passed among them (DESIGN.md, "The head's API", for what workers and a
    committing leader taking turns at the one interpreter lock cost). The loop
    never waits for the store, though: when another writer holds it (the control loop's
    interval, another process), or on PostgreSQL, a worker commits the turn's registrations.
    Every other request, and every registration under MUNGE (``unmunge`` is a program), goes to
    the workers. Answers are signed with ``signer`` (None: unsigned, which the hooks refuse);
    under MUNGE (``munge`` is a program) a committed registration is signed and answered on a
    worker, never on the committing thread."""

    def __init__(
        self,
        address: tuple[str, int],
        coordinator: Coordinator,
        verifier: Verifier,
        policy: AccessPolicy,
        *,
        signer: Signer | None = None,
        request_timeout_s: float = 10.0,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_connections: int = 256,
    ) -> None:
        self.coordinator = coordinator
        self.signer = signer
        self.signs_in_process = signer is None or bool(getattr(signer, "in_process", False))
        super().__init__(
            address,
            _Handler,
            verifier,
            policy,
            request_timeout_s=request_timeout_s,
            max_body_bytes=max_body_bytes,
            max_connections=max_connections,
            # the head node is the admins' machine: its own clients (benchmarks, the demo's
            # replayer) are not held to the per-host bound meant for compute nodes
            loopback_unbounded=True,
        )
        self._views: tuple[IntervalReport | None, dict[str, JobView]] = (None, {})
        self._inline_registrations = bool(getattr(verifier, "in_process", False))
        self._commit_handed_over = False

    def inline(self, request: bytes) -> bool:
        return self._inline_registrations and request.startswith(b"POST /v1/jobs ")

    def turn_ended(self) -> None:
        if self._commit_handed_over:
            return  # a worker is about to commit what is queued
        if not self.coordinator.registrations.commit_queued(wait=False):
            self._commit_handed_over = True
            self.loop.run_in_worker(self._commit_waiting)

    def _commit_waiting(self) -> None:
        self._commit_handed_over = False
        self.coordinator.registrations.commit_queued(wait=True)

    def job_views(self) -> dict[str, JobView]:
        """The last interval's job views by id, built once per interval: a lookup per job, not a
        scan of every job (listing thousands of jobs, or one registration, scanned them all)."""
        report = self.coordinator.last_report
        cached, views = self._views
        if report is None:
            return {}
        if cached is not report:  # two threads may both rebuild it; either result is right
            views = {v.job_id: v for v in report.jobs}
            self._views = (report, views)
        return views


# -- body checks: each returns the typed value or raises _HttpError(400) naming the field ------


def _bad(message: str) -> _HttpError:
    return _HttpError(HTTPStatus.BAD_REQUEST, message)


def _object(body: bytes, required: tuple[str, ...], optional: tuple[str, ...]) -> dict[str, Any]:
    try:
        data = load_json(body, MAX_BODY_BYTES)
    except ProtocolError as e:
        raise _bad(str(e)) from None
    if not isinstance(data, dict):
        raise _bad("body: must be a JSON object")
    unknown = sorted(k for k in data if k not in required + optional)
    if unknown:
        raise _bad(f"body: unknown field {unknown[0]!r}")
    missing = [k for k in required if k not in data]
    if missing:
        raise _bad(f"body: missing field {missing[0]!r}")
    return data


def _number(value: object, name: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(f"{name}: must be a finite number, got {value!r:.60}")
    if positive and not value > 0:
        raise _bad(f"{name}: must be positive, got {value!r}")
    return float(value)


def _optional_number(value: object, name: str) -> float | None:
    return None if value is None else _number(value, name)


def _count(value: object, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**53:
        raise _bad(f"{name}: must be an integer ≥ 0, got {value!r:.60}")
    return value


def _text(
    value: object, name: str, pattern: re.Pattern[str] | None = None, limit: int = 1000
) -> str:
    if (
        not isinstance(value, str)
        or len(value) > limit
        or not value.isprintable()
        or (pattern is not None and pattern.fullmatch(value) is None)
    ):
        raise _bad(f"{name}: not a valid value: {value!r:.60}")
    return value


def _agent_url(value: object) -> str:
    """An agent URL whose host is a host name or an IP address: ``http://-`` or
    ``ssh://--`` match the URL pattern but would reach an option parser, not a node."""
    url = _text(value, "url", _URL, 512)
    try:
        host = urlsplit(url).hostname or ""
        ipaddress.ip_address(host)
    except ValueError:
        try:
            check_node_name(host)
        except ProtocolError:
            raise _bad(f"url: {url!r:.60} does not name a host") from None
    return url


def _gpu_list(value: object) -> list[int]:
    if not isinstance(value, list) or not value or len(value) > MAX_GPUS_PER_NODE:
        raise _bad(f"gpus: must be a non-empty list of GPU indices, got {value!r:.60}")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < MAX_GPUS_PER_NODE:
            raise _bad(f"gpus[{i}]: must be a GPU index 0..{MAX_GPUS_PER_NODE - 1}")
        out.append(item)
    if len(set(out)) != len(out):
        raise _bad("gpus: a GPU is listed twice")
    return sorted(out)


def _slo(d: Mapping[str, object]) -> LatencyObjective | None:
    """``slo_percentile`` and ``slo_latency_s``, both or neither: a serving job's objective."""
    percentile = _optional_number(d.get("slo_percentile"), "slo_percentile")
    latency_s = _optional_number(d.get("slo_latency_s"), "slo_latency_s")
    if percentile is None and latency_s is None:
        return None
    if percentile is None or latency_s is None:
        raise _bad("slo_percentile, slo_latency_s: give both or neither")
    if not MIN_SLO_PERCENTILE <= percentile <= MAX_SLO_PERCENTILE:
        raise _bad(f"slo_percentile: must be in [50, 99.99], got {percentile}")
    if not 0 < latency_s <= MAX_SLO_LATENCY_S:
        raise _bad(f"slo_latency_s: must be in (0, 600], got {latency_s}")
    return LatencyObjective(percentile, latency_s)


def _checked(check: Callable[[object, str], str], value: object, name: str) -> str:
    try:
        return check(value, name)
    except InputError as e:
        raise _bad(str(e)) from None


# -- JSON views --------------------------------------------------------------------------------


def budget_dict(change: BudgetChange) -> dict[str, object]:
    """A change of the budget, or of a power domain's limit (``domain``; null: the budget)."""
    return {
        "budget_w": change.budget_w,
        "effective_at_s": change.effective_at_s,
        "set_by": change.set_by,
        "reason": change.reason,
        "created_at_s": change.created_at_s,
        "domain": change.domain,
    }


def node_dict(node: Node) -> dict[str, object]:
    return {
        "name": node.name,
        "url": node.url,
        "reachable": node.reachable,
        "last_seen_s": node.last_seen_s,
        "gpu_count": node.gpu_count,
        "gpu_type": node.gpu_type or None,
        "worst_case_power_w": node.worst_case_power_w,
    }


def decision_dict(d: DecisionRecord) -> dict[str, object]:
    return {
        "id": d.id,
        "time_s": d.time_s,
        "interval": d.interval_index,
        "status": d.status,
        "mode": d.mode,
        "shadow": d.shadow,
        "price": d.price if math.isfinite(d.price) else None,
        "budget_w": d.budget_w if math.isfinite(d.budget_w) else None,
        "effective_budget_w": d.effective_budget_w,
        "predicted_power_w": d.predicted_power_w,
        "measured_power_w": d.measured_power_w,
        "solve_s": d.solve_s,
        "setpoints": [
            {
                "job_id": s.job_id,
                "graphics_mhz": s.graphics_mhz,
                "memory_mhz": s.memory_mhz,
                "predicted_power_w": s.predicted_power_w,
            }
            for s in d.setpoints
        ],
    }


def job_dict(job: Job, views: Mapping[str, JobView]) -> dict[str, object]:
    """A job with what the last interval did with it (``views``: `HeadHttpServer.job_views`)."""
    view = views.get(job.job_id)
    return {
        "job_id": job.job_id,
        "user": job.user,
        "job_name": job.job_name,
        "state": job.state,
        "deadline_s": job.deadline_s,
        "iterations_total": job.iterations_total,
        "iterations_done": job.iterations_done,
        "registered_at_s": job.registered_at_s,
        "gpus": [{"node": g.node, "index": g.gpu_index} for g in job.gpus],
        "controlled": view is not None and view.controlled,
        "graphics_mhz": None if view is None else view.graphics_mhz,
        "memory_mhz": None if view is None else view.memory_mhz,
        "predicted_power_w": None if view is None else view.predicted_power_w,
        "measured_power_w": None if view is None else view.measured_power_w,
        "time_limit_s": job.time_limit_s,
        "progress": "none" if view is None else view.progress,
        "work": job.work_source,
        "left_top_s": None if view is None else view.left_top_s,
        "finish_s": None if view is None else view.finish_s,
        "shares_with": [] if view is None else list(view.shares_with),
        "model_readings": 0 if view is None else view.model_readings,
        "slo": None
        if job.slo_percentile is None
        else {"percentile": job.slo_percentile, "latency_s": job.slo_latency_s},
        "serving": None
        if view is None or view.serving is None
        else {"state": view.serving, "latency_s": view.latency_s, "floor_mhz": view.floor_mhz},
    }


def status_dict(coordinator: Coordinator) -> dict[str, object]:
    budget = coordinator.store.current_budget()
    report = coordinator.last_report
    cut = coordinator.last_cut
    return {
        "budget_w": budget.budget_w if budget else coordinator.settings.initial_budget_w,
        "budget": None if budget is None else budget_dict(budget),
        "shadow": coordinator.settings.shadow,
        "interval_s": coordinator.settings.interval_s,
        "last_interval": None if report is None else report.to_dict(),
        "last_emergency_cut": None if cut is None else cut.to_dict(),
    }


def budget_view(coordinator: Coordinator) -> dict[str, object]:
    """``GET /v1/budget``: the budget in force, the scheduled changes, the recent history, and
    the power domains below it (none without a topology), each with its limit in force, where
    that comes from (``source``: ``file``, or ``set`` by the change in ``set``), the file's
    limit and the changes scheduled for it."""
    now_s = coordinator.now_s()
    current = coordinator.store.current_budget(now_s)
    history = coordinator.store.budget_history()
    topology = coordinator.topology
    limits_w, sources = coordinator.domain_limits_in_force(now_s)
    scheduled: dict[str, list[dict[str, object]]] = {name: [] for name in topology.names}
    if topology.names:
        for change in coordinator.store.domain_limit_history(since_s=now_s):
            if change.effective_at_s > now_s and change.domain in scheduled:
                scheduled[change.domain].append(budget_dict(change))
    return {
        "current": None if current is None else budget_dict(current),
        "scheduled": [budget_dict(b) for b in history if b.effective_at_s > now_s],
        "history": [budget_dict(b) for b in history[-20:]],
        "domains": [
            {
                "name": domain.name,
                "limit_w": float(limit_w),
                "source": "file" if change is None else "set",
                "set": None if change is None else budget_dict(change),
                "file_limit_w": domain.limit_w,
                "scheduled": scheduled[domain.name],
            }
            for domain, limit_w, change in zip(topology.domains, limits_w, sources, strict=True)
        ],
    }


def _who(principal: Principal) -> str:
    """The store's ``set_by`` for a principal: the user name, else ``uid<N>``."""
    if principal.user is not None and names.ACCOUNT.fullmatch(principal.user):
        return principal.user
    return f"uid{principal.uid}"


class _Handler(JsonHandler):
    """The head's routes, and who may call each (node: root, the Slurm user, any HMAC key
    holder; admin: ``[auth]``'s admins; read: any authenticated user)::

        POST   /v1/jobs        node   register {job_id, user, node, gpus, gpu_type?, deadline_s?,
                                      iterations_total?, time_limit_s?, start_s?}; idempotent,
                                      a multi-node job registers once per node
        DELETE /v1/jobs/{id}   node   deregister; its GPUs are released at the next exchange
        POST   /v1/admission   node   {job_id, user, gpus (count), nodes, deadline_s?, gpu_type?,
                                      iterations_total?, time_limit_s?}: would the starting
                                      job meet its deadline under the current plan
                                      (`coordinator.admission.judge`); records nothing
        POST   /v1/nodes       node   announce {node, url, gpu_type?} (the agent's URL)
        POST   /v1/budget      admin  {budget_w, effective_at_s?, reason?, domain?}: the budget,
                                      or with domain that power domain's limit (checked
                                      against the topology: `Coordinator.set_budget`)
        GET    /v1/budget      read   the budget in force, scheduled changes, recent history,
                                      the power domains' limits in force, where each comes
                                      from, and their scheduled changes
        GET    /v1/status      read   the last interval, and the last emergency cut
        GET    /v1/jobs        read   active jobs: clocks, power, progress, predicted finish
        GET    /v1/nodes       read   nodes, reachability, worst-case power, each GPU's board
                                      and whether it is controlled (why not)
        GET    /v1/decisions   read   ?limit=N (default 20, at most 1000) latest decisions
        GET    /metrics        none   Prometheus text format 0.0.4 (`coordinator.metrics`)
        GET    /v1/health      none   {"ok": true}; signed when a given credential checks out

    An ``Authorization`` header binds the method, the full path (query included) and the body
    (`slurm_cdgpc.transport.auth`). Errors are ``{"error": "<one line>"}`` with 400 (malformed),
    401 (no, forged, expired or replayed credential), 403 (authenticated, not allowed), 404, 405,
    409, 411, 413 (body over `MAX_BODY_BYTES`), 503 (MUNGE or the database unavailable). Every
    answer to an authenticated request, refusals included, carries the reply credential
    (``X-Cdgpc-Reply-Auth``) bound to the request's nonce, `HEAD_RESPONDER`, the leader epoch,
    the status and the body.
    """

    # an event-loop server, not a socketserver: it gives the handler what JsonHandler uses
    server: HeadHttpServer
    server_version = "cdgpcd"
    _began_s: float  # when routing began (a registration's time runs from here)
    _nonce: str | None = None  # the authenticated request's, which its signed answer binds

    # -- routing --------------------------------------------------------------------------------

    def _route(self, method: str) -> None:
        self._began_s = time.monotonic()
        try:
            self._dispatch(method)
        except Exception as e:
            self._failed(method, e)

    def _failed(self, method: str, e: Exception) -> None:
        """Answer a request that raised ``e`` (one line; 500 for what no check foresaw)."""
        if isinstance(e, _MethodError):
            self._error(e.status, str(e), allow=e.allowed)
        elif isinstance(e, _HttpError):
            self._error(e.status, str(e))
        elif isinstance(e, (TimeoutError, ConnectionError)):
            logger.info("%s: connection dropped: %s", self.client_address[0], e)
            self.close_connection = True
        elif isinstance(e, (StoreError, AuthUnavailableError)):
            logger.error("%s %s: %s", method, self.path, e)
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(e))
        elif isinstance(e, InputError):
            self._error(HTTPStatus.BAD_REQUEST, str(e))
        else:
            logger.error("internal error handling %s %s", method, self.path, exc_info=e)
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error (see cdgpcd's log)")

    def _dispatch(self, method: str) -> None:
        parts = urlsplit(self.path)
        try:
            query = parse_qs(parts.query, max_num_fields=10)
        except ValueError:
            raise _bad("query: more than 10 fields") from None
        path = parts.path
        c = self.server.coordinator
        if path == "/v1/health":
            self._allow(method, "GET")
            self._vouch(method)
            self._send(HTTPStatus.OK, {"ok": True})
            return
        if path == "/metrics":
            self._allow(method, "GET")
            self._send_bytes(HTTPStatus.OK, c.metrics.render(), CONTENT_TYPE)
            return
        match = _JOB_PATH.fullmatch(path)
        if match is not None:
            self._allow(method, "DELETE")
            job = _checked(names.job_id, match["job_id"], "job id")
            principal = self._authenticate(method, b"", Operation.NODE)
            finished = c.deregister_job(job)
            if finished is None:
                raise _HttpError(HTTPStatus.NOT_FOUND, f"job {job} is not registered")
            logger.info("job %s: deregistered by %s", job, principal)
            self._send(HTTPStatus.OK, {"job_id": job, "state": finished.state})
            return
        routes = {
            "/v1/jobs": ("GET", "POST"),
            "/v1/admission": ("POST",),
            "/v1/nodes": ("GET", "POST"),
            "/v1/budget": ("GET", "POST"),
            "/v1/status": ("GET",),
            "/v1/decisions": ("GET",),
        }
        if path not in routes:
            raise _HttpError(HTTPStatus.NOT_FOUND, f"no such path: {path[:100]}")
        self._allow(method, *routes[path])
        if method == "GET":
            self._authenticate(method, b"", Operation.READ)
            self._send(HTTPStatus.OK, self._read(path, query))
            return
        body = self._body()
        if path == "/v1/budget":
            principal = self._authenticate(method, body, Operation.ADMIN)
            self._send(HTTPStatus.OK, self._set_budget(body, principal))
        elif path == "/v1/jobs":
            principal = self._authenticate(method, body, Operation.NODE)
            self._register(body, principal)
        elif path == "/v1/admission":
            principal = self._authenticate(method, body, Operation.NODE)
            self._send(HTTPStatus.OK, self._admit(body, principal))
        else:
            self._authenticate(method, body, Operation.NODE)
            d = _object(body, ("node", "url"), ("gpu_type",))
            name = _checked(names.node_name, d["node"], "node")
            url = _agent_url(d["url"])
            gpu_type = None if d.get("gpu_type") is None else _text(d["gpu_type"], "gpu_type")
            self._send(HTTPStatus.OK, node_dict(c.register_node(name, url, gpu_type)))

    def _allow(self, method: str, *allowed: str) -> None:
        if method not in allowed:
            raise _MethodError(", ".join(allowed))

    def _read(self, path: str, query: dict[str, list[str]]) -> dict[str, object]:
        c = self.server.coordinator
        if path == "/v1/status":
            return status_dict(c)
        if path == "/v1/jobs":
            views = self.server.job_views()
            return {"jobs": [job_dict(j, views) for j in c.store.jobs(ACTIVE_STATES)]}
        if path == "/v1/nodes":
            # each GPU's active jobs: more than one are its tenants (shards, MPS, MIG)
            on = jobs_on((j.job_id, gpu_refs(j)) for j in c.store.jobs(ACTIVE_STATES))

            def gpus(node: str) -> list[dict[str, object]]:
                views = c.nodes.gpu_views(node)
                return [
                    {**v, "jobs": on.get(GpuRef(node, int(str(v["index"]))), [])} for v in views
                ]

            return {"nodes": [{**node_dict(n), "gpus": gpus(n.name)} for n in c.store.nodes()]}
        if path == "/v1/budget":
            return budget_view(c)
        limit_text = query.get("limit", [str(DEFAULT_DECISIONS)])[-1]
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_DECISIONS:
            raise _bad(f"limit: must be an integer in 1..{MAX_DECISIONS}, got {limit_text!r:.20}")
        return {"decisions": [decision_dict(d) for d in c.store.decisions(limit=int(limit_text))]}

    def _set_budget(self, body: bytes, principal: Principal) -> dict[str, object]:
        d = _object(body, ("budget_w",), ("effective_at_s", "reason", "domain"))
        budget_w = _number(d["budget_w"], "budget_w", positive=True)
        effective_at_s = _optional_number(d.get("effective_at_s"), "effective_at_s")
        reason = "" if d.get("reason") is None else _text(d["reason"], "reason", limit=1000)
        domain = None if d.get("domain") is None else _text(d["domain"], "domain", limit=255)
        change = self.server.coordinator.set_budget(
            budget_w, _who(principal), effective_at_s=effective_at_s, reason=reason, domain=domain
        )
        logger.info(
            "%s change by %s: %.0f W",
            "budget" if domain is None else f"power domain {domain} limit",
            principal,
            budget_w,
        )
        return budget_dict(change)

    def _admit(self, body: bytes, principal: Principal) -> dict[str, object]:
        """``POST /v1/admission``: the verdict on a starting job, logged; nothing recorded."""
        d = _object(
            body,
            ("job_id", "user", "gpus", "nodes"),
            ("deadline_s", "gpu_type", "iterations_total", "time_limit_s"),
        )
        job = _checked(names.job_id, d["job_id"], "job_id")
        user = _checked(names.account, d["user"], "user")
        gpus = _count(d["gpus"], "gpus")
        if gpus is None or not 1 <= gpus <= MAX_GPUS_PER_JOB:
            raise _bad(f"gpus: must be a count of GPUs from 1 to {MAX_GPUS_PER_JOB}, got {gpus}")
        raw_nodes = d["nodes"]
        if not isinstance(raw_nodes, list) or not 1 <= len(raw_nodes) <= MAX_GPUS_PER_JOB:
            raise _bad(f"nodes: must be a non-empty list of node names, got {raw_nodes!r:.60}")
        nodes = tuple(_checked(names.node_name, n, f"nodes[{i}]") for i, n in enumerate(raw_nodes))
        if len(set(nodes)) != len(nodes):
            raise _bad("nodes: a node is listed twice")
        gpu_type = None if d.get("gpu_type") is None else _text(d["gpu_type"], "gpu_type", limit=64)
        time_limit_s = _optional_number(d.get("time_limit_s"), "time_limit_s")
        if time_limit_s is not None and time_limit_s <= 0:
            raise _bad(f"time_limit_s: must be > 0, got {time_limit_s:g}")
        admission = judge(
            self.server.coordinator,
            AdmissionRequest(
                job,
                user,
                gpus,
                nodes,
                deadline_s=_optional_number(d.get("deadline_s"), "deadline_s"),
                gpu_type=gpu_type,
                iterations_total=_count(d.get("iterations_total"), "iterations_total"),
                time_limit_s=time_limit_s,
            ),
        )
        logger.info(
            "job %s: admission for %s, asked by %s: %s: %s",
            job,
            user,
            principal,
            admission.verdict,
            admission.reason,
        )
        return {"job_id": job, **admission.to_dict()}

    def _register(self, body: bytes, principal: Principal) -> None:
        """Queue the registration and answer once it is committed (`GroupCommit`), on the
        thread that commits: a burst of Prologs holds no worker while its batch commits."""
        d = _object(
            body,
            ("job_id", "user", "node", "gpus"),
            (
                *("gpu_type", "deadline_s", "iterations_total", "time_limit_s", "start_s"),
                *("slo_percentile", "slo_latency_s", "job_name"),
            ),
        )
        job = _checked(names.job_id, d["job_id"], "job_id")
        user = _checked(names.account, d["user"], "user")
        node = _checked(names.node_name, d["node"], "node")
        job_name = (
            None
            if d.get("job_name") is None
            else _checked(names.job_name, d["job_name"], "job_name")
        )
        gpus = _gpu_list(d["gpus"])
        gpu_type = None if d.get("gpu_type") is None else _text(d["gpu_type"], "gpu_type", limit=64)
        deadline_s = _optional_number(d.get("deadline_s"), "deadline_s")
        iterations_total = _count(d.get("iterations_total"), "iterations_total")
        time_limit_s = _optional_number(d.get("time_limit_s"), "time_limit_s")
        if time_limit_s is not None and time_limit_s <= 0:
            raise _bad(f"time_limit_s: must be > 0, got {time_limit_s:g}")
        start_s = _optional_number(d.get("start_s"), "start_s")
        slo = _slo(d)
        deliver = self.defer()

        def answer(outcome: Callable[[], Job]) -> None:
            try:
                self._send(HTTPStatus.OK, job_dict(outcome(), self.server.job_views()))
                self._count_registration(HTTPStatus.OK)
            except Exception as e:  # refused, not committed, or a bug: one line either way
                self._failed("POST", e)
            finally:
                deliver()

        def committed(outcome: Callable[[], Job]) -> None:
            if self.server.signs_in_process:
                answer(outcome)
            else:  # signing runs a program: not on the committing thread, which must not block
                self.server.loop.run_in_worker(lambda: answer(outcome))

        try:
            registration = Registration.checked(  # a malformed one raises before it queues
                job,
                user,
                node,
                gpus,
                gpu_type=gpu_type,
                deadline_s=deadline_s,
                iterations_total=iterations_total,
                time_limit_s=time_limit_s,
                started_at_s=start_s,
                sender=principal,
                slo=slo,
                job_name=job_name,
            )
            self.server.coordinator.registrations.register_job_later(
                committed,
                registration,
                # on the loop's thread: committed with the turn's others when it ends
                lead=not self.server.loop.in_loop_thread(),
            )
        except BaseException:
            self.deferred = False  # refused before queueing: answered when this returns
            raise

    # -- authentication and the body -----------------------------------------------------------

    def _authenticate(self, method: str, body: bytes, operation: Operation) -> Principal:
        credentials = self.headers.get_all("Authorization") or []
        if len(credentials) != 1:
            raise _HttpError(HTTPStatus.UNAUTHORIZED, "exactly one Authorization header is needed")
        try:
            verified = self.server.verifier.verify_request(credentials[0], method, self.path, body)
            self._nonce, principal = verified.nonce, verified.principal
            self.server.policy.require(principal, operation)
        except ForbiddenError as e:
            logger.warning("%s: %s %s forbidden: %s", self.client_address[0], method, self.path, e)
            raise _HttpError(HTTPStatus.FORBIDDEN, str(e)) from None
        except AuthError as e:
            logger.warning("%s: %s %s refused: %s", self.client_address[0], method, self.path, e)
            raise _HttpError(HTTPStatus.UNAUTHORIZED, str(e)) from None
        return principal

    def _vouch(self, method: str) -> None:
        """Where no credential is needed: check one if given, so that the answer is signed;
        one that does not check out leaves the answer unsigned and refuses nothing."""
        credentials = self.headers.get_all("Authorization") or []
        if len(credentials) != 1:
            return
        try:
            self._nonce = self.server.verifier.verify_request(
                credentials[0], method, self.path, b""
            ).nonce
        except (AuthError, AuthUnavailableError) as e:
            logger.debug(
                "%s: %s %s: unsigned answer: %s", self.client_address[0], method, self.path, e
            )

    def _body(self) -> bytes:
        # framing was checked when the headers were read (`transport.server`): a
        # Transfer-Encoding never gets here, it is answered 501 there
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            raise _HttpError(HTTPStatus.LENGTH_REQUIRED, "Content-Length is required")
        if not length_text.strip().isdigit() or len(length_text) > 12:
            raise _bad("Content-Length must be a number of bytes")
        length = int(length_text)
        if length > self.server.max_body_bytes:
            raise _HttpError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"body is {length} bytes; the limit is {self.server.max_body_bytes}",
            )
        body = self.rfile.read(length)
        if len(body) != length:
            raise _bad("body shorter than Content-Length")
        return body

    # -- answers --------------------------------------------------------------------------------

    def _error(self, status: HTTPStatus, message: str, *, allow: str | None = None) -> None:
        self.close_connection = True
        if self.command == "POST" and urlsplit(self.path).path == "/v1/jobs":
            self._count_registration(status)
        self._send(status, {"error": one_line(message, 500)}, allow=allow)

    def _count_registration(self, status: HTTPStatus) -> None:
        elapsed_s = time.monotonic() - self._began_s
        self.server.coordinator.metrics.registration_answered(status.value, elapsed_s)

    def _send(self, status: HTTPStatus, data: object, *, allow: str | None = None) -> None:
        self._send_bytes(status, dump_json(data), "application/json", allow=allow)

    def _signed(self, status: HTTPStatus, body: bytes) -> list[str]:
        if self._nonce is None or self.server.signer is None:
            return []
        leader = self.server.coordinator.leader
        epoch = 0 if leader is None else leader.epoch
        try:
            reply = Reply.to(self._nonce, HEAD_RESPONDER, epoch, status, body)
            return [f"{REPLY_HEADER}: {self.server.signer.sign_reply(reply)}"]
        except CdgpcError as e:  # the client takes the answer for no answer, and spools
            logger.error("%s: answer to %s not signed: %s", self.client_address[0], self.path, e)
            return []


class _MethodError(_HttpError):
    def __init__(self, allowed: str) -> None:
        super().__init__(HTTPStatus.METHOD_NOT_ALLOWED, f"use {allowed}")
        self.allowed = allowed
