"""Power-capping policies for the cluster simulator, one interface (`Policy.decide`).

``cdgpc`` and ``cdgpc-paper`` are the controller cdgpcd runs (`Cdgpc`); every policy but the
oracle sees only a `ClusterView` and has no path to the plant. Power domains reach a policy
with its fleet (`FleetSpec.topology`, in ``start``). Design: DESIGN.md, "Controller"
(One brain) and "Simulator"; tests: `tests/unit/test_sim_policies.py`,
`tests/unit/test_one_brain.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final

import numpy as np
import numpy.typing as npt

from slurm_cdgpc.config import ControlConfig
from slurm_cdgpc.control.discrete import ClockGrid
from slurm_cdgpc.control.domains import DomainLimits
from slurm_cdgpc.control.empc import Decision, EconomicMPC, JobState, Measurements, QueueState
from slurm_cdgpc.control.guard_rail import lever_state, power_limits_w
from slurm_cdgpc.control.overdraw import ClusterDraw
from slurm_cdgpc.control.ramp import Ramp
from slurm_cdgpc.control.tenancy import Tenancy, cotenant_key
from slurm_cdgpc.control.tuning import Tuning, paper, shipped
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.gpu.catalog import GpuSpec
from slurm_cdgpc.gpu.plant import Plant, WorkloadArrays
from slurm_cdgpc.model.estimator import EstimatorSettings, JobEstimator, JobStatics
from slurm_cdgpc.model.kind_prior import job_kind
from slurm_cdgpc.sim.cluster import ClusterView, PlantPolicy, Policy, Setpoints
from slurm_cdgpc.sim.fleet import FleetSpec
from slurm_cdgpc.sim.sharing import TenantTimeErrors, co_tenants
from slurm_cdgpc.topology import Topology

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

#: ε: share of the budget uniform-clock and the oracle hold back (cdgpc's is its own setting)
GUARD_BAND: Final = 0.002
STATIC_MIN_CLOCK_FRACTION: Final = 0.5
UNIFORM_CLOCK_FRACTIONS: Final = np.round(np.arange(1.0, 0.295, -0.01), 2)
ORACLE_CLOCK_LEVELS: Final = 24
#: η of the relative-miss correction in uniform-clock
OFFSET_GAIN: Final = 0.3


def _limit_range(specs: tuple[GpuSpec, ...], types: IntArray) -> tuple[FloatArray, FloatArray]:
    lo = np.array([s.power_limit.min_w for s in specs])[types]
    hi = np.array([s.power_limit.max_w for s in specs])[types]
    return lo, hi


def uniform_limit_w(view: ClusterView) -> FloatArray:
    """Per job: L = (B − P_idle GPUs) / busy GPUs, clipped to the job's limit range."""
    lo, hi = _limit_range(view.specs, view.job_type)
    share = (view.budget_w - view.idle_power_w) / max(view.busy_gpus, 1)
    limit: FloatArray = np.clip(np.full(len(view), share), lo, hi)
    return limit


class _Levels:
    """Supported graphics clocks per GPU type (top memory clock), ascending."""

    def __init__(self, specs: tuple[GpuSpec, ...]) -> None:
        self.levels = [np.array(sorted(s.clocks.graphics_for()), dtype=np.float64) for s in specs]
        self.top = np.array([lv[-1] for lv in self.levels])

    def floor_mhz(self, types: IntArray, mhz: FloatArray) -> FloatArray:
        """Highest level ≤ mhz (the lowest level if none); mhz of shape (..., N)."""
        out = np.empty_like(mhz)
        for k, lv in enumerate(self.levels):
            sel = types == k
            idx = np.searchsorted(lv, mhz[..., sel] * (1 + 1e-12), side="right") - 1
            out[..., sel] = lv[np.clip(idx, 0, lv.size - 1)]
        return out

    def ceil_mhz(self, types: IntArray, mhz: FloatArray) -> FloatArray:
        """Lowest level ≥ mhz (the top level if none)."""
        out = np.empty_like(mhz)
        for k, lv in enumerate(self.levels):
            sel = types == k
            idx = np.searchsorted(lv, mhz[sel] * (1 - 1e-12), side="left")
            out[sel] = lv[np.clip(idx, 0, lv.size - 1)]
        return out


