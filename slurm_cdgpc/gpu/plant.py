"""The ground truth of simulated GPUs (`Plant`): power and iteration time of N jobs, vectorised.

Deliberately not the controller's model family. Reaches only `gpu/`, `wire/`, `errors` and
`units` of the package (`tests/unit/test_import_graph.py`). Calibration: DESIGN.md, "Simulator"
(Plant), recomputed from the data by `calibration_report`; tests: `tests/unit/test_gpu_plant.py`.
"""

from __future__ import annotations

import csv
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Final

import numpy as np
import numpy.typing as npt

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.gpu.catalog import GpuSpec, catalog_spec

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

#: Share of the busy-floor power drawn while the GPU waits between kernels [inferred].
WAIT_FLOOR_SHARE: Final = 0.5
#: Busy-floor share that does not scale with the memory clock on GDDR parts [inferred].
MEMORY_FIXED_SHARE: Final = 0.4
#: The GPU type whose times `WorkloadProfile.reference` gives.
REFERENCE_GPU: Final = "A100-SXM4-80GB"


@dataclass(frozen=True)
class HardwareCalibration:
    """The electrical and speed constants of one GPU type (beyond its `GpuSpec`)."""

    busy_floor_w: float  # B: power above idle while kernels run, independent of the SM clock
    dynamic_w: float  # D: core dynamic power at max clock for activity 1
    voltage_rise: float  # r: V(f_max)/V(knee) − 1
    cap_target: float  # busy power the firmware holds under a binding limit, as a share of it
    relative_time: float  # iteration-time multiplier against REFERENCE_GPU
    source: str = field(default="inferred", compare=False)


#: One least-squares fit per GPU (scipy ``least_squares`` on relative errors, the knee fixed at
#: the catalog value): the A100 and A40 to every stage/instruction/clock of the Perseus BLOOM
#: stage profiles, the V100 to the three highest-power series of each network in the Zeus V100
#: power-limit sweep. Every other type takes `hardware_calibration`'s [inferred] rule, and a
#: workload keeps its reference calibration (p included) and scales its time by `relative_time`.
_FITTED_HARDWARE: Final[Mapping[str, HardwareCalibration]] = MappingProxyType(
    {
        # Perseus A100 stage profiles, 608 points; cap target 0.97 [inferred] at the 500 W board.
        "A100-SXM4-80GB": HardwareCalibration(0.0, 467.0, 0.2602, 0.97, 1.0, "fitted: Perseus"),
        # Perseus A40 stage profiles, 960 points; 0.98 = the 293–296 W plateau under 300 W.
        # relative_time: BLOOM stages take 2.4–2.7 × as long as on the A100 [measured].
        "A40": HardwareCalibration(65.91, 279.5, 0.2548, 0.98, 2.5, "fitted: Perseus"),
        # Zeus V100 sweep (15 series, p = 4); relative_time [inferred from FP16 tensor throughput].
        "V100-PCIE-32GB": HardwareCalibration(0.0, 262.6, 0.1777, 1.0, 2.5, "fitted: Zeus"),
    }
)

# Iteration-time multipliers of the other types [inferred: dense BF16/FP16 tensor throughput
# against the A100, discounted for the parts of an iteration that do not scale].
# The later boards: ≈ 0.25 + 0.75 × (A100's 312 TFLOPS / theirs), rounded, memory-bound ones up.
_RELATIVE_TIME: Final[Mapping[str, float]] = MappingProxyType(
    {
        "V100-SXM2": 2.2,
        "A100-PCIE-40GB": 1.15,
        "H100-SXM": 0.5,
        "H100-NVL": 0.6,
        "H200": 0.45,
        "A100-SXM4-40GB": 1.05,
        "H100-PCIE": 0.6,
        "B200": 0.35,
        "L40S": 1.0,
        "L4": 2.5,
        "A10": 2.2,
        "A10G": 2.5,
        "T4": 4.0,
    }
)


def hardware_calibration(spec: GpuSpec) -> HardwareCalibration:
    """Fitted constants for `spec`'s type, else the [inferred] rule from its TDP and idle power."""
    fitted = _FITTED_HARDWARE.get(spec.name)
    if fitted is not None:
        return fitted
    busy_floor_w = 0.05 * spec.tdp_w
    return HardwareCalibration(
        busy_floor_w=busy_floor_w,
        dynamic_w=1.15 * spec.tdp_w - spec.idle_power_w - busy_floor_w,
        voltage_rise=0.25,
        cap_target=0.97,
        relative_time=_RELATIVE_TIME.get(spec.name, 1.0),
    )


