"""Checkpoints as zarr v3 groups, written and read through tensorstore.

Tools that speak zarr (xarray, tensorstore, zarr-python, neuroglancer-style
viewers) should be able to read a model without ckptkit. :func:`export_zarr`
writes every logical tensor — model space: global, unpadded, optimizer
moments in the parameter's shape — as one zarr v3 array in one group, at the
tensor's key path (``model/layers.0.weight`` -> array ``model/layers.0.weight``).

*tensorstore* is the writer, never zarr-python: it stores bfloat16 and
float8, and each array is written shard by shard, every write covering whole
shards, so there is no read-modify-write and no lost update between
concurrent writers. zarr-python 3.1 reads every non-bf16/float8 array.

Chunking follows the common read — one stored piece (a TP shard, an FSDP
shard) per inner chunk, the sharding codec packing chunks into objects of
about ``shard_bytes`` so object counts on S3 stay low — and each inner chunk
carries a CRC32C (see :mod:`ckptkit_converters.zarr.layout`).

The group's root attributes (``attributes.ckptkit``, versioned JSON) hold the
checkpoint's manifest without its index list — every tensor's dtype, global
shape, layout (grid rule or explicit pieces, writer ranks), partition rule,
and the replicated values and metadata; per-rank values (RNG states,
``PerRank``) go to the attributes of a child group ``ckptkit-per-rank``. The root's
``zarr.json`` is written last: an export without it did not finish, and
:func:`import_zarr` refuses it.

:func:`import_zarr` writes a normal committed ckptkit checkpoint with the
saver's own machinery (plan, persist with checksums, merge, atomic publish;
see :mod:`ckptkit.engine.offline_writer`, which the DCP import shares):
the same world size, the same pieces written by the same ranks, the same
manifest entries (layouts, rotations, rules), values and per-rank values.
Pieces are read from zarr one at a time (with a little read-ahead), so memory
stays bounded by the largest pieces. tensorstore opens whatever a path names, so
on a local source every file it will open (each array's ``zarr.json``, every
chunk of its grid) is first checked to be a regular file inside the source
folder, and present (:mod:`ckptkit_converters.zarr.nodes`); arrays are read
with ``fill_missing_data_reads`` off, so a missing chunk is never read as the
fill value.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ckptkit.options import Progress
from ckptkit.engine.offline_writer import ConvertResult, OfflineCheckpoint, OfflineWriteOptions, write_offline
from ckptkit.engine.prefetch import ReadAhead
from ckptkit.errors import (
    CheckpointNotFoundError,
    CkptkitError,
    CorruptCheckpointError,
    DTypeMismatchError,
    LayoutError,
    SaveError,
    ShapeMismatchError,
    StorageError,
)
from ckptkit.layout.box import Box, Region
from ckptkit.layout.manifest import DTYPES, Manifest, TensorMeta, pieces_by_writer
from ckptkit.offline.view import CheckpointView, ViewOptions
from ckptkit.offline.view import open as open_view
from ckptkit.offline.spread import Dealt, agreed, same_source, spread_comm, write_then_commit
from ckptkit_converters.common.failures import export_step
from ckptkit_converters.zarr.layout import (
    ATTRIBUTE,
    FORMAT,
    GROUP_METADATA,
    PER_RANK_GROUP,
    VERSION,
    ExportInfo,
    choose_chunking,
    from_stored,
    group_json,
    node_path,
    read_export,
    root_attributes,
    shard_boxes,
    stored_boxes,
    stored_dtype,
    to_stored,
)
from ckptkit_converters.zarr.nodes import check_chunk_files, check_node_metadata, local_store
from ckptkit_converters.zarr.options import ZarrExportOptions, ZarrImportOptions
from ckptkit.storage.base import ByteStore
from ckptkit.storage.url import open_store

__all__ = [
    "ZarrExportOptions",  # defined in ckptkit_converters.zarr.options; importable from here as before
    "ZarrImportOptions",
    "array_spec",
    "export_zarr",
    "import_zarr",
    "is_zarr_export",
]


# ---------------------------------------------------------------- tensorstore plumbing


def _tensorstore() -> Any:
    try:
        import tensorstore as ts
    except ImportError:
        raise CkptkitError("zarr export and import need tensorstore: pip install 'ckptkit[tensorstore]'") from None
    return ts


def _kvstore_spec(store: ByteStore) -> dict[str, Any]:
    from ckptkit.storage.tensorstore_kv import TensorstoreStore, kvstore_spec

    return kvstore_spec(store.base if isinstance(store, TensorstoreStore) else store)


def _under(kv: dict[str, Any], path: str) -> dict[str, Any]:
    return {**kv, "path": kv.get("path", "") + path.rstrip("/") + "/"}


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


def array_spec(kv: dict[str, Any], path: str, meta: TensorMeta, stored: str, chunk: tuple[int, ...],
               shard: tuple[int, ...], options: ZarrExportOptions, *, create: bool = True) -> dict[str, Any]:
    """The tensorstore spec creating one zarr v3 array (sharded when a shard holds several chunks), or
    (``create=False``) opening the one created so, its metadata checked against this."""
    codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if options.compression == "zstd":
        codecs.append({"name": "zstd", "configuration": {"level": 3, "checksum": False}})
    if options.checksum:
        codecs.append({"name": "crc32c"})
    grid = chunk
    if shard != chunk:
        grid = shard
        codecs = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": list(chunk), "codecs": codecs, "index_location": "end",
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        }}]
    attrs = {ATTRIBUTE: {"key": meta.key, "dtype": meta.dtype, "shape": list(meta.shape), "stored_dtype": stored}}
    return {
        "driver": "zarr3",
        "kvstore": _under(kv, path),
        "metadata": {
            "shape": list(meta.shape), "data_type": stored, "codecs": codecs, "attributes": attrs,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(grid)}},
            "chunk_key_encoding": {"name": "default"},
        },
        # a chunk equal to the fill value is written anyway: -0.0 and NaN payloads stay bit-exact
        "store_data_equal_to_fill_value": True,
        **({"create": True} if create else {"open": True}),
    }


# ---------------------------------------------------------------- export


def export_zarr(
    source: str | os.PathLike[str] | CheckpointView,
    dest: str | os.PathLike[str],
    *,
    options: ZarrExportOptions = ZarrExportOptions(),
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
    process_group: Any = None,
) -> ConvertResult:
    """Write every logical tensor of the checkpoint ``source`` as a zarr v3 array in a new group at ``dest``.

    ``dest`` (local path or ``s3://`` URL) must be empty or absent. Reads go
    through the lazy view (only each shard's bytes, checksum-verified).
    ``process_group`` (a ``torchrun`` job's; call on every process with the same arguments): process 0
    creates the groups and arrays, the shards are dealt to the processes by bytes and each writes its
    own, and process 0 writes the root group's attributes last (the export's commit); a failure anywhere
    fails every process and removes the group. The files are the one-process export's, byte for byte.
    """
    t0 = time.perf_counter()
    comm = spread_comm(process_group)
    job = agreed(comm, lambda: _prepare(source, dest, options, storage_options))
    same_source(comm, job.view.url, job.view.manifest.attempt)
    first = comm is None or comm.rank == 0
    try:
        agreed(comm, lambda: job.create(options) if first else None)  # the arrays exist before any shard
    except BaseException:
        if first:
            _discard(job.out)
        raise
    sizes = {i: box.numel * DTYPES[meta.dtype] for i, (meta, _, box) in enumerate(job.units)}
    dealt = Dealt(comm, sizes, len(job.units), progress, job.total, "zarr-export")
    write_then_commit(comm, dealt, lambda mine: job.write(mine, options, dealt.tick),
                      lambda _: job.commit(options), lambda: _discard(job.out))
    manifest = job.view.manifest
    return ConvertResult(job.view.url, job.out.url, "zarr", len(manifest.tensors), job.total,
                         job.view.bytes_read - job.read0, time.perf_counter() - t0)


@dataclass
class _ZarrExport:
    """What every process of a zarr export knows before anything is written: the source view, the
    destination, each tensor's array path and chunking, and the shard boxes (the units of work,
    largest first)."""

    view: CheckpointView
    out: ByteStore
    paths: dict[str, str]
    plans: list[tuple[TensorMeta, str, tuple[int, ...], tuple[int, ...]]]
    units: list[tuple[TensorMeta, str, Box]]
    total: int
    read0: int

    @property
    def what(self) -> str:
        return f"exporting {self.view.url} to {self.out.url} through tensorstore"

    def _kvs(self) -> Any:
        return _tensorstore().KvStore.open(_kvstore_spec(self.out)).result()

    def _arrays(self, options: ZarrExportOptions, create: bool) -> dict[str, Any]:
        ts = _tensorstore()
        kv, context = _kvstore_spec(self.out), ts.Context()
        opened = [ts.open(array_spec(kv, self.paths[m.key], m, stored, chunk, shard, options, create=create),
                          context=context) for m, stored, chunk, shard in self.plans]
        return {p[0].key: f.result() for p, f in zip(self.plans, opened)}

    def create(self, options: ZarrExportOptions) -> None:
        """Every group's and array's metadata (process 0, before any shard is written)."""
        def run() -> None:
            kvs = self._kvs()
            groups = {"/".join(p.split("/")[:i]) for p in self.paths.values() for i in range(1, p.count("/") + 1)}
            for group in sorted(groups):
                kvs.write(f"{group}/{GROUP_METADATA}", group_json()).result()
            self._arrays(options, create=True)
        export_step(run, StorageError, self.what)

    def write(self, mine: list[int], options: ZarrExportOptions, tick: Callable[[int], None]) -> None:
        """The shards numbered ``mine``: each read through the view and written whole, ``threads`` at a time."""
        def run() -> None:
            arrays = self._arrays(options, create=False)

            def write(i: int) -> None:
                meta, stored, box = self.units[i]
                host = to_stored(self.view.read_box(meta.key, box), meta.dtype, stored)
                arrays[meta.key][_slices(box)].write(host).result()
                tick(box.numel * DTYPES[meta.dtype])

            with ThreadPoolExecutor(max_workers=options.threads, thread_name_prefix="ckptkit-zarr") as pool:
                list(pool.map(write, mine))
        export_step(run, StorageError, self.what)

    def commit(self, options: ZarrExportOptions) -> None:
        """The per-rank values' group, then the root group's attributes: last, the export is complete."""
        def run() -> None:
            kvs, view, manifest = self._kvs(), self.view, self.view.manifest
            per_rank = {r: v for r, v in view.all_per_rank_values().items() if v} if manifest.per_rank_keys else {}
            if per_rank:
                doc = {"format": f"{FORMAT}-per-rank", "version": VERSION,
                       "ranks": {str(r): v for r, v in sorted(per_rank.items())}}
                kvs.write(f"{PER_RANK_GROUP}/{GROUP_METADATA}", group_json({ATTRIBUTE: doc})).result()
            chunking = {"chunk_bytes": options.chunk_bytes, "shard_bytes": options.shard_bytes,
                        "compression": options.compression, "portable": options.portable}
            attrs = root_attributes(view.url, manifest, self.paths, {m.key: s for m, s, _, _ in self.plans},
                                    bool(per_rank), chunking)
            kvs.write(GROUP_METADATA, group_json({ATTRIBUTE: attrs})).result()
        export_step(run, StorageError, self.what)


def _prepare(source: str | os.PathLike[str] | CheckpointView, dest: str | os.PathLike[str],
             options: ZarrExportOptions, storage_options: dict[str, Any] | None) -> _ZarrExport:
    view = source if isinstance(source, CheckpointView) else open_view(
        source, storage_options=storage_options, options=ViewOptions(options.io_threads))
    read0 = view.bytes_read
    out = open_store(dest, storage_options)
    if out.list_children():
        raise SaveError(f"{out.url} is not empty; a zarr export writes a new group (choose another path or remove it)")
    manifest = view.manifest
    paths = {key: node_path(key) for key in manifest.tensors}
    if len(set(paths.values())) != len(paths):
        raise LayoutError(f"{view.url}: two tensor keys map to one zarr path; cannot export")
    plans = []
    for meta in manifest.tensors.values():
        stored = stored_dtype(meta.dtype, options.portable)
        chunk, shard = choose_chunking(meta.shape, DTYPES[stored], stored_boxes(meta), options.chunk_bytes,
                                       options.shard_bytes)
        plans.append((meta, stored, chunk, shard))
    units = [(m, stored, box) for m, stored, _, shard in plans for box in shard_boxes(m.shape, shard)]
    units.sort(key=lambda u: -u[2].numel * DTYPES[u[0].dtype])
    total = sum(m.numel * DTYPES[m.dtype] for m in manifest.tensors.values())
    return _ZarrExport(view, out, paths, plans, units, total, read0)


def _discard(out: ByteStore) -> None:
    """Remove a failed export (best effort): ``out`` was empty when it began, so all of it is the export's."""
    try:
        out.delete_all()
    except (CkptkitError, OSError):
        pass


# ---------------------------------------------------------------- import


def is_zarr_export(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> bool:
    """True if ``url`` holds a zarr group root (``zarr.json``), e.g. one :func:`export_zarr` wrote."""
    return open_store(url, storage_options).exists(GROUP_METADATA)


def import_zarr(
    source: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    options: ZarrImportOptions = ZarrImportOptions(),
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> ConvertResult:
    """Write the export at ``source`` back as a committed ckptkit checkpoint at ``dest``.

    Every array is checked against the recorded dtype and shape before
    anything is written. The result has the source checkpoint's world size,
    layouts and writer ranks, values and per-rank values; ``ckptkit.load``
    reads it at any layout.
    """
    t0 = time.perf_counter()
    ts = _tensorstore()
    src = open_store(source, storage_options)
    export = read_export(src)
    manifest = export.manifest
    arrays = _open_arrays(ts, src, export)
    out = open_store(dest, storage_options)
    orig = manifest.meta
    # read-ahead only: the piece a rank's writer asks for is read in its own thread
    with ThreadPoolExecutor(max_workers=max(1, options.threads * options.read_ahead),
                            thread_name_prefix="ckptkit-zarr-read") as pool:
        checkpoint = OfflineCheckpoint(
            world_size=manifest.world_size,
            tensors=manifest.tensors,
            pieces=pieces_by_writer(manifest),
            values=manifest.values,
            per_rank_values=export.per_rank,
            rank_values=manifest.rank_values,
            meta={"user": orig.get("user", {}),
                  "converted_from": {"url": src.url, "format": "zarr", "created": orig.get("created"),
                                     "ckptkit_version": orig.get("ckptkit_version")}},
            parallel=manifest.parallel,
            # the pieces are declared explicitly; the manifest keeps the source's own entries
            # (grid rules with rotations, partition rules), which describe exactly these pieces
            layouts=manifest.tensors,
        )
        result = write_offline(
            out, checkpoint,
            lambda rank, items: _ZarrPieces(arrays, manifest, export.arrays, items, pool, options.read_ahead,
                                                    src.url),
            options=OfflineWriteOptions(block_size=options.block_size, threads=options.threads),
            progress=progress,
            what=f"importing {src.url} into {out.url}",
        )
    return ConvertResult(src.url, out.url, "ckptkit", len(manifest.tensors), result.nbytes, result.bytes_read,
                         time.perf_counter() - t0)


def _open_arrays(ts: Any, src: ByteStore, export: ExportInfo) -> dict[str, Any]:
    """Open every array (concurrently) and check it against the recorded dtype and shape.

    On a local source every file tensorstore will open is checked first (see
    :mod:`ckptkit_converters.zarr.nodes`): each array's ``zarr.json`` before it is opened, then
    every chunk file of its grid, so a link out of the folder, a FIFO or a missing chunk fails
    here, naming the file, before anything is read or written. Arrays are opened with
    ``fill_missing_data_reads`` off: a chunk gone on S3 (or gone since the check) is a read error,
    never the fill value.
    """
    kv = _kvstore_spec(src)
    local = local_store(src)
    context = ts.Context()
    if local is not None:
        for path, _ in export.arrays.values():
            check_node_metadata(local, path)
    futures = {
        key: ts.open({"driver": "zarr3", "kvstore": _under(kv, path), "open": True, "fill_missing_data_reads": False},
                     read=True, context=context)
        for key, (path, _) in export.arrays.items()
    }
    arrays = {}
    for key, future in futures.items():
        path, stored = export.arrays[key]
        where = f"{src.url}/{path}"
        try:
            arr = future.result()
        except Exception as exc:  # noqa: BLE001 - tensorstore's errors are plain ValueErrors
            raise CheckpointNotFoundError(f"{where}: array of tensor {key!r} cannot be opened: {exc}") from None
        meta = export.manifest.tensors[key]
        if tuple(arr.shape) != meta.shape:
            raise ShapeMismatchError(
                f"{where}: array of tensor {key!r} has shape {list(arr.shape)}, the export records {list(meta.shape)}")
        if arr.dtype.name != stored:
            raise DTypeMismatchError(
                f"{where}: array of tensor {key!r} is {arr.dtype.name}, the export records {stored} (for {meta.dtype})")
        if local is not None:
            check_chunk_files(local, path, key, arr.spec().to_json()["metadata"])
        arrays[key] = arr
    return arrays


class _ZarrPieces:
    """The local tensors of one rank's pieces, read from zarr on demand, in plan order, with read-ahead.

    The :class:`~ckptkit.engine.offline_writer.PieceSource` of one virtual
    rank: the writer asks for piece ``ref`` just before writing it; at most
    ``read_ahead`` later pieces are read meanwhile, on ``pool``, through a
    :class:`~ckptkit.engine.prefetch.ReadAhead` (a piece the writer skips is
    let go at once, not held until the import ends).
    """

    def __init__(self, arrays: dict[str, Any], manifest: Manifest, stored: dict[str, tuple[str, str]],
                 items: Sequence[tuple[str, Region]], pool: ThreadPoolExecutor, read_ahead: int,
                 url: str) -> None:
        self.items = items
        self._url = url
        self._arrays = arrays
        self._manifest = manifest
        self._stored = stored
        self._lock = threading.Lock()
        self._ahead = ReadAhead(len(items), self._load, pool, read_ahead)
        self.bytes_read = 0

    def __len__(self) -> int:
        return len(self.items)

    def _rows(self, ref: int) -> tuple[Box, int]:
        """The box read for a piece: the piece's box, or the whole rows holding a flat fragment."""
        region = self.items[ref][1]
        box = region.box
        if region.flat is None or not box.sizes:
            return box, 0
        row = math.prod(box.sizes[1:])
        r0, r1 = region.flat[0] // row, -(-region.flat[1] // row)
        return Box((box.offsets[0] + r0, *box.offsets[1:]), (r1 - r0, *box.sizes[1:])), r0 * row

    def _load(self, ref: int) -> torch.Tensor:
        key, region = self.items[ref]
        box, first = self._rows(ref)
        try:
            data = self._arrays[key][_slices(box)].read().result()
        except Exception as exc:  # noqa: BLE001 - tensorstore's errors are plain ValueErrors
            # a missing chunk (fill_missing_data_reads is off), a checksum or a decode failure
            raise CorruptCheckpointError(f"{self._url}/{self._stored[key][0]}: reading {list(box.offsets)} + "
                                         f"{list(box.sizes)} of the array of tensor {key!r} failed: {exc}") from None
        with self._lock:
            self.bytes_read += data.nbytes
        t = from_stored(data, self._manifest.tensors[key].dtype, self._stored[key][1])
        if region.flat is None:
            return t
        a, b = region.flat
        return t.reshape(-1)[a - first:b - first]

    def __getitem__(self, ref: int) -> torch.Tensor:
        return self._ahead[ref]

    def close(self) -> None:
        """The rank is written (or failed): read-ahead no one will ask for is dropped."""
        self._ahead.close()
