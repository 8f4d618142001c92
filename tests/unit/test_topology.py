"""The power-domain topology file: what it means (paths, sums, the controller's triples) and
every file it refuses, each with one line naming the offender and the file."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from slurm_cdgpc.config import ConfigError, load_config
from slurm_cdgpc.control.domains import IntArray
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.families import FloatArray
from slurm_cdgpc.topology import Domain, Topology, load_topology, parse_topology

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "daemon" / "topology.toml"

#: row1 ⊃ {rack11 (n1, n2), rack12 (n3, n4)}; row2 ⊃ rack21 (n5), and row2 names n6 itself
TEXT = """
[[domain]]
name = "row1"
limit = "100kW"
[[domain]]
name = "rack11"
parent = "row1"
limit = "40kW"
nodes = "n[1-2]"
[[domain]]
name = "rack12"
parent = "row1"
limit = "40kW"
nodes = ["n3", "n4"]
[[domain]]
name = "rack21"
parent = "row2"
limit = "30kW"
nodes = "n5"
[[domain]]
name = "row2"
limit = "50kW"
nodes = "n6"
"""


@pytest.fixture
def topology() -> Topology:
    return parse_topology(TEXT, "site.toml")


def test_the_shipped_example_parses_with_its_commented_keys_too() -> None:
    shipped = load_topology(EXAMPLE)
    assert shipped.names == ("row1", "rack11", "rack12", "row2", "pdu2a", "rack21", "rack22")
    rack21 = shipped.domains[shipped.index("rack21")]
    assert rack21 == Domain(
        "rack21", "pdu2a", 40_000.0, (*(f"gpu{i}" for i in range(101, 109)), "gpu120")
    )
    assert shipped.domains[shipped.index("rack12")].nodes == (
        "gpu009",
        "gpu010",
        "gpu011",
        "gpu012",
        "gpu016",
    )
    assert [shipped.names[d] for d in shipped.path("gpu110")] == ["row2", "pdu2a", "rack22"]
    # row1 ramps at 5 kW/s; the rest have no ramp of their own
    assert shipped.ramps_w_per_s.tolist() == [5000.0, *[np.inf] * 6]
    # a commented ``# key = value`` line is a valid alternative: uncommented, the file still loads
    lines = EXAMPLE.read_text().splitlines()
    commented = [i for i, line in enumerate(lines) if re.match(r"^# \w+ = ", line)]
    assert commented
    for i in commented:
        parse_topology("\n".join([*lines[:i], lines[i][2:], *lines[i + 1 :]]), str(EXAMPLE))


def test_parents_come_before_children(topology: Topology) -> None:
    assert topology.names == ("row1", "rack11", "rack12", "row2", "rack21")
    assert topology.domains[topology.index("rack21")].parent == "row2"
    np.testing.assert_array_equal(topology.limits_w, [100e3, 40e3, 40e3, 50e3, 30e3])


def test_a_node_is_in_its_domain_and_every_domain_above(topology: Topology) -> None:
    assert topology.path("n3") == (topology.index("row1"), topology.index("rack12"))
    assert topology.path("n5") == (topology.index("row2"), topology.index("rack21"))
    assert topology.path("n6") == (topology.index("row2"),)
    assert topology.path("elsewhere") == ()


def test_an_unknown_domain_is_refused_naming_it(topology: Topology) -> None:
    with pytest.raises(InputError, match=r"unknown power domain 'rack99' \(known: 'row1', "):
        topology.index("rack99")


def test_node_power_sums_over_descendants(topology: Topology) -> None:
    power_w = topology.node_power_w({"n1": 100.0, "n3": 10.0, "n5": 1.0, "n6": 2.0, "n9": 1e6})
    np.testing.assert_array_equal(power_w, [110.0, 100.0, 10.0, 3.0, 1.0])


def triples(domain: IntArray, row: IntArray, share: FloatArray) -> set[tuple[int, int, float]]:
    return {(int(d), int(n), float(s)) for d, n, s in zip(domain, row, share, strict=True)}


def test_the_controller_gets_one_share_per_domain_a_job_is_under(topology: Topology) -> None:
    row1, rack11, rack12 = (topology.index(n) for n in ("row1", "rack11", "rack12"))
    row2, rack21 = topology.index("row2"), topology.index("rack21")
    jobs = [
        {"n1": 4, "n3": 4},  # two racks of one row
        {"n9": 8},  # a node in no domain: under the cluster alone
        {"n2": 6, "n5": 2},  # two rows
        {"n5": 8},  # one node
    ]
    limits = topology.limits(jobs, {"n2": 50.0, "n5": 7.0, "n9": 1e6})
    assert limits.names == topology.names
    assert triples(limits.domain, limits.job_row, limits.share) == {
        (rack11, 0, 0.5),
        (rack12, 0, 0.5),
        (row1, 0, 1.0),
        (row1, 2, 0.75),
        (rack11, 2, 0.75),
        (row2, 2, 0.25),
        (rack21, 2, 0.25),
        (row2, 3, 1.0),
        (rack21, 3, 1.0),
    }
    np.testing.assert_array_equal(limits.uncontrolled_w, [50.0, 50.0, 0.0, 7.0, 7.0])
    np.testing.assert_array_equal(limits.limit_w, topology.limits_w)
    np.testing.assert_allclose(
        limits.job_power_w(np.array([1000.0, 500.0, 800.0, 400.0])), [1600, 1100, 500, 600, 600]
    )


def test_limits_in_force_override_the_files(topology: Topology) -> None:
    limit_w = np.array([90e3, 30e3, 30e3, 40e3, 20e3])
    limits = topology.limits([{"n1": 1}], {}, limit_w)
    np.testing.assert_array_equal(limits.limit_w, limit_w)
    with pytest.raises(InputError, match="5 domains need 5 limits"):
        topology.limits([], {}, np.array([1.0]))


def test_no_file_no_domains() -> None:
    assert len(Topology.empty().limits([{"n1": 8}], {"n1": 100.0})) == 0
    assert len(parse_topology("# nothing yet\n")) == 0


# -- refusals: one line naming the offender and the file ---------------------------------------

DOMAIN = '[[domain]]\nname = "{name}"\nlimit = "{limit}"\n'
ROW = DOMAIN.format(name="row1", limit="100kW")


def rack(name: str, limit: str = "40kW", parent: str = "row1", nodes: str = "") -> str:
    text = DOMAIN.format(name=name, limit=limit) + f'parent = "{parent}"\n'
    return text + (f"nodes = {nodes}\n" if nodes else "")


REFUSED = [
    ("not TOML", "[[domain]\nname = 1", ["not valid TOML"]),
    ("unknown top key", 'domains = "x"\n', ["unknown key 'domains'"]),
    ("domain not a table", "domain = 3\n", ["must be [[domain]] tables", "3"]),
    ("unknown domain key", ROW + 'limt = "5kW"\n', ["domain 'row1'", "unknown key 'limt'"]),
    ("missing name", '[[domain]]\nlimit = "5kW"\n', ["[[domain]] #1", "missing name"]),
    ("missing limit", ROW + '[[domain]]\nname = "rack1"\n', ["domain 'rack1'", "missing limit"]),
    ("name not a string", "[[domain]]\nname = 7\nlimit = 5\n", ["#1", "name", "got 7"]),
    ("bad name", DOMAIN.format(name="rack 1", limit="5kW"), ["name", "'rack 1'"]),
    ("reserved name", DOMAIN.format(name="cluster", limit="5kW"), ["'cluster' is reserved"]),
    ("duplicate", ROW + rack("rack1") + rack("rack1"), ["'rack1' is defined twice"]),
    ("parent not a string", ROW + '[[domain]]\nname = "r"\nlimit = 1\nparent = 1\n', ["parent"]),
    ("unknown parent", ROW + rack("rack1", parent="row9"), ["'rack1'", "unknown parent 'row9'"]),
    ("own parent", rack("a", parent="a"), ["cycle", "'a' → 'a'"]),
    (
        "cycle",
        ROW + rack("a", parent="b") + rack("b", parent="a") + rack("c", parent="a"),
        ["cycle", "'a' → 'b' → 'a'"],
    ),
    (
        "node in two racks",
        ROW + rack("rack1", nodes='"n[1-3]"') + rack("rack2", nodes='"n3,n4"'),
        ["node 'n3'", "'rack1'", "'rack2'"],
    ),
    (
        "node in a rack and its row",
        DOMAIN.format(name="row1", limit="100kW") + 'nodes = "n1"\n' + rack("rack1", nodes='"n1"'),
        ["node 'n1'", "'row1'", "'rack1'"],
    ),
    (
        "child above parent",
        ROW + rack("rack1", limit="120kW"),
        ["'rack1'", "limit 120 kW is above the 100 kW of its parent 'row1'"],
    ),
    ("negative limit", DOMAIN.format(name="row1", limit="-5W"), ["'row1'", "limit", "'-5W'"]),
    ("zero limit", '[[domain]]\nname = "row1"\nlimit = 0\n', ["'row1'", "limit", "got 0"]),
    ("unreadable limit", DOMAIN.format(name="row1", limit="abc"), ["'row1'", "limit", "'abc'"]),
    ("boolean limit", '[[domain]]\nname = "row1"\nlimit = true\n', ["'row1'", "limit", "True"]),
    ("bad ramp", ROW + 'ramp = "fast"\n', ["'row1'", "ramp", "5kW/s", "'fast'"]),
    ("negative ramp", ROW + 'ramp = "-2kW/s"\n', ["'row1'", "ramp", "'-2kW/s'"]),
    ("unbalanced hostlist", ROW + rack("rack1", nodes='"n[1-2"'), ["'rack1'", "nodes", "n[1-2"]),
    ("reversed range", ROW + rack("rack1", nodes='"n[5-1]"'), ["'rack1'", "nodes", "5-1"]),
    ("not a node name", ROW + rack("rack1", nodes='"n 1"'), ["'rack1'", "nodes", "'n 1'"]),
    ("nodes not text", ROW + rack("rack1", nodes="5"), ["'rack1'", "nodes", "got 5"]),
    ("a list item not text", ROW + rack("rack1", nodes='["n1", 2]'), ["'rack1'", "got 2"]),
]


@pytest.mark.parametrize(("text", "named"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_a_bad_file_is_refused_with_one_line_naming_the_offender(
    text: str, named: list[str]
) -> None:
    with pytest.raises(InputError) as caught:
        parse_topology(text, "/etc/cdgpc/topology.toml")
    message = str(caught.value)
    assert message.startswith("/etc/cdgpc/topology.toml: "), message
    assert "\n" not in message
    assert message.count("topology.toml") == 1, message
    for part in named:
        assert part in message, message


def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"absent\.toml: cannot read"):
        load_topology(tmp_path / "absent.toml")
    latin1 = tmp_path / "topology.toml"
    latin1.write_bytes(b'[[domain]]\nname = "r\xe9"\nlimit = 5\n')
    with pytest.raises(InputError, match=r"topology\.toml: not UTF-8"):
        load_topology(latin1)


def test_a_topology_built_in_code_is_checked_as_a_file_is() -> None:
    row = Domain("row1", "cluster", 100.0)
    with pytest.raises(InputError, match="'rack1': parent 'row1' is not a domain above it"):
        Topology((Domain("rack1", "row1", 50.0), row))
    with pytest.raises(InputError, match="'row1' is defined twice"):
        Topology((row, row))


def test_the_head_config_names_the_file(tmp_path: Path) -> None:
    config = tmp_path / "cdgpc.toml"
    config.write_text('[head]\nurl = "http://head:8463"\n')
    assert load_config(config, env={}).head.topology is None  # no file: no domains
    config.write_text('[head]\ntopology = "/etc/cdgpc/topology.toml"\n')
    assert load_config(config, env={}).head.topology == Path("/etc/cdgpc/topology.toml")
    config.write_text('[head]\ntopology = "topology.toml"\n')
    with pytest.raises(ConfigError, match=r"head\.topology: must be an absolute path"):
        load_config(config, env={})