@dataclass(frozen=True)
class WorkloadCalibration:
    """How one workload runs on one GPU type (uncapped, at max clocks)."""

    iteration_time_s: float  # T at max graphics and memory clock
    activity: float  # u: dynamic power relative to the heaviest calibrated job on the type
    memory_ratio: float  # t_m / t_c at max clocks: ≥ 1 means the clock barely matters there
    other_fraction: float  # t_o / T: share of the iteration with the GPU waiting
    saturation_p: float = 4.0  # p of the compute/memory soft maximum (p = 1: the controller's)

    def __post_init__(self) -> None:
        if not (self.iteration_time_s > 0 and math.isfinite(self.iteration_time_s)):
            raise InputError(f"iteration time must be positive, got {self.iteration_time_s}")
        if not 0 <= self.activity <= 3:
            raise InputError(f"activity must be in [0, 3], got {self.activity}")
        if not 0 <= self.memory_ratio <= 10:
            raise InputError(f"memory ratio must be in [0, 10], got {self.memory_ratio}")
        if not 0 <= self.other_fraction < 1:
            raise InputError(f"other fraction must be in [0, 1), got {self.other_fraction}")
        if not 1 <= self.saturation_p <= 50:
            raise InputError(f"saturation p must be in [1, 50], got {self.saturation_p}")


@dataclass(frozen=True)
class WorkloadProfile:
    """A job type: its calibration on the reference GPU and, where fitted, on other types."""

    name: str
    reference: WorkloadCalibration  # on REFERENCE_GPU
    calibrations: Mapping[str, WorkloadCalibration] = field(default_factory=dict, hash=False)
    source: str = "inferred"

    def on(self, spec: GpuSpec) -> WorkloadCalibration:
        """The fitted calibration for `spec`, else the reference one with the time rescaled."""
        fitted = self.calibrations.get(spec.name)
        if fitted is not None:
            return fitted
        ref = self.reference
        scale = hardware_calibration(spec).relative_time
        scale /= hardware_calibration(catalog_spec(REFERENCE_GPU)).relative_time
        return replace(ref, iteration_time_s=ref.iteration_time_s * scale)


def _zeus_profile(
    name: str, v100: tuple[float, ...], a40: tuple[float, ...], iterations_per_epoch: int
) -> WorkloadProfile:
    """A profile from (activity, memory ratio, other fraction, epoch time) fits on V100 and A40."""

    def cal(fit: tuple[float, ...]) -> WorkloadCalibration:
        u, rho, other, epoch_s = fit
        return WorkloadCalibration(epoch_s / iterations_per_epoch, u, rho, other)

    on_v100, on_a40 = cal(v100), cal(a40)
    v100_time = _FITTED_HARDWARE["V100-PCIE-32GB"].relative_time
    return WorkloadProfile(
        name=name,
        # On HBM datacenter parts the V100 fit is the better guide (similar FLOP/byte balance).
        reference=replace(on_v100, iteration_time_s=on_v100.iteration_time_s / v100_time),
        calibrations=MappingProxyType({"V100-PCIE-32GB": on_v100, "A40": on_a40}),
        source="fitted: Zeus power-limit sweeps (V100, A40)",
    )


def _perseus_profile(name: str, a100: tuple[float, ...], a40: tuple[float, ...]) -> WorkloadProfile:
    """A BLOOM-176B stage from (activity, memory ratio, other fraction, time) fits.

    The A100's flat top (1365–1410 MHz) needs a sharp saturation, p = 12 (fitted: 11.8); on the
    A40 p is not identifiable (its top is power-capped; 1.5–10 within 0.3 points) and p = 4.
    """
    on_a100 = WorkloadCalibration(a100[3], a100[0], a100[1], a100[2], saturation_p=12.0)
    on_a40 = WorkloadCalibration(a40[3], a40[0], a40[1], a40[2])
    return WorkloadProfile(
        name=name,
        reference=on_a100,
        calibrations=MappingProxyType({"A100-SXM4-80GB": on_a100, "A40": on_a40}),
        source="fitted: Perseus BLOOM stage profiles (A100, A40)",
    )


def _like(
    name: str, base: WorkloadProfile, time_x: float, activity: float, rho: float, other: float
) -> WorkloadProfile:
    """An [inferred] profile by analogy: `base`'s reference time × time_x, the rest given."""
    return WorkloadProfile(
        name=name,
        reference=WorkloadCalibration(
            base.reference.iteration_time_s * time_x, activity, rho, other
        ),
        source=f"inferred: by analogy with {base.name}",
    )


