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
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields
from math import prod
from typing import Any, Protocol, cast

import torch

from ckptkit.options import Progress, SaveOptions, progress_counter
from ckptkit.engine.checkpoint_dir import remove_attempt, remove_other_attempts
from ckptkit.engine.collective import Comm, Outcome
from ckptkit.engine.metadata_io import read_manifest
from ckptkit.engine.offline_spread import SharedProgress, share_of
from ckptkit.engine.saver import Prepared, Target, check_target, check_target_collective, persist, publish
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


@dataclass(frozen=True)
class StoredTensor:
    """A logical tensor as an importer declares it to the writer: dtype name and global shape
    (one type for every format's importer, instead of one private copy each)."""

    dtype: str
    shape: tuple[int, ...]


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


@dataclass(frozen=True)
class OfflineCheckpoint:
    """What an offline write commits, apart from where its bytes come from.

    One value rather than nine keywords, so that converters build it in one
    place and the writer's steps pass it along whole.

    ``pieces[r]`` lists what virtual rank ``r`` stores, in write order (ranks
    without an entry store no tensor bytes but still write an index); every
    stored region must be of a tensor in ``tensors``, and together they must
    cover each tensor exactly once. ``values`` are the replicated values and
    ``per_rank_values[r]`` rank ``r``'s per-rank values, both already
    JSON-encoded (:func:`ckptkit.layout.values.encode_value`); ``rank_values``
    values the source's ranks disagreed about (kept per rank, as
    :class:`~ckptkit.layout.manifest.Manifest` records them). ``meta`` adds
    fields (``user``, ``converted_from``) to the manifest's metadata;
    ``parallel`` names the layout (``tp2pp2``). ``layouts``, when given,
    replaces the manifest entries merged from the explicit pieces with the
    caller's own (grid rules, rotations, partition rules), which must describe
    exactly the same pieces and writers.
    """

    world_size: int
    tensors: Mapping[str, TensorSpec]
    pieces: Mapping[int, RankPieces]
    values: Mapping[str, Any] | None = None
    per_rank_values: Mapping[int, Mapping[str, Any]] | None = None
    rank_values: Mapping[str, tuple[tuple[Any, tuple[int, ...]], ...]] | None = None
    meta: Mapping[str, Any] | None = None
    parallel: str | None = None
    layouts: Mapping[str, TensorMeta] | None = None

    @property
    def nbytes(self) -> int:
        """Logical bytes of all tensors: the progress total and the result's size."""
        return sum(prod(t.shape) * DTYPES[t.dtype] for t in self.tensors.values())


def write_offline(
    store: ByteStore,
    checkpoint: OfflineCheckpoint | None = None,
    source: SourceFactory | None = None,
    *,
    options: OfflineWriteOptions = OfflineWriteOptions(),
    progress: Progress | None = None,
    what: str | None = None,
    comm: Comm | None = None,
    **fields: Any,
) -> OfflineWriteResult:
    """Write and commit ``checkpoint`` at ``store`` as its ``world_size`` virtual ranks.

    ``source(rank, pieces)`` builds the :class:`PieceSource` of one rank, in the
    thread that writes it. ``what`` names the operation in errors.

    ``comm``, a communicator over several processes (``torchrun``), spreads the
    write: every process must call this with the same checkpoint; each writes
    the virtual ranks of its share and process 0 commits
    (:mod:`ckptkit.engine.offline_spread`). The output is the same, byte for
    byte, as one process's. ``progress`` is reported on process 0 only.

    The first form of this call, ``write_offline(store, world_size=...,
    tensors=..., pieces=..., source=..., ...)`` with :class:`OfflineCheckpoint`'s
    fields as keywords, is still accepted (converters not yet switched use it)
    and goes through the same steps.

    The target must not hold a committed checkpoint; once this write commits,
    leftovers of other (crashed) attempts there are removed.
    """
    checkpoint = _checkpoint_of(checkpoint, fields)
    if source is None:
        raise TypeError("write_offline() needs a source: the factory of each rank's PieceSource")
    what = what or f"writing {store.url}"
    _check_pieces(checkpoint, what)
    if comm is not None and comm.world_size > 1:
        return _write_spread(store, checkpoint, source, options, progress, what, comm)
    target = check_target(store)
    total = checkpoint.nbytes
    writer = _RankWriter(store, checkpoint, source, target.attempt, options.block_size,
                         progress_counter(progress, total))
    try:
        written = _write_ranks(writer, range(checkpoint.world_size), options.threads)
        merged = _commit(store, checkpoint, written, target.attempt)
    except BaseException as exc:
        _remove_partial(store, target.attempt)
        if isinstance(exc, CkptkitError) or not isinstance(exc, Exception):
            raise
        raise StorageError(f"{what} failed: {exc}") from exc
    if target.leftovers:
        _remove_leftovers(store, target.attempt)
    return OfflineWriteResult(merged, total, writer.bytes_read)


