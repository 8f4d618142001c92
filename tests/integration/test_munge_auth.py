"""MUNGE authentication against real, private munged daemons (see munge_fixture.py)."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_cdgpc.transport.auth import (
    MUNGE_SCHEME,
    AccessPolicy,
    AuthUnavailableError,
    ExpiredCredentialError,
    ForbiddenError,
    InvalidCredentialError,
    MalformedCredentialError,
    MungeSigner,
    MungeVerifier,
    Operation,
    ReplayedCredentialError,
)
from tests.integration import munge_fixture
from tests.integration.munge_fixture import MungeDaemon, unavailable

# The private-munged fixtures, under the names the tests ask for (a conftest may provide them too).
munged = munge_fixture.munged
munged_factory = munge_fixture.munged_factory

pytestmark = [pytest.mark.live, pytest.mark.security]

BODY = b'{"job_id": 42, "deadline": "2026-12-01T12:00", "gpus": [0, 1]}'


def signer_for(daemon: MungeDaemon, ttl_s: int | None = None) -> MungeSigner:
    return MungeSigner(daemon.programs.munge, socket=daemon.socket, ttl_s=ttl_s)


def verifier_for(daemon: MungeDaemon, clock: Callable[[], float] = time.time) -> MungeVerifier:
    return MungeVerifier(daemon.programs.unmunge, socket=daemon.socket, clock=clock)


@pytest.fixture
def signer(munged: MungeDaemon) -> MungeSigner:
    return signer_for(munged)


@pytest.fixture
def verifier(munged: MungeDaemon) -> MungeVerifier:
    return verifier_for(munged)


@pytest.fixture
def policy() -> AccessPolicy:
    return AccessPolicy.from_names(slurm_user=None, admin_users=["root"])


def test_round_trip_yields_the_senders_uid_and_gid(
    signer: MungeSigner, verifier: MungeVerifier
) -> None:
    credential = signer.sign("POST", "/v1/jobs", BODY)
    assert credential.startswith("munge MUNGE:")
    assert credential.isascii() and credential.isprintable()
    principal = verifier.verify(credential, "POST", "/v1/jobs", BODY)
    assert (principal.uid, principal.gid) == (os.geteuid(), os.getegid())
    assert principal.user == pwd.getpwuid(os.geteuid()).pw_name
    assert principal.scheme == MUNGE_SCHEME


@pytest.fixture
def munge_as_nobody(munged: MungeDaemon, tmp_path: Path) -> tuple[Path, pwd.struct_passwd]:
    """A `munge` program that runs the real one as ``nobody`` (needs root, as CI runs)."""
    if os.geteuid() != 0:
        unavailable("signing as another user needs root (runuser)")
    runuser = shutil.which("runuser", path="/usr/sbin:/usr/bin:/sbin:/bin")
    if runuser is None:
        unavailable("runuser (util-linux) is not installed")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        unavailable("there is no user 'nobody'")
    wrapper = tmp_path / "munge-as-nobody"
    wrapper.write_text(f'#!/bin/sh\nexec {runuser} -u nobody -- {munged.programs.munge} "$@"\n')
    wrapper.chmod(0o700)
    return wrapper, nobody


def test_non_root_sender_is_authenticated_as_itself_and_refused_node_and_admin(
    munged: MungeDaemon,
    munge_as_nobody: tuple[Path, pwd.struct_passwd],
    verifier: MungeVerifier,
    policy: AccessPolicy,
) -> None:
    wrapper, nobody = munge_as_nobody
    signer = MungeSigner(wrapper, socket=munged.socket)
    credential = signer.sign("POST", "/v1/jobs", BODY)
    principal = verifier.verify(credential, "POST", "/v1/jobs", BODY)
    assert (principal.uid, principal.gid, principal.user) == (
        nobody.pw_uid,
        nobody.pw_gid,
        "nobody",
    )
    policy.require(principal, Operation.READ)
    for operation in (Operation.NODE, Operation.ADMIN):
        with pytest.raises(ForbiddenError, match=r"nobody \(uid \d+") as info:
            policy.require(principal, operation)
        assert "\n" not in str(info.value)


def test_root_sender_may_do_node_and_configured_admin_operations(
    signer: MungeSigner, verifier: MungeVerifier, policy: AccessPolicy
) -> None:
    if os.geteuid() != 0:
        pytest.skip("the sender is root only when the tests run as root")
    principal = verifier.verify(
        signer.sign("PUT", "/v1/budget", b"450kW"), "PUT", "/v1/budget", b"450kW"
    )
    policy.require(principal, Operation.NODE)
    policy.require(principal, Operation.ADMIN)
    with pytest.raises(ForbiddenError):
        AccessPolicy.from_names().require(principal, Operation.ADMIN)


@pytest.mark.parametrize(
    ("method", "path", "body", "what"),
    [
        ("PUT", "/v1/jobs", BODY, "method"),
        ("POST", "/v1/jobs/7", BODY, "path"),
        ("POST", "/v1/jobs", BODY.replace(b"42", b"43"), "body"),
    ],
)
def test_credential_for_another_request_is_refused(
    signer: MungeSigner, verifier: MungeVerifier, method: str, path: str, body: bytes, what: str
) -> None:
    credential = signer.sign("POST", "/v1/jobs", BODY)
    with pytest.raises(InvalidCredentialError, match=f"different {what}"):
        verifier.verify(credential, method, path, body)


def test_tampered_credential_is_refused(signer: MungeSigner, verifier: MungeVerifier) -> None:
    credential = signer.sign("POST", "/v1/jobs", BODY)
    middle = len(credential) // 2
    flipped = "B" if credential[middle] != "B" else "C"
    tampered = credential[:middle] + flipped + credential[middle + 1 :]
    with pytest.raises(InvalidCredentialError, match="MUNGE credential refused") as info:
        verifier.verify(tampered, "POST", "/v1/jobs", BODY)
    assert "\n" not in str(info.value)
    with pytest.raises(MalformedCredentialError):
        verifier.verify(credential[:-1], "POST", "/v1/jobs", BODY)


def test_munge_payload_that_is_not_ours_is_refused(
    munged: MungeDaemon, verifier: MungeVerifier
) -> None:
    armored = subprocess.run(
        [munged.programs.munge, f"--socket={munged.socket}", "--string=POST /v1/jobs"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout.strip()
    with pytest.raises(InvalidCredentialError, match="not a cdgpc request"):
        verifier.verify(f"munge {armored}", "POST", "/v1/jobs", BODY)


def test_replay_is_refused(signer: MungeSigner, verifier: MungeVerifier) -> None:
    credential = signer.sign("POST", "/v1/report", BODY)
    verifier.verify(credential, "POST", "/v1/report", BODY)
    with pytest.raises(ReplayedCredentialError):
        verifier.verify(credential, "POST", "/v1/report", BODY)


def test_credential_from_another_munge_key_is_refused(
    munged_factory: Callable[[str], MungeDaemon], verifier: MungeVerifier
) -> None:
    other = munged_factory("other-key")
    credential = signer_for(other).sign("POST", "/v1/jobs", BODY)
    assert verifier_for(other).verify(credential, "POST", "/v1/jobs", BODY).scheme == MUNGE_SCHEME
    fresh = signer_for(other).sign("POST", "/v1/jobs", BODY)
    with pytest.raises(InvalidCredentialError, match="MUNGE credential refused"):
        verifier.verify(fresh, "POST", "/v1/jobs", BODY)


def test_credential_older_than_our_window_is_refused(munged: MungeDaemon) -> None:
    credential = signer_for(munged).sign("GET", "/v1/status", b"")
    later = verifier_for(munged, clock=lambda: time.time() + 61)
    with pytest.raises(ExpiredCredentialError, match="expired"):
        later.verify(credential, "GET", "/v1/status", b"")


def test_credential_past_its_munge_ttl_is_refused(munged: MungeDaemon) -> None:
    credential = signer_for(munged, ttl_s=1).sign("GET", "/v1/status", b"")
    time.sleep(2.2)
    with pytest.raises(ExpiredCredentialError, match="MUNGE credential refused"):
        verifier_for(munged).verify(credential, "GET", "/v1/status", b"")


def test_unreachable_munged_is_unavailable_not_a_refusal(
    munged: MungeDaemon, tmp_path: Path, signer: MungeSigner
) -> None:
    credential = signer.sign("GET", "/v1/status", b"")
    gone = tmp_path / "no.socket"
    with pytest.raises(AuthUnavailableError, match="unmunge failed"):
        MungeVerifier(munged.programs.unmunge, socket=gone).verify(
            credential, "GET", "/v1/status", b""
        )
    with pytest.raises(AuthUnavailableError, match="munge failed"):
        MungeSigner(munged.programs.munge, socket=gone).sign("GET", "/v1/status", b"")