# --- simple policies ------------------------------------------------------------------------


class MaxClock(Policy):
    """``max-clock``: no cap; it needs nothing, and is the reference run's policy."""

    name = "max-clock"

    def decide(self, view: ClusterView) -> Setpoints:
        return Setpoints()


class UniformPowerCap(Policy):
    """``uniform-power-cap``, DCGM/Flux style: (budget − idle GPUs at idle power) / busy GPUs as
    every busy GPU's power limit, clipped to its type's limit range (`uniform_limit_w`)."""

    name = "uniform-power-cap"

    def decide(self, view: ClusterView) -> Setpoints:
        return Setpoints(limit_w=uniform_limit_w(view))


class UniformDomainCap(UniformPowerCap):
    """``uniform-domain-cap``, NVIDIA DPS / Flux style over power domains: every busy GPU's
    power limit is the lowest, over the cluster and each domain above its node, of (limit −
    the domain's idle GPUs at idle power) / the domain's busy GPUs, clipped to its type's
    limit range; a job spanning nodes takes its lowest node's. Without a topology it is
    ``uniform-power-cap``."""

    name = "uniform-domain-cap"

    def start(self, fleet: FleetSpec, budget_w: float, interval_s: float) -> None:
        self.members = fleet.domain_nodes()  # (D, nodes)
        self.limit_w = np.zeros(0) if fleet.topology is None else fleet.topology.limits_w

    def decide(self, view: ClusterView) -> Setpoints:
        limit = uniform_limit_w(view)
        if not self.limit_w.size:
            return Setpoints(limit_w=limit)
        members = self.members.astype(np.float64)
        busy = view.node_busy_gpus()
        idle_w = (view.node_gpus - busy) * np.array([s.idle_power_w for s in view.specs])[
            view.node_type
        ]
        # per domain d: (L_d − Σ_{nodes in d} idle GPUs · P_idle) / busy GPUs in d
        share = (self.limit_w - members @ idle_w) / np.maximum(members @ busy, 1)
        node_share = np.where(self.members, share[:, None], np.inf).min(axis=0)
        job_share = np.where(view.job_nodes > 0, node_share[None, :], np.inf).min(axis=1)
        lo, hi = _limit_range(view.specs, view.job_type)
        # clipping is monotone: min(clip(a), clip(b)) = clip(min(a, b))
        return Setpoints(limit_w=np.minimum(limit, np.clip(job_share, lo, hi)))