# Zeus fits: (activity, memory ratio, other fraction, seconds per epoch) on (V100-PCIE, A40) at
# the series dataset/network/batch/optimizer below; iterations per epoch = training-set size /
# batch size [inferred: ImageNet-1k 1,281,167; SQuAD v1.1 ≈ 88,500 features; LibriSpeech 960 h
# 281,241 utterances; CIFAR-100 50,000; MovieLens-1M 994,169 training ratings].
_ZEUS_SERIES: Final[Mapping[str, tuple[str, str, str, str]]] = MappingProxyType(
    {
        "resnet50": ("imagenet", "resnet50", "256", "adadelta"),
        "bert": ("squad", "bert_base_uncased", "32", "adamw"),
        "deepspeech2": ("librispeech", "deepspeech2", "192", "adamw"),
        "shufflenetv2": ("cifar100", "shufflenetv2", "1024", "adadelta"),
        "ncf": ("movielens-1m", "ncf", "1024", "adam"),
    }
)
_RESNET50 = _zeus_profile(
    "resnet50", (0.7926, 0.7554, 0.0796, 3475.3), (1.3976, 2.5936, 0.1765, 3763.7), 5005
)
_BERT = _zeus_profile("bert", (1.0, 1.036, 0.0643, 1664.7), (0.9838, 1.8563, 0.0844, 910.4), 2767)
_DEEPSPEECH2 = _zeus_profile(
    "deepspeech2", (0.585, 0.7717, 0.2073, 6290.3), (1.1969, 2.1001, 0.4437, 9479.8), 1465
)
_SHUFFLENETV2 = _zeus_profile(
    "shufflenetv2", (0.7802, 1.2097, 0.2342, 7.693), (0.8819, 2.1908, 0.2015, 8.503), 49
)
_NCF = _zeus_profile("ncf", (0.1064, 2.9995, 0.7251, 19.55), (0.0334, 1.3523, 0.3722, 20.20), 971)
# Perseus fits: (activity, memory ratio, other fraction, seconds per instruction) on (A100, A40).
_BLOOM_BWD = _perseus_profile(
    "bloom-bwd", (0.9948, 1.0087, 0.0596, 0.09745), (0.9883, 1.3353, 0.0058, 0.23873)
)
_BLOOM_FWD = _perseus_profile(
    "bloom-fwd", (0.9274, 0.9776, 0.0254, 0.05057), (0.9800, 1.7591, 0.0, 0.13575)
)
_BLOOM_LAST_BWD = _perseus_profile(
    "bloom-last-bwd", (1.0, 1.0005, 0.0553, 0.08753), (0.9948, 1.3713, 0.0062, 0.21903)
)
_BLOOM_LAST_FWD = _perseus_profile(
    "bloom-last-fwd", (0.9489, 0.9764, 0.0236, 0.04439), (1.0, 1.6736, 0.0, 0.11832)
)

PROFILES: Final[Mapping[str, WorkloadProfile]] = MappingProxyType(
    {
        p.name: p
        for p in (
            _RESNET50,
            _BERT,
            _DEEPSPEECH2,
            _SHUFFLENETV2,
            _NCF,
            _BLOOM_BWD,
            _BLOOM_FWD,
            _BLOOM_LAST_BWD,
            _BLOOM_LAST_FWD,
            # [inferred] names used by the ElasticFlow and Chronus traces
            _like("vgg16", _RESNET50, 2.5, 0.95, 0.6, 0.05),  # ≈ 4 × the FLOPs, denser GEMMs
            _like("resnet101", _RESNET50, 1.9, 0.8, 0.7, 0.06),
            _like("inception3", _RESNET50, 1.4, 0.75, 0.8, 0.08),
            _like("alexnet", _SHUFFLENETV2, 2.0, 0.5, 1.2, 0.4),  # input-pipeline bound
            _like("mobilenet_v2", _SHUFFLENETV2, 1.5, 0.6, 1.4, 0.25),
            _like("gpt2", _BERT, 3.0, 0.95, 0.9, 0.05),  # a larger transformer
        )
    }
)
"""Every named workload; `workload_profile` also accepts the aliases traces use."""

_PROFILE_ALIASES: Final[Mapping[str, str]] = MappingProxyType(
    {"bertbaseuncased": "bert", "inceptionv3": "inception3", "shufflenet": "shufflenetv2"}
)


