"""A real Slurm (tests/slurm/harness.sh: slurmctld, slurmd n1 and n2, munged, fake GPUs) with our
Prolog, Epilog and job_submit.lua, a real cdgpcd (SQLite, HMAC) and two cdgpc-noded (simulated).

Skips with the reason when Slurm cannot be installed or started (not root, no apt), except under
``CI=true``, where that fails. Everything started here is stopped at the end.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from slurm_cdgpc.localcluster import (
    LocalCluster,
    daemon_env,
    hmac_auth,
    toml_text,
    write_hmac_key,
)
from slurm_cdgpc.localcluster import wait_for as wait
from slurm_cdgpc.slurm.spool import forward_spool
from slurm_cdgpc.transport.http import HeadClient

pytestmark = [pytest.mark.slurm, pytest.mark.live]

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "tests" / "slurm" / "harness.sh"
NODES = ("n1", "n2")
INTERVAL_S = 0.5
LEASE_S = 3.0
#: the head's reconcile with squeue (and its grace period)
RECONCILE_S = 2.0


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but a real Slurm is needed and {reason}")
    pytest.skip(reason)


@dataclass
class Cluster:
    """Our daemons (a `LocalCluster` in ``tmp``) beside the real Slurm in ``lab``."""

    local: LocalCluster
    lab: Path
    env: dict[str, str]

    @property
    def tmp(self) -> Path:
        return self.local.run_dir

    def start_head(self) -> None:
        self.local.start_head()

    def stop_head(self) -> None:
        head = self.local.head.daemon
        if head is not None:
            head.stop(timeout_s=10)

    def client(self) -> HeadClient:
        return self.local.client(timeout_s=2.0)

    def jobs(self) -> dict[str, dict[str, Any]]:
        return {j["job_id"]: j for j in self.client().get("/v1/jobs")["jobs"]}

    def locks(self, node: str) -> dict[int, int]:
        return self.local.locks(node)

    def sbatch(self, *args: str) -> str:
        out = subprocess.run(
            ["sbatch", "--parsable", "-o", str(self.lab / "out" / "%j.out"), *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        )
        return out.stdout.strip().split(";")[0]

    def state(self, job_id: str) -> str:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=False
        ).stdout
        match = re.search(r"JobState=(\S+)", out)
        return match[1] if match else "GONE"

    def hook_times(self, kind: str) -> dict[tuple[str, str], tuple[float, float, int]]:
        path = self.lab / "log" / f"{kind}-times.log"
        out = {}
        for line in path.read_text().splitlines() if path.exists() else []:
            job, node, t0, t1, rc = line.split()
            out[(job, node)] = (float(t0), float(t1), int(rc))
        return out

    def agent_log(self, node: str) -> str:
        agent = self.local.nodes[node].daemon
        return "" if agent is None else agent.text()

    def logs(self) -> str:
        parts = [self.local.logs(2000)]
        parts += [
            f"== {p.name}\n{p.read_text(errors='replace')[-1500:]}"
            for p in (self.lab / "log").glob("*.log")
        ]
        return "\n".join(parts)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if os.geteuid() != 0:
        _unavailable("a real Slurm needs root (mknod, SlurmUser=root)")
    tmp = tmp_path_factory.mktemp("slurm")
    lab = tmp / "lab"
    key = tmp / "hmac.key"
    write_hmac_key(key)
    auth = hmac_auth(key, admin=True)
    env = {k: v for k, v in daemon_env(source_first=True).items() if not k.startswith("SLURM_")}
    local = LocalCluster(
        tmp, auth, interval_s=INTERVAL_S, lease_s=LEASE_S, env=env, start_timeout_s=20
    )
    head = local.add_head(extra={"head": {"reconcile_interval": f"{RECONCILE_S:g}s"}})
    hooks_config = tmp / "hooks.toml"
    hooks_config.write_text(toml_text({"head": {"url": head.url}, "auth": auth}))
    harness_env = {
        **env,
        "CDGPC_SLURM_LAB": str(lab),
        "CDGPC_PYTHON": sys.executable,
        "CDGPC_SLURM_HOOK_CONFIG": str(hooks_config),
        # cdgpc-prolog-slurmctld as PrologSlurmctld: the admission verdict at every job start
        "CDGPC_SLURM_PROLOG_SLURMCTLD": "1",
    }
    started = subprocess.run(
        ["bash", str(HARNESS), "start"],
        env=harness_env,
        capture_output=True,
        text=True,
        check=False,
    )
    c = Cluster(local, lab, env)
    try:
        if started.returncode == 3:
            _unavailable(f"Slurm cannot be installed here: {started.stderr.strip()[-300:]}")
        if started.returncode != 0:
            pytest.fail(f"harness start failed:\n{started.stderr[-3000:]}")
        c.start_head()
        for name in NODES:
            node = local.add_node(name, gpus=4)
            # this node's hooks reach this node's agent (the hook config is shared)
            (lab / "hooks" / "env" / name).write_text(
                f"CDGPC_NODE_LISTEN_PORT={node.port}\n"
                f"CDGPC_NODE_PROGRESS_SOCKET={node.progress_socket}\n"
            )
            local.start_agent(name)
            c.client().post("/v1/nodes", {"node": name, "url": node.url})
        wait(
            "both nodes report",
            lambda: all(n["reachable"] for n in c.client().get("/v1/nodes")["nodes"]),
            10,
            c.logs,
        )
        yield c
    finally:
        subprocess.run(["scancel", "--user=root"], check=False, capture_output=True)
        local.stop(timeout_s=10)
        subprocess.run(
            ["bash", str(HARNESS), "stop"], env=harness_env, check=False, capture_output=True
        )


@pytest.fixture
def slurm(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster, with no job left running after the test."""
    yield cluster
    subprocess.run(["scancel", "--user=root"], check=False, capture_output=True)
    wait(
        "queue empty",
        lambda: (
            not subprocess.run(
                ["squeue", "-h"], check=False, capture_output=True, text=True
            ).stdout.strip()
        ),
        20,
        cluster.logs,
    )


