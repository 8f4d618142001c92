from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from slurm_cdgpc.transport.http import NodeFailure, NodeTarget
from slurm_cdgpc.transport.routing import RoutingExchanger
from slurm_cdgpc.wire.protocol import ExchangeRequest, ExchangeResponse


@dataclass
class Recorder:
    label: str
    seen: list[set[str]] = field(default_factory=list)
    threads: list[str] = field(default_factory=list)
    closed: bool = False

    def exchange(
        self, targets: Mapping[str, NodeTarget]
    ) -> dict[str, ExchangeResponse | NodeFailure]:
        self.seen.append(set(targets))
        self.threads.append(threading.current_thread().name)
        return {node: NodeFailure(f"{self.label}") for node in targets}

    def close(self) -> None:
        self.closed = True


def _target(url: str) -> NodeTarget:
    return NodeTarget(url, ExchangeRequest(version=1, interval=0, lease_expires_s=1.0, node="n1"))


def test_each_node_goes_over_the_transport_its_url_names() -> None:
    http, ssh = Recorder("http"), Recorder("ssh")
    router = RoutingExchanger(http, ssh)
    results = router.exchange(
        {
            "n1": _target("http://127.0.0.1:8464"),
            "n2": _target("ssh://n2"),
            "n3": _target("ssh://n3:2222"),
        }
    )
    assert http.seen == [{"n1"}] and ssh.seen == [{"n2", "n3"}]
    assert {n: r.reason for n, r in results.items() if isinstance(r, NodeFailure)} == {
        "n1": "http",
        "n2": "ssh",
        "n3": "ssh",
    }
    assert ssh.threads[0] != threading.current_thread().name  # the SSH batch runs alongside
    router.close()
    assert http.closed and ssh.closed


def test_an_all_http_cluster_never_touches_ssh() -> None:
    http, ssh = Recorder("http"), Recorder("ssh")
    RoutingExchanger(http, ssh).exchange({"n1": _target("https://n1:8464")})
    assert ssh.seen == []
