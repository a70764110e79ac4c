"""``ckptkit reshard``: rewrite a checkpoint laid out for another parallel config, offline.

Parses the target (``--to tp4pp2`` plus ``--dp``, ``--vpp``, ``--pp-layers``)
and the memory budget, calls :func:`ckptkit.offline.resharding.reshard` (or
:func:`~ckptkit.offline.resharding.plan` for ``--dry-run``) and renders the plan
or the result. ``--format`` is a choice so that other writers (a Megatron
``torch_dist`` exporter) can be added beside ``ckptkit``.
"""

from __future__ import annotations

import dataclasses
import re
import sys

import click

from ckptkit.cli import render
from ckptkit.cli.commands_convert import progress_bar
from ckptkit.errors import CkptkitError
from ckptkit.layout.config import ParallelConfig
from ckptkit.plan.reshard_plan import ReshardPlanOptions, plan_summary_lines

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
FORMATS = ["ckptkit", "megatron"]  # megatron: a torch_dist directory, written by converters/megatron_export.py


def parse_size(text: str) -> int:
    """``1GiB``, ``512MiB``, ``2G``, ``1.5g`` or a byte count; binary units (GB means GiB here)."""
    m = _SIZE.match(text)
    if not m:
        raise click.BadParameter(f"{text!r} is not a size (e.g. 1GiB, 512MiB, 2G, or a byte count)")
    unit = (m.group(2) or "").lower()[:1]
    return int(float(m.group(1)) * _UNITS[unit])


def parse_layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of layer counts (e.g. 15,17)") from None


@click.command("reshard", short_help="Rewrite a checkpoint for another layout (tp/pp/dp/vpp), offline.")
@click.argument("source")
@click.argument("dest", required=False)
@click.option("--to", "to", required=True, help="Target parallel config, e.g. tp4pp2, tp2pp2dp4, tp1pp4vpp2.")
@click.option("--dp", type=click.IntRange(min=1), default=None, help="Target data-parallel size (default: from --to, else 1).")
@click.option("--vpp", type=click.IntRange(min=1), default=None, help="Target virtual pipeline chunks per stage.")
@click.option("--pp-layers", default=None,
              help="Layers per pipeline chunk in forward order (pp*vpp counts), for uneven stages, e.g. 15,17.")
@click.option("--num-layers", type=click.IntRange(min=1), default=None,
              help="The model's layer count, for per-layer rules when no stacked layer tensor tells it.")
@click.option("--max-memory", default="1GiB", show_default=True,
              help="Budget for tensor data held at once (pieces, read-ahead, read buffers).")
@click.option("--strict", is_flag=True, help="Refuse tensors without a partition rule instead of copying them whole.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="ckptkit", show_default=True,
              help="Output format: a ckptkit checkpoint, or a Megatron torch_dist directory that Megatron's "
                   "dist_checkpointing.load accepts at the target layout (model weights; even pipeline split).")