class EarGreedy(Policy):
    """``ear-greedy``, EAR style: each node starts from a share of the budget proportional to its
    GPUs' power limits; nodes drawing well below their share (measured) release the excess down
    to `headroom` × their draw, and the released power is water-filled over the nodes pressing
    their cap. A node's allocation, less its idle GPUs, becomes its busy GPUs' power limit."""

    name = "ear-greedy"
    #: a node drawing below this share of its allocation releases the excess
    release_below = 0.9
    #: what a releasing node keeps above its draw
    headroom = 1.1

    def start(self, fleet: FleetSpec, budget_w: float, interval_s: float) -> None:
        node_max = (
            fleet.node_gpus * np.array([s.power_limit.max_w for s in fleet.specs])[fleet.node_type]
        )
        self.base_w = budget_w * node_max / node_max.sum()  # equal per-GPU-limit shares
        self.node_max_w = node_max.astype(np.float64)
        self.alloc_w = self.base_w.copy()

    def decide(self, view: ClusterView) -> Setpoints:
        p = view.node_power_w
        started = np.zeros(len(view), dtype=bool)
        started[len(view) - view.started :] = True
        fresh = (view.job_nodes[started] > 0).any(axis=0)  # nodes that got a job
        # demand: a node well under its allocation wants 110 % of its draw; the others all
        # they can get (∞), up to their GPUs' maximum limits
        wants = np.where(
            np.isfinite(p) & ~fresh & (p < self.release_below * self.alloc_w),
            self.headroom * np.nan_to_num(p),
            np.inf,
        )
        wants = np.minimum(wants, self.node_max_w)
        # water-fill: alloc_i = min(wants_i, λ·base_i) with Σ alloc = B (bisection on λ)
        lo, hi = 0.0, 1.0
        while np.minimum(wants, hi * self.base_w).sum() < view.budget_w and hi < 1e6:
            if np.all(wants <= hi * self.base_w):
                break
            hi *= 2.0
        for _ in range(50):
            mid = 0.5 * (lo + hi)
            if np.minimum(wants, mid * self.base_w).sum() > view.budget_w:
                hi = mid
            else:
                lo = mid
        self.alloc_w = np.minimum(wants, lo * self.base_w)
        # per busy GPU of a node: (alloc − idle GPUs · P_idle) / busy GPUs
        busy = view.node_busy_gpus()
        idle_w = np.array([s.idle_power_w for s in view.specs])[view.node_type]
        per_gpu = (self.alloc_w - (view.node_gpus - busy) * idle_w) / np.maximum(busy, 1)
        # a job's limit: the lowest of its nodes'
        limit = np.where(view.job_nodes > 0, per_gpu[None, :], np.inf).min(axis=1)
        lo_w, hi_w = _limit_range(view.specs, view.job_type)
        return Setpoints(limit_w=np.clip(limit, lo_w, hi_w))


class StaticGpuFreq(Policy):
    """``static-gpu-freq``, as ``sbatch --gpu-freq``: a job runs its first interval at top
    clocks; from the measured iteration time it gets, once, the lowest supported clock that
    still meets its deadline assuming time ∝ 1 / clock (top clock when it has no deadline or
    cannot meet it), never below `STATIC_MIN_CLOCK_FRACTION` of max. The uniform per-GPU power
    limit is the backstop that holds the budget."""

    name = "static-gpu-freq"

    def start(self, fleet: FleetSpec, budget_w: float, interval_s: float) -> None:
        self.levels = _Levels(fleet.specs)
        self.clock_mhz = np.zeros(0)

    def decide(self, view: ClusterView) -> Setpoints:
        clock = np.concatenate([self.clock_mhz[view.kept], np.full(view.started, np.nan)])
        top = self.levels.top[view.job_type]
        # choose once, after the first measured interval at top clocks:
        # R·T_top·f_top/f ≤ D − t  ⇒  f ≥ f_top·R·T_top / (D − t)
        pick = np.isnan(clock) & np.isfinite(view.iteration_s)
        slack = view.deadline_s - view.now_s
        t_top = view.iteration_s * view.graphics_mhz / top
        need = top * view.remaining_iterations * t_top / np.where(slack > 0, slack, np.nan)
        need = np.where(np.isfinite(need) & (need <= top), need, top)
        need = np.maximum(need, STATIC_MIN_CLOCK_FRACTION * top)
        clock = np.where(pick, self.levels.ceil_mhz(view.job_type, need), clock)
        self.clock_mhz = clock
        return Setpoints(graphics_mhz=clock, limit_w=uniform_limit_w(view))


# --- policies that learn ----------------------------------------------------------------------


