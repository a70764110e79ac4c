"""Every format ckptkit converts, as one list of :class:`~ckptkit.offline.formats.Format` objects.

* :func:`formats` — every format, in detection order (the registered ones, and the shipped ones
  even when this package runs without being installed);
* :func:`detect` — the format of a checkpoint, None for ckptkit's own (or anything unknown);
* :func:`convert` — ``source`` to ``dest`` in ``to_format``; one result type,
  :class:`~ckptkit.engine.offline_writer.ConvertResult` (``ckptkit.offline.ConvertResult``; a
  format may add fields: ``skipped``, ``meta``, ``shards``; ``to_json()`` carries them):

  ====================  ===============================================================
  source                ``to_format``
  ====================  ===============================================================
  a detected format     ``"ckptkit"``: its ``import_to``
  a ckptkit checkpoint  any format with an exporter: its ``export_from``
  a detected format     any format with an exporter: imported to a temporary local
                        checkpoint first (a format to itself only where it is a relayout:
                        Megatron at another tp/pp)
  ====================  ===============================================================

Each format is one package (``ckptkit_converters.<name>``) whose ``format.FORMAT`` implements the
contract, registered under the ``ckptkit.formats`` entry-point group (``pyproject.toml``), so
``ckptkit.reshard`` imports a foreign source by itself too. Adding a format is adding a package
and its entry point: nothing here changes (docs/architecture.md, "How to add a format").

This module imports no torch: each format's work is imported when it runs.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.offline.formats import Format, RunOptions, description_of, priority_of, source_formats
from ckptkit.storage.url import overlaps
from ckptkit_converters.convert_options import ConvertOptions
from ckptkit_converters.dcp.format import FORMAT as DCP
from ckptkit_converters.deepspeed.format import FORMAT as DEEPSPEED
from ckptkit_converters.hf.format import FORMAT as HF
from ckptkit_converters.megatron.format import FORMAT as MEGATRON
from ckptkit_converters.megatron.options import MegatronExportOptions
from ckptkit_converters.zarr.format import FORMAT as ZARR

if TYPE_CHECKING:
    from ckptkit.engine.offline_writer import ConvertResult
    from ckptkit.layout.config import ParallelConfig

CKPTKIT = "ckptkit"
BUILTIN: tuple[Format, ...] = (MEGATRON, DEEPSPEED, DCP, ZARR, HF)

__all__ = ["BUILTIN", "CKPTKIT", "ConvertOptions", "DCP", "DEEPSPEED", "HF", "MEGATRON", "ZARR", "convert",
           "detect", "format_named", "formats", "targets"]


def formats() -> list[Format]:
    """Every format, in detection order: the registered ones (entry points), and the shipped ones
    even when this package runs without being installed (no entry points)."""
    found = {f.name: f for f in source_formats()}
    for f in BUILTIN:
        found.setdefault(f.name, f)
    return sorted(found.values(), key=lambda f: (priority_of(f), f.name))


def detect(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Format | None:
    """The format of the checkpoint at ``url``; None for a ckptkit checkpoint or anything unknown."""
    text = os.fspath(url)
    for fmt in formats():
        if fmt.import_options is not None and fmt.detect(text, storage_options):
            return fmt
    return None


def format_named(name: str) -> Format:
    """The format called ``name`` (as the CLI spells it); a clear error naming the known ones."""
    for fmt in formats():
        if fmt.name == name:
            return fmt
    raise CkptkitError(f"no checkpoint format {name!r} (formats: {', '.join(f.name for f in formats())})")


def targets() -> tuple[str, ...]:
    """Every ``to_format`` :func:`convert` takes."""
    return (CKPTKIT, *(f.name for f in formats() if f.export_options is not None))


# ---------------------------------------------------------------- convert


@contextmanager
def _imported(source: str, fmt: Format, options: Any, run: RunOptions, parent: str | None = None) -> Iterator[str]:
    """``source`` imported by ``fmt`` to a temporary local ckptkit checkpoint (removed on exit), in
    ``parent`` (None: the system's temporary folder)."""
    scratch = tempfile.mkdtemp(prefix="ckptkit-import-", dir=parent)
    try:
        path = os.path.join(scratch, "imported")
        fmt.import_to(source, path, options, run)
        yield path
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextmanager
def _import_once(source: str, fmt: Format, options: Any, run: RunOptions, out: str) -> Iterator[str]:
    """A foreign source as a local ckptkit checkpoint; in a spread run imported once, by process 0,
    where every process can read it (:func:`ckptkit.offline.spread.spread_source`)."""
    if not _spreading(run):
        with _imported(source, fmt, options, run) as local:
            yield local
        return
    from ckptkit.offline.spread import spread_comm, spread_source

    @contextmanager
    def factory(parent: str | None) -> Iterator[tuple[str, dict[str, Any] | None]]:
        with _imported(source, fmt, options, run, parent) as local:
            yield local, None

    with spread_source(spread_comm(run.process_group), factory, source, out, run.storage_options) as (local, _):
        yield local


def _spreading(run: RunOptions) -> bool:
    """Whether ``run`` spreads over more than this process."""
    if run.process_group is None:
        return False
    import torch.distributed as dist

    return dist.get_world_size(run.process_group) > 1


def _not_spread(target: str) -> CkptkitError:
    spread = [f.name for f in formats() if getattr(f, "spreads", False) and f.export_options is not None]
    return CkptkitError(f"a conversion to {target} runs in one process (spread over processes: reshard, and "
                        f"conversions to {', '.join(spread)}): run it without a process group (without torchrun)")


def _not_foreign(source: str) -> CkptkitError:
    names = [description_of(f) for f in formats() if f.import_options is not None]
    known = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    return CkptkitError(f"{source} is not {known}: --format ckptkit imports one of those (a ckptkit checkpoint "
                        f"converts to --format {', '.join(targets()[1:])})")


def _exporter(target: str) -> Format:
    for fmt in formats():
        if fmt.name == target and fmt.export_options is not None:
            return fmt
    raise CkptkitError(f"no conversion to {target!r} (formats: {', '.join(targets())})")


def convert(source: str | os.PathLike[str], dest: str | os.PathLike[str], *, to_format: str | None = None,
            from_format: str | None = None, source_options: Any = None, target_options: Any = None, run: RunOptions = RunOptions(),
            options: ConvertOptions | None = None) -> ConvertResult:
    """Convert the checkpoint at ``source`` to ``to_format`` at ``dest`` (see the module docstring).

    ``to_format`` None: ``ckptkit`` for a source of another format, ``zarr`` for a ckptkit one.
    ``from_format``: read ``source`` as this format instead of detecting it.
    ``source_options``: the source format's import options (e.g. ``MegatronImportOptions``; None:
    its defaults); ``target_options``: the target's export options (e.g. ``HFExportOptions``);
    ``run``: threads, progress, storage options. ``options`` (a :class:`ConvertOptions`) is the
    deprecated form. Raises :class:`~ckptkit.errors.CkptkitError` for a direction that does not
    exist (naming the formats that do), or options an export cannot run with, before anything
    is read; :class:`~ckptkit.offline.formats.MissingImportOptions` for facts a source does not
    record (Megatron's vocabulary size, by name).
    """
    src, out = os.fspath(source), os.fspath(dest)
    if overlaps(src, out):  # every direction writes dest and removes what it wrote on failure
        raise CkptkitError(f"the destination {out} overlaps the source {src} (links resolved): a conversion writes "
                           "a new checkpoint next to its source, never into it or around it")
    if options is not None:
        warnings.warn("convert(..., options=ConvertOptions(...)) is deprecated: pass run=RunOptions(...), "
                      "source_options= and target_options= (each format's own options dataclass)",
                      DeprecationWarning, stacklevel=2)
        run = options.run()
    fmt = format_named(from_format) if from_format is not None else detect(src, run.storage_options)
    target = to_format or (CKPTKIT if fmt is not None else "zarr")
    if options is not None:
        source_options = options.source_options(fmt)
    if target == CKPTKIT:
        if fmt is None:
            raise _not_foreign(src)
        if _spreading(run):
            raise _not_spread(target)
        return fmt.import_to(src, out, source_options, run)
    exporter = _exporter(target)
    if _spreading(run) and not getattr(exporter, "spreads", False):
        raise _not_spread(target)
    if options is not None:
        target_options = options.target_options(exporter)
    target_options = exporter.export_options_of(target_options)  # type: ignore[attr-defined]
    exporter.check_export(target_options)
    if fmt is None:
        return exporter.export_from(src, out, target_options, run)
    if fmt.name == target and not exporter.relayout:
        raise CkptkitError(f"{src} is already {description_of(fmt)}; --format ckptkit converts it to a checkpoint "
                           f"(then convert that to --format {target})")
    with _import_once(src, fmt, source_options, run, out) as local:
        result = exporter.export_from(local, out, target_options, run)
    return dataclasses.replace(result, source=src)


# ---------------------------------------------------------------- the first API's names (deprecated)


def check_megatron_target(target: ParallelConfig | None) -> ParallelConfig:
    """Deprecated: ``MegatronExportOptions(layout=target).target()``."""
    warnings.warn("check_megatron_target(t) is deprecated: MegatronExportOptions(layout=t).target()",
                  DeprecationWarning, stacklevel=2)
    return MegatronExportOptions(layout=target).target()


def hf_config_of(o: ConvertOptions) -> Any:
    """Deprecated: ``HFExportOptions(config=..., heads=..., kv_heads=...).hf_config()``."""
    from ckptkit_converters.hf.options import HFExportOptions

    warnings.warn("hf_config_of(ConvertOptions) is deprecated: HFExportOptions(config=, heads=, kv_heads=)"
                  ".hf_config()", DeprecationWarning, stacklevel=2)
    return HFExportOptions(config=o.hf_config, heads=o.heads, kv_heads=o.kv_heads).hf_config()
