"""The SSH transport without sshd: argv, name checks, and fake ``ssh`` programs that misbehave.

A fake ssh that answers well stands in for the forwarder and the agent together
(`_signed_reply`): it reads the head's signed request and answers it signed with the test key,
as the agent would through ``cdgpc-noded exchange``.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_cdgpc.config import Config, NodeConfig, agent_url
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.transport import forward
from slurm_cdgpc.transport.auth import REPLY_HEADER, HmacKey, HmacSigner, HmacVerifier
from slurm_cdgpc.transport.http import NodeFailure, NodeTarget
from slurm_cdgpc.transport.ssh import REQUEST_HEADER, SshExchanger, open_envelope, ssh_url
from slurm_cdgpc.wire.protocol import (
    ExchangeRequest,
    ExchangeResponse,
    MessageTooLargeError,
    ProtocolError,
    Setpoint,
)

REPO = Path(__file__).resolve().parents[2]
REQUEST = ExchangeRequest(
    3, 1_767_225_690.0, (Setpoint(0, "123", 1200),), (1,), epoch=7, node="node1"
)
RESPONSE = ExchangeResponse(node="node1", time_s=1_767_225_600.0)
SECRET = b"s" * 32
SIGNER = HmacSigner(HmacKey(SECRET))
#: the agent's side of a fake ssh: the head's request on stdin, argv[1] the answer to sign
_AGENT = f"""
import json, sys
from slurm_cdgpc.transport.auth import HmacKey, HmacSigner, Reply
head = sys.stdin.buffer.read()
line, _, body = head.partition(b"\\n")
assert line.startswith(b"{REQUEST_HEADER}: "), head[:80]
nonce = line.decode().split(":")[4]
answer = open(sys.argv[1], "rb").read()
request = json.loads(body)
reply = Reply.to(nonce, request["node"], request.get("epoch", 0), 200, answer)
credential = HmacSigner(HmacKey({SECRET!r})).sign_reply(reply)
sys.stdout.buffer.write(f"{REPLY_HEADER}: {{credential}}\\n".encode() + answer)
"""


def _fake_ssh(tmp_path: Path, body: str) -> Path:
    """A shell script standing in for ssh; it logs its arguments to ``argv.log``."""
    script = tmp_path / "ssh"
    script.write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$@" >> {tmp_path / "argv.log"}\n{body}\n', encoding="utf-8"
    )
    script.chmod(0o755)
    return script


def _reply_file(tmp_path: Path, data: bytes = RESPONSE.to_json()) -> Path:
    path = tmp_path / "reply.json"
    path.write_bytes(data)
    return path


def _signed_reply(tmp_path: Path, data: bytes = RESPONSE.to_json()) -> str:
    """A shell command that answers the request on its stdin with ``data``, signed."""
    agent = tmp_path / "agent.py"
    agent.write_text(_AGENT, encoding="utf-8")
    return f"{sys.executable} {agent} {_reply_file(tmp_path, data)}"


def _one(exchanger: SshExchanger, node: str = "node1", url: str = "") -> object:
    try:
        return exchanger.exchange({node: NodeTarget(url, REQUEST)})[node]
    finally:
        exchanger.close()


def _alive(pid: int) -> bool:
    """Running (a zombie that init has not reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


# -- argv ----------------------------------------------------------------------------------------


def test_argv_puts_batch_mode_first_and_the_host_after_double_dash() -> None:
    exchanger = SshExchanger(
        "/usr/bin/ssh",
        signer=SIGNER,
        timeout_s=2.5,
        options=("User=root", "IdentityFile=/etc/cdgpc/ssh/id_ed25519"),
        config_file="/etc/cdgpc/ssh_config",
        remote_command=("cdgpc-noded", "exchange", "--config", "/etc/cdgpc/my cdgpc.toml"),
    )
    try:
        assert exchanger.argv("gpu-node07") == [
            "/usr/bin/ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=3",
            "-F",
            "/etc/cdgpc/ssh_config",
            "-o",
            "User=root",
            "-o",
            "IdentityFile=/etc/cdgpc/ssh/id_ed25519",
            "--",
            "gpu-node07",
            "cdgpc-noded exchange --config '/etc/cdgpc/my cdgpc.toml'",
        ]
        # an ssh:// URL names the host (and port) to use for the node
        assert exchanger.argv("gpu-node07", ssh_url("10.1.2.7", 2222))[-5:] == [
            "-p",
            "2222",
            "--",
            "10.1.2.7",
            "cdgpc-noded exchange --config '/etc/cdgpc/my cdgpc.toml'",
        ]
        # an http URL (a node on the other transport) does not change the host
        assert exchanger.argv("gpu-node07", "http://gpu-node07:8464")[-2] == "gpu-node07"
    finally:
        exchanger.close()


def test_default_remote_command_is_cdgpc_noded_exchange() -> None:
    exchanger = SshExchanger(signer=SIGNER, timeout_s=1)
    try:
        assert exchanger.argv("n1")[0] == "/usr/bin/ssh"
        assert exchanger.argv("n1")[-1] == "cdgpc-noded exchange"
    finally:
        exchanger.close()


@pytest.mark.parametrize(
    "name",
    [
        "-oProxyCommand=touch /tmp/pwned",
        "-F/tmp/evil",
        "node1 -oProxyCommand=x",
        "node1;reboot",
        "root@node1",
        "node1:22",
        "ssh://node1",
        "",
        ".node1",
        "node\n1",
    ],
)
def test_unsafe_node_names_are_refused_before_argv(name: str) -> None:
    exchanger = SshExchanger(signer=SIGNER, timeout_s=1)
    try:
        with pytest.raises(ProtocolError):
            exchanger.argv(name)
    finally:
        exchanger.close()


@pytest.mark.parametrize(
    "url",
    [
        "ssh://-oProxyCommand=x",
        "ssh://root@node1",
        "ssh://node1/cdgpc",
        "ssh://node1:99999",
        "ssh://node1?x=1",
        "ssh://",
    ],
)
def test_unsafe_ssh_urls_are_refused(url: str) -> None:
    exchanger = SshExchanger(signer=SIGNER, timeout_s=1)
    try:
        with pytest.raises(InputError):
            exchanger.argv("node1", url)
    finally:
        exchanger.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ssh_path": "ssh"},
        {"timeout_s": 0},
        {"timeout_s": float("nan")},
        {"max_parallel": 0},
        {"options": ["-oProxyCommand=x"]},
        {"options": ["User root"]},
        {"options": ["User=root\nProxyCommand=x"]},
        {"remote_command": []},
        {"remote_command": ["cdgpc-noded", ""]},
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, object]) -> None:
    settings: dict[str, object] = {"signer": SIGNER, "timeout_s": 1.0, **kwargs}
    with pytest.raises(InputError):
        SshExchanger(**settings)  # type: ignore[arg-type]


