"""Signers and verifiers built from the ``[auth]`` section, one place for every daemon and hook. The
HMAC key must be root-only (`HmacKey.load`); a MUNGE signer takes the head's signed answers from
root or ``auth.slurm_user`` (`head_uids`), the agents' from root only. It never reaches `agent/`
or `coordinator/` (`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Authentication";
test: `tests/security/test_reply_auth.py`.
"""

from __future__ import annotations

import subprocess

from slurm_cdgpc.config import Config
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.transport.auth import (
    DEFAULT_TIMEOUT_S,
    AccessPolicy,
    HmacKey,
    HmacSigner,
    HmacVerifier,
    MungeSigner,
    MungeVerifier,
    ReplayCache,
    Signer,
    Verifier,
)


def signer_from_config(config: Config, timeout_s: float = DEFAULT_TIMEOUT_S) -> Signer:
    """Credentials for outgoing requests per ``auth.method``."""
    auth = config.auth
    if auth.method == "hmac":
        return HmacSigner(HmacKey.load(auth.hmac_key_file, owner_uid=0))
    return MungeSigner(socket=auth.munge_socket, timeout_s=timeout_s, head_uids=head_uids(config))


def head_uids(config: Config) -> frozenset[int]:
    """Who may answer for the head under MUNGE: root and the Slurm user (root alone when that
    user is unknown here)."""
    try:
        return AccessPolicy.from_names(slurm_user=config.auth.slurm_user).node_uids
    except InputError:
        return frozenset({0})


def verifier_from_config(config: Config) -> Verifier:
    """The credential checker per ``auth.method``, with its own replay cache."""
    auth = config.auth
    cache = ReplayCache(max_skew_s=auth.max_clock_skew_s)
    if auth.method == "hmac":
        return HmacVerifier(HmacKey.load(auth.hmac_key_file, owner_uid=0), replay_cache=cache)
    return MungeVerifier(socket=auth.munge_socket, replay_cache=cache)


def munge_works(timeout_s: float = 3.0) -> bool:
    """Whether a credential from ``munge -n`` decodes with ``unmunge`` (munged is up): the demo
    picks MUNGE when it does."""
    import shutil  # noqa: PLC0415 (the Prolog imports this module and never asks)

    munge, unmunge = shutil.which("munge"), shutil.which("unmunge")
    if munge is None or unmunge is None:
        return False
    try:
        credential = subprocess.run(
            [munge, "-n"], capture_output=True, timeout=timeout_s, check=True
        ).stdout
        subprocess.run(
            [unmunge], input=credential, capture_output=True, timeout=timeout_s, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return True
