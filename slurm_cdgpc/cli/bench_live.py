"""``cdgpc-admin bench exchange``, ``bench register`` and ``bench slow-headers``: the live head
and agents on loopback.

Each starts real servers in worker processes (stopped on exit, Ctrl-C included) and prints one
JSON object; registered on the ``bench`` group by `slurm_cdgpc.cli.bench`.
"""

from __future__ import annotations

import click

from slurm_cdgpc.cli.output import echo_json


@click.command("exchange")
@click.option("--nodes", type=click.IntRange(min=1), required=True, help="Node agents to serve.")
@click.option("--gpus-per-node", type=click.IntRange(1, 64), default=8, show_default=True)
@click.option(
    "--processes",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Worker processes hosting the agents (nodes are split evenly).",
)
@click.option("--intervals", type=click.IntRange(min=1), default=20, show_default=True)
@click.option(
    "--timeout-s",
    type=click.FloatRange(0.0, min_open=True),
    default=2.0,
    show_default=True,
    help="The exchanger's per-node timeout (the round is bounded by twice this).",
)
@click.option(
    "--max-in-flight",
    type=click.IntRange(min=1),
    default=1024,
    show_default=True,
    help="Sockets the exchange holds open at once (cdgpcd's default; also at most half the "
    "open-files limit).",
)
@click.option("--json", "as_json", is_flag=True, help="Accepted for symmetry: output is JSON.")
def exchange_cmd(
    nodes: int,
    gpus_per_node: int,
    processes: int,
    intervals: int,
    timeout_s: float,
    max_in_flight: int,
    as_json: bool,
) -> None:
    """Time the head's concurrent exchange with N live agents (HMAC, simulated GPUs).

    Every interval sends every node a setpoint per GPU and a lease; reports the interval's
    wall time (p50/p99) and the nodes that did not answer in time.
    """
    from slurm_cdgpc.bench.exchange import bench_exchange  # noqa: PLC0415 (only when run)

    echo_json(
        bench_exchange(
            nodes,
            gpus_per_node=gpus_per_node,
            processes=processes,
            intervals=intervals,
            timeout_s=timeout_s,
            max_in_flight=max_in_flight,
        )
    )


@click.command("register")
@click.option(
    "--concurrency", type=click.IntRange(min=1), required=True, help="Simultaneous Prologs."
)
@click.option("--requests", type=click.IntRange(min=1), default=2000, show_default=True)
@click.option(
    "--timeout-s",
    type=click.FloatRange(0.0, min_open=True),
    default=10.0,
    show_default=True,
    help="Each client's request timeout.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(min=1),
    default=None,
    help="The head's connection bound (default: cdgpcd's, 256).",
)
@click.option(
    "--listen-backlog",
    type=click.IntRange(min=1),
    default=None,
    help="The head's listen backlog (default: cdgpcd's, 1024).",
)
@click.option(
    "--client-processes",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Processes the client threads are spread over (Prologs are separate processes).",
)
@click.option("--json", "as_json", is_flag=True, help="Accepted for symmetry: output is JSON.")
def register_cmd(
    concurrency: int,
    requests: int,
    timeout_s: float,
    max_connections: int | None,
    listen_backlog: int | None,
    client_processes: int,
    as_json: bool,
) -> None:
    """Time job registrations (POST /v1/jobs, as the Prolog sends them) against a live cdgpcd.

    The head (SQLite store in WAL mode, HMAC auth) runs in its own process; each client
    thread (spread over --client-processes) registers distinct jobs, one connection per
    request, and is answered only once its registration has committed. A refused or dropped
    request is an error, not retried.
    """
    from slurm_cdgpc.bench.register import bench_register  # noqa: PLC0415 (only when run)

    echo_json(
        bench_register(
            concurrency,
            requests,
            timeout_s=timeout_s,
            max_connections=max_connections,
            listen_backlog=listen_backlog,
            client_processes=client_processes,
        )
    )


@click.command("slow-headers")
@click.option("--requests", type=click.IntRange(min=1), default=300, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=4, show_default=True)
@click.option(
    "--connections",
    type=click.IntRange(min=1),
    default=None,
    help="Attacking connections (default: what cdgpcd allows one host, 64).",
)
@click.option(
    "--fill-bytes",
    type=click.IntRange(min=0),
    default=None,
    help="What each attacking connection sends at once (default: 4 KiB short of the head's "
    "header block bound).",
)
@click.option("--chunk-bytes", type=click.IntRange(min=1), default=300, show_default=True)
@click.option(
    "--period-s",
    type=click.FloatRange(0.0, min_open=True),
    default=0.05,
    show_default=True,
    help="How often each attacking connection sends its chunk.",
)
@click.option(
    "--warmup-s",
    type=click.FloatRange(min=0.0),
    default=5.0,
    show_default=True,
    help="How long the attack runs before registrations are timed.",
)
@click.option("--json", "as_json", is_flag=True, help="Accepted for symmetry: output is JSON.")
def slow_headers_cmd(
    requests: int,
    concurrency: int,
    connections: int | None,
    fill_bytes: int | None,
    chunk_bytes: int,
    period_s: float,
    warmup_s: float,
    as_json: bool,
) -> None:
    """Time job registrations against a live cdgpcd while one host trickles header blocks.

    The attack holds as many connections as one host may, each sending a header block that
    never ends: most of the head's bound at once, then a few hundred bytes at a time.
    Registrations are timed without it, then under it.
    """
    from slurm_cdgpc.bench.slow_headers import (  # noqa: PLC0415 (only when run)
        PER_HOST_CONNECTIONS,
        bench_slow_headers,
    )

    echo_json(
        bench_slow_headers(
            requests,
            concurrency=concurrency,
            connections=connections or PER_HOST_CONNECTIONS,
            fill_bytes=fill_bytes,
            chunk_bytes=chunk_bytes,
            period_s=period_s,
            warmup_s=warmup_s,
        )
    )


COMMANDS = (exchange_cmd, register_cmd, slow_headers_cmd)
