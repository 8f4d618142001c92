"""The head's SSH transport (`SshExchanger`): ``ssh NODE cdgpc-noded exchange`` with the same signed
JSON as over HTTP, its answer checked end to end. No shell, node names checked and placed after
``--``, every failure a `NodeFailure`. It never reaches `agent/` or `coordinator/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "The exchange" (Over SSH); tests:
`tests/unit/test_transport_ssh.py`, `tests/integration/test_ssh_live.py`,
`tests/security/test_injection.py`.
"""

from __future__ import annotations

import logging
import math
import os
import re
import selectors
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

from slurm_cdgpc.errors import CdgpcError, InputError, one_line
from slurm_cdgpc.transport.auth import MAX_CREDENTIAL_CHARS, REPLY_HEADER, Signer
from slurm_cdgpc.transport.http import EXCHANGE_PATH, NodeFailure, NodeTarget, exchange_answer
from slurm_cdgpc.wire.protocol import (
    MAX_MESSAGE_BYTES,
    ExchangeResponse,
    ProtocolError,
    check_node_name,
)

logger = logging.getLogger(__name__)

DEFAULT_SSH_PATH: Final = "/usr/bin/ssh"
#: what the head runs on the node: ``cdgpc-noded exchange`` (`slurm_cdgpc.transport.forward`)
DEFAULT_REMOTE_COMMAND: Final = ("cdgpc-noded", "exchange")
SSH_SCHEME: Final = "ssh"
#: cap on what ssh may write to stderr (banners, warnings, one error line)
MAX_STDERR_BYTES: Final = 16 * 1024
#: ssh's own exit status when it could not connect or authenticate
SSH_FAILED_STATUS: Final = 255

#: the line before the request body on stdin, and the one before the answer on stdout
REQUEST_HEADER: Final = "Authorization"

_OPTION_RE: Final = re.compile(r"[A-Za-z][A-Za-z0-9]*=[\x20-\x7e]*")
_KILL_WAIT_S: Final = 2.0
_NO_MESSAGE: Final = "no error message"
_CHUNK_BYTES: Final = 65536


def ssh_url(host: str, port: int | None = None) -> str:
    """The agent URL that routes a node over SSH: ``ssh://HOST`` or ``ssh://HOST:PORT``."""
    check_node_name(host)
    if port is not None and not 0 < port < 65536:
        raise InputError(f"ssh port must be in 1..65535, got {port}")
    return f"{SSH_SCHEME}://{host}" if port is None else f"{SSH_SCHEME}://{host}:{port}"


def is_ssh_url(url: str) -> bool:
    return url.lower().startswith(f"{SSH_SCHEME}://")


@dataclass(frozen=True)
class _Destination:
    host: str
    port: int | None


def _destination(node: str, url: str) -> _Destination:
    """The host to reach ``node`` at: an ``ssh://`` URL's host, else the node name itself."""
    if not is_ssh_url(url):
        return _Destination(check_node_name(node), None)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise InputError(f"not an ssh://HOST[:PORT] URL: {url!r}") from None
    if parts.username or parts.password or parts.path not in ("", "/") or parts.query:
        raise InputError(f"not an ssh://HOST[:PORT] URL: {url!r}")
    # urlsplit lower-cases the host name; host names are case-insensitive anyway
    return _Destination(check_node_name(parts.hostname or ""), port)


def envelope(header: str, credential: str, body: bytes) -> bytes:
    """``body`` after one ``<header>: <credential>`` line: how a signed message crosses ssh."""
    return f"{header}: {credential}\n".encode("ascii") + body


def open_envelope(data: bytes, header: str) -> tuple[str | None, bytes]:
    """The credential and the body of an `envelope`; (None, ``data``) when ``data`` has no
    ``<header>:`` line (a bare message, which then carries no credential)."""
    prefix = f"{header}: ".encode("ascii")
    if not data.startswith(prefix):
        return None, data
    line, newline, body = data.partition(b"\n")
    credential = line[len(prefix) :]
    if not newline or len(credential) > MAX_CREDENTIAL_CHARS or not credential.isascii():
        raise ProtocolError(f"{header}: the credential line is malformed")
    return credential.decode("ascii"), body


def _check_option(option: str) -> str:
    if not (isinstance(option, str) and _OPTION_RE.fullmatch(option)):
        raise InputError(f"ssh option must look like Key=value (printable ASCII), got {option!r}")
    return option


def _stderr_reason(stderr: bytes) -> str:
    """The forwarder's ``Error: ...`` line if there is one, else ssh's last line."""
    text = stderr.decode("utf-8", "replace")
    for line in text.splitlines():
        if line.strip().startswith("Error:"):
            return one_line(line.strip()[len("Error:") :], empty=_NO_MESSAGE)
    return one_line(text, keep="last", empty=_NO_MESSAGE)


