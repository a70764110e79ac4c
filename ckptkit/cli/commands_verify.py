"""``ckptkit verify``: re-read every stored byte and check it against the metadata."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ckptkit.cli.options import json_option, storage_option, threads_option
from ckptkit.cli.output import Output, escape, human_bytes

if TYPE_CHECKING:  # the library is imported when the command runs (and never imports torch here)
    from ckptkit.offline import VerifyReport


@click.command("verify", short_help="Re-read every byte and check checksums and coverage.")
@click.argument("checkpoint")
@json_option
@threads_option(4, "Parallel readers.")
@storage_option
def verify_cmd(checkpoint: str, as_json: bool, threads: int, storage_options: dict[str, Any] | None) -> None:
    """Verify CHECKPOINT: digests, coverage, object sizes and every block checksum.

    Exits 0 if the checkpoint is intact, 1 if any problem was found (each is
    printed, naming the file, tensor and rank), 2 if there is no checkpoint.

    \b
    Example:
      ckptkit verify runs/exp1/step-0001000
      ckptkit verify runs/exp1/step-0001000 --json > verify.json || echo damaged
    """
    from ckptkit import CheckpointNotFoundError
    from ckptkit.offline import verify

    out = Output(as_json)
    with out.progress("verifying") as progress:
        report = verify(checkpoint, progress, threads=threads, storage_options=storage_options)
    if not report.found:
        raise CheckpointNotFoundError(report.problems[0].message if report.problems else f"no checkpoint at {checkpoint}")
    if as_json:
        out.json(report.to_json())
    else:
        render(out, report)
    click.get_current_context().exit(0 if report.ok else 1)


def render(out: Output, report: VerifyReport) -> None:
    counts = (f"{report.tensors} tensors, {report.pieces} pieces, {human_bytes(report.bytes_checked)} checked "
              f"in {report.objects} data object{'s' * (report.objects != 1)}")
    if report.ok:
        out.text(f"[green]OK[/] {escape(report.url)}: {counts}", markup=True)
        return
    for p in report.problems:
        out.text(f"[red]{escape(p.kind)}[/]: {escape(p.message)}", markup=True)
    n = len(report.problems)
    checked = f" ({counts})" if report.tensors or report.pieces else ""
    out.text(f"[red]FAILED[/] {escape(report.url)}: {n} problem{'s' * (n != 1)}{checked}", markup=True)
