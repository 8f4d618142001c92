"""``cdgpc-noded [--config PATH] [--node-name NAME]``: builds the node agent from the configuration
and runs it (HTTP listener, progress socket, spool forwarding, lease ticks); ``cdgpc-noded
exchange`` is `slurm_cdgpc.transport.forward`. Nothing here decides: `NodeAgent` does. Like all
of `agent/`, it never reaches `control/` (`tests/unit/test_import_graph.py`). Tests:
`tests/integration/test_agent_live.py`, `tests/integration/test_systemd_live.py`; design:
DESIGN.md, "Safety" (The lease) and "Under systemd".
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
import zlib
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from types import FrameType
from typing import Final

from slurm_cdgpc.agent.node import NodeAgent
from slurm_cdgpc.agent.progress import ProgressServer, socket_reporter
from slurm_cdgpc.agent.server import AgentHttpServer
from slurm_cdgpc.config import Config, load_config
from slurm_cdgpc.errors import CdgpcError, FatalError, InputError
from slurm_cdgpc.gpu.device import GpuSet
from slurm_cdgpc.service import serve, settle_heap
from slurm_cdgpc.slurm.spool import DEFAULT_SPOOL_DIR, forward_spool
from slurm_cdgpc.systemd import Notifier
from slurm_cdgpc.transport.auth import (
    AccessPolicy,
)
from slurm_cdgpc.transport.credentials import signer_from_config, verifier_from_config
from slurm_cdgpc.transport.http import HeadClient
from slurm_cdgpc.wire.protocol import check_node_name

logger = logging.getLogger(__name__)

TICK_PERIOD_S: Final = 0.5
#: fault tests only: a `slurm_cdgpc.gpu.simulated.FaultFile` the simulated GPUs obey (never
#: read with ``node.backend = nvml``; not a configuration key, so no config file can set it)
SIMULATED_FAULTS_ENV: Final = "CDGPC_SIMULATED_FAULTS"
#: how often registrations a Prolog or Epilog spooled while the head was away are sent on
SPOOL_FORWARD_PERIOD_S: Final = 30.0


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["exchange"]:  # the SSH transport: one exchange, JSON on stdin and stdout
        from slurm_cdgpc.transport.forward import main as exchange_main  # noqa: PLC0415

        return exchange_main(words[1:])
    parser = argparse.ArgumentParser(
        prog="cdgpc-noded",
        description="Node agent of slurm-cdgpc: applies GPU clock caps. "
        "`cdgpc-noded exchange` relays one exchange from stdin to the running agent (SSH).",
    )
    parser.add_argument(
        "--config",
        type=Path,
        help="configuration file (default: CDGPC_CONFIG or /etc/cdgpc/cdgpc.toml)",
    )
    parser.add_argument("--node-name", help="this node's name in replies (default: host name)")
    args = parser.parse_args(words)
    return serve("cdgpc-noded", lambda: run(load_config(args.config), node_name=args.node_name))


def open_gpus(config: Config, node_name: str) -> GpuSet:
    """The node's GPUs, from the configured backend."""
    node = config.node
    if node.backend == "simulated":
        # numpy only here; jobs run on the GPUs when CDGPC_SIMULATED_JOBS is set (the demo)
        from slurm_cdgpc.gpu.workloads import simulated_node  # noqa: PLC0415

        seed = zlib.crc32(node_name.encode())  # distinct UUIDs per simulated node
        kinds = node.simulated_gpu_type
        gpus = simulated_node(
            kinds,
            # TYPE:N,TYPE:N gives its own counts; simulated_gpu_count is for one TYPE
            None if ":" in kinds or "," in kinds else node.simulated_gpu_count,
            seed=seed,
            report=socket_reporter(node.progress_socket),
        )
        faults_file = os.environ.get(SIMULATED_FAULTS_ENV, "").strip()
        if faults_file:
            from slurm_cdgpc.gpu.simulated import install_faults  # noqa: PLC0415

            install_faults(gpus, Path(faults_file))
            logger.warning("simulated GPU faults follow %s (fault tests only)", faults_file)
        return gpus
    from slurm_cdgpc.gpu.nvml import open_nvml_gpus  # noqa: PLC0415 - pynvml only here

    return open_nvml_gpus()


def make_policy(config: Config) -> AccessPolicy:
    """Root and the Slurm user may exchange; an unknown Slurm user leaves root only."""
    try:
        return AccessPolicy.from_names(slurm_user=config.auth.slurm_user)
    except InputError as e:
        logger.warning("%s; only root may send setpoints", e)
        return AccessPolicy()


