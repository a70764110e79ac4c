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
  target piece through a :class:`~ckptkit.modelspace.view.CheckpointView`
  (ranged, checksum-verified reads of only the source bytes it overlaps)
  just before it is written. Memory holds a few pieces, never the model.

The source is only read. The destination is committed by its manifest,
written last; a failure removes the partial output, so a failed reshard
leaves no committed checkpoint. Replicated values are copied as they are;
per-rank values (RNG states, data-loader positions) belong to ranks of the
*source* layout and are dropped — the result lists them.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ckptkit.engine.buffers import BufferPool
from ckptkit.engine.metadata_io import read_manifest
from ckptkit.engine.state import torch_dtype
from ckptkit.engine.offline_writer import OfflineWriteOptions, write_offline
from ckptkit.errors import SaveError
from ckptkit.layout.box import Box, Region
from ckptkit.layout.config import ParallelConfig
from ckptkit.layout.manifest import MANIFEST_NAME, Manifest
from ckptkit.modelspace.view import CheckpointView, ViewOptions
from ckptkit.options import Progress
from ckptkit.plan.reshard_plan import (
    ReshardError,
    ReshardPlan,
    ReshardPlanOptions,
    TargetPiece,
    check_plan,
    plan_reshard,
)
from ckptkit.storage.url import open_store

Format = Literal["ckptkit"]
FORMATS: tuple[str, ...] = ("ckptkit",)


@dataclass(frozen=True)
class ReshardOptions:
    """How to reshard: the planner's options (memory budget, strictness, layer count), the
    checksum ``block_size`` of the output, and its ``format`` (only ``ckptkit`` so far)."""

    plan: ReshardPlanOptions = field(default_factory=ReshardPlanOptions)
    block_size: int = 4 << 20
    format: Format = "ckptkit"

    def __post_init__(self) -> None:
        OfflineWriteOptions(block_size=self.block_size)  # the saver's own check of the block size
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


def plan(
    source: str | os.PathLike[str],
    target: ParallelConfig,
    *,
    options: ReshardOptions = ReshardOptions(),
    storage_options: dict[str, Any] | None = None,
) -> ReshardResult:
    """The plan of resharding ``source`` to ``target``, reading only the manifest (a dry run)."""
    t0 = time.perf_counter()
    store = open_store(source, storage_options)
    manifest = read_manifest(store)
    the_plan = plan_reshard(manifest.tensors, target, options.plan)
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
) -> ReshardResult:
    """Write the checkpoint at ``source`` as a committed checkpoint at ``dest`` laid out for ``target``.

    Every tensor with a partition rule is stored as the target's grid (the
    rule recorded again, so the output can be resharded once more); ``dest``
    must not hold a committed checkpoint and must not overlap ``source``.
    """
    t0 = time.perf_counter()
    src = open_store(source, storage_options)
    out = open_store(dest, storage_options)
    _check_apart(src.url, out.url)
    manifest = read_manifest(src)
    if out.exists(MANIFEST_NAME):
        raise SaveError(f"{out.url} already holds a committed checkpoint; reshard never overwrites one "
                        "(choose another destination, or delete it first)")
    the_plan = plan_reshard(manifest.tensors, target, options.plan)
    check_plan(the_plan)
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
    dropped = tuple(sorted({*manifest.per_rank_keys, *manifest.rank_values}))  # values of source ranks
    orig = manifest.meta
    meta = {
        "user": orig.get("user", {}),
        "resharded_from": {
            "url": src.url, "parallel": manifest.parallel, "world_size": manifest.world_size,
            "created": orig.get("created"), "dropped_per_rank_values": list(dropped),
        },
        "layout": {"parallel": str(target), "pp_layers": list(target.pp_layers) if target.pp_layers else None},
    }
    with ThreadPoolExecutor(max_workers=the_plan.threads * (the_plan.read_ahead + 1),
                            thread_name_prefix="ckptkit-reshard-read") as pool:
        write_offline(
            out,
            world_size=the_plan.world_size,
            tensors=manifest.tensors,
            pieces={r: [(p.tensor, Region(p.box)) for p in items] for r, items in by_rank.items()},
            source=lambda rank, _: _ViewPieces(view, by_rank.get(rank, []), pool, the_plan.read_ahead, pieces_pool),
            values=manifest.values,
            meta=meta,
            parallel=str(target),
            layouts={t.key: t.meta() for t in the_plan.tensors},
            options=OfflineWriteOptions(block_size=options.block_size, threads=the_plan.threads),
            progress=progress,
            what=f"resharding {src.url} to {target} at {out.url}",
        )
    return ReshardResult(src.url, out.url, manifest.parallel, the_plan, dropped, view.bytes_read,
                         time.perf_counter() - t0, False)


