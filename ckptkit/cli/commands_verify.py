"""``ckptkit verify``: re-read every stored byte and check it against the metadata."""

from __future__ import annotations

import sys

import click

from ckptkit.offline import verify
from ckptkit.cli import render
from ckptkit.errors import CheckpointNotFoundError


@click.command("verify", short_help="Re-read every byte and check checksums and coverage.")
@click.argument("checkpoint")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of text.")
@click.option("--threads", default=4, show_default=True, type=click.IntRange(1, 64), help="Parallel readers.")
def verify_cmd(checkpoint: str, as_json: bool, threads: int) -> None:
    """Verify CHECKPOINT: digests, coverage, object sizes and every block checksum.

    Exits 0 if the checkpoint is intact, 1 if any problem was found (each is
    printed, naming the file, tensor and rank), 2 if there is no checkpoint.

    \b
    Example:
      ckptkit verify runs/exp1/step-0001000
      ckptkit verify runs/exp1/step-0001000 --json > verify.json || echo damaged
    """
    with render.byte_progress(enabled=not as_json and sys.stdout.isatty()) as progress:
        report = verify(checkpoint, progress, threads=threads)
    if not report.found:
        raise CheckpointNotFoundError(report.problems[0].message if report.problems else f"no checkpoint at {checkpoint}")
    if as_json:
        render.print_json(report.to_json())
    else:
        render.verify_report(report)
    click.get_current_context().exit(0 if report.ok else 1)
