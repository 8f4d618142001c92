"""Jobs on MIG instances through the real hooks, a real cdgpc-noded and a real cdgpcd (loopback,
HMAC from the config files, simulated GPUs: one whole A100 and one recorded A100 board in MIG
mode). What slurmd hands a MIG job's Prolog comes from Slurm's source (`slurm.env`): the GRES
record's position in ``SLURM_JOB_GPUS`` and the instance's UUID in ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_cdgpc.gpu.simulated import simulated_gpus
from slurm_cdgpc.localcluster import LocalCluster
from slurm_cdgpc.localcluster import wait_for as _wait
from slurm_cdgpc.slurm import hooks

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[2]
MIG_BOARD = REPO / "tests" / "data" / "nvml" / "a100-sxm4-80gb-mig.board.json"
GPU_TYPE = f"A100-SXM4-80GB:1,{MIG_BOARD}:1"


@pytest.fixture
def site(tmp_path: Path) -> Iterator[LocalCluster]:
    site = LocalCluster.with_hmac(tmp_path, interval_s=0.5, lease_s=2.0, unavailable=pytest.skip)
    site.add_head()
    try:
        site.add_node("node1", gpu_type=GPU_TYPE, head_url=site.head.url)
        site.start_agent("node1")
        site.start_head()
        site.announce()
        yield site
    finally:
        site.stop(timeout_s=10)


def _hook(site: LocalCluster, kind: str, env: dict[str, str], tmp_path: Path) -> str:
    """The hook as slurmd runs it, with node1's config file: its one line."""
    lines: list[str] = []
    settings = hooks.HookSettings(config_path=site.nodes["node1"].config, spool_dir=tmp_path)
    base = {"SLURM_JOB_USER": "root", "SLURMD_NODENAME": "node1"}
    status = hooks.run(kind, settings, {**base, **env}, emit=lambda _p, m: lines.append(m))
    assert status == 0
    [line] = lines
    return line


def test_jobs_on_mig_instances_are_tenants_of_their_gpu_held_by_its_power_limit(
    site: LocalCluster, tmp_path: Path
) -> None:
    client = site.client()
    client.post("/v1/budget", {"budget_w": 2000.0, "reason": "mig"})
    # the agent's simulated MIG GPU names its instances from its UUID, as this does
    parent = simulated_gpus(GPU_TYPE, None, seed=zlib.crc32(b"node1"))[1]
    first, second = parent.mig_instances()[:2]
    older = f"MIG-{parent.uuid}/{second.gpu_instance}/{second.compute_instance}"

    line = _hook(
        site,
        "prolog",
        {"SLURM_JOB_ID": "81", "SLURM_JOB_GPUS": "0", "CUDA_VISIBLE_DEVICES": first.uuid},
        tmp_path,
    )
    assert "registered GPUs 1" in line and f"{first.uuid} on GPU(s) 1" in line, line
    assert "GPU(s) [1] held here" in line, line  # by its power limit until the head plans it
    assert set(site.limits("node1")) == {1} and site.locks("node1") == {}
    line = _hook(
        site,
        "prolog",
        {"SLURM_JOB_ID": "82", "SLURM_JOB_GPUS": "1", "CUDA_VISIBLE_DEVICES": older},
        tmp_path,
    )
    assert "registered GPUs 1" in line, line

    def jobs() -> dict[str, dict[str, Any]]:
        return {j["job_id"]: j for j in client.get("/v1/jobs")["jobs"]}

    seen = jobs()
    assert all(seen[j]["gpus"] == [{"node": "node1", "index": 1}] for j in ("81", "82"))

    def levers() -> dict[int, object] | None:  # once the agent has described its boards
        gpus = client.get("/v1/nodes")["nodes"][0]["gpus"]
        by_index = {g["index"]: g for g in gpus}
        return by_index if by_index.get(1, {}).get("lever") == "power limit" else None

    gpus = _wait("boards described", levers, 5, site.logs)
    assert "another GPU here is in MIG mode" in gpus[0]["why"] and not gpus[0]["controlled"]

    # both tenants planned, through the GPU's power limit: never a clock lock on it
    _wait(
        "both jobs controlled",
        lambda: all(j["controlled"] for j in jobs().values()) or None,
        5,
        site.logs,
    )
    client.post("/v1/budget", {"budget_w": 250.0, "reason": "mig binds"})
    limits = _wait(
        "the MIG GPU held under its default limit",
        lambda: (w := site.limits("node1")).get(1, 500.0) < 250.0 and w,
        5,
        site.logs,
    )
    assert set(limits) == {1} and site.locks("node1") == {}
    shown = site.admin("nodes")
    [row] = [line for line in shown.splitlines() if "yes, by its power limit" in line]
    assert "81,82" in row, shown
    assert site.logs().count("2 GPU(s) of type") <= 2  # said when it changes, not each interval

    # the first tenant's Epilog leaves the GPU with the other's limit; the last one's resets it
    line = _hook(
        site, "epilog", {"SLURM_JOB_ID": "81", "CUDA_VISIBLE_DEVICES": first.uuid}, tmp_path
    )
    assert "deregistered" in line, line
    assert set(jobs()) == {"82"} and 1 in site.limits("node1")
    line = _hook(site, "epilog", {"SLURM_JOB_ID": "82", "CUDA_VISIBLE_DEVICES": older}, tmp_path)
    assert "deregistered" in line, line
    assert jobs() == {} and site.limits("node1") == {} and site.locks("node1") == {}