def _write_spread(store: ByteStore, checkpoint: OfflineCheckpoint, source: SourceFactory,
                  options: OfflineWriteOptions, progress: Progress | None, what: str, comm: Comm) -> OfflineWriteResult:
    """:func:`write_offline` over the processes of ``comm``: collective (a broadcast of the attempt, a
    gather of the rank reports, a broadcast of the outcome); any process's failure fails all of them."""
    target = check_target_collective(store, comm)
    rank_bytes = {r: sum(region.numel * DTYPES[checkpoint.tensors[k].dtype] for k, region in items)
                  for r, items in checkpoint.pieces.items()}
    mine = share_of(rank_bytes, checkpoint.world_size, comm.world_size)[comm.rank]
    total = checkpoint.nbytes
    shared = SharedProgress(comm, progress, total, sum(rank_bytes.get(r, 0) for r in mine),
                            f"ckptkit/offline/{target.attempt}/bytes")
    writer = _RankWriter(store, checkpoint, source, target.attempt, options.block_size, shared.tick)
    try:
        outcome = Outcome(True, (_write_ranks(writer, mine, options.threads), writer.bytes_read))
    except Exception as exc:  # noqa: BLE001 - reported to process 0, raised on every process below
        outcome = Outcome(False, error=str(exc) or type(exc).__name__, error_type=type(exc).__name__)
    finally:
        shared.close()
    gathered = comm.gather(outcome)
    result, manifest = Outcome(True), None
    if comm.rank == 0:
        assert gathered is not None
        result, manifest = _commit_spread(store, checkpoint, gathered, target, what)
    result = comm.broadcast(result)
    if not result.ok:
        raise StorageError(result.error)
    shared.finish()
    return OfflineWriteResult(manifest if manifest is not None else read_manifest(store), total, result.payload)


def _commit_spread(store: ByteStore, checkpoint: OfflineCheckpoint, gathered: Sequence[Outcome], target: Target,
                   what: str) -> tuple[Outcome, Manifest | None]:
    """Process 0: every process's ranks merged and published, or the failures named and the partial
    output removed. The outcome (broadcast) carries the bytes every process read; the manifest
    stays here (the other processes read the published one)."""
    failed = [(p, o) for p, o in enumerate(gathered) if not o.ok]
    try:
        if failed:
            lines = "; ".join(f"process {p}: {o.error}" for p, o in failed[:4])
            more = f" (and {len(failed) - 4} more processes)" if len(failed) > 4 else ""
            raise StorageError(f"{what} failed: {lines}{more}")
        written = sorted((w for o in gathered for w in o.payload[0]), key=lambda w: w.report.rank)
        merged = _commit(store, checkpoint, written, target.attempt)
    except Exception as exc:  # noqa: BLE001 - broadcast to every process, which raise it
        _remove_partial(store, target.attempt)
        message = str(exc) if isinstance(exc, CkptkitError) else f"{what} failed: {exc}"
        return Outcome(False, error=message, error_type=type(exc).__name__), None
    if target.leftovers:
        _remove_leftovers(store, target.attempt)
    return Outcome(True, sum(o.payload[1] for o in gathered)), merged


def _write_ranks(writer: _RankWriter, ranks: Iterable[int], threads: int) -> list[_WrittenRank]:
    """Persist ``ranks`` (their data objects and indexes), ``threads`` at a time."""
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckptkit-offline") as pool:
        return list(pool.map(writer.write, ranks))


def _commit(store: ByteStore, checkpoint: OfflineCheckpoint, written: Sequence[_WrittenRank], attempt: str) -> Manifest:
    """Merge every rank's report and publish the manifest: the commit. If it raises, nothing is
    committed and the caller removes the attempt's objects; after it returns, never (other attempts'
    leftovers are removed then, outside the caller's clean-up)."""
    merged = _merge(store, checkpoint, written, attempt)
    publish(store, merged.to_json_bytes())
    return merged


def _checkpoint_of(checkpoint: OfflineCheckpoint | None, fields: Mapping[str, Any]) -> OfflineCheckpoint:
    """The checkpoint of either call form: given whole, or built from the first form's keywords."""
    if checkpoint is not None:
        if fields:
            raise TypeError(f"write_offline() got an OfflineCheckpoint and also its fields as keywords: "
                            f"{', '.join(sorted(fields))}")
        return checkpoint
    unknown = sorted(set(fields) - {f.name for f in dataclass_fields(OfflineCheckpoint)})
    if unknown:
        raise TypeError(f"write_offline() got unexpected keyword argument(s): {', '.join(unknown)}")
    missing = [name for name in ("world_size", "tensors", "pieces") if name not in fields]
    if missing:
        raise TypeError(f"write_offline() needs a checkpoint (an OfflineCheckpoint), or {', '.join(missing)} "
                        "as keywords")
    return OfflineCheckpoint(**fields)


