"""``cdgpc-admin bench soak``: cdgpcd under job churn on a large simulated cluster, accelerated.

Registered on the ``bench`` group next to ``exchange`` and ``register``; prints one JSON object.
"""

from __future__ import annotations

import click

from slurm_cdgpc.cli.output import echo_json


@click.command("soak")
@click.option("--nodes", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--gpus-per-node", type=click.IntRange(1, 64), default=8, show_default=True)
@click.option(
    "--minutes",
    type=click.FloatRange(0.0, min_open=True),
    default=30.0,
    show_default=True,
    help="Cluster time to simulate.",
)
@click.option(
    "--accel",
    type=click.FloatRange(0.0, min_open=True),
    default=6.0,
    show_default=True,
    help="Cluster seconds per wall second (the head's interval is 30 s / accel).",
)
@click.option(
    "--processes",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Worker processes hosting the agents.",
)
@click.option(
    "--burst",
    type=click.IntRange(min=0),
    default=200,
    show_default=True,
    help="Registrations sent at once when the soak starts (simultaneous Prologs).",
)
@click.option(
    "--occupancy",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=0.7,
    show_default=True,
    help="Share of the GPUs kept busy with jobs.",
)
@click.option(
    "--mean-job-minutes",
    type=click.FloatRange(0.0, min_open=True),
    default=10.0,
    show_default=True,
    help="Mean job length in cluster time (exponentially distributed).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Accepted for symmetry: output is JSON.")
def soak_cmd(
    nodes: int,
    gpus_per_node: int,
    minutes: float,
    accel: float,
    processes: int,
    burst: int,
    occupancy: float,
    mean_job_minutes: float,
    seed: int,
    as_json: bool,
) -> None:
    """Run a real cdgpcd with N live agents under job churn; report its memory and intervals.

    Jobs register and deregister through the head's API as the Prolog and Epilog do; cdgpcd's
    resident memory is sampled throughout (it must stay flat). Needs root (cdgpcd's HMAC key).
    """
    from slurm_cdgpc.bench.soak import SoakSettings, bench_soak  # noqa: PLC0415 (only when run)

    echo_json(
        bench_soak(
            SoakSettings(
                nodes=nodes,
                gpus_per_node=gpus_per_node,
                sim_minutes=minutes,
                accel=accel,
                processes=processes,
                burst=burst,
                occupancy=occupancy,
                mean_job_sim_s=60.0 * mean_job_minutes,
                seed=seed,
            )
        )
    )
