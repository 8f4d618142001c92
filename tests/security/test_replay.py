"""Replay protection across a restart: what was signed before a verifier started is refused."""

from __future__ import annotations

import pytest

from slurm_cdgpc.transport.auth import (
    ExpiredCredentialError,
    HmacKey,
    HmacSigner,
    HmacVerifier,
    ReplayCache,
)

pytestmark = pytest.mark.security

T0 = 1_767_225_600.0
KEY = HmacKey(b"k" * 32)


def _signed_at(t_s: float) -> str:
    return HmacSigner(KEY, uid=0, gid=0, clock=lambda: t_s).sign("GET", "/v1/status", b"")


def test_a_fresh_credential_signed_before_the_start_is_refused() -> None:
    old = _signed_at(T0 + 50)  # 50 s old at the start: fresh, but possibly seen by the last run
    verifier = HmacVerifier(KEY, clock=lambda: T0 + 100)
    with pytest.raises(ExpiredCredentialError, match="before this service started"):
        verifier.verify(old, "GET", "/v1/status", b"")
    # the sender's next request, signed now, passes
    assert verifier.verify(_signed_at(T0 + 100), "GET", "/v1/status", b"").uid == 0


def test_a_credential_signed_in_the_second_of_the_start_passes() -> None:
    verifier = HmacVerifier(KEY, clock=lambda: T0 + 100.9)
    assert verifier.verify(_signed_at(T0 + 100.1), "GET", "/v1/status", b"").uid == 0


def test_the_start_mark_never_moves_back() -> None:
    cache = ReplayCache()
    cache.refuse_signed_before(T0 + 100)
    cache.refuse_signed_before(T0 + 10)  # a second verifier sharing the cache, built earlier
    with pytest.raises(ExpiredCredentialError, match="before this service started"):
        cache.admit("k", int(T0 + 99), T0 + 120)
    cache.admit("k", int(T0 + 100), T0 + 120)
