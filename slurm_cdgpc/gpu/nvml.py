"""The NVML backend: real NVIDIA GPUs through nvidia-ml-py (`NvmlGpu`, `open_nvml_gpus`, `probe`).

The only module that imports pynvml; every NVML call runs inside `_nvml_errors`, and nothing here
sets persistence mode or resets a GPU. Reaches only `gpu/`, `wire/`, `errors` and `units` of the
package (`tests/unit/test_import_graph.py`). Test: `tests/unit/test_gpu_nvml.py`.
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any, Final

import pynvml

from slurm_cdgpc.errors import (
    CdgpcError,
    GpuError,
    GpuLostError,
    GpuNotSupportedError,
    GpuPermissionError,
    GpuUnavailableError,
    InputError,
    PowerLimitPermissionError,
    UnsupportedPowerLimitError,
)
from slurm_cdgpc.gpu.device import (
    GpuDevice,
    GpuReading,
    GpuSet,
    LockedClocks,
    MigInstance,
    ThrottleReason,
)
from slurm_cdgpc.wire.board import ClockTable, PowerLimitRange

logger = logging.getLogger(__name__)

# NVML return code -> our exception; any code not listed becomes a plain GpuError.
_ERROR_CLASSES: Final[Mapping[int, type[CdgpcError]]] = MappingProxyType(
    {
        pynvml.NVML_ERROR_NO_PERMISSION: GpuPermissionError,
        pynvml.NVML_ERROR_NOT_SUPPORTED: GpuNotSupportedError,
        pynvml.NVML_ERROR_GPU_IS_LOST: GpuLostError,
        pynvml.NVML_ERROR_RESET_REQUIRED: GpuLostError,
        pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: GpuUnavailableError,
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED: GpuUnavailableError,
        pynvml.NVML_ERROR_UNINITIALIZED: GpuUnavailableError,
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: GpuUnavailableError,
        pynvml.NVML_ERROR_INVALID_ARGUMENT: GpuError,
    }
)

# A refused power limit loses the guard rail, not clock control: soft, unlike a refused lock.
_POWER_LIMIT_ERROR_CLASSES: Final[Mapping[int, type[CdgpcError]]] = MappingProxyType(
    {**_ERROR_CLASSES, pynvml.NVML_ERROR_NO_PERMISSION: PowerLimitPermissionError}
)

_ERROR_HINTS: Final[Mapping[int, str]] = MappingProxyType(
    {pynvml.NVML_ERROR_NO_PERMISSION: " (needs root or CAP_SYS_ADMIN)"}
)

_KNOWN_REASONS: Final[int] = sum(int(reason) for reason in ThrottleReason)

# Clock-event bits newer than `ThrottleReason`; `probe` reports them by name.
_EXTRA_REASON_NAMES: Final[Mapping[int, str]] = MappingProxyType(
    {0x200: "BOARD_LIMIT", 0x400: "RELIABILITY"}
)

# c_nvmlFieldValue_t.valueType -> member of the c_nvmlValue_t union.
_FIELD_VALUE_MEMBERS: Final[Mapping[int, str]] = MappingProxyType(
    {
        pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
        pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
    }
)


@contextmanager
def _nvml_errors(
    target: str, operation: str, classes: Mapping[int, type[CdgpcError]] = _ERROR_CLASSES
) -> Iterator[None]:
    """Translate an `NVMLError` raised inside into our exception root, naming GPU and operation."""
    try:
        yield
    except pynvml.NVMLError as e:
        code = int(e.value)
        error_class = classes.get(code, GpuError)
        hint = _ERROR_HINTS.get(code, "")
        raise error_class(f"{target}: {operation} failed: {e} (NVML error {code}){hint}") from e


def _text(value: object) -> str:
    """NVML strings arrive as bytes or str depending on the binding version."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


