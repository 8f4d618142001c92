"""The head with nested power domains: the plan keeps a rack's limit, and the report, the API,
``cdgpc-admin`` and ``/metrics`` judge each domain as the cluster is judged.

The clusters are `tests.unit.test_coordinator_daemon`'s: in-process agents on simulated GPUs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from slurm_cdgpc.cli import admin
from slurm_cdgpc.coordinator.api import budget_view, status_dict
from slurm_cdgpc.coordinator.daemon import Coordinator
from slurm_cdgpc.coordinator.report import IntervalReport
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.gpu.catalog import CATALOG
from slurm_cdgpc.topology import Topology, parse_topology
from tests.unit.test_coordinator_daemon import Cluster, MakeCluster, make_cluster, register_job

__all__ = ["make_cluster"]  # the fixture, imported to be found

BUDGET_W = 5000.0  # six busy A100s draw under half of it: the budget never binds
RACK1_W = 1000.0  # n1 and n2's four busy GPUs draw about 1500 W at top clocks
TOPOLOGY = f"""
[[domain]]
name = "rack1"
limit = "{RACK1_W:g}W"
nodes = "n[1-2]"
[[domain]]
name = "rack2"
limit = "3kW"
nodes = "n3"
"""


def _busy_cluster(make_cluster: MakeCluster, topology: Topology | None) -> Cluster:
    """Three nodes of two busy A100s, one job on each node's two GPUs, run for 8 intervals."""
    cluster = make_cluster(("n1", "n2", "n3"), topology=topology)
    for node in cluster.agents:
        for index in (0, 1):
            cluster.gpu(node, index).attach("bert")
    cluster.store.set_budget(BUDGET_W, "root")
    cluster.tick()
    for job_id, node in (("1", "n1"), ("2", "n2"), ("3", "n3")):
        register_job(cluster, job_id, node, 0, 1)
    for _ in range(8):
        cluster.tick()
    return cluster


def _clocks(report: IntervalReport) -> dict[str, int]:
    """The decided clock of each controlled job."""
    return {v.job_id: v.graphics_mhz for v in report.jobs if v.graphics_mhz is not None}


def test_a_rack_limit_binds_while_the_budget_does_not(make_cluster: MakeCluster) -> None:
    free = _busy_cluster(make_cluster, None).tick()
    racked = _busy_cluster(make_cluster, parse_topology(TOPOLOGY)).tick()
    rack1, rack2 = racked.domains
    # the cluster's budget is slack in both: price 0
    for report in (free, racked):
        assert (report.status, report.price) == ("slack", 0.0)
        assert report.predicted_power_w is not None
        assert report.predicted_power_w + report.uncontrolled_w < 0.7 * BUDGET_W
    # rack1's jobs run slower than without the rack, and rack1 keeps its limit, planned and drawn
    without, with_rack = _clocks(free), _clocks(racked)
    assert set(without) == set(with_rack) == {"1", "2", "3"}
    assert with_rack["1"] < without["1"] and with_rack["2"] < without["2"]
    assert with_rack["3"] == without["3"]  # rack2 has room: n3's job is not held back
    assert rack1.name == "rack1" and rack1.limit_w == RACK1_W
    assert 0.9 * RACK1_W < rack1.planned_w <= RACK1_W
    assert rack1.measured_w <= 1.01 * RACK1_W
    assert rack2.planned_w < rack2.limit_w and rack2.measured_w < rack2.limit_w
    # the domains' measured power is the cluster's, split by node
    assert rack1.measured_w + rack2.measured_w == pytest.approx(racked.measured_power_w)


