"""``ckptkit inspect``: what a checkpoint holds, from its metadata alone."""

from __future__ import annotations

import click

from ckptkit.offline import describe
from ckptkit.cli import render


@click.command("inspect", short_help="Show tensors, layouts and pieces per rank.")
@click.argument("checkpoint")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of tables.")
@click.option("--tensor", "pattern", metavar="PATTERN", help="Only tensors whose key matches this shell pattern.")
@click.option("--limit", default=500, show_default=True, metavar="N",
              help="Show at most N rows per table (0: all); --json always has everything.")
def inspect_cmd(checkpoint: str, as_json: bool, pattern: str | None, limit: int) -> None:
    """Describe CHECKPOINT: tensors, dtypes, shapes, layouts, and what each rank wrote.

    Reads the manifest and the index files only; no data object is read.

    \b
    Example:
      ckptkit inspect runs/exp1/step-0001000
      ckptkit inspect runs/exp1/step-0001000 --tensor 'model.layers.0.*' --json
    """
    desc = describe(checkpoint)
    if pattern is not None:
        desc = desc.select(pattern)
    if as_json:
        render.print_json(desc.to_json())
    else:
        render.description(desc, pattern, limit=limit or None)