@click.option("--dry-run", is_flag=True, help="Print the plan (per tensor and per target rank) and write nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of text.")
def reshard_cmd(source: str, dest: str | None, to: str, dp: int | None, vpp: int | None, pp_layers: str | None,
                num_layers: int | None, max_memory: str, strict: bool, fmt: str, dry_run: bool, as_json: bool) -> None:
    """Rewrite the checkpoint SOURCE at DEST, laid out as a job at --to would save it.

    Every tensor saved with a partition rule is split by that rule at the
    target (TP shards, fused parts, vocab padding, pipeline stages, virtual
    chunks); each target rank's pieces are stored together in its own data
    object, and the rule is recorded again, so the result can be resharded
    once more. Tensors without a rule are copied whole to one rank (listed).
    Replicated values are kept; per-rank values (RNG states, data-loader
    positions) belong to the source's ranks and are dropped (listed).

    SOURCE is only read. DEST must not hold a committed checkpoint; a failed
    reshard leaves none. Memory stays under --max-memory: fewer ranks are
    written at once, and a region too big even alone is stored in pieces.

    \b
    Examples:
      ckptkit reshard runs/exp1/step-0001000 runs/exp1-tp4pp2/step-0001000 --to tp4pp2
      ckptkit reshard runs/exp1/step-0001000 --to tp4pp2 --dry-run
      ckptkit reshard s3://bucket/run/step-1000 s3://bucket/run-pp4/step-1000 --to tp2pp4 --pp-layers 7,8,8,9
      ckptkit reshard runs/a/step-100 runs/b/step-100 --to tp2pp2 --vpp 2 --dp 4 --max-memory 4GiB
    """
    from ckptkit.offline import ReshardOptions, plan_reshard, reshard

    target = ParallelConfig.parse(to)
    changes: dict[str, object] = {}
    if dp is not None:
        changes["dp"] = dp
    if vpp is not None:
        changes["vpp"] = vpp
    if pp_layers is not None:
        changes["pp_layers"] = parse_layers(pp_layers)
    if changes:
        target = dataclasses.replace(target, **changes)  # type: ignore[arg-type]
    if fmt == "megatron":
        _to_megatron(source, dest, target, dry_run=dry_run, as_json=as_json)
        return
    options = ReshardOptions(ReshardPlanOptions(max_memory=parse_size(max_memory), strict=strict,
                                                num_layers=num_layers), format=fmt)  # type: ignore[arg-type]
    if dry_run:
        result = plan_reshard(source, target, options=options)
    else:
        if dest is None:
            raise CkptkitError("reshard needs DEST (where to write the resharded checkpoint), or --dry-run")
        with progress_bar("resharding", not as_json and sys.stdout.isatty()) as progress:
            result = reshard(source, dest, target, options=options, progress=progress)
    if as_json:
        render.print_json(result.to_json())
        return
    p = result.plan
    head = f"plan for {result.source}" if dry_run else f"resharded {result.source} -> {result.destination}"
    click.echo(f"{head} (from {result.source_parallel or 'an unrecorded layout'})")
    for line in plan_summary_lines(p, render.human_bytes):
        click.echo(f"  {line}")
    if result.dropped_per_rank:
        verb = "would drop" if dry_run else "dropped"
        click.echo(f"  {verb} per-rank values of the source's ranks (they do not carry over to a new layout): "
                   f"{', '.join(result.dropped_per_rank)}")
    if dry_run:
        click.echo("  per target rank:")
        click.echo(f"    {'rank':>6} {'pieces':>7} {'writes':>11} {'reads':>11}")
        for r in p.ranks:
            click.echo(f"    {r.rank:>6} {r.pieces:>7} {render.human_bytes(r.bytes_written):>11} "
                       f"{render.human_bytes(r.bytes_read):>11}")
        click.echo("  nothing written (--dry-run)")
    else:
        rate = p.nbytes / 2**20 / max(result.seconds, 1e-9)
        click.echo(f"  {render.human_bytes(p.nbytes)} written, {render.human_bytes(result.bytes_read)} read "
                   f"in {result.seconds:.2f}s ({rate:.0f} MiB/s)")


def _to_megatron(source: str, dest: str | None, target: ParallelConfig, *, dry_run: bool, as_json: bool) -> None:
    """``--format megatron``: the checkpoint (a ckptkit Megatron one) as a ``torch_dist`` directory for
    the target's tp/pp, through the exporter in converters/ (model weights only, see docs/megatron.md)."""
    if dry_run:
        raise CkptkitError("--dry-run plans ckptkit output; the Megatron exporter has no separate plan "
                           "(run it with --format ckptkit --dry-run to see the layout)")
    if dest is None:
        raise CkptkitError("reshard needs DEST (where to write the torch_dist directory)")
    if target.vpp != 1 or target.pp_layers is not None or target.cp != 1 or target.ep != 1:
        raise CkptkitError(f"--format megatron writes an even pipeline split without virtual chunks, context or "
                           f"expert parallelism; target {target} asks for more")
    from ckptkit_converters.megatron_export import export_torch_dist

    with progress_bar("exporting", not as_json and sys.stdout.isatty()) as progress:
        result = export_torch_dist(source, dest, tp=target.tp, pp=target.pp, progress=progress)
    if as_json:
        render.print_json(result.to_json())
        return
    click.echo(f"exported {source} -> {dest} as Megatron torch_dist for tp{target.tp}pp{target.pp} "
               "(model weights; load with megatron.core.dist_checkpointing.load)")