def _profile_key(name: str) -> str:
    """'BERT_base_uncased' → 'bertbaseuncased': case and separators do not matter."""
    return "".join(ch for ch in name.lower() if ch.isalnum())


_PROFILES_BY_KEY: Final[Mapping[str, WorkloadProfile]] = MappingProxyType(
    {_profile_key(name): p for name, p in PROFILES.items()}
    | {alias: PROFILES[target] for alias, target in _PROFILE_ALIASES.items()}
)


def workload_profile(name: str) -> WorkloadProfile:
    """The named workload (resnet50, bert_base_uncased, inception_v3, bloom-bwd, …)."""
    try:
        return _PROFILES_BY_KEY[_profile_key(name)]
    except KeyError:
        raise InputError(f"unknown workload {name!r} (known: {', '.join(PROFILES)})") from None


@dataclass(frozen=True)
class WorkloadArrays:
    """Per-job workload parameters for a `Plant`, arrays of shape (N,)."""

    iteration_time_s: FloatArray
    activity: FloatArray
    memory_ratio: FloatArray
    other_fraction: FloatArray
    saturation_p: FloatArray

    def __len__(self) -> int:
        return int(self.iteration_time_s.shape[0])

    @classmethod
    def of(cls, calibrations: Sequence[WorkloadCalibration]) -> WorkloadArrays:
        columns = np.array([astuple(c) for c in calibrations], dtype=np.float64).reshape(
            -1, len(fields(WorkloadCalibration))
        )
        return cls(*(np.ascontiguousarray(column) for column in columns.T))

    def calibration(self, i: int) -> WorkloadCalibration:
        return WorkloadCalibration(*(float(getattr(self, f.name)[i]) for f in fields(self)))


def draw_workloads(
    n: int,
    spec: GpuSpec,
    rng: np.random.Generator,
    model_names: Sequence[str] | None = None,
    *,
    jitter: float = 0.05,
    iteration_time_s: npt.ArrayLike | None = None,
) -> WorkloadArrays:
    """Seeded workloads for ``n`` jobs on `spec`'s GPU type.

    Named jobs take their profile (`workload_profile`); an unknown name is given a random known
    profile, the same for every job with that name; without names every job draws a profile.
    Each job then gets multiplicative log-normal jitter (σ = ``jitter``) on every parameter, so
    two ResNet-50 jobs are alike but not identical. ``iteration_time_s`` (scalar or (n,)), where
    given, replaces the drawn times (a trace knows duration / iterations).
    """
    if n < 0:
        raise InputError(f"cannot draw {n} workloads")
    if model_names is not None and len(model_names) != n:
        raise InputError(f"{len(model_names)} model names for {n} jobs")
    names = list(PROFILES)
    if model_names is None:
        picks = rng.integers(len(names), size=n)
    else:
        # one look-up per distinct name; an unknown name draws its stand-in once
        distinct, inverse = np.unique(np.asarray(model_names, dtype=str), return_inverse=True)
        position = {name: k for k, name in enumerate(names)}
        choice = np.empty(len(distinct), dtype=np.intp)
        for k, name in enumerate(distinct):
            profile = _PROFILES_BY_KEY.get(_profile_key(str(name)))
            if profile is None:
                choice[k] = rng.integers(len(names))
                logger.debug("unknown workload %r simulated as %s", name, names[choice[k]])
            else:
                choice[k] = position[profile.name]
        picks = choice[inverse.reshape(-1)]
    table = WorkloadArrays.of([PROFILES[name].on(spec) for name in names])
    base = WorkloadArrays(
        table.iteration_time_s[picks],
        table.activity[picks],
        table.memory_ratio[picks],
        table.other_fraction[picks],
        table.saturation_p[picks],
    )
    noise = np.exp(jitter * rng.standard_normal((4, n)))
    times = base.iteration_time_s * noise[0]
    if iteration_time_s is not None:
        times = np.broadcast_to(np.asarray(iteration_time_s, dtype=np.float64), (n,)).copy()
        if not np.all(times > 0):
            raise InputError("iteration times must be positive")
    return WorkloadArrays(
        iteration_time_s=times,
        activity=np.clip(base.activity * noise[1], 0.0, 3.0),
        memory_ratio=np.clip(base.memory_ratio * noise[2], 0.0, 10.0),
        other_fraction=np.clip(base.other_fraction * noise[3], 0.0, 0.95),
        saturation_p=base.saturation_p,
    )


