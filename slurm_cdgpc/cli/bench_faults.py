"""``cdgpc-admin bench faults``: what the fault, security, fuzz and soak tests proved."""

from __future__ import annotations

from pathlib import Path

import click

from slurm_cdgpc.bench.faults import EvidenceError, evidence_dir, render_text, summarise_dir
from slurm_cdgpc.cli.output import echo_json


@click.command("faults")
@click.option(
    "--evidence-dir",
    "evidence_dir_",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the tests wrote their evidence [default: $CDGPC_EVIDENCE_DIR or build/evidence].",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of text.")
def faults_cmd(evidence_dir_: Path | None, as_json: bool) -> None:
    """Summarise the evidence of the last `pytest -m 'faults or security'` run.

    Faults injected and survived, the worst overshoot and its duration, registrations sent and
    stored, requests refused per attack class, fuzz cases, soak memory, takeover times. A kind no
    test recorded is reported as absent.
    """
    directory = evidence_dir() if evidence_dir_ is None else evidence_dir_
    try:
        summary = summarise_dir(directory)
    except EvidenceError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        echo_json(summary)
    else:
        click.echo(render_text(summary))
