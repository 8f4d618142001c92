"""Jobs that share GPUs (`Tenancy`): one clock per physical GPU, weighed on all its tenants.

Jobs whose GPU sets overlap (Slurm shards, MPS, MIG instances of one GPU, two jobs naming one
index) are the tenants of one group, transitively. A GPU takes one clock, and a job runs at the
pace of its slowest GPU, so a group gets one clock, chosen against the sum of its tenants'
deadline pressures. Both models are linear in their parameters, so the group is one row of the
same dual problem:

- time: Σ_k w_k T_k(x) = W · (Σ_k w_k b_k / W) · φ_T(x) with W = Σ_k w_k; a tenant's speed
  steps when its co-tenants change, and its model re-anchors on the first sample taken among
  the new ones (`cotenant_key`, `Measurements.cotenants`);
- power: every tenant sees its GPUs' whole readings, so every tenant's model learns the GPUs'
  power; the group's is its youngest measured tenant's (the fewest readings, so all of them
  taken with the present co-tenants; ties averaged), times the group's physical GPUs. An older
  tenant's model also remembers the GPU before the newcomer came, and under-predicts what the
  two draw together; a model that remembers a tenant that has left over-predicts, the safe
  side. A tenant not yet measured makes the group unmeasured: counted at its power limit, as a
  new job is.

Each tenant is charged an equal share of its group's power (`job_power_w`, `attribution`), so
sums over jobs count every GPU once. The controller's math: never reaches `store/`,
`transport/`, `agent/`, `coordinator/` or `cli/` (`tests/unit/test_import_graph.py`). Design:
DESIGN.md, "Shared GPUs"; tests: `tests/unit/test_control_tenancy.py`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import NDArray

from slurm_cdgpc.control.domains import DomainLimits
from slurm_cdgpc.control.dual import DualProblem
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.families import FloatArray
from slurm_cdgpc.model.rls import BoolArray

IntArray = NDArray[np.int64]


def cotenant_key(others: Iterable[str]) -> int:
    """A job's co-tenants as one number: 0 for none, else a 62-bit digest of their ids, the
    same for the same set (a change of key is a change of co-tenants)."""
    ids = sorted(set(others))
    if not ids:
        return 0
    digest = hashlib.blake2b("\n".join(ids).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 2) + 1


@dataclass(frozen=True)
class Tenancy:
    """Which jobs share GPUs: ``group[n]`` is job n's group (0 … U−1, each used), ``gpus[u]``
    the physical GPUs group u spans."""

    group: IntArray
    gpus: FloatArray

    def __post_init__(self) -> None:
        u = self.gpus.shape[0]
        if self.group.ndim != 1 or (self.group.size and self.group.min() < 0):
            raise InputError("a job's GPU group must be a non-negative index")
        counts = np.bincount(self.group, minlength=u)
        if counts.shape[0] != u or np.any(counts == 0) or not np.all(self.gpus >= 1):
            raise InputError("GPU groups must be numbered 0 … U−1, each with a job and a GPU")

    @classmethod
    def of_gpus(cls, gpus: list[list[object]]) -> Tenancy | None:
        """From each job's GPUs (any hashable names): None when no two jobs share one."""
        parent = list(range(len(gpus)))

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        holder: dict[object, int] = {}
        for n, refs in enumerate(gpus):
            for ref in refs:
                if ref in holder:
                    parent[root(n)] = root(holder[ref])
                else:
                    holder[ref] = n
        roots = [root(n) for n in range(len(gpus))]
        if len(set(roots)) == len(gpus):
            return None
        index: dict[int, int] = {}
        group = np.array([index.setdefault(r, len(index)) for r in roots], dtype=np.int64)
        spans = np.bincount(group[[holder[ref] for ref in holder]], minlength=len(index))
        return cls(group, spans.astype(np.float64))

    @property
    def size(self) -> int:
        return int(self.gpus.shape[0])

    def tenants(self) -> IntArray:
        """(U,) jobs per group."""
        return np.bincount(self.group, minlength=self.size).astype(np.int64)

    def cotenant_counts(self) -> IntArray:
        """(N,) each job's co-tenants: the other jobs of its group."""
        counts: IntArray = self.tenants()[self.group] - 1
        return counts

    def first(self) -> IntArray:
        """(U,) each group's first job (its row order)."""
        return np.unique(self.group, return_index=True)[1].astype(np.int64)

    def attribution(self, job_gpus: NDArray[np.integer] | FloatArray) -> FloatArray:
        """(N,) the part of g_n × (its GPUs' mean power) that is job n's own: its group's
        power split equally between its tenants, gpus_u / (tenants_u g_n); 1 for a job alone."""
        u = self.group
        share: FloatArray = self.gpus[u] / (self.tenants()[u] * job_gpus)
        return share

    def gpu_power_w(self, job_power_w: FloatArray) -> FloatArray:
        """(N,) the power of each of job n's GPUs: its group's (its tenants' shares summed)
        over the group's GPUs."""
        per_gpu: FloatArray = (np.bincount(self.group, job_power_w, self.size) / self.gpus)[
            self.group
        ]
        return per_gpu

    def any_tenant(self, flags: BoolArray) -> BoolArray:
        """(N,) whether any tenant of job n's group is ``flags``: what one tenant does to its
        GPU (a clock cut, a default limit kept for a serving job) its co-tenants share."""
        shared: BoolArray = (np.bincount(self.group, flags, self.size) > 0)[self.group]
        return shared

    def lowest(self, values: FloatArray) -> FloatArray:
        """Per job, the lowest of ``values`` over its group's tenants (a shared GPU's lever
        gain: its tenants read one GPU at one limit)."""
        low: FloatArray = -group_max(self.group, -np.asarray(values, dtype=np.float64), self.size)
        return low[self.group]

    def job_power_w(self, group_power_w: FloatArray) -> FloatArray:
        """(N,) each job's equal share of its group's power."""
        return group_power_w[self.group] / self.tenants()[self.group]

    def collapse(
        self, problem: DualProblem, seen: FloatArray, pinned: BoolArray | None = None
    ) -> DualProblem:
        """The per-job problem as one row per group; ``seen``: (N,) the readings each job's
        power model has learnt from (0: unmeasured, its row already flat at its limit);
        ``pinned``: jobs whose range is one clock (serving jobs at their floors): their floor
        bounds the group from below, their ceiling only a group of pinned jobs alone."""
        u, size = self.group, self.size
        weight = np.stack([np.bincount(u, w, size) for w in problem.weight]).astype(np.float64)
        w0 = problem.weight[0]
        total = np.bincount(u, w0, size)
        # pressure-weighted time: a group with no pressure at all takes its tenants' mean
        pressed = total[u] > 0
        pull = np.where(pressed, w0 / np.where(pressed, total[u], 1.0), 1.0 / self.tenants()[u])
        time_theta = _sum_rows(u, pull[:, None] * problem.time_theta, size)
        # power: the youngest measured tenant's model, or a new tenant's flat limit
        new = seen <= 0
        has_new = np.bincount(u, new.astype(np.float64), size) > 0
        youngest = -group_max(u, -np.where(new, np.inf, seen), size)
        trust = np.where(has_new[u], new, seen == youngest[u]).astype(np.float64)
        trust = trust / np.bincount(u, trust, size)[u]
        power_theta = _sum_rows(u, trust[:, None] * problem.power_theta, size)
        first = self.first()
        x_lo = group_max(u, problem.x_lo, size)
        xm_lo = group_max(u, problem.xm_lo, size)
        x_hi, xm_hi = problem.x_hi, problem.xm_hi
        if pinned is not None and pinned.any():
            free = np.bincount(u, ~pinned, size)[u] > 0
            x_hi = np.where(pinned & free, np.inf, x_hi)
            xm_hi = np.where(pinned & free, np.inf, xm_hi)
        return replace(
            problem,
            gpus=self.gpus.copy(),
            power_theta=power_theta,
            time_theta=time_theta,
            weight=weight,
            knee_x=problem.knee_x[first],
            mem_mask=problem.mem_mask[first],
            x_lo=x_lo,
            x_hi=np.maximum(-group_max(u, -x_hi, size), x_lo),
            xm_lo=xm_lo,
            xm_hi=np.maximum(-group_max(u, -xm_hi, size), xm_lo),
        )

    def domains(self, domains: DomainLimits) -> DomainLimits:
        """The domains' memberships by group: a group's share of a domain is the largest of
        its tenants' (all of them where the tenants span the same GPUs)."""
        key = domains.domain * self.size + self.group[domains.job_row]
        keys, where = np.unique(key, return_inverse=True)
        share = np.zeros(keys.shape[0])
        np.maximum.at(share, where, domains.share)
        return replace(
            domains,
            domain=(keys // self.size).astype(np.int64),
            job_row=(keys % self.size).astype(np.int64),
            share=share,
        )


class Interference:
    """What a change of co-tenants does to a tenant's iteration time, learned over the
    cluster from the tenants that went through one: the mean of log(T / T̂) of a job's first
    sample among b co-tenants (b ≥ `MAX_COTENANTS` in one cell) after its time model learned
    among a ≠ b, T̂ that model's prediction at the sample's clocks. Co-scheML's slowdown as
    a function of the co-runners' load, the load being their number: what the head
    measures of them (no per-process activity is read).

    `scale` applies a learned cell to a plan: a tenant whose model learned among a co-tenants
    and that the plan puts among b runs exp(mean[a, b]) times the model's time until its first
    sample among them re-anchors the model (`JobEstimator.cotenants`). A cell counts once it
    has ``min_events``; before, its reverse (b, a) does, negated; else nothing changes. The
    cells live in the head's memory: a restarted head learns them again.
    """

    #: co-tenant counts from this one up share a cell
    MAX_COTENANTS = 3
    #: |log(T / T̂)| beyond this (a factor of e²) is clipped: one sample must not own a cell
    CLIP = 2.0

    def __init__(self, min_events: int = 10, gain: float = 0.05) -> None:
        k = self.MAX_COTENANTS + 1
        self.min_events = min_events
        self.gain = gain
        self.mean = np.zeros((k, k))
        self.count = np.zeros((k, k), dtype=np.int64)

    def _cell(self, count: IntArray) -> IntArray:
        return np.minimum(np.asarray(count, dtype=np.int64), self.MAX_COTENANTS)

    def learn(self, before: IntArray, after: IntArray, log_ratio: FloatArray) -> None:
        """One event per entry: a job whose model learned among ``before`` co-tenants measured
        log(T / T̂) = ``log_ratio`` among ``after`` (a running mean per cell, then a moving
        one of gain ``gain``, which follows a fleet that changes)."""
        rows, cols = self._cell(before), self._cell(after)
        for a, b, r in zip(rows.tolist(), cols.tolist(), log_ratio.tolist(), strict=True):
            if a == b or not math.isfinite(r):
                continue
            self.count[a, b] += 1
            step = max(1.0 / self.count[a, b], self.gain)
            self.mean[a, b] += step * (min(max(r, -self.CLIP), self.CLIP) - self.mean[a, b])

    def learned(self) -> dict[tuple[int, int], float]:
        """The factor of every cell that counts, by (co-tenants before, after)."""
        ready = np.argwhere(self.count >= self.min_events).tolist()
        return {(a, b): math.exp(float(self.mean[a, b])) for a, b in ready}

    def scale(self, learned: IntArray, planned: IntArray) -> FloatArray:
        """(N,) the factor on each job's predicted iteration time: its model learned among
        ``learned`` co-tenants (−1: not known, factor 1), the plan puts it among ``planned``."""
        known = np.asarray(learned) >= 0
        a = self._cell(np.where(known, learned, 0))
        b = self._cell(planned)
        ready = self.count >= self.min_events
        log = np.where(ready[a, b], self.mean[a, b], np.where(ready[b, a], -self.mean[b, a], 0.0))
        out: FloatArray = np.exp(np.where(known & (a != b), log, 0.0))
        return out


def _sum_rows(group: IntArray, rows: FloatArray, size: int) -> FloatArray:
    out = np.zeros((size, rows.shape[1]))
    np.add.at(out, group, rows)
    return out


def group_max(group: IntArray, values: FloatArray, size: int) -> FloatArray:
    """(size,) the largest of ``values`` in each group (−inf for a group without one)."""
    out = np.full(size, -np.inf)
    np.maximum.at(out, group, values)
    return out
