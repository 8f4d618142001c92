"""The one grammar of each name the head and the nodes exchange: job id, node name, account. The
Prolog and jobs' progress client use it, so it reaches only the standard library and
`slurm_cdgpc.errors` (`tests/unit/test_import_graph.py`). Test: `tests/unit/test_wire_names.py`.
"""

from __future__ import annotations

import re
from typing import Final

from slurm_cdgpc.errors import InputError, one_line

_NUMBER: Final = r"(?:0|[1-9][0-9]{0,9})"
#: a job id as Slurm writes it: ``SLURM_JOB_ID`` ``123`` (32 bits: at most 10 digits, from 1),
#: an array task ``123_4`` or a heterogeneous job's component ``123+1``; no leading zeros
JOB_ID: Final = re.compile(rf"[1-9][0-9]{{0,9}}(?:[_+]{_NUMBER})?")
#: a host name as Slurm and DNS write it: 1..255 characters, letters or digits at both ends
NODE_NAME: Final = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,253}[A-Za-z0-9])?")
#: a user or group name (a Samba machine account ends in ``$``): 1..64 characters
ACCOUNT: Final = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,63}|[A-Za-z0-9._-]{0,62}\$)")
#: a MIG instance as Slurm names it in ``CUDA_VISIBLE_DEVICES``: ``MIG-<uuid>``, or on drivers
#: before 470.42.01 ``MIG-<GPU UUID>/<GPU instance>/<compute instance>`` (gpu/nvml plugin)
MIG_DEVICE: Final = re.compile(r"MIG-[0-9A-Za-z-]{1,96}(?:/[0-9]{1,5}/[0-9]{1,5})?")


def _got(value: object) -> str:
    return f"got {one_line(repr(value), 60)}"


def job_id(value: object, where: str = "job_id") -> str:
    """``value`` if it is a Slurm job id, else `InputError` naming ``where``."""
    if isinstance(value, str) and JOB_ID.fullmatch(value):
        return value
    raise InputError(f"{where}: must be a Slurm job id like 123 or 123_4, {_got(value)}")


#: the longest job name the head keeps (the Prolog sends a longer one's first characters)
MAX_JOB_NAME: Final = 200


def job_name(value: object, where: str = "job_name") -> str:
    """``value`` if it is a Slurm job name (printable, 1 to `MAX_JOB_NAME` characters), else
    `InputError` naming ``where``."""
    if isinstance(value, str) and 0 < len(value) <= MAX_JOB_NAME and value.isprintable():
        return value
    raise InputError(f"{where}: must be 1 to {MAX_JOB_NAME} printable characters, {_got(value)}")


def node_name(value: object, where: str = "node") -> str:
    """``value`` if it is a node's host name, else `InputError` naming ``where``."""
    if isinstance(value, str) and NODE_NAME.fullmatch(value):
        return value
    raise InputError(f"{where}: must be a host name, {_got(value)}")


def mig_device(value: object, where: str = "MIG device") -> str:
    """``value`` if it names a MIG instance (`MIG_DEVICE`), else `InputError` naming ``where``."""
    if isinstance(value, str) and MIG_DEVICE.fullmatch(value):
        return value
    raise InputError(f"{where}: must be a MIG device name like MIG-<uuid>, {_got(value)}")


def account(value: object, where: str = "user") -> str:
    """``value`` if it is a user or group name, else `InputError` naming ``where``."""
    if isinstance(value, str) and ACCOUNT.fullmatch(value):
        return value
    raise InputError(f"{where}: must be a user or group name, {_got(value)}")