class NvmlGpu(GpuDevice):
    """One physical NVIDIA GPU. ``clock`` stamps readings (injectable for tests).

    Integer milliwatts and millijoules stay inside; everything leaving is in W and J. Clocks are
    capped with locked clocks over ``[lowest supported, cap]``, never with application clocks;
    memory is locked only on parts that list several memory clocks. Power limits are set with the
    v1 call, in integer mW, never ``_v2`` (nvidia-ml-py 13.615.71 ignores its return code); there
    is no reset call, so a reset sets the default limit. `GpuReading.energy_j` is NVML's
    total-energy counter (Volta and newer); where it is NOT_SUPPORTED (pre-Volta), `read`
    integrates its own power samples (trapezoid rule from 0 J at the first reading), only as
    good as the caller's sampling rate.
    """

    def __init__(
        self,
        index: int,
        handle: object,
        uuid: str,
        name: str,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.uuid = uuid
        self.name = name
        self._handle = handle
        self._clock = clock
        self._target = f"GPU {index} ({uuid})"
        self._clock_table: ClockTable | None = None
        self._locked: LockedClocks | None = None
        self._power_limit_set_mw: int | None = None
        self._energy_counter_supported = True
        self._integrated_energy_j = 0.0
        self._last_power: tuple[float, float] | None = None  # (timestamp_s, power_w)
        self._legacy_reasons_api = False

    def __repr__(self) -> str:
        return f"NvmlGpu(index={self.index}, uuid={self.uuid!r}, name={self.name!r})"

    # -- getters ------------------------------------------------------------------------------

    def supported_clocks(self) -> ClockTable:
        """Supported memory and per-memory graphics clocks, descending; queried once."""
        if self._clock_table is None:
            self._clock_table = self._query_clock_table()
        return self._clock_table

    def _query_clock_table(self) -> ClockTable:
        with _nvml_errors(self._target, "list supported memory clocks"):
            listed = pynvml.nvmlDeviceGetSupportedMemoryClocks(self._handle)
        graphics: dict[int, tuple[int, ...]] = {}
        for memory_mhz in sorted({int(m) for m in listed}, reverse=True):
            operation = f"list supported graphics clocks for memory {memory_mhz} MHz"
            with _nvml_errors(self._target, operation):
                listed = pynvml.nvmlDeviceGetSupportedGraphicsClocks(self._handle, memory_mhz)
            clocks = tuple(sorted({int(g) for g in listed}, reverse=True))
            if clocks:
                graphics[memory_mhz] = clocks
            else:
                logger.debug(
                    "%s: memory clock %s MHz lists no graphics clocks", self._target, memory_mhz
                )
        if not graphics:
            raise GpuNotSupportedError(f"{self._target}: NVML lists no supported clocks")
        return ClockTable(memory_mhz=tuple(graphics), graphics_mhz=MappingProxyType(graphics))

    def power_limit_range(self) -> PowerLimitRange:
        with _nvml_errors(self._target, "read power limit constraints"):
            min_mw, max_mw = pynvml.nvmlDeviceGetPowerManagementLimitConstraints(self._handle)
        with _nvml_errors(self._target, "read default power limit"):
            default_mw = int(pynvml.nvmlDeviceGetPowerManagementDefaultLimit(self._handle))
        return PowerLimitRange(
            min_w=int(min_mw) / 1000.0, max_w=int(max_mw) / 1000.0, default_w=default_mw / 1000.0
        )

    def read(self) -> GpuReading:
        power_w = self._power_mw() / 1000.0
        timestamp_s = self._clock()
        energy_j = self._energy_j(timestamp_s, power_w)
        return GpuReading(
            uuid=self.uuid,
            timestamp_s=timestamp_s,
            power_w=power_w,
            energy_j=energy_j,
            sm_clock_mhz=self._clock_mhz(pynvml.NVML_CLOCK_SM, "SM"),
            memory_clock_mhz=self._clock_mhz(pynvml.NVML_CLOCK_MEM, "memory"),
            enforced_limit_w=self._enforced_limit_mw() / 1000.0,
            throttle=ThrottleReason(self._clock_event_reasons() & _KNOWN_REASONS),
        )

    def _energy_j(self, timestamp_s: float, power_w: float) -> float:
        if self._energy_counter_supported:
            try:
                return self._energy_mj() / 1000.0
            except GpuNotSupportedError:
                logger.info(
                    "%s: no energy counter (pre-Volta); integrating power readings instead",
                    self._target,
                )
                self._energy_counter_supported = False
        if self._last_power is not None:
            last_s, last_w = self._last_power
            # E += (P_prev + P) / 2 * Δt  (trapezoid rule between consecutive readings)
            self._integrated_energy_j += (last_w + power_w) / 2.0 * (timestamp_s - last_s)
        self._last_power = (timestamp_s, power_w)
        return self._integrated_energy_j

    def _power_mw(self) -> int:
        with _nvml_errors(self._target, "read power usage"):
            return int(pynvml.nvmlDeviceGetPowerUsage(self._handle))

    def _energy_mj(self) -> int:
        with _nvml_errors(self._target, "read total energy consumption"):
            return int(pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))

    def _clock_mhz(self, clock_type: int, label: str) -> int:
        with _nvml_errors(self._target, f"read current {label} clock"):
            return int(pynvml.nvmlDeviceGetClockInfo(self._handle, clock_type))

    def _enforced_limit_mw(self) -> int:
        with _nvml_errors(self._target, "read enforced power limit"):
            return int(pynvml.nvmlDeviceGetEnforcedPowerLimit(self._handle))

    def _clock_event_reasons(self) -> int:
        """Raw clock-event bitmask; falls back to the pre-13.0 "throttle reasons" name."""
        with _nvml_errors(self._target, "read clock event reasons"):
            get_reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
            if get_reasons is not None and not self._legacy_reasons_api:
                try:
                    return int(get_reasons(self._handle))
                except pynvml.NVMLError_FunctionNotFound:
                    logger.debug("%s: driver predates clock event reasons", self._target)
            self._legacy_reasons_api = True
            return int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(self._handle))

    def _power_instant_mw(self) -> float:
        """Field NVML_FI_DEV_POWER_INSTANT; the call succeeds even when the field failed."""
        with _nvml_errors(self._target, "read field POWER_INSTANT"):
            value = pynvml.nvmlDeviceGetFieldValues(
                self._handle, [pynvml.NVML_FI_DEV_POWER_INSTANT]
            )[0]
            if value.nvmlReturn != pynvml.NVML_SUCCESS:
                raise pynvml.NVMLError(value.nvmlReturn)
        member = _FIELD_VALUE_MEMBERS.get(int(value.valueType))
        if member is None:
            raise GpuError(f"{self._target}: POWER_INSTANT has unknown type {value.valueType}")
        return float(getattr(value.value, member))

    def mig_mode(self) -> bool | None:
        """Current MIG mode; None where NVML says NOT_SUPPORTED (pre-Ampere, GDDR parts)."""
        try:
            with _nvml_errors(self._target, "read MIG mode"):
                current, _pending = pynvml.nvmlDeviceGetMigMode(self._handle)
        except GpuNotSupportedError:
            return None
        return bool(int(current) == pynvml.NVML_DEVICE_MIG_ENABLE)

    def mig_instances(self) -> tuple[MigInstance, ...]:
        """The MIG devices NVML lists on this GPU (slots up to its maximum; an empty slot is
        NOT_FOUND), with their UUIDs and GPU and compute instance IDs, as Slurm's gpu/nvml
        plugin reads them."""
        with _nvml_errors(self._target, "list MIG devices"):
            slots = int(pynvml.nvmlDeviceGetMaxMigDeviceCount(self._handle))
            found: list[MigInstance] = []
            for slot in range(slots):
                try:
                    handle = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(self._handle, slot)
                except pynvml.NVMLError_NotFound:
                    continue
                found.append(
                    MigInstance(
                        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                        gpu_instance=int(pynvml.nvmlDeviceGetGpuInstanceId(handle)),
                        compute_instance=int(pynvml.nvmlDeviceGetComputeInstanceId(handle)),
                    )
                )
        return tuple(found)

    # -- setters ------------------------------------------------------------------------------

    @property
    def power_limit_set_w(self) -> float | None:
        return None if self._power_limit_set_mw is None else self._power_limit_set_mw / 1000.0

    def set_power_limit_w(self, limit_w: float) -> None:
        """Set the software power limit (nvmlDeviceSetPowerManagementLimit, integer mW).

        NO_PERMISSION is a `PowerLimitPermissionError` (soft: the locks may still work).
        """
        limits = self.power_limit_range()
        if not (math.isfinite(limit_w) and limits.min_w <= limit_w <= limits.max_w):
            raise UnsupportedPowerLimitError(
                f"{self._target}: power limit {limit_w:g} W is outside "
                f"{limits.min_w:g}..{limits.max_w:g} W"
            )
        limit_mw = round(limit_w * 1000.0)
        if limit_mw == self._power_limit_set_mw:
            return
        self._write_power_limit(limit_mw, f"set power limit {limit_w:g} W")
        self._power_limit_set_mw = limit_mw
        logger.info("%s: power limit set to %s W", self._target, limit_mw / 1000.0)

    def reset_power_limit(self) -> None:
        """Set the default limit back. Always calls NVML, as `reset_locked_clocks` does: a
        limit a crashed agent set outlives it and NVML cannot tell whose a limit is."""
        with _nvml_errors(self._target, "read default power limit"):
            default_mw = int(pynvml.nvmlDeviceGetPowerManagementDefaultLimit(self._handle))
        self._write_power_limit(default_mw, f"reset power limit to {default_mw / 1000.0:g} W")
        self._power_limit_set_mw = None
        logger.info("%s: power limit reset to the default %s W", self._target, default_mw / 1000)

    def _write_power_limit(self, limit_mw: int, operation: str) -> None:
        with _nvml_errors(self._target, operation, _POWER_LIMIT_ERROR_CLASSES):
            pynvml.nvmlDeviceSetPowerManagementLimit(self._handle, limit_mw)

    @property
    def locked(self) -> LockedClocks | None:
        return self._locked

    def set_locked_clocks(self, graphics_mhz: int, memory_mhz: int | None = None) -> None:
        """Lock graphics to ``[lowest supported, graphics_mhz]``; lock memory on GDDR parts.

        The graphics lock is applied first; if the memory lock then fails, `locked` shows the new
        graphics range with the memory lock as it was before.
        """
        table = self.supported_clocks()
        table.check(graphics_mhz, memory_mhz)
        lowest_mhz = table.graphics_for(memory_mhz)[-1]
        lock_memory_mhz = memory_mhz if len(table.memory_mhz) > 1 else None
        current = self._locked
        wanted = LockedClocks(lowest_mhz, graphics_mhz, lock_memory_mhz)
        if wanted == current:
            return
        current_memory_mhz = None if current is None else current.memory_mhz
        graphics_range = (lowest_mhz, graphics_mhz)
        if (
            current is None
            or (current.graphics_min_mhz, current.graphics_max_mhz) != graphics_range
        ):
            with _nvml_errors(
                self._target, f"lock graphics clocks {lowest_mhz}..{graphics_mhz} MHz"
            ):
                pynvml.nvmlDeviceSetGpuLockedClocks(self._handle, lowest_mhz, graphics_mhz)
            self._locked = LockedClocks(lowest_mhz, graphics_mhz, current_memory_mhz)
            logger.info(
                "%s: locked graphics clocks %s..%s MHz", self._target, lowest_mhz, graphics_mhz
            )
        if lock_memory_mhz != current_memory_mhz:
            if lock_memory_mhz is None:
                with _nvml_errors(self._target, "reset memory clock lock"):
                    pynvml.nvmlDeviceResetMemoryLockedClocks(self._handle)
                logger.info("%s: memory clock unlocked", self._target)
            else:
                with _nvml_errors(self._target, f"lock memory clock {lock_memory_mhz} MHz"):
                    pynvml.nvmlDeviceSetMemoryLockedClocks(
                        self._handle, lock_memory_mhz, lock_memory_mhz
                    )
                logger.info("%s: locked memory clock %s MHz", self._target, lock_memory_mhz)
        self._locked = wanted

    def reset_locked_clocks(self) -> None:
        """Reset graphics and memory locks, trying both; raise the first failure.

        Always calls NVML, even when this process locked nothing: locks are device state that
        outlive a crashed agent, and NVML cannot report them. Resetting unlocked clocks is harmless.
        NOT_SUPPORTED from the memory reset (HBM and pre-Ampere parts) is not an error. When the
        memory reset fails after the graphics reset succeeded, `locked` is None although a memory
        lock may remain (`LockedClocks` cannot express it); the raised error says so.
        """
        first_error: CdgpcError | None = None
        graphics_reset = memory_reset = False
        try:
            with _nvml_errors(self._target, "reset graphics clock lock"):
                pynvml.nvmlDeviceResetGpuLockedClocks(self._handle)
            graphics_reset = True
        except CdgpcError as e:
            first_error = e
        try:
            with _nvml_errors(self._target, "reset memory clock lock"):
                pynvml.nvmlDeviceResetMemoryLockedClocks(self._handle)
            memory_reset = True
        except GpuNotSupportedError:
            logger.debug("%s: memory clock lock not supported, nothing to reset", self._target)
            memory_reset = True
        except CdgpcError as e:
            first_error = first_error or e
        previous = self._locked
        if graphics_reset or previous is None:
            self._locked = None
        elif memory_reset:
            self._locked = LockedClocks(previous.graphics_min_mhz, previous.graphics_max_mhz)
        if first_error is not None:
            raise first_error
        logger.info("%s: clock locks reset", self._target)


