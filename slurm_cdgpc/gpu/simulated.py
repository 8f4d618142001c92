"""The simulated backend: `SimulatedGpu`, the plant (`slurm_cdgpc.gpu.plant`) behind `GpuDevice`.

Refuses what NVML refuses, runs on an injectable clock, and takes faults from a `FaultFile`.
Reaches only `gpu/`, `wire/`, `errors` and `units` of the package
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "The demo" (faults); tests:
`tests/unit/test_gpu_simulated.py`, `tests/faults/test_fault_file.py`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final

import numpy as np

from slurm_cdgpc.errors import (
    GpuError,
    GpuLostError,
    GpuNotSupportedError,
    InputError,
    PowerLimitPermissionError,
    UnsupportedPowerLimitError,
)
from slurm_cdgpc.gpu.board import spec_from_board
from slurm_cdgpc.gpu.catalog import GpuSpec, catalog_spec
from slurm_cdgpc.gpu.device import (
    GpuDevice,
    GpuReading,
    GpuSet,
    LockedClocks,
    MigInstance,
    ThrottleReason,
)
from slurm_cdgpc.gpu.plant import (
    NoiseModel,
    Plant,
    PlantState,
    WorkloadArrays,
    WorkloadCalibration,
    WorkloadProfile,
    workload_profile,
)
from slurm_cdgpc.wire.board import BoardDescription, ClockTable, PowerLimitRange

logger = logging.getLogger(__name__)

_GARBAGE_POWER_W: Final = (float("nan"), 0.0, -1.0, 4_294_967.295)
#: what a `FaultFile` line may inject, and the `SimulatedGpu` attribute each one sets
FAULT_MODES: Final[Mapping[str, str]] = {
    "fail_clock_writes": "fail_clock_writes",
    "fail_power_limit_writes": "fail_power_limit_writes",
    "fail_reads": "fail_reads",
    "garbage_power": "report_garbage_power",
    "power_brake": "power_brake",
}
#: the window over which the firmware holds a power limit [inferred: NVML and nvidia-smi speak
#: of 1 s averages; the enforcement loop's exact window is not documented]
LIMIT_WINDOW_S: Final = 1.0
#: a simulated GPU in MIG mode holds seven 1g instances (the most an A100 or H100 takes), GPU
#: instance IDs 7-13 as NVML numbers 1g slices, their UUIDs derived from the GPU's
SIMULATED_MIG_GPU_INSTANCES: Final = tuple(range(7, 14))
_NO_LIMIT_W: Final = 1e9  # a limit no board reaches: the clock the lock alone allows


class ManualClock:
    """A time source that moves only when told: ``clock()`` is now, ``clock.advance(dt_s)``."""

    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = float(start_s)

    def __call__(self) -> float:
        return self.now_s

    def advance(self, dt_s: float) -> None:
        if not dt_s >= 0:
            raise InputError(f"time cannot go backwards (advance by {dt_s} s)")
        self.now_s += dt_s


class FaultFile:
    """Faults to inject into simulated GPUs, from a text file re-read whenever it changes.

    One rule a line, ``<GPU index or *> <mode>``, with ``mode`` one of `FAULT_MODES`; ``#``
    starts a comment; a missing or empty file injects nothing. Rewriting the file (atomically:
    write a temporary file, rename it) injects or heals a fault while the process runs, with no
    signal and no API. A malformed file is an `InputError` when first read; a malformed rewrite
    later is logged and the previous rules stay (the running agent must not fall over for it).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._rules: dict[int | None, frozenset[str]] = {}
        self._load(first=True)

    def modes(self, index: int) -> frozenset[str]:
        """The fault modes GPU ``index`` suffers now (the file is checked on every call)."""
        with self._lock:
            self._load(first=False)
            return self._rules.get(index, frozenset()) | self._rules.get(None, frozenset())

    def _load(self, *, first: bool) -> None:
        try:
            st = os.stat(self.path)
            seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            seen = (0, 0, 0)
        except OSError as e:
            if first:
                raise InputError(f"simulated faults file {self.path}: {e.strerror or e}") from e
            return  # unreadable for now: the rules in force stay
        if seen == self._seen:
            return
        self._seen = seen
        try:
            text = "" if seen == (0, 0, 0) else self.path.read_text(encoding="utf-8")
            rules = parse_faults(text)
        except (OSError, UnicodeDecodeError, InputError) as e:
            if first:
                raise InputError(f"simulated faults file {self.path}: {e}") from None
            logger.error("simulated faults file %s: %s; keeping the previous faults", self.path, e)
            return
        if rules != self._rules:
            logger.warning("simulated faults now %s", _describe(rules))
        self._rules = rules


