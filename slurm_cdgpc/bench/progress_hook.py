"""``bench progress-hook``: what the automatic progress hook costs a PyTorch training loop.

A small real training loop (an MLP, SGD, CPU, one thread) runs in fresh interpreters, with the
hook directory on ``PYTHONPATH`` (as the TaskProlog puts it) and without, paired and in
alternating order for ``rounds`` rounds, against a real `ProgressServer` socket. Each run times
its steps after a warm-up; ``step_ms_p50_*`` pool the steps of every round, ``overhead_pct`` is
the median over rounds of each pair's p50 ratio. In-process, ``post_hook_us`` is one call of the
optimizer post hook (mostly no send) and ``send_us_p50`` one report sent to the socket;
``startup_ms_p50_*`` is ``python -c pass`` with and without the hook's sitecustomize.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

from slurm_cdgpc.agent.progress import SOCKET_ENV, ProgressServer
from slurm_cdgpc.errors import FatalError, one_line
from slurm_cdgpc.integrations import HOOK_DIR, progress_hook

JOB_ID: Final = "1"
#: the training run: argv = steps, warm-up steps, width, batch; prints its step times (s)
TRAIN: Final = """\
import json, sys, time
import torch
steps, warmup, width, batch = map(int, sys.argv[1:5])
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(
    torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)
)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(batch, width), torch.randn(batch, 1)
times = []
for i in range(warmup + steps):
    t0 = time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if i >= warmup:
        times.append(time.perf_counter() - t0)
hook = sys.modules.get("_cdgpc_progress_hook")
print(json.dumps({"step_s": times, "hooked": bool(hook and hook.counting())}))
"""


def bench_progress_hook(
    *,
    rounds: int = 5,
    steps: int = 2000,
    warmup: int = 200,
    width: int = 256,
    batch: int = 64,
    interval_s: float = 1.0,
) -> dict[str, Any]:
    """Run the benchmark; the JSON-ready result (see the module docstring)."""
    if importlib.util.find_spec("torch") is None:
        raise FatalError("bench progress-hook needs torch in this Python (pip install torch)")
    received: list[int] = []
    with tempfile.TemporaryDirectory(prefix="cdgpc-hook-bench-") as scratch:
        server = ProgressServer(
            Path(scratch) / "progress.sock", lambda *_, **__: received.append(1)
        )
        server.start()
        try:
            without, with_ = _environments(server.path, interval_s)
            step_s: dict[bool, list[float]] = {False: [], True: []}
            ratios = []
            for r in range(rounds):
                p50 = {}
                for hooked in (False, True) if r % 2 == 0 else (True, False):
                    run = _train(with_ if hooked else without, steps, warmup, width, batch)
                    if run["hooked"] != hooked:
                        raise FatalError(f"the hook was {'not ' * hooked}active in a run")
                    step_s[hooked] += run["step_s"]
                    p50[hooked] = statistics.median(run["step_s"])
                ratios.append(p50[True] / p50[False])
            startup = _startup_s(without, with_, 4 * rounds + 1)
            post_hook_s, send_s = _in_process(server.path)
        finally:
            server.close()
    return {
        "rounds": rounds,
        "steps": steps,
        "width": width,
        "batch": batch,
        "interval_s": interval_s,
        "step_ms_p50_without": round(1e3 * statistics.median(step_s[False]), 4),
        "step_ms_p50_with": round(1e3 * statistics.median(step_s[True]), 4),
        "overhead_pct": round(100.0 * (statistics.median(ratios) - 1.0), 2),
        "post_hook_us": round(1e6 * post_hook_s, 3),
        "send_us_p50": round(1e6 * send_s, 1),
        "startup_ms_p50_without": round(1e3 * startup[False], 2),
        "startup_ms_p50_with": round(1e3 * startup[True], 2),
        "reports_received": len(received),
    }


def _environments(socket_path: Path, interval_s: float) -> tuple[dict[str, str], dict[str, str]]:
    """The runs' environments without and with the hook: one job, its first local task."""
    # PYTHONDONTWRITEBYTECODE off: an installed hook is compiled (pip compiles the wheel)
    drop = ("LOCAL_RANK", "SLURM_LOCALID", "PYTHONDONTWRITEBYTECODE")
    base = {k: v for k, v in os.environ.items() if not k.startswith("CDGPC_") and k not in drop}
    base.update(
        {
            "SLURM_JOB_ID": JOB_ID,
            SOCKET_ENV: str(socket_path),
            "CDGPC_PROGRESS_INTERVAL": repr(interval_s),
        }
    )
    current = base.get("PYTHONPATH", "")
    hooked = {**base, "PYTHONPATH": os.pathsep.join(filter(None, [current, str(HOOK_DIR)]))}
    return base, hooked


def _train(env: dict[str, str], steps: int, warmup: int, width: int, batch: int) -> Any:
    argv = [sys.executable, "-c", TRAIN, str(steps), str(warmup), str(width), str(batch)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        tail = one_line(done.stderr, keep="last", empty="no output")
        raise FatalError(f"the training run exited with {done.returncode}: {tail}")
    return json.loads(done.stdout)


def _startup_s(without: dict[str, str], with_: dict[str, str], runs: int) -> dict[bool, float]:
    """Median ``python -c pass`` without and with the hook, in alternating pairs."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(runs):
        for hooked in (False, True) if r % 2 == 0 else (True, False):
            started = time.perf_counter()
            argv = [sys.executable, "-c", "pass"]
            subprocess.run(argv, env=with_ if hooked else without, check=True, timeout=60)
            times[hooked].append(time.perf_counter() - started)
    return {hooked: statistics.median(t) for hooked, t in times.items()}


class _Optimizer:
    """Stands for an optimizer: the hook only keeps a weak reference to it."""


def _in_process(socket_path: Path, calls: int = 100_000) -> tuple[float, float]:
    """One post-hook call (1 s interval: almost never a send) and one send, both timed here."""
    hook: Any = progress_hook()
    optimizer = _Optimizer()
    counter = hook.Reporter(JOB_ID, str(socket_path), 1.0, env={})
    started = time.perf_counter()
    for _ in range(calls):
        counter.count_step(optimizer, (), {})
    post_hook_s = (time.perf_counter() - started) / calls
    sends = []
    for step in range(1, 41):
        sender = hook.Reporter(JOB_ID, str(socket_path), 0.0, env={})
        sender.step = step
        started = time.perf_counter()
        sender.send()
        sends.append(time.perf_counter() - started)
        time.sleep(0.01)  # one at a time: the server's per-uid bound is not the subject here
    return post_hook_s, statistics.median(sends)