# -- fake ssh programs ---------------------------------------------------------------------------


def test_request_goes_on_stdin_signed_and_the_signed_reply_is_parsed(tmp_path: Path) -> None:
    ssh = _fake_ssh(tmp_path, f"tee {tmp_path / 'stdin'} | {_signed_reply(tmp_path)}")
    # started before the request is signed, as the agent is: it refuses what came before it
    verifier = HmacVerifier(HmacKey(SECRET))
    result = _one(SshExchanger(ssh, signer=SIGNER, timeout_s=5))
    assert result == RESPONSE
    credential, body = open_envelope((tmp_path / "stdin").read_bytes(), REQUEST_HEADER)
    assert ExchangeRequest.from_json(body) == REQUEST
    assert credential is not None  # the head's own, for the agent to check
    verifier.verify(credential, "POST", "/v1/exchange", body)
    assert (tmp_path / "argv.log").read_text().endswith("--\nnode1\ncdgpc-noded exchange\n")


def test_an_answer_over_ssh_not_signed_for_this_request_is_refused(tmp_path: Path) -> None:
    # an answer that the node's agent signed, for another request, then one with no credential
    signed = _fake_ssh(tmp_path, _signed_reply(tmp_path))
    captured = tmp_path / "captured"
    earlier = subprocess.run(  # an earlier exchange's signed answer, captured
        [str(signed)],
        input=b"Authorization: hmac-sha256 0:0:1:" + b"a" * 32 + b":x\n" + REQUEST.to_json(),
        capture_output=True,
        check=True,
        timeout=30,
    )
    captured.write_bytes(earlier.stdout)
    replayed = _fake_ssh(tmp_path, f"cat >/dev/null; cat {captured}")
    result = _one(SshExchanger(replayed, signer=SIGNER, timeout_s=5))
    assert isinstance(result, NodeFailure), result
    assert result.reason.startswith("node1 over ssh: reply refused: reply HMAC does not match")
    bare = _fake_ssh(tmp_path, f"cat >/dev/null; cat {_reply_file(tmp_path)}")
    result = _one(SshExchanger(bare, signer=SIGNER, timeout_s=5))
    assert isinstance(result, NodeFailure)
    assert f"reply refused: no {REPLY_HEADER} header" in result.reason


