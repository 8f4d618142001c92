"""Shell and path injection through job comments, node names, URLs and SSH arguments.

Nothing a user or a node sends may become a shell word, an ssh option or a path: the head's API
refuses hostile names at the validation layer; free text (a GPU type, a budget reason) is stored
as data and never reaches a shell; the SSH transport refuses an unsafe host before ssh is ever
started; the comment parser reads only its own keys and refuses malformed values with one line.
A canary file that a successful injection would create must never appear.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.slurm.comment import parse_comment
from slurm_cdgpc.transport.auth import HmacKey, HmacSigner
from slurm_cdgpc.transport.http import NodeExchanger, NodeFailure, NodeTarget
from slurm_cdgpc.transport.routing import RoutingExchanger
from slurm_cdgpc.transport.ssh import SshExchanger
from slurm_cdgpc.wire.protocol import ExchangeRequest
from tests.evidence import record
from tests.security.live import Daemon, make_keys, start_head, stop_all

SIGNER = HmacSigner(HmacKey(b"k" * 32), uid=0, gid=0)

pytestmark = pytest.mark.security


def _payloads(canary: Path) -> list[str]:
    return [
        "../../etc",
        "../../etc/passwd",
        "/etc/passwd",
        f"-oProxyCommand=touch {canary}",
        "-oProxyCommand=sh",
        "node;rm -rf /",
        "node && rm -rf /",
        "node|sh",
        f"$(touch {canary})",
        f"`touch {canary}`",
        "node\nrm -rf /",
        "node\x00",
        "node name",
        "-",
        "--",
        "",
        "ñode",
    ]


@pytest.fixture
def canary(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "injected"
    yield path
    assert not path.exists(), "an injected command ran"


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    home = tmp_path_factory.mktemp("injection")
    daemon = start_head(home, make_keys(home), hmac_is_admin=True)
    try:
        yield daemon
    finally:
        stop_all([daemon])


def _snapshot(head: Daemon) -> object:
    return (
        head.ok("GET", "/v1/jobs")["jobs"],
        [(n["name"], n["url"]) for n in head.ok("GET", "/v1/nodes")["nodes"]],
        head.ok("GET", "/v1/budget")["history"],
    )


@pytest.mark.live
def test_hostile_names_are_refused_by_the_head(head: Daemon, canary: Path) -> None:
    job = {"job_id": "10", "user": "root", "node": "node1", "gpus": [0]}
    attempts: list[tuple[str, int]] = []
    before = _snapshot(head)
    for bad in _payloads(canary):
        for path, payload in (
            ("/v1/jobs", {**job, "node": bad}),
            ("/v1/jobs", {**job, "user": bad}),
            ("/v1/jobs", {**job, "job_id": bad}),
            ("/v1/nodes", {"node": bad, "url": "http://127.0.0.1:9"}),
        ):
            reply = head.request("POST", path, json.dumps(payload).encode())
            attempts.append((f"{path} {payload}", reply.status))
            if reply.status == 400:
                reply.error()
        reply = head.request("DELETE", f"/v1/jobs/{quote(bad, safe='')}")
        attempts.append((f"DELETE {bad!r}", reply.status))
    changed = _snapshot(head) != before
    passed = [a for a in attempts if a[1] not in (400, 404)]
    record(
        "attack",
        "injection:head names, users and job ids",
        tried=len(attempts),
        refused=len(attempts) - len(passed),
        accepted=sum(1 for _, status in attempts if status < 400),
        state_changed=int(changed),
    )
    assert passed == []
    assert not changed


def _hostile_urls(canary: Path) -> list[str]:
    return [f"{scheme}://{bad}" for bad in _payloads(canary) for scheme in ("ssh", "http")]


@pytest.mark.live
def test_hostile_agent_urls_are_refused_or_inert(head: Daemon, canary: Path) -> None:
    """A URL the head accepts is only ever a connection target: over ssh, the transport
    refuses a host that is not a host name before ssh runs; over http, no program runs."""
    exchanger = SshExchanger("/usr/bin/ssh", signer=SIGNER, timeout_s=5.0)
    refused = inert = 0
    try:
        for url in _hostile_urls(canary):
            body = json.dumps({"node": "node1", "url": url}).encode()
            reply = head.request("POST", "/v1/nodes", body)
            if reply.status == 400:
                reply.error()
                refused += 1
                continue
            assert reply.status == 200, (url, reply.status)
            if url.startswith("ssh://"):
                with pytest.raises(InputError):
                    exchanger.argv("node1", url)
            inert += 1
    finally:
        exchanger.close()
    tried = len(_hostile_urls(canary))
    record(
        "attack",
        "injection:head agent URLs",
        tried=tried,
        refused=refused + inert,  # inert: stored, but never a shell word or an ssh option
        inert=inert,
        accepted=0,
        state_changed=0,
    )
    assert refused + inert == tried


@pytest.mark.live
def test_the_head_refuses_agent_urls_whose_host_is_not_a_host_name(head: Daemon) -> None:
    for url in ("ssh://-", "ssh://--", "http://-", "http://../../etc"):
        body = json.dumps({"node": "node1", "url": url}).encode()
        assert head.request("POST", "/v1/nodes", body).status == 400, url


@pytest.mark.live
def test_free_text_is_stored_as_data(head: Daemon, canary: Path) -> None:
    """A budget reason may hold any printable text; it is kept verbatim, inert."""
    text = f"$(touch {canary}); `touch {canary}` | sh ../../etc"
    change = head.ok("POST", "/v1/budget", {"budget_w": 8000.0, "reason": text})
    assert change["reason"] == text
    for bad in ("line\nbreak", "bell\x07", "esc\x1b[2J"):
        reply = head.request(
            "POST", "/v1/budget", json.dumps({"budget_w": 1.0, "reason": bad}).encode()
        )
        assert reply.status == 400, bad
        reply.error()
    assert head.ok("GET", "/v1/budget")["current"]["reason"] == text


@pytest.fixture
def fake_ssh(tmp_path: Path) -> tuple[Path, Path]:
    """An "ssh" that records its argv and answers nothing (we only look at what it was given)."""
    ran = tmp_path / "ssh-ran"
    program = tmp_path / "ssh"
    program.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {ran}\nexit 255\n')
    program.chmod(0o755)
    return program, ran


def _target(url: str) -> NodeTarget:
    return NodeTarget(url, ExchangeRequest(interval=1, lease_expires_s=1.0, node="node1"))


def test_the_ssh_transport_never_starts_ssh_for_a_hostile_host(
    fake_ssh: tuple[Path, Path], canary: Path
) -> None:
    program, ran = fake_ssh
    exchanger = SshExchanger(program, signer=SIGNER, timeout_s=5.0, options=["User=root"])
    tried = refused = 0
    try:
        for bad in _payloads(canary):
            for node, url in ((bad, "ssh://"), ("node1", f"ssh://{bad}"), (bad, "")):
                tried += 1
                with pytest.raises(InputError) as info:
                    exchanger.argv(node, url)
                assert "\n" not in str(info.value)
                [result] = exchanger.exchange({node: _target(url or "ssh://")}).values()
                assert isinstance(result, NodeFailure)
                assert not ran.exists(), f"ssh started for {node!r} {url!r}"
                refused += 1
        # the control: a good name does start ssh, with the host after "--"
        [result] = exchanger.exchange({"node1": _target("ssh://node1:2222")}).values()
        assert isinstance(result, NodeFailure)  # our fake ssh exits 255
        argv = ran.read_text().splitlines()
        assert argv[argv.index("--") + 1] == "node1" and argv[:2] == ["-o", "BatchMode=yes"]
        assert argv[-1] == "cdgpc-noded exchange"
    finally:
        exchanger.close()
    record("attack", "injection:ssh host names", tried=tried, refused=refused, state_changed=0)


def test_routing_sends_no_hostile_name_anywhere(fake_ssh: tuple[Path, Path], canary: Path) -> None:
    """Through the head's router: ssh:// targets go to the checked SSH transport, the rest to
    HTTP; a hostile node name or host ends as a one-line `NodeFailure` either way."""
    program, ran = fake_ssh
    router = RoutingExchanger(
        NodeExchanger(SIGNER, timeout_s=2.0),
        SshExchanger(program, signer=SIGNER, timeout_s=5.0),
    )
    closed = "http://127.0.0.1:9"  # the discard port: nothing listens there
    try:
        targets = {bad: _target("ssh://") for bad in _payloads(canary)}
        targets.update(
            {f"h{i}": _target(f"ssh://{bad}") for i, bad in enumerate(_payloads(canary))}
        )
        targets["plain"] = _target(closed)
        results = router.exchange(targets)
    finally:
        router.close()
    assert set(results) == set(targets)
    for node, result in results.items():
        assert isinstance(result, NodeFailure), node
        assert "\n" not in result.reason, result.reason
    assert not ran.exists(), "ssh started for a hostile name"


@pytest.mark.parametrize(
    "option",
    ["-oProxyCommand=sh", "ProxyCommand", "Proxy Command=x", "User=root\nHost=*", "=x", ""],
)
def test_ssh_options_are_key_value_words(option: str) -> None:
    with pytest.raises(InputError):
        SshExchanger("/usr/bin/ssh", signer=SIGNER, timeout_s=5.0, options=[option])


@pytest.mark.parametrize(
    ("comment", "deadline", "iters"),
    [
        ("x=$(touch /tmp/cdgpc-canary) deadline=+6h", 6 * 3600.0, None),
        ("run `id`;rm -rf / iters=50", None, 50),
        ("deadline=+1h\niters=7\n$(reboot)", 3600.0, 7),
        ("../../etc/passwd,iters=3", None, 3),
        ("=;= ,,, \t$(x)=`y`", None, None),
    ],
)
def test_comment_text_around_the_keys_is_left_alone(
    comment: str, deadline: float | None, iters: int | None
) -> None:
    request = parse_comment(comment)
    got = None if request.deadline is None else request.deadline.relative_s
    assert (got, request.iterations_total) == (deadline, iters)


@pytest.mark.parametrize(
    "comment",
    [
        "deadline=$(touch /tmp/cdgpc-canary)",
        "deadline=`id`",
        "deadline=+6h;rm",
        "deadline=../../etc",
        "deadline=+6h|sh",
        "iters=1;reboot",
        "iters=$(id)",
        "deadline=2026-12-01T12:00\x1b[2J",
        "deadline=+6h deadline=+1h",
    ],
)
def test_malformed_comment_values_are_one_line_errors(comment: str) -> None:
    with pytest.raises(InputError) as info:
        parse_comment(comment)
    message = str(info.value)
    assert message.isprintable() and "\n" not in message, message
