"""The automatic progress hook: a PyTorch job reports its optimizer steps, with no change to it.

It runs inside the job's own Python (any CPython >= 3.8, nothing of ours installed): standard
library only, Python 3.8 syntax, no thread, no import of torch, nothing raised into the job
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Progress"; tests:
`tests/unit/test_progress_hook.py`, `tests/integration/test_progress_hook_live.py`.
"""

from __future__ import annotations

import atexit
import importlib
import os
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, MutableMapping, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

DEFAULT_SOCKET = "/run/cdgpc/progress.sock"
SOCKET_ENV = "CDGPC_NODE_PROGRESS_SOCKET"
JOB_ID_ENV = "SLURM_JOB_ID"
SWITCH_ENV = "CDGPC_PROGRESS"
INTERVAL_ENV = "CDGPC_PROGRESS_INTERVAL"
OFF_VALUES = ("off", "0", "false", "no")
RANK_ENVS = ("LOCAL_RANK", "SLURM_LOCALID")
DEFAULT_INTERVAL_S = 1.0
MAX_COUNT = 2**53  # slurm_cdgpc.wire.protocol.MAX_COUNT
_DIGITS = frozenset("0123456789")

_reporter: Reporter | None = None
_finder: _ImportWatcher | None = None
_handle: Any = None  # torch's RemovableHandle of the post hook


# -- the line and the environment --------------------------------------------------------------


def progress_line(job_id: str, step: int, total: int | None = None) -> bytes:
    """What the agent reads: ``ProgressLine(job_id, step, total).to_json()`` and a newline.

    The format is duplicated from slurm_cdgpc.wire.protocol because the job's Python has no
    slurm_cdgpc (a unit test keeps the two equal); a job id is digits, ``_`` or ``+``: no escaping.
    """
    text = "null" if total is None else str(int(total))
    return f'{{"job_id":"{job_id}","step":{int(step)},"total":{text}}}\n'.encode("ascii")


def valid_job_id(text: str) -> bool:
    """``123``, ``123_4`` or ``123+1``, as `slurm_cdgpc.wire.names.JOB_ID` says."""
    job, sep, part = text.partition("_") if "_" in text else text.partition("+")
    return _number(job) and job != "0" and (not sep or _number(part))


def _number(text: str) -> bool:
    """``0``, or 1 to 10 digits without a leading zero."""
    return 0 < len(text) <= 10 and _DIGITS.issuperset(text) and (text == "0" or text[0] != "0")


def job_id_of(env: Mapping[str, str]) -> str | None:
    """The job to report for, or None when the hook must stay off (no job, switched off)."""
    if env.get(SWITCH_ENV, "").strip().lower() in OFF_VALUES:
        return None
    job = env.get(JOB_ID_ENV, "")
    return job if valid_job_id(job) else None


def first_local_task(env: Mapping[str, str]) -> bool:
    """Whether this process is the job's first on its node (torchrun's and srun's local rank)."""
    return all(env.get(name, "").strip() in ("", "0") for name in RANK_ENVS)


def interval_of(env: Mapping[str, str]) -> float:
    try:
        interval_s = float(env.get(INTERVAL_ENV, DEFAULT_INTERVAL_S))
    except ValueError:
        return DEFAULT_INTERVAL_S
    return interval_s if 0.0 <= interval_s < float("inf") else DEFAULT_INTERVAL_S


# -- the reporter ------------------------------------------------------------------------------