def parse_faults(text: str) -> dict[int | None, frozenset[str]]:
    """GPU index (None: every GPU) → fault modes, from a `FaultFile`'s text."""
    rules: dict[int | None, set[str]] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) != 2 or words[1] not in FAULT_MODES:
            raise InputError(
                f"line {number}: expected '<GPU index or *> <mode>' with a mode among "
                f"{', '.join(FAULT_MODES)}, got {raw.strip()!r:.60}"
            )
        where, mode = words
        if where != "*" and not where.isdigit():
            raise InputError(f"line {number}: not a GPU index or '*': {where!r:.20}")
        rules.setdefault(None if where == "*" else int(where), set()).add(mode)
    return {index: frozenset(modes) for index, modes in rules.items()}


def _describe(rules: Mapping[int | None, frozenset[str]]) -> str:
    if not rules:
        return "none"
    return "; ".join(
        f"{'every GPU' if index is None else f'GPU {index}'}: {', '.join(sorted(modes))}"
        for index, modes in sorted(rules.items(), key=lambda kv: -1 if kv[0] is None else kv[0])
    )


def install_faults(gpus: GpuSet, path: Path) -> FaultFile:
    """Let the rules of the file at ``path`` drive the fault hooks of every simulated GPU.

    For a process whose GPUs a test cannot reach (a running ``cdgpc-noded``, started with
    ``CDGPC_SIMULATED_FAULTS`` naming the file); never used unless that variable is set."""
    faults = FaultFile(path)
    for device in gpus:
        if isinstance(device, SimulatedGpu):
            device.faults = faults
    return faults


