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
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from slurm_cdgpc.control.tenancy import Interference, group_max
from slurm_cdgpc.gpu.plant import Plant, PlantState

if TYPE_CHECKING:
    from slurm_cdgpc.model.estimator import JobEstimator
    from slurm_cdgpc.sim.cluster import ClusterView

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


def co_tenants(job_id: IntArray, shared_gpu: IntArray | None) -> list[tuple[int, ...]]:
    """Per row, the job ids of the other rows on its shared GPU (``shared_gpu``, −1: whole
    GPUs; none alone or without sharing)."""
    out: list[tuple[int, ...]] = [()] * len(job_id)
    if shared_gpu is None:
        return out
    ids = job_id.tolist()
    for gpu in np.unique(shared_gpu[shared_gpu >= 0]).tolist():
        rows = np.flatnonzero(shared_gpu == gpu).tolist()
        for r in rows:
            out[r] = tuple(ids[k] for k in rows if k != r)
    return out


class TenantTimeErrors:
    """How far the time model's prediction of each job's last interval was from its measured
    iteration time, by what its GPU did: alone, shared, and in the first intervals after its
    co-tenants changed or all left (`Cdgpc` and `HeadTwin` feed it; `summary` goes to the
    replay's metrics): what re-anchoring and the interference term earn, a tenant's model
    having learned its speed among the co-tenants it had.

    A prediction is the model before it learns from the interval, at the interval's clocks,
    scaled as a plan scales it for the interval's co-tenants (`score`); jobs whose time model
    has had fewer than `SETTLED_SAMPLES` samples are left out.
    """

    SETTLED_SAMPLES = 3
    #: the intervals after a change of co-tenants that count as "after a change"
    AFTER = 3

    def __init__(self) -> None:
        self._views = 0
        self._cotenants: dict[int, frozenset[int]] = {}  # job -> co-tenants in the last view
        self._changed: dict[int, int] = {}  # job -> the view its co-tenants last changed in
        self._errors: dict[str, list[float]] = {
            "alone": [],
            "shared": [],
            "shared_after_change": [],
            "alone_after_leaving": [],
        }

    def add(
        self,
        job_id: IntArray,
        shared_gpu: IntArray | None,
        predicted_s: FloatArray,
        measured_s: FloatArray,
        settled: BoolArray,
    ) -> None:
        """One view: per job row (``job_id``; ``shared_gpu``, its tenancy from now on), the
        prediction for the interval it reports and its measured iteration time (NaN: none).
        The jobs that ran the last interval are the first rows, as many as ``predicted_s``."""
        for n in range(predicted_s.shape[0]):
            job = int(job_id[n])
            before = self._cotenants.get(job)
            if before is None or not (settled[n] and measured_s[n] > 0):
                continue
            if not np.isfinite(predicted_s[n]):
                continue
            error = abs(predicted_s[n] / measured_s[n] - 1.0) * 100.0
            recent = self._views - self._changed.get(job, -self.AFTER) <= self.AFTER
            if before:
                self._errors["shared"].append(error)
                if recent:
                    self._errors["shared_after_change"].append(error)
            else:
                self._errors["alone"].append(error)
                if recent and job in self._changed:
                    self._errors["alone_after_leaving"].append(error)
        self._views += 1
        now: dict[int, frozenset[int]] = {}
        for job, mates in zip(job_id.tolist(), co_tenants(job_id, shared_gpu), strict=True):
            now[job] = frozenset(mates)
            if job in self._cotenants and self._cotenants[job] != now[job]:
                self._changed[job] = self._views  # a job that was never shared is not marked
        self._cotenants = now

    def score(
        self,
        estimator: JobEstimator,
        view: ClusterView,
        rows: IntArray,
        interference: Interference | None = None,
    ) -> None:
        """`add` the view as ``estimator`` predicted it before learning from it: ``rows``
        holds, per job that ran the interval the view reports (its first rows), the job's
        estimator row (−1: the estimator has none, and the job is not scored). With the
        controller's ``interference``, a model learned among another number of co-tenants
        than the interval's is scaled as a plan scales it (`Interference.scale`: by 1 while it
        has learned nothing, as with the setting off). Serving jobs, whose "iteration" is
        their latency, are not scored."""
        ran = rows.size
        known = rows >= 0
        graphics = np.full(len(estimator), np.nan)
        memory = np.full(len(estimator), np.nan)
        graphics[rows[known]] = view.graphics_mhz[:ran][known]
        memory[rows[known]] = view.memory_mhz[:ran][known]
        x, x_m = estimator.normalise(graphics, memory)
        predicted = np.full(ran, np.nan)
        predicted[known] = estimator.predict_iteration_s(x, x_m)[rows[known]]
        if interference is not None:
            # the interval's co-tenants: the last view's (-1: a job it did not hold)
            during = np.array(
                [
                    len(self._cotenants.get(job, ())) if job in self._cotenants else -1
                    for job in view.job_id[:ran].tolist()
                ],
                dtype=np.int64,
            )
            learned = estimator.cotenant_count[rows[known]]
            predicted[known] *= interference.scale(
                np.where(during[known] >= 0, learned, -1), np.maximum(during[known], 0)
            )
        if view.objective_s is not None:
            predicted = np.where(np.isfinite(view.objective_s[:ran]), np.nan, predicted)
        settled = np.zeros(ran, dtype=bool)
        settled[known] = estimator.time.count[rows[known]] >= self.SETTLED_SAMPLES
        self.add(view.job_id, view.shared_gpu, predicted, view.iteration_s[:ran], settled)

    def summary(self) -> dict[str, float] | None:
        """Mean |error| per kind, percent (kinds with no sample left out); None when no job
        shared a GPU."""
        if not self._errors["shared"]:
            return None
        return {k: float(np.mean(v)) for k, v in self._errors.items() if v}
