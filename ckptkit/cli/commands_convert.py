"""``ckptkit convert``: a checkpoint to a zarr v3 group (through tensorstore), a DCP, DeepSpeed or Megatron checkpoint, and back.

The source's kind is detected (a zarr group has ``zarr.json``, a DCP
checkpoint ``.metadata``, a Megatron torch_dist directory ``metadata.json`` naming
torch_dist, a legacy Megatron save ``mp_rank_*`` folders, a ckptkit checkpoint
``manifest.json``); ``--format``
names the output. The library functions do the work: this module only picks
one, draws the progress bar and prints the result.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any
from contextlib import contextmanager

import click

from ckptkit.cli import render
from ckptkit.errors import CkptkitError


@contextmanager
def progress_bar(label: str, enabled: bool, *, data: bool = True) -> Iterator[Callable[[int, int], None] | None]:
    """A ``progress(done, total)`` callback drawing a bar (bytes when ``data``), or None off a terminal."""
    if not enabled:
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TaskProgressColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (DownloadColumn(binary_units=True), TransferSpeedColumn()) if data else (TaskProgressColumn(),)
    bar = Progress(label, BarColumn(), *columns, TimeRemainingColumn(), console=render.console(), transient=True)
    task = bar.add_task(label, total=None)
    with bar:
        yield lambda done, total: bar.update(task, completed=done, total=total)


@click.command("convert", short_help="Checkpoint <-> zarr v3 group, DCP, DeepSpeed ZeRO or Megatron.")
@click.argument("source")
@click.argument("dest")
@click.option("--format", "fmt", type=click.Choice(["zarr", "dcp", "hf", "deepspeed", "megatron", "ckptkit"]), default=None,
              help="Output format. Default: zarr for a checkpoint, ckptkit for a zarr export, a DCP checkpoint, "
                   "a native DeepSpeed checkpoint folder or a Megatron (torch_dist or legacy) checkpoint.")
@click.option("--chunk-mib", type=click.FloatRange(min=0.001), default=8.0, show_default=True,
              help="zarr: largest inner (read) chunk.")
@click.option("--shard-mib", type=click.FloatRange(min=0.001), default=64.0, show_default=True,
              help="zarr: target size of one shard object.")
@click.option("--portable", is_flag=True,
              help="zarr: store bfloat16/float8 as float32 so zarr-python reads every array (lossless round trip).")
@click.option("--compression", type=click.Choice(["none", "zstd"]), default="none", show_default=True,
              help="zarr: codec of each inner chunk.")
@click.option("--skip-unsafe-items", is_flag=True,
              help="DCP import: leave out non-tensor items that do not decode with torch.load(weights_only=True) "
                   "into JSON-like values (they are listed) instead of failing.")
@click.option("--threads", type=click.IntRange(1, 64), default=None,
              help="Shards (zarr export, default 4), ranks (imports, default 2) or files (DCP export, default 2) "
                   "written concurrently.")
@click.option("--hf-config", type=click.Path(exists=True, dir_okay=False), default=None,
              help="hf: the model's Hugging Face config.json (head counts for the rotary permutation).")
@click.option("--heads", type=click.IntRange(min=1), default=None, help="hf: attention heads (instead of --hf-config).")
@click.option("--kv-heads", type=click.IntRange(min=1), default=None, help="hf: key/value heads (default: --heads).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="hf: cast the weights (default: as stored).")
@click.option("--prefix", default="model/", show_default=True, help="hf: where the model's parameters sit in the state.")
@click.option("--dp", type=click.IntRange(min=1), default=None, help="deepspeed: DP size of the native export.")
@click.option("--zero-stage", type=click.IntRange(1, 3), default=None,
              help="deepspeed: ZeRO stage of the native export (default: the saving job's).")
@click.option("--vocab-size", type=click.IntRange(min=1), default=None,
              help="megatron import: the true vocabulary size (Megatron stores only the padded one).")
@click.option("--divisible-by", type=click.IntRange(min=1), default=None,
              help="megatron: make_vocab_size_divisible_by, when the checkpoint's args do not record it.")
@click.option("--to", "to_layout", default=None,
              help="megatron export: the target layout, e.g. tp2pp2 (the torch_dist directory Megatron loads there).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of text.")
def convert_cmd(source: str, dest: str, fmt: str | None, chunk_mib: float, shard_mib: float, portable: bool,
                compression: str, skip_unsafe_items: bool, threads: int | None, hf_config: str | None,
                heads: int | None, kv_heads: int | None, dtype: str | None, prefix: str, dp: int | None,
                zero_stage: int | None, vocab_size: int | None, divisible_by: int | None, to_layout: str | None,
                as_json: bool) -> None:
    """Convert SOURCE into DEST.

    A checkpoint becomes a zarr v3 group (--format zarr): every logical tensor
    (model space: global, unpadded; optimizer moments in parameter shape) is
    one array at its key path, written by tensorstore; the group's attributes
    carry the manifest, so converting the group back (--format ckptkit) gives a
    checkpoint with bit-identical tensors, values and layouts.

    A checkpoint becomes a torch.distributed.checkpoint directory (--format
    dcp) that dcp.load reads at any world size; a DCP checkpoint (e.g. a
    torchtitan step-N folder) becomes a ckptkit checkpoint, keeping its
    sharding. Its .metadata pickle is read through an allow-list unpickler and
    its data only with torch.load(weights_only=True): see docs/converters.md.

    DEST must not exist (or be empty). Both sides take s3:// URLs.

    \b
    Examples:
      ckptkit convert runs/exp1/step-0001000 step-1000.zarr --format zarr
      ckptkit convert step-1000.zarr runs/exp1-copy/step-0001000 --format ckptkit
      ckptkit convert s3://bucket/run1/step-0001200 s3://bucket/zarr/step-1200.zarr --portable
      ckptkit convert outputs/checkpoint/step-1000 runs/titan/step-0001000        # DCP -> ckptkit
      ckptkit convert runs/exp1/step-0001000 dcp/step-1000 --format dcp           # ckptkit -> DCP
      ckptkit convert runs/exp1/step-0001000 hf/ --format hf --hf-config config.json  # weights -> HF safetensors
      ckptkit convert ds_checkpoints/ runs/ds/step-0000200          # native DeepSpeed (latest tag) -> ckptkit
      ckptkit convert runs/ds/step-0000200 ds_dp8/ --format deepspeed --dp 8 --zero-stage 3
      ckptkit convert mlm/iter_0001000 runs/mlm/step-0001000 --vocab-size 50257   # Megatron torch_dist/legacy -> ckptkit
      ckptkit convert runs/mlm/step-0001000 mlm_tp4/iter_0001000 --format megatron --to tp4pp1
    """
    from ckptkit_converters.zarr_io import is_zarr_export
    from ckptkit_converters.dcp import is_dcp_checkpoint

    from_zarr = is_zarr_export(source)
    from_megatron = not from_zarr and _is_megatron(source)  # before DCP: torch_dist is a DCP directory too
    from_dcp = not (from_zarr or from_megatron) and is_dcp_checkpoint(source)
    from_ds = not (from_zarr or from_dcp or from_megatron) and _is_deepspeed(source)
    foreign = from_zarr or from_dcp or from_ds or from_megatron
    fmt = fmt or ("ckptkit" if foreign else "zarr")
    show = not as_json and sys.stdout.isatty()
    if fmt != "ckptkit" and foreign:
        kind = ("a zarr group" if from_zarr else "a DCP checkpoint" if from_dcp else
                "a Megatron checkpoint" if from_megatron else "a DeepSpeed checkpoint")
        raise CkptkitError(f"{source} is already {kind}; --format ckptkit converts it to a checkpoint "
                           f"(then convert that to --format {fmt})")
    if fmt == "megatron":
        result = _export_megatron(source, dest, to_layout, divisible_by)
    elif from_megatron:
        result = _import_megatron(source, dest, vocab_size, divisible_by, threads)
    elif fmt == "deepspeed":
        from ckptkit_converters.deepspeed import export_deepspeed

        if dp is None:
            raise CkptkitError("--format deepspeed needs --dp N (the DP size the native checkpoint is written for)")
        result = export_deepspeed(source, dest, dp=dp, stage=zero_stage)
    elif fmt == "hf":
        _export_hf(source, dest, hf_config, heads, kv_heads, dtype, prefix, show, as_json)
        return
    elif fmt == "zarr":
        from ckptkit_converters.zarr_io import ZarrExportOptions, export_zarr

        options = ZarrExportOptions(chunk_bytes=int(chunk_mib * 2**20), shard_bytes=int(shard_mib * 2**20),
                                    portable=portable, compression=compression,  # type: ignore[arg-type]
                                    threads=threads or ZarrExportOptions.threads)
        with progress_bar("exporting", show) as progress:
            result = export_zarr(source, dest, options=options, progress=progress)
    elif fmt == "dcp":
        from ckptkit_converters.dcp import DcpExportOptions, export_dcp

        with progress_bar("exporting", show) as progress:
            result = export_dcp(source, dest, options=DcpExportOptions(threads=threads or DcpExportOptions.threads),
                                progress=progress)
    elif from_zarr:
        from ckptkit_converters.zarr_io import ZarrImportOptions, import_zarr

        with progress_bar("importing", show) as progress:
            result = import_zarr(source, dest, options=ZarrImportOptions(threads=threads or ZarrImportOptions.threads),
                                 progress=progress)
    elif from_ds:
        from ckptkit_converters.deepspeed import import_deepspeed

        result = import_deepspeed(source, dest)
    elif from_dcp:
        from ckptkit_converters.dcp import DcpImportOptions, import_dcp

        options_dcp = DcpImportOptions(threads=threads or DcpImportOptions.threads, skip_unsafe_items=skip_unsafe_items)
        with progress_bar("importing", show) as progress:
            result = import_dcp(source, dest, options=options_dcp, progress=progress)
    else:
        raise CkptkitError(
            f"{source} is not a zarr group (no zarr.json) nor a DCP checkpoint (no .metadata); --format ckptkit "
            "converts one of those to a checkpoint (a checkpoint converts to --format zarr or --format dcp)"
        )
    if as_json:
        render.print_json(result.to_json())
        return
    rate = result.nbytes / 2**20 / max(result.seconds, 1e-9)
    click.echo(
        f"converted {result.source} -> {result.destination} ({result.format}): {result.tensors} tensors, "
        f"{render.human_bytes(result.nbytes)} in {result.seconds:.2f}s ({rate:.0f} MiB/s)"
    )
    skipped = getattr(result, "skipped", ())
    if skipped:
        what = ("per-rank values DCP cannot hold" if result.format == "dcp" else
                "items not converted (optimizer state, _extra_state, non-model tensors)" if hasattr(result, "meta")
                else "non-tensor items that do not decode safely")
        click.echo(f"skipped {len(skipped)} {what}: {', '.join(skipped)}")


def _is_megatron(source: str) -> bool:
    from ckptkit_converters.megatron_format import is_legacy, is_torch_dist

    return is_torch_dist(source) or is_legacy(source)


def _import_megatron(source: str, dest: str, vocab_size: int | None, divisible_by: int | None,
                     threads: int | None) -> Any:
    from ckptkit_converters.megatron import import_legacy, import_torch_dist
    from ckptkit_converters.megatron_format import is_torch_dist

    if vocab_size is None:
        raise CkptkitError(f"{source} is a Megatron checkpoint: --vocab-size N is needed (Megatron stores only the "
                           "padded vocabulary; ckptkit stores the true one)")
    fn = import_torch_dist if is_torch_dist(source) else import_legacy
    return fn(source, dest, vocab_size=vocab_size, divisible_by=divisible_by, threads=threads or 2)


def _export_megatron(source: str, dest: str, to_layout: str | None, divisible_by: int | None) -> Any:
    from ckptkit.layout.config import ParallelConfig
    from ckptkit_converters.megatron_export import export_torch_dist

    if to_layout is None:
        raise CkptkitError("--format megatron needs --to LAYOUT (e.g. --to tp2pp2): the layout Megatron will load at")
    config = ParallelConfig.parse(to_layout)
    if config.vpp not in (None, 1) or config.ep != 1 or config.cp != 1:
        raise CkptkitError(f"--to {to_layout}: the Megatron export takes tp and pp only (no vpp, ep, cp yet)")
    return export_torch_dist(source, dest, tp=config.tp, pp=config.pp, divisible_by=divisible_by)


def _is_deepspeed(source: str) -> bool:
    from ckptkit_converters.deepspeed_format import is_deepspeed_checkpoint

    return is_deepspeed_checkpoint(source)


def _export_hf(source: str, dest: str, hf_config: str | None, heads: int | None, kv_heads: int | None,
               dtype: str | None, prefix: str, show: bool, as_json: bool) -> None:
    from ckptkit_converters.hf_safetensors import AttentionHeads, HFExportOptions, export_hf

    if hf_config is not None:
        counts = AttentionHeads.from_hf_config(hf_config)
    elif heads is not None:
        counts = AttentionHeads(heads, kv_heads or heads)
    else:
        raise CkptkitError("--format hf needs the attention head counts: --hf-config config.json or --heads N")
    with progress_bar("exporting", show) as progress:
        result = export_hf(source, dest, counts, options=HFExportOptions(prefix=prefix, dtype=dtype), progress=progress)
    if as_json:
        render.print_json({"source": source, "destination": result.dest, "format": "hf", "tensors": result.tensors,
                           "bytes": result.bytes, "shards": list(result.shards)})
        return
    click.echo(f"exported {source} -> {result.dest} (hf safetensors): {result.tensors} tensors, "
               f"{render.human_bytes(result.bytes)} in {len(result.shards)} file(s)")
