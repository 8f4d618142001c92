"""``cdgpc-noded exchange``: the node's end of the SSH transport. It relays one signed exchange from
stdin to the local agent and the agent's signed answer to stdout, adding no way in that root on
the node did not already have. It reaches the agent over HTTP only, never `agent/`
(`tests/unit/test_import_graph.py`). Tests: `tests/unit/test_transport_ssh.py`,
`tests/integration/test_ssh_live.py`; design: DESIGN.md, "The exchange" (Over SSH).
"""

from __future__ import annotations

import argparse
import http.client
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO, Final

from slurm_cdgpc.config import Config, agent_url, load_config
from slurm_cdgpc.errors import SoftError
from slurm_cdgpc.service import serve
from slurm_cdgpc.transport.auth import MAX_CREDENTIAL_CHARS, REPLY_HEADER
from slurm_cdgpc.transport.credentials import signer_from_config
from slurm_cdgpc.transport.http import (
    EXCHANGE_PATH,
    NodeExchanger,
    NodeFailure,
    NodeTarget,
    error_text,
    send_signed,
)
from slurm_cdgpc.transport.ssh import REQUEST_HEADER, envelope, open_envelope
from slurm_cdgpc.wire.protocol import (
    MAX_MESSAGE_BYTES,
    ExchangeRequest,
    MessageTooLargeError,
)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S: Final = 10.0
#: the longest ``Authorization:`` line before the request (the credential's cap and the name)
_MAX_CREDENTIAL_LINE: Final = MAX_CREDENTIAL_CHARS + 64


class AgentUnreachableError(SoftError):
    """The local agent did not answer, or refused the request (its one-line reason)."""


def main(argv: Sequence[str] | None = None) -> int:
    """``cdgpc-noded exchange [--config PATH]``, run by the head as ``ssh NODE cdgpc-noded
    exchange`` (`slurm_cdgpc.transport.ssh`).

    Stdin: the head's credential (an ``Authorization:`` line), then one `ExchangeRequest` JSON
    (at most `MAX_MESSAGE_BYTES`), which go to the agent (``POST /v1/exchange`` on
    ``node.listen_port``, on loopback when it listens on every address). Stdout: the agent's
    reply credential (an ``X-Cdgpc-Reply-Auth:`` line), then its answer as it came. A bare,
    unsigned request (a head older than this agent) is signed with this node's credentials and
    the agent's answer checked here (`forward`). On any failure nothing goes to stdout,
    ``Error: <one line>`` to stderr, and the exit status is 2 (a bad request or configuration)
    or 1 (the agent could not be reached, or refused: a request for another node, say).
    """
    parser = argparse.ArgumentParser(
        prog="cdgpc-noded exchange",
        description="Forward one exchange request (stdin) to the local agent; print its answer.",
    )
    parser.add_argument(
        "--config",
        type=Path,
        help="configuration file (default: CDGPC_CONFIG or /etc/cdgpc/cdgpc.toml)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds to wait for the local agent (default: {DEFAULT_TIMEOUT_S:g})",
    )
    args = parser.parse_args(argv)

    def body() -> int:
        credential, data = read_input(sys.stdin.buffer)
        if credential is None:  # a head older than this agent
            request = ExchangeRequest.from_json(data)
            reply = forward(load_config(args.config), request, timeout_s=args.timeout)
        else:
            reply = relay(load_config(args.config), credential, data, timeout_s=args.timeout)
        sys.stdout.buffer.write(reply)
        sys.stdout.buffer.flush()
        return 0

    return serve("cdgpc-noded exchange", body)


def read_input(stream: BinaryIO, limit_bytes: int = MAX_MESSAGE_BYTES) -> tuple[str | None, bytes]:
    """The head's credential (None: a bare request) and the request's body from ``stream``,
    read to its end but never past the credential's line and ``limit_bytes`` + 1."""
    data = stream.read(limit_bytes + _MAX_CREDENTIAL_LINE + 1)
    credential, body = open_envelope(data, REQUEST_HEADER)
    if len(body) > limit_bytes:
        raise MessageTooLargeError(f"request is larger than {limit_bytes} bytes")
    return credential, body


def read_request(stream: BinaryIO, limit_bytes: int = MAX_MESSAGE_BYTES) -> ExchangeRequest:
    """One bare request from ``stream``, read to its end but never past ``limit_bytes`` + 1."""
    data = stream.read(limit_bytes + 1)
    if len(data) > limit_bytes:
        raise MessageTooLargeError(f"request is larger than {limit_bytes} bytes")
    return ExchangeRequest.from_json(data)


def relay(config: Config, credential: str, body: bytes, *, timeout_s: float) -> bytes:
    """The local agent's answer to the head's signed request, as it came, after its reply
    credential: an `envelope` for the head to check (this program cannot: under MUNGE only one
    ``unmunge`` of the head's credential succeeds, and that one is the agent's)."""
    url = agent_url(config)
    try:
        reply = send_signed(url, "POST", EXCHANGE_PATH, body, credential, timeout_s)
    except (OSError, http.client.HTTPException) as e:
        raise AgentUnreachableError(
            f"local agent: {url}: {type(e).__name__}: {' '.join(str(e).split())}"
        ) from e
    if reply.status != 200:
        raise AgentUnreachableError(
            f"local agent: {url}: HTTP {reply.status}: {error_text(reply.body)}"
        )
    logger.debug("%s: answer relayed", url)
    if reply.credential is None:  # the head refuses it, and says why
        return reply.body
    return envelope(REPLY_HEADER, reply.credential, reply.body)


def forward(config: Config, request: ExchangeRequest, *, timeout_s: float) -> bytes:
    """The local agent's signed answer to ``request`` (response JSON, its reply credential
    checked here), else an error."""
    url = agent_url(config)
    name = request.node  # the agent refuses it unless that is its own name
    exchanger = NodeExchanger(signer_from_config(config, timeout_s), timeout_s=timeout_s)
    try:
        result = exchanger.exchange({name: NodeTarget(url, request)})[name]
    finally:
        exchanger.close()
    if isinstance(result, NodeFailure):
        raise AgentUnreachableError(f"local agent: {result.reason}")
    logger.debug("%s: interval %d answered", url, request.interval)
    return result.to_json()


if __name__ == "__main__":
    raise SystemExit(main())
