"""``ckptkit ls``: the checkpoints of a run directory, committed or not."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ckptkit.cli.options import json_option, storage_option
from ckptkit.cli.output import Output, escape, human_bytes

if TYPE_CHECKING:  # the library is imported when the command runs (and never imports torch here)
    from ckptkit.offline import CheckpointInfo


@click.command("ls", short_help="List the checkpoints of a run directory.")
@click.argument("directory")
@json_option
@storage_option
def ls_cmd(directory: str, as_json: bool, storage_options: dict[str, Any] | None) -> None:
    """List the checkpoints in DIRECTORY (a run directory, or one checkpoint).

    Shows each checkpoint's step, size, whether it is committed (and if not,
    why), the world size that saved it and when. Reads manifests only.

    \b
    Example:
      ckptkit ls runs/exp1
      ckptkit ls runs/exp1 --json | jq '.checkpoints[] | select(.committed) | .name'
      ckptkit ls s3://bucket/run1 --storage-option endpoint_url=http://localhost:9000
    """
    from ckptkit.offline import list_checkpoints

    infos = list_checkpoints(directory, storage_options=storage_options)
    out = Output(as_json)
    if as_json:
        out.json({"url": directory, "checkpoints": [i.to_json() for i in infos]})
    else:
        render(out, infos, directory)


def render(out: Output, infos: list[CheckpointInfo], url: str) -> None:
    if not infos:
        out.text(f"no checkpoints in {escape(url)}", markup=True)
        return
    columns = [("name", "left"), ("step", "right"), ("size", "right"), ("committed", "left"), ("world", "right"),
               ("metrics", "left"), ("kept as", "left"), ("created", "left")]
    rows = []
    for i in infos:
        committed = "[green]yes[/]" if i.committed else f"[red]no[/]: {escape(i.reason or '')}"
        metrics = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(i.metrics.items()))
        rows.append([escape(i.name), "-" if i.step is None else str(i.step), human_bytes(i.total_bytes), committed,
                     "-" if i.world_size is None else str(i.world_size), escape(metrics or "-"),
                     escape(", ".join(i.keep) or "-"), escape(i.created or "-")])
    out.table(columns, rows, title=escape(url))
