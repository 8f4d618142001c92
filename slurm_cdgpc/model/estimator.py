"""The online estimator: per-job power and iteration-time models, learned by RLS as jobs run.

The controller's math: never reaches `store/`, `transport/`, `agent/`, `coordinator/` or `cli/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Models" (RLS, What a sample is); tests:
`tests/unit/test_control_empc.py`, `tests/unit/test_closed_loop.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import numpy as np
from numpy.typing import NDArray

from slurm_cdgpc.model.families import (
    FloatArray,
    PowerFamily,
    power_family,
    time_regressors,
)
from slurm_cdgpc.model.kind_prior import KIND_PRIOR_AFTER, KindPrior
from slurm_cdgpc.model.rls import (
    BoolArray,
    Rls,
    RlsSettings,
    RlsState,
    RlsUpdate,
    finite_rows,
)

if TYPE_CHECKING:
    from slurm_cdgpc.gpu.catalog import GpuSpec

#: Share of a job's iteration time that the prior assigns to the core clock, the memory clock and
#: neither (used until the job's first measurements arrive).
TIME_PRIOR_SPLIT = (0.7, 0.2, 0.1)
#: Share of (limit − idle) the prior expects a job to draw at its top clocks (all of it: the prior
#: should not under-estimate).
POWER_PRIOR_ACTIVITY = 1.0


#: time-model samples before a job's miss among new co-tenants says what they do to it
#: (`JobEstimator.cotenant_steps`)
SETTLED_TIME_SAMPLES: Final = 3

#: Share of (limit − idle) above idle power at which a job's GPUs count as busy (`accrue_work`)
ACTIVE_POWER_SHARE: Final = 0.1


@dataclass(frozen=True)
class EstimatorSettings:
    family: str = "bent"
    # Power moves with phases and temperature: a short memory (≈ 20 intervals).
    power: RlsSettings = field(default_factory=lambda: RlsSettings(forgetting=0.95))
    # Iteration time is steadier: a longer memory (≈ 50 intervals).
    time: RlsSettings = field(default_factory=lambda: RlsSettings(forgetting=0.98))
    #: a new job of a known kind starts from the models pooled over the jobs of its kind
    #: (`KindPrior`) once the pool has enough readings, not from the fixed shape (only the
    #: jobs `add_jobs` is given kinds for)
    kind_prior: bool = True


@dataclass(frozen=True)
class JobStatics:
    """What the estimator knows about new jobs before measuring them (arrays of length m)."""

    gpus: NDArray[np.int64]
    graphics_max_mhz: FloatArray
    memory_max_mhz: FloatArray
    knee_mhz: FloatArray
    #: 1.0 where the memory clock is adjustable (GDDR parts), 0.0 on HBM parts
    mem_mask: FloatArray
    idle_power_w: FloatArray
    #: enforced power limit per GPU (the default limit, i.e. the TDP, unless an admin lowered it)
    power_limit_w: FloatArray

    def __len__(self) -> int:
        return int(self.gpus.shape[0])

    @staticmethod
    def of(
        specs: Sequence[GpuSpec], types: NDArray[np.intp], gpus: NDArray[np.int64]
    ) -> JobStatics:
        """Jobs on GPU types ``specs[types[n]]`` with ``gpus[n]`` GPUs each; the power limit
        is the type's default (the TDP) until a node reports an enforced one."""
        index = np.asarray(types, dtype=np.intp)

        def per_job(values: Sequence[float]) -> FloatArray:
            return np.asarray(values, dtype=np.float64)[index]

        return JobStatics(
            gpus=np.asarray(gpus, dtype=np.int64),
            graphics_max_mhz=per_job([s.max_graphics_mhz for s in specs]),
            memory_max_mhz=per_job([s.max_memory_mhz for s in specs]),
            knee_mhz=per_job([s.knee_mhz for s in specs]),
            mem_mask=per_job([1.0 if s.memory_lockable else 0.0 for s in specs]),
            idle_power_w=per_job([s.idle_power_w for s in specs]),
            power_limit_w=per_job([s.power_limit.default_w for s in specs]),
        )

    @staticmethod
    def concat(parts: list[JobStatics]) -> JobStatics:
        return JobStatics(*(np.concatenate([getattr(p, f) for p in parts]) for f in _STATIC_FIELDS))

    def select(self, mask: BoolArray) -> JobStatics:
        return JobStatics(*(getattr(self, f)[mask] for f in _STATIC_FIELDS))


_STATIC_FIELDS = (
    "gpus",
    "graphics_max_mhz",
    "memory_max_mhz",
    "knee_mhz",
    "mem_mask",
    "idle_power_w",
    "power_limit_w",
)


