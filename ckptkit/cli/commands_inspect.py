"""``ckptkit inspect``: what a checkpoint holds, from its metadata alone."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from ckptkit.cli.options import json_option, storage_option
from ckptkit.cli.output import Output, escape, human_bytes, ranks_text

if TYPE_CHECKING:  # the library is imported when the command runs (and never imports torch here)
    from ckptkit.offline import CheckpointDescription


@click.command("inspect", short_help="Show tensors, layouts and pieces per rank.")
@click.argument("checkpoint")
@json_option
@click.option("--tensor", "pattern", metavar="PATTERN", help="Only tensors whose key matches this shell pattern.")
@click.option("--limit", default=500, show_default=True, metavar="N",
              help="Show at most N rows per table (0: all); --json always has everything.")
@storage_option
def inspect_cmd(checkpoint: str, as_json: bool, pattern: str | None, limit: int,
                storage_options: dict[str, Any] | None) -> None:
    """Describe CHECKPOINT: tensors, dtypes, shapes, layouts, and what each rank wrote.

    Reads the manifest and the index files only; no data object is read.

    \b
    Example:
      ckptkit inspect runs/exp1/step-0001000
      ckptkit inspect runs/exp1/step-0001000 --tensor 'model.layers.0.*' --json
    """
    from ckptkit.offline import describe

    desc = describe(checkpoint, storage_options=storage_options)
    if pattern is not None:
        desc = desc.select(pattern)
    out = Output(as_json)
    if as_json:
        out.json(desc.to_json())
    else:
        render(out, desc, pattern, limit=limit or None)


def render(out: Output, d: CheckpointDescription, pattern: str | None = None, limit: int | None = None) -> None:
    """The tables of ``inspect``; at most ``limit`` rows each (a 300k-tensor checkpoint would take
    minutes to lay out as a table and nobody reads it: the last row says how many are left)."""
    meta = d.meta
    out.text(f"[bold]checkpoint[/] {escape(d.url)}", markup=True)
    saved = f"saved {meta.get('created', '?')} by ckptkit {meta.get('ckptkit_version', '?')}"
    out.text(f"  world size {d.world_size} · format v{d.version} · {escape(saved)}", markup=True)
    logical = sum(t.nbytes for t in d.tensors)
    what = f"{len(d.tensors)} tensors" + (f" matching {pattern!r}" if pattern is not None else "")
    total = f" (checkpoint total {human_bytes(d.total_bytes)})" if pattern is not None else ""
    out.text(f"  {escape(what)}: {human_bytes(logical)}{total}", markup=True)
    if d.parallel:
        out.text(f"  parallel config: {escape(d.parallel)}", markup=True)
    for m in d.meshes:
        dims = ", ".join(f"{n}={s}" for n, s in zip(m.dims, m.shape))
        out.text(f"  mesh {escape(m.name)}: ({escape(dims)}) on ranks {ranks_text(m.ranks)}", markup=True)
    if d.values:
        shown = d.values if limit is None else d.values[:limit]
        more = f" ... ({len(d.values) - len(shown)} more; --limit 0 shows all)" if len(shown) < len(d.values) else ""
        out.text(f"  values: {escape(', '.join(shown))}{more}", markup=True)
    if d.per_rank_keys:
        out.text(f"  per-rank values: {escape(', '.join(d.per_rank_keys))}", markup=True)
    if meta.get("user"):
        out.text(f"  user metadata: {escape(json.dumps(meta['user']))}", markup=True)
    if d.tensors:
        rows = [[escape(t.key), t.dtype, escape(str(list(t.shape))), human_bytes(t.nbytes), escape(t.layout),
                 str(t.stored_pieces)] for t in d.tensors[:limit]]
        if limit is not None and len(d.tensors) > limit:
            rows.append([f"... {len(d.tensors) - limit} more (--tensor PATTERN, --limit 0 or --json)", "", "", "", "", ""])
        out.table([("key", "left"), ("dtype", "left"), ("shape", "left"), ("size", "right"), ("layout", "left"),
                   ("pieces", "right")], rows, title="tensors")
    else:
        out.text("  (no tensors)")
    rows = [[str(r.rank), str(r.pieces), human_bytes(r.nbytes), escape(", ".join(r.value_keys) or "-")]
            for r in d.ranks[:limit]]
    if limit is not None and len(d.ranks) > limit:
        rows.append([f"... {len(d.ranks) - limit} more", "", "", ""])
    out.table([("rank", "right"), ("pieces", "right"), ("bytes", "right"), ("per-rank values", "left")], rows,
              title="pieces per rank")