@dataclass(frozen=True)
class NoiseModel:
    """Relative standard deviations of the measurement noise (1 % power, 1.5 % time)."""

    power_rel: float = 0.01
    time_rel: float = 0.015


@dataclass(frozen=True)
class PlantState:
    """Applied clock, power, iteration time and throttle flag of N jobs, arrays of shape (N,)."""

    applied_mhz: FloatArray
    power_w: FloatArray
    iteration_time_s: FloatArray
    power_capped: BoolArray  # the enforced limit held the clock below the lock (SW_POWER_CAP)


class Plant:
    """True power and speed of N jobs, one GPU each, on GPUs of the given types.

    ``spec_index[i]`` selects job i's GPU type in ``specs``. Clock and limit arguments are scalars
    or arrays of shape (N,); ``memory_mhz=None`` means each GPU's highest memory clock and
    ``limit_w=None`` its default power limit. All methods are pure: the plant has no state.

    Per job, on a GPU type with busy-floor power B, core dynamic power D and voltage rise r:

    * Voltage knee: V is flat at its floor below the knee f_k and rises linearly above it, so
      busy power (`busy_power_w`) is ≈ linear in f below the knee and ≈ cubic near f_max.
    * Saturating iteration time: a compute part t_c and a memory part t_m combine as a p-norm (a
      soft maximum, p per workload and GPU type), so raising the clock stops helping once the
      memory part dominates; t_o is time with the GPU waiting (input pipeline, communication)
      at P_wait = P_idle + B·m(f_m)/2 (`iteration_time_s`, `true_power_w`).
    * Power-limit plateau: the firmware lowers the applied clock to the highest clock whose busy
      power fits the enforced limit (times a per-type target just under it), never below the
      lowest supported clock (`limit_clock_mhz`, `step`): the SW_POWER_CAP throttle.
    * Measurement noise: seeded multiplicative noise on power and time (`observe`).
    """

    def __init__(
        self, specs: Sequence[GpuSpec], spec_index: npt.ArrayLike, workloads: WorkloadArrays
    ) -> None:
        index = np.asarray(spec_index, dtype=np.intp).reshape(-1)
        n = len(workloads)
        if index.shape[0] != n:
            raise InputError(f"{index.shape[0]} spec indices for {n} workloads")
        if n and (index.min() < 0 or index.max() >= len(specs)):
            raise InputError(f"spec index out of range 0..{len(specs) - 1}")
        self.specs = tuple(specs)
        self.spec_index = index
        self.workloads = workloads
        hw = [hardware_calibration(s) for s in self.specs]

        def per_job(values: Sequence[float]) -> FloatArray:
            return np.asarray(values, dtype=np.float64).reshape(-1)[index]

        self.max_graphics_mhz = per_job([s.max_graphics_mhz for s in self.specs])
        self.min_graphics_mhz = per_job([s.min_graphics_mhz for s in self.specs])
        self.knee_mhz = per_job([s.knee_mhz for s in self.specs])
        self.max_memory_mhz = per_job([s.max_memory_mhz for s in self.specs])
        self.idle_power_w = per_job([s.idle_power_w for s in self.specs])
        self.default_limit_w = per_job([s.power_limit.default_w for s in self.specs])
        self.busy_floor_w = per_job([h.busy_floor_w for h in hw])
        self.dynamic_w = per_job([h.dynamic_w for h in hw]) * workloads.activity  # u·D
        self.voltage_rise = per_job([h.voltage_rise for h in hw])
        self.cap_target = per_job([h.cap_target for h in hw])
        self.saturation_p = p = workloads.saturation_p
        # t_b0 = T0·(1 − o) = (t_c^p + t_m^p)^(1/p) with t_m = ρ·t_c
        busy0 = workloads.iteration_time_s * (1.0 - workloads.other_fraction)
        self.t_compute_s = busy0 / (1.0 + workloads.memory_ratio**p) ** (1.0 / p)
        self.t_memory_s = workloads.memory_ratio * self.t_compute_s
        self.t_other_s = workloads.iteration_time_s * workloads.other_fraction

    @classmethod
    def of(cls, spec: GpuSpec, workloads: WorkloadArrays) -> Plant:
        """All jobs on one GPU type."""
        return cls([spec], np.zeros(len(workloads), dtype=np.intp), workloads)

    def __len__(self) -> int:
        return int(self.max_graphics_mhz.shape[0])

    def _vec(self, value: npt.ArrayLike | None, default: FloatArray) -> FloatArray:
        if value is None:
            return default
        array = np.asarray(value, dtype=np.float64)
        try:
            return np.broadcast_to(array, default.shape)
        except ValueError:
            raise InputError(f"got shape {array.shape} for {len(self)} jobs") from None

    def _floor_w(self, memory_mhz: npt.ArrayLike | None) -> FloatArray:
        # B·m(f_m), m = s + (1 − s)·f_m/f_m,max on GDDR parts (m = 1 at the top memory clock)
        share = self._vec(memory_mhz, self.max_memory_mhz) / self.max_memory_mhz
        return self.busy_floor_w * (MEMORY_FIXED_SHARE + (1.0 - MEMORY_FIXED_SHARE) * share)

    def _volt2(self, x: FloatArray) -> FloatArray:
        # ν(x)², ν = (1 + r·clip((x − k)/(1 − k), 0, 1)) / (1 + r), k = f_k / f_max
        k = self.knee_mhz / self.max_graphics_mhz
        nu = (1.0 + self.voltage_rise * np.clip((x - k) / (1.0 - k), 0.0, 1.0)) / (
            1.0 + self.voltage_rise
        )
        return nu * nu

    def busy_power_w(
        self, graphics_mhz: npt.ArrayLike, memory_mhz: npt.ArrayLike | None = None
    ) -> FloatArray:
        """Power while kernels run at the applied clock: P_idle + B·m(f_m) + u·D·x·ν(x)²."""
        x = self._vec(graphics_mhz, self.max_graphics_mhz) / self.max_graphics_mhz
        return self.idle_power_w + self._floor_w(memory_mhz) + self.dynamic_w * x * self._volt2(x)

    def _times(
        self, graphics_mhz: npt.ArrayLike, memory_mhz: npt.ArrayLike | None
    ) -> tuple[FloatArray, FloatArray]:
        # t_b = ((t_c·f_max/f)^p + (t_m·f_m,max/f_m)^p)^(1/p); T = t_b + t_o
        p = self.saturation_p
        f = self._vec(graphics_mhz, self.max_graphics_mhz)
        fm = self._vec(memory_mhz, self.max_memory_mhz)
        busy = (self.t_compute_s * self.max_graphics_mhz / f) ** p + (
            self.t_memory_s * self.max_memory_mhz / fm
        ) ** p
        busy = busy ** (1.0 / p)
        return busy, busy + self.t_other_s

    def iteration_time_s(
        self, graphics_mhz: npt.ArrayLike, memory_mhz: npt.ArrayLike | None = None
    ) -> FloatArray:
        """Seconds per iteration at the applied clocks."""
        return self._times(graphics_mhz, memory_mhz)[1]

    def true_power_w(
        self, graphics_mhz: npt.ArrayLike, memory_mhz: npt.ArrayLike | None = None
    ) -> FloatArray:
        """Iteration-average power at the applied clocks: (t_b·P_busy + t_o·P_wait) / T.

        For input-bound jobs with little activity the busy share grows at low clocks, so their
        nearly flat average power may dip slightly as the clock rises: real, and not in any
        model family."""
        busy, total = self._times(graphics_mhz, memory_mhz)
        wait_w = self.idle_power_w + WAIT_FLOOR_SHARE * self._floor_w(memory_mhz)
        busy_w = self.busy_power_w(graphics_mhz, memory_mhz)
        return (busy * busy_w + self.t_other_s * wait_w) / total

    def limit_clock_mhz(
        self, limit_w: npt.ArrayLike | None = None, memory_mhz: npt.ArrayLike | None = None
    ) -> FloatArray:
        """The highest clock (continuous: the firmware dithers) whose busy power fits the limit.

        Solves P_busy(x) = cap_target·L: linear below the knee, convex and increasing above it, so
        Newton from x = 1 descends monotonically onto the root. Clipped to [f_min, f_max].
        """
        target = self.cap_target * self._vec(limit_w, self.default_limit_w)
        head = target - self.idle_power_w - self._floor_w(memory_mhz)  # what u·D·x·ν² may use
        a = np.maximum(self.dynamic_w, 1e-9)
        k = self.knee_mhz / self.max_graphics_mhz
        r = self.voltage_rise
        x = head * (1.0 + r) ** 2 / a  # below the knee ν = 1/(1 + r)
        above = x > k
        if np.any(above):
            # g(y) = a·y·ν(y)² − head, ν(y) = (1 + r·(y − k)/(1 − k))/(1 + r), y ∈ [k, 1]
            s = r / (1.0 - k)
            y = np.ones_like(x)
            for _ in range(8):
                nu = (1.0 + s * (y - k)) / (1.0 + r)
                g = a * y * nu * nu - head
                dg = a * nu * (nu + 2.0 * y * s / (1.0 + r))
                y = np.where(g > 0, y - g / dg, y)
            x = np.where(above, y, x)
        return (
            np.clip(x, self.min_graphics_mhz / self.max_graphics_mhz, 1.0) * self.max_graphics_mhz
        )

    def applied_clock_mhz(
        self,
        graphics_mhz: npt.ArrayLike,
        memory_mhz: npt.ArrayLike | None = None,
        limit_w: npt.ArrayLike | None = None,
    ) -> FloatArray:
        """The clock a job runs at: min(locked cap, limit clock), never below the lowest clock."""
        return self.step(graphics_mhz, memory_mhz, limit_w).applied_mhz

    def step(
        self,
        graphics_mhz: npt.ArrayLike,
        memory_mhz: npt.ArrayLike | None = None,
        limit_w: npt.ArrayLike | None = None,
    ) -> PlantState:
        """The truth for locked graphics caps ``graphics_mhz`` under the enforced limits."""
        cap = self._vec(graphics_mhz, self.max_graphics_mhz)
        limit_mhz = self.limit_clock_mhz(limit_w, memory_mhz)
        # f_a = clip(min(cap, f_L), f_min, f_max); capped when the limit, not the lock, decides
        applied = np.clip(np.minimum(cap, limit_mhz), self.min_graphics_mhz, self.max_graphics_mhz)
        capped = limit_mhz < np.minimum(cap, self.max_graphics_mhz) - 1e-6
        busy, total = self._times(applied, memory_mhz)
        wait_w = self.idle_power_w + WAIT_FLOOR_SHARE * self._floor_w(memory_mhz)
        power = (busy * self.busy_power_w(applied, memory_mhz) + self.t_other_s * wait_w) / total
        return PlantState(applied, power, total, capped)

    def observe(
        self, state: PlantState, rng: np.random.Generator, noise: NoiseModel | None = None
    ) -> PlantState:
        """`state` as measured: power and time times (1 + σ·N(0, 1)), drawn from ``rng``."""
        noise = NoiseModel() if noise is None else noise
        z = rng.standard_normal((2, len(self)))
        return PlantState(
            applied_mhz=state.applied_mhz,
            power_w=state.power_w * (1.0 + noise.power_rel * z[0]),
            iteration_time_s=state.iteration_time_s * (1.0 + noise.time_rel * z[1]),
            power_capped=state.power_capped,
        )


