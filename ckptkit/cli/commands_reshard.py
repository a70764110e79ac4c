"""``ckptkit reshard``: rewrite a checkpoint laid out for another parallel config, offline.

Parses the target (``--to tp4pp2`` plus ``--dp``, ``--vpp``, ``--pp-layers``) and the memory
budget, and calls one library function: :func:`ckptkit.offline.reshard` (or
:func:`~ckptkit.offline.plan_reshard` for ``--dry-run``) for ``--format ckptkit``;
:func:`ckptkit_converters.registry.convert` to ``megatron`` for ``--format megatron`` (a
``torch_dist`` directory for the target tp/pp). A source of another format (Megatron torch_dist
or legacy, DCP, DeepSpeed, a zarr export) is imported first by the library, to a temporary folder.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import click

from ckptkit.cli.options import (
    LAYER_COUNTS,
    LAYOUT,
    SIZE,
    json_option,
    megatron_facts_options,
    storage_option,
)
from ckptkit.cli.output import Output, human_bytes
from ckptkit import CkptkitError

if TYPE_CHECKING:
    from ckptkit import ParallelConfig
    from ckptkit.offline import ReshardResult

FORMATS = ["ckptkit", "megatron"]  # megatron: a torch_dist directory, written by converters/megatron/exporter.py


@click.command("reshard", short_help="Rewrite a checkpoint for another layout (tp/pp/dp/vpp), offline.")
@click.argument("source")
@click.argument("dest", required=False)
@click.option("--to", "to", type=LAYOUT, required=True, metavar="LAYOUT",
              help="Target parallel config, e.g. tp4pp2, tp2pp2dp4, tp1pp4vpp2, tp2pp2ep4etp1 (MoE: ep, etp).")
@click.option("--dp", type=click.IntRange(min=1), default=None, help="Target data-parallel size (default: from --to, else 1).")
@click.option("--vpp", type=click.IntRange(min=1), default=None, help="Target virtual pipeline chunks per stage.")
@click.option("--etp", type=click.IntRange(min=1), default=None,
              help="Target expert tensor-parallel size (MoE; default: from --to, else tp, as Megatron's default).")
@click.option("--pp-layers", type=LAYER_COUNTS, default=None,
              help="Layers per pipeline chunk in forward order (pp*vpp counts), for uneven stages, e.g. 15,17.")
@click.option("--num-layers", type=click.IntRange(min=1), default=None,
              help="The model's layer count, for per-layer rules when no stacked layer tensor tells it.")
@click.option("--max-memory", type=SIZE, default="1GiB", show_default=True,
              help="Budget for tensor data held at once (pieces, read-ahead, read buffers).")
@click.option("--strict", is_flag=True, help="Refuse tensors without a partition rule instead of copying them whole.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="ckptkit", show_default=True,
              help="Output format: a ckptkit checkpoint, or a Megatron torch_dist directory that Megatron's "
                   "dist_checkpointing.load accepts at the target layout (model weights and the distributed "
                   "optimizer's state; any pipeline split).")
@megatron_facts_options
@click.option("--dry-run", is_flag=True, help="Print the plan (per tensor and per target rank) and write nothing.")
@json_option
@storage_option
def reshard_cmd(source: str, dest: str | None, to: ParallelConfig, dp: int | None, vpp: int | None, etp: int | None,
                pp_layers: tuple[int, ...] | None, num_layers: int | None, max_memory: int, strict: bool, fmt: str,
                vocab_size: int | None, divisible_by: int | None, dry_run: bool, as_json: bool,
                storage_options: dict[str, Any] | None) -> None:
    """Rewrite the checkpoint SOURCE at DEST, laid out as a job at --to would save it.

    Every tensor saved with a partition rule is split by that rule at the
    target (TP shards, fused parts, vocab padding, pipeline stages, virtual
    chunks); each target rank's pieces are stored together in its own data
    object, and the rule is recorded again, so the result can be resharded
    once more. Tensors without a rule are copied whole to one rank (listed).
    Replicated values are kept; per-rank values (RNG states, data-loader
    positions) belong to the source's ranks and are dropped (listed).

    SOURCE is only read; it may be a checkpoint of another format (Megatron
    torch_dist or legacy, DCP, DeepSpeed, a zarr export): it is imported to a
    temporary folder first (a Megatron one's own args give its vocabulary
    padding; --vocab-size / --divisible-by only when they do not). DEST must
    not hold a committed checkpoint; a failed reshard leaves none. Memory
    stays under --max-memory: fewer ranks are written at once, and a region
    too big even alone is stored in pieces.

    Launched by torchrun (python -m ckptkit under torchrun), the work is
    spread over every process, on every node: each writes the target ranks
    of its share, the first commits once and alone prints (one progress
    bar). The result is the same, byte for byte, as one process's.
    --max-memory is then per process.

    \b
    Examples:
      ckptkit reshard runs/exp1/step-0001000 runs/exp1-tp4pp2/step-0001000 --to tp4pp2
      ckptkit reshard runs/exp1/step-0001000 --to tp4pp2 --dry-run
      ckptkit reshard s3://bucket/run/step-1000 s3://bucket/run-pp4/step-1000 --to tp2pp4 --pp-layers 7,8,8,9
      ckptkit reshard runs/a/step-100 runs/b/step-100 --to tp2pp2 --vpp 2 --dp 4 --max-memory 4GiB
      ckptkit reshard runs/moe/step-100 runs/moe-ep4/step-100 --to tp2pp2ep4 --etp 1 --dry-run
      ckptkit reshard mlm/iter_0001000 mlm_tp4/iter_0001000 --to tp4pp1 --format megatron  # Megatron -> Megatron
      torchrun --nnodes 4 --nproc_per_node 8 -m ckptkit reshard /lustre/a/step-100 /lustre/b/step-100 --to tp8pp4
    """
    changes: dict[str, object] = {}
    if dp is not None:
        changes["dp"] = dp
    if vpp is not None:
        changes["vpp"] = vpp
    if etp is not None:
        changes["etp"] = etp
    if pp_layers is not None:
        changes["pp_layers"] = pp_layers
    target = dataclasses.replace(to, **changes) if changes else to  # type: ignore[arg-type]
    facts = {k: v for k, v in (("vocab_size", vocab_size), ("make_vocab_size_divisible_by", divisible_by))
             if v is not None}
    from ckptkit.offline import launched_by_torchrun

    spread = launched_by_torchrun()
    out = Output(as_json, quiet=spread and os.environ.get("RANK") != "0")
    if fmt == "megatron":
        _to_megatron(out, source, dest, target, facts, dry_run=dry_run, storage_options=storage_options,
                     max_memory=max_memory)
        return
    from ckptkit.offline import ReshardOptions, ReshardPlanOptions, plan_reshard, reshard, torchrun_group

    options = ReshardOptions(ReshardPlanOptions(max_memory=max_memory, strict=strict, num_layers=num_layers),
                             format="ckptkit", source_options=_source_options(source, facts, storage_options))
    if dry_run:
        result = plan_reshard(source, target, options=options, storage_options=storage_options)
    else:
        if dest is None:
            raise CkptkitError("reshard needs DEST (where to write the resharded checkpoint), or --dry-run")
        with torchrun_group() as group, out.progress("resharding") as progress:
            result = reshard(source, dest, target, options=options, storage_options=storage_options,
                             progress=progress, process_group=group)
    if as_json:
        out.json(result.to_json())
    else:
        render(out, result, dry_run)


def render(out: Output, result: ReshardResult, dry_run: bool) -> None:
    from ckptkit.offline import plan_summary_lines

    p = result.plan
    head = f"plan for {result.source}" if dry_run else f"resharded {result.source} -> {result.destination}"
    out.text(f"{head} (from {result.source_parallel or 'an unrecorded layout'})")
    for line in plan_summary_lines(p, human_bytes):
        out.text(f"  {line}")
    if result.dropped_per_rank:
        verb = "would drop" if dry_run else "dropped"
        out.text(f"  {verb} per-rank values of the source's ranks (they do not carry over to a new layout): "
                 f"{', '.join(result.dropped_per_rank)}")
    if dry_run:
        experts = p.experts_by_rank()
        out.text("  per target rank:")
        out.text(f"    {'rank':>6} {'pieces':>7} {'writes':>11} {'reads':>11}" + ("  experts" if experts else ""))
        for r in p.ranks:
            held = f"  {_spans(experts.get(r.rank, ()))}" if experts else ""
            out.text(f"    {r.rank:>6} {r.pieces:>7} {human_bytes(r.bytes_written):>11} {human_bytes(r.bytes_read):>11}"
                     + held)
        out.text("  nothing written (--dry-run)")
    else:
        rate = p.nbytes / 2**20 / max(result.seconds, 1e-9)
        out.text(f"  {human_bytes(p.nbytes)} written, {human_bytes(result.bytes_read)} read "
                 f"in {result.seconds:.2f}s ({rate:.0f} MiB/s)")


def _spans(indices: tuple[int, ...]) -> str:
    """``0-3,6`` for experts 0, 1, 2, 3 and 6."""
    if not indices:
        return "-"
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _source_options(source: str, facts: dict[str, Any], storage_options: dict[str, Any] | None) -> Any:
    """The detected source format's import options with the Megatron facts given (None: none given).
    A fact the source's format does not take is refused, naming the flag."""
    if not facts:
        return None
    from ckptkit.offline import option_types, options_from
    from ckptkit_converters.registry import detect

    fmt = detect(source, storage_options)
    fields = option_types(fmt.import_options) if fmt is not None and fmt.import_options is not None else {}
    for name in facts:
        if name not in fields:
            flag = "--vocab-size" if name == "vocab_size" else "--divisible-by"
            what = "a ckptkit checkpoint" if fmt is None else fmt.description
            raise click.UsageError(f"{flag} is a fact of a Megatron import; {source} is {what}")
    assert fmt is not None and fmt.import_options is not None
    return options_from(fmt.import_options, facts, where=f"importing {fmt.description}")


