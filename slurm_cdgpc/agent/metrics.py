"""Prometheus exposition of ``cdgpc-noded`` (``GET /metrics``): the lease, the exchanges, the
process, from a registry of its own (`AgentMetrics.registry`), never the library's global one.
No label names a job, a user or a GPU. Like all of `agent/`, it never reaches `control/`
(`tests/unit/test_import_graph.py`). The series: DESIGN.md, "Metrics"; tests:
`tests/unit/test_metrics.py`, `tests/integration/test_metrics_live.py`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from slurm_cdgpc.agent.node import NodeAgent

#: the text format `generate_latest` writes (0.0.4)
CONTENT_TYPE: Final = CONTENT_TYPE_PLAIN_0_0_4
#: bucket bounds in seconds: one exchange reads and locks a node's GPUs and writes the state file
EXCHANGE_BUCKETS_S: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
#: HTTP statuses a refused exchange may get (`slurm_cdgpc.agent.server`)
REFUSAL_CODES: Final = (400, 401, 403, 409, 411, 413, 500, 503)


class AgentMetrics:
    """cdgpc-noded's metric families over one `NodeAgent`, in a registry of their own."""

    def __init__(self, agent: NodeAgent) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, CPU, fds
        PlatformCollector(registry=self.registry)  # python_info
        self.registry.register(_LeaseCollector(agent))
        r = self.registry
        self.exchanges = Counter(
            "cdgpc_node_exchanges",
            "exchanges answered with readings (one whose lease expired on arrival applies nothing)",
            registry=r,
        )
        self.exchanges_refused = Counter(
            "cdgpc_node_exchanges_refused",
            "exchanges refused, by HTTP status (401 credential or another node's request, "
            "409 an older leader epoch)",
            ["code"],
            registry=r,
        )
        for code in REFUSAL_CODES:
            self.exchanges_refused.labels(str(code))
        self.exchange_seconds = Histogram(
            "cdgpc_node_exchange_duration_seconds",
            "time to serve one answered exchange (read every GPU, apply, write the state file)",
            buckets=EXCHANGE_BUCKETS_S,
            registry=r,
        )

    def exchange_served(self, elapsed_s: float) -> None:
        self.exchanges.inc()
        self.exchange_seconds.observe(elapsed_s)

    def exchange_refused(self, status: int) -> None:
        self.exchanges_refused.labels(str(status)).inc()

    def render(self) -> bytes:
        """The exposition text (`CONTENT_TYPE`)."""
        return generate_latest(self.registry)


class _LeaseCollector(Collector):
    """The lease and the GPUs, read at each scrape."""

    def __init__(self, agent: NodeAgent) -> None:
        self._agent = agent

    def collect(self) -> Iterator[Metric]:
        lease = self._agent.lease
        yield GaugeMetricFamily(
            "cdgpc_node_lease_lapsed",
            "1 while the head's lease has lapsed (the GPUs follow lease.on_lapse)",
            value=float(lease.lapsed),
        )
        yield GaugeMetricFamily(
            "cdgpc_node_lease_remaining_seconds",
            "time until the lease lapses (negative: lapsed that long ago)",
            value=lease.left_s,
        )
        yield CounterMetricFamily(
            "cdgpc_node_lease_lapses", "lease lapses since the agent started", value=lease.lapses
        )
        yield GaugeMetricFamily(
            "cdgpc_node_safe_capped_gpus",
            "GPUs a lapsed lease moved to the safe cap that still hold it",
            value=lease.safe_capped,
        )
        yield GaugeMetricFamily("cdgpc_node_gpus", "GPUs on this node", value=len(self._agent.gpus))
        yield GaugeMetricFamily(
            "cdgpc_node_leader_epoch",
            "the highest leader epoch seen; exchanges from an older one are refused",
            value=self._agent.epoch,
        )
