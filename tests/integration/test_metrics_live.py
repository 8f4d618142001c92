"""``promtool check metrics`` on what a live cdgpcd and a live cdgpc-noded serve at ``/metrics``.

The head and two agents (simulated GPUs, HMAC) run as real processes on loopback, as in
`tests.integration.test_head_live`; the head has exchanged with both agents and answered a
registration and a refusal before the scrapes. promtool comes from Debian's ``prometheus``
package (tests/prepare.sh installs it); without it the test skips, and fails under CI=true.
"""

from __future__ import annotations

import http.client
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slurm_cdgpc.localcluster import LocalCluster
from tests.integration.test_head_live import make_site

pytestmark = pytest.mark.live

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin", "/bin"])


def _unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def promtool() -> str:
    found = shutil.which("promtool", path=_SEARCH_PATH)
    if found is None:
        _unavailable("promtool is not installed (apt-get install prometheus)")
    return found


@pytest.fixture
def site(tmp_path: Path) -> Iterator[LocalCluster]:
    yield from make_site(tmp_path, f"sqlite:///{tmp_path / 'cdgpc.db'}")


def _scrape(port: int) -> str:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/metrics")
        reply = connection.getresponse()
        body = reply.read().decode()
        assert (reply.status, reply.getheader("Content-Type")) == (200, CONTENT_TYPE), body
        return body
    finally:
        connection.close()


def _value(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    raise KeyError(f"{name}{labels}")


def _check(promtool: str, text: str) -> str:
    """promtool's verdict on ``text``: its output, which is empty when it finds nothing."""
    done = subprocess.run(
        [promtool, "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    output = (done.stdout + done.stderr).strip()
    assert done.returncode == 0, f"promtool check metrics exited {done.returncode}: {output}"
    return output


def test_promtool_accepts_the_metrics_of_a_live_head_and_agent(
    site: LocalCluster, promtool: str
) -> None:
    site.start_head()
    client = site.client()
    site.announce()
    client.post("/v1/jobs", {"job_id": "7", "user": "root", "node": "node2", "gpus": [1]})
    refused = http.client.HTTPConnection("127.0.0.1", site.head.port, timeout=10)
    try:  # a Prolog without a credential
        refused.request("POST", "/v1/jobs", body=b"{}", headers={"Content-Length": "2"})
        assert refused.getresponse().status == 401
    finally:
        refused.close()
    site.wait_reachable()

    head = _scrape(site.head.port)
    assert _check(promtool, head) == ""
    assert _value(head, "cdgpc_registrations_total") == 1
    assert _value(head, "cdgpc_registrations_refused_total", code="401") == 1
    assert _value(head, "cdgpc_nodes", reachable="true") == 2
    assert _value(head, "cdgpc_interval_duration_seconds_count") >= 1
    assert _value(head, "process_resident_memory_bytes") > 0

    agent = _scrape(site.nodes["node2"].port)
    assert _check(promtool, agent) == ""
    assert _value(agent, "cdgpc_node_exchanges_total") >= 1
    assert _value(agent, "cdgpc_node_lease_lapsed") == 0
    assert _value(agent, "process_resident_memory_bytes") > 0
