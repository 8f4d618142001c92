"""Exchanges with every node over the transport its URL names (`RoutingExchanger`: ``http(s)://``
or ``ssh://``), both at once (the SSH batch on a thread of its own), so a cluster that mixes them
still finishes within one per-node timeout. It never reaches `agent/` or `coordinator/`
(`tests/unit/test_import_graph.py`). Test: `tests/unit/test_transport_routing.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from slurm_cdgpc.transport.http import NodeFailure, NodeTarget
from slurm_cdgpc.transport.ssh import is_ssh_url
from slurm_cdgpc.wire.protocol import ExchangeResponse


class Exchanger(Protocol):
    def exchange(
        self, targets: Mapping[str, NodeTarget]
    ) -> dict[str, ExchangeResponse | NodeFailure]: ...

    def close(self) -> None: ...


class RoutingExchanger:
    def __init__(self, http: Exchanger, ssh: Exchanger) -> None:
        self.http = http
        self.ssh = ssh
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ssh-batch")

    def exchange(
        self, targets: Mapping[str, NodeTarget]
    ) -> dict[str, ExchangeResponse | NodeFailure]:
        over_ssh = {n: t for n, t in targets.items() if is_ssh_url(t.url)}
        over_http = {n: t for n, t in targets.items() if n not in over_ssh}
        pending = self._pool.submit(self.ssh.exchange, over_ssh) if over_ssh else None
        results = self.http.exchange(over_http) if over_http else {}
        if pending is not None:
            results.update(pending.result())
        return results

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.http.close()
        self.ssh.close()