class NvmlGpuSet(GpuSet):
    """The GPUs opened by `open_nvml_gpus`; `close` (or leaving ``with``) shuts NVML down.

    Closing does not reset clock locks: they are device state, reset them first if wanted.
    """

    def __init__(self, devices: Sequence[NvmlGpu]) -> None:
        super().__init__(devices)
        self._nvml_devices = tuple(devices)
        self._open = True

    def __iter__(self) -> Iterator[NvmlGpu]:
        return iter(self._nvml_devices)

    def __enter__(self) -> NvmlGpuSet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Shut NVML down once; later calls do nothing."""
        if self._open:
            self._open = False
            with _nvml_errors("NVML", "shut down"):
                pynvml.nvmlShutdown()


def open_nvml_gpus(
    indices: Sequence[int] | None = None, *, clock: Callable[[], float] = time.monotonic
) -> NvmlGpuSet:
    """Initialise NVML and open the GPUs at ``indices`` (NVML indices; default: all of them)."""
    with _nvml_errors("NVML", "initialise"):
        pynvml.nvmlInit()
    try:
        with _nvml_errors("NVML", "count devices"):
            count = int(pynvml.nvmlDeviceGetCount())
        wanted = list(range(count)) if indices is None else list(indices)
        if not wanted:
            raise GpuUnavailableError("NVML found no GPUs on this node")
        if len(set(wanted)) != len(wanted):
            raise InputError(f"GPU indices listed twice: {wanted}")
        devices = [_open_device(index, count, clock) for index in wanted]
    except BaseException:
        _shutdown_quietly()
        raise
    logger.info("opened %s NVIDIA GPU(s): %s", len(devices), ", ".join(d.uuid for d in devices))
    return NvmlGpuSet(devices)


def _open_device(index: int, count: int, clock: Callable[[], float]) -> NvmlGpu:
    if not 0 <= index < count:
        raise GpuUnavailableError(f"GPU {index} is not on this node (NVML sees {count} GPUs)")
    target = f"GPU {index}"
    with _nvml_errors(target, "get handle"):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    with _nvml_errors(target, "read UUID"):
        uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
    with _nvml_errors(target, "read name"):
        name = _text(pynvml.nvmlDeviceGetName(handle))
    return NvmlGpu(index, handle, uuid, name, clock=clock)


def _shutdown_quietly() -> None:
    with suppress(CdgpcError), _nvml_errors("NVML", "shut down"):
        pynvml.nvmlShutdown()


def nvml_is_available() -> bool:
    """True when NVIDIA's bindings initialise NVML and it lists at least one GPU."""
    if not hasattr(pynvml, "_nvmlGetFunctionPointer"):
        logger.warning("the installed 'pynvml' is not NVIDIA's nvidia-ml-py; NVML unusable")
        return False
    try:
        with _nvml_errors("NVML", "initialise"):
            pynvml.nvmlInit()
    except CdgpcError as e:
        logger.debug("NVML not available: %s", e)
        return False
    try:
        with _nvml_errors("NVML", "count devices"):
            return int(pynvml.nvmlDeviceGetCount()) > 0
    except CdgpcError as e:
        logger.debug("NVML not available: %s", e)
        return False
    finally:
        _shutdown_quietly()