def windowed_power_w(
    previous_w: npt.ArrayLike,
    current_w: npt.ArrayLike,
    since_change_s: npt.ArrayLike,
    window_s: npt.ArrayLike,
) -> FloatArray:
    """What a GPU that averages power over ``window_s`` reports ``since_change_s`` after a step.

    P_read = P_now once the step is older than the window, else the time-weighted blend
    (since·P_now + (window − since)·P_before) / window. Exact for one change per window.
    Hopper's 1 s averaging of GetPowerUsage is a property of the reading, not of the GPU, so it
    is not in `Plant`: the simulated device averages over its own history, and this gives the
    cluster simulator the same answer.
    """
    window = np.asarray(window_s, dtype=np.float64)
    since = np.asarray(since_change_s, dtype=np.float64)
    share = np.where(window > 0, np.clip(since / np.where(window > 0, window, 1.0), 0.0, 1.0), 1.0)
    result: FloatArray = share * np.asarray(current_w) + (1.0 - share) * np.asarray(previous_w)
    return result


# --- calibration check ---------------------------------------------------------------------


_PERSEUS_FILES: Final[Mapping[str, tuple[str, float]]] = MappingProxyType(
    {  # GPU type -> (stage-profile file, the enforced limit of the measured board)
        "A100-SXM4-80GB": ("bloom+a100_sxm_bf16.csv", 500.0),
        "A40": ("bloom+a40_bf16.csv", 300.0),
    }
)
_ZEUS_FILES: Final[Mapping[str, str]] = MappingProxyType(
    {"V100-PCIE-32GB": "summary_power_v100.csv", "A40": "summary_power_a40.csv"}
)


