"""``ckptkit convert``: a checkpoint to and from zarr, DCP, DeepSpeed, Megatron, and to HF safetensors.

One library call: :func:`ckptkit_converters.registry.convert`, which detects the source's format
(Megatron torch_dist or legacy, DeepSpeed, DCP, a zarr group, or a registered plugin; else a
ckptkit checkpoint) and looks the direction up in its table. This module parses the flags into
:class:`~ckptkit_converters.registry.ConvertOptions` and prints the one result type.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ckptkit.cli.options import (
    LAYOUT,
    import_options,
    json_option,
    megatron_facts_options,
    storage_option,
    threads_option,
)
from ckptkit.cli.output import Output, human_bytes

if TYPE_CHECKING:
    from ckptkit.engine.offline_writer import ConvertResult
    from ckptkit.layout.config import ParallelConfig

FORMATS = ["zarr", "dcp", "hf", "deepspeed", "megatron", "ckptkit"]  # ckptkit_converters.registry.targets()


@click.command("convert", short_help="Checkpoint <-> zarr, DCP, DeepSpeed ZeRO or Megatron; -> HF safetensors.")
@click.argument("source")
@click.argument("dest")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="Output format. Default: ckptkit for a source of another format (a zarr export, a DCP, "
                   "native DeepSpeed or Megatron torch_dist/legacy checkpoint), zarr for a ckptkit checkpoint.")
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
@threads_option(None, "Shards (zarr export, default 4), ranks (imports, default 2) or files (DCP export, default 2) "
                      "written concurrently.")
@click.option("--from", "from_fmt", type=click.Choice(["hf"]), default=None,
              help="Read SOURCE as this format instead of detecting it: hf imports a Hugging Face safetensors "
                   "folder into a ckptkit checkpoint (routed experts stacked again; needs --hf-config).")
@click.option("--hf-config", type=click.Path(exists=True, dir_okay=False), default=None,
              help="hf: the model's Hugging Face config.json (model_type picks the key table: llama, qwen3, "
                   "qwen3_moe, deepseek_v3, mixtral; head counts, vocab_size, expert counts from it).")
@click.option("--hf-family", default=None, metavar="NAME",
              help="hf: a key table by name instead of the config's model_type (llama3, qwen3, qwen3_moe, "
                   "deepseek_v3, mixtral, megatron_llama, megatron_qwen3, megatron_qwen3_moe, megatron_qwen2_moe, "
                   "megatron_mixtral).")
@click.option("--heads", type=click.IntRange(min=1), default=None, help="hf: attention heads (instead of --hf-config).")
@click.option("--kv-heads", type=click.IntRange(min=1), default=None, help="hf: key/value heads (default: --heads).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="hf: cast the weights (default: as stored).")
@click.option("--prefix", default=None,
              help="hf: where the model's parameters sit in the state ('model/', or '' for the top level); "
                   "default: detected.")
@click.option("--dp", type=click.IntRange(min=1), default=None, help="deepspeed: DP size of the native export.")
@click.option("--zero-stage", type=click.IntRange(1, 3), default=None,
              help="deepspeed: ZeRO stage of the native export (default: the saving job's).")
@click.option("--ep", type=click.IntRange(min=1), default=None,
              help="deepspeed: expert-parallel size of the native export of an MoE model (default: the saving job's).")
@click.option("--tag", default=None, help="deepspeed import: the checkpoint tag (default: the one 'latest' names).")
@megatron_facts_options
@click.option("--to", "to_layout", type=LAYOUT, default=None, metavar="LAYOUT",
              help="megatron export: the target layout, e.g. tp2pp2 (the torch_dist directory Megatron loads there).")
@json_option
@storage_option
def convert_cmd(source: str, dest: str, fmt: str | None, chunk_mib: float, shard_mib: float, portable: bool,
                compression: str, skip_unsafe_items: bool, threads: int | None, from_fmt: str | None,
                hf_config: str | None, hf_family: str | None,
                heads: int | None, kv_heads: int | None, dtype: str | None, prefix: str | None, dp: int | None,
                zero_stage: int | None, ep: int | None, tag: str | None, vocab_size: int | None, divisible_by: int | None,
                to_layout: ParallelConfig | None, as_json: bool, storage_options: dict[str, Any] | None) -> None:
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

    A Megatron checkpoint's own args (common.pt / model_optim_rng.pt) give its
    vocabulary padding and layer count; --vocab-size and --divisible-by are
    needed only when they do not record them (the error names what is missing).
    A source of another format converts to any other format through a
    temporary ckptkit import (Megatron to --format megatron: another tp/pp).

    DEST must not exist (or be empty). zarr, DCP, HF and ckptkit take s3:// URLs.

    \b
    Examples:
      ckptkit convert runs/exp1/step-0001000 step-1000.zarr --format zarr
      ckptkit convert step-1000.zarr runs/exp1-copy/step-0001000 --format ckptkit
      ckptkit convert s3://bucket/run1/step-0001200 s3://bucket/zarr/step-1200.zarr --portable
      ckptkit convert outputs/checkpoint/step-1000 runs/titan/step-0001000        # DCP -> ckptkit
      ckptkit convert runs/exp1/step-0001000 dcp/step-1000 --format dcp           # ckptkit -> DCP
      ckptkit convert runs/exp1/step-0001000 hf/ --format hf --hf-config config.json  # weights -> HF safetensors
      ckptkit convert mlm/iter_0001000 hf/ --format hf --hf-config config.json    # Megatron GPT -> HF
      ckptkit convert hf/ runs/from-hf/step-0000000 --from hf --hf-config config.json  # HF -> ckptkit
      ckptkit convert ds_checkpoints/ runs/ds/step-0000200          # native DeepSpeed (latest tag) -> ckptkit
      ckptkit convert runs/ds/step-0000200 ds_dp8/ --format deepspeed --dp 8 --zero-stage 3
      ckptkit convert runs/ds-moe/step-0000200 ds_ep4/ --format deepspeed --dp 8 --ep 4   # MoE: 4 expert ranks
      ckptkit convert mlm/iter_0001000 runs/mlm/step-0001000        # Megatron torch_dist/legacy -> ckptkit
      ckptkit convert runs/mlm/step-0001000 mlm_tp4/iter_0001000 --format megatron --to tp4pp1
    """
    from ckptkit_converters.registry import ConvertOptions, convert, hf_config_of

    out = Output(as_json)
    if hf_family is not None:
        from ckptkit_converters.hf.families import FAMILIES

        if hf_family not in FAMILIES:
            raise click.BadParameter(f"unknown table {hf_family!r} (known: {', '.join(FAMILIES)})",
                                     param_hint="--hf-family")
    imports = import_options(vocab_size, divisible_by, skip_unsafe_items=skip_unsafe_items, tag=tag)
    with out.progress("converting") as progress:
        options = ConvertOptions(
            threads=threads, progress=progress, storage_options=storage_options, imports=imports,
            chunk_bytes=int(chunk_mib * 2**20), shard_bytes=int(shard_mib * 2**20), portable=portable,
            compression=compression, hf_config=hf_config, heads=heads, kv_heads=kv_heads, prefix=prefix, dtype=dtype,
            hf_family=hf_family, dp=dp, zero_stage=zero_stage, ep=ep, layout=to_layout)
        if from_fmt == "hf":
            result = _from_hf(source, dest, fmt, options, hf_config_of(options))
        else:
            result = convert(source, dest, to_format=fmt, options=options)
    if as_json:
        out.json(result.to_json())
    else:
        render(out, result)


