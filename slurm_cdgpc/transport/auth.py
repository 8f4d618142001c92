"""Request and reply authentication (MUNGE or root-only HMAC) and the access policy: the only module
that knows MUNGE and reads the HMAC key. A refused request changes nothing, and no error names a
credential or a key. It never reaches `agent/` or `coordinator/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Authentication" and "The exchange"
(Signed answers); tests: `tests/unit/test_transport_auth.py`, `tests/security/test_replay.py`,
`tests/security/test_reply_auth.py`.
"""

from __future__ import annotations

import enum
import errno
import grp
import hashlib
import heapq
import hmac
import logging
import math
import os
import pwd
import re
import secrets
import selectors
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from slurm_cdgpc.errors import FatalError, InputError, SoftError, one_line
from slurm_cdgpc.wire.names import NODE_NAME

logger = logging.getLogger(__name__)

MUNGE_SCHEME: Final = "munge"
HMAC_SCHEME: Final = "hmac-sha256"

DEFAULT_MUNGE_PATH: Final = "/usr/bin/munge"
DEFAULT_UNMUNGE_PATH: Final = "/usr/bin/unmunge"

DEFAULT_WINDOW_S: Final = 60.0  # a credential older than this is expired
DEFAULT_MAX_SKEW_S: Final = 10.0  # how far in the future a sender's clock may be
DEFAULT_REPLAY_ENTRIES: Final = 200_000  # ~40 MB at worst; a full cache shortens the window
DEFAULT_TIMEOUT_S: Final = 2.0  # Prolog/Epilog must finish within a second or two

MIN_KEY_BYTES: Final = 32
MAX_KEY_BYTES: Final = 4096
MAX_CREDENTIAL_CHARS: Final = 4096
MAX_PATH_CHARS: Final = 1024

_VERSION: Final = "cdgpc-auth-v1"  # domain separation: no other MUNGE payload or MAC parses as ours
_REPLY_VERSION: Final = "cdgpc-reply-v1"  # a reply's purpose tag: never a request's

#: the response header that carries a reply credential
REPLY_HEADER: Final = "X-Cdgpc-Reply-Auth"
#: who answers in the head's reply credentials: not a node name (those start with a letter or
#: a digit), so no agent's answer passes for the head's
HEAD_RESPONDER: Final = "@cdgpcd"
_NONCE_BYTES: Final = 16
_MAX_ID: Final = 0xFFFFFFFE  # (uid_t)-1 is "no id"
_MAX_CHILD_OUTPUT_BYTES: Final = 16 * 1024
_CHILD_ENV: Final = {"LC_ALL": "C"}  # the programs are absolute paths; no PATH, no user locale

_METHOD_RE: Final = re.compile(r"[A-Z]{1,16}")
_PATH_RE: Final = re.compile(rf"/[\x21-\x7e]{{0,{MAX_PATH_CHARS - 1}}}")  # no spaces or controls
_DIGEST_RE: Final = re.compile(r"[0-9a-f]{64}")
_NONCE_RE: Final = re.compile(rf"[0-9a-f]{{{2 * _NONCE_BYTES}}}")
_INT_RE: Final = re.compile(r"[0-9]{1,12}")
_SCHEME_RE: Final = re.compile(r"[a-z0-9-]{1,24}")
_MUNGE_ARMOR_RE: Final = re.compile(r"MUNGE:[A-Za-z0-9+/=]{1,4000}:")
_HMAC_TOKEN_RE: Final = re.compile(
    r"(?P<uid>[0-9]{1,10}):(?P<gid>[0-9]{1,10}):(?P<timestamp>[0-9]{1,12})"
    rf":(?P<nonce>[0-9a-f]{{{2 * _NONCE_BYTES}}}):(?P<mac>[0-9a-f]{{64}})"
)
_HMAC_REPLY_RE: Final = re.compile(
    r"(?P<uid>[0-9]{1,10}):(?P<gid>[0-9]{1,10}):(?P<epoch>[0-9]{1,19}):(?P<mac>[0-9a-f]{64})"
)
_EPOCH_RE: Final = re.compile(r"[0-9]{1,19}")  # leader epochs are milliseconds: 13 digits now
_STATUS_RE: Final = re.compile(r"[1-5][0-9][0-9]")
#: a node's name or the head's
_RESPONDER_RE: Final = re.compile(rf"{re.escape(HEAD_RESPONDER)}|{NODE_NAME.pattern}")
_MAX_EPOCH: Final = 2**63 - 1

# unmunge exit status = munge_err_t. These mean "the credential is bad"; any other status means
# munge itself could not work (munged down, socket, timeout, out of memory).
_MUNGE_EXPIRED: Final = frozenset({15, 16})  # EMUNGE_CRED_EXPIRED, EMUNGE_CRED_REWOUND
_MUNGE_REPLAYED: Final = 17  # EMUNGE_CRED_REPLAYED
_MUNGE_INVALID: Final = frozenset({2, 3, 8, 9, 10, 11, 12, 13, 14, 18})


class AuthError(InputError):
    """A request could not be authenticated or is not allowed: refused with a one-line reason
    (HTTP 401; `ForbiddenError` 403)."""


class MalformedCredentialError(AuthError):
    """The credential is not one we can parse (wrong scheme, garbage, truncated, too long)."""


class InvalidCredentialError(AuthError):
    """Wrong signature or key, or the signed payload does not match this request."""


class ExpiredCredentialError(AuthError):
    """Signed too long ago, or too far in the future for the allowed clock skew."""