def _to_megatron(out: Output, source: str, dest: str | None, target: ParallelConfig, facts: dict[str, Any], *,
                 dry_run: bool, storage_options: dict[str, Any] | None, max_memory: int) -> None:
    """``--format megatron``: SOURCE (a ckptkit Megatron checkpoint, or a Megatron one of another
    layout) as a ``torch_dist`` directory for the target's tp/pp (model weights, docs/megatron.md)."""
    from ckptkit.offline import RunOptions, options_from, torchrun_group
    from ckptkit_converters.registry import convert, detect, format_named

    megatron = format_named("megatron")
    assert megatron.export_options is not None
    export = options_from(megatron.export_options, {"layout": target, "max_memory": max_memory, **facts},
                          where="the megatron export")
    megatron.check_export(export)
    if dry_run:
        raise CkptkitError("--dry-run plans ckptkit output; the Megatron exporter has no separate plan "
                           "(run it with --format ckptkit --dry-run to see the layout)")
    if dest is None:
        raise CkptkitError("reshard needs DEST (where to write the torch_dist directory)")
    with torchrun_group() as group, out.progress("exporting") as progress:  # spread under torchrun
        fmt = detect(source, storage_options)
        result = convert(source, dest, to_format="megatron", target_options=export,
                         source_options=_source_options(source, facts, storage_options) if fmt else None,
                         run=RunOptions(progress=progress, storage_options=storage_options, process_group=group))
    if out.as_json:
        out.json(result.to_json())
        return
    out.text(f"exported {source} -> {dest} as Megatron torch_dist for tp{target.tp}pp{target.pp} "
             "(model weights; load with megatron.core.dist_checkpointing.load)")
