"""``ckptkit convert``: a checkpoint to and from every registered format.

One library call, :func:`ckptkit_converters.registry.convert`, which detects the source's format
(or takes ``--from``) and runs the direction. Each format takes its own options dataclass; this
module turns the flags into those: a flag names one field (``--dp`` is ``dp``, ``--hf-config``
is ``config``), ``--opt KEY=VALUE`` names any field of any format (so a new format's options work
without a new flag), and a flag that neither side of the conversion takes is refused, naming it.
The help lists the flags per format, then every format's fields for ``--opt``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import click

from ckptkit.cli.grouped import GroupedCommand, grouped
from ckptkit.cli.options import KEY_VALUE, LAYOUT, SIZE, FiniteRange, json_option, storage_option, threads_option
from ckptkit.cli.output import Output, human_bytes

if TYPE_CHECKING:
    from ckptkit.offline import ConvertResult, Format

MIB = 2**20

# flag (click parameter name) -> (the flag as typed, the options field it fills, value -> field value)
FIELDS: dict[str, tuple[str, str, Any]] = {
    "chunk_mib": ("--chunk-mib", "chunk_bytes", lambda v: int(v * MIB)),
    "shard_mib": ("--shard-mib", "shard_bytes", lambda v: int(v * MIB)),
    "portable": ("--portable", "portable", None),
    "compression": ("--compression", "compression", None),
    "skip_unsafe_items": ("--skip-unsafe-items", "skip_unsafe_items", None),
    "hf_config": ("--hf-config", "config", None),
    "hf_family": ("--hf-family", "family", None),
    "heads": ("--heads", "heads", None),
    "kv_heads": ("--kv-heads", "kv_heads", None),
    "dtype": ("--dtype", "dtype", None),
    "prefix": ("--prefix", "prefix", None),
    "dp": ("--dp", "dp", None),
    "zero_stage": ("--zero-stage", "zero_stage", None),
    "ep": ("--ep", "ep", None),
    "tag": ("--tag", "tag", None),
    "vocab_size": ("--vocab-size", "vocab_size", None),
    "divisible_by": ("--divisible-by", "make_vocab_size_divisible_by", None),
    "to_layout": ("--to", "layout", None),
    "max_memory": ("--max-memory", "max_memory", None),
}


class FormatName(click.ParamType):
    """A registered format's name, checked against the registry when the command runs (so a new
    format's package is a valid ``--format``/``--from`` without editing this file, and
    ``ckptkit --help`` still imports no converter)."""

    name = "format"

    def __init__(self, direction: str) -> None:
        self.direction = direction

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from ckptkit_converters.registry import formats, targets

        names = list(targets()) if self.direction == "export" else [
            f.name for f in formats() if f.import_options is not None]
        if value not in names:
            self.fail(f"{value!r} is not one of {', '.join(names)}", param, ctx)
        return str(value)


def _opt_help(formatter: click.HelpFormatter) -> None:
    """Every registered format's option fields, as ``--opt`` takes them (listed when help is asked)."""
    import dataclasses

    from ckptkit_converters.registry import formats

    rows = []
    for fmt in formats():
        for direction, cls in (("import", fmt.import_options), ("export", fmt.export_options)):
            if cls is not None:
                rows.append((f"{fmt.name} {direction}", ", ".join(f.name for f in dataclasses.fields(cls))))
    with formatter.section("Fields for --opt KEY=VALUE, per format"):
        formatter.write_dl(rows)


@click.command("convert", cls=GroupedCommand, extra_help=_opt_help,
               short_help="Checkpoint <-> zarr, DCP, DeepSpeed ZeRO, Megatron or HF safetensors.")
@click.argument("source")
@click.argument("dest")
@click.option("--format", "fmt", type=FormatName("export"), default=None,
              help="Output format (zarr, dcp, hf, deepspeed, megatron, ckptkit, or a plugin's). Default: ckptkit for a source of another format (detected), zarr for a "
                   "ckptkit checkpoint.")
@click.option("--from", "from_fmt", type=FormatName("import"), default=None,
              help="Read SOURCE as this format instead of detecting it (megatron, deepspeed, dcp, zarr, hf, or a "
                   "plugin's).")
@click.option("--opt", "opts", type=KEY_VALUE, multiple=True, metavar="KEY=VALUE",
              help="Any option field of the source's import or the target's export (listed below), by name; "
                   "repeatable.")
