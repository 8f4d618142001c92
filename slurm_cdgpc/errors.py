"""One exception root for the whole project.

`SoftError` means "log it and carry on" (one GPU fell off the bus, one node did not answer);
`FatalError` means the component cannot do its job (no permission to set clocks, no NVML at all).
Bad input from a person or a peer is an `InputError`: a one-line message, and nothing changes.
Vendor exceptions are translated once, at their seam, with ``raise ... from e``.
"""

from __future__ import annotations


class CdgpcError(Exception):
    """Root of every error this project raises on purpose."""


class SoftError(CdgpcError):
    """A local failure: log it, count it, keep the control loop running."""


class FatalError(CdgpcError):
    """The component cannot work as configured; stop and say why."""


class InputError(CdgpcError, ValueError):
    """Bad input (a budget, a deadline, a clock, a file): refused with a one-line reason."""


class GpuError(SoftError):
    """One GPU operation failed (the device may still work for other calls)."""


class GpuNotSupportedError(GpuError):
    """The device does not support this operation (e.g. memory locks on an HBM part)."""


class GpuLostError(GpuError):
    """The device fell off the bus or needs a reset."""


class PowerLimitPermissionError(GpuError):
    """Setting a power limit was refused (NO_PERMISSION): soft, clock control may still work."""


class GpuPermissionError(FatalError):
    """Clock control needs root or CAP_SYS_ADMIN and /dev/nvidiactl."""


class GpuUnavailableError(FatalError):
    """No usable GPU backend: NVML library or driver missing, or no devices."""


class UnsupportedClockError(InputError):
    """A requested clock is not in the device's supported list."""


class UnsupportedPowerLimitError(InputError, GpuError):
    """A requested power limit is outside the device's range (or not a finite number)."""


class SolverError(SoftError):
    """The controller could not produce a decision this interval."""
