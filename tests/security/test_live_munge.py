"""Wrong uid over MUNGE: a non-root, non-Slurm user may read, and nothing else, on every endpoint.

With MUNGE the uid is munged's word, not the sender's claim, so this is where per-user refusals
are real: the same requests that root may send are refused with 403 when ``nobody`` signs them
(``runuser``, as in ``tests/integration/test_munge_auth.py``), and the state stays as it was.
Skips without MUNGE locally; fails under ``CI=true``, where MUNGE must be installed.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from slurm_cdgpc.localcluster import free_port
from slurm_cdgpc.transport.auth import MungeSigner
from tests.evidence import record
from tests.integration import munge_fixture
from tests.integration.munge_fixture import MungeDaemon, unavailable
from tests.security.live import (
    Daemon,
    Reply,
    make_keys,
    raw_request,
    start_agent,
    start_head,
    stop_all,
)

munged = munge_fixture.munged
munged_factory = munge_fixture.munged_factory

pytestmark = [pytest.mark.security, pytest.mark.live]


@dataclass
class MungeSite:
    head: Daemon
    agent: Daemon
    root: MungeSigner
    nobody: MungeSigner

    def send(self, d: Daemon, signer: MungeSigner, method: str, path: str, body: bytes) -> Reply:
        credential = signer.sign(method, path, body)
        return raw_request(d.port, method, path, body, credentials=[credential])

    def ok(self, d: Daemon, method: str, path: str, payload: object | None = None) -> Any:
        body = b"" if payload is None else json.dumps(payload).encode()
        reply = self.send(d, self.root, method, path, body)
        assert reply.status == 200, (method, path, reply.status, reply.body[:300])
        return reply.json()

    def state(self) -> object:
        state_file = Path(self.agent.extra["state"])
        return (
            self.ok(self.head, "GET", "/v1/jobs")["jobs"],
            self.ok(self.head, "GET", "/v1/nodes")["nodes"],
            self.ok(self.head, "GET", "/v1/budget"),
            json.loads(state_file.read_text())["locks"] if state_file.exists() else None,
        )


def _exchange(job: str, gpu: int) -> dict[str, object]:
    return {
        "version": 1,
        "node": "node1",
        "interval": 1,
        "lease_expires_s": time.time() + 3600,
        "setpoints": [{"gpu": gpu, "job_id": job, "graphics_mhz": 1200}],
        "release": [],
    }


@pytest.fixture(scope="module")
def site(munged: MungeDaemon, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MungeSite]:
    if os.geteuid() != 0:
        unavailable("signing as another user needs root (runuser)")
    runuser = shutil.which("runuser", path="/usr/sbin:/usr/bin:/sbin:/bin")
    if runuser is None:
        unavailable("runuser (util-linux) is not installed")
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        unavailable("there is no user 'nobody'")
    home = tmp_path_factory.mktemp("security-munge")
    wrapper = home / "munge-as-nobody"
    wrapper.write_text(f'#!/bin/sh\nexec {runuser} -u nobody -- {munged.programs.munge} "$@"\n')
    wrapper.chmod(0o700)
    auth = {"method": "munge", "munge_socket": str(munged.socket)}
    keys = make_keys(home)  # unused by MUNGE daemons; the helpers want one
    head = start_head(home / "head", keys, hmac_is_admin=False, auth=auth)
    try:
        agent = start_agent(home / "node1", keys, auth=auth)
    except BaseException:
        stop_all([head])
        raise
    s = MungeSite(
        head,
        agent,
        MungeSigner(munged.programs.munge, socket=munged.socket),
        MungeSigner(wrapper, socket=munged.socket),
    )
    try:
        s.ok(head, "POST", "/v1/nodes", {"node": "ghost", "url": f"http://127.0.0.1:{free_port()}"})
        s.ok(
            head,
            "POST",
            "/v1/jobs",
            {"job_id": "100", "user": "root", "node": "ghost", "gpus": [0]},
        )
        s.ok(agent, "POST", "/v1/exchange", _exchange("100", 0))
        yield s
    finally:
        stop_all([head, agent])


def _requests() -> list[tuple[str, str, str, object | None]]:
    return [
        (
            "head",
            "POST",
            "/v1/jobs",
            {"job_id": "666", "user": "root", "node": "ghost", "gpus": [1]},
        ),
        ("head", "DELETE", "/v1/jobs/100", None),
        ("head", "POST", "/v1/nodes", {"node": "evil", "url": "http://127.0.0.1:9"}),
        ("head", "POST", "/v1/budget", {"budget_w": 1.0, "reason": "attack"}),
        ("agent", "POST", "/v1/exchange", _exchange("666", 1)),
        ("agent", "POST", "/v1/release", {"job_id": "100"}),
    ]


def test_a_non_root_user_may_not_register_release_announce_or_change_the_budget(
    site: MungeSite,
) -> None:
    for server, method, path, payload in _requests():
        d = site.head if server == "head" else site.agent
        body = b"" if payload is None else json.dumps(payload).encode()
        before = site.state()
        reply = site.send(d, site.nobody, method, path, body)
        changed = site.state() != before
        template = "/v1/jobs/{id}" if method == "DELETE" else path
        record(
            "attack",
            f"wrong-uid:{server} {method} {template} (munge)",
            tried=1,
            refused=int(reply.status == 403),
            accepted=int(reply.status < 400),
            state_changed=int(changed),
        )
        assert reply.status == 403, (server, method, path, reply.status, reply.body[:300])
        assert "nobody (uid" in reply.error()
        assert not changed, (server, method, path)
    # reading is every authenticated user's right: the refusals above are about the uid
    assert site.send(site.head, site.nobody, "GET", "/v1/status", b"").status == 200


def test_root_may_do_what_nobody_may_not(site: MungeSite) -> None:
    """The control: the same requests signed by root are accepted (and change the state)."""
    for server, method, path, payload in _requests():
        d = site.head if server == "head" else site.agent
        body = b"" if payload is None else json.dumps(payload).encode()
        before = site.state()
        reply = site.send(d, site.root, method, path, body)
        assert reply.status == 200, (server, method, path, reply.status, reply.body[:300])
        assert site.state() != before, (server, method, path)