def test_a_malicious_node_name_never_runs_ssh(tmp_path: Path) -> None:
    ssh = _fake_ssh(tmp_path, _signed_reply(tmp_path))
    exchanger = SshExchanger(ssh, signer=SIGNER, timeout_s=5)
    try:
        results = exchanger.exchange(
            {
                "-oProxyCommand=touch /tmp/x": NodeTarget("", REQUEST),
                "node1": NodeTarget("", REQUEST),
            }
        )
    finally:
        exchanger.close()
    failure = results["-oProxyCommand=touch /tmp/x"]
    assert isinstance(failure, NodeFailure) and "refused" in failure.reason
    assert results["node1"] == RESPONSE
    assert "ProxyCommand" not in (tmp_path / "argv.log").read_text()


def test_a_hanging_ssh_is_killed_with_what_it_started(tmp_path: Path) -> None:
    ssh = _fake_ssh(
        tmp_path, f"echo $$ > {tmp_path / 'pid'}\nsleep 60 &\necho $! > {tmp_path / 'child'}\nwait"
    )
    started = time.monotonic()
    result = _one(SshExchanger(ssh, signer=SIGNER, timeout_s=0.5))
    assert time.monotonic() - started < 3
    assert isinstance(result, NodeFailure)
    assert result.reason == "node1: no answer over ssh within 0.5 s"
    pids = [int((tmp_path / name).read_text()) for name in ("pid", "child")]
    deadline = time.monotonic() + 2
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(_alive(pid) for pid in pids)


def test_ssh_that_exits_but_leaves_a_child_holding_stderr_does_not_stall(tmp_path: Path) -> None:
    # like ControlPersist: a background process keeps stderr open after ssh has answered
    ssh = _fake_ssh(tmp_path, f"{_signed_reply(tmp_path)}\nsleep 5 >/dev/null &\nexit 0")
    started = time.monotonic()
    assert _one(SshExchanger(ssh, signer=SIGNER, timeout_s=3)) == RESPONSE
    assert time.monotonic() - started < 2


def test_oversized_output_is_cut_off_and_ssh_killed(tmp_path: Path) -> None:
    ssh = _fake_ssh(tmp_path, f"echo $$ > {tmp_path / 'pid'}\nexec yes")
    started = time.monotonic()
    result = _one(SshExchanger(ssh, signer=SIGNER, timeout_s=5, max_reply_bytes=100_000))
    assert time.monotonic() - started < 3
    assert result == NodeFailure("node1: reply over ssh larger than 100000 bytes")
    assert not _alive(int((tmp_path / "pid").read_text()))


def test_garbage_output_is_a_node_failure(tmp_path: Path) -> None:
    ssh = _fake_ssh(tmp_path, "cat >/dev/null; echo 'Welcome to node1!'")
    result = _one(SshExchanger(ssh, signer=SIGNER, timeout_s=5))
    assert isinstance(result, NodeFailure)
    assert result.reason.startswith("node1 over ssh: reply refused: no X-Cdgpc-Reply-Auth")
    signed = _fake_ssh(tmp_path, _signed_reply(tmp_path, b"Welcome to node1!\n"))
    result = _one(SshExchanger(signed, signer=SIGNER, timeout_s=5))
    assert isinstance(result, NodeFailure)
    assert result.reason.startswith("node1 over ssh: bad reply: not valid JSON")


def test_a_reply_of_the_wrong_schema_is_a_node_failure(tmp_path: Path) -> None:
    ssh = _fake_ssh(tmp_path, _signed_reply(tmp_path, b'{"version": 1, "node": "node1"}'))
    result = _one(SshExchanger(ssh, signer=SIGNER, timeout_s=5))
    assert isinstance(result, NodeFailure) and "missing field" in result.reason


def test_the_forwarders_error_line_is_the_reason(tmp_path: Path) -> None:
    ssh = _fake_ssh(
        tmp_path,
        "cat >/dev/null\n"
        "echo 'Warning: Permanently added node1 to the list of known hosts.' >&2\n"
        "echo 'Error: local agent: http://127.0.0.1:8464: HTTP 401: bad credential' >&2\n"
        "echo 'ignored' >&2\nexit 1",
    )
    result = _one(SshExchanger(ssh, signer=SIGNER, timeout_s=5))
    assert result == NodeFailure(
        "node1: exchange failed on the node (exit 1): "
        "local agent: http://127.0.0.1:8464: HTTP 401: bad credential"
    )


