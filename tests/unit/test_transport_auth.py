"""Request authentication without munged: HMAC end to end, the replay cache, the access policy,
the key-file rules, and the MUNGE code paths against small fake ``munge``/``unmunge`` programs."""

from __future__ import annotations

import base64
import logging
import os
import stat
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_cdgpc.errors import CdgpcError, FatalError, InputError, SoftError
from slurm_cdgpc.transport.auth import (
    HMAC_SCHEME,
    MUNGE_SCHEME,
    AccessPolicy,
    AuthError,
    AuthUnavailableError,
    ExpiredCredentialError,
    ForbiddenError,
    HmacKey,
    HmacSigner,
    HmacVerifier,
    InvalidCredentialError,
    KeyFileError,
    MalformedCredentialError,
    MungeSigner,
    MungeVerifier,
    Operation,
    Principal,
    ReplayCache,
    ReplayedCredentialError,
    Signer,
    Verifier,
    require_uid_in,
)

T0 = 1_800_000_000.0
SECRET = bytes(range(32)) + b"cdgpc-test-key!!"
BODY = b'{"job_id": 42, "gpus": [0, 1]}'


class Clock:
    """A settable clock: `clock.now` is what `time.time()` would return."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def key() -> HmacKey:
    return HmacKey(SECRET)


@pytest.fixture
def signer(key: HmacKey, clock: Clock) -> HmacSigner:
    return HmacSigner(key, uid=0, gid=0, clock=clock)


@pytest.fixture
def verifier(key: HmacKey, clock: Clock) -> HmacVerifier:
    return HmacVerifier(key, clock=clock)


def assert_one_line(error: BaseException, *secrets: str) -> None:
    text = str(error)
    assert text
    assert "\n" not in text
    assert "\r" not in text
    assert len(text) < 300
    for secret in secrets:
        assert secret not in text


def replace_field(credential: str, index: int, value: str) -> str:
    scheme, token = credential.split(" ")
    fields = token.split(":")
    fields[index] = value
    return f"{scheme} {':'.join(fields)}"


def bump_hex(text: str) -> str:
    """Change the last hex digit, keeping the format valid."""
    return text[:-1] + ("0" if text[-1] != "0" else "1")


# ------------------------------------------------------------------------------------------
# HMAC round trip and tampering


def test_round_trip_yields_claimed_principal(signer: HmacSigner, verifier: HmacVerifier) -> None:
    credential = signer.sign("POST", "/v1/jobs", BODY)
    assert credential.isascii() and credential.isprintable()
    assert credential.startswith(f"{HMAC_SCHEME} ")
    principal = verifier.verify(credential, "POST", "/v1/jobs", BODY)
    assert principal == Principal(uid=0, gid=0, user="root", scheme=HMAC_SCHEME)


def test_signer_and_verifier_meet_the_protocols(key: HmacKey) -> None:
    signers: list[Signer] = [HmacSigner(key), MungeSigner()]
    verifiers: list[Verifier] = [HmacVerifier(key), MungeVerifier()]
    assert [s.scheme for s in signers] == [HMAC_SCHEME, MUNGE_SCHEME]
    assert [v.scheme for v in verifiers] == [HMAC_SCHEME, MUNGE_SCHEME]


def test_default_claim_is_this_process(key: HmacKey, clock: Clock) -> None:
    credential = HmacSigner(key, clock=clock).sign("GET", "/v1/status", b"")
    principal = HmacVerifier(key, clock=clock).verify(credential, "GET", "/v1/status", b"")
    assert (principal.uid, principal.gid) == (os.getuid(), os.getgid())


def test_two_signatures_of_one_request_differ(signer: HmacSigner) -> None:
    assert signer.sign("GET", "/v1/status", b"") != signer.sign("GET", "/v1/status", b"")


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("PUT", "/v1/jobs", BODY),
        ("POST", "/v1/jobs/42", BODY),
        ("POST", "/v1/jobs", BODY + b" "),
        ("POST", "/v1/jobs", b""),
    ],
    ids=["method", "path", "body", "empty-body"],
)
def test_request_changed_after_signing_is_refused(
    signer: HmacSigner, verifier: HmacVerifier, method: str, path: str, body: bytes
) -> None:
    credential = signer.sign("POST", "/v1/jobs", BODY)
    with pytest.raises(InvalidCredentialError) as info:
        verifier.verify(credential, method, path, body)
    assert_one_line(info.value, credential, SECRET.hex())


@pytest.mark.parametrize(
    ("index", "change"),
    [
        (0, lambda v: "1000"),  # claimed uid
        (1, lambda v: "1000"),  # claimed gid
        (2, lambda v: str(int(v) - 1)),  # timestamp
        (3, bump_hex),  # nonce
        (4, bump_hex),  # the MAC itself
    ],
    ids=["uid", "gid", "timestamp", "nonce", "mac"],
)
def test_tampered_credential_field_is_refused(
    signer: HmacSigner,
    verifier: HmacVerifier,
    index: int,
    change: Callable[[str], str],
) -> None:
    credential = signer.sign("POST", "/v1/jobs", BODY)
    field = credential.split(" ")[1].split(":")[index]
    tampered = replace_field(credential, index, change(field))
    assert tampered != credential
    with pytest.raises(InvalidCredentialError):
        verifier.verify(tampered, "POST", "/v1/jobs", BODY)


def test_wrong_key_is_refused(signer: HmacSigner, clock: Clock) -> None:
    other = HmacVerifier(HmacKey(bytes(reversed(SECRET))), clock=clock)
    with pytest.raises(InvalidCredentialError, match="wrong key"):
        other.verify(signer.sign("GET", "/v1/status", b""), "GET", "/v1/status", b"")


def test_munge_credential_is_refused_by_hmac_verifier(verifier: HmacVerifier) -> None:
    with pytest.raises(MalformedCredentialError, match="accepts hmac-sha256"):
        verifier.verify("munge MUNGE:AwQFAAA=:", "GET", "/v1/status", b"")


@pytest.mark.parametrize(
    ("method", "path"),
    [("get", "/v1/status"), ("", "/v1/status"), ("GET", "v1/status"), ("GET", "/a b")],
)
def test_unsignable_request_is_refused(signer: HmacSigner, method: str, path: str) -> None:
    with pytest.raises(AuthError):
        signer.sign(method, path, b"")


def test_out_of_range_claim_cannot_be_signed(key: HmacKey) -> None:
    with pytest.raises(InputError):
        HmacSigner(key, uid=2**32 - 1)


# ------------------------------------------------------------------------------------------
# Replay and freshness through the verifier


def test_replay_is_refused(signer: HmacSigner, verifier: HmacVerifier) -> None:
    credential = signer.sign("POST", "/v1/report", BODY)
    verifier.verify(credential, "POST", "/v1/report", BODY)
    with pytest.raises(ReplayedCredentialError) as info:
        verifier.verify(credential, "POST", "/v1/report", BODY)
    assert_one_line(info.value, credential)


def test_refused_request_does_not_burn_the_nonce(
    signer: HmacSigner, verifier: HmacVerifier
) -> None:
    credential = signer.sign("POST", "/v1/report", BODY)
    with pytest.raises(InvalidCredentialError):
        verifier.verify(credential, "POST", "/v1/report", b"{}")
    assert len(verifier.replay_cache) == 0
    assert verifier.verify(credential, "POST", "/v1/report", BODY).uid == 0


def test_credential_at_the_window_edge_is_accepted_just_after_it_is_expired(
    key: HmacKey, clock: Clock
) -> None:
    signer = HmacSigner(key, uid=0, gid=0, clock=clock)
    verifier = HmacVerifier(key, clock=clock, replay_cache=ReplayCache(window_s=60))
    at_edge = signer.sign("GET", "/v1/status", b"")
    too_old = signer.sign("GET", "/v1/status", b"")
    clock.now = T0 + 60
    verifier.verify(at_edge, "GET", "/v1/status", b"")
    clock.now = T0 + 61
    with pytest.raises(ExpiredCredentialError, match="expired") as info:
        verifier.verify(too_old, "GET", "/v1/status", b"")
    assert_one_line(info.value)
    assert len(verifier.replay_cache) == 1


def test_credential_from_the_future_is_refused(key: HmacKey, clock: Clock) -> None:
    verifier = HmacVerifier(key, clock=clock, replay_cache=ReplayCache(max_skew_s=10))
    ahead = HmacSigner(key, clock=Clock(T0 + 11))
    with pytest.raises(ExpiredCredentialError, match="future"):
        verifier.verify(ahead.sign("GET", "/v1/status", b""), "GET", "/v1/status", b"")
    slightly_ahead = HmacSigner(key, clock=Clock(T0 + 10))
    verifier.verify(slightly_ahead.sign("GET", "/v1/status", b""), "GET", "/v1/status", b"")


def test_verifiers_can_share_one_replay_cache(key: HmacKey, clock: Clock) -> None:
    cache = ReplayCache()
    first = HmacVerifier(key, clock=clock, replay_cache=cache)
    second = HmacVerifier(key, clock=clock, replay_cache=cache)
    credential = HmacSigner(key, clock=clock).sign("GET", "/v1/status", b"")
    first.verify(credential, "GET", "/v1/status", b"")
    with pytest.raises(ReplayedCredentialError):
        second.verify(credential, "GET", "/v1/status", b"")


# ------------------------------------------------------------------------------------------
# Malformed credentials


def _malformed(valid: str) -> list[str]:
    return [
        "",
        " ",
        valid[:-1],
        valid[: len(HMAC_SCHEME) + 10],
        valid + ":",
        valid + " ",
        valid.replace(" ", "  ", 1),
        valid.replace(" ", "\t", 1),
        valid + "\nX-Injected: 1",
        valid.upper(),
        HMAC_SCHEME,
        f"{HMAC_SCHEME} ",
        "garbage",
        "Bearer abc.def.ghi",
        "hmac-sha256 0:0:1:zz:zz",
        "hmac-sha256 99999999999:0:" + valid.split(":", 2)[2],
        valid.replace("0", "\u0660", 1),  # an Arabic-Indic zero: str.isdigit() but not ours
        "hmac-sha256 é" + valid[len(HMAC_SCHEME) + 1 :],
        "\x00" * 40,
        valid + "A" * 1_000_000,
        "A" * 5000,
    ]


def test_malformed_credentials_get_one_line_refusals(
    signer: HmacSigner, verifier: HmacVerifier
) -> None:
    valid = signer.sign("POST", "/v1/jobs", BODY)
    for credential in _malformed(valid):
        with pytest.raises(AuthError) as info:
            verifier.verify(credential, "POST", "/v1/jobs", BODY)
        assert_one_line(info.value, SECRET.hex(), valid.rsplit(":", 1)[1])
    assert len(verifier.replay_cache) == 0


def test_non_string_credential_is_refused(verifier: HmacVerifier) -> None:
    with pytest.raises(MalformedCredentialError):
        verifier.verify(b"hmac-sha256 0:0", "GET", "/", b"")  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(credential=st.text(max_size=300))
def test_fuzz_random_text_raises_only_auth_errors(credential: str) -> None:
    verifier = HmacVerifier(HmacKey(SECRET), clock=Clock())
    with pytest.raises(AuthError) as info:
        verifier.verify(credential, "POST", "/v1/jobs", BODY)
    assert_one_line(info.value)


@settings(max_examples=300, deadline=None)
@given(
    tail=st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x7F), max_size=200),
    method=st.text(max_size=20),
    path=st.text(max_size=60),
    body=st.binary(max_size=64),
)
def test_fuzz_near_valid_credentials_and_requests(
    tail: str, method: str, path: str, body: bytes
) -> None:
    verifier = HmacVerifier(HmacKey(SECRET), clock=Clock())
    try:
        verifier.verify(f"{HMAC_SCHEME} 0:0:{int(T0)}:{tail}", method, path, body)
    except AuthError as e:
        assert_one_line(e)
    else:
        pytest.fail("a credential with a random MAC was accepted")


@settings(max_examples=100, deadline=None)
@given(method=st.sampled_from(["GET", "POST", "PUT"]), path=st.text(max_size=40), body=st.binary())
def test_fuzz_only_the_signed_request_verifies(method: str, path: str, body: bytes) -> None:
    clock = Clock()
    signer = HmacSigner(HmacKey(SECRET), clock=clock)
    credential = signer.sign("POST", "/v1/report", BODY)
    verifier = HmacVerifier(HmacKey(SECRET), clock=clock)
    if (method, path, body) == ("POST", "/v1/report", BODY):
        verifier.verify(credential, method, path, body)
        return
    with pytest.raises(AuthError):
        verifier.verify(credential, method, path, body)


# ------------------------------------------------------------------------------------------
# Replay cache


def test_replay_cache_memory_stays_bounded_and_never_lets_a_replay_through() -> None:
    cache = ReplayCache(window_s=60, max_entries=100)
    accepted: list[tuple[str, int]] = []
    for i in range(1500):
        now = T0 + i / 150  # ten seconds of a 150 requests/s flood
        key = f"nonce-{i}"
        try:
            cache.admit(key, int(now), now)
        except ExpiredCredentialError:
            pass
        else:
            accepted.append((key, int(now)))
        assert len(cache) <= 100
    assert 100 < len(accepted) < 1500  # the flood degrades, it does not stop
    now = T0 + 10
    for key, timestamp in accepted:
        with pytest.raises((ReplayedCredentialError, ExpiredCredentialError)):
            cache.admit(key, timestamp, now)


def test_replay_cache_evicts_expired_entries() -> None:
    cache = ReplayCache(window_s=60, max_entries=1000)
    for i in range(500):
        cache.admit(f"n{i}", int(T0), T0)
    assert len(cache) == 500
    cache.admit("later", int(T0 + 61), T0 + 61)
    assert len(cache) == 1


def test_replay_cache_is_not_fooled_by_a_clock_stepped_back() -> None:
    cache = ReplayCache(window_s=60)
    cache.admit("k", int(T0), T0)
    cache.admit("other", int(T0 + 61), T0 + 61)  # forgets "k": it is expired now
    with pytest.raises(ExpiredCredentialError):
        cache.admit("k", int(T0), T0 + 30)  # NTP stepped the clock back 31 s


def test_replay_cache_refusal_records_nothing() -> None:
    cache = ReplayCache(window_s=60, max_skew_s=5)
    for timestamp in (int(T0 - 61), int(T0 + 6)):
        with pytest.raises(ExpiredCredentialError):
            cache.admit("k", timestamp, T0)
    assert len(cache) == 0
    cache.admit("k", int(T0), T0)
    assert len(cache) == 1


def test_replay_cache_admits_one_of_many_concurrent_replays() -> None:
    cache = ReplayCache()
    outcomes: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(16)

    def attempt(key: str) -> None:
        start.wait()
        try:
            cache.admit(key, int(T0), T0)
        except ReplayedCredentialError:
            result = "replay"
        else:
            result = "ok"
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=attempt, args=("same",)) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["ok"] + ["replay"] * 15


@pytest.mark.parametrize(
    "kwargs", [{"window_s": 0}, {"max_skew_s": -1}, {"max_entries": 0}, {"window_s": float("nan")}]
)
def test_replay_cache_rejects_nonsense_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(InputError):
        ReplayCache(**kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------
# Key files


def write_key(path: Path, data: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def test_key_file_loads_for_its_owner(tmp_path: Path) -> None:
    path = write_key(tmp_path / "key", SECRET)
    key = HmacKey.load(path, owner_uid=os.getuid())
    assert key.secret == SECRET
    assert SECRET.hex() not in repr(key)
    assert repr(SECRET) not in repr(key)


def test_key_file_trailing_newline_is_not_part_of_the_key(tmp_path: Path) -> None:
    text = SECRET.hex().encode()
    plain = HmacKey.load(write_key(tmp_path / "a", text), owner_uid=os.getuid())
    with_newline = HmacKey.load(write_key(tmp_path / "b", text + b"\n"), owner_uid=os.getuid())
    assert plain.mac(b"m") == with_newline.mac(b"m")


@pytest.mark.skipif(os.getuid() != 0, reason="the default owner is root")
def test_key_file_default_owner_is_root(tmp_path: Path) -> None:
    assert HmacKey.load(write_key(tmp_path / "key", SECRET)).secret == SECRET


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o602, 0o660, 0o644, 0o601])
def test_key_file_with_group_or_other_access_is_refused(tmp_path: Path, mode: int) -> None:
    path = write_key(tmp_path / "key", SECRET, mode)
    with pytest.raises(KeyFileError, match="chmod 600") as info:
        HmacKey.load(path, owner_uid=os.getuid())
    assert_one_line(info.value, SECRET.hex())


def test_key_file_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    path = write_key(tmp_path / "key", SECRET)
    with pytest.raises(KeyFileError, match="owned by uid"):
        HmacKey.load(path, owner_uid=os.getuid() + 1)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a file away")
def test_key_file_not_owned_by_root_is_refused(tmp_path: Path) -> None:
    path = write_key(tmp_path / "key", SECRET)
    os.chown(path, 65534, 65534)
    with pytest.raises(KeyFileError, match="must be owned by uid 0"):
        HmacKey.load(path)


def test_short_and_huge_keys_are_refused(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="at least 32"):
        HmacKey.load(write_key(tmp_path / "short", b"x" * 31 + b"\n"), owner_uid=os.getuid())
    with pytest.raises(KeyFileError, match="larger than"):
        HmacKey.load(write_key(tmp_path / "huge", b"x" * 5000), owner_uid=os.getuid())
    with pytest.raises(KeyFileError):
        HmacKey(b"")


def test_missing_symlinked_and_special_key_files_are_refused(tmp_path: Path) -> None:
    uid = os.getuid()
    with pytest.raises(KeyFileError, match="does not exist"):
        HmacKey.load(tmp_path / "absent", owner_uid=uid)
    target = write_key(tmp_path / "key", SECRET)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(KeyFileError, match="symlink"):
        HmacKey.load(tmp_path / "link", owner_uid=uid)
    directory = tmp_path / "dir"
    directory.mkdir(mode=0o700)
    with pytest.raises(KeyFileError, match="regular file"):
        HmacKey.load(directory, owner_uid=uid)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(KeyFileError, match="regular file"):  # and does not hang on open
        HmacKey.load(fifo, owner_uid=uid)


def test_unreadable_key_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_key(tmp_path / "key", SECRET, 0o000)
    if os.getuid() == 0:  # root reads any file: make the kernel's answer the unprivileged one
        real_open = os.open

        def denied(target: object, *args: object, **kwargs: object) -> int:
            if Path(str(target)) == path:
                raise PermissionError(13, "Permission denied")
            return real_open(target, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "open", denied)
    with pytest.raises(KeyFileError, match="not readable"):
        HmacKey.load(path, owner_uid=os.getuid())


def test_error_classes_sit_under_the_project_root() -> None:
    for cls in (
        MalformedCredentialError,
        InvalidCredentialError,
        ExpiredCredentialError,
        ReplayedCredentialError,
        ForbiddenError,
    ):
        assert issubclass(cls, AuthError)
    assert issubclass(AuthError, InputError)
    assert issubclass(KeyFileError, FatalError)
    assert issubclass(AuthUnavailableError, SoftError)
    assert not issubclass(AuthUnavailableError, AuthError)
    assert issubclass(AuthUnavailableError, CdgpcError)


# ------------------------------------------------------------------------------------------
# No secrets in logs


def test_nothing_secret_is_logged(
    signer: HmacSigner, verifier: HmacVerifier, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="slurm_cdgpc")
    credential = signer.sign("POST", "/v1/jobs", BODY)
    verifier.verify(credential, "POST", "/v1/jobs", BODY)
    for bad in (credential, bump_hex(credential)):
        with pytest.raises(AuthError):
            verifier.verify(bad, "POST", "/v1/jobs", BODY)
    full = HmacVerifier(HmacKey(SECRET), replay_cache=ReplayCache(max_entries=1), clock=clock)
    for _ in range(3):
        clock.now += 1
        full.verify(signer.sign("GET", "/", b""), "GET", "/", b"")
    assert any(r.levelno == logging.WARNING for r in caplog.records)  # cache full...
    assert any(r.levelno == logging.DEBUG for r in caplog.records)  # ...and who got in
    mac = credential.rsplit(":", 1)[1]
    for record in caplog.records:  # without the key or a credential
        text = record.getMessage()
        assert SECRET.hex() not in text
        assert mac not in text
        assert credential not in text


# ------------------------------------------------------------------------------------------
# Authorisation


def munge_principal(uid: int, gid: int | None = None, user: str | None = None) -> Principal:
    return Principal(uid=uid, gid=uid if gid is None else gid, user=user, scheme=MUNGE_SCHEME)


ROOT = munge_principal(0, user="root")
SLURM = munge_principal(64030, user="slurm")
ALICE = munge_principal(1000, user="alice")
BOB = munge_principal(1001, user="bob")
NOBODY = munge_principal(65534, user="nobody")


def test_node_operations_only_for_root_and_slurm_user() -> None:
    policy = AccessPolicy(node_uids=frozenset({64030}))
    policy.require(ROOT, Operation.NODE)
    policy.require(SLURM, Operation.NODE)
    for other in (ALICE, NOBODY):
        with pytest.raises(ForbiddenError, match="may not perform node operations") as info:
            policy.require(other, Operation.NODE)
        assert_one_line(info.value)


def test_admin_operations_only_for_configured_users_and_groups() -> None:
    groups = {1000: frozenset({1000}), 1001: frozenset({1001, 2000})}
    policy = AccessPolicy(
        admin_uids=frozenset({1000}),
        admin_gids=frozenset({2000}),
        group_lookup=lambda p: groups.get(p.uid, frozenset({p.gid})),
    )
    policy.require(ALICE, Operation.ADMIN)
    policy.require(BOB, Operation.ADMIN)  # through group 2000
    for other in (ROOT, SLURM, NOBODY):
        with pytest.raises(ForbiddenError, match="admin operations"):
            policy.require(other, Operation.ADMIN)


def test_admin_users_may_not_do_node_operations() -> None:
    policy = AccessPolicy(admin_uids=frozenset({1000}))
    with pytest.raises(ForbiddenError):
        policy.require(ALICE, Operation.NODE)


def test_everyone_authenticated_may_read() -> None:
    policy = AccessPolicy()
    for principal in (ROOT, ALICE, NOBODY):
        policy.require(principal, Operation.READ)


def test_real_group_membership_is_looked_up() -> None:
    policy = AccessPolicy.from_names(admin_groups=["root"])
    assert policy.allows(ROOT, Operation.ADMIN)
    assert not policy.allows(NOBODY, Operation.ADMIN)
    unknown = munge_principal(4_000_000, gid=4_000_000)  # no passwd entry: primary gid only
    assert not policy.allows(unknown, Operation.ADMIN)
    assert AccessPolicy(admin_gids=frozenset({4_000_000})).allows(unknown, Operation.ADMIN)


def test_hmac_principals_are_node_peers_and_admins_only_when_configured() -> None:
    claims_alice = Principal(uid=1000, gid=1000, user="alice", scheme=HMAC_SCHEME)
    policy = AccessPolicy(admin_uids=frozenset({1000}))
    policy.require(claims_alice, Operation.NODE)
    with pytest.raises(ForbiddenError):
        policy.require(claims_alice, Operation.ADMIN)
    AccessPolicy(hmac_is_admin=True).require(claims_alice, Operation.ADMIN)


def test_policy_from_names_resolves_and_refuses_unknown_names() -> None:
    policy = AccessPolicy.from_names(slurm_user="nobody", admin_users=["root", "1234"])
    assert policy.node_uids == frozenset({0, 65534})
    assert policy.admin_uids == frozenset({0, 1234})
    with pytest.raises(InputError, match="unknown user"):
        AccessPolicy.from_names(slurm_user="no-such-user-cdgpc")
    with pytest.raises(InputError, match="unknown group"):
        AccessPolicy.from_names(admin_groups=["no-such-group-cdgpc"])


def test_require_uid_in() -> None:
    require_uid_in(ALICE, {1000, 1001}, "this")
    with pytest.raises(ForbiddenError, match=r"nobody \(uid 65534.*may not perform this"):
        require_uid_in(NOBODY, [0], "this")


# ------------------------------------------------------------------------------------------
# MUNGE code paths against fake programs (the real munged is in tests/integration)

FAKE_MUNGE = """
import base64, sys
sys.stdout.write("MUNGE:" + base64.b64encode(sys.stdin.buffer.read()).decode() + ":\\n")
"""

# Decodes what FAKE_MUNGE made and reports the sender that `fake_unmunge` baked in.
FAKE_UNMUNGE = """
import base64, sys
payload = base64.b64decode(sys.stdin.read().strip()[6:-1])
sys.stdout.write("STATUS: 0\\nENCODE_TIME: @TIME@\\nTTL: 300\\nUID: @UID@\\nGID: @GID@\\n")
sys.stdout.write("LENGTH: %d\\n\\n" % len(payload))
sys.stdout.flush()
sys.stdout.buffer.write(payload)
"""


def fake_program(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(stat.S_IRWXU)
    return path


def fake_unmunge(tmp_path: Path, uid: int, gid: int, encode_time: float) -> Path:
    body = FAKE_UNMUNGE.replace("@UID@", str(uid)).replace("@GID@", str(gid))
    return fake_program(tmp_path, "unmunge", body.replace("@TIME@", str(int(encode_time))))


def test_munge_round_trip_through_fake_programs(tmp_path: Path, clock: Clock) -> None:
    munge = fake_program(tmp_path, "munge", FAKE_MUNGE)
    credential = MungeSigner(munge, clock=clock).sign("POST", "/v1/jobs", BODY)
    assert credential.startswith("munge MUNGE:")
    verifier = MungeVerifier(fake_unmunge(tmp_path, 65534, 65534, T0), clock=clock)
    principal = verifier.verify(credential, "POST", "/v1/jobs", BODY)
    assert principal == Principal(65534, 65534, "nobody", MUNGE_SCHEME)
    with pytest.raises(ReplayedCredentialError):
        verifier.verify(credential, "POST", "/v1/jobs", BODY)
    with pytest.raises(InvalidCredentialError, match="different body"):
        verifier.verify(
            MungeSigner(munge, clock=clock).sign("POST", "/v1/jobs", BODY),
            "POST",
            "/v1/jobs",
            b"{}",
        )


def test_munge_encode_time_must_agree_with_signed_time(tmp_path: Path, clock: Clock) -> None:
    munge = fake_program(tmp_path, "munge", FAKE_MUNGE)
    credential = MungeSigner(munge, clock=clock).sign("GET", "/v1/status", b"")
    verifier = MungeVerifier(fake_unmunge(tmp_path, 0, 0, T0 - 3600), clock=clock)
    with pytest.raises(InvalidCredentialError, match="encode time"):
        verifier.verify(credential, "GET", "/v1/status", b"")


def test_foreign_munge_payload_is_refused(tmp_path: Path, clock: Clock) -> None:
    verifier = MungeVerifier(fake_unmunge(tmp_path, 0, 0, T0), clock=clock)
    for payload in (b"", b"slurm job credential", "é".encode(), b"cdgpc-auth-v1\nmunge\n1\n2"):
        credential = f"munge MUNGE:{base64.b64encode(payload).decode() or 'AA=='}:"
        with pytest.raises(InvalidCredentialError, match="not a cdgpc request"):
            verifier.verify(credential, "GET", "/v1/status", b"")


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (15, ExpiredCredentialError),
        (16, ExpiredCredentialError),
        (17, ReplayedCredentialError),
        (14, InvalidCredentialError),
        (8, InvalidCredentialError),
        (6, AuthUnavailableError),
        (7, AuthUnavailableError),
        (1, AuthUnavailableError),
    ],
)
def test_unmunge_exit_status_is_translated(
    tmp_path: Path, status: int, expected: type[Exception]
) -> None:
    script = f'import sys\nsys.stderr.write("unmunge: Error: status {status}\\nmore\\n")\n'
    unmunge = fake_program(tmp_path, "unmunge", script + f"sys.exit({status})\n")
    with pytest.raises(expected, match=f"status {status}$") as info:
        MungeVerifier(unmunge).verify("munge MUNGE:AAAA:", "GET", "/v1/status", b"")
    assert_one_line(info.value)


def test_munge_failures_are_one_line_unavailable_errors(tmp_path: Path) -> None:
    cases = {
        "fails": 'import sys\nsys.stderr.write("munge: Error: no socket\\n")\nsys.exit(6)\n',
        "silent": "import sys\nsys.exit(1)\n",
        "hangs": "import time\ntime.sleep(30)\n",
        "floods": "import sys\nsys.stdout.write('M' * 10_000_000)\n",
        "garbage": "print('not a credential')\n",
    }
    reasons = {
        "fails": "no socket",
        "silent": "exit status 1",
        "hangs": "timed out",
        "floods": "more than",
        "garbage": "not a MUNGE credential",
    }
    for name, script in cases.items():
        signer = MungeSigner(fake_program(tmp_path, name, script), timeout_s=1.0)
        with pytest.raises(AuthUnavailableError, match=reasons[name]) as info:
            signer.sign("GET", "/v1/status", b"")
        assert_one_line(info.value)
    with pytest.raises(AuthUnavailableError, match="cannot run"):
        MungeSigner(tmp_path / "absent").sign("GET", "/v1/status", b"")
    with pytest.raises(InputError, match="absolute"):
        MungeSigner("munge")


def test_malformed_munge_credentials_never_reach_unmunge(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    unmunge = fake_program(tmp_path, "unmunge", f"open({str(marker)!r}, 'w').close()\n")
    verifier = MungeVerifier(unmunge)
    for credential in (
        "munge",
        "munge ",
        "munge MUNGE::",
        "munge MUNGE:a b:",
        "munge x",
        "MUNGE:AA:",
    ):
        with pytest.raises(MalformedCredentialError):
            verifier.verify(credential, "GET", "/v1/status", b"")
    assert not marker.exists()
