"""The node's spool: registrations and deregistrations the head could not take when they happened.

A job never waits for the head: the hooks spool and return, and `forward_spool` sends the records
later. The Prolog imports it: it pulls in the standard library and this package alone
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "The Prolog and Epilog"; test:
`tests/unit/test_slurm_hooks.py`.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from slurm_cdgpc.errors import InputError, SoftError
from slurm_cdgpc.transport.http import HeadRefusedError, HeadUnavailableError
from slurm_cdgpc.wire.names import JOB_ID

logger = logging.getLogger(__name__)

DEFAULT_SPOOL_DIR: Final = Path("/var/spool/cdgpc")
MAX_RECORDS: Final = 10_000
MAX_RECORD_BYTES: Final = 64 * 1024
OPS: Final = ("register", "deregister")
_NAME: Final = re.compile(
    rf"[0-9]{{20}}-[0-9a-f]{{8}}-(register|deregister)-{JOB_ID.pattern}\.json"
)
_LOCK_NAME: Final = ".lock"


class SpoolError(SoftError):
    """The spool directory cannot be used (missing permission, full disk, too many records)."""


class JobsClient(Protocol):
    """What forwarding needs of `slurm_cdgpc.transport.http.HeadClient`."""

    def post(self, path: str, payload: dict[str, object]) -> Any: ...

    def delete(self, path: str) -> Any: ...


@dataclass(frozen=True)
class SpoolRecord:
    """One spooled request, one JSON file: ``{"op": "register", "job_id", "payload": <POST
    /v1/jobs body>, "spooled_at_s"}`` or ``{"op": "deregister", "job_id", "spooled_at_s"}``."""

    op: str
    job_id: str
    payload: dict[str, object] | None
    spooled_at_s: float

    def to_json(self) -> bytes:
        data: dict[str, object] = {
            "op": self.op,
            "job_id": self.job_id,
            "spooled_at_s": self.spooled_at_s,
        }
        if self.payload is not None:
            data["payload"] = self.payload
        return json.dumps(data, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> SpoolRecord:
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise InputError(f"spool record is not JSON: {e}") from None
        if (
            not isinstance(d, dict)
            or d.get("op") not in OPS
            or not isinstance(d.get("job_id"), str)
        ):
            raise InputError("spool record lacks op or job_id")
        payload = d.get("payload")
        if d["op"] == "register" and not isinstance(payload, dict):
            raise InputError("spool record: a registration without its payload")
        spooled = d.get("spooled_at_s")
        return cls(
            op=d["op"],
            job_id=d["job_id"],
            payload=payload if isinstance(payload, dict) else None,
            spooled_at_s=float(spooled) if isinstance(spooled, int | float) else 0.0,
        )


@dataclass(frozen=True)
class ForwardResult:
    """What one `forward_spool` pass did: sent to the head, dropped as hopeless, still waiting."""

    sent: int = 0
    dropped: int = 0
    left: int = 0
    skipped: bool = False  # another forwarder held the lock


class Spool:
    """One spool directory (default ``/var/spool/cdgpc``, created 0700 on first write).

    Each record is written to a temporary name, synced and renamed, so a crash never leaves
    half a record."""

    def __init__(self, directory: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.directory = directory
        self._clock = clock

    def put(self, record: SpoolRecord) -> Path:
        """Write a record atomically; `SpoolError` when that is impossible."""
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if len(self.pending()) >= MAX_RECORDS:
                raise SpoolError(f"spool {self.directory} holds {MAX_RECORDS} records; not adding")
            stamp = f"{time.time_ns():020d}-{os.urandom(4).hex()}"
            final = self.directory / f"{stamp}-{record.op}-{record.job_id}.json"
            tmp = self.directory / f".{final.name}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, record.to_json())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
        except OSError as e:
            raise SpoolError(f"cannot write to spool {self.directory}: {e.strerror or e}") from e
        return final

    def spool(self, op: str, job_id: str, payload: dict[str, object] | None = None) -> Path:
        return self.put(SpoolRecord(op, job_id, payload, self._clock()))

    def pending(self) -> list[Path]:
        """Record files, oldest first (an absent directory holds none)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise SpoolError(f"cannot list spool {self.directory}: {e.strerror or e}") from e
        return [self.directory / n for n in sorted(names) if _NAME.fullmatch(n)]

    def forward(self, client: JobsClient, *, until_s: float | None = None) -> ForwardResult:
        """Send pending records oldest first until done, the head fails, or ``until_s``
        (``time.monotonic()``) passes. Never raises for the head's sake.

        Each record the head took is deleted. One it refuses as malformed (400) or does not know
        (404 on deregister) is dropped with a log line: resending it cannot help. Concurrent
        forwarders are kept apart by a non-blocking ``flock`` on ``.lock``: the loser skips."""
        try:
            lock_fd = os.open(
                self.directory / _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
            )
        except FileNotFoundError:
            return ForwardResult()
        except OSError as e:
            raise SpoolError(f"cannot lock spool {self.directory}: {e.strerror or e}") from e
        try:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return ForwardResult(left=len(self.pending()), skipped=True)
            return self._forward_locked(client, until_s)
        finally:
            os.close(lock_fd)

    def _forward_locked(self, client: JobsClient, until_s: float | None) -> ForwardResult:
        files = self.pending()
        sent = dropped = 0
        for i, path in enumerate(files):
            if until_s is not None and time.monotonic() >= until_s:
                return ForwardResult(sent, dropped, len(files) - i)
            try:
                data = path.read_bytes()[:MAX_RECORD_BYTES]
            except FileNotFoundError:  # taken by a forwarder that did not lock (old version)
                continue
            try:
                record = SpoolRecord.from_json(data)
                _send(client, record)
                sent += 1
            except HeadUnavailableError as e:
                logger.info("spool: head still unavailable (%s); %d record(s) wait", e, len(files))
                return ForwardResult(sent, dropped, len(files) - i)
            except HeadRefusedError as e:
                if e.status in (401, 403, 503) or e.status >= 500:
                    # our credentials, the head's clock or its database: may heal, keep it
                    logger.warning("spool: %s; keeping %s", e, path.name)
                    return ForwardResult(sent, dropped, len(files) - i)
                if e.status == 404 and path.name.split("-")[2] == "deregister":
                    sent += 1  # already gone: what the record asked for
                else:
                    logger.warning("spool: dropping %s: %s", path.name, e)
                    dropped += 1
            except InputError as e:
                logger.warning("spool: dropping unreadable %s: %s", path.name, e)
                dropped += 1
            path.unlink(missing_ok=True)
        return ForwardResult(sent, dropped, 0)


def _send(client: JobsClient, record: SpoolRecord) -> None:
    if record.op == "register" and record.payload is not None:
        client.post("/v1/jobs", record.payload)
    else:
        client.delete(f"/v1/jobs/{record.job_id}")
    logger.info("spool: job %s: %s forwarded", record.job_id, record.op)


def forward_spool(
    client: JobsClient, spool_dir: Path = DEFAULT_SPOOL_DIR, *, until_s: float | None = None
) -> ForwardResult:
    """Forward every spooled record in ``spool_dir`` to the head behind ``client``.

    The hooks call it after every request the head answered (bounded by their budget); the node
    agent calls it too."""
    return Spool(spool_dir).forward(client, until_s=until_s)