class Cdgpc(Policy):
    """The head's controller on the simulator's view: only turns the view into its inputs.

    ``cdgpc`` is `EconomicMPC` with the shipped configuration's settings
    (`slurm_cdgpc.control.tuning.shipped`); ``cdgpc-paper`` the same controller with the
    paper's (`slurm_cdgpc.control.tuning.paper`): the linear power family and the
    deadline-aware weights w = R / max(D − t, Δt) alone. With power domains (the fleet's
    topology) each step also gets every domain's limit, its jobs' shares and its idle GPUs'
    power (`Topology.limits`), as the head builds them. Serving jobs reach it as the head
    sees them: their objective (`JobState.objective_s`) and their measured latency as their
    iteration time."""

    def __init__(
        self,
        name: str = "cdgpc",
        tuning: Callable[[float], Tuning] = shipped,
        power_limit_margin: float = ControlConfig().power_limit_margin,
    ) -> None:
        self.name = name
        self.tuning = tuning
        #: the guard rail (`control.power_limit_margin`): per-GPU limits under the plan, as
        #: the head sends them (0: off)
        self.power_limit_margin = power_limit_margin

    def start(self, fleet: FleetSpec, budget_w: float, interval_s: float) -> None:
        self.specs = fleet.specs
        tuning = self.tuning(interval_s)
        # every supported clock, as cdgpcd builds it: the controller applies its own floor
        grid = ClockGrid.from_tables([(s.name, s.clocks) for s in fleet.specs], min_fraction=0.0)
        self.controller = EconomicMPC(grid, tuning.controller)
        self.estimator = JobEstimator(tuning.estimator)
        self.planned_w = np.zeros(0)
        #: per row, the power limit a GPU in MIG mode was held at by the last setpoints
        self.lever_w = np.zeros(0)
        #: per row, its co-tenants in the last view and their number (`_measured_cotenants`)
        self._cotenants = np.zeros(0, dtype=np.int64)
        self._cotenant_count = np.zeros(0, dtype=np.int64)
        self.last: Decision | None = None  # the plan in force over the interval each view shows
        self.time_limit_s = np.zeros(0)
        self.topology: Topology | None = fleet.topology
        self.node_names = fleet.node_names
        self.time_errors = TenantTimeErrors()

    def domains(self, view: ClusterView) -> DomainLimits | None:
        """The controller's power-domain input: each job's GPUs per node, and per node what
        its idle GPUs draw (the per-node terms of ``view.idle_power_w``)."""
        if self.topology is None:
            return None
        names = self.node_names
        job_gpus: list[dict[str, int]] = [{} for _ in range(len(view))]
        rows, nodes = np.nonzero(view.job_nodes)
        for row, node, count in zip(
            rows.tolist(), nodes.tolist(), view.job_nodes[rows, nodes].tolist(), strict=True
        ):
            job_gpus[row][names[node]] = count
        idle_w = (view.node_gpus - view.node_busy_gpus()) * np.array(
            [s.idle_power_w for s in self.specs]
        )[view.node_type]
        uncontrolled = {names[i]: w for i, w in enumerate(idle_w.tolist()) if w > 0}
        return self.topology.limits(job_gpus, uncontrolled)

    def _score_time_model(self, view: ClusterView) -> None:
        """What the time models predicted for the interval the view reports, against what the
        jobs measured (`TenantTimeErrors`: a replay's figure, no input to any decision), on
        traces whose jobs share GPUs."""
        if view.shared_gpu is None:
            return
        # the jobs still running from the last view, first in it, in the estimator's rows
        rows = np.arange(len(self.estimator))
        self.time_errors.score(self.estimator, view, rows, self.controller.interference)

    def _kinds(self, view: ClusterView, new: slice) -> list[str | None] | None:
        """The new jobs' kinds for the kind prior, as the head keys them (`job_kind`): the
        trace's model name stands for Slurm's job name, with no user (Philly's users are
        virtual clusters, not the jobs' authors); none for a job without a name, a serving
        job or a shared GPU's tenant (`RunningJobs.add`)."""
        if view.job_name is None:
            return None
        shared = (
            np.zeros(len(view), dtype=bool) if view.shared_gpu is None else view.shared_gpu >= 0
        )
        alone = (view.job_id >= 0) & ~shared & (view.job_name != "")
        return [
            job_kind("", str(name), self.specs[t].name) if ok else None
            for name, t, ok in zip(
                view.job_name[new].tolist(),
                view.job_type[new].tolist(),
                alone[new].tolist(),
                strict=True,
            )
        ]

    def _measured_cotenants(self, view: ClusterView) -> tuple[IntArray, IntArray] | None:
        """Per row, the co-tenants it had over the interval the view reports (those of the
        last view: a job that ended within the interval was there for part of it; -1 for a
        job that just started), as the head keys its samples (`cotenant_key`), and how many
        they were; None on a trace whose jobs never share."""
        if view.shared_gpu is None:
            return None
        unknown = np.full(view.started, -1, dtype=np.int64)
        before = np.concatenate([self._cotenants[view.kept], unknown])
        count = np.concatenate([self._cotenant_count[view.kept], unknown])
        mates = co_tenants(view.job_id, view.shared_gpu)
        self._cotenants = np.array([cotenant_key(map(str, m)) for m in mates], dtype=np.int64)
        self._cotenant_count = np.array([len(m) for m in mates], dtype=np.int64)
        return before, count

    @staticmethod
    def tenancy(view: ClusterView) -> Tenancy | None:
        """The jobs that share GPUs, as the head finds them: from each job's GPUs."""
        if view.shared_gpu is None or not np.any(view.shared_gpu >= 0):
            return None
        shared, gpus = view.shared_gpu.tolist(), view.job_gpus.tolist()
        return Tenancy.of_gpus(
            [
                [("shared", g)] if g >= 0 else [(n, k) for k in range(gpus[n])]
                for n, g in enumerate(shared)
            ]
        )

    def ramp(self, with_domains: bool) -> Ramp | None:
        """The ramp rule's input, as the head builds it (`Coordinator._ramp`): the cluster's
        rate and each domain's. The controller ramps from the plan it put in force; its first
        plan is free here (the head's starts from the nodes' readings), and a replay schedules
        no budget ahead. None when no rate is set."""
        rates = [self.controller.settings.ramp_w_per_s]
        if with_domains and self.topology is not None:
            rates.extend(self.topology.ramps_w_per_s.tolist())
        rate = np.array(rates)
        if not np.isfinite(rate).any():
            return None
        return Ramp(rate, np.full(rate.size, np.nan))

    def cluster_draw(self, view: ClusterView) -> ClusterDraw | None:
        """What every GPU drew over the interval the view shows (its nodes' mean power), against
        the plan in force over it (`Overdraw`)."""
        if self.last is None or not view.node_power_w.size:
            return None
        return ClusterDraw(float(view.node_power_w.sum()), self.last.expected_w, self.last.budget_w)

    def decide(self, view: ClusterView) -> Setpoints:
        ended = ~view.kept
        if ended.any():  # as the head does when Slurm ends a job
            self.controller.jobs_ended(self.estimator.work_top_s[ended], self.time_limit_s[ended])
        self.time_limit_s = view.time_limit_s
        self.estimator.keep(view.kept)
        self._score_time_model(view)
        new = slice(len(view) - view.started, None)
        if view.started:
            self.estimator.add_jobs(
                JobStatics.of(self.specs, view.job_type[new], view.job_gpus[new]),
                kinds=self._kinds(view, new),
            )
        planned = np.concatenate([self.planned_w[view.kept], np.full(view.started, np.nan)])
        lever_w = np.concatenate([self.lever_w[view.kept], np.full(view.started, np.nan)])
        # as the head reads a MIG GPU: the limit is its own lever, not another limiter, and
        # teaches the lever's gain where it held the clock (`NodeBook.samples`)
        capped = view.power_capped & (not view.mig)
        cotenants = self._measured_cotenants(view)
        measured = Measurements(
            view.graphics_mhz,
            view.memory_mhz,
            view.power_w,
            view.iteration_s,
            planned,
            capped,
            cluster=self.cluster_draw(view),
            cotenants=None if cotenants is None else cotenants[0],
            cotenant_count=None if cotenants is None else cotenants[1],
            lever_limit_w=np.where(view.power_capped, lever_w, np.nan) if view.mig else None,
        )
        tenancy = self.tenancy(view)
        jobs = JobState(
            view.job_type,
            view.remaining_iterations,
            view.deadline_s,
            time_limit_s=view.time_limit_s,
            start_s=view.start_s,
            tenancy=tenancy,
            objective_s=view.objective_s,
        )
        free_gpus = np.rint(view.node_gpus - view.node_busy_gpus()).astype(np.int64)
        queue = QueueState.from_matrix(view.queued_jobs > 0, view.job_nodes, free_gpus)
        domains = self.domains(view)
        d = self.controller.step(
            self.estimator,
            jobs,
            view.now_s,
            view.budget_w,
            view.idle_power_w,
            measured,
            queue,
            domains=domains,
            ramp=self.ramp(domains is not None),
        )
        self.planned_w = d.planned_power_w
        self.last = d
        # as the head's setpoints: a shared GPU is planned at its group's power, and keeps
        # its default limit if any tenant serves
        gpu_w = d.job_power_w / view.job_gpus
        free = None if d.serving is None else d.serving.serving
        held = d.held
        gain, counted, unmodelled = lever_state(self.estimator, tenancy)
        if tenancy is not None:
            gpu_w = tenancy.gpu_power_w(d.job_power_w)
            free = None if free is None else tenancy.any_tenant(free)
            held = None if held is None else tenancy.any_tenant(held)
        # in MIG mode a GPU's limit is its setpoint (`RunningJobs.setpoints`, the head's)
        top = d.graphics_mhz >= np.array([s.max_graphics_mhz for s in self.specs])[view.job_type]
        default_w = np.array([s.power_limit.default_w for s in self.specs])[view.job_type]
        limits = power_limits_w(
            gpu_w,
            np.ones(len(view)),
            self.power_limit_margin,
            np.array([s.power_limit.min_w for s in self.specs])[view.job_type],
            default_w,
            free,
            held,
            np.full(len(view), view.mig),
            top,
            gain,
            counted,
            unmodelled,
        )
        # what a lever GPU is held at, for the next measurements (`limit_gain`)
        self.lever_w = np.full(len(view), np.nan)
        if view.mig and limits is not None:
            self.lever_w = np.where(limits < default_w - 1e-6, limits, np.nan)
        return Setpoints(
            graphics_mhz=d.graphics_mhz.astype(np.float64),
            memory_mhz=d.memory_mhz.astype(np.float64),
            limit_w=limits,
        )