def _running(c: Cluster, job_id: str) -> bool:
    return c.state(job_id) == "RUNNING"


def test_job_registers_gets_clocks_and_is_deregistered(slurm: Cluster) -> None:
    submit_s = time.time()
    job = slurm.sbatch("--comment=deadline=+2h,iters=500", "--gres=gpu:2", "--wrap", "sleep 4")
    wait("job running", lambda: _running(slurm, job), 15, slurm.logs)
    seen = wait("job registered", lambda: slurm.jobs().get(job), 5, slurm.logs)
    node = seen["gpus"][0]["node"]
    t0, t1, rc = wait(
        "Prolog done", lambda: slurm.hook_times("prolog").get((job, node)), 5, slurm.logs
    )
    assert rc == 0 and t1 - t0 < 2.0
    # registered by the time the Prolog ended: long before 1 s after the job started
    assert {(g["node"], g["index"]) for g in seen["gpus"]} == {(node, 0), (node, 1)}
    assert abs(seen["deadline_s"] - (submit_s + 7200)) < 5
    assert seen["iterations_total"] == 500
    other = "n2" if node == "n1" else "n1"
    wait(
        "clocks applied on the job's GPUs", lambda: set(slurm.locks(node)) == {0, 1}, 5, slurm.logs
    )
    assert slurm.locks(other) == {}
    # the Prolog held the job's GPUs through its own node's agent (at the safe cap, or at the
    # head's setpoint if that came first); the other node's agent heard nothing of the job
    held = rf"job {job}: Prolog \(root \(uid 0\b.*\) held GPU\(s\) \[0, 1\] \(safe cap"
    assert re.search(held, slurm.agent_log(node)), slurm.logs()
    assert f"job {job}:" not in slurm.agent_log(other)
    wait("job deregistered after it ended", lambda: job not in slurm.jobs(), 15, slurm.logs)
    wait("GPUs released", lambda: slurm.locks(node) == {}, 5, slurm.logs)
    wait(
        "the Epilog's release reached the agent",
        lambda: re.search(rf"job {job}: Epilog \(root .*\) released GPU", slurm.agent_log(node)),
        5,
        slurm.logs,
    )


