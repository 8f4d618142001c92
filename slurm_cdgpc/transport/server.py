"""The HTTP server under the head's API and the node agent's listener.

A `ThreadingHTTPServer` with what both need: the request verifier and access policy the
handlers consult, a per-request timeout, a body cap, and a bound on concurrent connections (a
connection over the bound is closed at once, so a flood cannot exhaust threads).
"""

from __future__ import annotations

import logging
import socket
import threading
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