def test_per_node_power_outside_the_plan_sums_to_the_clusters(
    make_cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle node read, two nodes never reached at their worst case: the per-node breakdown
    the domains are built from is the cluster's total, node by node."""
    topology = parse_topology('[[domain]]\nname = "rack1"\nlimit = "10kW"\nnodes = "n1,n9"\n')
    cluster = make_cluster(("n1",), topology=topology)
    cluster.store.set_budget(BUDGET_W, "root")
    largest_w = max(s.power_limit.max_w for s in CATALOG.values())
    cluster.head.register_job("9", "bob", "n9", [0, 2])  # no agent, never reported, no type
    cluster.head.register_node("n8", "http://n8.test:8464")  # announced, no type
    cluster.head.register_job("10", "bob", "n8", [1])
    cluster.tick()  # the exchanges with n8 and n9 fail
    n1_w = sum(r.power_w or 0.0 for r in cluster.head.nodes["n1"].reports)  # idle, read
    seen: list[dict[str, float]] = []
    breakdown = cluster.head.ledger.uncontrolled_by_node_w

    def spy(*args: Any) -> dict[str, float]:
        seen.append(breakdown(*args))
        return seen[-1]

    monkeypatch.setattr(cluster.head.ledger, "uncontrolled_by_node_w", spy)
    report = cluster.tick()
    [by_node] = seen
    assert by_node == pytest.approx({"n1": n1_w, "n8": 2 * largest_w, "n9": 3 * largest_w})
    assert report.uncontrolled_w == pytest.approx(n1_w + 3 * largest_w + 2 * largest_w)
    assert sum(by_node.values()) == report.uncontrolled_w
    # no job is controlled: rack1 plans for what is outside the plan on n1 and n9, and measures
    # what n1 drew (n9 never answered)
    [rack1] = report.domains
    assert rack1.planned_w == pytest.approx(by_node["n1"] + by_node["n9"])
    n1_drawn = [w for ref, w in cluster.head.nodes.power_by_gpu().items() if ref.node == "n1"]
    assert rack1.measured_w == pytest.approx(sum(n1_drawn))


@dataclass
class _Head:
    """``cdgpc-admin``'s client, answered by the head's own views (through JSON, as over HTTP)."""

    head: Coordinator

    def get(self, path: str, query: Mapping[str, object] | None = None) -> Any:
        view = {"/v1/status": status_dict, "/v1/budget": budget_view}[path]
        return json.loads(json.dumps(view(self.head)))


def _admin(monkeypatch: pytest.MonkeyPatch, head: Coordinator, *args: str) -> str:
    monkeypatch.setattr(admin, "_config", lambda path: None)
    monkeypatch.setattr(admin, "_client", lambda config: _Head(head))
    group = {"status": admin.status, "budget": admin.budget}[args[0]]
    result = CliRunner().invoke(group, list(args[1:]))
    assert result.exit_code == 0, result.output
    return result.output


def _domain_samples(head: Coordinator) -> dict[tuple[str, str], float]:
    """(series, domain) → value of every ``cdgpc_domain_*`` sample the head exposes."""
    text = head.metrics.render().decode()
    return {
        (s.name, s.labels["domain"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("cdgpc_domain_")
    }


def test_the_report_api_admin_and_metrics_carry_each_domain(
    make_cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = _busy_cluster(make_cluster, parse_topology(TOPOLOGY))
    report = cluster.tick()
    head = cluster.head
    rack1, rack2 = report.domains
    expected = [
        {"name": d.name, "limit_w": d.limit_w, "planned_w": d.planned_w, "measured_w": d.measured_w}
        for d in (rack1, rack2)
    ]
    assert report.to_dict()["domains"] == expected
    assert status_dict(head)["last_interval"]["domains"] == expected  # type: ignore[index]
    from_file = {"source": "file", "set": None, "scheduled": []}
    assert budget_view(head)["domains"] == [
        {"name": "rack1", "limit_w": RACK1_W, "file_limit_w": RACK1_W, **from_file},
        {"name": "rack2", "limit_w": 3000.0, "file_limit_w": 3000.0, **from_file},
    ]

    status = _admin(monkeypatch, head, "status").splitlines()
    assert [line for line in status if line.startswith("domain ")] == [
        "domain rack1: limit 1 kW, planned "
        f"{rack1.planned_w:.1f} W, measured {rack1.measured_w:.1f} W",
        "domain rack2: limit 3 kW, planned "
        f"{rack2.planned_w:.1f} W, measured {rack2.measured_w:.1f} W",
    ]
    assert json.loads(_admin(monkeypatch, head, "status", "--json")) == json.loads(
        json.dumps(status_dict(head))
    )
    shown = _admin(monkeypatch, head, "budget", "show").splitlines()
    assert shown[:3] == [
        "budget: 5 kW",
        "domain rack1: limit 1 kW (topology file)",
        "domain rack2: limit 3 kW (topology file)",
    ]
    assert json.loads(_admin(monkeypatch, head, "budget", "show", "--json")) == json.loads(
        json.dumps(budget_view(head))
    )

    assert _domain_samples(head) == {
        ("cdgpc_domain_limit_watts", "rack1"): RACK1_W,
        ("cdgpc_domain_limit_watts", "rack2"): 3000.0,
        ("cdgpc_domain_planned_watts", "rack1"): pytest.approx(rack1.planned_w),
        ("cdgpc_domain_planned_watts", "rack2"): pytest.approx(rack2.planned_w),
        ("cdgpc_domain_power_watts", "rack1"): pytest.approx(rack1.measured_w),
        ("cdgpc_domain_power_watts", "rack2"): pytest.approx(rack2.measured_w),
    }


def test_without_a_topology_there_is_no_domain_anywhere(
    make_cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = _busy_cluster(make_cluster, None)
    report = cluster.tick()
    head = cluster.head
    assert report.domains == () and report.to_dict()["domains"] == []
    assert budget_view(head)["domains"] == []
    assert "domain" not in _admin(monkeypatch, head, "status")
    assert "domain" not in _admin(monkeypatch, head, "budget", "show")
    assert _domain_samples(head) == {}


def test_an_admins_rack_limit_is_the_one_the_plan_keeps_until_the_next_one(
    make_cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``budget set --domain rack1`` lowers rack1 below its file's limit at once, and a change
    scheduled for later takes over at its time; ``budget show`` says where each limit comes
    from, and the cluster's budget is untouched."""
    cluster = _busy_cluster(make_cluster, parse_topology(TOPOLOGY))
    head = cluster.head
    lowered_w, raised_w = 700.0, 900.0
    head.set_budget(lowered_w, "alice", domain="rack1", reason="breaker work")
    later_s = cluster.clock() + 6.5
    head.set_budget(raised_w, "alice", domain="rack1", effective_at_s=later_s)
    assert cluster.store.current_budget().budget_w == BUDGET_W  # type: ignore[union-attr]

    for _ in range(5):
        rack1, rack2 = cluster.tick().domains
        assert (rack1.limit_w, rack2.limit_w) == (lowered_w, 3000.0)
    assert 0.9 * lowered_w < rack1.planned_w <= lowered_w
    assert rack1.measured_w <= 1.01 * lowered_w
    text = head.metrics.render().decode()  # /metrics: the limit in force, not the file's
    assert 'cdgpc_domain_limit_watts{domain="rack1"} 700.0' in text

    view = budget_view(head)["domains"]
    assert [(d["name"], d["limit_w"], d["source"], d["file_limit_w"]) for d in view] == [  # type: ignore[attr-defined]
        ("rack1", lowered_w, "set", RACK1_W),
        ("rack2", 3000.0, "file", 3000.0),
    ]
    [rack1_view, _] = view  # type: ignore[misc]
    assert rack1_view["set"]["set_by"] == "alice" and rack1_view["set"]["domain"] == "rack1"
    assert [c["budget_w"] for c in rack1_view["scheduled"]] == [raised_w]
    shown = _admin(monkeypatch, head, "budget", "show").splitlines()
    assert shown[1].startswith("domain rack1: limit 700 W (set by alice from ")
    assert shown[1].endswith(": breaker work)")
    assert shown[2].startswith("domain rack1: limit 900 W from ")
    assert shown[2].endswith(" (scheduled by alice)")
    assert shown[3] == "domain rack2: limit 3 kW (topology file)"

    for _ in range(4):
        report = cluster.tick()
    assert report.domains[0].limit_w == raised_w
    assert report.domains[0].planned_w <= raised_w
    assert budget_view(head)["domains"][0]["scheduled"] == []  # type: ignore[index]


@dataclass
class _Posts:
    """``cdgpc-admin``'s client, recording what it would post."""

    posted: list[tuple[str, dict[str, Any]]]

    def post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        self.posted.append((path, payload))
        return {"set_by": "root", "effective_at_s": 0.0, **payload}


def _budget_set(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[Any, list[Any]]:
    posts = _Posts([])
    monkeypatch.setattr(admin, "_config", lambda path: None)
    monkeypatch.setattr(admin, "_client", lambda config: posts)
    return CliRunner().invoke(admin.budget, ["set", *args]), posts.posted


def test_budget_set_domain_only_parses_and_the_head_decides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result, posted = _budget_set(monkeypatch, "--domain", "rack12", "40kW", "--reason", "PDU")
    assert result.exit_code == 0, result.output
    assert (
        result.output == "domain rack12: limit 40 kW from " + admin._when(0.0) + " (set by root)\n"
    )
    assert posted == [("/v1/budget", {"budget_w": 40e3, "reason": "PDU", "domain": "rack12"})]

    # --at as the budget's, in either order; a negative reason is the option's
    result, posted = _budget_set(monkeypatch, "35kW", "--at", "+1h", "--domain", "rack12")
    assert result.exit_code == 0, result.output
    [(_, payload)] = posted
    assert payload["domain"] == "rack12" and payload["budget_w"] == 35e3
    assert payload["effective_at_s"] == pytest.approx(time.time() + 3600, abs=60)

    # a power that is not one: one line naming it, nothing posted (-5W is not an option -5)
    for power, *where in (("-5W", "--domain", "rack12"), ("-5W",), ("0W", "--domain", "rack12"),
                          ("40 parsecs", "--domain", "rack12")):  # fmt: skip
        for args in ([*where, power], [power, *where]):
            result, posted = _budget_set(monkeypatch, *args)
            assert result.exit_code != 0 and posted == [], args
            assert isinstance(result.exception, InputError), args
            message = str(result.exception)
            assert "\n" not in message and repr(power) in message, args
    result, posted = _budget_set(monkeypatch, "--domain")
    assert result.exit_code == 2 and posted == []
