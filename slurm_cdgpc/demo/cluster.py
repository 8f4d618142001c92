"""The demo's cluster: ``cdgpcd`` on a SQLite file and ``cdgpc-noded`` per node, on loopback.

Built on the one local-cluster harness (`slurm_cdgpc.localcluster`): one private run directory
holds the configuration files, the HMAC key (generated for the run; MUNGE instead when
``munge -n | unmunge`` works), the store, each node's state file, progress socket and launch
directory, and every process's log. The daemons are configured by their TOML files only:
``CDGPC_*`` settings of the caller's environment (but ``CDGPC_DEBUG``) are not passed on. They
also get SIGTERM from the kernel if the demo itself dies, so no daemon outlives it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from slurm_cdgpc.errors import FatalError
from slurm_cdgpc.gpu.workloads import JOBS_DIR_ENV, SPEED_ENV
from slurm_cdgpc.localcluster import (
    LocalCluster,
    TomlValue,
    daemon_env,
    hmac_auth,
    write_hmac_key,
)
from slurm_cdgpc.transport.credentials import munge_works

#: the head's name: its process, its log (``cdgpcd.log``) and its configuration file
HEAD: Final = "cdgpcd"


@dataclass(frozen=True)
class NodeSpec:
    name: str
    gpu_type: str
    gpus: int = 8


#: two A100 and two A40 nodes: both types are calibrated on measured clock sweeps (Perseus)
DEFAULT_NODES: Final = (
    NodeSpec("node1", "A100-SXM4-80GB"),
    NodeSpec("node2", "A100-SXM4-80GB"),
    NodeSpec("node3", "A40"),
    NodeSpec("node4", "A40"),
)


def create_cluster(
    *,
    interval_s: float,
    lease_s: float,
    initial_budget_w: float,
    nodes: Sequence[NodeSpec] = DEFAULT_NODES,
    parent: Path | None = None,
    control: Mapping[str, TomlValue] | None = None,
) -> LocalCluster:
    """The run directory and every daemon's configuration (nothing started yet); ``control``:
    the head's ``[control]`` keys beyond the shipped ones."""
    run_dir = Path(tempfile.mkdtemp(prefix="cdgpc-demo-", dir=parent))
    if munge_works():
        user = pwd.getpwuid(os.geteuid()).pw_name
        auth: dict[str, TomlValue | None] = {
            "method": "munge",
            "admin_users": [user],
            "slurm_user": user,
        }
    elif os.geteuid() != 0:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise FatalError(
            "the demo needs root (the daemons accept only a root-owned HMAC key) "
            "or a running munged"
        )
    else:
        key_file = run_dir / "hmac.key"
        write_hmac_key(key_file)
        auth = hmac_auth(key_file, admin=True)
    cluster = LocalCluster(
        run_dir,
        auth,
        interval_s=interval_s,
        lease_s=lease_s,
        safe_cap=0.6,
        env=daemon_env(keep_debug=True),
        die_with_parent=True,
    )
    head = cluster.add_head(
        HEAD,
        # the demo's jobs are not this machine's Slurm's: no reconcile with squeue
        extra={
            "head": {"reconcile": False},
            "budget": {"initial": f"{initial_budget_w:.0f}W"},
            "control": dict(control or {}),
        },
    )
    for spec in nodes:
        cluster.add_node(spec.name, gpu_type=spec.gpu_type, gpus=spec.gpus, head_url=head.url)
    return cluster


def start_cluster(
    cluster: LocalCluster, *, speed: float, on_step: Callable[[str], None] = lambda _: None
) -> None:
    """Start the agents (their simulated GPUs ``speed`` times faster) and the head, wait until
    all answer, announce the nodes and wait until every one reports."""
    agents = [
        cluster.start_agent(
            node.name, env={JOBS_DIR_ENV: str(node.jobs_dir), SPEED_ENV: f"{speed:g}"}, wait=False
        )
        for node in cluster.nodes.values()
    ]
    head = cluster.start_head(wait=False)
    on_step(f"started cdgpcd and {len(agents)} cdgpc-noded; waiting for them to listen")
    for daemon in [head, *agents]:
        cluster.wait_ready(daemon)
    cluster.announce(gpu_types=True)
    client = cluster.client()

    def all_reachable() -> bool:
        nodes = client.get("/v1/nodes")["nodes"]
        return len(nodes) == len(cluster.nodes) and all(n["reachable"] for n in nodes)

    cluster.wait("every node reports to cdgpcd", all_reachable, watch=[head])
