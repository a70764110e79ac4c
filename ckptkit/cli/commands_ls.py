"""``ckptkit ls``: the checkpoints of a run directory, committed or not."""

from __future__ import annotations

import click

from ckptkit.offline import list_checkpoints
from ckptkit.cli import render


@click.command("ls", short_help="List the checkpoints of a run directory.")
@click.argument("directory")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of a table.")
def ls_cmd(directory: str, as_json: bool) -> None:
    """List the checkpoints in DIRECTORY (a run directory, or one checkpoint).

    Shows each checkpoint's step, size, whether it is committed (and if not,
    why), the world size that saved it and when.

    \b
    Example:
      ckptkit ls runs/exp1
      ckptkit ls runs/exp1 --json | jq '.checkpoints[] | select(.committed) | .name'
    """
    infos = list_checkpoints(directory)
    if as_json:
        render.print_json({"url": directory, "checkpoints": [i.to_json() for i in infos]})
    else:
        render.checkpoint_table(infos, directory)