@threads_option(None, "Shards (zarr export, default 4), ranks (imports, default 2) or files (DCP export, default 2) "
                      "written concurrently.")
@json_option
@storage_option
@grouped("zarr export", "--chunk-mib", type=FiniteRange(min=0.001), default=8.0, show_default=True,
         help="Largest inner (read) chunk.")
@grouped("zarr export", "--shard-mib", type=FiniteRange(min=0.001), default=64.0, show_default=True,
         help="Target size of one shard object.")
@grouped("zarr export", "--portable", is_flag=True,
         help="Store bfloat16/float8 as float32 so zarr-python reads every array (lossless round trip).")
@grouped("zarr export", "--compression", type=click.Choice(["none", "zstd"]), default="none", show_default=True,
         help="Codec of each inner chunk.")
@grouped("DCP import", "--skip-unsafe-items", is_flag=True,
         help="Leave out non-tensor items that do not decode with torch.load(weights_only=True) into JSON-like "
              "values (they are listed) instead of failing.")
@grouped("Hugging Face", "--hf-config", type=click.Path(exists=True, dir_okay=False), default=None,
         help="The model's config.json (model_type picks the key table: llama, qwen3, qwen3_moe, deepseek_v3, "
              "mixtral; head counts, vocab_size, expert counts from it). Import default: SOURCE/config.json.")
@grouped("Hugging Face", "--hf-family", default=None, metavar="NAME",
         help="A key table by name instead of the config's model_type (llama, qwen3, qwen3_moe, deepseek_v3, "
              "mixtral, megatron_llama, megatron_qwen3, megatron_qwen3_moe, megatron_qwen2_moe, megatron_mixtral).")
@grouped("Hugging Face", "--heads", type=click.IntRange(min=1), default=None,
         help="Export: attention heads (instead of --hf-config).")
@grouped("Hugging Face", "--kv-heads", type=click.IntRange(min=1), default=None,
         help="Export: key/value heads (default: --heads).")
@grouped("Hugging Face", "--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
         help="Export: cast the weights (default: as stored).")
@grouped("Hugging Face", "--max-memory", type=SIZE, default=None, metavar="SIZE",
         help="Export: bytes of tensor data held at once (e.g. 1GiB); each tensor is then written in slabs of rows, "
              "the same bytes. Default: whole tensors.")
@grouped("Hugging Face", "--prefix", default=None,
         help="Where the model's parameters sit in the state ('model/', or '' for the top level); export "
              "default: detected; import default: model/.")
@grouped("DeepSpeed", "--dp", type=click.IntRange(min=1), default=None, help="Export: DP size of the native checkpoint.")
@grouped("DeepSpeed", "--zero-stage", type=click.IntRange(1, 3), default=None,
         help="Export: ZeRO stage (default: the saving job's).")
@grouped("DeepSpeed", "--ep", type=click.IntRange(min=1), default=None,
         help="Export: expert-parallel size of an MoE model (default: the saving job's).")
@grouped("DeepSpeed", "--tag", default=None,
         help="The checkpoint tag (import default: the one 'latest' names; export default: global_stepN).")
@grouped("Megatron", "--vocab-size", type=click.IntRange(min=1), default=None,
         help="Import: the true vocabulary size, when the checkpoint's args do not record it.")
@grouped("Megatron", "--divisible-by", type=click.IntRange(min=1), default=None,
         help="make_vocab_size_divisible_by: import, when the args do not record it; export, re-pad to it.")
@grouped("Megatron", "--to", "to_layout", type=LAYOUT, default=None, metavar="LAYOUT",
         help="Export: the target layout, e.g. tp2pp2 (the torch_dist directory Megatron loads there).")