class ReplayedCredentialError(AuthError):
    """This credential (its nonce) was already used."""


class ForbiddenError(AuthError):
    """Authenticated, but this principal may not do this operation."""


class AuthUnavailableError(SoftError):
    """``munge``/``unmunge`` could not run (missing, timed out, munged not running): HTTP 503."""


class KeyFileError(FatalError):
    """The HMAC key file is missing, unreadable, too short, or not root-only."""


@dataclass(frozen=True)
class Principal:
    """Who sent a request. With HMAC the ids are only the signer's claim (`HmacSigner`)."""

    uid: int
    gid: int
    user: str | None  # from pwd on the verifying host; None when the uid has no entry
    scheme: str

    def __str__(self) -> str:
        name = self.user if self.user is not None else "?"
        return f"{name} (uid {self.uid}, gid {self.gid}, {self.scheme})"


@dataclass(frozen=True)
class SignedRequest:
    """A request's credential and its nonce, which the signed reply to it must repeat."""

    credential: str
    nonce: str


@dataclass(frozen=True)
class Verified:
    """An authenticated request: its sender, and its nonce (for the signed reply)."""

    principal: Principal
    nonce: str


@dataclass(frozen=True)
class Reply:
    """What a reply credential binds: the request it answers (by its nonce), who answers (a
    node's name or `HEAD_RESPONDER`), the leader epoch and the answer itself.

    On the client's side ``epoch`` is None where any epoch will do (the head's API answers
    carry the head's epoch; a Prolog cannot know it)."""

    nonce: str
    responder: str
    epoch: int | None
    status: int
    body_sha256: str

    @classmethod
    def to(cls, nonce: str, responder: str, epoch: int | None, status: int, body: bytes) -> Reply:
        """The binding of an answer with ``status`` and ``body`` to the request with ``nonce``;
        `InvalidCredentialError` when a field cannot be signed."""
        if not isinstance(nonce, str) or _NONCE_RE.fullmatch(nonce) is None:
            raise InvalidCredentialError("reply: the request's nonce is malformed")
        if not isinstance(responder, str) or _RESPONDER_RE.fullmatch(responder) is None:
            raise InvalidCredentialError("reply: the responder must be a node name or the head")
        if epoch is not None and not (
            isinstance(epoch, int) and not isinstance(epoch, bool) and 0 <= epoch <= _MAX_EPOCH
        ):
            raise InvalidCredentialError("reply: the leader epoch must be an integer >= 0")
        if not isinstance(status, int) or not 100 <= status <= 599:
            raise InvalidCredentialError("reply: the status must be an HTTP status")
        return cls(nonce, responder, epoch, int(status), hashlib.sha256(body).hexdigest())


class Signer(Protocol):
    """A daemon's or a client's credentials: it signs outgoing requests and its own answers,
    and checks the signed answers to the requests it made.

    A signer may also say ``in_process = True`` when signing and checking are cheap and block
    on nothing (no program, no socket): the head's exchange then does both on its event loop's
    thread rather than on a pool.
    """

    @property
    def scheme(self) -> str: ...

    def sign(self, method: str, path: str, body: bytes) -> str:
        """Return a one-line ASCII credential binding this request."""
        ...

    def sign_request(self, method: str, path: str, body: bytes) -> SignedRequest:
        """`sign`, with the nonce the credential carries."""
        ...

    def sign_reply(self, reply: Reply) -> str:
        """Return a one-line ASCII reply credential binding ``reply`` (its epoch is set)."""
        ...

    def verify_reply(self, credential: str | None, expected: Reply) -> Principal:
        """Return who signed the answer, or raise `AuthError` unless ``credential`` binds
        exactly ``expected`` and was made by an account a reply may come from."""
        ...


class Verifier(Protocol):
    """Checks credentials of incoming requests.

    A verifier may also say ``in_process = True`` when `verify` is cheap and blocks on nothing:
    the head then checks registrations on its event loop's thread rather than on a worker.
    """

    @property
    def scheme(self) -> str: ...

    def verify(self, credential: str, method: str, path: str, body: bytes) -> Principal:
        """Return the sender, or raise `AuthError` (nothing is recorded then)."""
        ...

    def verify_request(self, credential: str, method: str, path: str, body: bytes) -> Verified:
        """`verify`, with the request's nonce."""
        ...


# --------------------------------------------------------------------------------------------
# Replay protection