def _from_hf(source: str, dest: str, fmt: str | None, options: Any, cfg: Any) -> ConvertResult:
    """``--from hf``: an HF safetensors folder into a ckptkit checkpoint (the only target: convert that on)."""
    from ckptkit.errors import CkptkitError
    from ckptkit_converters.hf.importer import import_hf

    if fmt not in (None, "ckptkit"):
        raise CkptkitError(f"--from hf writes a ckptkit checkpoint; convert that to --format {fmt} next")
    if options.hf_config is None:
        raise CkptkitError("--from hf needs the model's config.json (--hf-config): its model_type picks the key table")
    return import_hf(source, dest, cfg, family=options.hf_family, prefix=options.prefix or "model/",
                     storage_options=options.storage_options, progress=options.progress)


def render(out: Output, result: ConvertResult) -> None:
    rate = result.nbytes / 2**20 / max(result.seconds, 1e-9)
    out.text(f"converted {result.source} -> {result.destination} ({result.format}): {result.tensors} tensors, "
             f"{human_bytes(result.nbytes)} in {result.seconds:.2f}s ({rate:.0f} MiB/s)")
    skipped = getattr(result, "skipped", ())
    if skipped:
        what = ("per-rank values DCP cannot hold" if result.format == "dcp" else
                "items not converted (optimizer state, _extra_state, non-model tensors)" if hasattr(result, "meta")
                else "non-tensor items that do not decode safely")
        out.text(f"skipped {len(skipped)} {what}: {', '.join(skipped)}")
