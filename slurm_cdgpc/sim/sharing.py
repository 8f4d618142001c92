"""Jobs that share GPUs in the simulator: where they go (`SharedGpus`) and what the GPU does
with several of them (`shared_step`).

A job that asks for part of one GPU (`Trace.gpu_milli` below 1000: Alibaba's fractional pods,
Slurm shards, MPS) goes first-fit onto the oldest open shared GPU with room for it on a node it
may use, else opens a new one: a whole free GPU taken from the node's pool, which gets it back
when its last tenant leaves. Tenants of one GPU share its clock and its power:

- **Speed.** Alone, a tenant runs as it would on the whole GPU (MPS, time-slicing and Slurm
  shards do not cap a lone process). With co-tenants it runs at a throughput factor s_i of its
  speed alone: its iteration time is T_i(f) / s_i (`slurm_cdgpc.sim.colocation`, calibrated on
  Gavel's measured pairs).
- **Power.** Dynamic energy per unit of work is the tenant's own, so the GPU draws
  P(f) = P_idle + Σ_i s_i · (P_i(f) − P_idle), where P_i is tenant i's power alone at clock f.
  Co-located work draws more than one job alone and at most what the board allows.
- **One clock.** The GPU runs at the highest lock its tenants' setpoints ask for, under the
  highest of their limits (a policy that plans per GPU gives them all the same); a limit the
  summed power would pass lowers the clock to the highest that fits it (times the board's cap
  target, as `Plant.limit_clock_mhz` does for one job), never below the lowest clock.

Every tenant measures the whole GPU's power (NVML reads per GPU) and its own iteration time.
Design: DESIGN.md, "Simulator" (Shared GPUs); tests: `tests/unit/test_sim_sharing.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from slurm_cdgpc.control.tenancy import group_max
from slurm_cdgpc.gpu.plant import Plant, PlantState

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

#: bisection steps for the clock a binding limit leaves a shared GPU: 2⁻¹⁴ of its range
_BISECTIONS = 14


class SharedGpus:
    """The open shared GPUs: each one's node, room left (thousandths) and tenant count."""

    def __init__(self) -> None:
        self.node: dict[int, int] = {}
        self.room: dict[int, int] = {}
        self.tenants: dict[int, int] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self.node)

    def find(self, milli: int, allowed: BoolArray) -> int | None:
        """The oldest open GPU on an allowed node with room for ``milli``."""
        for gpu, room in self.room.items():
            if room >= milli and allowed[self.node[gpu]]:
                return gpu
        return None

    def open(self, node: int) -> int:
        """A new shared GPU on ``node`` (its whole GPU already taken from the node's pool)."""
        gpu = self._next
        self._next += 1
        self.node[gpu], self.room[gpu], self.tenants[gpu] = node, 1000, 0
        return gpu

    def join(self, gpu: int, milli: int) -> None:
        self.room[gpu] -= milli
        self.tenants[gpu] += 1

    def leave(self, gpu: int, milli: int) -> int | None:
        """A tenant leaves; the GPU's node when it was the last (the GPU is whole again)."""
        self.room[gpu] += milli
        self.tenants[gpu] -= 1
        if self.tenants[gpu]:
            return None
        del self.room[gpu], self.tenants[gpu]
        return self.node.pop(gpu)


@dataclass(frozen=True)
class SharedStep:
    """One interval of the shared GPUs, per tenant row: ``state`` as its tenant sees it (the
    GPU's clock and power, its own iteration time), and ``dynamic_w``, s_i · (P_i − P_idle),
    its part of the GPU's draw above idle."""

    state: PlantState
    dynamic_w: FloatArray
    idle_w: FloatArray  # the GPU's idle power, per row


def shared_step(
    plant: Plant,
    gpu: IntArray,
    factor: FloatArray,
    lock_mhz: FloatArray,
    memory_mhz: FloatArray | None,
    limit_w: FloatArray | None,
) -> SharedStep:
    """The truth for tenant rows of ``plant`` (one row per tenant, alone on a whole GPU):
    ``gpu[i]`` row i's GPU (0 … G−1), ``factor`` its throughput factor s_i, ``lock_mhz``,
    ``memory_mhz`` and ``limit_w`` its setpoints (limit None: the board's default)."""
    size = int(gpu.max()) + 1 if gpu.size else 0
    lock = group_max(gpu, np.minimum(lock_mhz, plant.max_graphics_mhz), size)
    memory = None if memory_mhz is None else group_max(gpu, memory_mhz, size)[gpu]
    limit = group_max(gpu, plant.default_limit_w if limit_w is None else limit_w, size)
    idle = plant.idle_power_w
    gpu_idle = group_max(gpu, idle, size)
    target = group_max(gpu, plant.cap_target, size) * limit
    low = group_max(gpu, plant.min_graphics_mhz, size)

    def draw(mhz: FloatArray) -> tuple[FloatArray, FloatArray]:
        """At each GPU's clock ``mhz``: per tenant row its draw above idle, per GPU its power."""
        dynamic = factor * (plant.true_power_w(mhz[gpu], memory) - idle)
        return dynamic, np.bincount(gpu, dynamic, size) + gpu_idle

    clock = np.maximum(lock, low)
    dynamic, gpu_w = draw(clock)
    over = gpu_w > target
    if over.any():
        lo, hi = low.copy(), clock.copy()
        for _ in range(_BISECTIONS):
            mid = 0.5 * (lo + hi)
            fits = draw(mid)[1] <= target
            lo = np.where(fits, mid, lo)
            hi = np.where(fits, hi, mid)
        clock = np.where(over, lo, clock)
        dynamic, gpu_w = draw(clock)
    applied = clock[gpu]
    state = PlantState(
        applied_mhz=applied,
        power_w=gpu_w[gpu],
        iteration_time_s=plant.iteration_time_s(applied, memory) / factor,
        power_capped=over[gpu],
    )
    return SharedStep(state, dynamic, idle)