class ReplayCache:
    """Refuses expired, future and already-seen credentials in bounded memory (thread-safe).

    A nonce is remembered until its credential would be expired anyway (timestamp + window). When
    `max_entries` live nonces are remembered, the one with the oldest timestamp is forgotten and
    every credential stamped at or before it is refused from then on (a "watermark"): the cache
    never lets a replay through, it only shortens the effective window under a flood.

    The cache lives in memory, so a restarted service would have forgotten every nonce of the
    last window: `refuse_signed_before` (the verifiers call it with their start time) refuses
    credentials signed in an earlier second, so one captured before a restart is not replayable
    after it. A sender's next request is signed anew and passes.
    """

    def __init__(
        self,
        window_s: float = DEFAULT_WINDOW_S,
        max_skew_s: float = DEFAULT_MAX_SKEW_S,
        max_entries: int = DEFAULT_REPLAY_ENTRIES,
    ) -> None:
        if not window_s > 0 or not max_skew_s >= 0 or max_entries < 1:
            raise InputError(
                f"replay cache needs window_s > 0, max_skew_s >= 0, max_entries >= 1 "
                f"(got {window_s}, {max_skew_s}, {max_entries})"
            )
        self.window_s = float(window_s)
        self.max_skew_s = float(max_skew_s)
        self.max_entries = int(max_entries)
        self._lock = threading.Lock()
        self._seen: dict[str, int] = {}  # key -> timestamp_s
        self._by_time: list[tuple[int, str]] = []  # min-heap of (timestamp_s, key), same keys
        self._watermark_s: int | None = None
        self._not_before_s: int | None = None
        self._latest_now_s = float("-inf")

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)

    def check_fresh(self, timestamp_s: int, now_s: float) -> None:
        """Raise `ExpiredCredentialError` unless ``now - window <= timestamp <= now + skew``."""
        age_s = now_s - timestamp_s
        if age_s > self.window_s:
            raise ExpiredCredentialError(
                f"credential expired: signed {age_s:.0f} s ago (window {self.window_s:g} s)"
            )
        if -age_s > self.max_skew_s:
            raise ExpiredCredentialError(
                f"credential is {-age_s:.0f} s in the future (allowed skew "
                f"{self.max_skew_s:g} s); check the clocks (NTP)"
            )

    def refuse_signed_before(self, start_s: float) -> None:
        """Refuse credentials stamped before the second of ``start_s`` (this service's start)."""
        with self._lock:
            floor_s = math.floor(start_s)
            if self._not_before_s is None or floor_s > self._not_before_s:
                self._not_before_s = floor_s

    def admit(self, key: str, timestamp_s: int, now_s: float) -> None:
        """Record `key` if the credential is fresh and unseen; else raise and record nothing.

        Time never runs backwards here: a clock stepped back cannot revive a forgotten nonce.
        """
        with self._lock:
            now_s = max(now_s, self._latest_now_s)
            self.check_fresh(timestamp_s, now_s)
            self._latest_now_s = now_s
            self._evict_expired(now_s)
            if self._not_before_s is not None and timestamp_s < self._not_before_s:
                raise ExpiredCredentialError(
                    "credential signed before this service started (a replay?); sign a new one"
                )
            if self._watermark_s is not None and timestamp_s <= self._watermark_s:
                raise ExpiredCredentialError(
                    "credential too old for the replay cache under the current request rate; "
                    "sign a new one"
                )
            if key in self._seen:
                raise ReplayedCredentialError("credential already used (replay refused)")
            if len(self._seen) >= self.max_entries:
                oldest_s, oldest_key = heapq.heappop(self._by_time)
                del self._seen[oldest_key]
                self._watermark_s = oldest_s
                logger.warning(
                    "replay cache full (%d entries); refusing credentials signed at or before %d",
                    self.max_entries,
                    oldest_s,
                )
                if timestamp_s <= oldest_s:
                    raise ExpiredCredentialError(
                        "credential too old for the replay cache under the current request "
                        "rate; sign a new one"
                    )
            self._seen[key] = timestamp_s
            heapq.heappush(self._by_time, (timestamp_s, key))

    def _evict_expired(self, now_s: float) -> None:
        while self._by_time and now_s - self._by_time[0][0] > self.window_s:
            _, key = heapq.heappop(self._by_time)
            del self._seen[key]


# --------------------------------------------------------------------------------------------
# The signed content


@dataclass(frozen=True)
class _Claim:
    method: str
    path: str
    body_sha256: str
    timestamp_s: int
    nonce: str


def _check_request(method: str, path: str) -> None:
    if not isinstance(method, str) or _METHOD_RE.fullmatch(method) is None:
        raise AuthError("request method must be 1-16 upper-case letters")
    if not isinstance(path, str) or _PATH_RE.fullmatch(path) is None:
        raise AuthError(
            f"request path must start with '/' and be at most {MAX_PATH_CHARS} printable "
            "ASCII characters without spaces"
        )


def _new_claim(method: str, path: str, body: bytes, now_s: float) -> _Claim:
    _check_request(method, path)
    return _Claim(
        method=method,
        path=path,
        body_sha256=hashlib.sha256(body).hexdigest(),
        timestamp_s=int(now_s),
        nonce=secrets.token_hex(_NONCE_BYTES),
    )


def _munge_payload(claim: _Claim) -> bytes:
    fields = (
        _VERSION,
        MUNGE_SCHEME,
        str(claim.timestamp_s),
        claim.nonce,
        claim.method,
        claim.path,
        claim.body_sha256,
    )
    return "\n".join(fields).encode("ascii")


def _parse_munge_payload(payload: bytes) -> _Claim:
    try:
        text = payload.decode("ascii")
    except UnicodeDecodeError:
        raise InvalidCredentialError("MUNGE payload is not a cdgpc request credential") from None
    fields = text.split("\n")
    if (
        len(fields) != 7
        or fields[0] != _VERSION
        or fields[1] != MUNGE_SCHEME
        or _INT_RE.fullmatch(fields[2]) is None
        or _NONCE_RE.fullmatch(fields[3]) is None
        or _METHOD_RE.fullmatch(fields[4]) is None
        or _PATH_RE.fullmatch(fields[5]) is None
        or _DIGEST_RE.fullmatch(fields[6]) is None
    ):
        raise InvalidCredentialError("MUNGE payload is not a cdgpc request credential")
    return _Claim(
        method=fields[4],
        path=fields[5],
        body_sha256=fields[6],
        timestamp_s=int(fields[2]),
        nonce=fields[3],
    )


