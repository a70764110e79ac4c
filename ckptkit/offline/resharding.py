"""Offline resharding: rewrite a checkpoint as a job at another parallel layout would save it.

Loading already reshards (any layout reads any checkpoint), so why rewrite?
Because the *target* reads faster when every rank finds its data as one
contiguous run of its own object, because other tools (a Megatron exporter,
a cold-storage copy) want the target layout on disk, and because a
16k-rank restart should not make every rank intersect boxes against a
different saving layout.

The work is split the usual way:

* :func:`ckptkit.plan.reshard_plan.plan_reshard` (pure) decides every target
  rank's pieces, the source pieces each reads, and the concurrency that fits
  the memory budget — ``--dry-run`` prints exactly that plan;
* this module executes it with :func:`write_offline` (the saver's own
  plan/persist/merge/publish phases, run for N virtual ranks), fetching each
  target piece through a :class:`~ckptkit.offline.view.CheckpointView`
  (ranged, checksum-verified reads of only the source bytes it overlaps)
  just before it is written. Memory holds a few pieces, never the model.

The source is only read. The destination is committed by its manifest,
written last; a failure removes the partial output, so a failed reshard
leaves no committed checkpoint. Replicated values are copied as they are;
per-rank values (RNG states, data-loader positions) belong to ranks of the
*source* layout and are dropped — the result lists them.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from ckptkit.engine.buffers import BufferPool
from ckptkit.engine.metadata_io import read_manifest
from ckptkit.engine.state import torch_dtype
from ckptkit.engine.offline_writer import OfflineCheckpoint, OfflineWriteOptions, write_offline
from ckptkit.engine.prefetch import PrefetchedPieces
from ckptkit.errors import SaveError
from ckptkit.layout.box import Box, Region
from ckptkit.layout.config import ParallelConfig
from ckptkit.layout.manifest import MANIFEST_NAME, Manifest, dropped_per_rank_values
from ckptkit.offline.view import CheckpointView, ViewOptions
from ckptkit.offline.formats import ImportOptions, RunOptions, detect_format, import_options_for
from ckptkit.engine.collective import Comm
from ckptkit.offline.spread import agreed, same_source, spread_comm, spread_source
from ckptkit.options import Progress
from ckptkit.plan.reshard_plan import (
    ReshardError,
    ReshardPlan,
    ReshardPlanOptions,
    TargetPiece,
    check_plan,
)
from ckptkit.plan.reshard_plan import plan_reshard as plan_layout
from ckptkit.storage.url import open_store, overlaps

log = logging.getLogger("ckptkit")
Format = Literal["ckptkit"]
FORMATS: tuple[str, ...] = ("ckptkit",)


@dataclass(frozen=True)
class ReshardOptions:
    """How to reshard: the planner's options (memory budget, strictness, layer count), the
    checksum ``block_size`` of the output, its ``format`` (only ``ckptkit`` here; the CLI's
    ``--format megatron`` goes through the converter), and what importing a source of another
    format may need: ``source_options``, an instance of that format's import options (e.g.
    ``ckptkit_converters.megatron.MegatronImportOptions(vocab_size=...)``; None: its defaults).
    ``imports`` (a first-contract :class:`~ckptkit.offline.formats.ImportOptions`) is deprecated:
    its fields are mapped onto the format's options by name."""

    plan: ReshardPlanOptions = field(default_factory=ReshardPlanOptions)
    block_size: int = 4 << 20
    format: Format = "ckptkit"
    imports: ImportOptions = field(default_factory=ImportOptions)
    source_options: Any = None

    def __post_init__(self) -> None:
        OfflineWriteOptions(block_size=self.block_size)  # the saver's own check of the block size
        if not self.imports.is_default():
            warnings.warn("ReshardOptions(imports=ImportOptions(...)) is deprecated: pass source_options=, the "
                          "source format's own import options (e.g. MegatronImportOptions(vocab_size=...))",
                          DeprecationWarning, stacklevel=3)
        if self.format not in FORMATS:
            raise ReshardError(f"output format {self.format!r} is not supported (formats: {', '.join(FORMATS)})")


@dataclass(frozen=True)
class ReshardResult:
    """What a reshard did (or, for a dry run, would do)."""

    source: str
    destination: str | None
    source_parallel: str | None
    plan: ReshardPlan
    dropped_per_rank: tuple[str, ...]
    bytes_read: int
    seconds: float
    dry_run: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "destination": self.destination,
            "source_parallel": self.source_parallel,
            "dry_run": self.dry_run,
            "bytes_read": self.bytes_read,
            "seconds": self.seconds,
            "dropped_per_rank_values": list(self.dropped_per_rank),
            "plan": self.plan.to_json(),
        }