def power_prior(family: PowerFamily, statics: JobStatics) -> FloatArray:
    """θ_P at job start: idle power as intercept, a core term reaching the limit at f_max."""
    one = np.ones(len(statics))
    knee_x = statics.knee_mhz / statics.graphics_max_mhz
    h_top = family.basis(one, knee_x)  # h_j(1)
    dynamic = POWER_PRIOR_ACTIVITY * (statics.power_limit_w - statics.idle_power_w)
    theta = np.zeros((len(statics), family.n_params))
    # put the whole dynamic share on the first core coefficient: a₁ h₁(1) = dynamic
    theta[:, 0] = dynamic / h_top[:, 0]
    theta[:, -1] = statics.idle_power_w
    return theta


def time_prior(statics: JobStatics, iteration_s: FloatArray | None = None) -> FloatArray:
    """θ_T at job start from a first iteration time at top clocks (1 s when unknown).

    The scale only matters relative to the job's own weight, which is itself "remaining time
    over slack", so an unknown job starts scale-free.
    """
    t0 = np.ones(len(statics)) if iteration_s is None else np.asarray(iteration_s, np.float64)
    core, mem, other = TIME_PRIOR_SPLIT
    m = statics.mem_mask
    # on HBM parts the memory share is clock-independent time
    return np.stack([core * t0, mem * m * t0, (other + mem * (1.0 - m)) * t0], axis=1)