class CdgpcServingTop(Cdgpc):
    """``cdgpc-serving-top``, the baseline for serving jobs: they run at their top clock and
    default power limit outside the controller, as on a site that does not register them with
    cdgpcd, and their GPUs' measured power is uncontrolled power to the controller, which runs
    the training jobs in what is left (an unmeasured serving GPU counts at its power limit, as
    the controller counts an unmeasured job). Without serving jobs it is ``cdgpc``. Not with
    power domains: a domain's uncontrolled power would need the serving GPUs' per node."""

    def start(self, fleet: FleetSpec, budget_w: float, interval_s: float) -> None:
        super().start(fleet, budget_w, interval_s)
        self.serving = np.zeros(0, dtype=bool)  # over the previous view's rows

    def decide(self, view: ClusterView) -> Setpoints:
        if view.objective_s is None:
            return super().decide(view)
        if self.topology is not None:
            raise InputError(f"{self.name} does not run with power domains")
        serving = np.isfinite(view.objective_s)
        train = ~serving
        kept = view.kept[~self.serving]
        started = int(train[len(view) - view.started :].sum())
        self.serving = serving
        limit_w = np.array([s.power_limit.default_w for s in self.specs])[view.job_type]
        drawn_w = view.job_gpus * np.where(np.isfinite(view.power_w), view.power_w, limit_w)
        sp = super().decide(
            view.rows(
                train,
                kept,
                started,
                objective_s=None,
                idle_power_w=view.idle_power_w + float(drawn_w[serving].sum()),
            )
        )

        def top(values: FloatArray | None) -> FloatArray | None:
            if values is None:
                return None
            out = np.full(len(view), np.nan)
            out[train] = values
            return out

        return Setpoints(top(sp.graphics_mhz), top(sp.memory_mhz), top(sp.limit_w))


