"""The agent's HTTP routes (`_ROUTES`: ``/v1/exchange``, ``/v1/hold``, ``/v1/mig``,
``/v1/release``, ``/v1/health``, ``/metrics``) over the shared `JsonHandler`. Every answer to a
request whose credential checked out is signed. Like all of `agent/`, it never reaches
`control/` (`tests/unit/test_import_graph.py`). Tests: `tests/unit/test_transport_exchange.py`,
`tests/unit/test_agent_release.py`, `tests/security/test_http_framing.py`,
`tests/security/test_reply_auth.py`; design: DESIGN.md, "The exchange" (Signed answers).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, Final, TypeVar

from slurm_cdgpc.agent.metrics import CONTENT_TYPE, AgentMetrics
from slurm_cdgpc.agent.node import NodeAgent, StaleEpochError, WrongNodeError
from slurm_cdgpc.errors import CdgpcError, one_line
from slurm_cdgpc.transport.auth import (
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
from slurm_cdgpc.transport.evented import EventedHttpServer, EventLoop
from slurm_cdgpc.transport.server import JsonHandler
from slurm_cdgpc.wire.protocol import (
    HOLD_PATH,
    MAX_MESSAGE_BYTES,
    MIG_PATH,
    RELEASE_PATH,
    ExchangeRequest,
    MessageTooLargeError,
    ProtocolError,
    dump_json,
    gpu_indices,
    job_id,
    load_json,
    mig_names,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

EXCHANGE_PATH: Final = "/v1/exchange"
HEALTH_PATH: Final = "/v1/health"
METRICS_PATH: Final = "/metrics"
_ROUTES: Final = {
    EXCHANGE_PATH: "POST",
    RELEASE_PATH: "POST",
    HOLD_PATH: "POST",
    MIG_PATH: "POST",
    HEALTH_PATH: "GET",
    METRICS_PATH: "GET",
}
_LOOPBACK: Final = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})


class AgentHttpServer(EventedHttpServer):
    """An event-loop HTTP server bound to one `NodeAgent`, `Verifier` and `AccessPolicy`, which
    signs its answers with ``signer`` (None: unsigned, which every client refuses).

    Requests are handled on the loop's thread (``workers=0``): the agent serves one exchange an
    interval under its lock, so a pool of threads would add two thread switches to each and
    overlap nothing (DESIGN.md, "The exchange"). Sockets are still the
    loop's: a slow or silent peer holds no thread and is cut at ``request_timeout_s``.
    ``loop``: serve from a shared `EventLoop` (``bench exchange`` runs hundreds of agents on one).
    """

    def __init__(
        self,
        address: tuple[str, int],
        agent: NodeAgent,
        verifier: Verifier,
        policy: AccessPolicy,
        *,
        signer: Signer | None = None,
        request_timeout_s: float = 10.0,
        max_body_bytes: int = MAX_MESSAGE_BYTES,
        max_connections: int = 32,
        loop: EventLoop | None = None,
    ) -> None:
        self.agent = agent
        self.signer = signer
        self.metrics = AgentMetrics(agent)
        super().__init__(
            address,
            _Handler,
            verifier,
            policy,
            request_timeout_s=request_timeout_s,
            max_body_bytes=max_body_bytes,
            max_connections=max_connections,
            workers=0,
            loop=loop,
        )


class _Handler(JsonHandler):
    """The agent's routes (`_ROUTES`); a request's body is authenticated before it is parsed.

    - ``POST /v1/exchange``: an `ExchangeRequest` from a principal allowed `Operation.NODE`
      (root, the Slurm user; any HMAC key holder); answers the `ExchangeResponse`.
    - ``POST /v1/hold`` (the Prolog) and ``POST /v1/release`` (the Epilog): from this node only
      (loopback), authenticated like an exchange. ``{"job_id": "...", "gpus": [0, 1]}`` holds a
      starting job's GPUs at the safe cap (`NodeAgent.hold_job`); ``{"job_id": "..."}`` resets
      the GPUs the job held.
    - ``POST /v1/mig`` (the Prolog), likewise: ``{"job_id": "...", "names": ["MIG-..."]}``
      answers ``{"job_id": "...", "gpus": {"MIG-...": 1}}``, the physical GPU of each named
      MIG instance on this node (`NodeAgent.mig_parents`); it changes nothing.
    - ``GET /v1/health``: ``{"ok": true}``, no credential needed (signed when one checks out).
    - ``GET /metrics``: Prometheus text (`slurm_cdgpc.agent.metrics`), no credential; it reads,
      and changes nothing.

    A refusal is one line, ``{"error": "..."}``, and changes nothing: 400 bad JSON or schema,
    401 a missing, bad or replayed credential or an exchange that names another node, 403 not
    allowed, 404 unknown path, 405 wrong method, 409 a leader epoch older than one already seen,
    411 no Content-Length, 413 a body over the cap, 503 the authentication backend down, 500 a
    bug (logged with its traceback). The reply credential (`Signer.sign_reply`) binds the
    request's nonce, this node's name, the exchange's leader epoch (0 for a hold or a release),
    the status and the body.
    """

    server: AgentHttpServer
    server_version = "cdgpc-noded"
    #: the authenticated request's nonce and leader epoch, which its signed answer binds
    _nonce: str | None = None
    _epoch = 0

    # -- routing --------------------------------------------------------------------------------

    def _route(self, method: str) -> None:
        try:
            allowed = _ROUTES.get(self.path)
            if allowed is None:
                self._error(HTTPStatus.NOT_FOUND, f"no such path (use {EXCHANGE_PATH})")
            elif method != allowed:
                self._error(HTTPStatus.METHOD_NOT_ALLOWED, f"use {allowed}", allow=allowed)
            elif self.path == METRICS_PATH:
                self._send_bytes(HTTPStatus.OK, self.server.metrics.render(), CONTENT_TYPE)
            elif method == "GET":
                self._vouch()
                self._send(HTTPStatus.OK, {"ok": True})
            elif self.path == RELEASE_PATH:
                self._release_job()
            elif self.path == HOLD_PATH:
                self._hold_job()
            elif self.path == MIG_PATH:
                self._mig_parents()
            else:
                self._exchange()
        except (TimeoutError, ConnectionError) as e:
            logger.info("%s: connection dropped: %s", self.client_address[0], e)
            self.close_connection = True
        except Exception:
            logger.exception("internal error handling %s %s", method, self.path)
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error (see the agent's log)")

    # -- the exchange ---------------------------------------------------------------------------

    def _authorised(self, body: bytes) -> Principal | None:
        """The sender, if its credential is valid for this request and it may act as a node;
        otherwise None after answering 401/403/503. A refused request changes nothing."""
        peer = self.client_address[0]
        credentials = self.headers.get_all("Authorization") or []
        if len(credentials) != 1:
            self._error(HTTPStatus.UNAUTHORIZED, "exactly one Authorization header is needed")
            return None
        try:
            verified = self.server.verifier.verify_request(credentials[0], "POST", self.path, body)
            self._nonce, principal = verified.nonce, verified.principal
            self.server.policy.require(principal, Operation.NODE)
        except ForbiddenError as e:
            logger.warning("%s: %s forbidden: %s", peer, self.path, e)
            self._error(HTTPStatus.FORBIDDEN, str(e))
            return None
        except AuthError as e:
            logger.warning("%s: %s refused: %s", peer, self.path, e)
            self._error(HTTPStatus.UNAUTHORIZED, str(e))
            return None
        except AuthUnavailableError as e:
            logger.error("%s: cannot authenticate: %s", peer, e)
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(e))
            return None
        return principal

    def _vouch(self) -> None:
        """``GET /v1/health`` needs no credential: one that is given and checks out gets a
        signed answer; one that does not leaves it unsigned and refuses nothing."""
        credentials = self.headers.get_all("Authorization") or []
        if len(credentials) != 1:
            return
        try:
            verified = self.server.verifier.verify_request(credentials[0], "GET", self.path, b"")
        except (AuthError, AuthUnavailableError) as e:
            logger.debug("%s: health: unsigned answer: %s", self.client_address[0], e)
            return
        self._nonce = verified.nonce

    def _local_request(
        self, what: str, hook: str, fields: frozenset[str]
    ) -> tuple[dict[str, Any], Principal] | None:
        """The body of a request this node's own ``hook`` (Prolog, Epilog) makes, and its
        sender: loopback only, authenticated, exactly ``fields`` (``job_id`` checked); None
        after answering 400/401/403."""
        if self.client_address[0] not in _LOOPBACK:
            self._error(HTTPStatus.FORBIDDEN, f"{what} is only for this node's own {hook}")
            return None
        body = self._body()
        if body is None:
            return None
        principal = self._authorised(body)
        if principal is None:
            return None
        try:
            data = load_json(body)
            if not isinstance(data, dict) or set(data) != fields:
                names = ", ".join(f'"{f}"' for f in sorted(fields))
                raise ProtocolError(f"{what}: the body must be an object with {names}")
            data["job_id"] = job_id(data["job_id"])
        except ProtocolError as e:
            self._error(HTTPStatus.BAD_REQUEST, str(e))
            return None
        return data, principal

    def _release_job(self) -> None:
        request = self._local_request("release", "Epilog", frozenset({"job_id"}))
        if request is None:
            return
        data, principal = request
        job = data["job_id"]
        released, refused = self.server.agent.release_job(job)
        logger.info("job %s: Epilog (%s) released GPU(s) %s", job, principal, released or "none")
        self._send(
            HTTPStatus.OK,
            {"job_id": job, "released": released, "refused": [r.to_dict() for r in refused]},
        )

    def _prolog_list(
        self, what: str, key: str, parse: Callable[[object, str], tuple[T, ...]]
    ) -> tuple[str, Principal, tuple[T, ...]] | None:
        """A Prolog's ``{"job_id": ..., key: [...]}`` (`_local_request`): the job, the sender
        and the list ``parse`` reads, which must not be empty; None after answering 400."""
        request = self._local_request(what, "Prolog", frozenset({"job_id", key}))
        if request is None:
            return None
        data, principal = request
        try:
            items = parse(data[key], f"{what}: {key}")
            if not items:
                raise ProtocolError(f"{what}: {key}: at least one is needed")
        except ProtocolError as e:
            self._error(HTTPStatus.BAD_REQUEST, str(e))
            return None
        return data["job_id"], principal, items

    def _hold_job(self) -> None:
        request = self._prolog_list("hold", "gpus", gpu_indices)
        if request is None:
            return
        job, principal, gpus = request
        held, refused = self.server.agent.hold_job(job, gpus)
        logger.info(
            "job %s: Prolog (%s) held GPU(s) %s (safe cap, or the head's earlier setpoint)",
            job,
            principal,
            held or "none",
        )
        self._send(
            HTTPStatus.OK,
            {"job_id": job, "held": held, "refused": [r.to_dict() for r in refused]},
        )

    def _mig_parents(self) -> None:
        request = self._prolog_list("mig", "names", mig_names)
        if request is None:
            return
        job, _principal, names = request
        self._send(HTTPStatus.OK, {"job_id": job, "gpus": self.server.agent.mig_parents(names)})

    def _exchange(self) -> None:
        body = self._body()
        if body is None:
            return
        peer = self.client_address[0]
        principal = self._authorised(body)
        if principal is None:
            return
        try:
            request = ExchangeRequest.from_json(body)
        except ProtocolError as e:
            logger.warning("%s (%s): bad exchange request: %s", peer, principal, e)
            self._error(HTTPStatus.BAD_REQUEST, str(e))
            return
        self._epoch = request.epoch
        began_s = time.perf_counter()
        try:
            response = self.server.agent.exchange(request)
        except StaleEpochError as e:
            self._error(HTTPStatus.CONFLICT, str(e))
            return
        except WrongNodeError as e:  # a credential is good for the node the body names only
            logger.warning("%s (%s): %s", peer, principal, e)
            self._error(HTTPStatus.UNAUTHORIZED, str(e))
            return
        logger.debug(
            "%s (%s): interval %d: %d setpoint(s), %d release(s), %d refused",
            peer,
            principal,
            request.interval,
            len(request.setpoints),
            len(request.release),
            len(response.refused),
        )
        self.server.metrics.exchange_served(time.perf_counter() - began_s)
        self._send_bytes(HTTPStatus.OK, response.to_json())

    def _body(self) -> bytes | None:
        """The request body, or None after answering 400/411/413."""
        # framing was checked when the headers were read (`transport.server`): a
        # Transfer-Encoding never gets here, it is answered 501 there
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            self._error(HTTPStatus.LENGTH_REQUIRED, "Content-Length is required")
            return None
        if not length_text.strip().isdigit() or len(length_text) > 12:
            self._error(HTTPStatus.BAD_REQUEST, "Content-Length must be a number of bytes")
            return None
        length = int(length_text)
        if length > self.server.max_body_bytes:
            error = MessageTooLargeError(
                f"body is {length} bytes; the limit is {self.server.max_body_bytes}"
            )
            self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, str(error))
            return None
        body = self.rfile.read(length)
        if len(body) != length:
            self._error(HTTPStatus.BAD_REQUEST, "body shorter than Content-Length")
            return None
        return body

    # -- answers --------------------------------------------------------------------------------

    def _error(self, status: HTTPStatus, message: str, *, allow: str | None = None) -> None:
        self.close_connection = True
        if self.command == "POST" and self.path == EXCHANGE_PATH:
            self.server.metrics.exchange_refused(status.value)
        self._send(status, {"error": one_line(message, 500)}, allow=allow)

    def _send(self, status: HTTPStatus, data: object, *, allow: str | None = None) -> None:
        self._send_bytes(status, dump_json(data), allow=allow)

    def _signed(self, status: HTTPStatus, body: bytes) -> list[str]:
        if self._nonce is None or self.server.signer is None:
            return []
        try:
            reply = Reply.to(self._nonce, self.server.agent.node_name, self._epoch, status, body)
            return [f"{REPLY_HEADER}: {self.server.signer.sign_reply(reply)}"]
        except CdgpcError as e:  # the client takes the answer for no answer
            logger.error("%s: answer to %s not signed: %s", self.client_address[0], self.path, e)
            return []