class SimulatedGpu(GpuDevice):
    """One simulated GPU of type `spec` (a catalog type, or a recorded `BoardDescription` whose
    type is `spec_from_board`); deterministic for a given seed, index and time source.

    It behaves like the NVML backend where the controller can see it: clocks outside the list
    are refused before anything changes; a lock is the range [lowest, cap] and is recorded
    (memory is locked only on parts that list several memory clocks); setting the same lock
    twice makes one "driver call" (`clock_writes`). Between calls the GPU runs on its own: with
    a job attached, the applied clock is min(cap, the highest clock within the enforced power
    limit) and iterations advance at the plant's iteration time; without one it idles at its
    idle clock and idle power. The energy counter integrates the true power and never
    decreases; `read` reports power with seeded noise, averaged over
    `GpuSpec.power_average_window_s` (Hopper). A power limit is held over a `LIMIT_WINDOW_S`
    average (`_refresh`). Time comes from ``time_source``; state advances lazily, on every
    call, so nothing runs in the background. In MIG mode (built from a board described so) a
    lock raises `GpuNotSupportedError`, as NVML's clock control is documented not to be offered
    on a partitioned GPU; its power limit, which is whole-GPU, works.

    Fault hooks, plain attributes that may be flipped at any time (or driven by a `FaultFile`):
    ``fail_clock_writes`` (lock and reset raise `GpuError`, nothing changes), ``fail_reads``
    (`read` raises `GpuLostError`), ``report_garbage_power`` (`read` reports each of
    `_GARBAGE_POWER_W` in turn, the last 0xFFFFFFFF mW, while the energy counter stays true),
    ``fail_power_limit_writes`` (setting or resetting a limit raises
    `PowerLimitPermissionError`, as NO_PERMISSION does) and `power_brake`. Other limiters:
    `set_external_power_cap_w` and `override_lock`.
    """

    def __init__(
        self,
        spec: GpuSpec | BoardDescription,
        *,
        index: int = 0,
        seed: int = 0,
        time_source: Callable[[], float] = time.monotonic,
        noise: NoiseModel | None = None,
    ) -> None:
        if isinstance(spec, BoardDescription):
            self.spec = spec_from_board(spec)
            self.name = spec.name  # what NVML would report, so `describe` round-trips
            self._mig_mode = spec.mig_mode
        else:
            self.spec = spec
            self.name = spec.name
            self._mig_mode = None
        spec = self.spec
        self.index = index
        self._rng = np.random.default_rng([seed, index])
        self.uuid = f"GPU-{uuid.UUID(bytes=self._rng.bytes(16), version=4)}"
        self._time = time_source
        self._noise = NoiseModel() if noise is None else noise
        self.fail_clock_writes = False
        self.fail_power_limit_writes = False
        self.fail_reads = False
        self.report_garbage_power = False
        #: when set, the hooks above follow this file instead (`install_faults`)
        self.faults: FaultFile | None = None
        self.clock_writes = 0  # driver calls that changed a lock (idempotent calls make none)
        self.power_limit_writes = 0
        self._garbage = 0
        self._locked: LockedClocks | None = None
        self._foreign_lock: LockedClocks | None = None
        self._limit_w = spec.power_limit.default_w  # the software limit in force
        self._limit_set_w: float | None = None  # what this process set
        self._external_cap_w: float | None = None
        self._brake = False
        self._workload: WorkloadCalibration | None = None
        self._plant: Plant | None = None
        self._truth: PlantState | None = None
        self._pending: tuple[float, PlantState] | None = None  # (when, truth after the burst)
        self._energy_j = 0.0
        self._iterations = 0.0
        self._last_s = self._time()
        self._history_s = max(spec.power_average_window_s, LIMIT_WINDOW_S)
        # (start time, true power) of each constant-power stretch within the history kept
        self._segments: deque[tuple[float, float]] = deque([(self._last_s, spec.idle_power_w)])

    # --- the GpuDevice interface ---------------------------------------------------------------

    def supported_clocks(self) -> ClockTable:
        return self.spec.clocks

    def power_limit_range(self) -> PowerLimitRange:
        return self.spec.power_limit

    def mig_mode(self) -> bool | None:
        return self._mig_mode

    def mig_instances(self) -> tuple[MigInstance, ...]:
        if not self._mig_mode:
            return ()
        return tuple(
            MigInstance(f"MIG-{uuid.uuid5(uuid.NAMESPACE_OID, f'{self.uuid}/{gi}/0')}", gi, 0)
            for gi in SIMULATED_MIG_GPU_INSTANCES
        )

    @property
    def locked(self) -> LockedClocks | None:
        return self._locked

    def set_locked_clocks(self, graphics_mhz: int, memory_mhz: int | None = None) -> None:
        self._follow_faults()
        if self._mig_mode:  # clock control is whole-GPU and not offered on a partitioned one
            raise GpuNotSupportedError(
                f"simulated GPU {self.index}: MIG mode is on: clocks cannot be locked"
            )
        self.spec.clocks.check(graphics_mhz, memory_mhz)  # UnsupportedClockError, no change
        memory = memory_mhz if self.spec.memory_lockable else None
        lowest = self.spec.clocks.graphics_for(memory)[-1]
        lock = LockedClocks(
            graphics_min_mhz=lowest, graphics_max_mhz=graphics_mhz, memory_mhz=memory
        )
        if lock == self._locked:
            return
        self._write("lock clocks")
        self._advance()
        self._locked = lock
        self._foreign_lock = None  # the last writer wins
        self._refresh()
        logger.debug(
            "%s: locked graphics %d..%d MHz, memory %s", self.uuid, lowest, graphics_mhz, memory
        )

    def reset_locked_clocks(self) -> None:
        self._follow_faults()
        if self._locked is None and self._foreign_lock is None:
            return
        self._write("reset clocks")
        self._advance()
        self._locked = None
        self._foreign_lock = None
        self._refresh()

    @property
    def power_limit_set_w(self) -> float | None:
        return self._limit_set_w

    def set_power_limit_w(self, limit_w: float) -> None:
        """Set the software limit; refused (`UnsupportedPowerLimitError`) outside the range."""
        self._follow_faults()
        limits = self.spec.power_limit
        if not (math.isfinite(limit_w) and limits.min_w <= limit_w <= limits.max_w):
            raise UnsupportedPowerLimitError(
                f"simulated GPU {self.index}: power limit {limit_w:g} W is outside "
                f"{limits.min_w:g}..{limits.max_w:g} W"
            )
        if self._limit_set_w == float(limit_w):
            return
        self._write_limit(float(limit_w))
        self._limit_set_w = float(limit_w)

    def reset_power_limit(self) -> None:
        """Back to the default limit; no driver call when this process set none."""
        self._follow_faults()
        if self._limit_set_w is None:
            return
        self._write_limit(self.spec.power_limit.default_w)
        self._limit_set_w = None

    def read(self) -> GpuReading:
        self._follow_faults()
        if self.fail_reads:
            raise GpuLostError(f"simulated GPU {self.index} fell off the bus")
        now = self._advance()
        power_w = self._windowed_power_w(now, self.spec.power_average_window_s) * (
            1.0 + self._noise.power_rel * self._rng.standard_normal()
        )
        if self.report_garbage_power:
            power_w = _GARBAGE_POWER_W[self._garbage % len(_GARBAGE_POWER_W)]
            self._garbage += 1
        truth = self._truth
        throttle = ThrottleReason.HW_POWER_BRAKE if self._brake else ThrottleReason.NONE
        if truth is None:
            sm_clock_mhz = self.spec.idle_graphics_mhz
            throttle |= ThrottleReason.GPU_IDLE
        else:
            sm_clock_mhz = round(float(truth.applied_mhz[0]))
            if truth.power_capped[0]:
                throttle |= ThrottleReason.SW_POWER_CAP
        return GpuReading(
            uuid=self.uuid,
            timestamp_s=now,
            power_w=float(power_w),
            energy_j=self._energy_j,
            sm_clock_mhz=sm_clock_mhz,
            memory_clock_mhz=self._memory_mhz(),
            enforced_limit_w=self.enforced_limit_w,
            throttle=throttle,
        )

    # --- simulation controls -------------------------------------------------------------------

    def attach(self, workload: WorkloadProfile | WorkloadCalibration | str) -> None:
        """Start a job: a profile (calibrated for this GPU type), a calibration or a name."""
        if isinstance(workload, str):
            workload = workload_profile(workload)
        calibration = workload.on(self.spec) if isinstance(workload, WorkloadProfile) else workload
        self._advance()
        self._workload = calibration
        self._plant = Plant.of(self.spec, WorkloadArrays.of([calibration]))
        self._iterations = 0.0
        self._refresh()

    def detach(self) -> None:
        """End the job: the GPU idles (its lock stays, as on a real GPU)."""
        self._advance()
        self._workload = None
        self._plant = None
        self._refresh()

    def set_external_power_cap_w(self, limit_w: float | None) -> None:
        """Another limiter (a BMC's out-of-band cap, someone's ``nvidia-smi -pl``) caps the
        board at ``limit_w`` (None: lifted); the firmware enforces the lowest limit."""
        if limit_w is not None and not (math.isfinite(limit_w) and limit_w > 0):
            raise InputError(f"an external power cap must be a positive power, got {limit_w}")
        self._advance()
        self._external_cap_w = None if limit_w is None else float(limit_w)
        self._refresh()

    @property
    def power_brake(self) -> bool:
        """HW power brake asserted (a PSU/BMC signal): the clock is halved, HW_POWER_BRAKE."""
        return self._brake

    @power_brake.setter
    def power_brake(self, active: bool) -> None:
        if bool(active) == self._brake:
            return
        self._advance()
        self._brake = bool(active)
        self._refresh()

    def override_lock(self, graphics_max_mhz: int | None) -> None:
        """Another process locks graphics at ``graphics_max_mhz`` (None: it resets the lock).

        `locked` still shows our lock, as NVML cannot read one back; our next driver write
        (a changed lock, or a reset) replaces the other one, as on a real GPU.
        """
        self._advance()
        if graphics_max_mhz is None:
            self._foreign_lock = None
            self._locked = None  # a reset by anyone removes every lock
        else:
            self.spec.clocks.check(graphics_max_mhz)
            memory = None if self._locked is None else self._locked.memory_mhz
            self._foreign_lock = LockedClocks(self.spec.min_graphics_mhz, graphics_max_mhz, memory)
        self._refresh()

    @property
    def workload(self) -> WorkloadCalibration | None:
        return self._workload

    @property
    def enforced_limit_w(self) -> float:
        """What the firmware enforces: the lowest of our limit and any external cap."""
        external = self._external_cap_w
        return self._limit_w if external is None else min(self._limit_w, external)

    @property
    def iterations_done(self) -> float:
        """Iterations the attached job has completed since `attach` (fractional)."""
        self._advance()
        return self._iterations

    @property
    def true_power_w(self) -> float:
        """The power drawn now, without noise or averaging (what the energy counter integrates)."""
        self._advance()
        return self._power_now_w()

    @property
    def true_iteration_time_s(self) -> float | None:
        """Seconds per iteration at the current settings, or None when idle."""
        self._advance()
        return None if self._truth is None else float(self._truth.iteration_time_s[0])

    # --- internals -----------------------------------------------------------------------------

    def _follow_faults(self) -> None:
        if self.faults is None:
            return
        modes = self.faults.modes(self.index)
        for mode, attribute in FAULT_MODES.items():
            setattr(self, attribute, mode in modes)

    def _write(self, what: str) -> None:
        if self.fail_clock_writes:
            raise GpuError(f"simulated GPU {self.index}: {what} failed (injected fault)")
        self.clock_writes += 1

    def _write_limit(self, limit_w: float) -> None:
        if self.fail_power_limit_writes:
            raise PowerLimitPermissionError(
                f"simulated GPU {self.index}: set power limit {limit_w:g} W failed: "
                "Insufficient Permissions (injected fault)"
            )
        self.power_limit_writes += 1
        self._advance()
        self._limit_w = limit_w
        self._refresh()

    def _lock_in_force(self) -> LockedClocks | None:
        return self._foreign_lock if self._foreign_lock is not None else self._locked

    def _memory_mhz(self) -> int:
        locked = self._lock_in_force()
        if locked is not None and locked.memory_mhz is not None:
            return locked.memory_mhz
        return self.spec.max_memory_mhz

    def _power_now_w(self) -> float:
        truth = self._truth
        return self.spec.idle_power_w if truth is None else float(truth.power_w[0])

    def _advance(self) -> float:
        """Run the GPU up to now, through the end of a power-limit burst on the way."""
        now = self._time()
        pending = self._pending
        if pending is not None and pending[0] <= now:
            self._run_until(pending[0])
            self._truth, self._pending = pending[1], None
            self._record_power(pending[0])
        self._run_until(now)
        return self._last_s

    def _run_until(self, now: float) -> None:
        """energy += P·dt, iterations += dt / T."""
        dt_s = now - self._last_s
        if dt_s > 0:
            self._energy_j += self._power_now_w() * dt_s
            if self._truth is not None:
                self._iterations += dt_s / float(self._truth.iteration_time_s[0])
            self._last_s = now

    def _refresh(self) -> None:
        """Recompute the truth after a settings change (made right after `_advance`).

        A binding limit is held as a `LIMIT_WINDOW_S` average, as the firmware does: when the
        window before the change averaged no more than the capped power, the GPU first runs
        uncapped for the burst that brings the window's average exactly to the limit,
        Δ = W·(L − P_cap)/(P_free − P_cap), then at the limit clock; every window's average
        stays ≤ L (exact when the window before the change drew a constant power).
        """
        now = self._last_s
        self._pending = None
        if self._plant is None:
            self._truth = None
        else:
            locked = self._lock_in_force()
            cap = float(self.spec.max_graphics_mhz if locked is None else locked.graphics_max_mhz)
            if self._brake:  # a power brake cuts the clock at least in half
                cap = max(float(self.spec.min_graphics_mhz), cap / 2.0)
            limit_w = self.enforced_limit_w
            capped = self._plant.step(cap, self._memory_mhz(), limit_w)
            self._truth = capped
            if capped.power_capped[0]:
                free = self._plant.step(cap, self._memory_mhz(), _NO_LIMIT_W)
                free_w, capped_w = float(free.power_w[0]), float(capped.power_w[0])
                before_w = self._windowed_power_w(now, LIMIT_WINDOW_S)
                if free_w > limit_w and before_w <= capped_w:
                    burst_s = LIMIT_WINDOW_S * (limit_w - capped_w) / (free_w - capped_w)
                    if burst_s > 0:
                        self._truth, self._pending = free, (now + burst_s, capped)
        self._record_power(now)

    def _record_power(self, now: float) -> None:
        self._segments.append((now, self._power_now_w()))
        while len(self._segments) > 1 and self._segments[1][0] <= now - self._history_s:
            self._segments.popleft()

    def _windowed_power_w(self, now: float, window: float) -> float:
        """Mean true power over [now − window, now]; the power now when the window is 0."""
        if window <= 0:
            return self._power_now_w()
        start = now - window
        total_j = 0.0
        starts = [t for t, _ in self._segments]
        for (begin, power_w), end in zip(self._segments, [*starts[1:], now], strict=True):
            overlap = min(end, now) - max(begin, start)
            if overlap > 0:
                total_j += power_w * overlap
        first = self._segments[0][0]
        if first > start:  # before the GPU existed it idled
            total_j += self.spec.idle_power_w * (first - start)
        return total_j / window