@click.pass_context
def convert_cmd(ctx: click.Context, source: str, dest: str, fmt: str | None, from_fmt: str | None,
                opts: tuple[tuple[str, Any], ...], threads: int | None, as_json: bool,
                storage_options: dict[str, Any] | None, **flags: Any) -> None:
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

    DEST must not exist (or be empty), nor overlap SOURCE; an HF export may go next to a model's
    config and tokenizer files, never next to weights (*.safetensors). zarr, DCP, HF and ckptkit
    take s3:// URLs.

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
      ckptkit convert runs/ds/step-0000200 ds_dp4/ --format deepspeed --opt dp=4 --opt tag=resumed
    """
    from ckptkit.offline import RunOptions, launched_by_torchrun, torchrun_group
    from ckptkit_converters.registry import convert, detect, format_named

    spread = launched_by_torchrun()  # formats that cannot spread refuse it (every process would write DEST)
    out = Output(as_json, quiet=spread and os.environ.get("RANK") != "0")
    source_fmt = format_named(from_fmt) if from_fmt else detect(source, storage_options)
    target = fmt or ("ckptkit" if source_fmt is not None else "zarr")
    target_fmt = None if target == "ckptkit" else format_named(target)
    sides = _Sides(source_fmt, target_fmt, target)
    for flag, value in flags.items():
        if ctx.get_parameter_source(flag) is click.core.ParameterSource.COMMANDLINE:
            spelled, field, scale = FIELDS[flag]
            sides.give(field, scale(value) if scale else value, spelled)
    for key, value in opts:
        sides.give_text(key, value if isinstance(value, str) else _as_text(value))
    with torchrun_group() as group, out.progress("converting") as progress:
        result = convert(source, dest, to_format=target, from_format=from_fmt, source_options=sides.source(),
                         target_options=sides.target(), run=RunOptions(threads, progress, storage_options, group))
    if as_json:
        out.json(result.to_json())
    else:
        render(out, result)


def _as_text(value: Any) -> str:
    """``--opt`` values arrive JSON-parsed (KEY_VALUE); options parse text by their field's type."""
    return "true" if value is True else "false" if value is False else "none" if value is None else str(value)


class _Sides:
    """The options of both sides of one conversion, filled flag by flag.

    A field goes to every side whose dataclass has it (Megatron to Megatron: the padding multiple
    is both the import's and the export's); a flag no side takes is a usage error naming it.
    """

    def __init__(self, source: Format | None, target: Format | None, target_name: str) -> None:
        self._what = f"{'a ckptkit checkpoint' if source is None else source.description} -> {target_name}"
        self._classes = {"source": source.import_options if source is not None else None,
                         "target": target.export_options if target is not None else None}
        self._names = {"source": f"the {source.name} import" if source is not None else "",
                       "target": f"the {target_name} export"}
        self._given: dict[str, dict[str, Any]] = {"source": {}, "target": {}}

    def _fields(self, side: str) -> dict[str, Any]:
        from ckptkit.offline import option_types

        cls = self._classes[side]
        return option_types(cls) if cls is not None else {}

    def give(self, field: str, value: Any, flag: str) -> None:
        taken = [side for side in ("source", "target") if field in self._fields(side)]
        if not taken:
            raise click.UsageError(f"{flag} does not apply to this conversion ({self._what})")
        for side in taken:
            self._given[side][field] = value

    def give_text(self, key: str, text: str) -> None:
        from ckptkit.offline import parse_options

        taken = [side for side in ("source", "target") if key in self._fields(side)]
        if not taken:
            known = sorted({*self._fields("source"), *self._fields("target")})
            raise click.UsageError(f"--opt {key}=...: no option {key!r} in this conversion ({self._what}; its "
                                   f"options: {', '.join(known) or 'none'})")
        for side in taken:
            cls = self._classes[side]
            self._given[side].update(parse_options(cls, {key: text}, what=self._names[side]))

    def _build(self, side: str) -> Any:
        from ckptkit.offline import options_from

        cls = self._classes[side]
        return None if cls is None else options_from(cls, self._given[side], where=self._names[side])

    def source(self) -> Any:
        return self._build("source")

    def target(self) -> Any:
        return self._build("target")


def render(out: Output, result: ConvertResult) -> None:
    rate = result.nbytes / 2**20 / max(result.seconds, 1e-9)
    out.text(f"converted {result.source} -> {result.destination} ({result.format}): {result.tensors} tensors, "
             f"{human_bytes(result.nbytes)} in {result.seconds:.2f}s ({rate:.0f} MiB/s)")
    skipped = getattr(result, "skipped", ())
    if skipped:
        what = ("per-rank values DCP cannot hold" if result.format == "dcp" else
                "items not converted (e.g. an optimizer form not read, _extra_state, non-model tensors)"
                if hasattr(result, "meta")
                else "non-tensor items that do not decode safely")
        out.text(f"skipped {len(skipped)} {what}: {', '.join(skipped)}")
