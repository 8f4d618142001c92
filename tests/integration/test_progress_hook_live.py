"""Automatic progress end to end: a real ``cdgpcd`` and ``cdgpc-noded`` (simulated GPUs, HMAC)
on loopback, the TaskProlog's export lines applied to a job, and real PyTorch and Lightning
training runs whose optimizer steps reach the head's ``/v1/jobs`` with no change to their code.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from slurm_cdgpc.localcluster import (
    LocalCluster,
    daemon_env,
    hmac_auth,
    wait_for,
    write_hmac_key,
)
from slurm_cdgpc.transport.http import HeadClient

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[2]
NODE = "node1"
#: a 2-layer MLP, SGD, one CPU thread: a few hundred steps of sized batches (seconds, no sleep)
TRAIN = """
import torch
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(1024, 256), torch.randn(1024, 1)
for step in range(400):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
print(f"trained 400 steps, loss {loss.item():.4f}")
"""
LIGHTNING = """
import importlib
import torch
from torch.utils.data import DataLoader, TensorDataset
from slurm_cdgpc.integrations.lightning import CdgpcProgress
try:
    pl = importlib.import_module("lightning.pytorch")
except ImportError:
    pl = importlib.import_module("pytorch_lightning")

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

torch.manual_seed(0)
data = DataLoader(TensorDataset(torch.randn(256, 8), torch.randn(256, 1)), batch_size=4)
trainer = pl.Trainer(
    max_steps=40, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, callbacks=[CdgpcProgress()],
)
trainer.fit(Tiny(), data)
print("fitted", trainer.global_step)
"""

TRANSFORMERS = """
import torch
from transformers import Trainer, TrainingArguments
from slurm_cdgpc.integrations.transformers import CdgpcProgress

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}

