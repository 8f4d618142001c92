"""One exception root for the whole project (`CdgpcError`), and `one_line` for every message.

Vendor exceptions are translated once, at their seam, with ``raise ... from e``. The ground
floor: standard library only (`tests/unit/test_import_graph.py`). Test:
`tests/unit/test_errors.py`.
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
    """A local failure: log it, count it, keep the control loop running (one GPU fell off the
    bus, one node did not answer)."""


class FatalError(CdgpcError):
    """The component cannot work as configured; stop and say why (no permission to set clocks,
    no NVML at all)."""


class InputError(CdgpcError, ValueError):
    """Bad input from a person or a peer (a budget, a deadline, a clock, a file): refused with a
    one-line reason, and nothing changes."""


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
