"""Every conversion ckptkit ships, as one table: detect a source's format, convert in any direction.

* :func:`detect` — the format of a checkpoint (a :class:`~ckptkit.offline.formats.SourceFormat`:
  Megatron torch_dist or legacy, DeepSpeed, DCP, a zarr export, or a plugin's), None for ckptkit's
  own (or anything unknown);
* :func:`convert` — ``source`` to ``dest`` in ``to_format``, returning one result type,
  :class:`~ckptkit.engine.offline_writer.ConvertResult` (a format may add fields: ``skipped``,
  ``meta``, ``shards``; ``to_json()`` carries them):

  ====================  ===============================================================
  source                ``to_format``
  ====================  ===============================================================
  a detected format     ``"ckptkit"``: its :class:`SourceFormat` ``import_to``
  a ckptkit checkpoint  ``"zarr"``, ``"dcp"``, ``"hf"``, ``"deepspeed"``, ``"megatron"``:
                        the exporter in :data:`EXPORTERS`
  a detected format     any exporter: imported to a temporary local checkpoint first
                        (``megatron`` -> ``megatron`` at another tp/pp is a relayout; any
                        other format to itself is refused)
  ====================  ===============================================================

The importers are registered as :class:`SourceFormat` objects (:data:`MEGATRON`,
:data:`DEEPSPEED`, :data:`DCP`, :data:`ZARR`) under the ``ckptkit.formats`` entry-point group
(``pyproject.toml``), so ``ckptkit.reshard(MEGATRON_ITER_DIR, OUT, target)`` imports a foreign
source by itself (:mod:`ckptkit.offline.formats`). Detection order is their ``priority``:
Megatron first (a torch_dist directory is a DCP checkpoint too), then DeepSpeed, DCP, zarr.

This module imports no torch: entry points load it whenever formats are listed; each format's
work is imported when it runs.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError, LayoutError
from ckptkit.layout.config import ParallelConfig
from ckptkit.offline.formats import ImportOptions, SourceFormat, description_of, priority_of, source_formats

if TYPE_CHECKING:
    from ckptkit.engine.offline_writer import ConvertResult

CKPTKIT = "ckptkit"
Progress = Callable[[int, int], None]


# ---------------------------------------------------------------- options


@dataclass(frozen=True)
class ConvertOptions:
    """How :func:`convert` runs; each direction reads the fields it needs (None: its default).

    * every direction: ``threads`` (ranks, shards or files written at once), ``progress``
      (``progress(done, total)`` over bytes), ``storage_options`` (both sides' byte stores);
    * imports: ``imports`` (:class:`~ckptkit.offline.formats.ImportOptions`: Megatron's
      ``vocab_size`` / ``make_vocab_size_divisible_by`` where its args do not record them,
      ``extra={"skip_unsafe_items": True}`` for DCP, ``{"tag": ...}`` for DeepSpeed);
    * ``zarr``: ``chunk_bytes``, ``shard_bytes``, ``portable``, ``compression``;
    * ``hf``: ``hf_config`` (a Hugging Face ``config.json``: its ``model_type`` picks the key table, and
      head counts, vocabulary, layer and expert counts come from it) or just ``heads`` / ``kv_heads``
      (Llama); ``prefix`` (None: detected, ``model/`` or the top level), ``dtype``, ``hf_family``
      (a table by name, overriding ``model_type``);
    * ``deepspeed``: ``dp`` (required), ``zero_stage``, ``ep`` (MoE models: the expert-parallel size;
      None keeps the saving job's);
    * ``megatron``: ``layout`` (required: the target tp/pp; an even pipeline split, no vpp, cp or
      ep), and ``imports.make_vocab_size_divisible_by`` to re-pad the vocabulary differently.
    """

    threads: int | None = None
    progress: Progress | None = None
    storage_options: dict[str, Any] | None = None
    imports: ImportOptions = field(default_factory=ImportOptions)
    chunk_bytes: int | None = None
    shard_bytes: int | None = None
    portable: bool = False
    compression: str = "none"
    hf_config: str | None = None
    heads: int | None = None
    kv_heads: int | None = None
    prefix: str | None = None
    dtype: str | None = None
    hf_family: str | None = None
    dp: int | None = None
    zero_stage: int | None = None
    ep: int | None = None
    layout: ParallelConfig | None = None

    def import_options(self) -> ImportOptions:
        """``imports`` with this conversion's ``threads`` and ``progress`` where it has none."""
        changes: dict[str, Any] = {}
        if self.imports.threads is None and self.threads is not None:
            changes["threads"] = self.threads
        if self.imports.progress is None and self.progress is not None:
            changes["progress"] = self.progress
        return dataclasses.replace(self.imports, **changes) if changes else self.imports


# ---------------------------------------------------------------- source formats (importers)


def _local_dir(url: str) -> bool:
    """Megatron and DeepSpeed write with ``torch.save`` to local paths only."""
    return "://" not in url or url.startswith("file://")


def _local(url: str) -> str:
    return url.removeprefix("file://")


@dataclass(frozen=True)
class MegatronFormat:
    """Megatron-core ``torch_dist`` (``metadata.json`` naming torch_dist) and legacy
    (``mp_rank_*/model_optim_rng.pt``, or the save root with ``latest_checkpointed_iteration.txt``)."""

    name: str = "megatron"
    description: str = "a Megatron checkpoint"
    priority: int = 10

    def detect(self, url: str, storage_options: dict[str, Any] | None = None) -> bool:
        if not _local_dir(url):
            return False
        from ckptkit_converters.megatron.files import is_legacy, is_torch_dist

        return is_torch_dist(_local(url)) or is_legacy(_local(url))

    def import_to(self, source: str, dest: str, options: ImportOptions,
                  storage_options: dict[str, Any] | None = None) -> ConvertResult:
        from ckptkit_converters.megatron.importer import import_legacy, import_torch_dist
        from ckptkit_converters.megatron.files import is_torch_dist

        path = _local(source)
        common: dict[str, Any] = {
            "vocab_size": options.vocab_size, "divisible_by": options.make_vocab_size_divisible_by,
            "threads": options.threads or 2, "progress": options.progress, "storage_options": storage_options}
        if is_torch_dist(path):
            return import_torch_dist(path, dest, **common)
        return import_legacy(path, dest, tied=options.extra.get("tied"), **common)


@dataclass(frozen=True)
class DeepSpeedFormat:
    """A native DeepSpeed ZeRO checkpoint folder (``latest`` naming a ``global_stepN`` tag)."""

    name: str = "deepspeed"
    description: str = "a DeepSpeed checkpoint"
    priority: int = 20

    def detect(self, url: str, storage_options: dict[str, Any] | None = None) -> bool:
        if not _local_dir(url):
            return False
        from ckptkit_converters.deepspeed.files import is_deepspeed_checkpoint

        return is_deepspeed_checkpoint(_local(url))

    def import_to(self, source: str, dest: str, options: ImportOptions,
                  storage_options: dict[str, Any] | None = None) -> ConvertResult:
        from ckptkit.engine.offline_writer import OfflineWriteOptions
        from ckptkit_converters.deepspeed.convert import import_deepspeed

        return import_deepspeed(_local(source), dest, tag=options.extra.get("tag"),
                                options=OfflineWriteOptions(threads=options.threads or 1),
                                storage_options=storage_options)


@dataclass(frozen=True)
class DcpFormat:
    """A ``torch.distributed.checkpoint`` directory (``.metadata``): torchtitan, plain ``dcp.save``."""

    name: str = "dcp"
    description: str = "a DCP checkpoint"
    priority: int = 30

    def detect(self, url: str, storage_options: dict[str, Any] | None = None) -> bool:
        from ckptkit_converters.dcp.files import METADATA_NAME
        from ckptkit.storage.url import open_store

        return open_store(url, storage_options).exists(METADATA_NAME)

    def import_to(self, source: str, dest: str, options: ImportOptions,
                  storage_options: dict[str, Any] | None = None) -> ConvertResult:
        from ckptkit_converters.dcp.convert import DcpImportOptions, import_dcp

        opts = DcpImportOptions(threads=options.threads or DcpImportOptions.threads,
                                skip_unsafe_items=bool(options.extra.get("skip_unsafe_items", False)))
        return import_dcp(source, dest, options=opts, storage_options=storage_options, progress=options.progress)


@dataclass(frozen=True)
class ZarrFormat:
    """A zarr v3 group written by ``ckptkit convert --format zarr`` (``zarr.json`` at its root)."""

    name: str = "zarr"
    description: str = "a zarr group"
    priority: int = 40

    def detect(self, url: str, storage_options: dict[str, Any] | None = None) -> bool:
        from ckptkit.storage.url import open_store

        return open_store(url, storage_options).exists("zarr.json")

    def import_to(self, source: str, dest: str, options: ImportOptions,
                  storage_options: dict[str, Any] | None = None) -> ConvertResult:
        from ckptkit_converters.zarr.convert import ZarrImportOptions, import_zarr

        opts = ZarrImportOptions(threads=options.threads or ZarrImportOptions.threads)
        return import_zarr(source, dest, options=opts, storage_options=storage_options, progress=options.progress)


MEGATRON = MegatronFormat()
DEEPSPEED = DeepSpeedFormat()
DCP = DcpFormat()
ZARR = ZarrFormat()
BUILTIN: tuple[SourceFormat, ...] = (MEGATRON, DEEPSPEED, DCP, ZARR)


def formats() -> list[SourceFormat]:
    """Every source format, in detection order: the registered ones (entry points), and the
    built-in ones even when this package runs without being installed (no entry points)."""
    found = {f.name: f for f in source_formats()}
    for f in BUILTIN:
        found.setdefault(f.name, f)
    return sorted(found.values(), key=lambda f: (priority_of(f), f.name))


def detect(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> SourceFormat | None:
    """The format of the checkpoint at ``url``; None for a ckptkit checkpoint or anything unknown."""
    text = os.fspath(url)
    for fmt in formats():
        if fmt.detect(text, storage_options):
            return fmt
    return None


# ---------------------------------------------------------------- exporters (ckptkit -> X)


def _to_zarr(source: str, dest: str, o: ConvertOptions) -> ConvertResult:
    from ckptkit_converters.zarr.convert import ZarrExportOptions, export_zarr

    d = ZarrExportOptions()
    opts = ZarrExportOptions(chunk_bytes=o.chunk_bytes or d.chunk_bytes, shard_bytes=o.shard_bytes or d.shard_bytes,
                             portable=o.portable, compression=o.compression,  # type: ignore[arg-type]
                             threads=o.threads or d.threads)
    return export_zarr(source, dest, options=opts, storage_options=o.storage_options, progress=o.progress)


def _to_dcp(source: str, dest: str, o: ConvertOptions) -> ConvertResult:
    from ckptkit_converters.dcp.convert import DcpExportOptions, export_dcp

    opts = DcpExportOptions(threads=o.threads or DcpExportOptions.threads)
    return export_dcp(source, dest, options=opts, storage_options=o.storage_options, progress=o.progress)


def _check_hf(o: ConvertOptions) -> None:
    if o.hf_config is None and o.heads is None:
        raise CkptkitError("the hf export needs the model's Hugging Face config.json (its model_type picks the key "
                           "table; head counts, vocabulary and expert counts come from it) or at least the "
                           "attention head counts: hf_config or heads (CLI: --hf-config config.json, or "
                           "--heads N [--kv-heads M])")


def hf_config_of(o: ConvertOptions) -> Any:
    """The :class:`~ckptkit_converters.hf.mapping.HFConfig` of these options (the file, then the flags)."""
    from ckptkit_converters.hf.mapping import HFConfig

    cfg = HFConfig.from_file(o.hf_config) if o.hf_config is not None else HFConfig(source="the head counts given")
    if o.heads is not None:
        cfg = dataclasses.replace(cfg, n_heads=o.heads, n_kv_heads=o.kv_heads or o.heads)
    return cfg


def _to_hf(source: str, dest: str, o: ConvertOptions) -> ConvertResult:
    from ckptkit_converters.hf.exporter import HFExportOptions, export_hf

    _check_hf(o)
    opts = HFExportOptions(family=o.hf_family, prefix=o.prefix, dtype=o.dtype)
    return export_hf(source, dest, hf_config_of(o), options=opts, storage_options=o.storage_options,
                     progress=o.progress)


def _check_deepspeed(o: ConvertOptions) -> None:
    if o.dp is None:
        raise CkptkitError("the deepspeed export needs dp, the DP size the native checkpoint is written for "
                           "(CLI: --dp N)")


def _to_deepspeed(source: str, dest: str, o: ConvertOptions) -> ConvertResult:
    from ckptkit_converters.deepspeed.convert import export_deepspeed

    _check_deepspeed(o)
    assert o.dp is not None
    return export_deepspeed(source, dest, dp=o.dp, stage=o.zero_stage, ep=o.ep, storage_options=o.storage_options)


def check_megatron_target(target: ParallelConfig | None) -> ParallelConfig:
    """The target of a Megatron export: tp, pp (an even split), ep and etp (what the exporter writes)."""
    if target is None:
        raise CkptkitError("the megatron export needs the target layout: layout (CLI: --to LAYOUT, e.g. --to tp2pp2), "
                           "the tp/pp Megatron will load the torch_dist directory at")
    if target.vpp not in (None, 1) or target.pp_layers is not None or target.cp != 1:
        raise LayoutError(f"--format megatron writes an even pipeline split without virtual chunks or context "
                          f"parallelism; target {target} asks for more")
    return target


def _to_megatron(source: str, dest: str, o: ConvertOptions) -> ConvertResult:
    from ckptkit_converters.megatron.exporter import export_torch_dist

    target = check_megatron_target(o.layout)
    return export_torch_dist(source, dest, tp=target.tp, pp=target.pp, ep=target.ep, etp=target.etp,
                             divisible_by=o.imports.make_vocab_size_divisible_by, progress=o.progress)


Exporter = Callable[[str, str, ConvertOptions], "ConvertResult"]
EXPORTERS: dict[str, Exporter] = {
    "zarr": _to_zarr,
    "dcp": _to_dcp,
    "hf": _to_hf,
    "deepspeed": _to_deepspeed,
    "megatron": _to_megatron,
}
"""ckptkit -> format: the exporter of each target format."""

CHECKS: dict[str, Callable[[ConvertOptions], Any]] = {
    "hf": _check_hf,
    "deepspeed": _check_deepspeed,
    "megatron": lambda o: check_megatron_target(o.layout),
}
"""What an exporter needs, checked before anything is read (and before a foreign source is imported)."""

RELAYOUT = frozenset({"megatron"})
"""Targets whose exporter writes a chosen layout: converting a source of that format to it is a relayout."""


def targets() -> tuple[str, ...]:
    """Every ``to_format`` :func:`convert` takes."""
    return (CKPTKIT, *EXPORTERS)


# ---------------------------------------------------------------- convert


@contextmanager
def _imported(source: str, fmt: SourceFormat, options: ConvertOptions) -> Iterator[str]:
    """``source`` imported by ``fmt`` to a temporary local ckptkit checkpoint (removed on exit)."""
    scratch = tempfile.mkdtemp(prefix="ckptkit-import-")
    try:
        path = os.path.join(scratch, "imported")
        fmt.import_to(source, path, options.import_options(), options.storage_options)
        yield path
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _not_foreign(source: str) -> CkptkitError:
    others = ", ".join(f.name for f in formats() if f not in BUILTIN)
    extra = f" nor any other registered format ({others})" if others else ""
    return CkptkitError(
        f"{source} is not a zarr group (no zarr.json), a DCP checkpoint (no .metadata), a DeepSpeed or a Megatron "
        f"checkpoint{extra}: --format ckptkit imports one of those (a ckptkit checkpoint converts to "
        f"--format {', '.join(EXPORTERS)})")


def convert(source: str | os.PathLike[str], dest: str | os.PathLike[str], *, to_format: str | None = None,
            options: ConvertOptions = ConvertOptions()) -> ConvertResult:
    """Convert the checkpoint at ``source`` to ``to_format`` at ``dest`` (see the module docstring).

    ``to_format`` None: ``ckptkit`` for a source of another format, ``zarr`` for a ckptkit one.
    Raises :class:`~ckptkit.errors.CkptkitError` for a direction that does not exist (naming the
    formats that do) and :class:`~ckptkit.offline.formats.MissingImportOptions` for facts a
    source does not record (Megatron's vocabulary size, by name).
    """
    src, out = os.fspath(source), os.fspath(dest)
    fmt = detect(src, options.storage_options)
    target = to_format or (CKPTKIT if fmt is not None else "zarr")
    if target == CKPTKIT:
        if fmt is None:
            raise _not_foreign(src)
        return fmt.import_to(src, out, options.import_options(), options.storage_options)
    export = EXPORTERS.get(target)
    if export is None:
        raise CkptkitError(f"no conversion to {target!r} (formats: {', '.join(targets())})")
    CHECKS.get(target, lambda o: None)(options)
    if fmt is None:
        return export(src, out, options)
    if fmt.name == target and target not in RELAYOUT:
        raise CkptkitError(f"{src} is already {description_of(fmt)}; --format ckptkit converts it to a checkpoint "
                           f"(then convert that to --format {target})")
    with _imported(src, fmt, options) as local:
        result = export(local, out, options)
    return dataclasses.replace(result, source=src)
