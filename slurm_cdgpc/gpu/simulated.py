"""The simulated backend: GPUs whose physics is `slurm_cdgpc.gpu.plant`, on an injectable clock.

A `SimulatedGpu` behaves like the NVML backend where the controller can see it: clocks outside
the device's list are refused before anything changes; a lock is the range [lowest, cap] and is
recorded (memory is locked only on parts that list several memory clocks); setting the same lock
twice makes one "driver call" (`clock_writes`). Between calls the GPU runs on its own: with a job
attached, the applied clock is min(cap, the highest clock within the enforced power limit) and
iterations advance at the plant's iteration time; without one it idles at its idle clock and idle
power. The energy counter integrates the TRUE power and never decreases; `read` reports power
with seeded noise, averaged over the last second on Hopper (`GpuSpec.power_average_window_s`).

Time comes from ``time_source`` (default `time.monotonic`); tests and accelerated demos pass a
`ManualClock`. State advances lazily, on every call, so nothing runs in the background.

Fault hooks for fault tests, plain attributes that may be flipped at any time:
``fail_clock_writes`` (lock and reset raise `GpuError`, nothing changes), ``fail_reads`` (`read`
raises `GpuLostError`) and ``report_garbage_power`` (`read` reports NaN, 0 W, −1 W and
4 294 967.295 W = 0xFFFFFFFF mW in turn, while the energy counter stays true).

A process that cannot reach those attributes (a running ``cdgpc-noded``) takes them from a
`FaultFile` (`install_faults`): the fault tests start the agent with ``CDGPC_SIMULATED_FAULTS``
naming one, and rewrite it to inject or heal a fault while the agent runs. It is never read
unless that variable is set, and only by the simulated backend: no NVML GPU can be made to fail.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

import numpy as np

from slurm_cdgpc.errors import GpuError, GpuLostError, InputError
from slurm_cdgpc.gpu.catalog import GpuSpec, catalog_spec
from slurm_cdgpc.gpu.device import (
    ClockTable,
    GpuDevice,
    GpuReading,
    GpuSet,
    LockedClocks,
    PowerLimitRange,
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

logger = logging.getLogger(__name__)

_GARBAGE_POWER_W: Final = (float("nan"), 0.0, -1.0, 4_294_967.295)
#: what a `FaultFile` line may inject, and the `SimulatedGpu` attribute each one sets
FAULT_MODES: Final[Mapping[str, str]] = {
    "fail_clock_writes": "fail_clock_writes",
    "fail_reads": "fail_reads",
    "garbage_power": "report_garbage_power",
}


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
    """Let the rules of the file at ``path`` drive the fault hooks of every simulated GPU."""
    faults = FaultFile(path)
    for device in gpus:
        if isinstance(device, SimulatedGpu):
            device.faults = faults
    return faults


class SimulatedGpu(GpuDevice):
    """One simulated GPU of type `spec`; deterministic for a given seed, index and time source."""

    def __init__(
        self,
        spec: GpuSpec,
        *,
        index: int = 0,
        seed: int = 0,
        time_source: Callable[[], float] = time.monotonic,
        noise: NoiseModel | None = None,
    ) -> None:
        self.spec = spec
        self.index = index
        self.name = spec.name
        self._rng = np.random.default_rng([seed, index])
        self.uuid = f"GPU-{uuid.UUID(bytes=self._rng.bytes(16), version=4)}"
        self._time = time_source
        self._noise = NoiseModel() if noise is None else noise
        self.fail_clock_writes = False
        self.fail_reads = False
        self.report_garbage_power = False
        #: when set, the hooks above follow this file instead (`install_faults`)
        self.faults: FaultFile | None = None
        self.clock_writes = 0  # driver calls that changed a lock (idempotent calls make none)
        self._garbage = 0
        self._locked: LockedClocks | None = None
        self._limit_w = spec.power_limit.default_w
        self._workload: WorkloadCalibration | None = None
        self._plant: Plant | None = None
        self._truth: PlantState | None = None
        self._energy_j = 0.0
        self._iterations = 0.0
        self._last_s = self._time()
        # (start time, true power) of each constant-power stretch within the averaging window
        self._segments: deque[tuple[float, float]] = deque([(self._last_s, spec.idle_power_w)])

    # --- the GpuDevice interface ---------------------------------------------------------------

    def supported_clocks(self) -> ClockTable:
        return self.spec.clocks

    def power_limit_range(self) -> PowerLimitRange:
        return self.spec.power_limit

    @property
    def locked(self) -> LockedClocks | None:
        return self._locked

    def set_locked_clocks(self, graphics_mhz: int, memory_mhz: int | None = None) -> None:
        self._follow_faults()
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
        self._refresh()
        logger.debug(
            "%s: locked graphics %d..%d MHz, memory %s", self.uuid, lowest, graphics_mhz, memory
        )

    def reset_locked_clocks(self) -> None:
        self._follow_faults()
        if self._locked is None:
            return
        self._write("reset clocks")
        self._advance()
        self._locked = None
        self._refresh()

    def read(self) -> GpuReading:
        self._follow_faults()
        if self.fail_reads:
            raise GpuLostError(f"simulated GPU {self.index} fell off the bus")
        now = self._advance()
        power_w = self._windowed_power_w(now) * (
            1.0 + self._noise.power_rel * self._rng.standard_normal()
        )
        if self.report_garbage_power:
            power_w = _GARBAGE_POWER_W[self._garbage % len(_GARBAGE_POWER_W)]
            self._garbage += 1
        truth = self._truth
        throttle = ThrottleReason.NONE
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
            enforced_limit_w=self._limit_w,
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

    def set_power_limit_w(self, limit_w: float) -> None:
        """Set the enforced power limit; refused (`InputError`) outside `power_limit_range`."""
        limits = self.spec.power_limit
        if not limits.min_w <= limit_w <= limits.max_w:
            raise InputError(
                f"power limit {limit_w} W is outside {limits.min_w:g}..{limits.max_w:g} W"
            )
        self._advance()
        self._limit_w = float(limit_w)
        self._refresh()

    @property
    def workload(self) -> WorkloadCalibration | None:
        return self._workload

    @property
    def enforced_limit_w(self) -> float:
        return self._limit_w

    @property
    def iterations_done(self) -> float:
        """Iterations the attached job has completed since `attach` (fractional)."""
        self._advance()
        return self._iterations

    @property
    def true_power_w(self) -> float:
        """The power drawn now, without noise or averaging (what the energy counter integrates)."""
        return self._power_now_w()

    @property
    def true_iteration_time_s(self) -> float | None:
        """Seconds per iteration at the current settings, or None when idle."""
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

    def _memory_mhz(self) -> int:
        locked = self._locked
        if locked is not None and locked.memory_mhz is not None:
            return locked.memory_mhz
        return self.spec.max_memory_mhz

    def _power_now_w(self) -> float:
        truth = self._truth
        return self.spec.idle_power_w if truth is None else float(truth.power_w[0])

    def _advance(self) -> float:
        """Run the GPU up to now: energy += P·dt, iterations += dt / T."""
        now = self._time()
        dt_s = now - self._last_s
        if dt_s > 0:
            self._energy_j += self._power_now_w() * dt_s
            if self._truth is not None:
                self._iterations += dt_s / float(self._truth.iteration_time_s[0])
            self._last_s = now
        return self._last_s

    def _refresh(self) -> None:
        """Recompute the truth after a settings change (made right after `_advance`)."""
        now = self._last_s
        if self._plant is None:
            self._truth = None
        else:
            locked = self._locked
            cap = self.spec.max_graphics_mhz if locked is None else locked.graphics_max_mhz
            self._truth = self._plant.step(cap, self._memory_mhz(), self._limit_w)
        self._segments.append((now, self._power_now_w()))
        window = self.spec.power_average_window_s
        while len(self._segments) > 1 and self._segments[1][0] <= now - window:
            self._segments.popleft()

    def _windowed_power_w(self, now: float) -> float:
        """Mean true power over [now − window, now]; the power now when the window is 0."""
        window = self.spec.power_average_window_s
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


def simulated_gpus(
    spec_name: str,
    count: int,
    *,
    seed: int,
    time_source: Callable[[], float] = time.monotonic,
    noise: NoiseModel | None = None,
) -> GpuSet:
    """``count`` simulated GPUs of the catalog type ``spec_name`` (indices 0..count−1)."""
    if count < 1:
        raise InputError(f"a simulated node needs at least one GPU, got {count}")
    spec = catalog_spec(spec_name)
    return GpuSet(
        [
            SimulatedGpu(spec, index=i, seed=seed, time_source=time_source, noise=noise)
            for i in range(count)
        ]
    )