def test_ssh_own_failure_is_reported_with_its_last_line(tmp_path: Path) -> None:
    ssh = _fake_ssh(
        tmp_path, "echo 'ssh: connect to host node1 port 22: Connection refused' >&2; exit 255"
    )
    result = _one(SshExchanger(ssh, signer=SIGNER, timeout_s=5))
    assert result == NodeFailure(
        "node1: ssh failed (exit 255): ssh: connect to host node1 port 22: Connection refused"
    )


def test_a_failure_without_a_message_still_says_something(tmp_path: Path) -> None:
    result = _one(SshExchanger(_fake_ssh(tmp_path, "exit 3"), signer=SIGNER, timeout_s=5))
    assert result == NodeFailure("node1: exchange failed on the node (exit 3): no error message")


def test_a_flood_on_stderr_neither_blocks_nor_fails_a_good_reply(tmp_path: Path) -> None:
    ssh = _fake_ssh(tmp_path, f"yes warning | head -c 1000000 >&2; {_signed_reply(tmp_path)}")
    assert _one(SshExchanger(ssh, signer=SIGNER, timeout_s=5)) == RESPONSE


def test_a_missing_ssh_program_is_a_node_failure(tmp_path: Path) -> None:
    result = _one(SshExchanger(tmp_path / "no-such-ssh", signer=SIGNER, timeout_s=5))
    assert isinstance(result, NodeFailure)
    assert result.reason.startswith("node1: cannot run ")


def test_nodes_are_exchanged_with_concurrently(tmp_path: Path) -> None:
    ssh = _fake_ssh(tmp_path, f"sleep 0.5; {_signed_reply(tmp_path)}")
    exchanger = SshExchanger(ssh, signer=SIGNER, timeout_s=5, max_parallel=4)
    started = time.monotonic()
    try:
        results = exchanger.exchange(
            {f"node{i}": NodeTarget("", replace(REQUEST, node=f"node{i}")) for i in range(4)}
        )
    finally:
        exchanger.close()
    assert time.monotonic() - started < 1.5
    assert all(r == RESPONSE for r in results.values())


# -- the node side: cdgpc-noded exchange ---------------------------------------------------------


def test_forwarder_reads_one_bounded_request() -> None:
    assert forward.read_request(io.BytesIO(REQUEST.to_json())) == REQUEST
    with pytest.raises(MessageTooLargeError):
        forward.read_request(io.BytesIO(b" " * 101 + REQUEST.to_json()), limit_bytes=100)
    with pytest.raises(ProtocolError):
        forward.read_request(io.BytesIO(b'{"version": 1}'))


def test_forwarder_reads_the_heads_credential_before_the_request() -> None:
    signed = SIGNER.sign_request("POST", "/v1/exchange", REQUEST.to_json())
    envelope = f"{REQUEST_HEADER}: {signed.credential}\n".encode() + REQUEST.to_json()
    assert forward.read_input(io.BytesIO(envelope)) == (signed.credential, REQUEST.to_json())
    # a head older than the agent sends the request bare: the forwarder signs it itself
    assert forward.read_input(io.BytesIO(REQUEST.to_json())) == (None, REQUEST.to_json())
    with pytest.raises(MessageTooLargeError):
        forward.read_input(io.BytesIO(envelope + b" " * 100), limit_bytes=len(REQUEST.to_json()))
    with pytest.raises(ProtocolError):  # a credential line that never ends
        forward.read_input(io.BytesIO(f"{REQUEST_HEADER}: {'a' * 5000}".encode()))


@pytest.mark.parametrize(
    ("address", "url"),
    [
        ("0.0.0.0", "http://127.0.0.1:8464"),
        ("::", "http://[::1]:8464"),
        ("127.0.0.1", "http://127.0.0.1:8464"),
        ("10.1.2.7", "http://10.1.2.7:8464"),
    ],
)
def test_forwarder_reaches_the_agent_where_it_listens(address: str, url: str) -> None:
    assert agent_url(Config(node=NodeConfig(listen_address=address))) == url


def test_forwarder_fails_with_one_line_and_nothing_on_stdout(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "slurm_cdgpc.transport.forward", "--config", str(tmp_path / "none")],
        input=b"not json",
        capture_output=True,
        timeout=30,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 2
    assert done.stdout == b""
    assert done.stderr.decode().splitlines() == [
        "Error: not valid JSON: Expecting value: line 1 column 1 (char 0)"
    ]
