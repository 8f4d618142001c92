"""``cdgpc-admin doctor``: is this node set up for slurm-cdgpc, and if not, what to fix.

Every check reads; none changes a GPU, a lock or a limit. It runs no Slurm or MUNGE program
itself: `slurm/` and `transport/` do (`tests/unit/test_import_graph.py`). Test:
`tests/unit/test_doctor.py`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from slurm_cdgpc.config import Config, agent_url
from slurm_cdgpc.errors import CdgpcError
from slurm_cdgpc.gpu.device import ThrottleReason
from slurm_cdgpc.transport.credentials import signer_from_config, verifier_from_config
from slurm_cdgpc.transport.http import HeadClient

#: bit 21 of CapEff in /proc/self/status: the capability NVML clock locks need
CAP_SYS_ADMIN_BIT = 21


@dataclass(frozen=True)
class Check:
    """One check's answer: ok or not, one line of detail and, when not ok, one line saying what
    to do. Clock control is checked by the privileges it needs, not by setting a clock."""

    name: str
    ok: bool
    detail: str
    fix: str = ""

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail, "fix": self.fix}


def run_checks(
    config: Config,
    *,
    status_path: Path = Path("/proc/self/status"),
    proc_root: Path = Path("/proc"),
) -> list[Check]:
    checks: list[Callable[[], Check]] = [
        lambda: _auth(config),
        lambda: _reachable("head", config.head.url, "start cdgpcd or fix [head] url"),
        lambda: _gpus(config),
        lambda: _clock_privileges(config, status_path),
        lambda: _limiters(config, proc_root),
        lambda: _agent(config),
        _spool,
    ]
    return [check() for check in checks]


def _auth(config: Config) -> Check:
    """Sign and verify one request with the configured credentials (MUNGE or HMAC)."""
    try:
        signer = signer_from_config(config)
        verifier = verifier_from_config(config)
        credential = signer.sign("GET", "/v1/health", b"")
        who = verifier.verify(credential, "GET", "/v1/health", b"")
    except CdgpcError as e:
        hint = (
            "start munged (and check /etc/munge/munge.key matches the head's)"
            if config.auth.method == "munge"
            else f"create {config.auth.hmac_key_file}: 32+ random bytes, root-owned, mode 0600"
        )
        return Check("auth", False, f"{config.auth.method}: {e}", hint)
    return Check("auth", True, f"{config.auth.method}: a signed request verifies as uid {who.uid}")


def _reachable(name: str, url: str, hint: str) -> Check:
    try:
        HeadClient(url, None, timeout_s=2.0, peer=name).get("/v1/health")
    except CdgpcError as e:
        return Check(name, False, str(e), hint)
    return Check(name, True, f"{url} answers")


def _agent(config: Config) -> Check:
    return _reachable("agent", agent_url(config), "start cdgpc-noded (systemctl start cdgpc-noded)")


def _gpus(config: Config) -> Check:
    node = config.node
    if node.backend == "simulated":
        return Check(
            "gpus",
            True,
            f"simulated backend: {node.simulated_gpu_count} × {node.simulated_gpu_type}",
        )
    from slurm_cdgpc.gpu.nvml import nvml_is_available  # noqa: PLC0415 (loads NVML lazily)

    if not nvml_is_available():
        return Check(
            "gpus",
            False,
            "NVML cannot be initialised or lists no GPU",
            "install the NVIDIA driver (libnvidia-ml.so.1) or set [node] backend = 'simulated'",
        )
    return Check("gpus", True, "NVML answers and lists GPUs")


def _clock_privileges(config: Config, status_path: Path) -> Check:
    """Locked clocks need CAP_SYS_ADMIN and /dev/nvidiactl; checked without setting a clock."""
    if config.node.backend == "simulated":
        return Check("clock control", True, "simulated backend: no privileges needed")
    try:
        cap_eff = next(
            int(line.split()[1], 16)
            for line in status_path.read_text().splitlines()
            if line.startswith("CapEff:")
        )
    except (OSError, StopIteration, ValueError, IndexError):
        return Check("clock control", False, f"cannot read {status_path}", "run as root")
    if not cap_eff >> CAP_SYS_ADMIN_BIT & 1:
        return Check(
            "clock control",
            False,
            "no CAP_SYS_ADMIN: NVML refuses clock locks",
            "run cdgpc-noded as root (the shipped unit keeps CAP_SYS_ADMIN)",
        )
    ctl = Path("/dev/nvidiactl")
    if not os.access(ctl, os.R_OK | os.W_OK):
        return Check("clock control", False, f"{ctl} is not accessible", "check DeviceAllow=")
    return Check("clock control", True, "CAP_SYS_ADMIN and /dev/nvidiactl available")


#: daemons that set GPU clocks or power limits themselves, by their process name
OTHER_LIMITERS: Final = {
    "nvidia-powerd": "NVIDIA Dynamic Power Boost (moves power between CPU and GPU)",
    "nv-hostengine": "the DCGM host engine (its power policies set limits)",
    "geopmd": "GEOPM (sets power limits and frequencies)",
    "eard": "the EAR node daemon (sets GPU clocks)",
}
#: throttle reasons only another limiter causes
_FOREIGN_REASONS: Final = (
    (ThrottleReason.HW_POWER_BRAKE, "a power brake"),
    (ThrottleReason.HW_SLOWDOWN, "a hardware slowdown"),
    (ThrottleReason.SW_THERMAL, "a thermal slowdown"),
    (ThrottleReason.HW_THERMAL, "a thermal slowdown"),
)


def _limiters(config: Config, proc_root: Path) -> Check:
    """Whatever else may hold this node's GPUs: daemons known to set clocks or limits, and
    (NVML) an enforced limit below the default or a brake or slowdown in force now."""
    found = []
    for comm in sorted(proc_root.glob("[0-9]*/comm")):
        try:
            name = comm.read_text().strip()
        except OSError:
            continue  # the process is gone
        if name in OTHER_LIMITERS:
            found.append(f"{name} runs: {OTHER_LIMITERS[name]}")
    if config.node.backend == "nvml":
        found += _nvml_limiters()
    if not found:
        return Check("other limiters", True, "none found (no daemon of the known ones, no cap)")
    return Check(
        "other limiters",
        False,
        "; ".join(dict.fromkeys(found)),
        'leave GPU clocks to cdgpc-noded there, or set node.on_override = "yield"',
    )


def _nvml_limiters() -> list[str]:
    from slurm_cdgpc.gpu.nvml import nvml_is_available, open_nvml_gpus  # noqa: PLC0415

    if not nvml_is_available():
        return []
    found = []
    try:
        with open_nvml_gpus() as gpus:
            for dev in gpus:
                reading, default_w = dev.read(), dev.power_limit_range().default_w
                if reading.enforced_limit_w < default_w - 1.0:
                    found.append(
                        f"GPU {dev.index}: enforced power limit {reading.enforced_limit_w:.0f} W, "
                        f"below its default {default_w:.0f} W (a BMC, nvidia-smi -pl, a policy)"
                    )
                for reason, text in _FOREIGN_REASONS:
                    if reason in reading.throttle:
                        found.append(f"GPU {dev.index}: held by {text}")
    except CdgpcError as e:
        found.append(f"NVML could not be read: {e}")
    return found


def _spool() -> Check:
    from slurm_cdgpc.slurm.spool import DEFAULT_SPOOL_DIR, Spool  # noqa: PLC0415

    if not DEFAULT_SPOOL_DIR.is_dir():
        return Check("spool", True, f"{DEFAULT_SPOOL_DIR}: nothing spooled")
    pending = len(Spool(DEFAULT_SPOOL_DIR).pending())
    if pending:
        return Check(
            "spool",
            False,
            f"{pending} Prolog/Epilog record(s) waiting in {DEFAULT_SPOOL_DIR}",
            "start cdgpcd; cdgpc-noded forwards them every 30 s",
        )
    free_mb = shutil.disk_usage(DEFAULT_SPOOL_DIR).free / 1e6
    return Check("spool", True, f"{DEFAULT_SPOOL_DIR}: empty, {free_mb:.0f} MB free")
