"""The NVML backend against a fake NVML patched in at the pynvml seam (no GPU needed).

Only the pynvml *functions* are replaced, so the real `pynvml.NVMLError_*` classes are raised.
Every NVML call the backend makes is recorded; setters the fake does not model (power limits,
persistence, application clocks, GPU reset...) fail the test if called.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml
import pytest

from slurm_cdgpc.errors import (
    CdgpcError,
    GpuError,
    GpuLostError,
    GpuNotSupportedError,
    GpuPermissionError,
    GpuUnavailableError,
    InputError,
    PowerLimitPermissionError,
    UnsupportedClockError,
    UnsupportedPowerLimitError,
)
from slurm_cdgpc.gpu.device import LockedClocks, ThrottleReason, lock_overridden
from slurm_cdgpc.gpu.nvml import NvmlGpu, NvmlGpuSet, nvml_is_available, open_nvml_gpus, probe
from slurm_cdgpc.wire.board import PowerLimitRange

DATA = Path(__file__).resolve().parent.parent / "data" / "nvml"
PACKAGE = Path(__file__).resolve().parent.parent.parent / "slurm_cdgpc"

# Anything that changes device state: Set*, Reset*, Clear* at any NVML object level.
SETTER = re.compile(
    r"^nvml(Device|System|Unit|GpuInstance|ComputeInstance|Vgpu\w*?)?(Set|Reset|Clear)"
)
MODELLED_SETTERS = (
    "nvmlDeviceSetPowerManagementLimit",
    "nvmlDeviceSetGpuLockedClocks",
    "nvmlDeviceSetMemoryLockedClocks",
    "nvmlDeviceResetGpuLockedClocks",
    "nvmlDeviceResetMemoryLockedClocks",
)
# pynvml function -> the FakeNvml method that answers it.
FAKE_METHODS = {
    "nvmlInit": "init",
    "nvmlShutdown": "shutdown",
    "nvmlDeviceGetCount": "device_get_count",
    "nvmlDeviceGetHandleByIndex": "device_get_handle_by_index",
    "nvmlSystemGetDriverVersion": "system_get_driver_version",
    "nvmlSystemGetNVMLVersion": "system_get_nvml_version",
    "nvmlDeviceGetUUID": "device_get_uuid",
    "nvmlDeviceGetName": "device_get_name",
    "nvmlDeviceGetSupportedMemoryClocks": "device_get_supported_memory_clocks",
    "nvmlDeviceGetSupportedGraphicsClocks": "device_get_supported_graphics_clocks",
    "nvmlDeviceGetPowerManagementLimitConstraints": "device_get_power_management_limit_constraints",
    "nvmlDeviceGetPowerManagementDefaultLimit": "device_get_power_management_default_limit",
    "nvmlDeviceGetEnforcedPowerLimit": "device_get_enforced_power_limit",
    "nvmlDeviceGetPowerUsage": "device_get_power_usage",
    "nvmlDeviceGetTotalEnergyConsumption": "device_get_total_energy_consumption",
    "nvmlDeviceGetClockInfo": "device_get_clock_info",
    "nvmlDeviceGetCurrentClocksEventReasons": "device_get_current_clocks_event_reasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons": "device_get_current_clocks_throttle_reasons",
    "nvmlDeviceGetFieldValues": "device_get_field_values",
    "nvmlDeviceGetMigMode": "device_get_mig_mode",
    "nvmlDeviceGetMaxMigDeviceCount": "device_get_max_mig_device_count",
    "nvmlDeviceGetMigDeviceHandleByIndex": "device_get_mig_device_handle_by_index",
    "nvmlDeviceGetGpuInstanceId": "device_get_gpu_instance_id",
    "nvmlDeviceGetComputeInstanceId": "device_get_compute_instance_id",
    "nvmlDeviceSetPowerManagementLimit": "device_set_power_management_limit",
    "nvmlDeviceSetGpuLockedClocks": "device_set_gpu_locked_clocks",
    "nvmlDeviceSetMemoryLockedClocks": "device_set_memory_locked_clocks",
    "nvmlDeviceResetGpuLockedClocks": "device_reset_gpu_locked_clocks",
    "nvmlDeviceResetMemoryLockedClocks": "device_reset_memory_locked_clocks",
}

Value = int | Callable[[], int]


class FakeClock:
    """Monotonic seconds that advance only when the code under test sleeps (integer µs ticks)."""

    def __init__(self) -> None:
        self.ticks_us = 0

    def __call__(self) -> float:
        return self.ticks_us / 1e6

    def sleep(self, seconds: float) -> None:
        self.ticks_us += round(seconds * 1e6)


@dataclass(frozen=True)
class FakeHandle:
    index: int


@dataclass(frozen=True)
class FakeMigHandle:
    """A MIG device: the ``slot``-th instance of physical GPU ``index``."""

    index: int
    slot: int


@dataclass
class FakeDevice:
    """What one fake GPU answers; ``fail`` maps an NVML function name to the error it raises."""

    name: str | bytes
    uuid: str | bytes
    memory_mhz: list[int]
    graphics_mhz: dict[int, list[int]]
    limits_mw: tuple[int, int] = (100_000, 400_000)
    default_limit_mw: int = 400_000
    enforced_limit_mw: Value = 400_000
    requested_limit_mw: int = 400_000
    power_mw: Value = 251_234
    energy_mj: Value = 123_456_789
    instant_mw: Value = 260_000
    instant_return: int = pynvml.NVML_SUCCESS
    sm_clock_mhz: int = 1410
    memory_clock_mhz: int = 1593
    reasons: int = 0
    mig_mode: tuple[int, int] | None = None  # (current, pending); None: NOT_SUPPORTED
    #: MIG slot -> (UUID, GPU instance ID, compute instance ID); slots not listed are empty
    mig_devices: dict[int, tuple[str, int, int]] = field(default_factory=dict)
    mig_slots: int = 7
    fail: dict[str, int] = field(default_factory=dict)


def _value(value: Value) -> int:
    return value() if callable(value) else value


def a100_sxm4_80gb(uuid: str = "GPU-a100-0000") -> FakeDevice:
    """Modelled on published A100-SXM4-80GB values: HBM, one memory clock, 15 MHz steps."""
    return FakeDevice(
        name="NVIDIA A100-SXM4-80GB",
        uuid=uuid,
        memory_mhz=[1593],
        graphics_mhz={1593: list(range(1410, 209, -15))},
    )


def a40() -> FakeDevice:
    """A GDDR part with two memory clocks, each with its own graphics list (modelled, unsorted)."""
    return FakeDevice(
        name=b"NVIDIA A40",
        uuid=b"GPU-a40-0001",
        memory_mhz=[405, 7251],
        graphics_mhz={7251: list(range(210, 1741, 15)), 405: list(range(285, 421, 15))},
        limits_mw=(100_000, 300_000),
        default_limit_mw=300_000,
        enforced_limit_mw=300_000,
        sm_clock_mhz=1740,
        memory_clock_mhz=7251,
    )


def recorded_device(gpu: str) -> FakeDevice:
    """A device whose clock lists are the recorded ``nvidia-smi`` ones (tests/data/nvml)."""
    graphics: dict[int, list[int]] = {}
    with (DATA / "supported_clocks.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            if row["gpu"] == gpu:
                graphics.setdefault(int(row["memory_clock_mhz"]), []).append(
                    int(row["graphics_clock_mhz"])
                )
    return FakeDevice(name=gpu, uuid=f"GPU-{gpu}", memory_mhz=list(graphics), graphics_mhz=graphics)


class FakeNvml:
    """Answers the pynvml functions from `FakeDevice` tables and records every call."""

    def __init__(self, devices: list[FakeDevice]) -> None:
        self.devices = devices
        self.calls: list[tuple[Any, ...]] = []
        self.init_error: int | None = None
        self.initialised = 0
        self.shut_down = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name, method in FAKE_METHODS.items():
            monkeypatch.setattr(pynvml, name, getattr(self, method))
        for name in dir(pynvml):
            if SETTER.match(name) and name not in MODELLED_SETTERS:
                monkeypatch.setattr(pynvml, name, self._forbidden(name))

    def _forbidden(self, name: str) -> Callable[..., None]:
        def call(*args: object) -> None:
            self.calls.append((name, *args))
            raise AssertionError(f"the NVML backend must never call {name}")

        return call

    def setter_calls(self) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if SETTER.match(c[0])]

    def count(self, name: str) -> int:
        return sum(1 for c in self.calls if c[0] == name)

    def _device(self, name: str, handle: FakeHandle, *args: object) -> FakeDevice:
        self.calls.append((name, handle.index, *args))
        device = self.devices[handle.index]
        if name in device.fail:
            raise pynvml.NVMLError(device.fail[name])  # pynvml makes it the NVMLError_* subclass
        return device

    # -- library ------------------------------------------------------------------------------
    def init(self) -> None:
        self.calls.append(("nvmlInit",))
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialised += 1

    def shutdown(self) -> None:
        self.calls.append(("nvmlShutdown",))
        self.shut_down += 1

    def device_get_count(self) -> int:
        self.calls.append(("nvmlDeviceGetCount",))
        return len(self.devices)

    def device_get_handle_by_index(self, index: int) -> FakeHandle:
        self.calls.append(("nvmlDeviceGetHandleByIndex", index))
        return FakeHandle(index)

    def system_get_driver_version(self) -> str:
        return "580.82.07"

    def system_get_nvml_version(self) -> bytes:
        return b"13.580.82.07"

    # -- device getters -----------------------------------------------------------------------
    def device_get_uuid(self, h: FakeHandle | FakeMigHandle) -> str | bytes:
        if isinstance(h, FakeMigHandle):
            return self._mig("nvmlDeviceGetUUID", h)[0]
        return self._device("nvmlDeviceGetUUID", h).uuid

    def _mig(self, name: str, h: FakeMigHandle) -> tuple[str, int, int]:
        self.calls.append((name, h.index, h.slot))
        return self.devices[h.index].mig_devices[h.slot]

    def device_get_max_mig_device_count(self, h: FakeHandle) -> int:
        device = self._device("nvmlDeviceGetMaxMigDeviceCount", h)
        if device.mig_mode is None:
            raise pynvml.NVMLError_NotSupported()
        return device.mig_slots

    def device_get_mig_device_handle_by_index(self, h: FakeHandle, slot: int) -> FakeMigHandle:
        device = self._device("nvmlDeviceGetMigDeviceHandleByIndex", h, slot)
        if slot not in device.mig_devices:
            raise pynvml.NVMLError_NotFound()
        return FakeMigHandle(h.index, slot)

    def device_get_gpu_instance_id(self, h: FakeMigHandle) -> int:
        return self._mig("nvmlDeviceGetGpuInstanceId", h)[1]

    def device_get_compute_instance_id(self, h: FakeMigHandle) -> int:
        return self._mig("nvmlDeviceGetComputeInstanceId", h)[2]

    def device_get_name(self, h: FakeHandle) -> str | bytes:
        return self._device("nvmlDeviceGetName", h).name

    def device_get_supported_memory_clocks(self, h: FakeHandle) -> list[int]:
        return list(self._device("nvmlDeviceGetSupportedMemoryClocks", h).memory_mhz)

    def device_get_supported_graphics_clocks(self, h: FakeHandle, memory_mhz: int) -> list[int]:
        device = self._device("nvmlDeviceGetSupportedGraphicsClocks", h, memory_mhz)
        if memory_mhz not in device.graphics_mhz:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return list(device.graphics_mhz[memory_mhz])

    def device_get_power_management_limit_constraints(self, h: FakeHandle) -> list[int]:
        return list(self._device("nvmlDeviceGetPowerManagementLimitConstraints", h).limits_mw)

    def device_get_power_management_default_limit(self, h: FakeHandle) -> int:
        return self._device("nvmlDeviceGetPowerManagementDefaultLimit", h).default_limit_mw

    def device_get_enforced_power_limit(self, h: FakeHandle) -> int:
        return _value(self._device("nvmlDeviceGetEnforcedPowerLimit", h).enforced_limit_mw)

    def device_get_power_usage(self, h: FakeHandle) -> int:
        return _value(self._device("nvmlDeviceGetPowerUsage", h).power_mw)

    def device_get_total_energy_consumption(self, h: FakeHandle) -> int:
        return _value(self._device("nvmlDeviceGetTotalEnergyConsumption", h).energy_mj)

    def device_get_clock_info(self, h: FakeHandle, clock_type: int) -> int:
        device = self._device("nvmlDeviceGetClockInfo", h, clock_type)
        clocks = {pynvml.NVML_CLOCK_SM: device.sm_clock_mhz}
        clocks[pynvml.NVML_CLOCK_MEM] = device.memory_clock_mhz
        return clocks[clock_type]

    def device_get_current_clocks_event_reasons(self, h: FakeHandle) -> int:
        return self._device("nvmlDeviceGetCurrentClocksEventReasons", h).reasons

    def device_get_current_clocks_throttle_reasons(self, h: FakeHandle) -> int:
        return self._device("nvmlDeviceGetCurrentClocksThrottleReasons", h).reasons

    def device_get_field_values(self, h: FakeHandle, field_ids: list[int]) -> Any:
        device = self._device("nvmlDeviceGetFieldValues", h, tuple(field_ids))
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for value, field_id in zip(values, field_ids, strict=True):
            assert field_id == pynvml.NVML_FI_DEV_POWER_INSTANT
            value.fieldId = field_id
            value.nvmlReturn = device.instant_return
            value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
            value.value.uiVal = _value(device.instant_mw)
        return values

    def device_get_mig_mode(self, h: FakeHandle) -> list[int]:
        device = self._device("nvmlDeviceGetMigMode", h)
        if device.mig_mode is None:
            raise pynvml.NVMLError_NotSupported()
        return list(device.mig_mode)

    # -- setters ------------------------------------------------------------------------------
    def device_set_power_management_limit(self, h: FakeHandle, limit_mw: int) -> None:
        device = self._device("nvmlDeviceSetPowerManagementLimit", h, limit_mw)
        low, high = device.limits_mw
        if not low <= limit_mw <= high:
            raise pynvml.NVMLError_InvalidArgument()
        device.requested_limit_mw = limit_mw

    def device_set_gpu_locked_clocks(self, h: FakeHandle, min_mhz: int, max_mhz: int) -> None:
        self._device("nvmlDeviceSetGpuLockedClocks", h, min_mhz, max_mhz)

    def device_set_memory_locked_clocks(self, h: FakeHandle, min_mhz: int, max_mhz: int) -> None:
        self._device("nvmlDeviceSetMemoryLockedClocks", h, min_mhz, max_mhz)

    def device_reset_gpu_locked_clocks(self, h: FakeHandle) -> None:
        self._device("nvmlDeviceResetGpuLockedClocks", h)

    def device_reset_memory_locked_clocks(self, h: FakeHandle) -> None:
        self._device("nvmlDeviceResetMemoryLockedClocks", h)


OpenGpus = Callable[..., tuple[FakeNvml, NvmlGpuSet]]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> Callable[..., FakeNvml]:
    """Install a fake NVML serving the given devices."""

    def make(*devices: FakeDevice) -> FakeNvml:
        nvml = FakeNvml(list(devices))
        nvml.install(monkeypatch)
        return nvml

    return make


@pytest.fixture
def open_gpus(fake_nvml: Callable[..., FakeNvml], clock: FakeClock) -> Iterator[OpenGpus]:
    """Open the given fake devices through `open_nvml_gpus`; closed again after the test."""
    opened: list[NvmlGpuSet] = []

    def make(*devices: FakeDevice) -> tuple[FakeNvml, NvmlGpuSet]:
        nvml = fake_nvml(*devices)
        gpus = open_nvml_gpus(clock=clock)
        opened.append(gpus)
        return nvml, gpus

    yield make
    for gpus in opened:
        gpus.close()


def only_gpu(gpus: NvmlGpuSet) -> NvmlGpu:
    (gpu,) = list(gpus)
    return gpu


# -- error translation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (pynvml.NVML_ERROR_NO_PERMISSION, GpuPermissionError),
        (pynvml.NVML_ERROR_NOT_SUPPORTED, GpuNotSupportedError),
        (pynvml.NVML_ERROR_GPU_IS_LOST, GpuLostError),
        (pynvml.NVML_ERROR_RESET_REQUIRED, GpuLostError),
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, GpuUnavailableError),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, GpuUnavailableError),
        (pynvml.NVML_ERROR_UNINITIALIZED, GpuUnavailableError),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, GpuUnavailableError),
        (pynvml.NVML_ERROR_INVALID_ARGUMENT, GpuError),
        (pynvml.NVML_ERROR_TIMEOUT, GpuError),
        (pynvml.NVML_ERROR_NO_DATA, GpuError),
        (pynvml.NVML_ERROR_UNKNOWN, GpuError),
    ],
)
def test_nvml_errors_are_translated_naming_gpu_and_operation(
    open_gpus: OpenGpus, code: int, expected: type[CdgpcError]
) -> None:
    device = a100_sxm4_80gb()
    _, gpus = open_gpus(device)
    device.fail["nvmlDeviceGetPowerUsage"] = code
    with pytest.raises(CdgpcError) as info:
        only_gpu(gpus).read()
    assert type(info.value) is expected
    message = str(info.value)
    assert "GPU 0 (GPU-a100-0000)" in message
    assert "read power usage" in message
    assert "\n" not in message
    assert isinstance(info.value.__cause__, pynvml.NVMLError)
    assert info.value.__cause__.value == code


def test_permission_error_on_a_setter_names_the_lock_and_the_remedy(open_gpus: OpenGpus) -> None:
    device = a100_sxm4_80gb()
    device.fail["nvmlDeviceSetGpuLockedClocks"] = pynvml.NVML_ERROR_NO_PERMISSION
    _, gpus = open_gpus(device)
    with pytest.raises(
        GpuPermissionError, match=r"lock graphics clocks 210\.\.1200 MHz.*SYS_ADMIN"
    ):
        only_gpu(gpus).set_locked_clocks(1200)
    assert only_gpu(gpus).locked is None


def test_missing_library_is_unavailable_and_probe_says_false(
    fake_nvml: Callable[..., FakeNvml],
) -> None:
    nvml = fake_nvml(a100_sxm4_80gb())
    nvml.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    with pytest.raises(GpuUnavailableError, match="NVML: initialise failed") as info:
        open_nvml_gpus()
    assert isinstance(info.value.__cause__, pynvml.NVMLError_LibraryNotFound)
    assert nvml_is_available() is False


def test_nvml_is_available_initialises_and_shuts_down(fake_nvml: Callable[..., FakeNvml]) -> None:
    nvml = fake_nvml(a100_sxm4_80gb())
    assert nvml_is_available() is True
    assert (nvml.initialised, nvml.shut_down) == (1, 1)
    empty = fake_nvml()
    assert nvml_is_available() is False
    assert (empty.initialised, empty.shut_down) == (1, 1)


# -- opening ----------------------------------------------------------------------------------


def test_open_decodes_bytes_and_closes_nvml_once(
    fake_nvml: Callable[..., FakeNvml], clock: FakeClock
) -> None:
    nvml = fake_nvml(a100_sxm4_80gb(), a40())
    with open_nvml_gpus(clock=clock) as gpus:
        assert [(g.index, g.uuid, g.name) for g in gpus] == [
            (0, "GPU-a100-0000", "NVIDIA A100-SXM4-80GB"),
            (1, "GPU-a40-0001", "NVIDIA A40"),
        ]
        assert gpus.by_uuid("GPU-a40-0001") is gpus[1]
        gpus.close()
    assert nvml.shut_down == 1


def test_open_selected_indices_only(fake_nvml: Callable[..., FakeNvml]) -> None:
    fake_nvml(a100_sxm4_80gb("GPU-0"), a100_sxm4_80gb("GPU-1"), a40())
    with open_nvml_gpus([1]) as gpus:
        assert [g.uuid for g in gpus] == ["GPU-1"]


@pytest.mark.parametrize(
    ("indices", "expected"),
    [([0, 2], GpuUnavailableError), ([-1], GpuUnavailableError), ([0, 0], InputError)],
)
def test_open_refuses_bad_indices_and_shuts_nvml_down(
    fake_nvml: Callable[..., FakeNvml], indices: list[int], expected: type[CdgpcError]
) -> None:
    nvml = fake_nvml(a100_sxm4_80gb(), a40())
    with pytest.raises(expected):
        open_nvml_gpus(indices)
    assert (nvml.initialised, nvml.shut_down) == (1, 1)


def test_open_with_no_gpus_is_unavailable(fake_nvml: Callable[..., FakeNvml]) -> None:
    nvml = fake_nvml()
    with pytest.raises(GpuUnavailableError, match="no GPUs"):
        open_nvml_gpus()
    assert nvml.shut_down == 1


# -- supported clocks and limits --------------------------------------------------------------


def test_clock_table_is_sorted_descending_and_queried_once(open_gpus: OpenGpus) -> None:
    nvml, gpus = open_gpus(a40())
    gpu = only_gpu(gpus)
    table = gpu.supported_clocks()
    assert table.memory_mhz == (7251, 405)
    assert table.graphics_for(7251)[:2] == (1740, 1725)
    assert table.graphics_for(7251)[-1] == 210
    assert table.graphics_for(405) == tuple(range(420, 284, -15))
    queries = len(nvml.calls)
    assert gpu.supported_clocks() is table
    assert len(nvml.calls) == queries


@pytest.mark.parametrize(
    ("gpu_name", "memory_mhz", "levels", "min_mhz", "max_mhz"),
    [
        ("Tesla V100-PCIE-32GB", (877,), 167, 135, 1380),
        ("NVIDIA A100-PCIE-40GB", (1215,), 81, 210, 1410),
        ("NVIDIA H100 NVL (94GB)", (2619, 1593), 97, 345, 1785),
    ],
)
def test_recorded_clock_tables(
    open_gpus: OpenGpus,
    gpu_name: str,
    memory_mhz: tuple[int, ...],
    levels: int,
    min_mhz: int,
    max_mhz: int,
) -> None:
    _, gpus = open_gpus(recorded_device(gpu_name))
    table = only_gpu(gpus).supported_clocks()
    assert table.memory_mhz == memory_mhz
    for mem in memory_mhz:
        graphics = table.graphics_for(mem)
        assert (len(graphics), graphics[-1], graphics[0]) == (levels, min_mhz, max_mhz)
        assert list(graphics) == sorted(graphics, reverse=True)


def test_power_limit_range_in_watts(open_gpus: OpenGpus) -> None:
    device = a100_sxm4_80gb()
    device.limits_mw, device.default_limit_mw = (100_500, 400_000), 350_250
    _, gpus = open_gpus(device)
    assert only_gpu(gpus).power_limit_range() == PowerLimitRange(100.5, 400.0, 350.25)


# -- locking ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make_device", "graphics_mhz", "memory_mhz"),
    [
        (a100_sxm4_80gb, 1412, None),  # between two 15 MHz levels
        (a100_sxm4_80gb, 1425, None),  # above the maximum
        (a100_sxm4_80gb, 1200, 1215),  # memory clock of another A100 model
        (a40, 1740, 405),  # graphics clock only valid with the other memory clock
        (a40, 1200, 5001),  # memory clock not listed
    ],
)
def test_unsupported_clocks_are_refused_before_any_setter(
    open_gpus: OpenGpus,
    make_device: Callable[[], FakeDevice],
    graphics_mhz: int,
    memory_mhz: int | None,
) -> None:
    nvml, gpus = open_gpus(make_device())
    gpu = only_gpu(gpus)
    with pytest.raises(UnsupportedClockError):
        gpu.set_locked_clocks(graphics_mhz, memory_mhz)
    assert nvml.setter_calls() == []
    assert gpu.locked is None


def test_lock_caps_graphics_over_lowest_to_cap_and_skips_memory_on_hbm(
    open_gpus: OpenGpus,
) -> None:
    nvml, gpus = open_gpus(a100_sxm4_80gb())
    gpu = only_gpu(gpus)
    gpu.set_locked_clocks(1200, 1593)
    assert nvml.setter_calls() == [("nvmlDeviceSetGpuLockedClocks", 0, 210, 1200)]
    assert gpu.locked == LockedClocks(210, 1200, None)


def test_lock_on_gddr_locks_memory_and_uses_that_memory_clocks_floor(
    open_gpus: OpenGpus,
) -> None:
    nvml, gpus = open_gpus(a40())
    gpu = only_gpu(gpus)
    gpu.set_locked_clocks(1200, 7251)
    gpu.set_locked_clocks(390, 405)
    assert nvml.setter_calls() == [
        ("nvmlDeviceSetGpuLockedClocks", 0, 210, 1200),
        ("nvmlDeviceSetMemoryLockedClocks", 0, 7251, 7251),
        ("nvmlDeviceSetGpuLockedClocks", 0, 285, 390),
        ("nvmlDeviceSetMemoryLockedClocks", 0, 405, 405),
    ]
    assert gpu.locked == LockedClocks(285, 390, 405)


def test_lock_on_gddr_without_memory_clock_leaves_memory_free(open_gpus: OpenGpus) -> None:
    nvml, gpus = open_gpus(a40())
    gpu = only_gpu(gpus)
    gpu.set_locked_clocks(1200)
    assert nvml.setter_calls() == [("nvmlDeviceSetGpuLockedClocks", 0, 210, 1200)]
    gpu.set_locked_clocks(1200, 7251)
    gpu.set_locked_clocks(1200)
    assert nvml.setter_calls()[1:] == [
        ("nvmlDeviceSetMemoryLockedClocks", 0, 7251, 7251),
        ("nvmlDeviceResetMemoryLockedClocks", 0),
    ]
    assert gpu.locked == LockedClocks(210, 1200, None)


def test_recorded_h100_nvl_lists_two_memory_clocks_so_memory_is_locked(
    open_gpus: OpenGpus,
) -> None:
    nvml, gpus = open_gpus(recorded_device("NVIDIA H100 NVL (94GB)"))
    only_gpu(gpus).set_locked_clocks(1500, 1593)
    assert nvml.setter_calls() == [
        ("nvmlDeviceSetGpuLockedClocks", 0, 345, 1500),
        ("nvmlDeviceSetMemoryLockedClocks", 0, 1593, 1593),
    ]


def test_same_lock_twice_makes_one_driver_call(open_gpus: OpenGpus) -> None:
    nvml, gpus = open_gpus(a40())
    gpu = only_gpu(gpus)
    gpu.set_locked_clocks(1200, 7251)
    gpu.set_locked_clocks(1200, 7251)
    assert len(nvml.setter_calls()) == 2  # one graphics lock, one memory lock
    gpu.set_locked_clocks(1215, 7251)
    assert nvml.setter_calls()[2:] == [("nvmlDeviceSetGpuLockedClocks", 0, 210, 1215)]
    gpu.reset_locked_clocks()
    calls = len(nvml.setter_calls())
    gpu.set_locked_clocks(1215, 7251)
    assert len(nvml.setter_calls()) == calls + 2  # after a reset the lock is applied again


def test_failed_memory_lock_leaves_locked_describing_the_graphics_lock(
    open_gpus: OpenGpus,
) -> None:
    device = a40()
    nvml, gpus = open_gpus(device)
    gpu = only_gpu(gpus)
    device.fail["nvmlDeviceSetMemoryLockedClocks"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    with pytest.raises(GpuNotSupportedError, match="lock memory clock 7251 MHz"):
        gpu.set_locked_clocks(1200, 7251)
    assert gpu.locked == LockedClocks(210, 1200, None)

    del device.fail["nvmlDeviceSetMemoryLockedClocks"]
    gpu.set_locked_clocks(1200, 7251)
    assert nvml.setter_calls()[-1] == ("nvmlDeviceSetMemoryLockedClocks", 0, 7251, 7251)
    device.fail["nvmlDeviceSetMemoryLockedClocks"] = pynvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(GpuLostError):
        gpu.set_locked_clocks(390, 405)
    assert gpu.locked == LockedClocks(285, 390, 7251)


def test_failed_graphics_lock_changes_nothing_and_skips_memory(open_gpus: OpenGpus) -> None:
    device = a40()
    device.fail["nvmlDeviceSetGpuLockedClocks"] = pynvml.NVML_ERROR_INVALID_ARGUMENT
    nvml, gpus = open_gpus(device)
    gpu = only_gpu(gpus)
    with pytest.raises(GpuError):
        gpu.set_locked_clocks(1200, 7251)
    assert nvml.count("nvmlDeviceSetMemoryLockedClocks") == 0
    assert gpu.locked is None


# -- reset ------------------------------------------------------------------------------------


def test_reset_calls_nvml_even_when_nothing_was_locked(open_gpus: OpenGpus) -> None:
    nvml, gpus = open_gpus(a40())
    gpu = only_gpu(gpus)
    gpu.reset_locked_clocks()
    gpu.reset_locked_clocks()
    assert (
        nvml.setter_calls()
        == [
            ("nvmlDeviceResetGpuLockedClocks", 0),
            ("nvmlDeviceResetMemoryLockedClocks", 0),
        ]
        * 2
    )
    assert gpu.locked is None


def test_reset_tolerates_memory_not_supported(open_gpus: OpenGpus) -> None:
    device = a100_sxm4_80gb()
    device.fail["nvmlDeviceResetMemoryLockedClocks"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    _, gpus = open_gpus(device)
    gpu = only_gpu(gpus)
    gpu.set_locked_clocks(1200)
    gpu.reset_locked_clocks()
    assert gpu.locked is None


def test_reset_tries_memory_after_graphics_fails_and_raises_the_first_error(
    open_gpus: OpenGpus,
) -> None:
    device = a40()
    nvml, gpus = open_gpus(device)
    gpu = only_gpu(gpus)
    gpu.set_locked_clocks(1200, 7251)
    device.fail["nvmlDeviceResetGpuLockedClocks"] = pynvml.NVML_ERROR_NO_PERMISSION
    device.fail["nvmlDeviceResetMemoryLockedClocks"] = pynvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(GpuPermissionError, match="reset graphics clock lock"):
        gpu.reset_locked_clocks()
    assert nvml.count("nvmlDeviceResetMemoryLockedClocks") == 1
    assert gpu.locked == LockedClocks(210, 1200, 7251)

    del device.fail["nvmlDeviceResetMemoryLockedClocks"]
    with pytest.raises(GpuPermissionError):
        gpu.reset_locked_clocks()
    assert gpu.locked == LockedClocks(210, 1200, None)  # memory reset worked, graphics did not


def test_reset_raises_memory_error_after_graphics_reset_worked(open_gpus: OpenGpus) -> None:
    device = a40()
    _, gpus = open_gpus(device)
    gpu = only_gpu(gpus)
    gpu.set_locked_clocks(1200, 7251)
    device.fail["nvmlDeviceResetMemoryLockedClocks"] = pynvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(GpuLostError, match="reset memory clock lock"):
        gpu.reset_locked_clocks()


# -- reading ----------------------------------------------------------------------------------


def test_read_converts_units_and_decodes_throttle_reasons(
    open_gpus: OpenGpus, clock: FakeClock
) -> None:
    device = a100_sxm4_80gb()
    device.enforced_limit_mw = 350_500
    device.sm_clock_mhz, device.memory_clock_mhz = 1275, 1593
    device.reasons = 0x4 | 0x80 | 0x400  # SwPowerCap | HwPowerBrake | Reliability (newer bit)
    _, gpus = open_gpus(device)
    clock.sleep(12.5)
    reading = only_gpu(gpus).read()
    assert reading.uuid == "GPU-a100-0000"
    assert reading.timestamp_s == 12.5
    assert reading.power_w == pytest.approx(251.234)
    assert reading.energy_j == pytest.approx(123_456.789)
    assert reading.enforced_limit_w == pytest.approx(350.5)
    assert (reading.sm_clock_mhz, reading.memory_clock_mhz) == (1275, 1593)
    assert reading.throttle == ThrottleReason.SW_POWER_CAP | ThrottleReason.HW_POWER_BRAKE


@pytest.mark.parametrize("old", ["missing function", "old driver"])
def test_throttle_reasons_fall_back_to_the_deprecated_call(
    open_gpus: OpenGpus, monkeypatch: pytest.MonkeyPatch, old: str
) -> None:
    device = a100_sxm4_80gb()
    device.reasons = 0x1
    nvml, gpus = open_gpus(device)
    if old == "missing function":
        monkeypatch.delattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons")
    else:
        device.fail["nvmlDeviceGetCurrentClocksEventReasons"] = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    gpu = only_gpu(gpus)
    assert gpu.read().throttle == ThrottleReason.GPU_IDLE
    assert gpu.read().throttle == ThrottleReason.GPU_IDLE
    assert nvml.count("nvmlDeviceGetCurrentClocksThrottleReasons") == 2
    assert nvml.count("nvmlDeviceGetCurrentClocksEventReasons") <= 1


def test_energy_is_integrated_from_power_without_an_energy_counter(
    open_gpus: OpenGpus, clock: FakeClock
) -> None:
    power_mw = [100_000]
    device = a100_sxm4_80gb()
    device.power_mw = lambda: power_mw[0]
    device.fail["nvmlDeviceGetTotalEnergyConsumption"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    nvml, gpus = open_gpus(device)
    gpu = only_gpu(gpus)
    energies_j = []
    for step_s, watts in [(0.0, 100), (1.0, 200), (2.0, 200), (0.5, 0)]:
        clock.sleep(step_s)
        power_mw[0] = watts * 1000
        energies_j.append(gpu.read().energy_j)
    # trapezoid: 0, (100+200)/2*1 = 150, +200*2 = 550, +(200+0)/2*0.5 = 600
    assert energies_j == pytest.approx([0.0, 150.0, 550.0, 600.0])
    assert nvml.count("nvmlDeviceGetTotalEnergyConsumption") == 1


def test_energy_counter_other_errors_are_not_masked(open_gpus: OpenGpus) -> None:
    device = a100_sxm4_80gb()
    device.fail["nvmlDeviceGetTotalEnergyConsumption"] = pynvml.NVML_ERROR_GPU_IS_LOST
    _, gpus = open_gpus(device)
    with pytest.raises(GpuLostError, match="energy"):
        only_gpu(gpus).read()


# -- the set ----------------------------------------------------------------------------------


def test_read_all_and_reset_all_keep_going_past_a_lost_gpu(open_gpus: OpenGpus) -> None:
    lost, healthy = a100_sxm4_80gb("GPU-lost"), a100_sxm4_80gb("GPU-ok")
    nvml, gpus = open_gpus(lost, healthy)
    lost.fail["nvmlDeviceGetPowerUsage"] = pynvml.NVML_ERROR_GPU_IS_LOST
    lost.fail["nvmlDeviceResetGpuLockedClocks"] = pynvml.NVML_ERROR_GPU_IS_LOST
    readings, failed = gpus.read_all()
    assert [r.uuid for r in readings] == ["GPU-ok"]
    assert [(d.uuid, type(e)) for d, e in failed] == [("GPU-lost", GpuLostError)]
    failed_resets = gpus.reset_all()
    assert [(d.uuid, type(e)) for d, e in failed_resets] == [("GPU-lost", GpuLostError)]
    assert ("nvmlDeviceResetGpuLockedClocks", 1) in nvml.setter_calls()


# -- probe ------------------------------------------------------------------------------------


def test_probe_is_read_only_and_measures_update_periods(
    open_gpus: OpenGpus, clock: FakeClock
) -> None:
    a100, gddr = a100_sxm4_80gb(), a40()

    def power_mw() -> int:
        """A new value every 100 ms, except that the update at 0.2 s is missed."""
        step = clock.ticks_us // 100_000
        return 200_000 + 10 * (1 if step == 2 else step)

    a100.power_mw = power_mw
    a100.energy_mj = lambda: 5_000 + 20 * (clock.ticks_us // 50_000)  # every 50 ms
    a100.instant_mw = lambda: 210_000 + clock.ticks_us // 20_000  # every 20 ms
    a100.reasons = 0x4 | 0x200
    gddr.fail["nvmlDeviceGetTotalEnergyConsumption"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    gddr.instant_return = pynvml.NVML_ERROR_NOT_SUPPORTED
    nvml, gpus = open_gpus(a100, gddr)

    report = probe(gpus, seconds=2.0, clock=clock, sleep=clock.sleep)

    assert nvml.setter_calls() == []
    assert json.loads(json.dumps(report)) == report
    assert report["driver_version"] == "580.82.07"
    first, second = report["gpus"]
    assert (first["uuid"], first["name"]) == ("GPU-a100-0000", "NVIDIA A100-SXM4-80GB")
    assert first["clocks"] == {
        "memory_mhz": [1593],
        "graphics_by_memory_mhz": {"1593": {"levels": 81, "min_mhz": 210, "max_mhz": 1410}},
    }
    assert first["power_limit_w"] == {"min_w": 100.0, "max_w": 400.0, "default_w": 400.0}
    assert first["clock_event_reasons"] == ["SW_POWER_CAP", "BOARD_LIMIT"]
    assert first["energy_counter_j"] == pytest.approx(5.0)
    periods = first["update_periods"]
    assert periods["power_usage"]["update_period_s"] == pytest.approx(0.1, abs=1e-3)
    assert periods["energy_counter"]["update_period_s"] == pytest.approx(0.05, abs=1e-3)
    assert periods["power_instant_field"]["update_period_s"] == pytest.approx(0.02, abs=1e-3)
    assert periods["power_usage"]["samples"] == pytest.approx(2000, abs=2)

    assert second["clocks"]["memory_mhz"] == [7251, 405]
    assert second["energy_counter_j"] is None
    assert "Not Supported" in second["errors"]["energy_counter_j"]
    assert second["update_periods"]["power_usage"]["update_period_s"] is None  # constant power
    instant = second["update_periods"]["power_instant_field"]
    assert instant["samples"] == 0
    assert "POWER_INSTANT" in instant["error"]


def test_probe_reports_a_failing_query_and_carries_on(
    open_gpus: OpenGpus, clock: FakeClock
) -> None:
    device = a100_sxm4_80gb()
    device.fail["nvmlDeviceGetSupportedMemoryClocks"] = pynvml.NVML_ERROR_UNKNOWN
    _, gpus = open_gpus(device)
    (report,) = probe(gpus, seconds=0.01, clock=clock, sleep=clock.sleep)["gpus"]
    assert report["clocks"] is None
    assert "list supported memory clocks" in report["errors"]["clocks"]
    assert report["power_w"] == pytest.approx(251.234)


# -- the seam ---------------------------------------------------------------------------------


def test_only_the_nvml_backend_imports_pynvml() -> None:
    importers = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if re.search(r"^\s*(import|from)\s+pynvml\b", path.read_text(), re.MULTILINE)
    )
    assert importers == ["gpu/nvml.py"]


# -- board description, power limits, coexistence -----------------------------------------------


def test_describe_reports_mig_mode_and_the_enforced_limit(open_gpus: OpenGpus) -> None:
    mig, gddr = a100_sxm4_80gb("GPU-mig"), a40()
    mig.mig_mode = (pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE)
    mig.enforced_limit_mw = 400_000
    gddr.fail["nvmlDeviceGetPowerUsage"] = pynvml.NVML_ERROR_GPU_IS_LOST
    nvml, gpus = open_gpus(mig, gddr)
    first, second = (gpu.describe() for gpu in gpus)
    assert (first.name, first.uuid, first.mig_mode) == ("NVIDIA A100-SXM4-80GB", "GPU-mig", True)
    assert first.enforced_limit_w == 400.0
    assert first.power_limit == PowerLimitRange(100.0, 400.0, 400.0)
    assert first.clocks.graphics_for(1593)[0] == 1410
    assert second.mig_mode is None  # NOT_SUPPORTED: a GDDR part
    assert second.enforced_limit_w is None  # the read failed; the description still comes
    assert second.clocks.memory_mhz == (7251, 405)
    assert nvml.setter_calls() == []
    mig.mig_mode = (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE)
    assert gpus[0].mig_mode() is False  # pending is not current


def test_mig_instances_name_their_physical_gpu(open_gpus: OpenGpus) -> None:
    mig, whole = a100_sxm4_80gb("GPU-mig"), a100_sxm4_80gb("GPU-whole")
    mig.mig_mode = (pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE)
    mig.mig_devices = {0: ("MIG-aaaa", 3, 0), 4: (b"MIG-bbbb", 5, 0)}  # slots 1-3, 5, 6 empty
    whole.mig_mode = (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_DISABLE)
    nvml, gpus = open_gpus(whole, mig)
    assert [(i.uuid, i.gpu_instance, i.compute_instance) for i in gpus[1].mig_instances()] == [
        ("MIG-aaaa", 3, 0),
        ("MIG-bbbb", 5, 0),
    ]
    # both names Slurm may give an instance; a whole GPU's UUID or an unknown name: unresolved
    names = ["MIG-bbbb", "MIG-GPU-mig/3/0", "GPU-whole", "MIG-cccc"]
    nvml.calls.clear()
    assert gpus.mig_parents(names) == {"MIG-bbbb": 1, "MIG-GPU-mig/3/0": 1}
    assert nvml.count("nvmlDeviceGetMaxMigDeviceCount") == 1  # the whole GPU is not asked
    assert nvml.setter_calls() == []


def test_memory_lock_not_supported_comes_from_the_real_pynvml_class(open_gpus: OpenGpus) -> None:
    device = a40()
    device.fail["nvmlDeviceSetMemoryLockedClocks"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    _, gpus = open_gpus(device)
    with pytest.raises(GpuNotSupportedError) as info:
        only_gpu(gpus).set_locked_clocks(1200, 7251)
    assert type(info.value.__cause__) is pynvml.NVMLError_NotSupported


def test_power_limit_is_set_in_milliwatts_idempotently_and_reset_to_the_default(
    open_gpus: OpenGpus,
) -> None:
    device = a100_sxm4_80gb()
    device.default_limit_mw = 350_000
    nvml, gpus = open_gpus(device)
    gpu = only_gpu(gpus)
    gpu.set_power_limit_w(250.5)
    gpu.set_power_limit_w(250.5)
    assert gpu.power_limit_set_w == 250.5
    for bad in (99.9, 400.001, float("inf")):
        with pytest.raises(UnsupportedPowerLimitError, match=r"outside 100\.\.400 W"):
            gpu.set_power_limit_w(bad)
    gpu.reset_power_limit()
    gpu.reset_power_limit()  # always calls NVML: a crashed agent's limit outlives it
    assert gpu.power_limit_set_w is None
    assert nvml.setter_calls() == [
        ("nvmlDeviceSetPowerManagementLimit", 0, 250_500),
        ("nvmlDeviceSetPowerManagementLimit", 0, 350_000),
        ("nvmlDeviceSetPowerManagementLimit", 0, 350_000),
    ]


def test_power_limit_without_permission_is_a_soft_error_naming_it(open_gpus: OpenGpus) -> None:
    device = a100_sxm4_80gb()
    device.fail["nvmlDeviceSetPowerManagementLimit"] = pynvml.NVML_ERROR_NO_PERMISSION
    _, gpus = open_gpus(device)
    gpu = only_gpu(gpus)
    with pytest.raises(PowerLimitPermissionError) as info:
        gpu.set_power_limit_w(300.0)
    assert isinstance(info.value, GpuError)  # soft: the clock locks may still work
    assert "set power limit 300 W failed" in str(info.value)
    assert "SYS_ADMIN" in str(info.value) and "\n" not in str(info.value)
    assert type(info.value.__cause__) is pynvml.NVMLError_NoPermission
    assert gpu.power_limit_set_w is None
    with pytest.raises(PowerLimitPermissionError):
        gpu.reset_power_limit()


def test_an_enforced_limit_below_ours_is_what_readings_carry(
    open_gpus: OpenGpus, clock: FakeClock
) -> None:
    device = a100_sxm4_80gb()
    device.enforced_limit_mw = lambda: min(device.requested_limit_mw, 250_000)  # a BMC cap
    device.reasons = 0x4  # SW_POWER_CAP
    device.sm_clock_mhz = 1095
    _, gpus = open_gpus(device)
    gpu = only_gpu(gpus)
    gpu.set_power_limit_w(300.0)
    reading = gpu.read()
    assert gpu.power_limit_set_w == 300.0
    assert reading.enforced_limit_w == 250.0 < gpu.power_limit_set_w
    assert reading.throttle == ThrottleReason.SW_POWER_CAP


def test_clocks_changed_behind_our_back_are_detected(open_gpus: OpenGpus, clock: FakeClock) -> None:
    device = a100_sxm4_80gb()
    _, gpus = open_gpus(device)
    gpu = only_gpu(gpus)
    gpu.set_locked_clocks(1200)
    device.sm_clock_mhz = 1200
    readings = [gpu.read() for _ in range(3)]
    assert not lock_overridden(readings, gpu.locked)
    device.sm_clock_mhz = 1410  # another process ran nvidia-smi -lgc 210,1410
    readings += [gpu.read() for _ in range(2)]
    assert not lock_overridden(readings, gpu.locked)
    readings.append(gpu.read())
    assert lock_overridden(readings, gpu.locked)
    device.reasons = 0x1  # GPU_IDLE: an idle GPU's clock says nothing about the lock
    assert not lock_overridden([gpu.read() for _ in range(3)], gpu.locked)
    assert not lock_overridden(readings, None)
