"""Where a request ends, as the head and the agents read it, against a reference parser (h11).

Two readers of one byte stream that disagree on where a request ends (a proxy and the server,
or the server and a later request) let a request be smuggled in another's body. Each case is
sent, with a second request pipelined after it, to a real head (``POST /v1/nodes``) and a
real agent (``POST /v1/exchange``) on loopback, and read by h11 as well:

- a request h11 refuses, the server refuses too (it never answers 2xx to it);
- a request both accept, they read alike: its credential is made for the body h11 read, and
  binds it, so the server's 2xx says it read that body; a 401 says it read another; and the
  next answer is to the request h11 reads next.

The server may refuse what h11 accepts (a chunked body, a folded line, a block over the
server's bound): it is the stricter reader. The cases are hand-written (one per defect, each
of which once let the server read a request h11 refuses) and seeded random mutations of a
valid request: Content-Length repeated, conflicting or malformed, Transfer-Encoding in every
spelling, Host missing or doubled, folded lines, bare line ends, odd bytes, huge lines, bodies
cut short.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import h11
import pytest

from slurm_cdgpc.agent.node import NodeAgent
from slurm_cdgpc.agent.server import AgentHttpServer
from slurm_cdgpc.config import SafeCap
from slurm_cdgpc.coordinator.api import HeadHttpServer
from slurm_cdgpc.coordinator.daemon import Coordinator, CoordinatorSettings
from slurm_cdgpc.gpu.simulated import simulated_gpus
from slurm_cdgpc.store import Store, make_engine, upgrade
from slurm_cdgpc.transport.auth import AccessPolicy, HmacKey, HmacSigner, HmacVerifier
from slurm_cdgpc.transport.evented import EventLoop
from slurm_cdgpc.wire.protocol import ExchangeRequest
from tests.evidence import record
from tests.unit.test_coordinator_api import NoAgents

pytestmark = pytest.mark.security

WAIT_S = 10.0
RANDOM_CASES = 300  # per server
SEED = 20260
HEALTH = b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
#: a valid request: @PATH@, @CRED@, @LEN@ and @BODY@ are the server's
VALID = (
    b"POST @PATH@ HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Authorization: @CRED@\r\nContent-Length: @LEN@\r\n\r\n"
)


@dataclass(frozen=True)
class Server:
    name: str
    port: int
    signer: HmacSigner
    path: str
    body: Callable[[], bytes]  # a body the server accepts


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    engine = make_engine(f"sqlite:///{tmp_path_factory.mktemp('head') / 'head.db'}")
    upgrade(engine)
    coordinator = Coordinator(Store(engine), NoAgents(), CoordinatorSettings(interval_s=1.0))
    coordinator.start()
    key = HmacKey(secrets.token_bytes(32))
    server = HeadHttpServer(
        ("127.0.0.1", 0), coordinator, HmacVerifier(key), AccessPolicy(hmac_is_admin=False)
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    announce = json.dumps({"node": "n1", "url": "http://n1:9100"}).encode()
    yield Server("head", server.port, HmacSigner(key), "/v1/nodes", lambda: announce)
    server.shutdown()
    server.server_close()
    thread.join(WAIT_S)
    engine.dispose()


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    key = HmacKey(secrets.token_bytes(32))
    loop = EventLoop(workers=0)
    server = AgentHttpServer(
        ("127.0.0.1", 0),
        NodeAgent(
            simulated_gpus("A100", 2, seed=1),
            SafeCap(),
            tmp_path_factory.mktemp("agent") / "state.json",
            node_name="n0",
        ),
        HmacVerifier(key),
        AccessPolicy(node_uids=frozenset({0, os.getuid()})),
        loop=loop,
    )
    thread = threading.Thread(target=loop.serve_forever, daemon=True)
    thread.start()
    intervals = iter(range(1, 1 << 30))

    def exchange() -> bytes:
        lease_s = time.time() + 3600
        return ExchangeRequest(
            node="n0", interval=next(intervals), lease_expires_s=lease_s
        ).to_json()

    yield Server("agent", server.port, HmacSigner(key), "/v1/exchange", exchange)
    loop.shutdown()
    server.server_close()
    loop.close()
    thread.join(WAIT_S)


@pytest.fixture(params=["head", "agent"])
def server(request: pytest.FixtureRequest) -> Server:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


# -- the reference's reading and the server's answers ------------------------------------------


@dataclass(frozen=True)
class Reading:
    """The requests h11 reads off a stream, in order, each (target, body); ``refused``: it
    then refused the rest (otherwise the stream or the connection ended)."""

    requests: tuple[tuple[bytes, bytes], ...]
    refused: bool


def h11_reading(data: bytes) -> Reading:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    conn.receive_data(b"")  # the peer then closes its half, as the test's client does
    requests: list[tuple[bytes, bytes]] = []
    target, body = b"", b""
    try:
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Request):
                target, body = event.target, b""
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                requests.append((target, body))
                conn.send(h11.Response(status_code=200, headers=[(b"Content-Length", b"0")]))
                conn.send(h11.EndOfMessage())
                if conn.our_state is not h11.DONE:  # the connection closes after this one
                    break
                conn.start_next_cycle()
            else:
                break
    except h11.RemoteProtocolError:
        return Reading(tuple(requests), refused=True)
    return Reading(tuple(requests), refused=False)


def exchange(port: int, data: bytes) -> list[tuple[int, bytes]]:
    """Send ``data``, close this half, and read the answers (status, body) until the server
    closes (interim 1xx answers left out)."""
    received = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)  # refused and closed before all was sent: the answer still counts
            sock.shutdown(socket.SHUT_WR)
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                received += chunk
    answers = []
    rest = bytes(received)
    while rest:
        head, blank, rest = rest.partition(b"\r\n\r\n")
        assert blank, f"an answer cut short: {head[:200]!r}"
        status = int(head.split(b" ", 2)[1])
        length = re.search(rb"\r\nContent-Length: ([0-9]+)", head)
        size = int(length[1]) if length else 0
        if status >= 200:
            answers.append((status, rest[:size]))
        rest = rest[size:]
    return answers


@dataclass(frozen=True)
class Case:
    name: str
    #: the request line and header block, @PATH@, @CRED@ and @LEN@ to be filled in
    head: bytes = VALID
    #: what follows the header block (@BODY@: the server's body)
    body: bytes = b"@BODY@"
    #: what follows that: a request pipelined after this one (b"": nothing, the peer stops)
    tail: bytes = HEALTH
    #: bytes cut off the end of the request (before the tail): the peer stops short
    cut: int = 0


@dataclass
class Tally:
    cases: int = 0
    both_accepted: int = 0
    both_refused: int = 0
    only_h11_accepted: int = 0


def check(server: Server, case: Case, tally: Tally) -> list[str]:
    """Send ``case`` to ``server``; what its answers say it read that h11 does not."""
    body = server.body()
    method = "GET" if case.head.lstrip().startswith(b"GET") else "POST"  # the one signed

    def render(signed: bytes) -> bytes:
        credential = server.signer.sign(method, server.path, signed).encode()
        request = case.head.replace(b"@PATH@", server.path.encode()).replace(
            b"@CRED@", credential
        ).replace(b"@LEN@", b"%d" % len(body)) + case.body.replace(b"@BODY@", body).replace(
            b"@HEXLEN@", b"%x" % len(body)
        )
        return request[: len(request) - case.cut] + case.tail

    signed = body
    data = render(signed)
    reading = h11_reading(data)
    if reading.requests and reading.requests[0][1] != signed:
        signed = reading.requests[0][1]  # sign what h11 reads: the server must read it too
        data = render(signed)
        reading = h11_reading(data)
    answers = exchange(server.port, data)
    tally.cases += 1
    first_accepted = bool(answers) and answers[0][0] < 300
    if reading.requests:
        tally.both_accepted += first_accepted
        tally.only_h11_accepted += not first_accepted
    else:
        tally.both_refused += not first_accepted
    problems = []
    for i, (status, answer) in enumerate(answers):
        if status >= 300:
            break  # refused, and the connection closed
        if i >= len(reading.requests):
            problems.append(f"answer {i} is {status} to a request h11 refuses")
            break
        ours = "/v1/health" if json.loads(answer) == {"ok": True} else server.path
        if reading.requests[i][0] != ours.encode():
            problems.append(f"answer {i} is to {ours}; h11 reads {reading.requests[i][0]!r}")
    first = reading.requests[0] if reading.requests else None
    if first == (server.path.encode(), signed) and answers and answers[0][0] == 401:
        # the credential binds the body h11 read: the server read another
        problems.append(f"401 where h11 reads a {len(signed)}-byte body: {answers[0][1]!r}")
    return [f"{server.name}, {case.name}: {p}; sent {data[:300]!r}" for p in problems]


# -- hand-written cases -------------------------------------------------------------------------


def _with(*fields: bytes, without: bytes = b"", head: bytes = VALID) -> bytes:
    """``head`` less the field line starting ``without``, with ``fields`` added at its end."""
    lines = head.split(b"\r\n")[:-2]
    if without:
        lines = [line for line in lines if not line.startswith(without)]
    return b"\r\n".join([*lines, *fields]) + b"\r\n\r\n"


HAND_WRITTEN = [
    Case("valid"),
    Case("valid, bare LF line ends", VALID.replace(b"\r\n", b"\n")),
    Case("valid over HTTP/1.0 without Host", _with(without=b"Host").replace(b"1.1", b"1.0")),
    Case("valid, Content-Length twice alike", _with(b"Content-Length: @LEN@")),
    # the three defects: each was read as a request, or read two ways
    Case("no Host", _with(without=b"Host")),
    Case("no Host on a GET", b"GET /v1/health HTTP/1.1\r\n\r\n", b""),
    Case("Content-Length twice, the first right", _with(b"Content-Length: 0")),
    Case(
        "Content-Length twice, the second right",
        _with(b"Content-Length: 0", b"Content-Length: @LEN@", without=b"Content-Length"),
    ),
    Case("empty Transfer-Encoding", _with(b"Transfer-Encoding: ")),
    Case(
        "empty Transfer-Encoding on a GET",
        b"GET /v1/health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding:\r\n\r\n",
        b"",
    ),
    # the rest of the grammar
    Case("two Hosts", _with(b"Host: 127.0.0.1")),
    Case("chunked beside Content-Length", _with(b"Transfer-Encoding: chunked")),
    Case(
        "chunked",
        _with(b"Transfer-Encoding: chunked", without=b"Content-Length"),
        b"@HEXLEN@\r\n@BODY@\r\n0\r\n\r\n",
    ),
    Case("Content-Length with a sign", _with(b"Content-Length: +@LEN@", without=b"Content-Le")),
    Case("Content-Length a list", _with(b"Content-Length: @LEN@, @LEN@", without=b"Content-Le")),
    Case("Content-Length in another script", _with(b"Content-Length: \xb2", without=b"Content-Le")),
    Case("Content-Length too long", _with(b"Content-Length: 1" + b"0" * 20, without=b"Content-Le")),
    Case("a folded line", _with(b"X-Note: a", b" folded")),
    Case("a folded Content-Length", _with(b"Content-Length: @LEN@", b" 0", without=b"Content-Le")),
    Case("a space before a colon", _with(b"Content-Length : 0")),
    Case("a bare CR in a value", _with(b"X-Note: a\rb")),
    Case("a line ending CR CR LF", VALID.replace(b"json\r\n", b"json\r\r\n")),
    Case("a NUL in a value", _with(b"X-Note: a\x00b")),
    Case("two spaces in the request line", VALID.replace(b"POST ", b"POST  ", 1)),
    Case("a tab in the request line", VALID.replace(b"POST ", b"POST\t", 1)),
    Case("an empty line first", b"\r\n" + VALID),
    Case("a header block cut short", VALID, b"", b"", cut=2),
    Case("a header block cut short on a GET", b"GET /v1/health HTTP/1.1\r\nHost: x\r\n", b"", b""),
    Case("a body cut short", tail=b"", cut=5),
    Case("a header block over the bound", _with(b"X-Pad: " + b"a" * 17000)),
    Case("many header lines", _with(*[b"X: y"] * 120)),
]


@pytest.mark.parametrize("case", HAND_WRITTEN, ids=[c.name for c in HAND_WRITTEN])
def test_the_server_reads_no_request_h11_refuses_and_reads_alike_what_both_accept(
    server: Server, case: Case
) -> None:
    tally = Tally()
    problems = check(server, case, tally)
    assert not problems, problems[0]
    if case.name.startswith("valid"):
        assert tally.both_accepted == 1  # the control: a valid request is served


# -- seeded random mutations of a valid request -------------------------------------------------

#: Content-Length values: right, wrong, or not numbers at all (@LEN@: the body's length)
LENGTHS = [
    b"@LEN@", b"0@LEN@", b" @LEN@", b"@LEN@ ", b"\t@LEN@", b"+@LEN@", b"-@LEN@", b"@LEN@, @LEN@",
    b"@LEN@,0", b"", b"0", b"1", b"0x10", b"@LEN@.0", b"1e2", b"\xb2", b"@LEN@\x00", b"9" * 13,
    b"@LEN@0", b"@LEN@\x0b",
]  # fmt: skip
ENCODINGS = [
    b"chunked", b"Chunked", b"", b" ", b"identity", b"gzip", b"gzip, chunked", b"chunked, gzip",
    b"\tchunked", b"chunked\x0b", b"x",
]  # fmt: skip
ODD_BYTES = b"\x00\r\n \t:\x0b\x0c\x7f\x80\xff,;\\"


def random_case(rng: random.Random, number: int) -> Case:
    """A valid request with one to three of the ways a request goes wrong applied to it."""
    line = b"POST @PATH@ HTTP/1.1"
    fields = [
        b"Host: 127.0.0.1",
        b"Content-Type: application/json",
        b"Authorization: @CRED@",
        b"Content-Length: @LEN@",
    ]
    ends = [b"\r\n"] * (len(fields) + 2)  # the request line's, the fields', the blank line's
    body, tail, cut = b"@BODY@", HEALTH, 0
    done = []
    for _ in range(rng.randint(1, 3)):
        what = rng.choice(MUTATIONS)
        done.append(what)
        at = rng.randrange(len(fields) + 1)
        if what == "Content-Length":
            fields = [f for f in fields if not f.startswith(b"Content-Length")]
            for _ in range(rng.choice([0, 1, 1, 2, 2, 3])):
                fields.insert(
                    rng.randrange(len(fields) + 1), b"Content-Length: " + rng.choice(LENGTHS)
                )
        elif what == "Transfer-Encoding":
            fields.insert(at, b"Transfer-Encoding: " + rng.choice(ENCODINGS))
            if rng.random() < 0.5:
                body = b"@HEXLEN@\r\n@BODY@\r\n0\r\n\r\n"
        elif what == "Host":
            fields = [f for f in fields if not f.startswith(b"Host")]
            fields[at:at] = [b"Host: 127.0.0.1"] * rng.choice([0, 2, 3])
        elif what == "HTTP/1.0":
            line = b"POST @PATH@ HTTP/1.0"
        elif what == "folded":
            fields.insert(at, rng.choice([b" folded", b"\tfolded", b" 0", b" X: y"]))
        elif what == "line ends":
            for i in rng.sample(range(len(ends)), rng.randint(1, len(ends))):
                ends[i] = rng.choice([b"\n", b"\r\r\n", b"\n\r", b"\r"])
        elif what == "odd byte":
            target = [i for i, f in enumerate(fields) if not f.startswith(b"Authorization")]
            i = rng.choice(target)
            j = rng.randrange(len(fields[i]) + 1)
            fields[i] = fields[i][:j] + bytes([rng.choice(ODD_BYTES)]) + fields[i][j:]
        elif what == "request line":
            line = rng.choice(
                [b"POST  @PATH@ HTTP/1.1", b"POST @PATH@  HTTP/1.1", b"POST @PATH@ HTTP/1.1 ",
                 b"POST\t@PATH@ HTTP/1.1", b" POST @PATH@ HTTP/1.1", b"POST @PATH@ HTTP/1.2",
                 b"POST @PATH@ http/1.1", b"POST @PATH@?a=\xff HTTP/1.1"]
            )  # fmt: skip
        elif what == "huge line":
            size = rng.choice([1000, 8000, 16000, 16300, 16500, 20000, 70000])
            fields.insert(at, b"X-Pad: " + b"a" * size)
        elif what == "many lines":
            fields[at:at] = [b"X: y"] * rng.choice([50, 95, 101, 150])
        elif what == "body cut short":
            tail, cut = b"", rng.randint(1, 20)
        elif what == "body too long":
            body += rng.choice([b"x", b"\r\n", b"GET / HTTP/1.1\r\n\r\n"])
        elif what == "Expect":
            fields.insert(at, b"Expect: 100-continue")
        elif what == "Connection: close":
            fields.insert(at, b"Connection: close")
        ends = (ends + [b"\r\n"] * len(fields))[: len(fields) + 2]
    lines = [line, *fields, b""]
    head = b"".join(text + end for text, end in zip(lines, ends, strict=True))
    return Case(f"random {number} ({', '.join(done)})", head, body, tail, cut)


MUTATIONS = [
    "Content-Length", "Content-Length", "Content-Length", "Transfer-Encoding", "Transfer-Encoding",
    "Host", "HTTP/1.0", "folded", "line ends", "odd byte", "odd byte", "request line",
    "huge line", "many lines", "body cut short", "body too long", "Expect", "Connection: close",
]  # fmt: skip


def test_seeded_random_requests_are_read_as_h11_reads_them_or_refused(server: Server) -> None:
    rng = random.Random(f"{SEED}-{server.name}")
    tally = Tally()
    problems = []
    for number in range(RANDOM_CASES):
        problems += check(server, random_case(rng, number), tally)
    record("fuzz", f"http framing against h11 ({server.name})", cases=tally.cases,
           unhandled=len(problems))  # fmt: skip
    assert problems == [], "\n".join(problems[:10])
    # the cases are not all of one kind: many are read alike, many refused by both
    assert tally.both_accepted >= RANDOM_CASES // 10, tally
    assert tally.both_refused >= RANDOM_CASES // 4, tally