class Reporter:
    """Counts steps and sends them, rate-limited and without ever waiting on the agent.

    Each optimizer step counts (per optimizer; the step is the most any optimizer took, so a
    GAN's two optimizers make one step per iteration). At most once per ``interval_s``
    (``$CDGPC_PROGRESS_INTERVAL``, default 1 s), inside the step that crosses it, one
    non-blocking send of one line to ``path`` (``$CDGPC_NODE_PROGRESS_SOCKET``, else
    `DEFAULT_SOCKET`); a send that cannot go at once is dropped. One more at exit if the step
    moved. Only the first task of the job on a node reports (``LOCAL_RANK`` and
    ``SLURM_LOCALID`` unset or 0).
    """

    def __init__(
        self,
        job_id: str,
        path: str,
        interval_s: float = DEFAULT_INTERVAL_S,
        env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job_id = job_id
        self.path = path
        self.interval_s = interval_s
        self.env = os.environ if env is None else env
        self.clock = clock
        self.step = 0
        self.total: int | None = None
        self.enabled = True
        self.sent: tuple[int, int | None] | None = None
        self.attempts = 0  # sends tried (tests and the bench read them)
        self._next_s = float("-inf")
        self._pid: int | None = None  # the process that last counted: the one that flushes
        import weakref  # noqa: PLC0415 (made once torch is imported, not at interpreter start)

        self._counts: MutableMapping[Any, int] = weakref.WeakKeyDictionary()

    def count_step(self, optimizer: object, args: object = None, kwargs: object = None) -> None:
        """torch's optimizer step post hook: one more step of ``optimizer``."""
        try:
            n = self._counts.get(optimizer, 0) + 1
            self._counts[optimizer] = n
            self.step = max(self.step, n)
            self._pid = os.getpid()
            if self.clock() >= self._next_s:
                self._due()
        except Exception:  # never into the job's training loop
            pass

    def report(self, step: int, total: int | None = None) -> None:
        """The framework's step (the step is the larger of it and the count), and its total."""
        try:
            if total is not None:
                self.set_total(total)
            step = int(step)
            if 0 <= step <= MAX_COUNT and step > self.step:
                self.step = step
            self._pid = os.getpid()
            if self.clock() >= self._next_s:
                self._due()
        except Exception:
            pass

    def set_total(self, total: int | None) -> None:
        """The job's total steps, sent with every later report (None or < 1: unknown)."""
        try:
            total = None if total is None else int(total)
        except (TypeError, ValueError, OverflowError):
            return
        self.total = total if total is not None and 0 < total <= MAX_COUNT else None
        self._pid = os.getpid()

    def flush(self) -> None:
        """At exit: send what the last report did not say, from the process that counted
        (not from every Python the job starts, nor from a forked DataLoader worker)."""
        if os.getpid() == self._pid:
            self.send()

    def send(self) -> bool:
        """One non-blocking send of the current step, unless it was sent already or this is
        not the node's reporting task. True when the line went out whole."""
        if not self.enabled or not first_local_task(self.env):
            return False
        total = self.total
        step = self.step if total is None else min(self.step, total)
        if self.sent == (step, total):
            return False
        self.attempts += 1
        if not _send(self.path, progress_line(self.job_id, step, total)):
            return False
        self.sent = (step, total)
        return True

    def _due(self) -> None:
        self._next_s = self.clock() + self.interval_s
        self.send()


def _send(path: str, line: bytes) -> bool:
    """Connect, send, close, all non-blocking: an agent that is down, slow or busy costs one
    failed system call, never a wait."""
    try:
        import socket  # noqa: PLC0415 (not at interpreter start: most processes never send)

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except Exception:
        return False
    try:
        sock.setblocking(False)
        sock.connect(path)
        return sock.send(line) == len(line)
    except Exception:  # OSError (absent, refused, backlog full), ValueError (a NUL in the path)
        return False
    finally:
        sock.close()


# -- waiting for torch -------------------------------------------------------------------------


class _ImportWatcher:
    """A `sys.meta_path` finder that calls ``then(module)`` once ``name`` has been imported."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then
        self._busy = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != self.name or self._busy:
            return None
        self._busy = True  # the other finders below must not come back here
        try:
            spec: ModuleSpec | None = None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        except Exception:
            return None  # the import goes on without us, and fails as it would have
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Loader(spec.loader, self)  # type: ignore[assignment]
        return spec

    def invalidate_caches(self) -> None:
        pass

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass

    def imported(self, module: ModuleType) -> None:
        self.remove()
        try:
            self.then(module)
        except Exception:
            pass


class _Loader:
    """Wraps the loader of the watched module; the module itself keeps its own loader."""

    def __init__(self, loader: Any, watcher: _ImportWatcher) -> None:
        self.loader = loader
        self.watcher = watcher

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create = getattr(self.loader, "create_module", None)
        module: ModuleType | None = None if create is None else create(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self.loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader
        self.loader.exec_module(module)
        self.watcher.imported(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def watch_import(name: str, then: Callable[[ModuleType], None]) -> None:
    """Call ``then(module)`` when ``name`` has been imported (now, if it is already)."""
    global _finder
    module = sys.modules.get(name)
    if module is not None:
        then(module)
        return
    watcher = _ImportWatcher(name, then)
    sys.meta_path.insert(0, watcher)
    _finder = watcher


def _on_torch(torch: ModuleType) -> None:
    """torch >= 2.0: count every optimizer step (older torch: nothing)."""
    global _handle
    try:
        optimizer = importlib.import_module("torch.optim.optimizer")
        register = getattr(optimizer, "register_optimizer_step_post_hook", None)
        reporter = get_reporter()
        if register is not None and reporter is not None and _handle is None:
            _handle = register(reporter.count_step)
    except Exception:
        pass


# -- the module's functions --------------------------------------------------------------------


def get_reporter(env: Mapping[str, str] | None = None) -> Reporter | None:
    """This process's reporter, made from the environment on first use (None: off)."""
    global _reporter
    if _reporter is None:
        env = os.environ if env is None else env
        job = job_id_of(env)
        if job is None:
            return None
        path = env.get(SOCKET_ENV) or DEFAULT_SOCKET
        _reporter = Reporter(job, path, interval_of(env))
        atexit.register(_reporter.flush)
    return _reporter if _reporter.enabled else None


def install() -> bool:
    """Count the optimizer steps of the torch this process imports; False when off.

    Loaded as a top-level module, by `sitecustomize` (the TaskProlog appends this directory to
    the job's PYTHONPATH) or by `slurm_cdgpc.integrations`; a `sys.meta_path` finder waits for
    the job's own import of torch. ``CDGPC_PROGRESS=off`` turns it off."""
    try:
        if job_id_of(os.environ) is None:
            return False
        watch_import("torch", _on_torch)
        return True
    except Exception:
        return False


def counting() -> bool:
    """Whether optimizer steps are being counted (torch imported, hook registered)."""
    return _handle is not None and _reporter is not None and _reporter.enabled


def set_total(total: int | None) -> None:
    """The job's total steps (from its framework), sent with the reports that follow."""
    reporter = get_reporter()
    if reporter is not None:
        reporter.set_total(total)


def report(step: int, total: int | None = None) -> None:
    """Report ``step`` (of ``total``) through the one rate-limited reporter (for callbacks)."""
    reporter = get_reporter()
    if reporter is not None:
        reporter.report(step, total)


def disable() -> None:
    """Stop reporting and counting in this process."""
    global _handle
    if _reporter is not None:
        _reporter.enabled = False
    if _finder is not None:
        _finder.remove()
    if _handle is not None:
        try:
            _handle.remove()
        except Exception:
            pass
        _handle = None