@dataclass(frozen=True)
class _Finished:
    returncode: int
    stdout: bytes
    stderr: bytes


class SshExchanger:
    """Concurrent exchanges with node agents through ``ssh HOST cdgpc-noded exchange``::

        ssh -o BatchMode=yes -o ConnectTimeout=S [-F FILE] [-o OPT ...] [-p PORT] -- HOST COMMAND

    with the head's credential (an ``Authorization:`` line) and the `ExchangeRequest` JSON on
    stdin, and the agent's reply credential (an ``X-Cdgpc-Reply-Auth:`` line) and its
    `ExchangeResponse` JSON on stdout (`slurm_cdgpc.transport.forward`). The host is the node's
    name, or the host of its ``ssh://HOST[:PORT]`` agent URL (`ssh_url`). The remote command's
    words are quoted for the remote shell; stdout and stderr are capped.

    ``options`` are ``Key=value`` ssh options passed as ``-o`` (``User=root``,
    ``IdentityFile=/etc/cdgpc/ssh/id_ed25519``, ``UserKnownHostsFile=...``); ``config_file`` is
    passed as ``-F``. ``timeout_s`` bounds each node's whole exchange (connect, authenticate,
    run, answer); past it the ssh process is killed. At most ``max_parallel`` ssh run at once.
    ``signer`` signs each request and checks the agent's signed answer (on the ssh's thread).
    """

    def __init__(
        self,
        ssh_path: str | os.PathLike[str] = DEFAULT_SSH_PATH,
        *,
        signer: Signer,
        timeout_s: float,
        options: Sequence[str] = (),
        config_file: str | os.PathLike[str] | None = None,
        remote_command: Sequence[str] = DEFAULT_REMOTE_COMMAND,
        max_parallel: int = 64,
        max_reply_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        program = os.fspath(ssh_path)
        if not os.path.isabs(program):
            raise InputError(f"ssh program must be an absolute path, got {program!r}")
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise InputError(f"exchange timeout must be positive, got {timeout_s}")
        if max_parallel < 1:
            raise InputError(f"max_parallel must be at least 1, got {max_parallel}")
        if not remote_command or not all(
            isinstance(word, str) and word and word.isprintable() for word in remote_command
        ):
            raise InputError(f"remote command must be printable words, got {remote_command!r}")
        self.signer = signer
        self.timeout_s = timeout_s
        self.max_reply_bytes = max_reply_bytes
        connect_timeout_s = max(1, math.ceil(timeout_s))
        self._prefix: tuple[str, ...] = (
            program,
            "-o",
            "BatchMode=yes",
            "-o",
            f"ConnectTimeout={connect_timeout_s}",
            *(() if config_file is None else ("-F", os.fspath(config_file))),
            *(word for option in options for word in ("-o", _check_option(option))),
        )
        # ssh joins the words with spaces for the remote shell: quote each one
        self._remote = " ".join(shlex.quote(word) for word in remote_command)
        self._pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="ssh")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def argv(self, node: str, url: str = "") -> list[str]:
        """The ssh command line for ``node`` (`InputError` if the name or URL is unsafe)."""
        dest = _destination(node, url)
        port = () if dest.port is None else ("-p", str(dest.port))
        return [*self._prefix, *port, "--", dest.host, self._remote]

    def exchange(
        self, targets: Mapping[str, NodeTarget]
    ) -> dict[str, ExchangeResponse | NodeFailure]:
        """Exchange with every node at once; every node gets an answer or a `NodeFailure`."""
        futures: dict[str, Future[ExchangeResponse | NodeFailure]] = {
            node: self._pool.submit(self._one, node, target) for node, target in targets.items()
        }
        # each ssh is killed at its own deadline; queued behind max_parallel, a node may wait
        # up to one more timeout to start
        deadline = time.monotonic() + 2 * self.timeout_s + _KILL_WAIT_S
        results: dict[str, ExchangeResponse | NodeFailure] = {}
        for node, future in futures.items():
            try:
                results[node] = future.result(timeout=max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                future.cancel()
                results[node] = NodeFailure(f"ssh: no answer within {2 * self.timeout_s:g} s")
        return results

    def _one(self, node: str, target: NodeTarget) -> ExchangeResponse | NodeFailure:
        try:
            argv = self.argv(node, target.url)
        except InputError as e:
            logger.warning("node %r: not exchanged over ssh: %s", node, e)
            return NodeFailure(one_line(f"ssh: refused: {e}"))
        host = argv[-2]
        body = target.request.to_json()
        try:
            signed = self.signer.sign_request("POST", EXCHANGE_PATH, body)
        except CdgpcError as e:
            return NodeFailure(one_line(f"{host}: {e}"))
        finished = self._run(argv, envelope(REQUEST_HEADER, signed.credential, body))
        if isinstance(finished, NodeFailure):
            return finished
        if finished.returncode != 0:
            reason = _stderr_reason(finished.stderr)
            what = (
                "ssh failed"
                if finished.returncode == SSH_FAILED_STATUS
                else "exchange failed on the node"
            )
            return NodeFailure(f"{host}: {what} (exit {finished.returncode}): {reason}")
        if finished.stderr:
            logger.debug(
                "%s: ssh stderr: %s", host, one_line(finished.stderr.decode("utf-8", "replace"))
            )
        try:
            credential, data = open_envelope(finished.stdout, REPLY_HEADER)
        except ProtocolError as e:
            return NodeFailure(one_line(f"{host} over ssh: bad reply: {e}"))
        where = f"{host} over ssh"
        epoch = target.request.epoch
        return exchange_answer(self.signer, node, where, signed.nonce, epoch, 200, data, credential)

    def _run(self, argv: list[str], request: bytes) -> _Finished | NodeFailure:
        """Run one ssh (no shell) with the request on stdin, bounded in time and output."""
        host = argv[-2]
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                close_fds=True,
                start_new_session=True,  # its own process group: a timeout kills ProxyCommands too
            )
        except OSError as e:
            return NodeFailure(one_line(f"{host}: cannot run {argv[0]}: {e.strerror or e}"))
        try:
            return self._talk(proc, host, request)
        finally:
            if proc.poll() is None:
                _kill_group(proc)
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()

    def _talk(
        self, proc: subprocess.Popen[bytes], host: str, request: bytes
    ) -> _Finished | NodeFailure:
        """Write the request, read the reply until stdout closes and ssh exits, or time runs out."""
        stdin, stdout, stderr = proc.stdin, proc.stdout, proc.stderr
        if stdin is None or stdout is None or stderr is None:  # for the type checker
            return NodeFailure(f"{host}: ssh started without pipes")
        deadline = time.monotonic() + self.timeout_s
        late = NodeFailure(f"{host}: no answer over ssh within {self.timeout_s:g} s")
        out = bytearray()
        err = bytearray()
        pending = memoryview(request)
        os.set_blocking(stdin.fileno(), False)
        with selectors.DefaultSelector() as selector:
            selector.register(stdin, selectors.EVENT_WRITE)
            selector.register(stdout, selectors.EVENT_READ, out)
            selector.register(stderr, selectors.EVENT_READ, err)
            # done when stdout is closed and ssh has exited (a child it left behind may hold
            # stderr open: what ssh itself wrote there is read below, without waiting)
            while stdout in _registered(selector) or proc.poll() is None:
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    return late
                if not _registered(selector):  # all pipes closed: wait for the exit status
                    try:
                        proc.wait(remaining_s)
                    except subprocess.TimeoutExpired:
                        return late
                    break
                for key, _ in selector.select(min(remaining_s, 0.5)):
                    if key.fileobj is stdin:
                        try:
                            pending = pending[os.write(key.fd, pending) :]
                        except BrokenPipeError:  # it will not read: its exit status says why
                            pending = pending[:0]
                        if not pending:
                            selector.unregister(stdin)
                            stdin.close()
                        continue
                    chunk = os.read(key.fd, _CHUNK_BYTES)
                    if not chunk:
                        selector.unregister(key.fileobj)
                    elif key.data is out:
                        out.extend(chunk)
                        if len(out) > self.max_reply_bytes:
                            return NodeFailure(
                                f"{host}: reply over ssh larger than {self.max_reply_bytes} bytes"
                            )
                    else:
                        err.extend(chunk[: max(MAX_STDERR_BYTES - len(err), 0)])
            if stderr in _registered(selector):
                _drain(stderr.fileno(), err)
        return _Finished(proc.returncode, bytes(out), bytes(err))


def _registered(selector: selectors.BaseSelector) -> set[object]:
    return {key.fileobj for key in selector.get_map().values()}


def _drain(fd: int, buffer: bytearray) -> None:
    """Read what is already in a pipe, without waiting for its writer to close it."""
    os.set_blocking(fd, False)
    try:
        while len(buffer) < MAX_STDERR_BYTES:
            chunk = os.read(fd, _CHUNK_BYTES)
            if not chunk:
                return
            buffer.extend(chunk[: MAX_STDERR_BYTES - len(buffer)])
    except BlockingIOError:
        return


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the ssh we started and its process group (it leads a session of its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except OSError:
        proc.kill()
    try:
        proc.wait(_KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        logger.error("ssh (pid %d) did not die after SIGKILL", proc.pid)