class JobEstimator:
    """Power and iteration-time models of every running job, learned online.

    Holds, for N running jobs, what the controller needs to know about each one: its GPU count,
    the normalisation of its clocks, whether its memory clock is adjustable, the knee of its GPU
    type, and two RLS banks (power per GPU, seconds per iteration). No offline profiling: a job
    starts from a prior built from its GPU type and learns from every interval's measurements.
    """

    def __init__(self, settings: EstimatorSettings | None = None) -> None:
        self.settings = settings or EstimatorSettings()
        self.family = power_family(self.settings.family)
        k_p = self.family.n_params
        # clock coefficients ≥ 0 keep the subproblem convex; the intercept a_e may go negative
        # (a tangent model above the knee crosses zero below it), the time coefficients may not
        nonneg_p = np.arange(k_p) < k_p - 1
        self.power = Rls(np.zeros((0, k_p)), self.settings.power, nonneg=nonneg_p)
        self.time = Rls(np.zeros((0, 3)), self.settings.time, nonneg=np.ones(3, dtype=bool))
        #: every job's readings pooled per kind (None: `kind_prior` off)
        self.pool = (
            KindPrior(k_p, self.settings.power.initial_cov) if self.settings.kind_prior else None
        )
        #: per job, its kind's pool in `pool` (-1: none)
        self.kind = np.zeros(0, dtype=np.int64)
        #: per job, whether its power model started from its kind's pool: watts as the kind
        #: drew them, which its first reading does not rescale (`_anchor_first`)
        self.pooled = np.zeros(0, dtype=bool)
        empty = np.zeros(0)
        self.statics = JobStatics(np.zeros(0, dtype=np.int64), *([empty] * 6))
        #: the clock (normalised) at which the firmware was last seen holding the job at its
        #: power limit; +inf while it has not been
        self.limit_x = np.zeros(0)
        #: work done, in seconds at top clocks (`accrue_work`): what a job that does not say its
        #: total has used of its time limit
        self.work_top_s = np.zeros(0)
        #: a serving job's floor in the last plan (normalised; NaN: none yet), where the next
        #: starts from (`slurm_cdgpc.control.serving`)
        self.floor_x = np.zeros(0)
        #: the part of its GPUs' readings that was the job's own in the last plan (1 alone,
        #: less on a shared GPU: `Tenancy.attribution`; NaN: not planned yet): what its next
        #: reading, taken among the tenants that plan counted on, is compared with
        self.share = np.zeros(0)
        #: plans in a row with that share: a GPU whose tenants changed gives readings its
        #: models have not learnt yet, like a new job's
        self.same_share = np.zeros(0, dtype=np.int64)
        #: the co-tenants the time model last learned among (`Measurements.cotenants`; -1:
        #: none learned yet), and how many they were (-1: not known)
        self.cotenants = np.zeros(0, dtype=np.int64)
        self.cotenant_count = np.zeros(0, dtype=np.int64)
        #: the samples of the last `observe` taken among other co-tenants than their models
        #: learned among, from settled models: (count before, count after, log(T / T̂)), what
        #: `slurm_cdgpc.control.tenancy.Interference` learns from
        self.cotenant_steps = _no_steps()
        #: the factor on each job's time model in the last plan (`Interference.scale`): its
        #: prediction there is the model's times this
        self.time_scale = np.zeros(0)
        #: what its GPU drew over the power limit it was held at, where the limit is the
        #: setpoint (MIG mode: `slurm_cdgpc.control.guard_rail.limit_gain`); 1 until seen
        self.limit_gain = np.zeros(0)
        #: δ_n, the job's own relative miss of its settled plans (`offset_per_job`); NaN until
        #: it has one (`EconomicMPC.job_offsets`)
        self.offset = np.zeros(0)
        #: its power in the last plan, W (`offset_per_job` weighs the offsets by it); NaN: none
        self.planned_w = np.zeros(0)

    def __len__(self) -> int:
        return self.power.n

    @property
    def knee_x(self) -> FloatArray:
        return self.statics.knee_mhz / self.statics.graphics_max_mhz

    def add_jobs(
        self,
        statics: JobStatics,
        iteration_s: FloatArray | None = None,
        kinds: Sequence[str | None] | None = None,
    ) -> None:
        """New jobs from their priors. ``kinds`` (with `kind_prior`): each job's kind (`KindPrior`:
        the same work on the same GPU type), None for a job of no known kind or whose readings
        are not its own training steps' (a serving job, a shared GPU's tenant). A job of a kind
        whose pool is ready starts from the pool's models."""
        first = len(self)
        self.power.append(power_prior(self.family, statics))
        self.time.append(time_prior(statics, iteration_s))
        kind = np.full(len(statics), -1, dtype=np.int64)
        pooled = np.zeros(len(statics), dtype=bool)
        if self.pool is not None and kinds is not None:
            rows = np.array([k is not None for k in kinds], dtype=bool).nonzero()[0]
            kind[rows] = self.pool.ids([k for k in kinds if k is not None])
            models = self.pool.models(kind[rows])
            ready, rows = models.ready, rows[models.ready]
            at = first + rows
            scale = np.ones(len(statics)) if iteration_s is None else np.asarray(iteration_s)
            self.power.theta[at] = models.power_theta[ready]
            self.power.cov[at] = models.power_cov[ready]
            self.time.theta[at] = models.time_theta[ready] * scale[rows, None]
            self.time.cov[at] = models.time_cov[ready]
            pooled[rows] = True
        self.kind = np.concatenate([self.kind, kind])
        self.pooled = np.concatenate([self.pooled, pooled])
        self.statics = JobStatics.concat([self.statics, statics])
        self.limit_x = np.concatenate([self.limit_x, np.full(len(statics), np.inf)])
        self.work_top_s = np.concatenate([self.work_top_s, np.zeros(len(statics))])
        self.floor_x = np.concatenate([self.floor_x, np.full(len(statics), np.nan)])
        self.share = np.concatenate([self.share, np.full(len(statics), np.nan)])
        self.same_share = np.concatenate([self.same_share, np.zeros(len(statics), np.int64)])
        self.cotenants = np.concatenate([self.cotenants, np.full(len(statics), -1, np.int64)])
        self.cotenant_count = np.concatenate(
            [self.cotenant_count, np.full(len(statics), -1, np.int64)]
        )
        self.time_scale = np.concatenate([self.time_scale, np.ones(len(statics))])
        self.limit_gain = np.concatenate([self.limit_gain, np.ones(len(statics))])
        self.offset = np.concatenate([self.offset, np.full(len(statics), np.nan)])
        self.planned_w = np.concatenate([self.planned_w, np.full(len(statics), np.nan)])

    def restore(self, power: RlsState, time: RlsState, rows: Sequence[int] | None = None) -> None:
        """Put back the models of jobs already added (``rows``; default: every one), as
        `Rls.state` saved them: a restarted head, or a job whose node came back, learns on
        where it stopped."""
        self.power.restore(power, rows)
        self.time.restore(time, rows)

    def keep(self, mask: BoolArray) -> None:
        self.kind = self.kind[mask]
        self.pooled = self.pooled[mask]
        self.power.keep(mask)
        self.time.keep(mask)
        self.statics = self.statics.select(mask)
        self.limit_x = self.limit_x[mask]
        self.work_top_s = self.work_top_s[mask]
        self.floor_x = self.floor_x[mask]
        self.share = self.share[mask]
        self.same_share = self.same_share[mask]
        self.cotenants = self.cotenants[mask]
        self.cotenant_count = self.cotenant_count[mask]
        self.time_scale = self.time_scale[mask]
        self.limit_gain = self.limit_gain[mask]
        self.offset = self.offset[mask]
        self.planned_w = self.planned_w[mask]

    def normalise(
        self, graphics_mhz: FloatArray, memory_mhz: FloatArray
    ) -> tuple[FloatArray, FloatArray]:
        return (
            graphics_mhz / self.statics.graphics_max_mhz,
            memory_mhz / self.statics.memory_max_mhz,
        )

    def power_regressors(self, x: FloatArray, x_m: FloatArray) -> FloatArray:
        return self.family.regressors(x, x_m, self.statics.mem_mask, self.knee_x)

    def predict_power_w(self, x: FloatArray, x_m: FloatArray) -> FloatArray:
        """Per-GPU power at normalised clocks (x, x_m); shapes (N,) or (H, N)."""
        return self.power.predict(self.power_regressors(x, x_m))

    def predict_iteration_s(self, x: FloatArray, x_m: FloatArray) -> FloatArray:
        return self.time.predict(time_regressors(x, x_m, self.statics.mem_mask))

    def accrue_work(self, x: FloatArray, x_m: FloatArray, power_w: FloatArray, dt_s: float) -> None:
        """Add ``dt_s`` of work at the applied clocks, in seconds at top clocks (the time model's
        T(1, 1) / T(x, x_m), at most 1), to every job whose GPUs were busy: measured above
        ``ACTIVE_POWER_SHARE`` of the way from idle to the limit. An idle or unmeasured job
        adds nothing (its bound on the work left stays high)."""
        one = np.ones(len(self))
        speed = self.predict_iteration_s(one, one) / self.predict_iteration_s(
            np.nan_to_num(x, nan=1.0), np.nan_to_num(x_m, nan=1.0)
        )
        st = self.statics
        busy = power_w > st.idle_power_w + ACTIVE_POWER_SHARE * (st.power_limit_w - st.idle_power_w)
        speed = np.where(np.isfinite(speed), np.clip(speed, 0.0, 1.0), 0.0)
        self.work_top_s = self.work_top_s + np.where(busy & np.isfinite(x), speed * dt_s, 0.0)

    def observe(
        self,
        x: FloatArray,
        x_m: FloatArray,
        power_w: FloatArray,
        iteration_s: FloatArray,
        mask: BoolArray | None = None,
        power_capped: BoolArray | None = None,
        cotenants: NDArray[np.int64] | None = None,
        cotenant_count: NDArray[np.int64] | None = None,
        reanchor: bool = True,
    ) -> tuple[RlsUpdate, RlsUpdate]:
        """Learn from one interval: applied clocks (normalised), mean per-GPU power and mean
        iteration time. NaN marks "not measured" (e.g. a job that reports no progress).
        ``power_capped`` marks jobs the firmware held below their lock at the applied clock.

        ``cotenants`` (`Measurements.cotenants`: per job, the co-tenants its sample was taken
        among, −1 not known): a job measured among others than its time model last learned
        with runs at another speed, and its model re-anchors on the sample (`Rls.expect_step`),
        which otherwise lies many σ̂ from what it learned and is rejected for several
        intervals (on Alibaba's pods 31 % off after a change, 85 % after the co-tenants left).
        Keyed on the sample's own co-tenants, not the plan's: the head learns from readings
        taken two plans back. With ``cotenant_count`` (how many they were, -1 not known), such
        a sample of a settled model leaves its miss in `cotenant_steps`; ``reanchor`` False
        keeps the model as it is (the sample may then be rejected)."""
        self.cotenant_steps = _no_steps()
        if cotenants is not None:
            seen = cotenants >= 0
            changed = seen & (self.cotenants >= 0) & (cotenants != self.cotenants)
            if cotenant_count is not None:
                self._cotenant_steps(changed, x, x_m, iteration_s, cotenant_count, mask)
                self.cotenant_count = np.where(seen, cotenant_count, self.cotenant_count)
            if reanchor:
                self.time.expect_step(changed)
            self.cotenants = np.where(seen, cotenants, self.cotenants)
        if power_capped is not None:
            seen = np.isfinite(x) & (True if mask is None else mask)
            capped = seen & power_capped
            # the limit binds at the applied clock; once a job runs above that uncapped
            # (a lighter phase, a raised limit) the old ceiling no longer holds
            self.limit_x = np.where(capped, x, self.limit_x)
            self.limit_x = np.where(
                seen & ~power_capped & (x >= self.limit_x), np.inf, self.limit_x
            )
        phi_p = self.power_regressors(x, x_m)
        phi_t = time_regressors(x, x_m, self.statics.mem_mask)
        if self.pool is not None and (self.kind >= 0).any():
            self._pool(phi_p, power_w, phi_t, iteration_s, mask, cotenants, power_capped)
        # a pooled power model is the kind's watts already: its first reading teaches it
        # as any other does
        scaled = ~(self.pooled & (self.power.count == 0))
        _anchor_first(self.power, phi_p, power_w, scaled if mask is None else mask & scaled)
        _anchor_first(self.time, phi_t, iteration_s, mask)
        return self.power.update(phi_p, power_w, mask), self.time.update(phi_t, iteration_s, mask)

    def _pool(
        self,
        phi_p: FloatArray,
        power_w: FloatArray,
        phi_t: FloatArray,
        iteration_s: FloatArray,
        mask: BoolArray | None,
        cotenants: NDArray[np.int64] | None,
        power_capped: BoolArray | None,
    ) -> None:
        """Add the interval's readings to `pool`: every job of a kind, measured alone
        (co-tenants known to be none, or not known on a fleet that does not share), whose
        time model has its scale (`KIND_PRIOR_AFTER` readings), not held by a power limit: the
        firmware ran such a job below its lock, so its reading is not what the clock it is
        filed under draws, and a pool that took it predicted the kind's later jobs under what
        they drew there. Its time over its own model's at top clocks, before this reading
        teaches it."""
        assert self.pool is not None
        rows = (
            (self.kind >= 0)
            & (self.time.count >= KIND_PRIOR_AFTER)
            & finite_rows(phi_p)
            & finite_rows(phi_t)
            & np.isfinite(power_w)
            & (power_w > 0)
            & np.isfinite(iteration_s)
            & (iteration_s > 0)
        )
        if mask is not None:
            rows &= mask
        if cotenants is not None:
            rows &= cotenants <= 0
        if power_capped is not None:
            rows &= ~power_capped
        idx = np.flatnonzero(rows)
        one = np.ones(idx.size)
        top = self.time.predict(time_regressors(one, one, self.statics.mem_mask[idx]), idx)
        known = top > 0
        idx, top = idx[known], top[known]
        # np.take: a few times faster than indexing on the 2-D arrays, the same rows
        self.pool.learn(
            self.kind[idx],
            np.take(phi_p, idx, axis=0),
            power_w[idx],
            np.take(phi_t, idx, axis=0),
            iteration_s[idx] / top,
        )

    def _cotenant_steps(
        self,
        changed: BoolArray,
        x: FloatArray,
        x_m: FloatArray,
        iteration_s: FloatArray,
        count: NDArray[np.int64],
        mask: BoolArray | None,
    ) -> None:
        """`cotenant_steps` of the ``changed`` rows whose time model is settled (a young
        model's miss is its own) and whose counts before and after are known."""
        rows = (
            changed
            & (self.time.count >= SETTLED_TIME_SAMPLES)
            & (self.cotenant_count >= 0)
            & (count >= 0)
            & np.isfinite(iteration_s)
            & (iteration_s > 0)
        )
        if mask is not None:
            rows &= mask
        if not rows.any():
            return
        predicted = self.predict_iteration_s(x, x_m)
        rows &= np.isfinite(predicted) & (predicted > 0)
        self.cotenant_steps = (
            self.cotenant_count[rows].copy(),
            np.asarray(count, dtype=np.int64)[rows],
            np.log(iteration_s[rows] / predicted[rows]),
        )


CotenantSteps = tuple[NDArray[np.int64], NDArray[np.int64], FloatArray]


def _no_steps() -> CotenantSteps:
    """`JobEstimator.cotenant_steps` of an `observe` that saw no change of co-tenants."""
    return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0)


def _anchor_first(rls: Rls, phi: FloatArray, y: FloatArray, mask: BoolArray | None) -> None:
    """Scale a new job's prior so it predicts its first measurement exactly.

    The prior's *shape* (how power and time split between the clocks) is a fair guess for any
    training job; its *scale* (a 1 s iteration, the power limit at the top clock) is not.
    Rescaling on the first sample, before RLS sees it, avoids a large first correction along
    near-collinear directions.
    """
    first = ((rls.count == 0) | rls.fresh) & np.isfinite(y) & (y > 0)
    if mask is not None:
        first &= mask
    if not first.any():
        return
    y_hat = np.einsum("nk,nk->n", phi[first], rls.theta[first])
    ok = y_hat > 0
    rows = np.flatnonzero(first)[ok]
    rls.theta[rows] *= (y[rows] / y_hat[ok])[:, None]
