"""The GPU interface every backend implements (`GpuDevice`), and the GPUs a node owns (`GpuSet`).

Units are in the names: clocks in MHz, power in W, energy in J. Reaches only `gpu/`, `wire/`,
`errors` and `units` of the package (`tests/unit/test_import_graph.py`). Tests:
`tests/unit/test_gpu_simulated.py`, `tests/unit/test_gpu_nvml.py`.
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from slurm_cdgpc.errors import CdgpcError, GpuError
from slurm_cdgpc.wire.board import BoardDescription, ClockTable, PowerLimitRange

logger = logging.getLogger(__name__)


class ThrottleReason(enum.IntFlag):
    """Why the GPU runs below the requested clock (NVML clocks-event-reason bits)."""

    NONE = 0
    GPU_IDLE = 0x1
    APPLICATIONS_CLOCKS = 0x2
    SW_POWER_CAP = 0x4
    HW_SLOWDOWN = 0x8
    SYNC_BOOST = 0x10
    SW_THERMAL = 0x20
    HW_THERMAL = 0x40
    HW_POWER_BRAKE = 0x80
    DISPLAY_CLOCK = 0x100


@dataclass(frozen=True)
class LockedClocks:
    """What we locked: graphics range and (on GDDR parts) the memory clock."""

    graphics_min_mhz: int
    graphics_max_mhz: int
    memory_mhz: int | None = None


@dataclass(frozen=True)
class GpuReading:
    """One sample of a GPU, taken at ``timestamp_s`` (monotonic seconds of the backend's clock)."""

    uuid: str
    timestamp_s: float
    power_w: float
    energy_j: float
    sm_clock_mhz: int
    memory_clock_mhz: int
    enforced_limit_w: float
    throttle: ThrottleReason = ThrottleReason.NONE


@dataclass(frozen=True)
class MigInstance:
    """One MIG instance of a physical GPU: its own UUID (``MIG-<uuid>``, drivers from 470.42.01)
    and its GPU and compute instance IDs. Slurm names an instance in ``CUDA_VISIBLE_DEVICES`` by
    the UUID, or on older drivers as ``MIG-<parent GPU UUID>/<GI>/<CI>`` (gpu/nvml plugin,
    ``_handle_mig``); `names` gives both."""

    uuid: str
    gpu_instance: int
    compute_instance: int

    def names(self, parent_uuid: str) -> tuple[str, str]:
        return self.uuid, f"MIG-{parent_uuid}/{self.gpu_instance}/{self.compute_instance}"


class GpuDevice(ABC):
    """One physical GPU. Getters never need root; setters do on real hardware.

    Clock control uses *locked* clocks (application clocks are deprecated since CUDA 13): a range
    ``[lowest supported, cap]`` rather than a single clock, so idle GPUs still drop to their idle
    clock. NVML cannot read a lock back, so every backend records what it set (`locked`), and
    `lock_overridden` tells from readings when another process changed it. Power limits are the
    guard rail under the locks: what this process set is recorded too (`power_limit_set_w`); the
    limit the firmware enforces, after every other limiter (a BMC, another ``nvidia-smi -pl``),
    is in each `GpuReading`. Integer milliwatts and millijoules exist only inside the NVML
    backend.
    """

    index: int
    uuid: str
    name: str

    @abstractmethod
    def supported_clocks(self) -> ClockTable: ...

    @abstractmethod
    def power_limit_range(self) -> PowerLimitRange: ...

    @abstractmethod
    def read(self) -> GpuReading:
        """Power, energy counter, clocks, enforced limit and throttle reasons, now."""

    @abstractmethod
    def set_locked_clocks(self, graphics_mhz: int, memory_mhz: int | None = None) -> None:
        """Cap the graphics clock at ``graphics_mhz`` (and lock memory on GDDR parts).

        Refuses (`UnsupportedClockError`) clocks the device does not list. Idempotent: setting
        the same lock twice makes no second driver call.
        """

    @abstractmethod
    def reset_locked_clocks(self) -> None:
        """Remove our locks (graphics and memory). Idempotent."""

    @property
    @abstractmethod
    def locked(self) -> LockedClocks | None:
        """The lock this process set, or None (NVML cannot read a lock back)."""

    @abstractmethod
    def set_power_limit_w(self, limit_w: float) -> None:
        """Set the board's software power limit; the firmware holds it as a ~1 s average.

        Refuses (`UnsupportedPowerLimitError`) a limit outside `power_limit_range` before any
        driver call. Idempotent like `set_locked_clocks`. Other limiters still apply: the
        enforced limit (`GpuReading.enforced_limit_w`) is the lowest of them all.
        """

    @abstractmethod
    def reset_power_limit(self) -> None:
        """Set the software power limit back to the board's default; `power_limit_set_w` is None."""

    @property
    @abstractmethod
    def power_limit_set_w(self) -> float | None:
        """The power limit this process set, or None (none set, or reset since)."""

    def mig_mode(self) -> bool | None:
        """True when MIG is enabled now; None when the board is not MIG-capable or cannot say."""
        return None

    def mig_instances(self) -> tuple[MigInstance, ...]:
        """The MIG instances on this GPU now; () when MIG is off or the board has none."""
        return ()

    def describe(self) -> BoardDescription:
        """This board as NVML reports it: what the head builds its clock grid and limits from."""
        try:
            enforced_limit_w: float | None = self.read().enforced_limit_w
        except GpuError as e:
            logger.debug("%s: no enforced limit for the description: %s", self.uuid, e)
            enforced_limit_w = None
        try:
            mig_mode = self.mig_mode()
        except GpuError as e:
            logger.debug("%s: MIG mode unknown: %s", self.uuid, e)
            mig_mode = None
        return BoardDescription(
            name=self.name,
            uuid=self.uuid,
            clocks=self.supported_clocks(),
            power_limit=self.power_limit_range(),
            enforced_limit_w=enforced_limit_w,
            mig_mode=mig_mode,
        )


def lock_overridden(
    readings: Sequence[GpuReading], locked: LockedClocks | None, *, consecutive: int = 3
) -> bool:
    """True when the last ``consecutive`` readings of one GPU show a lock other than ``locked``.

    NVML cannot read a lock back, so the sign is the one no limiter can cause: a busy GPU (no
    GPU_IDLE reason) running its SM clock above our cap, or (when we locked memory) a memory
    clock other than ours, read after read. Power caps, thermal and brake slowdowns only lower
    clocks, so a clock below the cap is never taken for an override. One odd sample (a read
    racing our own lock change) is not enough: it takes ``consecutive`` in a row.
    """
    if locked is None or consecutive < 1 or len(readings) < consecutive:
        return False

    def differs(reading: GpuReading) -> bool:
        if ThrottleReason.GPU_IDLE in reading.throttle:
            return False
        if reading.sm_clock_mhz > locked.graphics_max_mhz:
            return True
        return locked.memory_mhz is not None and reading.memory_clock_mhz != locked.memory_mhz

    return all(differs(r) for r in readings[-consecutive:])


@dataclass
class GpuSet:
    """The GPUs a node owns, addressed by index (as in ``SLURM_JOB_GPUS``) or UUID."""

    devices: Sequence[GpuDevice]
    _by_uuid: dict[str, GpuDevice] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._by_uuid = {d.uuid: d for d in self.devices}

    def __len__(self) -> int:
        return len(self.devices)

    def __iter__(self) -> Iterator[GpuDevice]:
        return iter(self.devices)

    def __getitem__(self, index: int) -> GpuDevice:
        for dev in self.devices:
            if dev.index == index:
                return dev
        raise CdgpcError(f"no GPU with index {index} on this node")

    def by_uuid(self, uuid: str) -> GpuDevice:
        try:
            return self._by_uuid[uuid]
        except KeyError:
            raise CdgpcError(f"no GPU with UUID {uuid} on this node") from None

    def mig_parents(self, names: Sequence[str]) -> dict[str, int]:
        """Each of ``names`` that names a MIG instance here (either of `MigInstance.names`) ->
        the index of its physical GPU; names not found are left out. Clocks and power belong
        to the physical GPU, so the jobs on its instances are its tenants. A GPU whose
        instances cannot be read is skipped (logged): its names stay unresolved."""
        wanted = set(names)
        found: dict[str, int] = {}
        for dev in self.devices:
            if len(found) == len(wanted):
                break
            try:
                if not dev.mig_mode():
                    continue
                instances = dev.mig_instances()
            except GpuError as e:
                logger.warning("GPU %d: cannot list its MIG instances: %s", dev.index, e)
                continue
            for instance in instances:
                for name in instance.names(dev.uuid):
                    if name in wanted:
                        found[name] = dev.index
        return found

    def read_all(self) -> tuple[list[GpuReading], list[tuple[GpuDevice, GpuError]]]:
        """Read every GPU; a GPU that fails is reported, not fatal for the others."""
        readings: list[GpuReading] = []
        failed: list[tuple[GpuDevice, GpuError]] = []
        for dev in self.devices:
            try:
                readings.append(dev.read())
            except GpuError as e:
                failed.append((dev, e))
        return readings, failed

    def reset_all(self) -> list[tuple[GpuDevice, CdgpcError]]:
        """Reset every GPU's locks, trying all of them even when some fail (a permission error
        on one GPU included: leaving the others locked would be worse). A GPU in MIG mode has
        none to reset (clock control is not offered there, and turning MIG on resets the GPU):
        its power limit is the caller's to reset."""
        failed: list[tuple[GpuDevice, CdgpcError]] = []
        for dev in self.devices:
            try:
                if dev.mig_mode():
                    continue
            except GpuError:
                pass  # cannot say: reset it as any other
            try:
                dev.reset_locked_clocks()
            except CdgpcError as e:
                failed.append((dev, e))
        return failed