class UniformClock(Policy):
    """``uniform-clock``: one clock fraction for every job, the highest whose predicted power
    fits the budget. Power is predicted by the same online estimator as cdgpc (bent family, RLS
    on measurements), corrected by the measured relative miss of the last plans; unmeasured jobs
    count at their power limit. Clocks are floored to each type's supported levels."""

    name = "uniform-clock"

    def start(self, fleet: FleetSpec, budget_w: float, interval_s: float) -> None:
        self.specs = fleet.specs
        self.levels = _Levels(fleet.specs)
        self.estimator = JobEstimator(EstimatorSettings(family="bent", kind_prior=False))
        self.planned_w = np.zeros(0)
        self.offset = 0.0  # δ: relative miss of recent plans

    def decide(self, view: ClusterView) -> Setpoints:
        est = self.estimator
        est.keep(view.kept)
        new = slice(len(view) - view.started, None)
        if view.started:
            est.add_jobs(JobStatics.of(self.specs, view.job_type[new], view.job_gpus[new]))
        planned = np.concatenate([self.planned_w[view.kept], np.full(view.started, np.nan)])
        x_a, xm_a = est.normalise(view.graphics_mhz, view.memory_mhz)
        settled = est.power.count >= 3
        held = view.gpus_held  # a shared GPU's reading once
        drawn = held * view.power_w
        ok = settled & np.isfinite(drawn) & np.isfinite(planned) & ~view.power_capped
        if ok.any() and planned[ok].sum() > 0:
            miss = float(drawn[ok].sum() / planned[ok].sum()) - 1.0
            self.offset = (1 - OFFSET_GAIN) * self.offset + OFFSET_GAIN * miss
        est.observe(x_a, xm_a, view.power_w, view.iteration_s, power_capped=view.power_capped)
        # candidates (H, N): every job at the same fraction, floored to its type's levels
        top = self.levels.top[view.job_type]
        clocks = self.levels.floor_mhz(view.job_type, UNIFORM_CLOCK_FRACTIONS[:, None] * top)
        x = clocks / est.statics.graphics_max_mhz
        per_gpu = est.predict_power_w(x, np.ones_like(x))
        # unmeasured jobs: at their power limit, whatever the clock
        per_gpu = np.where(est.power.count > 0, per_gpu, est.statics.power_limit_w)
        job_w = held * per_gpu
        total = job_w.sum(axis=1) * (1.0 + self.offset)
        room = view.budget_w * (1.0 - GUARD_BAND) - view.idle_power_w
        fits = np.flatnonzero(total <= room)
        h = int(fits[0]) if fits.size else len(UNIFORM_CLOCK_FRACTIONS) - 1
        self.planned_w = np.where(settled, job_w[h], np.nan)
        return Setpoints(graphics_mhz=clocks[h])