def _check_pieces(checkpoint: OfflineCheckpoint, what: str) -> None:
    """Every piece must belong to a rank of the world and to a known tensor, before anything is written."""
    for rank, items in checkpoint.pieces.items():
        if not 0 <= rank < checkpoint.world_size:
            raise LayoutError(f"{what}: pieces for rank {rank} in a world of {checkpoint.world_size}")
        for key, _ in items:
            if key not in checkpoint.tensors:
                raise LayoutError(f"{what}: rank {rank} stores a piece of {key!r}, which is not among the tensors")


@dataclass(frozen=True)
class _WrittenRank:
    """One virtual rank's report for the merge, its logical tensor bytes and the bytes of its data objects."""

    report: RankReport
    tensor_bytes: int
    object_bytes: int


class _RankWriter:
    """Persists virtual ranks (one :meth:`write` per rank, from the pool's threads) and totals the
    bytes their sources read, for the result."""

    def __init__(self, store: ByteStore, checkpoint: OfflineCheckpoint, source: SourceFactory, attempt: str,
                 block_size: int, tick: Callable[[int], None]) -> None:
        self._store, self._checkpoint, self._source = store, checkpoint, source
        self._attempt, self._block_size, self._tick = attempt, block_size, tick
        self._lock = threading.Lock()
        self.bytes_read = 0

    def write(self, rank: int) -> _WrittenRank:
        """Plan ``rank``'s pieces as explicit declarations and persist them with its per-rank values."""
        items = list(self._checkpoint.pieces.get(rank, ()))
        src = self._source(rank, items)
        plan = plan_save(rank, [], _declarations(self._checkpoint.tensors, items))
        own_values = dict((self._checkpoint.per_rank_values or {}).get(rank, {}))
        prep = Prepared(plan, cast(list, src), {}, own_values, tuple(sorted(own_values))).for_attempt(self._attempt)
        try:
            report = persist(prep, self._store, self._block_size, self._tick, getattr(src, "release", None))
        finally:
            self._finish(src)
        return _WrittenRank(report, plan.nbytes, sum(plan.objects.values()))

    def _finish(self, src: PieceSource) -> None:
        """Stop the source's read-ahead (whether or not the rank was written) and count what it read."""
        close = getattr(src, "close", None)
        if close is not None:
            close()
        with self._lock:
            self.bytes_read += src.bytes_read


def _declarations(tensors: Mapping[str, TensorSpec], items: RankPieces) -> list[ExplicitDecl]:
    """One explicit declaration per piece (its index in ``items`` is its ref): explicit pieces need no
    collective to agree on replicas, which a write without a process group could not run."""
    decls = []
    for ref, (key, region) in enumerate(items):
        spec = tensors[key]
        place, local_shape = local_place(region)
        decls.append(ExplicitDecl(ref, spec.dtype, DTYPES[spec.dtype], local_shape,
                                  (Piece(key, tuple(spec.shape), region, place),)))
    return decls


def _merge(store: ByteStore, checkpoint: OfflineCheckpoint, written: Sequence[_WrittenRank],
           attempt: str) -> Manifest:
    """The manifest to publish: the ranks' reports merged and validated exactly as for a live save."""
    manifest_meta: dict[str, Any] = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ckptkit_version": __version__,
        "tensor_bytes": sum(w.tensor_bytes for w in written),
        "stored_bytes": sum(w.object_bytes + w.report.index.size for w in written),
    }
    manifest_meta.update(checkpoint.meta or {})
    merged = merge_reports([w.report for w in written], world_size=checkpoint.world_size,
                           values=dict(checkpoint.values or {}), meta=manifest_meta, parallel=checkpoint.parallel,
                           where=store.url, attempt=attempt, rank_values=dict(checkpoint.rank_values or {}))
    _check_all_stored(merged, checkpoint.tensors, store.url)
    if checkpoint.layouts is not None:
        merged.tensors = dict(checkpoint.layouts)
    return merged


def _check_all_stored(merged: Manifest, tensors: Mapping[str, TensorSpec], where: str) -> None:
    """A tensor without stored pieces is only fine when it has no elements; record those too."""
    for key, spec in tensors.items():
        if key in merged.tensors:
            continue
        if prod(spec.shape):
            raise LayoutError(f"{where}: tensor {key!r} of shape {list(spec.shape)} has no stored pieces")
        merged.tensors[key] = TensorMeta(key, spec.dtype, tuple(spec.shape), ExplicitLayout(()))
    merged.tensors = dict(sorted(merged.tensors.items()))


def _remove_partial(store: ByteStore, attempt: str) -> None:
    """Best effort, never raising over the original error: a failed write leaves nothing of its own."""
    try:
        remove_attempt(store, attempt)
    except (CkptkitError, OSError):
        pass


def _remove_leftovers(store: ByteStore, attempt: str) -> None:
    """Best effort once committed: other attempts' files are garbage, never a damaged checkpoint (gc
    removes them later), so failing to remove them must not fail the write."""
    try:
        remove_other_attempts(store, attempt)
    except (CkptkitError, OSError):
        pass


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