def plan_reshard(
    source: str | os.PathLike[str],
    target: ParallelConfig,
    *,
    options: ReshardOptions = ReshardOptions(),
    storage_options: dict[str, Any] | None = None,
) -> ReshardResult:
    """The plan of resharding ``source`` to ``target`` (a dry run: a ckptkit source's manifest is
    all that is read; a checkpoint of another format is imported first, to a temporary folder)."""
    with ckptkit_source(source, options, storage_options) as (url, opts):
        return _plan(url, target, options, opts)


def _plan(source: str, target: ParallelConfig, options: ReshardOptions,
          storage_options: dict[str, Any] | None) -> ReshardResult:
    t0 = time.perf_counter()
    store = open_store(source, storage_options)
    manifest = read_manifest(store)
    the_plan = plan_layout(manifest.tensors, target, options.plan)
    dropped = tuple(sorted({*manifest.per_rank_keys, *manifest.rank_values}))
    return ReshardResult(store.url, None, manifest.parallel, the_plan, dropped, 0, time.perf_counter() - t0, True)


def reshard(
    source: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    target: ParallelConfig,
    *,
    options: ReshardOptions = ReshardOptions(),
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
    process_group: Any = None,
) -> ReshardResult:
    """Write the checkpoint at ``source`` as a committed checkpoint at ``dest`` laid out for ``target``.

    Every tensor with a partition rule is stored as the target's grid (the
    rule recorded again, so the output can be resharded once more); ``dest``
    must not hold a committed checkpoint and must not overlap ``source``.
    ``source`` may be of any format a registered converter detects (Megatron
    ``torch_dist`` or legacy, DCP, DeepSpeed, a zarr export): it is imported to
    a temporary ckptkit checkpoint first (on local disk, removed afterwards).

    ``process_group`` (a ``torch.distributed`` group, e.g. ``torch.distributed.group.WORLD``
    under ``torchrun``) spreads the work over its processes, which must all make this call with
    the same arguments: each writes the target ranks of its share, process 0 commits once and
    reports ``progress``; the output is the same, byte for byte, as one process's
    (:mod:`ckptkit.offline.spread`). None (the default): this process alone, whatever job it is in.
    """
    comm = spread_comm(process_group)
    # the source as the user named it, before a foreign one is imported to a temporary folder (the
    # import's folder never overlaps dest: a DCP or zarr source used to take dest inside it)
    agreed(comm, lambda: _check_apart(os.fspath(source), os.fspath(dest)))
    with spread_source(comm, lambda scratch: ckptkit_source(source, options, storage_options, scratch), source,
                       dest, storage_options) as (url, src_opts):
        result = agreed(comm, lambda: _prepare(url, dest, target, options, src_opts, storage_options))
        same_source(comm, url, result.manifest.attempt)
        result = _reshard(result, options, progress, comm, None if url == os.fspath(source) else os.fspath(source))
    return result if url == os.fspath(source) else replace(result, source=os.fspath(source))


@dataclass(frozen=True)
class _Prepared:
    """What every process of a reshard knows before it writes: the stores, the source manifest and the plan."""

    src: Any
    out: Any
    manifest: Manifest
    plan: ReshardPlan
    started: float


def _prepare(source: str, dest: str | os.PathLike[str], target: ParallelConfig, options: ReshardOptions,
             source_options: dict[str, Any] | None, storage_options: dict[str, Any] | None) -> _Prepared:
    t0 = time.perf_counter()
    src = open_store(source, source_options)
    out = open_store(dest, storage_options)
    _check_apart(src.url, out.url)
    manifest = read_manifest(src)
    if out.exists(MANIFEST_NAME):
        raise SaveError(f"{out.url} already holds a committed checkpoint; reshard never overwrites one "
                        "(choose another destination, or delete it first)")
    the_plan = plan_layout(manifest.tensors, target, options.plan)
    check_plan(the_plan)
    return _Prepared(src, out, manifest, the_plan, t0)