GpuKind = GpuSpec | BoardDescription


def simulated_gpus(
    spec_name: str,
    count: int | None,
    *,
    seed: int,
    time_source: Callable[[], float] = time.monotonic,
    noise: NoiseModel | None = None,
) -> GpuSet:
    """Simulated GPUs of the kinds ``spec_name`` names (`node_gpu_kinds`), indices 0, 1, …"""
    return simulated_gpus_mixed(
        node_gpu_kinds(spec_name, count), seed=seed, time_source=time_source, noise=noise
    )


def simulated_gpus_mixed(
    kinds: Sequence[GpuKind],
    *,
    seed: int,
    time_source: Callable[[], float] = time.monotonic,
    noise: NoiseModel | None = None,
) -> GpuSet:
    """One simulated GPU per entry of ``kinds`` (catalog types or recorded boards), in order."""
    if not kinds:
        raise InputError("a simulated node needs at least one GPU, got 0")
    return GpuSet(
        [
            SimulatedGpu(kind, index=i, seed=seed, time_source=time_source, noise=noise)
            for i, kind in enumerate(kinds)
        ]
    )


def node_gpu_kinds(text: str, count: int | None) -> list[GpuKind]:
    """The kind of each GPU of a simulated node, in index order, from ``node.simulated_gpu_type``.

    ``TYPE`` (``count`` GPUs) or ``TYPE:N,TYPE:N,…`` (N of each, in that order; ``count``,
    when given, must equal the total). TYPE is a catalog name or alias, or the path of a
    ``.json`` file holding a `BoardDescription` (e.g. a recorded one from ``tests/data/nvml``).
    """
    items = [part.strip() for part in text.split(",")]
    if not all(items):
        raise InputError(f"simulated GPU types {text!r:.80}: an empty entry")
    groups: list[tuple[GpuKind, int | None]] = []
    for item in items:
        kind_text, colon, number = item.rpartition(":") if ":" in item else (item, "", "")
        if colon and not number.strip().isdigit():
            raise InputError(f"simulated GPU type {item!r:.60}: expected TYPE:N, N a count")
        groups.append((_gpu_kind(kind_text.strip()), int(number) if colon else None))
    counts = [n for _, n in groups]
    if len(groups) == 1 and counts[0] is None:
        if count is None:
            raise InputError(f"simulated GPU type {text!r:.60}: how many? write {text}:N")
        return [groups[0][0]] * _positive(count, text)
    if any(n is None for n in counts):
        raise InputError(f"simulated GPU types {text!r:.80}: give every type a count, TYPE:N")
    kinds = [kind for kind, n in groups for _ in range(_positive(n or 0, text))]
    if count is not None and count != len(kinds):
        raise InputError(
            f"simulated GPU types {text!r:.80} list {len(kinds)} GPUs, but the count is {count}"
        )
    return kinds


def _positive(count: int, text: str) -> int:
    if count < 1:
        raise InputError(f"a simulated node needs at least one GPU, got {count} for {text!r:.60}")
    return count


def _gpu_kind(text: str) -> GpuKind:
    if not text.lower().endswith(".json"):
        return catalog_spec(text)
    path = Path(text)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"simulated board file {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"simulated board file {path}: not JSON: {e}") from None
    return BoardDescription.from_dict(value, path.name)
