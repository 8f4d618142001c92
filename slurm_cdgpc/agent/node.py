"""`NodeAgent`: the core of ``cdgpc-noded``. It applies setpoints, enforces the lease and keeps the
state file. No sockets and no threads: `server` and `progress` call in under its one lock, and
`main` ticks the lease. It never reaches `control/` (`tests/unit/test_import_graph.py`).
Invariants: DESIGN.md, "Safety" (the table, "The lease", "The state file"); tests:
`tests/unit/test_agent_node.py`, `tests/unit/test_agent_release.py`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from slurm_cdgpc.config import LEASE_ACTIONS, OVERRIDE_ACTIONS, SafeCap
from slurm_cdgpc.errors import CdgpcError, InputError, PowerLimitPermissionError, one_line
from slurm_cdgpc.gpu.device import GpuDevice, GpuReading, GpuSet, LockedClocks, lock_overridden
from slurm_cdgpc.wire.board import BoardDescription
from slurm_cdgpc.wire.protocol import (
    ExchangeRequest,
    ExchangeResponse,
    GpuReport,
    LockReport,
    ProgressLine,
    ProgressReport,
    Refusal,
    check_node_name,
)

logger = logging.getLogger(__name__)

STATE_VERSION: Final = 1
#: at most this many (job, uid) progress reports are kept (the least recently updated goes first)
MAX_PROGRESS_JOBS: Final = 1024
#: at most this many of them from one uid (one user's reports never push out another's)
MAX_PROGRESS_PER_UID: Final = 64
#: a power reading above this multiple of the GPU's maximum power limit is garbage
PLAUSIBLE_POWER_FACTOR: Final = 2.0
_MAX_REASON_CHARS: Final = 300


@dataclass(frozen=True)
class TickResult:
    """What `NodeAgent.tick` found: whether the lease has lapsed and which GPUs it changed."""

    lapsed: bool
    changed: tuple[int, ...] = ()


@dataclass(frozen=True)
class LeaseState:
    """The lease as ``GET /metrics`` shows it (`NodeAgent.lease`)."""

    lapsed: bool
    left_s: float  # until the lease lapses (negative: lapsed that long ago)
    lapses: int  # since the agent started
    safe_capped: int  # GPUs a lapse moved to the safe cap that still hold it


#: exchanges in a row whose reads show another lock before the agent calls it an override
OVERRIDE_READS: Final = 2
_YIELDED: Final = "another process holds its clocks (node.on_override = yield)"
_NO_LIMIT: Final = (
    "MIG mode is on: its clocks cannot be locked and the setpoint sets no power limit"
)


def _reason(text: object, limit: int = _MAX_REASON_CHARS) -> str:
    """A refusal's or a reading's reason: the protocol carries printable ASCII only."""
    return one_line(text, limit, empty="error", ascii_only=True)


def safe_clock_mhz(device: GpuDevice, safe_cap: SafeCap) -> int:
    """The graphics clock a lapsed lease falls back to on ``device``: the highest supported clock
    ≤ f · max for a clock fraction f; a power ``P_safe``, without a power model, as the fraction
    ``P_safe / max power limit`` (DESIGN.md, "Safety", The lease)."""
    allowed = device.supported_clocks().graphics_for(None)  # descending
    if safe_cap.power_w is not None:
        # no power model here: P_safe / P_max as a clock fraction (conservative above the knee)
        fraction = min(1.0, safe_cap.power_w / device.power_limit_range().max_w)
    else:
        fraction = 1.0 if safe_cap.clock_fraction is None else safe_cap.clock_fraction
    target_mhz = fraction * allowed[0]  # f_safe = max{f ∈ supported : f ≤ fraction · f_max}
    for clock_mhz in allowed:
        if clock_mhz <= target_mhz + 1e-9:
            return clock_mhz
    return allowed[-1]


def safe_limit_w(device: GpuDevice, safe_cap: SafeCap) -> float:
    """The power limit a lapsed lease falls back to on a GPU in MIG mode, whose clocks cannot
    be locked: ``P_safe`` itself, or, for a clock fraction f, f · the default limit (power falls
    faster than the clock, so this caps no lower than the clock fraction would), within the
    board's range."""
    limits = device.power_limit_range()
    if safe_cap.power_w is not None:
        target_w = safe_cap.power_w
    else:
        fraction = 1.0 if safe_cap.clock_fraction is None else safe_cap.clock_fraction
        target_w = fraction * limits.default_w
    return min(max(target_w, limits.min_w), limits.default_w)


def _set_limit_within(device: GpuDevice, limit_w: float) -> None:
    """Set ``device``'s power limit at ``limit_w`` clipped into [minimum, default] of its board:
    the head's limits only tighten what the board boots with."""
    limits = device.power_limit_range()
    device.set_power_limit_w(min(max(limit_w, limits.min_w), limits.default_w))


class StaleEpochError(InputError):
    """An exchange from a head with an older leader epoch than one already seen (HTTP 409)."""


class WrongNodeError(InputError):
    """An exchange that names another node: captured on its way there and replayed (HTTP 401)."""


