"""`Scraper` and ``cdgpc-progress --scrape`` against a real loopback HTTP server serving a
vLLM-style exposition (made by prometheus_client, as vLLM's is) and a real `ProgressServer`."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client import Histogram as PromHistogram

from slurm_cdgpc.agent.progress import main
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.integrations.prometheus import (
    DEFAULT_METRICS,
    MAX_BODY_BYTES,
    Histogram,
    Scraper,
    parse_histogram,
    window_quantile,
)
from tests.unit.test_integrations_serving import Agent, running_agent

REPO = Path(__file__).resolve().parents[2]
TPOT = "vllm:time_per_output_token_seconds"
BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
UID = os.getuid()


class Endpoint:
    """A real HTTP server on loopback: ``registry``'s exposition at any path, or ``body`` with
    ``status`` when ``body`` is set."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.body: bytes | None = None
        self.status = 200
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = endpoint.body
                if body is None:
                    body = generate_latest(endpoint.registry)
                self.send_response(endpoint.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/metrics"

    def vllm(self, name: str = TPOT) -> PromHistogram:
        """A fresh registry (a server (re)started) with vLLM's metrics; its latency histogram."""
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        Gauge("vllm:num_requests_running", "Running.", labels, registry=self.registry).labels(
            "llama", "0"
        ).set(3)
        Counter("vllm:prompt_tokens", "Prompt tokens.", labels, registry=self.registry).labels(
            "llama", "0"
        ).inc(1234)
        e2e = PromHistogram(
            "vllm:e2e_request_latency_seconds", "E2E.", labels, registry=self.registry
        )
        e2e.labels("llama", "0").observe(7.5)  # another histogram: never mixed in
        return PromHistogram(name, "TPOT.", labels, buckets=BUCKETS, registry=self.registry)


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    found = Endpoint()
    thread = threading.Thread(target=found.server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield found
    found.server.shutdown()
    found.server.server_close()
    thread.join()


@pytest.fixture
def agent() -> Iterator[Agent]:
    """A real agent progress socket."""
    with running_agent() as found:
        yield found


def _scraper(url: str, agent: Agent, **kwargs: Any) -> Scraper:
    return Scraper(url, **({"job_id": "77", "path": agent.path, "env": {}} | kwargs))


# -- the parser --------------------------------------------------------------------------------

#: two label sets (one with a comma, a brace and escaped quotes in a value, its labels in
#: another order), a timestamp, ``Inf`` and scientific notation, between other metrics, one of
#: them malformed, and the renamed histogram after it
VLLM_TEXT = rf"""# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="llama"}} 3.0

# HELP vllm:e2e_request_latency_seconds Histogram of end to end request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{{engine="0",le="1.0",model_name="llama"}} 7.0
vllm:e2e_request_latency_seconds_bucket{{engine="0",le="+Inf",model_name="llama"}} 9.0
vllm:e2e_request_latency_seconds_count{{engine="0",model_name="llama"}} 9.0
vllm:e2e_request_latency_seconds_sum{{engine="0",model_name="llama"}} 8.5
# HELP {TPOT} Histogram of time per output token in seconds.
# TYPE {TPOT} histogram
{TPOT}_bucket{{engine="0",le="0.025",model_name="llama"}} 2.0
{TPOT}_bucket{{engine="0",le="0.05",model_name="llama"}} 1.2e1
{TPOT}_bucket{{engine="0",le="0.1",model_name="llama"}} 30 1712345678000
{TPOT}_bucket{{engine="0",le="+Inf",model_name="llama"}} 31.0
{TPOT}_count{{engine="0",model_name="llama"}} 31.0
{TPOT}_sum{{engine="0",model_name="llama"}} 1.5
{TPOT}_bucket{{model_name="a \"b\", {{c}}",le="2.5e-2",engine="1"}} 0
{TPOT}_bucket{{model_name="a \"b\", {{c}}",le="0.05",engine="1"}} 4
{TPOT}_bucket{{model_name="a \"b\", {{c}}",le="0.1",engine="1"}} 5
{TPOT}_bucket{{model_name="a \"b\", {{c}}",le="Inf",engine="1"}} 9
{TPOT}_count{{model_name="a \"b\", {{c}}",engine="1"}} 9
{TPOT}_sum{{model_name="a \"b\", {{c}}",engine="1"}} 3.25
# HELP {TPOT}_created Histogram of time per output token in seconds.
# TYPE {TPOT}_created gauge
{TPOT}_created{{engine="0",model_name="llama"}} 1.7962110791488833e+09
vllm:gpu_cache_usage_perc{{engine="0" 0.5
vllm:inter_token_latency_seconds_bucket{{le="+Inf"}} 99
"""
VLLM_HISTOGRAM = Histogram((0.025, 0.05, 0.1, math.inf), (2.0, 16.0, 35.0, 40.0), 40.0, 4.75)


def test_the_histogram_is_summed_over_vllms_label_sets_and_nothing_else() -> None:
    assert parse_histogram(VLLM_TEXT, DEFAULT_METRICS) == VLLM_HISTOGRAM
    assert parse_histogram(VLLM_TEXT.replace("\n", "\r\n"), [TPOT]) == VLLM_HISTOGRAM
    e2e = parse_histogram(VLLM_TEXT, ["vllm:nope", "vllm:e2e_request_latency_seconds"])
    assert e2e == Histogram((1.0, math.inf), (7.0, 9.0), 9.0, 8.5)
    assert parse_histogram(VLLM_TEXT, ["vllm:num_requests", "vllm:gpu_cache_usage_perc"]) is None


def test_the_renamed_histogram_of_newer_vllm_is_read_when_the_old_one_is_absent() -> None:
    newer = VLLM_TEXT.replace(TPOT, "vllm:inter_token_latency_seconds").replace(
        'vllm:inter_token_latency_seconds_bucket{le="+Inf"} 99\n', ""
    )
    assert TPOT not in newer
    assert parse_histogram(newer, DEFAULT_METRICS) == VLLM_HISTOGRAM


def test_what_prometheus_client_writes_is_read_as_it_counted(endpoint: Endpoint) -> None:
    tpot = endpoint.vllm()
    for value in (0.01, 0.03, 0.03, 0.2, 0.7, 3.0):
        tpot.labels("llama", "0").observe(value)
    tpot.labels('a "b", {c}\n', "1").observe(0.07)
    found = parse_histogram(generate_latest(endpoint.registry).decode(), DEFAULT_METRICS)
    assert found == Histogram(
        (*BUCKETS, math.inf), (1.0, 3.0, 4.0, 5.0, 5.0, 6.0, 7.0), 7.0, pytest.approx(4.04)
    )


def test_a_histogram_declared_before_its_first_observation_is_empty_not_absent(
    endpoint: Endpoint,
) -> None:
    endpoint.vllm()  # labelled, as vLLM's are: no samples until a child observes
    text = generate_latest(endpoint.registry).decode()
    assert f"# TYPE {TPOT} histogram" in text and f"{TPOT}_count" not in text
    assert parse_histogram(text, DEFAULT_METRICS) == Histogram((math.inf,), (0.0,), 0.0, 0.0)


GOOD = f"""# TYPE {TPOT} histogram
{TPOT}_bucket{{le="0.05"}} 5
{TPOT}_bucket{{le="+Inf"}} 6
{TPOT}_count 6
{TPOT}_sum 0.5
"""


@pytest.mark.parametrize(
    ("good", "bad", "message"),
    [
        ('le="0.05"} 5', 'le="0.05"} five', "line 2: the value must be a number, got 'five'"),
        ('le="0.05"} 5', 'le="0.05"} NaN', "line 2: the value must be a number"),
        ('le="0.05"} 5', 'le="0.05" 5', "line 2: cannot read"),
        ('le="0.05"} 5', 'le="0.05"}', "line 2: cannot read"),
        ('le="0.05"} 5', 'le="0.05"} 5 soon', "line 2: cannot read"),
        ('le="0.05"} 5', 'le="0.05" model_name="x"} 5', "line 2: cannot read the labels"),
        ('{le="0.05"} 5', '{le="fast"} 5', "line 2: le must be a number, got 'fast'"),
        ('{le="0.05"} 5', '{model_name="x"} 5', "line 2: a bucket with no le label"),
        ('{le="0.05"} 5', '{le="0.05"} -1', "line 2: a count must be a number >= 0"),
        (f"{TPOT}_count 6", f"{TPOT}_count +Inf", "line 4: a count must be a number >= 0"),
        ('{le="0.05"} 5', '{le="0.05"} 7', "its bucket counts are not cumulative"),
        ('{le="+Inf"} 6', '{le="0.5"} 6', 'no le="+Inf" bucket'),
        ('{le="+Inf"} 6', '{le="0.05"} 6', "line 3: a second bucket le=0.05"),
        (f"{TPOT}_count 6\n", "", f"no {TPOT}_count line"),
        ('{le="+Inf"} 6', '{le="+Inf",engine="1"} 6', "its label sets have different buckets"),
    ],
)
def test_a_malformed_line_of_the_wanted_histogram_is_refused_naming_it(
    good: str, bad: str, message: str
) -> None:
    assert parse_histogram(GOOD, DEFAULT_METRICS) is not None
    assert GOOD.count(good) == 1
    with pytest.raises(InputError) as caught:
        parse_histogram(GOOD.replace(good, bad) + VLLM_TEXT.replace(TPOT, "other"), DEFAULT_METRICS)
    assert message in str(caught.value)


# -- the window's quantile: Prometheus' histogram_quantile over the increase ---------------------


def _h(*counts: float) -> Histogram:
    return Histogram((0.1, 0.2, 0.4, math.inf), counts, counts[-1], 0.0)


@pytest.mark.parametrize(
    ("before", "after", "q", "expected"),
    [
        (None, _h(10, 30, 40, 40), 0.5, 0.15),  # rank 20 in (0.1, 0.2]: 0.1 + 0.1 · 10/20
        (None, _h(10, 30, 40, 40), 0.05, 0.02),  # rank 2, first bucket from 0: 0.1 · 2/10
        (None, _h(10, 30, 40, 40), 0.99, 0.392),  # rank 39.6 in (0.2, 0.4]: 0.2 + 0.2 · 9.6/10
        (None, _h(10, 30, 40, 50), 0.9, 0.4),  # rank 45 in (0.4, +Inf]: the largest finite bound
        (_h(10, 30, 40, 40), _h(10, 40, 60, 60), 0.5, 0.2),  # increase (0, 10, 20, 20): rank 10
        (_h(10, 30, 40, 40), _h(10, 40, 60, 60), 0.75, 0.3),  # rank 15: 0.2 + 0.2 · 5/10
        (_h(10, 30, 40, 40), _h(10, 30, 40, 40), 0.5, None),  # nothing observed in between
        (None, _h(0, 0, 0, 0), 0.5, None),
        (_h(10, 30, 40, 40), _h(1, 2, 3, 3), 0.5, 0.15),  # a reset: after alone, 0.1 + 0.1 · 0.5/1
        (
            _h(2, 5, 40, 40),
            _h(3, 4, 44, 44),
            0.5,
            0.29,
        ),  # a bucket went back: after, 0.2 + 0.2 · 18/40
        (Histogram((1.0, math.inf), (3, 3), 3, 0), _h(10, 30, 40, 40), 0.5, 0.15),  # new buckets
    ],
)
def test_the_quantile_is_prometheus_histogram_quantile_of_the_increase(
    before: Histogram | None, after: Histogram, q: float, expected: float | None
) -> None:
    found = window_quantile(before, after, q)
    assert found == (None if expected is None else pytest.approx(expected, rel=1e-12))


@pytest.mark.parametrize("q", [0.0, 1.0, -0.5, math.nan])
def test_a_quantile_outside_0_1_is_refused(q: float) -> None:
    with pytest.raises(InputError, match="q: must be in"):
        window_quantile(None, _h(1, 2, 3, 3), q)


# -- the scraper, through a real endpoint and a real agent -------------------------------------


def test_each_scrape_sends_the_count_the_windows_percentile_and_rate(
    endpoint: Endpoint, agent: Agent
) -> None:
    tpot = endpoint.vllm()
    llama, mistral = tpot.labels("llama", "0"), tpot.labels("mistral", "1")
    for _ in range(30):
        llama.observe(0.01)
    scraper = _scraper(endpoint.url, agent)
    assert scraper.step(100.0) is None  # the baseline
    for _ in range(90):
        llama.observe(0.03)
    for _ in range(10):
        mistral.observe(0.3)
    line = scraper.step(102.0)
    # 90 in (0.025, 0.05] and 10 in (0.25, 0.5]: rank 99 is the 9th of the 10, 0.25 + 0.25 · 9/10
    assert agent.wait(1) == [("77", 130, None, UID, pytest.approx(0.475), 50.0)]
    assert line is not None and (line.step, line.rate) == (130, 50.0)
    assert scraper.step(104.0) is not None  # nothing served meanwhile: no latency, rate 0
    assert agent.wait(2)[1] == ("77", 130, None, UID, None, 0.0)
    for _ in range(20):
        llama.observe(0.02)
    scraper.step(108.0)
    # rank 19.8 of 20 in the first bucket, from 0: 0.025 · 19.8/20
    assert agent.wait(3)[2] == ("77", 150, None, UID, pytest.approx(0.02475), 5.0)


def test_a_restarted_server_counts_from_zero_and_the_count_sent_goes_on(
    endpoint: Endpoint, agent: Agent
) -> None:
    tpot = endpoint.vllm()
    for _ in range(50):
        tpot.labels("llama", "0").observe(0.3)
    scraper = _scraper(endpoint.url, agent, percentile=50)
    scraper.step(10.0)
    tpot = endpoint.vllm()  # restarted: every count from 0
    for _ in range(4):
        tpot.labels("llama", "0").observe(0.07)
    scraper.step(12.0)
    # the window is the new server's 4, all in (0.05, 0.1]: rank 2, 0.05 + 0.05 · 2/4
    assert agent.wait(1) == [("77", 54, None, UID, pytest.approx(0.075), 2.0)]


def test_the_percentile_is_the_scrapers_and_latency_is_clamped_to_the_wire(
    endpoint: Endpoint, agent: Agent
) -> None:
    tpot = endpoint.vllm()
    scraper = _scraper(endpoint.url, agent, percentile=10)
    scraper.step(0.0)
    for _ in range(10):
        tpot.labels("llama", "0").observe(0.04)
    tpot.labels("llama", "0").observe(99.0)
    scraper.step(1.0)
    # rank 1.1 of 11 in (0.025, 0.05]: 0.025 + 0.025 · 1.1/10
    assert agent.wait(1)[0][4] == pytest.approx(0.02775)
    endpoint.body = (
        f'{TPOT}_bucket{{le="0"}} 0\n{TPOT}_bucket{{le="+Inf"}} 0\n{TPOT}_count 0\n{TPOT}_sum 0\n'
    ).encode()
    scraper.step(2.0)  # new buckets: after alone, with nothing in it
    endpoint.body = (
        f'{TPOT}_bucket{{le="0"}} 5\n{TPOT}_bucket{{le="+Inf"}} 5\n{TPOT}_count 5\n{TPOT}_sum 0\n'
    ).encode()
    scraper.step(3.0)  # at most 0 s: no request is served in no time, the least the wire takes
    assert agent.wait(3)[2][4] == 1e-6


def test_scraper_run_scrapes_every_period_until_stopped(endpoint: Endpoint, agent: Agent) -> None:
    endpoint.vllm().labels("llama", "0").observe(0.2)
    scraper = _scraper(endpoint.url, agent)
    stop = threading.Event()
    thread = threading.Thread(target=scraper.run, args=(0.05, stop))
    thread.start()
    assert agent.wait(2)[:2] == [("77", 1, None, UID, None, 0.0)] * 2
    stop.set()
    thread.join(timeout=5)
    assert not thread.is_alive()


# -- failures: logged once per kind, never raised ------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("setup", "logged"),
    [
        ("unreachable", "Connection refused"),
        ("status 500", "HTTP Error 500"),
        ("too long", "longer than 8 MiB"),
        ("malformed", "line 2: the value must be a number"),
        ("absent", f"no histogram {TPOT} or vllm:inter_token_latency_seconds"),
        ("no agent", "none.sock"),
    ],
)
def test_a_failure_is_logged_once_and_never_raised(
    endpoint: Endpoint, agent: Agent, caplog: pytest.LogCaptureFixture, setup: str, logged: str
) -> None:
    endpoint.vllm().labels("llama", "0").observe(0.2)
    url, path = endpoint.url, agent.path
    if setup == "unreachable":
        url = f"http://127.0.0.1:{_free_port()}/metrics"
    elif setup == "status 500":
        endpoint.status, endpoint.body = 500, GOOD.encode()
    elif setup == "too long":
        endpoint.body = b"#" * (MAX_BODY_BYTES + 1)
    elif setup == "malformed":
        endpoint.body = GOOD.replace("} 5", "} five").encode()
    elif setup == "absent":
        endpoint.body = GOOD.replace(TPOT, "vllm:other").encode()
    else:
        path = path.with_name("none.sock")
    scraper = _scraper(url, agent, path=path)
    assert [scraper.step(float(t)) for t in range(4)] == [None] * 4
    (message,) = [record.getMessage() for record in caplog.records]
    assert logged in message and message.endswith("(not logged again)")
    assert agent.records == []


def test_a_body_of_8_mib_is_read(endpoint: Endpoint, agent: Agent) -> None:
    endpoint.body = (GOOD + "#" * (MAX_BODY_BYTES - len(GOOD))).encode()
    assert len(endpoint.body) == MAX_BODY_BYTES
    scraper = _scraper(endpoint.url, agent)
    scraper.step(0.0)
    assert scraper.step(1.0) is not None


def test_off_outside_a_job_or_when_switched_off_it_does_not_scrape(agent: Agent) -> None:
    def fetch(url: str) -> str:
        raise AssertionError(f"fetched {url}")

    for env in ({}, {"SLURM_JOB_ID": "abc"}, {"SLURM_JOB_ID": "77", "CDGPC_PROGRESS": " Off "}):
        off = Scraper("http://127.0.0.1:1/metrics", path=agent.path, env=env, fetch=fetch)
        assert not off.enabled and off.step(1.0) is None
        off.run(0.01, threading.Event())  # returns at once
    on = Scraper("http://x/metrics", path=agent.path, env={"SLURM_JOB_ID": "77"}, fetch=fetch)
    assert on.enabled and on.job_id == "77"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"url": "ftp://127.0.0.1/metrics"}, "url: must be an http:// or https:// URL"),
        ({"url": "file:///etc/passwd"}, "url: must be an http:// or https:// URL"),
        ({"url": "127.0.0.1:8000/metrics"}, "url: must be an http:// or https:// URL"),
        ({"url": "http://[::1/metrics"}, "url: must be an http:// or https:// URL"),
        ({"percentile": 100}, "percentile: must be in (0, 100), got 100"),
        ({"percentile": 0}, "percentile: must be in (0, 100), got 0"),
        ({"names": []}, "names: must be Prometheus metric names"),
        ({"names": ["vllm:ok", "not a name"]}, "names: must be Prometheus metric names"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InputError) as caught:
        Scraper(**({"url": "http://127.0.0.1:8000/metrics"} | kwargs))
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