def _read_csv(path: Path) -> list[dict[str, str]]:
    try:
        with path.open(newline="") as fh:
            return list(csv.DictReader(fh))
    except OSError as e:
        raise InputError(f"cannot read calibration data {path}: {e.strerror}") from e


def _mape_pct(model: FloatArray, measured: FloatArray) -> float:
    return float(np.mean(np.abs(model / measured - 1.0)) * 100.0)


def _perseus_report(data_dir: Path, gpu: str) -> dict[str, float]:
    name, board_limit_w = _PERSEUS_FILES[gpu]
    rows = _read_csv(data_dir / "perseus-sosp24" / "stage_profile" / name)
    spec = catalog_spec(gpu)
    # stages 0–6 are the same profile; stage 7 (the last) has its own
    prefix = {True: "bloom-last-", False: "bloom-"}
    kinds = {"forward": "fwd", "backward": "bwd"}
    profiles = [
        PROFILES[prefix[r["stage"] == "7"] + kinds[r["instruction"]]].on(spec) for r in rows
    ]
    plant = Plant.of(spec, WorkloadArrays.of(profiles))
    clock = np.array([float(r["frequency"]) for r in rows])
    time_s = np.array([float(r["time"]) for r in rows])
    power_w = np.array([float(r["energy"]) for r in rows]) / time_s
    truth = plant.step(clock, limit_w=board_limit_w)
    return {
        "points": float(len(rows)),
        "power_mape_pct": _mape_pct(truth.power_w, power_w),
        "time_mape_pct": _mape_pct(truth.iteration_time_s, time_s),
        "power_worst_pct": float(np.max(np.abs(truth.power_w / power_w - 1.0)) * 100.0),
        "time_worst_pct": float(np.max(np.abs(truth.iteration_time_s / time_s - 1.0)) * 100.0),
    }