class Oracle(PlantPolicy):
    """``oracle``: the true plant, centralised. Per job the true power and time on a grid of
    `ORACLE_CLOCK_LEVELS` clocks, one price λ found by bisection so that each job's argmin of
    w·T + λ·g·P fits the budget. Weights as cdgpc's (with triage), from the true time at top
    clocks; clocks from ``min_clock_fraction`` of max, lower only when that does not fit. An
    upper bound on what a controller can know, not on deadline outcomes (DESIGN.md, "Known
    gaps")."""

    name = "oracle"

    def __init__(self, triage: bool = True, min_clock_fraction: float = 0.6) -> None:
        self.triage = triage
        self.min_clock_fraction = min_clock_fraction

    def start(self, fleet: FleetSpec, budget_w: float, interval_s: float) -> None:
        self.levels = _Levels(fleet.specs)

    def decide_with_plant(self, view: ClusterView, plant: Plant) -> Setpoints:
        n = len(view)
        room = view.budget_w * (1.0 - GUARD_BAND) - view.idle_power_w
        time_s, job_w, clocks = self._table(view, plant, self.min_clock_fraction)
        if job_w[-1].sum() > room:  # the floor does not fit: give way down to the lowest clock
            time_s, job_w, clocks = self._table(view, plant, 0.0)
        t_top = time_s[0]
        slack = view.deadline_s - view.now_s
        has = np.isfinite(view.deadline_s)
        # w = R / max(D − t, Δt); triage: hopeless (R·T_top > D − t) and no-deadline jobs 0.5/T_top
        w = view.remaining_iterations / np.maximum(slack, view.interval_s)
        hopeless = has & (view.remaining_iterations * t_top > slack)
        low = ~has | (hopeless if self.triage else np.zeros(n, dtype=bool))
        w = np.where(low, 0.5 / t_top, np.minimum(w, 1e3 / t_top))

        def choice(price: float) -> IntArray:
            return np.argmin(w * time_s + price * job_w, axis=0)  # type: ignore[no-any-return]

        cols = np.arange(n)
        if job_w[0].sum() <= room:
            pick = np.zeros(n, dtype=np.int64)
        else:
            lo, hi = 0.0, 1.0
            while job_w[choice(hi), cols].sum() > room and hi < 1e12:
                hi *= 4.0
            for _ in range(40):
                mid = 0.5 * (lo + hi)
                if job_w[choice(mid), cols].sum() > room:
                    lo = mid
                else:
                    hi = mid
            pick = choice(hi)
        return Setpoints(graphics_mhz=clocks[pick, cols])

    def _table(
        self, view: ClusterView, plant: Plant, floor: float
    ) -> tuple[FloatArray, FloatArray, FloatArray]:
        """True time and job power (L, N) on L clocks from top down to ``floor`` × top."""
        n = len(view)
        top = self.levels.top[view.job_type]
        frac = np.linspace(1.0, floor, ORACLE_CLOCK_LEVELS)
        clocks = self.levels.floor_mhz(view.job_type, frac[:, None] * top)  # (L, N)
        big = Plant(
            plant.specs,
            np.tile(plant.spec_index, ORACLE_CLOCK_LEVELS),
            WorkloadArrays(
                *(np.tile(getattr(plant.workloads, f), ORACLE_CLOCK_LEVELS) for f in _WL)
            ),
        )
        truth = big.step(clocks.reshape(-1))
        time_s = truth.iteration_time_s.reshape(ORACLE_CLOCK_LEVELS, n)
        job_w = view.job_gpus * truth.power_w.reshape(ORACLE_CLOCK_LEVELS, n)
        return time_s, job_w, clocks