# -- cdgpc-progress --scrape -------------------------------------------------------------------


def _cli(agent: Agent, *args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "slurm_cdgpc.agent.progress", *args],
        env={"PYTHONPATH": str(REPO), "CDGPC_NODE_PROGRESS_SOCKET": str(agent.path), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_cli_scrapes_every_period_until_a_signal_then_exits_0(
    endpoint: Endpoint, agent: Agent, signum: int
) -> None:
    endpoint.vllm("vllm:ttft_seconds").labels("llama", "0").observe(0.2)
    cli = _cli(
        agent,
        *("--scrape", endpoint.url, "--metric", "vllm:nope", "--metric", "vllm:ttft_seconds"),
        *("--every", "100ms", "--percentile", "50"),
        SLURM_JOB_ID="42",
    )
    try:
        assert agent.wait(2)[:2] == [("42", 1, None, UID, None, 0.0)] * 2
        cli.send_signal(signum)
        out, err = cli.communicate(timeout=10)
    finally:
        cli.kill()
    assert (cli.returncode, out, err) == (0, "", "")


@pytest.mark.parametrize(
    "env", [{}, {"SLURM_JOB_ID": "42", "CDGPC_PROGRESS": "off"}], ids=["no job", "off"]
)
def test_cli_scrape_is_off_outside_a_job_or_switched_off(agent: Agent, env: dict[str, str]) -> None:
    cli = _cli(agent, "--scrape", "http://127.0.0.1:1/metrics", **env)
    out, err = cli.communicate(timeout=30)
    assert (cli.returncode, out) == (0, "")
    assert err.count("\n") == 1 and err.startswith("cdgpc-progress: off")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "Error: nothing to report: give step or --scrape URL"),
        (["5", "--scrape", "http://127.0.0.1:8000/metrics"], "Error: give step or --scrape URL"),
        (["--scrape", "http://h/metrics", "--every", "soon"], "Error: --every: cannot read"),
        (["--scrape", "http://h/metrics", "--every", "0s"], "Error: --every: duration must be"),
        (["--scrape", "http://h/metrics", "--latency", "1s"], "Error: --latency and --rate go"),
        (["--scrape", "http://h/metrics", "--percentile", "100"], "Error: percentile: must be"),
        (["--scrape", "localhost:8000"], "Error: url: must be an http:// or https:// URL"),
        (["--scrape", "http://h/metrics", "--metric", "a b"], "Error: names: must be"),
        (["5", "--every", "5s"], "Error: --metric, --percentile and --every go with --scrape"),
    ],
)
def test_cli_usage_errors_are_one_line_and_exit_2(
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(message) and err.count("\n") == 1