def test_two_shards_of_one_gpu_share_its_clock_until_the_last_job_ends(slurm: Cluster) -> None:
    """``--gres=shard:1`` twice on n1: Slurm puts both jobs on GPU 0 (each GPU has two shards)
    and both Prologs name it. Both jobs are registered and controlled, as the GPU's tenants at
    one clock, and the GPU's readings teach both models; the first job's Epilog leaves the GPU
    at its clock for the second, and the second's resets it."""
    first = slurm.sbatch(
        "-w", "n1", "--gres=shard:1", "--comment=deadline=+2h", "--wrap", "sleep 8"
    )
    second = slurm.sbatch(
        "-w", "n1", "--gres=shard:1", "--comment=deadline=+1h", "--wrap", "sleep 14"
    )
    wait("both running", lambda: _running(slurm, first) and _running(slurm, second), 15, slurm.logs)

    def both_controlled() -> bool:
        jobs = slurm.jobs()
        return all(jobs.get(j, {}).get("controlled") for j in (first, second))

    wait("both controlled", both_controlled, 10, slurm.logs)
    jobs = slurm.jobs()
    assert [(g["node"], g["index"]) for g in jobs[first]["gpus"]] == [("n1", 0)]
    assert [(g["node"], g["index"]) for g in jobs[second]["gpus"]] == [("n1", 0)]
    assert jobs[first]["shares_with"] == [second] and jobs[second]["shares_with"] == [first]
    assert jobs[first]["graphics_mhz"] == jobs[second]["graphics_mhz"] is not None

    def both_learn() -> bool:
        jobs = slurm.jobs()
        return all(jobs.get(j, {}).get("model_readings", 0) > 0 for j in (first, second))

    wait("both tenants' models learn", both_learn, 8, slurm.logs)
    wait("the first job deregistered", lambda: first not in slurm.jobs(), 15, slurm.logs)
    assert _running(slurm, second)
    assert 0 in slurm.locks("n1"), slurm.logs()  # the second job's clock stays
    stays = rf"GPU 0: job {first} ended; job {second} still runs on it"
    assert re.search(stays, slurm.agent_log("n1")), slurm.logs()
    wait("the second job deregistered", lambda: second not in slurm.jobs(), 20, slurm.logs)
    wait("GPU 0 back to defaults", lambda: slurm.locks("n1") == {}, 5, slurm.logs)


def test_a_starting_job_gets_the_heads_deadline_verdict_in_its_admin_comment(
    slurm: Cluster,
) -> None:
    """The PrologSlurmctld asks the head and writes its verdict where ``scontrol show job``
    shows it to the user; the head logs it. Half an hour of work at most (``--time=30``),
    two hours to the deadline, no budget: feasible at the top clock."""
    job = slurm.sbatch("--comment=deadline=+2h", "--gres=gpu:1", "--time=30", "--wrap", "sleep 3")
    wait("job running", lambda: _running(slurm, job), 15, slurm.logs)
    shown = subprocess.run(
        ["scontrol", "show", "job", job], capture_output=True, text=True, check=True
    ).stdout
    comment = re.search(r"AdminComment=(.*)", shown)
    assert comment, shown
    assert comment[1].startswith("cdgpc: feasible: work ≤ 0.50 h at top clocks"), comment[1]
    assert re.search(r"at [0-9]+ MHz \(", comment[1]) and "to its deadline" in comment[1]
    logged = slurm.local.head.daemon.text() if slurm.local.head.daemon else ""
    assert f"job {job}: admission for root" in logged
    ran = (slurm.lab / "log" / "prolog-slurmctld.log").read_text().split("\n")
    assert f"{job} 0" in ran
    wait("job ended", lambda: slurm.state(job) in ("COMPLETED", "GONE"), 30, slurm.logs)