def _reshard(prep: _Prepared, options: ReshardOptions, progress: Progress | None, comm: Comm | None,
             imported_from: str | None) -> ReshardResult:
    """Write the plan. ``imported_from``: the foreign source a temporary import was made of (recorded
    in place of the import's own folder and creation time, which name nothing that lasts)."""
    src, out, manifest, the_plan = prep.src, prep.out, prep.manifest, prep.plan
    target = the_plan.target
    by_rank = the_plan.pieces_by_rank()
    # Fixed, reused buffers (see ckptkit.engine.buffers): the pieces in flight and the read scratch.
    # Piece buffers: per rank being written, its read-ahead plus the piece being written, and one
    # more, so a rank always finds one while a written piece is still being checksummed. Only for a
    # store that is done with each chunk before taking the next (else a piece is freed per object).
    largest = max((p.nbytes for items in by_rank.values() for p in items), default=0)
    pieces_pool = (BufferPool(the_plan.threads * (the_plan.read_ahead + 1) + 1, largest)
                   if out.streams_writes else None)
    scratch = BufferPool(the_plan.threads * the_plan.io_threads, the_plan.read_window)
    view = CheckpointView(src, manifest, ViewOptions(io_threads=the_plan.io_threads, scratch=scratch))
    orig = manifest.meta
    # values of source ranks, and those an earlier reshard dropped: a loader asks for them by name
    dropped = tuple(sorted({*manifest.per_rank_keys, *manifest.rank_values, *dropped_per_rank_values(orig)}))
    meta = {
        "user": orig.get("user", {}),
        "resharded_from": {
            "url": imported_from or src.url, "parallel": manifest.parallel, "world_size": manifest.world_size,
            "created": None if imported_from else orig.get("created"), "dropped_per_rank_values": list(dropped),
            **({"converted_from": orig.get("converted_from")} if imported_from else {}),
        },
        "layout": {"parallel": str(target), "pp_layers": list(target.pp_layers) if target.pp_layers else None},
    }
    with ThreadPoolExecutor(max_workers=the_plan.threads * (the_plan.read_ahead + 1),
                            thread_name_prefix="ckptkit-reshard-read") as pool:
        checkpoint = OfflineCheckpoint(
            world_size=the_plan.world_size,
            tensors=manifest.tensors,
            pieces={r: [(p.tensor, Region(p.box)) for p in items] for r, items in by_rank.items()},
            values=manifest.values,
            meta=meta,
            parallel=str(target),
            layouts={t.key: t.meta() for t in the_plan.tensors},
        )
        written = write_offline(
            out,
            checkpoint,
            lambda rank, _: _target_pieces(view, by_rank.get(rank, []), pool, the_plan.read_ahead, pieces_pool),
            options=OfflineWriteOptions(block_size=options.block_size, threads=the_plan.threads),
            progress=progress,
            what=f"resharding {src.url} to {target} at {out.url}",
            comm=comm,
        )
    return ReshardResult(src.url, out.url, manifest.parallel, the_plan, dropped, written.bytes_read,
                         time.perf_counter() - prep.started, False)


@contextmanager
def ckptkit_source(source: str | os.PathLike[str], options: ReshardOptions, storage_options: dict[str, Any] | None,
                   scratch_parent: str | None = None) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """``source`` itself when it is a ckptkit checkpoint; else a temporary import of it by the
    converter that detects its format (in a new folder under ``scratch_parent``, default the
    system's temporary folder; removed on exit). Yields the URL and its storage options."""
    url = os.fspath(source)
    store = open_store(url, storage_options)
    if store.exists(MANIFEST_NAME):
        yield url, storage_options
        return
    fmt = detect_format(url, storage_options)
    if fmt is None:
        read_manifest(store)  # the usual error: not found, or uncommitted
        yield url, storage_options
        return
    scratch = tempfile.mkdtemp(prefix=".ckptkit-import-", dir=scratch_parent)
    try:
        log.info("%s is a %s checkpoint: importing it to %s first", url, fmt.name, scratch)
        given = options.source_options if options.source_options is not None else options.imports
        run = RunOptions(threads=options.imports.threads, progress=options.imports.progress,
                         storage_options=storage_options)
        fmt.import_to(url, os.path.join(scratch, "imported"), import_options_for(fmt, given), run)
        yield os.path.join(scratch, "imported"), None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _check_apart(src: str, dst: str) -> None:
    """The destination is written and, on failure, removed: it must not be, or be inside, the source
    (links resolved: :func:`ckptkit.storage.url.overlaps`)."""
    if overlaps(src, dst):
        raise ReshardError(f"the destination {dst} overlaps the source {src}; reshard writes a new checkpoint "
                           "next to the source, never into it")


def _target_pieces(view: CheckpointView, pieces: Sequence[TargetPiece], pool: ThreadPoolExecutor, read_ahead: int,
                   buffers: BufferPool | None) -> PrefetchedPieces:
    """One target rank's pieces, each read from the source as a box of its tensor, with read-ahead."""

    def shape_of(ref: int) -> tuple[torch.dtype, tuple[int, ...], int]:
        p = pieces[ref]
        return torch_dtype(view.meta_of(p.tensor).dtype), tuple(p.box.sizes), p.nbytes

    def fetch(ref: int, out: torch.Tensor | None) -> torch.Tensor:
        p = pieces[ref]
        return view.read_box(p.tensor, Box(p.box.offsets, p.box.sizes), out)

    return PrefetchedPieces(len(pieces), shape_of, fetch, pool, read_ahead, buffers)


def source_manifest(source: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Manifest:
    """The source's manifest (what the CLI shows next to a plan)."""
    return read_manifest(open_store(source, storage_options))