def run(config: Config, *, node_name: str | None = None) -> int:
    """Run the agent until SIGTERM, SIGINT or SIGHUP; 0, or 1 if a GPU could not be reset.

    Start-up, in this order: open the GPUs (``node.backend``); build the `NodeAgent`, which
    resets every GPU first if a crash left a state file; the request verifier and the reply
    signer (``auth.method``); the progress socket (a failure there is logged, not fatal); the
    HTTP listener and the spool forwarder (every `SPOOL_FORWARD_PERIOD_S`); then `NodeAgent.tick`
    every `TICK_PERIOD_S` on this thread. At the stop the listener and the progress socket close
    and every GPU goes back to default clocks.
    """
    name = check_node_name(node_name or socket.gethostname().split(".")[0])
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        logger.info("%s received: stopping", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)

    gpus = open_gpus(config, name)
    with ExitStack() as cleanup:
        close = getattr(gpus, "close", None)
        if callable(close):
            cleanup.callback(close)
        agent = NodeAgent(
            gpus,
            config.lease.safe_cap,
            config.node.state_file,
            time.time,
            monotonic=time.monotonic,  # the lease: a stepped wall clock cannot stretch it
            node_name=name,
            lease_duration_s=config.lease.duration_s,
            max_lease_s=2 * config.lease.duration_s,
            on_lapse=config.lease.on_lapse,
            on_override=config.node.on_override,
        )
        failed = _serve(config, agent, stop)
        return 1 if failed else 0
    return 1  # not reached (ExitStack does not swallow exceptions)


def _serve(config: Config, agent: NodeAgent, stop: threading.Event) -> bool:
    """Run until ``stop``; always restore defaults at the end. True if a GPU reset failed."""
    progress: ProgressServer | None = None
    server: AgentHttpServer | None = None
    thread: threading.Thread | None = None
    notifier = Notifier.from_environment()
    try:
        verifier = verifier_from_config(config)
        policy = make_policy(config)
        progress = ProgressServer(config.node.progress_socket, agent.record_progress)
        try:
            progress.start()
        except FatalError as e:
            logger.error("%s; progress reports are disabled", e)
            progress = None
        address = (config.node.listen_address, config.node.listen_port)
        try:
            server = AgentHttpServer(
                address, agent, verifier, policy, signer=signer_from_config(config)
            )
        except OSError as e:
            raise FatalError(
                f"cannot listen on {address[0]}:{address[1]}: {e.strerror or e}"
            ) from e
        settle_heap()  # start-up's objects out of the collector's full passes
        thread = threading.Thread(target=server.serve_forever, name="http", daemon=True)
        thread.start()
        threading.Thread(
            target=_forward_spool_until, args=(config, stop), name="spool", daemon=True
        ).start()
        logger.info(
            "cdgpc-noded on %s: %d GPU(s), listening on %s:%d (%s auth), lease %gs, safe cap %s",
            agent.node_name,
            len(agent.gpus),
            config.node.listen_address,
            server.port,
            config.auth.method,
            config.lease.duration_s,
            config.lease.safe_cap,
        )
        notifier.ready(f"{len(agent.gpus)} GPU(s), listening on port {server.port}")
        while not stop.wait(TICK_PERIOD_S):
            try:
                agent.tick()
            except Exception:
                logger.exception("watchdog tick failed")
            notifier.watchdog()  # the loop turns: the lease watchdog is alive
    finally:
        notifier.stopping("stopping: restoring default clocks")
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5.0)
        if progress is not None:
            progress.close()
        failed = agent.restore_defaults()
        logger.info("cdgpc-noded stopped%s", f" ({len(failed)} GPU(s) not reset)" if failed else "")
    return bool(failed)


def _forward_spool_until(config: Config, stop: threading.Event) -> None:
    """Every `SPOOL_FORWARD_PERIOD_S`, send what the hooks spooled while the head was away."""
    while not stop.wait(SPOOL_FORWARD_PERIOD_S):
        if not DEFAULT_SPOOL_DIR.is_dir():
            continue
        try:
            client = HeadClient(config.head.url, signer_from_config(config))
            result = forward_spool(client, DEFAULT_SPOOL_DIR)
        except CdgpcError as e:
            logger.warning("spooled registrations not forwarded: %s", e)
            continue
        if result.sent or result.dropped:
            logger.info(
                "spool: %d forwarded, %d dropped, %d left", result.sent, result.dropped, result.left
            )


if __name__ == "__main__":
    raise SystemExit(main())