#: a PyTorch training loop that knows nothing of slurm-cdgpc; it notes when its first step is done
TRAIN = """
import pathlib, sys, time
import torch
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(512, 64), torch.randn(512, 1)
end = time.monotonic() + float(sys.argv[2])
step = 0
while time.monotonic() < end:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    step += 1
    if step == 1:
        pathlib.Path(sys.argv[1]).write_text(str(time.time()))
print("steps", step)
"""


def test_a_pytorch_job_reports_its_steps_with_no_change_to_its_code(slurm: Cluster) -> None:
    """Only ``--comment=deadline=+2h``: the TaskProlog puts the hook on the task's path, the hook
    reports optimizer steps to the node's agent, and the head shows them within two intervals
    of the first step."""
    script = slurm.tmp / "train.py"
    script.write_text(TRAIN)
    first = slurm.tmp / "first-step"
    first.unlink(missing_ok=True)
    job = slurm.sbatch(
        "--comment=deadline=+2h",
        "--gres=gpu:1",
        "--time=30",
        "--wrap",
        f"{sys.executable} {script} {first} 12",
    )
    stepped = wait("the job's first step", first.exists, 60, slurm.logs)
    assert stepped
    first_s = float(first.read_text())
    seen = wait(
        "the head shows reported steps",
        lambda: (j := slurm.jobs().get(job)) and j["progress"] == "reported" and j,
        10,
        slurm.logs,
    )
    shown_s = time.time()
    assert seen["iterations_done"] > 0 and seen["iterations_total"] is None
    assert seen["work"] == "time-limit" and seen["time_limit_s"] == 30 * 60.0
    assert seen["left_top_s"] is not None and seen["left_top_s"] <= 30 * 60.0
    # the hook reports at its first step; the next exchange carries it; the interval persists it
    assert shown_s - first_s < 2 * INTERVAL_S + 0.5, (shown_s - first_s, seen)
    config = slurm.tmp / "hooks.toml"
    out = subprocess.run(
        [str(Path(sys.executable).parent / "cdgpc-admin"), "jobs", "--config", str(config)],
        capture_output=True,
        text=True,
        check=True,
        env=slurm.env,
        timeout=30,
    ).stdout
    [row] = [line for line in out.splitlines() if line.split()[:1] == [job]]
    assert "reported" in row and "time-limit" in row, out
    wait("job ended", lambda: slurm.state(job) in ("COMPLETED", "GONE"), 60, slurm.logs)
    assert "steps" in (slurm.lab / "out" / f"{job}.out").read_text()


