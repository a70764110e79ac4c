"""Write a committed checkpoint from one process, as N virtual writer ranks.

Converters (zarr import, DCP import) hold a checkpoint's pieces in some other
store, not in the memory of N live ranks. Rather than a second writer, this
runs a save's own phases for them, with no process group:

1. **plan** each virtual rank's pieces with :func:`plan_save` (explicit
   pieces, so no collective is needed to agree on replicas);
2. **persist** them with :func:`persist` — one sequential data object per
   rank, a CRC32C per block computed while writing, then the rank's index —
   fetching each piece from a :class:`PieceSource` just before it is
   written, so memory holds a few pieces (the source's read-ahead) per rank
   being written, never the model;
3. **merge** the ranks' reports with :func:`merge_reports` (coverage,
   overlaps and dtype agreement are validated exactly as for a live save);
4. **publish** the manifest with :func:`publish` (atomic put-if-absent).

On any failure nothing is committed and the partial output is removed. The
result is indistinguishable from a checkpoint saved by ``world_size`` ranks:
``ckptkit.load`` reads it at any layout.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Protocol, cast

import torch

from ckptkit.options import Progress, SaveOptions, progress_counter
from ckptkit.engine.checkpoint_dir import remove_attempt, remove_other_attempts
from ckptkit.engine.saver import Prepared, check_target, persist, publish
from ckptkit.errors import CkptkitError, LayoutError, OptionsError, StorageError
from ckptkit.layout.box import Region
from ckptkit.layout.manifest import (
    DTYPES,
    ExplicitLayout,
    Manifest,
    TensorMeta,
)
from ckptkit.layout.pieces import LocalBox, LocalFlat, Piece
from ckptkit.plan.merge import RankReport, merge_reports
from ckptkit.plan.save_plan import ExplicitDecl, plan_save
from ckptkit.storage.base import ByteStore
from ckptkit.version import __version__

RankPieces = Sequence[tuple[str, Region]]  # (tensor key, stored region), in the order they are written


class PieceSource(Protocol):
    """The pieces of one virtual rank, fetched on demand.

    ``source[ref]`` is piece ``ref`` of the rank's piece list as a CPU tensor:
    shaped like the piece's box, or 1-D (``region.numel`` elements) for a
    flat region. It is asked for in write order, one piece at a time, so a
    source can read ahead. ``bytes_read`` counts bytes fetched from the
    source store (reported in conversion results).
    """

    bytes_read: int

    def __len__(self) -> int: ...

    def __getitem__(self, ref: int) -> torch.Tensor: ...


# Optional, looked up on a source: ``release(ref)``, told once piece ``ref``'s bytes are written and
# checksummed (a source that reuses buffers frees that one then), and ``close()``, called when the
# rank is done or failed (a source stops its read-ahead).


class TensorSpec(Protocol):
    """What the writer needs of a logical tensor (a :class:`TensorMeta` is one)."""

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


# Builds the piece source of one rank, called in the thread that writes that rank.
SourceFactory = Callable[[int, RankPieces], PieceSource]


@dataclass(frozen=True)
class OfflineWriteOptions:
    """``block_size``: bytes per stored checksum (a multiple of 4096); ``threads``: virtual ranks
    written at once (memory grows with it: each rank holds its source's read-ahead)."""

    block_size: int = 4 << 20
    threads: int = 2

    def __post_init__(self) -> None:
        SaveOptions(block_size=self.block_size)  # the saver's own validation of the checksum block
        if self.threads < 1:
            raise OptionsError(f"threads {self.threads} must be >= 1")


@dataclass(frozen=True)
class OfflineWriteResult:
    """The published manifest, the logical bytes written, and the bytes the sources read."""

    manifest: Manifest
    nbytes: int
    bytes_read: int


def local_place(region: Region) -> tuple[LocalBox | LocalFlat, tuple[int, ...]]:
    """Where a piece sits in the tensor its source returns, and that tensor's shape."""
    if region.flat is None:
        return LocalBox(tuple(0 for _ in region.box.sizes)), tuple(region.box.sizes)
    return LocalFlat(0), (region.numel,)


def write_offline(
    store: ByteStore,
    *,
    world_size: int,
    tensors: Mapping[str, TensorSpec],
    pieces: Mapping[int, RankPieces],
    source: SourceFactory,
    values: Mapping[str, Any] | None = None,
    per_rank_values: Mapping[int, Mapping[str, Any]] | None = None,
    rank_values: Mapping[str, tuple[tuple[Any, tuple[int, ...]], ...]] | None = None,
    meta: Mapping[str, Any] | None = None,
    parallel: str | None = None,
    layouts: Mapping[str, TensorMeta] | None = None,
    options: OfflineWriteOptions = OfflineWriteOptions(),
    progress: Progress | None = None,
    what: str | None = None,
) -> OfflineWriteResult:
    """Write and commit a checkpoint at ``store`` as ``world_size`` virtual ranks.

    ``pieces[r]`` lists what rank ``r`` stores (ranks without an entry store
    no tensor bytes but still write an index); every stored region must be of
    a tensor in ``tensors``, and together they must cover each tensor exactly
    once. ``values`` are the replicated values and ``per_rank_values[r]`` rank
    ``r``'s per-rank values, both already JSON-encoded; ``rank_values`` values the source's ranks
    disagreed about (kept per rank, as :class:`~ckptkit.layout.manifest.Manifest` records them)
    (:func:`ckptkit.layout.values.encode_value`). ``meta`` adds fields (``user``,
    ``converted_from``) to the manifest's metadata. ``layouts``, when given,
    replaces the manifest entries merged from the explicit pieces with the
    caller's own (grid rules, rotations, partition rules), which must describe
    exactly the same pieces and writers. ``what`` names the operation in errors.

    The target must not hold a committed checkpoint; once this write commits,
    leftovers of other (crashed) attempts there are removed.
    """
    what = what or f"writing {store.url}"
    for rank, items in pieces.items():
        if not 0 <= rank < world_size:
            raise LayoutError(f"{what}: pieces for rank {rank} in a world of {world_size}")
        for key, _ in items:
            if key not in tensors:
                raise LayoutError(f"{what}: rank {rank} stores a piece of {key!r}, which is not among the tensors")
    target = check_target(store)
    per_rank_values = per_rank_values or {}
    total = sum(_numel(t.shape) * DTYPES[t.dtype] for t in tensors.values())
    lock, read = threading.Lock(), [0]
    tick = progress_counter(progress, total)

    def write_rank(rank: int) -> tuple[RankReport, int, int]:
        items = list(pieces.get(rank, ()))
        src = source(rank, items)
        decls = []
        for ref, (key, region) in enumerate(items):
            spec = tensors[key]
            place, local_shape = local_place(region)
            decls.append(ExplicitDecl(ref, spec.dtype, DTYPES[spec.dtype], local_shape,
                                      (Piece(key, tuple(spec.shape), region, place),)))
        plan = plan_save(rank, [], decls)
        own_values = dict(per_rank_values.get(rank, {}))
        prep = Prepared(plan, cast(list, src), {}, own_values, tuple(sorted(own_values))).for_attempt(target.attempt)
        try:
            report = persist(prep, store, options.block_size, tick, getattr(src, "release", None))
        finally:
            close = getattr(src, "close", None)
            if close is not None:
                close()
            with lock:
                read[0] += src.bytes_read
        return report, plan.nbytes, sum(plan.objects.values())

    try:
        with ThreadPoolExecutor(max_workers=options.threads, thread_name_prefix="ckptkit-offline") as pool:
            results = list(pool.map(write_rank, range(world_size)))
        reports = [r for r, _, _ in results]
        manifest_meta: dict[str, Any] = {
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "ckptkit_version": __version__,
            "tensor_bytes": sum(n for _, n, _ in results),
            "stored_bytes": sum(o + r.index.size for r, _, o in results),
        }
        manifest_meta.update(meta or {})
        merged = merge_reports(reports, world_size=world_size, values=dict(values or {}), meta=manifest_meta,
                               parallel=parallel, where=store.url, attempt=target.attempt,
                               rank_values=dict(rank_values or {}))
        _check_all_stored(merged, tensors, store.url)
        if layouts is not None:
            merged.tensors = dict(layouts)
        publish(store, merged.to_json_bytes())
    except BaseException as exc:
        _remove_partial(store, target.attempt)
        if isinstance(exc, CkptkitError) or not isinstance(exc, Exception):
            raise
        raise StorageError(f"{what} failed: {exc}") from exc
    if target.leftovers:
        try:
            remove_other_attempts(store, target.attempt)
        except (CkptkitError, OSError):
            pass  # garbage, never a damaged checkpoint: gc removes it later
    return OfflineWriteResult(merged, total, read[0])


def _check_all_stored(merged: Manifest, tensors: Mapping[str, TensorSpec], where: str) -> None:
    """A tensor without stored pieces is only fine when it has no elements; record those too."""
    for key, spec in tensors.items():
        if key in merged.tensors:
            continue
        if _numel(spec.shape):
            raise LayoutError(f"{where}: tensor {key!r} of shape {list(spec.shape)} has no stored pieces")
        merged.tensors[key] = TensorMeta(key, spec.dtype, tuple(spec.shape), ExplicitLayout(()))
    merged.tensors = dict(sorted(merged.tensors.items()))


def _remove_partial(store: ByteStore, attempt: str) -> None:
    """Best effort, never raising over the original error: a failed write leaves nothing of its own."""
    try:
        remove_attempt(store, attempt)
    except (CkptkitError, OSError):
        pass


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True)
class ConvertResult:
    """What a conversion did: logical tensor bytes moved, data bytes read from the source."""

    source: str
    destination: str
    format: str
    tensors: int
    nbytes: int
    bytes_read: int
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
