"""One exception root for the whole project.

`SoftError` means "log it and carry on" (one GPU fell off the bus, one node did not answer);
`FatalError` means the component cannot do its job (no permission to set clocks, no NVML at all).
Bad input from a person or a peer is an `InputError`: a one-line message, and nothing changes.
Vendor exceptions are translated once, at their seam, with ``raise ... from e``. `one_line` makes
any text that goes into a log line or an error message one printable line.
"""

from __future__ import annotations

from typing import Literal


def one_line(
    text: object,
    limit: int = 300,
    *,
    keep: Literal["all", "first", "last"] = "all",
    empty: str = "no message",
    ascii_only: bool = False,
) -> str:
    """``text`` (an exception, a program's output, a peer's reason) as one printable line.

    ``keep``: all its lines joined, or only its first or last non-blank one. Runs of whitespace
    become one space, characters that do not print (with ``ascii_only`` also non-ASCII ones)
    ``?``; past ``limit`` characters it is cut to end in ``...``; ``empty`` if nothing is left.
    """
    lines = [" ".join(line.split()) for line in str(text).splitlines()]
    lines = [line for line in lines if line]
    if keep == "first":
        lines = lines[:1]
    elif keep == "last":
        lines = lines[-1:]
    line = "".join(
        c if c.isprintable() and (c.isascii() or not ascii_only) else "?" for c in " ".join(lines)
    )
    if len(line) > limit:
        line = line[: max(limit - 3, 0)] + "..."
    return line or empty


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