def test_malformed_deadline_is_refused_at_submit(slurm: Cluster) -> None:
    with pytest.raises(subprocess.CalledProcessError) as refused:
        slurm.sbatch("--comment=deadline=tomorow", "--gres=gpu:1", "--wrap", "true")
    assert (
        "cdgpc: cannot read deadline 'tomorow': use 2026-12-01T12:00 or +6h" in refused.value.stderr
    )
    out = subprocess.run(
        ["sbatch", "-o", "/dev/null", "--comment=note deadline=2001-01-01T00:00", "--wrap", "true"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "cdgpc: warning: the deadline is in the past" in out.stderr


def test_head_down_job_starts_and_spool_arrives(slurm: Cluster) -> None:
    slurm.stop_head()
    job = slurm.sbatch("--comment=deadline=2030-01-01T00:00Z", "--gres=gpu:1", "--wrap", "sleep 60")
    wait("job running without a head", lambda: _running(slurm, job), 15, slurm.logs)
    [(t0, t1, rc)] = wait(
        "Prolog done",
        lambda: [v for (j, _), v in slurm.hook_times("prolog").items() if j == job],
        5,
        slurm.logs,
    )
    assert rc == 0 and t1 - t0 < 2.0
    states = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%T"], check=False, capture_output=True, text=True
    ).stdout
    assert "drain" not in states
    slurm.start_head()
    assert job not in slurm.jobs()
    result = forward_spool(slurm.client(), slurm.lab / "spool")
    assert result.sent >= 1 and result.left == 0
    seen = slurm.jobs()[job]
    assert seen["deadline_s"] == 1893456000.0
    subprocess.run(["scancel", job], check=True)
    wait("scancel deregisters", lambda: job not in slurm.jobs(), 15, slurm.logs)


def test_a_running_job_whose_registration_was_lost_is_adopted(slurm: Cluster) -> None:
    slurm.stop_head()
    job = slurm.sbatch(
        "--comment=project x deadline=2030-01-01T00:00Z iters=700",
        "--gres=gpu:2",
        "--wrap",
        "sleep 60",
    )
    wait("job running without a head", lambda: _running(slurm, job), 15, slurm.logs)
    wait(
        "Prolog spooled",
        lambda: any(j == job for j, _ in slurm.hook_times("prolog")),
        5,
        slurm.logs,
    )
    for record in (slurm.lab / "spool").iterdir():
        record.unlink()  # the node lost its spool: only Slurm knows the job now
    slurm.start_head()
    seen = wait("job adopted by the reconcile", lambda: slurm.jobs().get(job), 20, slurm.logs)
    assert seen["state"] == "adopted"
    assert seen["deadline_s"] == 1893456000.0 and seen["iterations_total"] == 700
    [node] = {g["node"] for g in seen["gpus"]}
    assert sorted(g["index"] for g in seen["gpus"]) == [0, 1]
    wait("clocks applied", lambda: set(slurm.locks(node)) == {0, 1}, 10, slurm.logs)
    subprocess.run(["scancel", job], check=True)
    wait("scancel deregisters", lambda: job not in slurm.jobs(), 15, slurm.logs)
    wait("GPUs released", lambda: slurm.locks(node) == {}, 10, slurm.logs)


def test_two_node_job_registers_both_nodes(slurm: Cluster) -> None:
    job = slurm.sbatch("-N2", "--gres=gpu:1", "--wrap", "sleep 30")
    seen = wait(
        "both nodes registered",
        lambda: len((j := slurm.jobs().get(job, {"gpus": []}))["gpus"]) == 2 and j,
        15,
        slurm.logs,
    )
    assert {g["node"] for g in seen["gpus"]} == set(NODES)
    subprocess.run(["scancel", job], check=True)
    wait("scancel deregisters", lambda: job not in slurm.jobs(), 15, slurm.logs)


def test_array_tasks_register_under_their_own_ids(slurm: Cluster) -> None:
    array = slurm.sbatch("--array=1-2", "--gres=gpu:1", "--wrap", "sleep 30")
    ids = wait(
        "both tasks registered",
        lambda: (
            len(
                r := [
                    j
                    for j, line in _array_ids(array).items()
                    if line == "RUNNING" and j in slurm.jobs()
                ]
            )
            == 2
            and r
        ),
        15,
        slurm.logs,
    )
    assert array not in ids or len(set(ids)) == 2
    subprocess.run(["scancel", array], check=True)
    wait("tasks deregistered", lambda: not set(ids) & set(slurm.jobs()), 15, slurm.logs)


def _array_ids(array: str) -> dict[str, str]:
    """Raw job id → state of each task of an array job."""
    out = subprocess.run(
        ["squeue", "-h", "-r", "-j", array, "-o", "%A %T"],
        check=False,
        capture_output=True,
        text=True,
    ).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())
