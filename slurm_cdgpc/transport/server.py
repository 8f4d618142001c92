"""The HTTP server under the head's API and the node agent's listener.

A `ThreadingHTTPServer` with what both need: the request verifier and access policy the
handlers consult, a per-request timeout, a body cap, and a bound on concurrent connections (a
connection over the bound is closed at once, so a flood cannot exhaust threads).
"""

from __future__ import annotations

import logging
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from slurm_cdgpc.transport.auth import AccessPolicy, Verifier

logger = logging.getLogger(__name__)


class BoundedHttpServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    #: the listen backlog: a burst of Prologs (a large array job starting) must queue, not be
    #: refused by the kernel (the standard library's default is 5)
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        verifier: Verifier,
        policy: AccessPolicy,
        *,
        request_timeout_s: float,
        max_body_bytes: int,
        max_connections: int,
    ) -> None:
        self.verifier = verifier
        self.policy = policy
        self.request_timeout_s = request_timeout_s
        self.max_body_bytes = max_body_bytes
        self._slots = threading.BoundedSemaphore(max_connections)
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            logger.warning("too many connections; closing one from %s", client_address[0])
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class JsonHandler(BaseHTTPRequestHandler):
    """The request plumbing both servers share: a per-request socket timeout, debug-level
    access logs, every method routed to `_route`, and JSON answers that never cache."""

    server: BoundedHttpServer
    sys_version = ""
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.request_timeout_s)  # per-request socket timeout

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.client_address[0], format % args)

    def _route(self, method: str) -> None:
        raise NotImplementedError

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    def do_HEAD(self) -> None:
        self._route("HEAD")

    def _send_bytes(
        self,
        status: HTTPStatus,
        body: bytes,
        content_type: str = "application/json",
        *,
        allow: str | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        if allow is not None:
            self.send_header("Allow", allow)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