class NodeAgent:
    """The GPUs of one node under the head's control, with a lease watchdog and a state file.

    Time comes from ``clock`` (epoch seconds, what the head's lease expiry is written in) and
    ``monotonic`` (what the lease runs on); tests pass one `ManualClock` for both. Every public
    method takes the one lock.
    """

    def __init__(
        self,
        gpus: GpuSet,
        safe_cap: SafeCap,
        state_file: Path,
        clock: Callable[[], float] = time.time,
        *,
        monotonic: Callable[[], float] | None = None,
        node_name: str | None = None,
        lease_duration_s: float = 90.0,
        max_lease_s: float | None = None,
        on_lapse: str = "cap",
        on_override: str = "reapply",
    ) -> None:
        if on_lapse not in LEASE_ACTIONS:
            raise InputError(
                f"on_lapse must be one of {', '.join(LEASE_ACTIONS)}, got {on_lapse!r}"
            )
        if on_override not in OVERRIDE_ACTIONS:
            raise InputError(
                f"on_override must be one of {', '.join(OVERRIDE_ACTIONS)}, got {on_override!r}"
            )
        self.on_override = on_override
        #: per GPU we hold a lock on: its last readings, to tell when another process changed it
        self._recent: dict[int, deque[GpuReading]] = {}
        #: GPUs another process took the clocks of: logged (once an episode); left to it (yield)
        self._overridden: set[int] = set()
        self._yielded: set[int] = set()
        if not lease_duration_s > 0:
            raise InputError(f"lease duration must be positive, got {lease_duration_s}")
        self.gpus = gpus
        self.safe_cap = safe_cap
        self.state_file = Path(state_file)
        self.node_name = check_node_name(node_name or socket.gethostname().split(".")[0])
        self.on_lapse = on_lapse
        self.max_lease_s = 2 * lease_duration_s if max_lease_s is None else max_lease_s
        self._clock = clock
        #: None: ``time.monotonic`` beside the system clock; a test's own ``clock`` drives both
        self._monotonic = monotonic or (time.monotonic if clock is time.time else clock)
        self._lock = threading.RLock()
        self._jobs: dict[int, str] = {}  # GPU index -> the job the head assigned it
        #: GPU index -> the other jobs on it (shards, MPS, MIG slices of one GPU): their Epilog
        #: releases their share; the GPU returns to defaults only when its last job leaves
        self._cotenants: dict[int, set[str]] = {}
        self._lapse_capped: set[int] = set()  # GPUs the lapse moved to the safe cap
        #: (job, reporting uid) -> its latest report; the head keeps only the owner's and root's
        self._progress: dict[tuple[str, int], ProgressReport] = {}
        self._lapsed = False
        self._lapses = 0
        self._epoch = 0  # the highest leader epoch seen (persisted in the state file)
        #: the GPUs whose locks the state file on disk lists (the file never lists fewer GPUs
        #: than are locked: a GPU not in here is written down before it is locked)
        self._recorded: frozenset[int] = frozenset()
        #: each GPU's board as NVML describes it, read at start and whenever the head asks
        self._boards: dict[int, BoardDescription] = {}
        self._digests: dict[int, str] = {}
        #: GPUs whose power limit was refused (warned about once; the lock stands)
        self._limit_warned: set[int] = set()
        self._describe()
        self.recovered_stale_state = self._recover()
        self._lease_expires_s = self._clock() + lease_duration_s  # as the head wrote it
        self._lease_deadline = self._monotonic() + lease_duration_s  # what `tick` checks

    # -- start-up -------------------------------------------------------------------------------

    def _describe(self) -> None:
        """Describe every GPU's board (a GPU that cannot be described reports no board: the
        head then goes by its name, as the catalog knows it)."""
        boards: dict[int, BoardDescription] = {}
        for dev in self.gpus:
            try:
                boards[dev.index] = dev.describe()
            except CdgpcError as e:
                logger.warning("GPU %d: cannot describe its board: %s", dev.index, _reason(e))
        if boards != self._boards:
            for index, board in sorted(boards.items()):
                if self._boards.get(index) != board:
                    logger.info(
                        "GPU %d: %s, %d memory clock(s), power limit %g-%g W%s",
                        index,
                        board.name,
                        len(board.clocks.memory_mhz),
                        board.power_limit.min_w,
                        board.power_limit.max_w,
                        ", MIG on" if board.mig_mode else "",
                    )
        self._boards = boards
        self._digests = {index: board.digest() for index, board in boards.items()}

    def _mig_changed(self) -> bool:
        """True when a GPU's MIG mode now differs from its last description (an admin turned
        MIG on or off and reset the GPU); a GPU that cannot say is left as described."""
        for dev in self.gpus:
            board = self._boards.get(dev.index)
            if board is None:
                continue
            try:
                mode = dev.mig_mode()
            except CdgpcError as e:
                logger.debug("GPU %d: MIG mode unknown: %s", dev.index, e)
                continue
            if mode != board.mig_mode:
                logger.info("GPU %d: MIG mode is now %s", dev.index, "on" if mode else "off")
                return True
        return False

    def _recover(self) -> bool:
        """Take the leader epoch back from the state file; reset every GPU if it lists locks (a
        crashed agent left it) or cannot be read. True if GPUs had to be reset."""
        try:
            text = self.state_file.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return False
        except OSError as e:
            text = f"<unreadable: {e.strerror or e}>"
        locks = self._read_state(text)
        if locks is not None and not locks:
            logger.info(
                "leader epoch %d known from %s; no clock locks", self._epoch, self.state_file
            )
            return False
        logger.warning(
            "stale state file %s found (a previous agent did not stop cleanly): "
            "resetting every GPU to default clocks first; it recorded: %s",
            self.state_file,
            _reason(text, 200),
        )
        failed: list[tuple[GpuDevice, CdgpcError]] = self.gpus.reset_all()
        # only the limits the file records go back to the default: a limit this agent did not
        # set is another limiter's (an admin's nvidia-smi -pl, a site policy), and raising it
        # would be the unsafe direction; a limit of ours the crash kept from the file stays
        # below the default until the next setpoint or release, which is the safe one
        listed = {e.get("index") for e in locks or () if e.get("power_limit_w") is not None}
        for dev in self.gpus:
            if dev.index not in listed:
                continue
            try:
                dev.reset_power_limit()
            except PowerLimitPermissionError as e:
                # no right to reset a limit is no right to have set one: none of ours remains
                logger.info("GPU %d: power limit not reset: %s", dev.index, _reason(e))
            except CdgpcError as e:
                failed.append((dev, e))
        for dev, error in failed:
            logger.error("GPU %s: reset after a crash failed: %s", dev.index, error)
        if failed:
            logger.error("keeping %s so that the next start retries the reset", self.state_file)
        else:
            self._sync_state()
            logger.info("default clocks restored on %d GPU(s) after a crash", len(self.gpus))
        return True

    def _read_state(self, text: str) -> list[dict[str, Any]] | None:
        """Restore the epoch from a state file's text; the entries it lists, one per GPU lock
        or limit (None: not a state file this agent understands, so locks may remain)."""
        try:
            document = json.loads(text)
        except ValueError:
            return None
        if not isinstance(document, dict) or not isinstance(document.get("locks"), list):
            return None
        epoch = document.get("epoch", 0)
        if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0:
            self._epoch = epoch
        else:
            logger.warning("state file %s: epoch %r ignored", self.state_file, epoch)
        return [e if isinstance(e, dict) else {} for e in document["locks"]]

    # -- the exchange ---------------------------------------------------------------------------

    def exchange(self, request: ExchangeRequest) -> ExchangeResponse:
        """Read every GPU, then apply the head's releases and setpoints and renew the lease.

        Per GPU, all or nothing: a setpoint is checked against that GPU's supported clocks
        before anything changes; an unsupported clock or a failed write is refused for that GPU
        only (in ``refused``), the others are still applied, and a write that fails half-way is
        rolled back to the GPU's previous lock, best effort.

        The GPUs are read first so that the answer describes the interval that just ended, under
        the clocks that were in force during it: read after a clock change, a power reading that
        averages over the last second (Hopper) would pair mostly the old clock's power with the
        new clock, and the head would learn a point that never happened.
        """
        with self._lock:
            now_s, arrived_s = self._clock(), self._monotonic()
            self._check_node(request)
            self._fence(request)
            # MIG mode changes only with a GPU reset, and a board's digest leaves it out: say
            # so unasked, or the head would keep the old mode for as long as it runs
            describe = request.describe or self._mig_changed()
            if describe:
                self._describe()
            reports = tuple(self._report(dev) for dev in self.gpus)
            self._check_overrides()
            refused: list[Refusal] = []
            if request.lease_expires_s <= now_s:
                return self._expired_on_arrival(request, now_s, reports, describe)
            for gpu in request.release:
                self._release(gpu, refused)
            wanted: dict[int, LockedClocks] = {}
            limited: dict[int, float] = {}  # MIG GPUs: the power limit is the setpoint
            devices: dict[int, GpuDevice] = {}
            for sp in request.setpoints:
                device = self._device(sp.gpu)
                if device is None:
                    refused.append(Refusal(sp.gpu, f"no GPU with index {sp.gpu} on this node"))
                    continue
                if sp.gpu in self._yielded:
                    refused.append(Refusal(sp.gpu, _YIELDED))
                    continue
                try:
                    table = device.supported_clocks()
                    table.check(sp.graphics_mhz, sp.memory_mhz)
                    lowest = table.graphics_for(sp.memory_mhz)[-1]
                except CdgpcError as e:
                    refused.append(Refusal(sp.gpu, _reason(e)))
                    continue
                if self._limit_only(sp.gpu):
                    if sp.power_limit_w is None:
                        refused.append(Refusal(sp.gpu, _NO_LIMIT))
                        continue
                    devices[sp.gpu] = device
                    limited[sp.gpu] = sp.power_limit_w
                    continue
                devices[sp.gpu] = device
                wanted[sp.gpu] = LockedClocks(lowest, sp.graphics_mhz, sp.memory_mhz)
            if (wanted.keys() | limited.keys()) - self._recorded and not self._write_state(
                intended=wanted, limits=limited
            ):
                for gpu in wanted.keys() | limited.keys():
                    refused.append(Refusal(gpu, "cannot record the lock in the state file"))
                wanted, limited = {}, {}
            for sp in request.setpoints:
                if sp.gpu in limited:
                    if self._hold_limit(devices[sp.gpu], limited[sp.gpu], refused):
                        self._jobs[sp.gpu] = sp.job_id
                        self._share(sp.gpu, self._cotenants.get(sp.gpu, set()) | set(sp.tenants))
                        self._lapse_capped.discard(sp.gpu)
                    continue
                if sp.gpu not in wanted:
                    continue
                if self._apply(devices[sp.gpu], sp.graphics_mhz, sp.memory_mhz, refused):
                    # the head's job for it now; the jobs sharing it (the head's tenants,
                    # their Prologs' holds) keep their shares, a job it assigned the GPU to
                    # before does not
                    self._jobs[sp.gpu] = sp.job_id
                    self._share(sp.gpu, self._cotenants.get(sp.gpu, set()) | set(sp.tenants))
                    self._lapse_capped.discard(sp.gpu)
                    self._apply_limit(devices[sp.gpu], sp.power_limit_w)
            self._renew(request, now_s, arrived_s)
            self._sync_state()
            for r in refused:
                logger.warning("GPU %s: setpoint refused: %s", r.gpu, r.reason)
            return self._response(now_s, reports, refused, describe)

    def _expired_on_arrival(
        self,
        request: ExchangeRequest,
        now_s: float,
        reports: tuple[GpuReport, ...],
        describe: bool,
    ) -> ExchangeResponse:
        """Answer an exchange whose lease was over before it arrived: readings, and every setpoint
        and release refused; the lease and the clocks stay as they are (applying them would only
        flip the node between the head's clocks and the safe cap at every tick)."""
        late_s = now_s - request.lease_expires_s
        logger.warning(
            "interval %d: lease already expired on arrival (%.1f s ago): nothing applied, "
            "lease not renewed; check NTP on the head and this node",
            request.interval,
            late_s,
        )
        reason = f"lease already expired on arrival ({late_s:.1f} s ago): nothing applied"
        refused = [Refusal(sp.gpu, reason) for sp in request.setpoints]
        refused += [Refusal(gpu, reason) for gpu in request.release]
        return self._response(now_s, reports, refused, describe)

    def _response(
        self,
        now_s: float,
        reports: tuple[GpuReport, ...],
        refused: Sequence[Refusal],
        describe: bool = False,
    ) -> ExchangeResponse:
        """The readings taken before anything was applied, the progress reported since the
        last exchange, what was refused, and the boards when the head asked."""
        return ExchangeResponse(
            node=self.node_name,
            time_s=now_s,
            gpus=reports,
            progress=tuple(self._progress.values()),
            refused=tuple(refused),
            boards=tuple(b for _, b in sorted(self._boards.items())) if describe else (),
        )

    def _check_node(self, request: ExchangeRequest) -> None:
        """Refuse, before anything changes (not even the lease), a request for another node."""
        if request.node != self.node_name:
            error = WrongNodeError(
                f"exchange refused: the request is for node {request.node}, this is node "
                f"{self.node_name}"
            )
            logger.warning("interval %d: %s", request.interval, error)
            raise error

    def _fence(self, request: ExchangeRequest) -> None:
        """Refuse a head older than one already seen; record a newer one before obeying it."""
        if request.epoch < self._epoch:
            error = StaleEpochError(
                f"exchange refused: leader epoch {request.epoch} is older than epoch "
                f"{self._epoch}, already seen (another head has taken over)"
            )
            logger.warning("interval %d: %s", request.interval, error)
            raise error
        if request.epoch > self._epoch:
            if self._epoch:
                logger.info(
                    "head with leader epoch %d takes over (was %d)", request.epoch, self._epoch
                )
            self._epoch = request.epoch
            if not self._write_state():
                logger.error("leader epoch %d not recorded: a restart forgets it", self._epoch)

    @property
    def epoch(self) -> int:
        """The highest leader epoch seen."""
        with self._lock:
            return self._epoch

    def _renew(self, request: ExchangeRequest, now_s: float, arrived_s: float) -> None:
        """Renew the lease (the caller has checked it is still running): the head's expiry as a
        duration from the request's arrival (``now_s`` by the wall clock, ``arrived_s`` by the
        monotonic one), kept as a deadline on the monotonic clock, at most ``max_lease_s``. After
        a lapse, GPUs the lapse capped that hold no job go back to default clocks."""
        left_s = min(request.lease_expires_s - now_s, self.max_lease_s)
        self._lease_expires_s = now_s + left_s
        self._lease_deadline = arrived_s + left_s
        if self._lapsed and left_s > 0:
            self._lapsed = False
            logger.info(
                "lease renewed at interval %d: the head controls the clocks again", request.interval
            )
            for gpu in sorted(self._lapse_capped):
                if gpu not in self._jobs:  # capped only because of the lapse: back to defaults
                    dev = self._device(gpu)
                    if dev is not None and self._reset(dev):
                        self._lapse_capped.discard(gpu)

    def _check_overrides(self) -> None:
        """After the exchange's reads: a GPU whose clocks another process changed (two reads
        in a row, `lock_overridden`) is logged once, then locked again (``reapply``) or left to
        that process (``yield``: its setpoints are refused until its job's GPUs are released)."""
        for dev in self.gpus:
            locked, recent = dev.locked, self._recent.get(dev.index, ())
            if locked is None or dev.index in self._yielded:
                continue
            if not lock_overridden(list(recent), locked, consecutive=OVERRIDE_READS):
                self._overridden.discard(dev.index)
                continue
            if dev.index not in self._overridden:
                self._overridden.add(dev.index)
                logger.warning(
                    "GPU %d: its clocks are not the %d MHz cap we locked (another process "
                    "changed them); %s",
                    dev.index,
                    locked.graphics_max_mhz,
                    "locking ours again" if self.on_override == "reapply" else "leaving it to it",
                )
            self._recent.pop(dev.index, None)
            if self.on_override == "yield":
                self._yielded.add(dev.index)
                continue
            try:  # a lock is idempotent: undo it, then set ours again
                dev.reset_locked_clocks()
                dev.set_locked_clocks(locked.graphics_max_mhz, locked.memory_mhz)
            except CdgpcError as e:
                logger.error("GPU %d: locking our clocks again failed: %s", dev.index, e)

    def _release(self, gpu: int, refused: list[Refusal]) -> None:
        device = self._device(gpu)
        if device is None:
            refused.append(Refusal(gpu, f"no GPU with index {gpu} on this node"))
            return
        if gpu in self._yielded:  # its clocks are another process's: leave them be
            self._yielded.discard(gpu)
            self._overridden.discard(gpu)
            job = self._jobs.pop(gpu, None)
            self._cotenants.pop(gpu, None)
            logger.info("GPU %d: released (job %s ended); its clocks left as they are", gpu, job)
            return
        if self._reset(device):
            job = self._jobs.pop(gpu, None)
            self._cotenants.pop(gpu, None)
            self._lapse_capped.discard(gpu)
            if job is not None and job not in self._jobs.values():
                for key in [k for k in self._progress if k[0] == job]:
                    del self._progress[key]
            logger.info("GPU %d: released (job %s ended), default clocks", gpu, job or "-")
        else:
            refused.append(Refusal(gpu, "reset to default clocks failed"))

    def _apply(
        self, device: GpuDevice, graphics_mhz: int, memory_mhz: int | None, refused: list[Refusal]
    ) -> bool:
        previous = device.locked
        try:
            device.set_locked_clocks(graphics_mhz, memory_mhz)
            return True
        except CdgpcError as e:
            refused.append(Refusal(device.index, _reason(e)))
        if device.locked != previous:  # half-applied: put the previous lock back
            try:
                if previous is None:
                    device.reset_locked_clocks()
                else:
                    device.set_locked_clocks(previous.graphics_max_mhz, previous.memory_mhz)
            except CdgpcError as e:
                logger.error("GPU %d: rollback after a failed lock failed: %s", device.index, e)
        return False

    def _reset(self, device: GpuDevice) -> bool:
        """Default clocks, and the default power limit if one was set (True: the clocks; on a
        GPU in MIG mode, whose lever is its limit: the limit)."""
        if self._limit_only(device.index):
            return self._reset_limit(device)
        self._reset_limit(device)
        try:
            device.reset_locked_clocks()
            return True
        except CdgpcError as e:
            logger.error("GPU %d: reset to default clocks failed: %s", device.index, e)
            return False

    def _limit_only(self, gpu: int) -> bool:
        """True when ``gpu``'s board is in MIG mode (as last described): clock control is not
        offered on a partitioned GPU, and its power limit, whole-GPU, is what the head sets."""
        board = self._boards.get(gpu)
        return board is not None and bool(board.mig_mode)

    def _hold_limit(self, device: GpuDevice, limit_w: float, refused: list[Refusal]) -> bool:
        """A MIG GPU's setpoint: its power limit at ``limit_w``, clipped into [minimum, default]
        of the board (the firmware then runs the highest clock within it). A refusal is the
        setpoint's: the head keeps the GPU out of its plan until one is accepted."""
        try:
            _set_limit_within(device, limit_w)
            return True
        except CdgpcError as e:
            refused.append(Refusal(device.index, _reason(e)))
            return False

    def _apply_limit(self, device: GpuDevice, limit_w: float | None) -> None:
        """The guard rail after the lock: ``limit_w`` clipped into [minimum, default] of the
        board (None: the default limit back). A refusal is warned about once per GPU and
        changes nothing else: the lock stands."""
        if limit_w is None:
            self._reset_limit(device)
            return
        try:
            _set_limit_within(device, limit_w)
        except CdgpcError as e:
            self._limit_refused(device, f"power limit {limit_w:g} W refused", e)

    def _reset_limit(self, device: GpuDevice) -> bool:
        """The board's default power limit back, if this agent set another (True: done)."""
        if device.power_limit_set_w is None:
            return True
        try:
            device.reset_power_limit()
            return True
        except CdgpcError as e:
            self._limit_refused(device, "reset to the default power limit failed", e)
            return False

    def _limit_refused(self, device: GpuDevice, what: str, error: CdgpcError) -> None:
        if device.index in self._limit_warned:
            logger.debug("GPU %d: %s: %s", device.index, what, error)
            return
        self._limit_warned.add(device.index)
        logger.warning(
            "GPU %d: %s: %s; the clock lock stands (logged once for this GPU)",
            device.index,
            what,
            _reason(error),
        )

    def _device(self, index: int) -> GpuDevice | None:
        for dev in self.gpus:
            if dev.index == index:
                return dev
        return None

    # -- measurements ---------------------------------------------------------------------------

    def _report(self, device: GpuDevice) -> GpuReport:
        """One GPU's report; a read that fails gives null measurements and an ``error``."""
        locked = device.locked
        lock = (
            None
            if locked is None
            else LockReport(locked.graphics_min_mhz, locked.graphics_max_mhz, locked.memory_mhz)
        )
        job = self._jobs.get(device.index)
        digest = self._digests.get(device.index)
        try:
            reading = device.read()
        except CdgpcError as e:
            return GpuReport(
                index=device.index,
                uuid=device.uuid,
                name=device.name,
                power_w=None,
                energy_j=None,
                sm_clock_mhz=None,
                memory_clock_mhz=None,
                enforced_limit_w=None,
                throttle=None,
                locked=lock,
                job_id=job,
                error=_reason(f"read failed: {e}"),
                board=digest,
            )
        if locked is not None:
            self._recent.setdefault(device.index, deque(maxlen=OVERRIDE_READS)).append(reading)
        else:
            self._recent.pop(device.index, None)
        stamp_s = reading.timestamp_s
        read_s = stamp_s if math.isfinite(stamp_s) and stamp_s >= 0 else None
        power_w, energy_j, error = self._plausible(device, reading)
        return GpuReport(
            index=device.index,
            uuid=device.uuid,
            name=device.name,
            power_w=power_w,
            energy_j=energy_j,
            sm_clock_mhz=reading.sm_clock_mhz,
            memory_clock_mhz=reading.memory_clock_mhz,
            enforced_limit_w=reading.enforced_limit_w
            if math.isfinite(reading.enforced_limit_w) and reading.enforced_limit_w >= 0
            else None,
            throttle=int(reading.throttle),
            locked=lock,
            job_id=job,
            error=error,
            read_s=read_s,
            board=digest,
        )

    def _plausible(
        self, device: GpuDevice, reading: GpuReading
    ) -> tuple[float | None, float | None, str | None]:
        """Power and energy as the head may trust them, and why not: a power reading that is NaN,
        infinite, ≤ 0 W or above `PLAUSIBLE_POWER_FACTOR` times the GPU's maximum power limit
        (e.g. 0xFFFFFFFF mW) becomes None with an error, as does a non-finite or negative energy
        counter; the reading's other fields are kept."""
        errors: list[str] = []
        try:
            ceiling_w = PLAUSIBLE_POWER_FACTOR * device.power_limit_range().max_w
        except CdgpcError:
            ceiling_w = 1e5
        power_w: float | None = reading.power_w
        if not (math.isfinite(reading.power_w) and 0 < reading.power_w <= ceiling_w):
            errors.append(f"implausible power reading {reading.power_w!r} W")
            power_w = None
        energy_j: float | None = reading.energy_j
        if not (math.isfinite(reading.energy_j) and reading.energy_j >= 0):
            errors.append(f"implausible energy counter {reading.energy_j!r} J")
            energy_j = None
        return power_w, energy_j, "; ".join(errors) or None

    # -- the lease watchdog ---------------------------------------------------------------------

    def tick(self) -> TickResult:
        """Check the lease; on a lapse apply ``on_lapse`` (retrying GPUs that failed), logged once
        per lapse: ``cap`` moves every GPU to the safe cap, never raising one already below it;
        ``reset`` restores default clocks; ``keep`` leaves the clocks as they are."""
        with self._lock:
            now_s = self._monotonic()
            if now_s < self._lease_deadline:
                return TickResult(lapsed=False)
            if not self._lapsed:
                self._lapsed = True
                self._lapses += 1
                logger.warning(
                    "lease lapsed %.1f s ago (no valid exchange from the head): %s",
                    now_s - self._lease_deadline,
                    {
                        "cap": f"moving every GPU to the safe cap ({self.safe_cap})",
                        "reset": "restoring default clocks",
                        "keep": "keeping the last clocks",
                    }[self.on_lapse],
                )
            if self.on_lapse == "keep":
                return TickResult(lapsed=True)
            if self.on_lapse == "reset":
                changed = [
                    d.index
                    for d in self.gpus
                    if (d.locked is not None or d.power_limit_set_w is not None) and self._reset(d)
                ]
                self._sync_state()
                return TickResult(lapsed=True, changed=tuple(changed))
            return TickResult(lapsed=True, changed=self._apply_safe_cap())

    def _safe_cap_lock(self, device: GpuDevice) -> LockedClocks | None:
        """The lock that puts ``device`` at the safe cap; None when it is already at or below
        it (a clock is never raised to the safe cap). `CdgpcError` if it cannot be computed."""
        safe_mhz = safe_clock_mhz(device, self.safe_cap)
        current = device.locked
        if current is not None and current.graphics_max_mhz <= safe_mhz:
            return None
        return LockedClocks(device.supported_clocks().graphics_for(None)[-1], safe_mhz, None)

    def _apply_safe_cap(self) -> tuple[int, ...]:
        wanted: dict[int, LockedClocks] = {}
        limits_reset = False
        changed: list[int] = []
        for dev in self.gpus:
            if self._limit_only(dev.index):  # MIG: the safe cap as a power limit
                if self._safe_cap_limit(dev):
                    changed.append(dev.index)
                continue
            # the safe cap is a clock: a rail sized for the head's last plan goes with the head
            if dev.power_limit_set_w is not None:
                limits_reset = self._reset_limit(dev) or limits_reset
            try:
                lock = self._safe_cap_lock(dev)
            except CdgpcError as e:
                logger.error("GPU %d: cannot compute the safe cap: %s", dev.index, e)
                continue
            if lock is not None:
                wanted[dev.index] = lock
        if not wanted:
            if limits_reset or changed:
                self._sync_state()
            return tuple(changed)
        if wanted.keys() - self._recorded and not self._write_state(intended=wanted):
            logger.error("cannot record the safe cap in the state file; applying it anyway")
        for index, lock in wanted.items():
            dev = self.gpus[index]
            try:
                dev.set_locked_clocks(lock.graphics_max_mhz, None)
            except CdgpcError as e:
                logger.error("GPU %d: safe cap %d MHz failed: %s", index, lock.graphics_max_mhz, e)
                continue
            self._lapse_capped.add(index)
            changed.append(index)
            logger.info("GPU %d: safe cap %d MHz applied", index, lock.graphics_max_mhz)
        self._sync_state()
        return tuple(changed)

    def _safe_cap_limit(self, device: GpuDevice) -> bool:
        """Put a MIG GPU at the safe cap's power limit (`safe_limit_w`) unless its limit is
        already at or below it (True: changed)."""
        problems: list[Refusal] = []
        changed = self._limit_at_most(device, problems, unrecorded=True)
        for problem in problems:
            logger.error("GPU %d: %s", problem.gpu, problem.reason)
        if changed is True:
            self._lapse_capped.add(device.index)
            logger.info("GPU %d (MIG mode): safe cap applied as a power limit", device.index)
        return changed is True

    def _limit_at_most(
        self, device: GpuDevice, refused: list[Refusal], *, unrecorded: bool = False
    ) -> bool | None:
        """A MIG GPU's power limit at most the safe cap's (`safe_limit_w`), written down in the
        state file first (if that fails, set anyway only when ``unrecorded``, as a lapse does):
        True when set, None when already at or below it (never raised), False (with the reason
        in ``refused``) when it was not set."""
        try:
            safe_w = safe_limit_w(device, self.safe_cap)
        except CdgpcError as e:
            refused.append(Refusal(device.index, _reason(f"cannot compute the safe cap: {e}")))
            return False
        current = device.power_limit_set_w
        if current is not None and current <= safe_w:
            return None
        if device.index not in self._recorded and not self._write_state(
            limits={device.index: safe_w}
        ):
            if not unrecorded:
                refused.append(Refusal(device.index, "cannot record the limit in the state file"))
                return False
            logger.error("cannot record the safe cap in the state file; applying it anyway")
        try:
            device.set_power_limit_w(safe_w)
        except CdgpcError as e:
            refused.append(Refusal(device.index, _reason(f"safe cap {safe_w:g} W failed: {e}")))
            return False
        return True

    @property
    def lapsed(self) -> bool:
        with self._lock:
            return self._lapsed

    @property
    def lease(self) -> LeaseState:
        with self._lock:
            return LeaseState(
                self._lapsed,
                self._lease_deadline - self._monotonic(),
                self._lapses,
                len(self._lapse_capped),
            )

    @property
    def lease_expires_s(self) -> float:
        """When the lease ends, in epoch seconds as of its last renewal (the watchdog itself
        counts on the monotonic clock)."""
        with self._lock:
            return self._lease_expires_s

    # -- shutdown -------------------------------------------------------------------------------

    def hold_job(self, job_id: str, gpus: Sequence[int]) -> tuple[list[int], list[Refusal]]:
        """The job is about to start on ``gpus`` (its Prolog says so): hold them at the safe cap,
        as the job's, until the head's first setpoint for the job takes over.

        Between two intervals the head has not planned the job, and a GPU left at default
        clocks would draw its full power against a budget that did not count it, for up to an
        interval. The safe cap is where a lapsed lease puts a GPU anyway, so a job whose head
        is away runs as every other job does then. A GPU already at or below the safe cap keeps
        its clock (never raised); one the head gave another job is shared: the job becomes one
        of its tenants and the GPU keeps its clock (one clock per GPU); one already the job's
        keeps its clock too: the head's setpoint may come before the hold (the Prolog holds
        after it registers), and an older hold has capped it already. A GPU in MIG mode is held
        by its power limit instead (`safe_limit_w`, never raised), as a lapse holds it."""
        with self._lock:
            held: list[int] = []
            refused: list[Refusal] = []
            wanted: dict[int, LockedClocks] = {}
            devices: dict[int, GpuDevice] = {}
            for gpu in dict.fromkeys(gpus):
                device = self._device(gpu)
                owner = self._jobs.get(gpu)
                if device is None:
                    refused.append(Refusal(gpu, f"no GPU with index {gpu} on this node"))
                    continue
                limit_only = self._limit_only(gpu)
                if not limit_only and any(b.mig_mode for b in self._boards.values()):
                    # beside a MIG GPU, Slurm's index is a GRES list position: maybe not this GPU
                    refused.append(
                        Refusal(
                            gpu, "another GPU here is in MIG mode: not capped (counted as drawn)"
                        )
                    )
                    continue
                if owner == job_id:
                    held.append(gpu)
                    continue
                if owner is not None:  # another job's: shared, at the clock it has
                    self._cotenants.setdefault(gpu, set()).add(job_id)
                    logger.info("GPU %d: job %s shares it with job %s", gpu, job_id, owner)
                    held.append(gpu)
                    continue
                if limit_only:  # MIG mode: the safe cap as a power limit (never raised)
                    if self._limit_at_most(device, refused) is not False:
                        self._jobs[gpu] = job_id
                        held.append(gpu)
                    continue
                try:
                    lock = self._safe_cap_lock(device)
                except CdgpcError as e:
                    refused.append(Refusal(gpu, _reason(e)))
                    continue
                if lock is None:  # already at or below the safe cap: kept
                    self._jobs[gpu] = job_id
                    held.append(gpu)
                    continue
                devices[gpu] = device
                wanted[gpu] = lock
            if wanted.keys() - self._recorded and not self._write_state(intended=wanted):
                for gpu in wanted:
                    refused.append(Refusal(gpu, "cannot record the lock in the state file"))
                wanted = {}
            for gpu, lock in wanted.items():
                if self._apply(devices[gpu], lock.graphics_max_mhz, None, refused):
                    self._jobs[gpu] = job_id
                    self._lapse_capped.discard(gpu)
                    held.append(gpu)
            self._sync_state()
            return sorted(held), refused

    def mig_parents(self, names: Sequence[str]) -> dict[str, int]:
        """The physical GPU (index) of each MIG instance Slurm names that is on this node: the
        Prolog registers a job on MIG instances with them (`GpuSet.mig_parents`)."""
        with self._lock:
            return self.gpus.mig_parents(names)

    def release_job(self, job_id: str) -> tuple[list[int], list[Refusal]]:
        """The job ended (its Epilog says so): reset the GPUs the head gave it, now, without
        waiting for the head. Only GPUs this agent knows to be the job's are touched, and a GPU
        another job still shares keeps its clock: the job's share is released, the GPU passes
        to a remaining tenant, and it returns to defaults when its last job leaves."""
        with self._lock:
            gpus = sorted(
                g
                for g in self._jobs.keys() | self._cotenants.keys()
                if self._jobs.get(g) == job_id or job_id in self._cotenants.get(g, ())
            )
            refused: list[Refusal] = []
            for gpu in gpus:
                others = self._tenants(gpu) - {job_id}
                if others:
                    owner = self._jobs.get(gpu)
                    self._jobs[gpu] = owner if owner in others else min(others)
                    self._share(gpu, others)
                    logger.info(
                        "GPU %d: job %s ended; job %s still runs on it: its clock stays",
                        gpu,
                        job_id,
                        self._jobs[gpu],
                    )
                    continue
                self._cotenants.pop(gpu, None)
                self._release(gpu, refused)
            self._sync_state()
            failed = {r.gpu for r in refused}
            return [g for g in gpus if g not in failed], refused

    def _tenants(self, gpu: int) -> set[str]:
        """Every job on ``gpu``: the one the head assigned it, and those sharing it."""
        owner = self._jobs.get(gpu)
        return self._cotenants.get(gpu, set()) | ({owner} if owner is not None else set())

    def _share(self, gpu: int, tenants: set[str]) -> None:
        """``gpu``'s jobs other than its owner (`_jobs`) are ``tenants`` less the owner."""
        others = tenants - {self._jobs.get(gpu)}
        if others:
            self._cotenants[gpu] = others
        else:
            self._cotenants.pop(gpu, None)

    def restore_defaults(self) -> list[tuple[int, CdgpcError]]:
        """Reset every GPU (trying all even if some fail); remove the state file if all worked."""
        with self._lock:
            failed = self.gpus.reset_all()
            for dev in self.gpus:
                if dev.power_limit_set_w is not None:
                    try:
                        dev.reset_power_limit()
                    except CdgpcError as e:
                        failed.append((dev, e))
            for dev, error in failed:
                logger.error("GPU %d: restoring default clocks failed: %s", dev.index, error)
            self._jobs.clear()
            self._cotenants.clear()
            self._lapse_capped.clear()
            self._sync_state()
            if not failed:
                logger.info("default clocks restored on %d GPU(s)", len(self.gpus))
            return [(dev.index, error) for dev, error in failed]

    # -- progress -------------------------------------------------------------------------------

    def record_progress(
        self,
        job_id: str,
        step: int,
        total: int | None,
        uid: int,
        *,
        latency_s: float | None = None,
        rate: float | None = None,
    ) -> None:
        """Keep the latest progress ``uid`` reported for ``job_id`` (until its GPUs are released),
        a serving job's latency and request rate with its step.

        The socket is open to every local user and the agent cannot tell who owns a job, so
        reports are kept per reporting uid (the kernel's, never the sender's word): another user
        can neither overwrite the owner's report nor lock the owner out by reporting first. The
        head, which knows each job's user and nodes, keeps only reports from root or the job's
        owner on a node where the job holds GPUs (`Coordinator`). The latest report replaces
        the one before whatever its step, so a serving job's new latency at an unchanged count
        is relayed; the head orders reports by step and time, across uids and nodes alike.
        """
        line = ProgressLine(job_id, step, total, latency_s, rate)  # validates
        with self._lock:
            key = (line.job_id, uid)
            self._progress.pop(key, None)
            self._progress[key] = ProgressReport(
                line.job_id, line.step, line.total, self._clock(), uid, line.latency_s, line.rate
            )
            own = [k for k in self._progress if k[1] == uid]
            for old in own[: max(len(own) - MAX_PROGRESS_PER_UID, 0)]:
                del self._progress[old]  # a user flooding job ids evicts only its own reports
            while len(self._progress) > MAX_PROGRESS_JOBS:
                del self._progress[next(iter(self._progress))]

    # -- the state file -------------------------------------------------------------------------

    def _state(
        self,
        extra: dict[int, LockedClocks] | None = None,
        limits: dict[int, float] | None = None,
    ) -> list[dict[str, Any]]:
        """One entry per lock that may exist (current and ``extra``, intended), with the power
        limit set on its GPU (or, where none is yet, the one intended in ``limits``); a GPU
        with a limit and no lock gets one with null clocks."""
        locks: list[dict[str, Any]] = []
        for dev in self.gpus:
            limit_w = dev.power_limit_set_w
            if limit_w is None and limits:
                limit_w = limits.get(dev.index)
            entry = {
                "index": dev.index,
                "uuid": dev.uuid,
                "graphics_min_mhz": None,
                "graphics_max_mhz": None,
                "memory_mhz": None,
                "job_id": self._jobs.get(dev.index),
                "power_limit_w": limit_w,
            }
            entries = [lock for lock in (dev.locked, (extra or {}).get(dev.index)) if lock]
            for lock in entries:
                locks.append(
                    entry
                    | {
                        "graphics_min_mhz": lock.graphics_min_mhz,
                        "graphics_max_mhz": lock.graphics_max_mhz,
                        "memory_mhz": lock.memory_mhz,
                    }
                )
            if not entries and limit_w is not None:
                locks.append(entry)  # a limit alone still needs its reset
        return locks

    def _write_state(
        self,
        intended: dict[int, LockedClocks] | None = None,
        limits: dict[int, float] | None = None,
    ) -> bool:
        """Atomically write the state file listing current (and intended) locks and limits."""
        locks = self._state(intended, limits)
        document = {
            "version": STATE_VERSION,
            "node": self.node_name,
            "pid": os.getpid(),
            "written_s": self._clock(),
            "epoch": self._epoch,
            "locks": locks,
        }
        # json.dumps, not json.dump: dump streams through the pure-Python encoder, far slower,
        # and this runs on every exchange on every node
        data = (json.dumps(document, separators=(",", ":")) + "\n").encode()
        tmp = self.state_file.with_name(f".node-state.{self.state_file.name}.tmp")
        try:
            fd = _create_private(tmp)
            try:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, self.state_file)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            _fsync_directory(self.state_file.parent)
        except OSError as e:
            logger.error("cannot write the state file %s: %s", self.state_file, e.strerror or e)
            return False
        self._recorded = frozenset(lock["index"] for lock in locks)
        return True

    def _sync_state(self) -> None:
        """The state file lists exactly what is locked now; it is absent when nothing is and no
        leader epoch needs keeping."""
        if self._epoch or any(
            dev.locked is not None or dev.power_limit_set_w is not None for dev in self.gpus
        ):
            self._write_state()
        else:
            self._remove_state_file()

    def _remove_state_file(self) -> None:
        try:
            self.state_file.unlink()
        except FileNotFoundError:
            self._recorded = frozenset()
            return
        except OSError as e:
            logger.error("cannot remove the state file %s: %s", self.state_file, e.strerror or e)
            return
        self._recorded = frozenset()
        _fsync_directory(self.state_file.parent)


def _create_private(path: Path) -> int:
    """A new file at ``path``, mode 0600, for writing; one left there by a crash is replaced,
    a missing directory made. Never follows a link put in its place."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(3):
        try:
            return os.open(path, flags, 0o600)
        except FileExistsError:  # a temp file from a write that died half-way
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, flags, 0o600)


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