# -- read-only probe ----------------------------------------------------------------------------


@dataclass
class _ChangeTimes:
    """When a polled value changed; the median gap between changes is its update period."""

    samples: int = 0
    last: float | None = None
    change_times_s: list[float] = field(default_factory=list)
    error: str | None = None

    def add(self, timestamp_s: float, value: float) -> None:
        if self.samples and value != self.last:
            self.change_times_s.append(timestamp_s)
        self.last = value
        self.samples += 1

    def report(self) -> dict[str, Any]:
        gaps_s = [b - a for a, b in itertools.pairwise(self.change_times_s)]
        return {
            "samples": self.samples,
            "changes": len(self.change_times_s),
            "update_period_s": statistics.median(gaps_s) if gaps_s else None,
            "error": self.error,
        }


def probe(
    gpus: Iterable[NvmlGpu],
    seconds: float = 2.0,
    *,
    interval_s: float = 0.001,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Describe each GPU and measure how often its power and energy readings change.

    Read-only: calls NVML getters only, so it is safe on a shared production GPU. Polls every
    ``interval_s`` for ``seconds``; returns a JSON-serialisable dict.
    """
    devices = list(gpus)
    reports = [_describe(gpu) for gpu in devices]
    trackers = [_update_trackers(gpu) for gpu in devices]
    pollers = [(read, tracker) for by_name in trackers for read, tracker in by_name.values()]
    start_s = clock()
    while clock() - start_s < seconds:
        for read, tracker in pollers:
            if tracker.error is None:
                try:
                    value = read()
                except CdgpcError as e:
                    tracker.error = str(e)
                else:
                    tracker.add(clock(), value)
        sleep(interval_s)
    for report, by_name in zip(reports, trackers, strict=True):
        report["update_periods"] = {name: t.report() for name, (_, t) in by_name.items()}
    return {
        "driver_version": _optional(lambda: _system_text("nvmlSystemGetDriverVersion")),
        "nvml_version": _optional(lambda: _system_text("nvmlSystemGetNVMLVersion")),
        "seconds": seconds,
        "interval_s": interval_s,
        "gpus": reports,
    }


def _update_trackers(gpu: NvmlGpu) -> dict[str, tuple[Callable[[], float], _ChangeTimes]]:
    """The readings whose update period `probe` measures, each with its change tracker."""
    sources: dict[str, Callable[[], float]] = {
        "power_usage": gpu._power_mw,
        "energy_counter": gpu._energy_mj,
    }
    if hasattr(pynvml, "NVML_FI_DEV_POWER_INSTANT"):
        sources["power_instant_field"] = gpu._power_instant_mw
    return {name: (read, _ChangeTimes()) for name, read in sources.items()}


def _describe(gpu: NvmlGpu) -> dict[str, Any]:
    """Static facts and one snapshot of a GPU; a failing query is reported under ``errors``."""
    errors: dict[str, str] = {}

    def attempt(key: str, query: Callable[[], Any]) -> Any:
        try:
            return query()
        except CdgpcError as e:
            errors[key] = str(e)
            return None

    table = attempt("clocks", gpu.supported_clocks)
    limits = attempt("power_limit_w", gpu.power_limit_range)
    reasons = attempt("clock_event_reasons", gpu._clock_event_reasons)
    energy_mj = attempt("energy_counter_j", gpu._energy_mj)
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "name": gpu.name,
        "clocks": None if table is None else _describe_clocks(table),
        "power_limit_w": None if limits is None else asdict(limits),
        "enforced_limit_w": _scaled(attempt("enforced_limit_w", gpu._enforced_limit_mw)),
        "power_w": _scaled(attempt("power_w", gpu._power_mw)),
        "energy_counter_j": _scaled(energy_mj),
        "sm_clock_mhz": attempt("sm_clock_mhz", lambda: gpu._clock_mhz(pynvml.NVML_CLOCK_SM, "SM")),
        "memory_clock_mhz": attempt(
            "memory_clock_mhz", lambda: gpu._clock_mhz(pynvml.NVML_CLOCK_MEM, "memory")
        ),
        "clock_event_reasons": None if reasons is None else _reason_names(reasons),
        "clock_event_reasons_raw": reasons,
        "errors": errors,
    }


def _describe_clocks(table: ClockTable) -> dict[str, Any]:
    return {
        "memory_mhz": list(table.memory_mhz),
        "graphics_by_memory_mhz": {
            str(mem): {"levels": len(gfx), "min_mhz": gfx[-1], "max_mhz": gfx[0]}
            for mem, gfx in table.graphics_mhz.items()
        },
    }


def _reason_names(raw: int) -> list[str]:
    names = [reason.name or hex(reason) for reason in ThrottleReason(raw & _KNOWN_REASONS)]
    rest = raw & ~_KNOWN_REASONS
    for bit in (1 << i for i in range(rest.bit_length())):
        if rest & bit:
            names.append(_EXTRA_REASON_NAMES.get(bit, hex(bit)))
    return names


def _scaled(milli: int | None) -> float | None:
    """mW -> W and mJ -> J."""
    return None if milli is None else milli / 1000.0


def _system_text(function_name: str) -> str:
    with _nvml_errors("NVML", function_name):
        return _text(getattr(pynvml, function_name)())


def _optional(query: Callable[[], str]) -> str | None:
    try:
        return query()
    except CdgpcError as e:
        logger.debug("probe: %s", e)
        return None