def _check_apart(src: str, dst: str) -> None:
    """The destination is written and, on failure, removed: it must not be, or be inside, the source."""
    a, b = src.rstrip("/"), dst.rstrip("/")
    if a == b or b.startswith(a + "/") or a.startswith(b + "/"):
        raise ReshardError(f"the destination {dst} overlaps the source {src}; reshard writes a new checkpoint "
                           "next to the source, never into it")


class _ViewPieces:
    """One target rank's pieces, each read from the source through the view, with read-ahead.

    The :class:`~ckptkit.engine.offline_writer.PieceSource` of a reshard: the
    writer asks for piece ``ref`` just before writing it; at most
    ``read_ahead`` later pieces are being read meanwhile (the plan's memory
    estimate counts them). With a ``buffers`` pool each piece is read into a
    pooled buffer, given back when the writer calls :meth:`release` (written
    and checksummed); without one, into a new tensor.
    """

    def __init__(self, view: CheckpointView, pieces: Sequence[TargetPiece], pool: ThreadPoolExecutor,
                 read_ahead: int, buffers: BufferPool | None = None) -> None:
        self._view = view
        self._pieces = pieces
        self._pool = pool
        self._read_ahead = read_ahead
        self._buffers = buffers
        self._futures: dict[int, Future[torch.Tensor]] = {}
        self._held: dict[int, torch.Tensor] = {}  # ref -> pooled buffer, until released
        self._closed = False
        self._lock = threading.Lock()
        self.bytes_read = 0

    def __len__(self) -> int:
        return len(self._pieces)

    def _load(self, ref: int) -> torch.Tensor:
        piece = self._pieces[ref]
        box = Box(piece.box.offsets, piece.box.sizes)
        out = None
        if self._buffers is not None:
            buf = self._buffers.acquire(piece.nbytes)
            with self._lock:
                if self._closed:
                    self._buffers.release(buf)
                    raise SaveError("the reshard of this rank was abandoned")
                self._held[ref] = buf
            out = buf.view(torch_dtype(self._view.meta_of(piece.tensor).dtype)).view(piece.box.sizes)
        data = self._view.read_box(piece.tensor, box, out)
        with self._lock:
            self.bytes_read += piece.nbytes
        return data

    def __getitem__(self, ref: int) -> torch.Tensor:
        with self._lock:
            future = self._futures.pop(ref, None) or self._pool.submit(self._load, ref)
            for stale in [r for r in self._futures if r < ref]:  # never to be asked for: free their buffers
                self._futures.pop(stale).add_done_callback(lambda _f, r=stale: self.release(r))
            for nxt in range(ref + 1, min(len(self._pieces), ref + 1 + self._read_ahead)):
                if nxt not in self._futures:
                    self._futures[nxt] = self._pool.submit(self._load, nxt)
        try:
            return future.result()
        except BaseException:
            self.release(ref)
            raise

    def release(self, ref: int) -> None:
        """Piece ``ref`` is written and checksummed: its buffer goes back to the pool."""
        with self._lock:
            buf = self._held.pop(ref, None)
        if buf is not None and self._buffers is not None:
            self._buffers.release(buf)

    def close(self) -> None:
        """The rank is done (or failed): read-ahead still running frees its buffers as it finishes."""
        with self._lock:
            self._closed = True
            futures, self._futures = list(self._futures.items()), {}
        for ref, future in futures:
            future.add_done_callback(lambda _f, r=ref: self.release(r))
        for ref in list(self._held):
            if all(ref != r for r, _ in futures):
                self.release(ref)


def source_manifest(source: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Manifest:
    """The source's manifest (what the CLI shows next to a plan)."""
    return read_manifest(open_store(source, storage_options))