def _check_binding(claim: _Claim, method: str, path: str, body: bytes) -> None:
    """The signed method, path and body hash must be this request's (constant-time compares)."""
    if not hmac.compare_digest(claim.method, method):
        raise InvalidCredentialError("credential was signed for a different method")
    if not hmac.compare_digest(claim.path, path):
        raise InvalidCredentialError("credential was signed for a different path")
    if not hmac.compare_digest(claim.body_sha256, hashlib.sha256(body).hexdigest()):
        raise InvalidCredentialError("credential was signed for a different body")


def _split_credential(credential: str, scheme: str) -> str:
    """``"<scheme> <token>"`` -> token, after the checks every header value gets."""
    if not isinstance(credential, str) or not credential:
        raise MalformedCredentialError("missing credential")
    if len(credential) > MAX_CREDENTIAL_CHARS:
        raise MalformedCredentialError(f"credential longer than {MAX_CREDENTIAL_CHARS} characters")
    if not credential.isascii() or not credential.isprintable():
        raise MalformedCredentialError("credential must be one line of printable ASCII")
    given, sep, token = credential.partition(" ")
    if not sep:
        raise MalformedCredentialError(f"credential must look like '{scheme} <token>'")
    if given != scheme:
        shown = f"'{given}'" if _SCHEME_RE.fullmatch(given) else "an unknown scheme"
        raise MalformedCredentialError(f"credential uses {shown}; this service accepts {scheme}")
    return token


#: seconds a uid's account name is remembered (DESIGN.md, "The head's API": its lookup's cost)
_USER_NAME_TTL_S: Final = 60.0
_user_names: dict[int, tuple[float, str | None]] = {}


def _user_name(uid: int) -> str | None:
    now = time.monotonic()
    cached = _user_names.get(uid)
    if cached is not None and now - cached[0] < _USER_NAME_TTL_S:
        return cached[1]
    try:
        name: str | None = pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        name = None
    if len(_user_names) > 4096:
        _user_names.clear()  # a bound, not a policy: uids on one cluster are few
    _user_names[uid] = (now, name)
    return name


def _replay_key(scheme: str, uid: int, nonce: str) -> str:
    # Per sender, so that one user cannot burn another's nonce seen on the wire.
    return f"{scheme}:{uid}:{nonce}"


def _signed_epoch(reply: Reply) -> int:
    if reply.epoch is None:
        raise InputError("a reply is signed with a leader epoch (0: none)")
    return reply.epoch


def _reply_token(credential: str | None, scheme: str) -> str:
    if credential is None:
        raise MalformedCredentialError(
            f"no {REPLY_HEADER} header: the answer is not from a cdgpc daemon (or one too old)"
        )
    return _split_credential(credential, scheme)


def _check_reply_epoch(expected: Reply, epoch: int) -> None:
    if expected.epoch is not None and epoch != expected.epoch:
        raise InvalidCredentialError(
            f"reply was signed for leader epoch {epoch}, not {expected.epoch}"
        )


# --------------------------------------------------------------------------------------------
# HMAC-SHA256