torch.manual_seed(0)
data = [{"x": torch.randn(8), "labels": torch.randn(1)} for _ in range(256)]
args = TrainingArguments(
    output_dir="hf-out", max_steps=30, per_device_train_batch_size=4, report_to="none",
    use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
)
trainer = Trainer(model=Tiny(), args=args, train_dataset=data, callbacks=[CdgpcProgress()])
trainer.train()
print("trained", trainer.state.global_step)
"""


@dataclass
class Site:
    """A head and one node agent, running; the node's config; a signed client of the head."""

    node_config: Path
    progress_socket: Path
    client: HeadClient
    logs: Callable[[], str]
    scratch: Path

    def job(self, job_id: str) -> dict[str, Any]:
        [job] = [j for j in self.client.get("/v1/jobs")["jobs"] if j["job_id"] == job_id]
        return job  # type: ignore[no-any-return]

    def register(self, job_id: str, gpu: int) -> None:
        self.client.post(
            "/v1/jobs", {"job_id": job_id, "user": "root", "node": NODE, "gpus": [gpu]}
        )

    def task_env(self, job_id: str, pythonpath: str = "") -> dict[str, str]:
        """A task's environment after the TaskProlog (run with -I, as its entry point runs) has
        printed its export lines and slurmd applied them."""
        env = {k: v for k, v in daemon_env().items() if k not in ("PYTHONPATH", "LOCAL_RANK")}
        env.update(SLURM_JOB_ID=job_id, SLURM_LOCALID="0")
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        # the code under test on sys.path; the task's PYTHONPATH is what the prolog reads
        code = (
            f"import sys; sys.path.insert(0, {str(REPO)!r}); "
            "from slurm_cdgpc.slurm.task_prolog import main; "
            f"sys.exit(main(['--config', {str(self.node_config)!r}]))"
        )
        done = subprocess.run(
            [sys.executable, "-I", "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        assert done.stderr == ""
        for line in done.stdout.splitlines():
            name, _, value = line.removeprefix("export ").partition("=")
            env[name] = value
        return env


def _run(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    pytest.importorskip("torch")
    tmp = tmp_path_factory.mktemp("hook")
    write_hmac_key(tmp / "hmac.key", pytest.skip)
    short = Path(tempfile.mkdtemp(prefix="cdgpc-"))  # Unix socket paths: at most 107 bytes
    cluster = LocalCluster(
        tmp,
        hmac_auth(tmp / "hmac.key", admin=True),
        interval_s=0.5,
        lease_s=2.0,
        safe_cap=0.6,
        env=daemon_env(source_first=True),
        start_timeout_s=20,
    )
    cluster.add_head()
    node = cluster.add_node(
        NODE, gpu_type="A100-SXM4-80GB", gpus=4, progress_socket=short / "progress.sock"
    )
    try:
        cluster.start_head()
        cluster.start_agent(NODE)
        client = cluster.client()
        wait_for("the agent's socket", node.progress_socket.exists, 20, cluster.logs)
        cluster.announce()
        client.post("/v1/budget", {"budget_w": 5000.0, "reason": "live test"})
        wait_for(
            "the node reports",
            lambda: any(n["reachable"] for n in client.get("/v1/nodes")["nodes"]),
            10,
            cluster.logs,
        )
        yield Site(node.config, node.progress_socket, client, cluster.logs, tmp)
    finally:
        cluster.stop(timeout_s=5)
        shutil.rmtree(short, ignore_errors=True)


def test_a_torch_job_reports_progress_with_no_change_to_its_code(site: Site) -> None:
    site.register("7", 0)
    env = site.task_env("7")
    assert env["PYTHONPATH"] == str(REPO / "slurm_cdgpc" / "hook")
    assert env["CDGPC_NODE_PROGRESS_SOCKET"] == str(site.progress_socket)
    started = time.monotonic()
    done = _run(TRAIN, env, site.scratch)
    assert (done.returncode, done.stderr) == (0, "")
    assert time.monotonic() - started > 2.0  # long enough for more than one report
    job = wait_for(
        "job 7's progress", lambda: (j := site.job("7"))["iterations_done"] and j, 10, site.logs
    )
    assert job["iterations_done"] > 0

    # the same job with the agent away (its socket gone), and with no hook at all: unchanged
    away = _run(
        TRAIN, env | {"CDGPC_NODE_PROGRESS_SOCKET": str(site.scratch / "none.sock")}, site.scratch
    )
    bare = _run(TRAIN, {k: v for k, v in env.items() if k != "PYTHONPATH"}, site.scratch)
    assert (away.returncode, away.stdout, away.stderr) == (0, done.stdout, "")
    assert (bare.returncode, bare.stdout, bare.stderr) == (0, done.stdout, "")


def test_a_jobs_own_sitecustomize_still_runs(site: Site, tmp_path: Path) -> None:
    for name in ("user", "later"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "sitecustomize.py").write_text(
            f"with open({str(tmp_path / name / 'ran')!r}, 'a') as f:\n    f.write('ran\\n')\n"
        )
    # on the job's own PYTHONPATH: before the hook (the TaskProlog appends), so theirs wins
    env = site.task_env("70", pythonpath=str(tmp_path / "user"))
    assert env["PYTHONPATH"].startswith(str(tmp_path / "user") + os.pathsep)
    done = _run(TRAIN, env, site.scratch)
    assert (done.returncode, done.stderr) == (0, "")
    assert (tmp_path / "user" / "ran").read_text() == "ran\n"

    # in a directory after the hook's (as site-packages is): both run, and progress arrives
    site.register("8", 1)
    env = site.task_env("8")
    env["PYTHONPATH"] += os.pathsep + str(tmp_path / "later")
    done = _run(TRAIN, env, site.scratch)
    assert (done.returncode, done.stderr) == (0, "")
    assert (tmp_path / "later" / "ran").read_text() == "ran\n"
    wait_for("job 8's progress", lambda: site.job("8")["iterations_done"] > 0, 10, site.logs)


def test_a_lightning_job_reports_its_total(site: Site) -> None:
    if not any(importlib.util.find_spec(m) for m in ("lightning", "pytorch_lightning")):
        pytest.skip("neither lightning nor pytorch_lightning is installed")
    site.register("9", 2)
    env = site.task_env("9", pythonpath=str(REPO))  # the callback is ours: importable there
    done = _run(LIGHTNING, env, site.scratch)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("fitted 40")
    job = wait_for(
        "job 9's total", lambda: (j := site.job("9"))["iterations_done"] == 40 and j, 10, site.logs
    )
    assert job["iterations_total"] == 40


def test_a_transformers_trainer_job_reports_its_total(site: Site) -> None:
    site.register("10", 3)
    env = site.task_env("10", pythonpath=str(REPO))
    done = _run(TRANSFORMERS, env, site.scratch)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("trained 30")
    job = wait_for(
        "job 10's total",
        lambda: (j := site.job("10"))["iterations_done"] == 30 and j,
        10,
        site.logs,
    )
    assert job["iterations_total"] == 30