_WL = tuple(WorkloadArrays.__dataclass_fields__)

_FACTORIES: Final[dict[str, Callable[[], Policy]]] = {
    "cdgpc": lambda: Cdgpc("cdgpc", shipped),
    "cdgpc-paper": lambda: Cdgpc("cdgpc-paper", paper),
    "cdgpc-serving-top": lambda: CdgpcServingTop("cdgpc-serving-top", shipped),
    "max-clock": MaxClock,
    "uniform-power-cap": UniformPowerCap,
    "uniform-domain-cap": UniformDomainCap,
    "uniform-clock": UniformClock,
    "ear-greedy": EarGreedy,
    "static-gpu-freq": StaticGpuFreq,
    "oracle": Oracle,
}
POLICIES: Final = tuple(_FACTORIES)
#: policies allowed to read the plant's true parameters
READS_PLANT: Final = ("max-clock", "oracle")


def make_policy(name: str, control: ControlConfig | None = None) -> Policy:
    """A fresh policy called ``name`` (one of `POLICIES`); ``control``: the ``[control]``
    section ``cdgpc`` and ``cdgpc-serving-top`` run with, as cdgpcd would (None: the shipped
    one)."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise InputError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})") from None
    if name in ("cdgpc", "cdgpc-serving-top") and control is not None:
        kind = Cdgpc if name == "cdgpc" else CdgpcServingTop
        return kind(
            name,
            lambda interval_s: Tuning.from_config(control).with_interval(interval_s),
            control.power_limit_margin,
        )
    return factory()