@dataclass(frozen=True)
class HmacKey:
    """A shared HMAC key; its bytes never appear in repr, logs or errors."""

    secret: bytes = field(repr=False)
    source: str = "<memory>"

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_KEY_BYTES:
            raise KeyFileError(
                f"HMAC key {self.source} is {len(self.secret)} bytes; "
                f"at least {MIN_KEY_BYTES} are needed"
            )

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, owner_uid: int = 0) -> HmacKey:
        """Read a key file that only `owner_uid` (root in production) can read or write.

        Refused: a missing or unreadable file, a symlink, anything but a regular file, a file not
        owned by `owner_uid`, any group/other permission bit, fewer than 32 or more than 4096
        bytes. Trailing CR/LF are dropped, so ``openssl rand -hex 32 > key`` works. Checks run on
        the opened descriptor, so the file cannot be swapped between check and read.
        """
        where = str(path)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            raise KeyFileError(f"HMAC key file {where} does not exist") from None
        except PermissionError:
            raise KeyFileError(f"HMAC key file {where} is not readable (run as root)") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise KeyFileError(f"HMAC key file {where} is a symlink; refusing it") from None
            raise KeyFileError(f"cannot open HMAC key file {where}: {e.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise KeyFileError(f"HMAC key file {where} is not a regular file")
            if info.st_uid != owner_uid:
                raise KeyFileError(
                    f"HMAC key file {where} is owned by uid {info.st_uid}, "
                    f"must be owned by uid {owner_uid}"
                )
            if info.st_mode & 0o077:
                raise KeyFileError(
                    f"HMAC key file {where} has mode {stat.S_IMODE(info.st_mode):04o}; "
                    f"group/other must have no access (chmod 600)"
                )
            if info.st_size > MAX_KEY_BYTES:
                raise KeyFileError(f"HMAC key file {where} is larger than {MAX_KEY_BYTES} bytes")
            data = os.read(fd, MAX_KEY_BYTES + 1)
        except OSError as e:
            raise KeyFileError(f"cannot read HMAC key file {where}: {e.strerror}") from None
        finally:
            os.close(fd)
        if len(data) > MAX_KEY_BYTES:
            raise KeyFileError(f"HMAC key file {where} is larger than {MAX_KEY_BYTES} bytes")
        return cls(secret=data.rstrip(b"\r\n"), source=where)

    def mac(self, message: bytes) -> str:
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()


def _hmac_message(claim: _Claim, uid: int, gid: int) -> bytes:
    fields = (
        _VERSION,
        HMAC_SCHEME,
        str(uid),
        str(gid),
        str(claim.timestamp_s),
        claim.nonce,
        claim.method,
        claim.path,
        claim.body_sha256,
    )
    return "\n".join(fields).encode("ascii")


def _hmac_reply_message(reply: Reply, uid: int, gid: int, epoch: int) -> bytes:
    fields = (
        _REPLY_VERSION,
        HMAC_SCHEME,
        str(uid),
        str(gid),
        reply.nonce,
        reply.responder,
        str(epoch),
        str(reply.status),
        reply.body_sha256,
    )
    return "\n".join(fields).encode("ascii")


class HmacSigner:
    """Signs with the shared key; claims this process's uid/gid unless told otherwise. Nothing
    vouches for the claim (`AccessPolicy` treats every key holder as root-equivalent): the ids
    are kept in the `Principal` for the audit trail only. The credentials, one ASCII line each::

        hmac-sha256 <uid>:<gid>:<time_s>:<nonce>:<mac>      a request
        hmac-sha256 <uid>:<gid>:<epoch>:<mac>               a reply
    """

    scheme: Final = HMAC_SCHEME
    in_process: Final = True

    def __init__(
        self,
        key: HmacKey,
        *,
        uid: int | None = None,
        gid: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._key = key
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        for what, value in (("uid", self.uid), ("gid", self.gid)):
            if not 0 <= value <= _MAX_ID:
                raise InputError(f"HMAC signer {what} must be in 0..{_MAX_ID}, got {value}")
        self._clock = clock

    def sign(self, method: str, path: str, body: bytes) -> str:
        return self.sign_request(method, path, body).credential

    def sign_request(self, method: str, path: str, body: bytes) -> SignedRequest:
        claim = _new_claim(method, path, body, self._clock())
        mac = self._key.mac(_hmac_message(claim, self.uid, self.gid))
        credential = f"{HMAC_SCHEME} {self.uid}:{self.gid}:{claim.timestamp_s}:{claim.nonce}:{mac}"
        return SignedRequest(credential, claim.nonce)

    def sign_reply(self, reply: Reply) -> str:
        epoch = _signed_epoch(reply)
        mac = self._key.mac(_hmac_reply_message(reply, self.uid, self.gid, epoch))
        return f"{HMAC_SCHEME} {self.uid}:{self.gid}:{epoch}:{mac}"

    def verify_reply(self, credential: str | None, expected: Reply) -> Principal:
        """The key proves the answer; the uid it claims is kept for the log only."""
        match = _HMAC_REPLY_RE.fullmatch(_reply_token(credential, HMAC_SCHEME))
        if match is None:
            raise MalformedCredentialError(
                f"reply credential must look like '{HMAC_SCHEME} <uid>:<gid>:<epoch>:<mac>'"
            )
        uid, gid, epoch = int(match["uid"]), int(match["gid"]), int(match["epoch"])
        if uid > _MAX_ID or gid > _MAX_ID or epoch > _MAX_EPOCH:
            raise MalformedCredentialError("reply credential uid, gid or epoch out of range")
        _check_reply_epoch(expected, epoch)
        mac = self._key.mac(_hmac_reply_message(expected, uid, gid, epoch))
        if not hmac.compare_digest(mac, match["mac"]):
            raise InvalidCredentialError(
                "reply HMAC does not match: wrong key, or signed for another request, responder "
                "or answer"
            )
        return Principal(uid=uid, gid=gid, user=_user_name(uid), scheme=HMAC_SCHEME)


class HmacVerifier:
    """Checks shared-key credentials; what the claimed uid means: `HmacSigner`, and DESIGN.md,
    "Authentication"."""

    scheme: Final = HMAC_SCHEME
    in_process: Final = True

    def __init__(
        self,
        key: HmacKey,
        *,
        replay_cache: ReplayCache | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._key = key
        self.replay_cache = ReplayCache() if replay_cache is None else replay_cache
        self._clock = clock
        self.replay_cache.refuse_signed_before(clock())

    def verify(self, credential: str, method: str, path: str, body: bytes) -> Principal:
        return self.verify_request(credential, method, path, body).principal

    def verify_request(self, credential: str, method: str, path: str, body: bytes) -> Verified:
        token = _split_credential(credential, HMAC_SCHEME)
        match = _HMAC_TOKEN_RE.fullmatch(token)
        if match is None:
            raise MalformedCredentialError(
                f"credential must look like '{HMAC_SCHEME} <uid>:<gid>:<time>:<nonce>:<mac>'"
            )
        uid, gid = int(match["uid"]), int(match["gid"])
        if uid > _MAX_ID or gid > _MAX_ID:
            raise MalformedCredentialError("credential uid/gid out of range")
        _check_request(method, path)
        claim = _Claim(
            method=method,
            path=path,
            body_sha256=hashlib.sha256(body).hexdigest(),
            timestamp_s=int(match["timestamp"]),
            nonce=match["nonce"],
        )
        # The MAC covers the request as received: any change to method, path, body, time, nonce or
        # claimed ids lands here, and so does a different key.
        expected = self._key.mac(_hmac_message(claim, uid, gid))
        if not hmac.compare_digest(expected, match["mac"]):
            raise InvalidCredentialError(
                "HMAC does not match: wrong key, or the request was changed after signing"
            )
        self.replay_cache.admit(
            _replay_key(HMAC_SCHEME, uid, claim.nonce), claim.timestamp_s, self._clock()
        )
        principal = Principal(uid=uid, gid=gid, user=_user_name(uid), scheme=HMAC_SCHEME)
        logger.debug("authenticated %s for %s %s", principal, method, path)
        return Verified(principal, claim.nonce)


# --------------------------------------------------------------------------------------------
# MUNGE


@dataclass(frozen=True)
class _ChildResult:
    returncode: int
    stdout: bytes
    stderr: bytes

    def reason(self) -> str:
        """The child's first stderr line, trimmed, for a one-line error."""
        stderr = self.stderr.decode("ascii", "replace")
        return one_line(stderr, 200, keep="first", empty=f"exit status {self.returncode}")


def _run_bounded(
    argv: Sequence[str], stdin: bytes, timeout_s: float, max_output_bytes: int
) -> _ChildResult:
    """Run a program (no shell) with a timeout and a cap on stdout+stderr; kill it past either."""
    program = argv[0]
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_CHILD_ENV,
            close_fds=True,
        )
    except OSError as e:
        raise AuthUnavailableError(f"cannot run {program}: {e.strerror or e}") from e
    deadline = time.monotonic() + timeout_s
    out = bytearray()
    err = bytearray()
    with proc, selectors.DefaultSelector() as selector:
        if proc.stdin is None or proc.stdout is None or proc.stderr is None:  # for the type checker
            raise AuthUnavailableError(f"cannot talk to {program}: no pipes")
        pending = memoryview(stdin)
        if pending:
            os.set_blocking(proc.stdin.fileno(), False)
            selector.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        selector.register(proc.stdout, selectors.EVENT_READ, out)
        selector.register(proc.stderr, selectors.EVENT_READ, err)
        try:
            while selector.get_map():
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    raise AuthUnavailableError(f"{program} timed out after {timeout_s:g} s")
                for key, _ in selector.select(remaining_s):
                    if key.fileobj is proc.stdin:
                        try:
                            pending = pending[os.write(key.fd, pending) :]
                        except BrokenPipeError:
                            pending = pending[:0]
                        if not pending:
                            selector.unregister(proc.stdin)
                            proc.stdin.close()
                        continue
                    chunk = os.read(key.fd, 4096)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        continue
                    key.data.extend(chunk)
                    if len(out) + len(err) > max_output_bytes:
                        raise AuthUnavailableError(
                            f"{program} wrote more than {max_output_bytes} bytes; killed it"
                        )
            returncode = proc.wait(max(deadline - time.monotonic(), 0.001))
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AuthUnavailableError(f"{program} timed out after {timeout_s:g} s") from None
        except BaseException:
            proc.kill()
            raise
    return _ChildResult(returncode, bytes(out), bytes(err))


def _check_program(path: str | os.PathLike[str], what: str) -> str:
    text = os.fspath(path)
    if not os.path.isabs(text):
        raise InputError(f"{what} must be an absolute path, got {text!r}")
    return text


def _socket_args(socket: str | os.PathLike[str] | None) -> list[str]:
    # Long form on purpose: `munge -s` is --string (the payload), the socket is -S/--socket.
    return [] if socket is None else [f"--socket={os.fspath(socket)}"]


def _munge_reply_payload(reply: Reply, epoch: int) -> bytes:
    fields = (
        _REPLY_VERSION,
        MUNGE_SCHEME,
        reply.nonce,
        reply.responder,
        str(epoch),
        str(reply.status),
        reply.body_sha256,
    )
    return "\n".join(fields).encode("ascii")


def _check_munge_reply(payload: bytes, expected: Reply) -> None:
    """The decoded reply payload must bind exactly ``expected`` (constant-time compares)."""
    fields = payload.decode("ascii", "replace").split("\n")
    if (
        len(fields) != 7
        or fields[0] != _REPLY_VERSION
        or fields[1] != MUNGE_SCHEME
        or _NONCE_RE.fullmatch(fields[2]) is None
        or _RESPONDER_RE.fullmatch(fields[3]) is None
        or _EPOCH_RE.fullmatch(fields[4]) is None
        or _STATUS_RE.fullmatch(fields[5]) is None
        or _DIGEST_RE.fullmatch(fields[6]) is None
    ):
        raise InvalidCredentialError("MUNGE payload is not a cdgpc reply credential")
    if not hmac.compare_digest(fields[2], expected.nonce):
        raise InvalidCredentialError("reply was signed for another request (nonce)")
    if fields[3] != expected.responder:
        raise InvalidCredentialError(
            f"reply was signed by {fields[3][:60]!r}, not {expected.responder[:60]!r}"
        )
    if int(fields[4]) > _MAX_EPOCH:
        raise InvalidCredentialError("MUNGE payload is not a cdgpc reply credential")
    _check_reply_epoch(expected, int(fields[4]))
    if int(fields[5]) != expected.status:
        raise InvalidCredentialError(
            f"reply was signed for status {fields[5]}, not {expected.status}"
        )
    if not hmac.compare_digest(fields[6], expected.body_sha256):
        raise InvalidCredentialError("reply was signed for a different body")


def _munge_credential(argv: Sequence[str], payload: bytes, timeout_s: float) -> str:
    result = _run_bounded(argv, payload, timeout_s, _MAX_CHILD_OUTPUT_BYTES)
    if result.returncode != 0:
        raise AuthUnavailableError(f"munge failed: {result.reason()}")
    armored = result.stdout.decode("ascii", "replace").strip()
    if _MUNGE_ARMOR_RE.fullmatch(armored) is None:
        raise AuthUnavailableError("munge printed something that is not a MUNGE credential")
    return f"{MUNGE_SCHEME} {armored}"


class MungeSigner:
    """Signs by running ``munge`` with the payload on stdin (munged vouches for our uid/gid),
    and checks replies with ``unmunge``.

    A reply is accepted only from root (agents run as root), or, for the head's answers
    (`HEAD_RESPONDER`), from one of ``head_uids`` too: the accounts besides root that the
    agents let send setpoints (``auth.slurm_user``), under which alone a head can work. A
    request's credential and a reply's are both ``munge MUNGE:<base64>:``; each payload starts
    with its own purpose tag, so neither passes for the other."""

    scheme: Final = MUNGE_SCHEME

    def __init__(
        self,
        munge_path: str | os.PathLike[str] = DEFAULT_MUNGE_PATH,
        *,
        unmunge_path: str | os.PathLike[str] = DEFAULT_UNMUNGE_PATH,
        socket: str | os.PathLike[str] | None = None,
        ttl_s: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        head_uids: Iterable[int] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._argv = [_check_program(munge_path, "munge program"), *_socket_args(socket)]
        if ttl_s is not None:
            self._argv.append(f"--ttl={int(ttl_s)}")
        self._unmunge_argv = [
            _check_program(unmunge_path, "unmunge program"),
            "--numeric",
            *_socket_args(socket),
        ]
        self.timeout_s = timeout_s
        self.head_uids = frozenset({0, *head_uids})
        self._clock = clock

    def sign(self, method: str, path: str, body: bytes) -> str:
        return self.sign_request(method, path, body).credential

    def sign_request(self, method: str, path: str, body: bytes) -> SignedRequest:
        claim = _new_claim(method, path, body, self._clock())
        credential = _munge_credential(self._argv, _munge_payload(claim), self.timeout_s)
        return SignedRequest(credential, claim.nonce)

    def sign_reply(self, reply: Reply) -> str:
        payload = _munge_reply_payload(reply, _signed_epoch(reply))
        return _munge_credential(self._argv, payload, self.timeout_s)

    def verify_reply(self, credential: str | None, expected: Reply) -> Principal:
        armored = _reply_token(credential, MUNGE_SCHEME)
        if _MUNGE_ARMOR_RE.fullmatch(armored) is None:
            raise MalformedCredentialError(
                f"reply credential must look like '{MUNGE_SCHEME} MUNGE:...:'"
            )
        result = _run_bounded(
            self._unmunge_argv,
            armored.encode("ascii") + b"\n",
            self.timeout_s,
            _MAX_CHILD_OUTPUT_BYTES,
        )
        if result.returncode != 0:
            raise _unmunge_error(result)
        metadata, payload = _parse_unmunge_output(result.stdout)
        _check_munge_reply(payload, expected)
        uid, gid = metadata["UID"], metadata["GID"]
        allowed = self.head_uids if expected.responder == HEAD_RESPONDER else frozenset({0})
        if uid not in allowed:
            raise InvalidCredentialError(
                f"reply was made by uid {uid}, not by {_uids_text(allowed)}: not the daemon's"
            )
        return Principal(uid=uid, gid=gid, user=_user_name(uid), scheme=MUNGE_SCHEME)


def _uids_text(uids: frozenset[int]) -> str:
    return "root" if uids == {0} else "uid " + " or ".join(map(str, sorted(uids)))


class MungeVerifier:
    """Checks MUNGE credentials by running ``unmunge``; the uid/gid are munged's, not a claim.
    ``unmunge`` also gives MUNGE's own encode time and TTL, and the payload, which must match
    the request; munged refuses replayed and expired credentials itself, and the shared checks
    (`ReplayCache`) run as well."""

    scheme: Final = MUNGE_SCHEME

    def __init__(
        self,
        unmunge_path: str | os.PathLike[str] = DEFAULT_UNMUNGE_PATH,
        *,
        socket: str | os.PathLike[str] | None = None,
        replay_cache: ReplayCache | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._argv = [
            _check_program(unmunge_path, "unmunge program"),
            "--numeric",
            *_socket_args(socket),
        ]
        self.replay_cache = ReplayCache() if replay_cache is None else replay_cache
        self.timeout_s = timeout_s
        self._clock = clock
        self.replay_cache.refuse_signed_before(clock())

    def verify(self, credential: str, method: str, path: str, body: bytes) -> Principal:
        return self.verify_request(credential, method, path, body).principal

    def verify_request(self, credential: str, method: str, path: str, body: bytes) -> Verified:
        armored = _split_credential(credential, MUNGE_SCHEME)
        if _MUNGE_ARMOR_RE.fullmatch(armored) is None:
            raise MalformedCredentialError(f"credential must look like '{MUNGE_SCHEME} MUNGE:...:'")
        _check_request(method, path)
        result = _run_bounded(
            self._argv, armored.encode("ascii") + b"\n", self.timeout_s, _MAX_CHILD_OUTPUT_BYTES
        )
        if result.returncode != 0:
            raise _unmunge_error(result)
        metadata, payload = _parse_unmunge_output(result.stdout)
        claim = _parse_munge_payload(payload)
        _check_binding(claim, method, path, body)
        # The payload's time is signed inside the credential; MUNGE's encode time must agree.
        if abs(metadata["ENCODE_TIME"] - claim.timestamp_s) > self.replay_cache.max_skew_s + 1:
            raise InvalidCredentialError("MUNGE encode time does not match the signed time")
        uid, gid = metadata["UID"], metadata["GID"]
        self.replay_cache.admit(
            _replay_key(MUNGE_SCHEME, uid, claim.nonce), claim.timestamp_s, self._clock()
        )
        principal = Principal(uid=uid, gid=gid, user=_user_name(uid), scheme=MUNGE_SCHEME)
        logger.debug("authenticated %s for %s %s", principal, method, path)
        return Verified(principal, claim.nonce)


def _unmunge_error(result: _ChildResult) -> Exception:
    status, reason = result.returncode, result.reason()
    if status in _MUNGE_EXPIRED:
        return ExpiredCredentialError(f"MUNGE credential refused: {reason}")
    if status == _MUNGE_REPLAYED:
        return ReplayedCredentialError(f"MUNGE credential refused: {reason}")
    if status in _MUNGE_INVALID:
        return InvalidCredentialError(f"MUNGE credential refused: {reason}")
    return AuthUnavailableError(f"unmunge failed: {reason}")


def _parse_unmunge_output(stdout: bytes) -> tuple[dict[str, int], bytes]:
    """``unmunge --numeric`` prints ``KEY: value`` lines, a blank line, then the payload."""
    head, sep, payload = stdout.partition(b"\n\n")
    metadata: dict[str, int] = {}
    for line in head.decode("ascii", "replace").splitlines():
        name, _, value = line.partition(":")
        value = value.strip()
        if _INT_RE.fullmatch(value) is not None:
            metadata[name.strip()] = int(value)
    needed = ("UID", "GID", "ENCODE_TIME", "TTL")
    if not sep or any(name not in metadata for name in needed):
        raise AuthUnavailableError("could not read unmunge's output (unexpected format)")
    if metadata["UID"] > _MAX_ID or metadata["GID"] > _MAX_ID:
        raise AuthUnavailableError("unmunge reported an out-of-range uid/gid")
    return metadata, payload


# --------------------------------------------------------------------------------------------
# Authorisation


class Operation(enum.Enum):
    """What a request wants to do; the HTTP layer maps each route to one of these."""

    READ = "read"  # status, jobs, nodes, reports: any authenticated principal
    NODE = "node"  # register/deregister jobs, report measurements: root and the Slurm user
    ADMIN = "admin"  # change the budget: configured admin users and groups


_OPERATION_TEXT: Final = {
    Operation.NODE: "node operations (register jobs, report measurements)",
    Operation.ADMIN: "admin operations (change the budget)",
}


def require_uid_in(principal: Principal, allowed_uids: Iterable[int], operation: str) -> None:
    """Raise `ForbiddenError` unless the principal's uid is one of `allowed_uids`."""
    if principal.uid not in set(allowed_uids):
        raise ForbiddenError(f"{principal} may not perform {operation}")


def groups_of(principal: Principal) -> frozenset[int]:
    """The principal's gid plus its supplementary groups on this host (when the user is known)."""
    if principal.user is None:
        return frozenset({principal.gid})
    try:
        return frozenset({principal.gid, *os.getgrouplist(principal.user, principal.gid)})
    except OSError:
        return frozenset({principal.gid})


@dataclass(frozen=True)
class AccessPolicy:
    """Who may do what. Root may always do node operations; admins are only those configured.

    HMAC principals are root-equivalent (anyone holding the root-only key): node operations yes,
    admin operations only with ``hmac_is_admin=True``, whatever uid they claim.
    """

    node_uids: frozenset[int] = frozenset({0})
    admin_uids: frozenset[int] = frozenset()
    admin_gids: frozenset[int] = frozenset()
    hmac_is_admin: bool = False
    group_lookup: Callable[[Principal], frozenset[int]] = field(
        default=groups_of, repr=False, compare=False
    )

    @classmethod
    def from_names(
        cls,
        *,
        slurm_user: str | None = None,
        admin_users: Iterable[str] = (),
        admin_groups: Iterable[str] = (),
        hmac_is_admin: bool = False,
    ) -> AccessPolicy:
        """Resolve names (or numeric ids) from the config; an unknown name is an `InputError`."""
        node_uids = {0}
        if slurm_user is not None:
            node_uids.add(_resolve_uid(slurm_user))
        return cls(
            node_uids=frozenset(node_uids),
            admin_uids=frozenset(_resolve_uid(name) for name in admin_users),
            admin_gids=frozenset(_resolve_gid(name) for name in admin_groups),
            hmac_is_admin=hmac_is_admin,
        )

    def allows(self, principal: Principal, operation: Operation) -> bool:
        if operation is Operation.READ:
            return True
        if principal.scheme == HMAC_SCHEME:
            return operation is Operation.NODE or self.hmac_is_admin
        if operation is Operation.NODE:
            return principal.uid == 0 or principal.uid in self.node_uids
        if principal.uid in self.admin_uids:
            return True
        return bool(self.admin_gids and self.group_lookup(principal) & self.admin_gids)

    def require(self, principal: Principal, operation: Operation) -> None:
        """Raise `ForbiddenError` (one line) unless `principal` may do `operation`."""
        if not self.allows(principal, operation):
            raise ForbiddenError(f"{principal} may not perform {_OPERATION_TEXT[operation]}")


def _resolve_uid(name: str) -> int:
    if _INT_RE.fullmatch(name):
        return int(name)
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        raise InputError(f"unknown user {name!r} in the access policy") from None


def _resolve_gid(name: str) -> int:
    if _INT_RE.fullmatch(name):
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise InputError(f"unknown group {name!r} in the access policy") from None