def _zeus_report(data_dir: Path, gpu: str) -> dict[str, float]:
    rows = _read_csv(data_dir / "zeus-nsdi23-powerlimit" / _ZEUS_FILES[gpu])
    spec = catalog_spec(gpu)
    power_err: list[FloatArray] = []
    time_err: list[FloatArray] = []
    over_limit: list[FloatArray] = []
    measured_over: list[FloatArray] = []
    for model, key in _ZEUS_SERIES.items():
        series = [
            r for r in rows if (r["dataset"], r["network"], r["batch_size"], r["optimizer"]) == key
        ]
        series.sort(key=lambda r: -float(r["power_limit"]))
        limit_w = np.array([float(r["power_limit"]) for r in series])
        epoch_s = np.array([float(r["time_per_epoch"]) for r in series])
        power_w = np.array([float(r["average_power"]) for r in series])
        cal = PROFILES[model].on(spec)
        plant = Plant.of(spec, WorkloadArrays.of([cal] * len(series)))
        truth = plant.step(spec.max_graphics_mhz, limit_w=limit_w)
        power_err.append(np.abs(truth.power_w / power_w - 1.0))
        # epochs are not iterations: compare the slow-down against the highest limit
        ratio_plant = truth.iteration_time_s / truth.iteration_time_s[0]
        time_err.append(np.abs(ratio_plant / (epoch_s / epoch_s[0]) - 1.0))
        over_limit.append(truth.power_w / limit_w - 1.0)
        measured_over.append(power_w / limit_w - 1.0)
    return {
        "series": float(len(power_err)),
        "points": float(sum(e.size for e in power_err)),
        "power_mape_pct": float(np.mean(np.concatenate(power_err)) * 100.0),
        "time_ratio_mape_pct": float(np.mean(np.concatenate(time_err)) * 100.0),
        "power_over_limit_max_pct": float(np.max(np.concatenate(over_limit)) * 100.0),
        "measured_over_limit_max_pct": float(np.max(np.concatenate(measured_over)) * 100.0),
    }


def calibration_report(data_dir: str | os.PathLike[str]) -> dict[str, dict[str, dict[str, float]]]:
    """The plant's error against the measurements it was calibrated on.

    ``perseus``: power and time MAPE (%) over every stage/instruction/clock of the BLOOM stage
    profiles (A100-SXM4-80GB, A40). ``zeus``: power MAPE and slow-down (time ratio to the highest
    limit) MAPE over the power-limit sweeps of the five `_ZEUS_SERIES` (V100-PCIE-32GB, A40), and
    the largest excess of plant power over the limit (negative: always under it).
    """
    root = Path(data_dir)
    return {
        "perseus": {gpu: _perseus_report(root, gpu) for gpu in _PERSEUS_FILES},
        "zeus": {gpu: _zeus_report(root, gpu) for gpu in _ZEUS_FILES},
    }
