"""A ckptkit checkpoint written as a DCP checkpoint, by one process or spread over a job's processes.

One ``__{r}_0.distcp`` per writer rank ``r`` of the source, holding the boxes that rank stored,
streamed box by box through the checkpoint view (checksum-verified); a flat fragment (ZeRO /
distributed-optimizer state) cannot be a DCP chunk, so it is written as the at most 2N-1 boxes it
decomposes into. Replicated values become DCP byte items in rank 0's file; per-rank values have
no DCP form and are listed as skipped. ``.metadata`` is written last, atomically (put-if-absent):
it is DCP's commit.

**Spread** (``process_group`` of a ``torchrun`` job): every process checks the source and the
destination before any writes (one failure fails all, naming the process); each writes the files of
its share of the ranks (dealt by bytes, the same on every process with no exchange,
:func:`~ckptkit.engine.offline_spread.share_of`); the chunks each wrote are exchanged as JSON;
process 0 writes ``.metadata``. The files are the ones one process writes, byte for byte. A failure
anywhere fails every process and process 0 removes everything written. One progress bar, on
process 0, counts every process's bytes.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ckptkit.engine.offline_writer import ConvertResult
from ckptkit.engine.prefetch import ReadAhead
from ckptkit.errors import CkptkitError, SaveError, StorageError
from ckptkit.layout.box import Box, Region
from ckptkit.layout.manifest import DTYPES, pieces_by_writer
from ckptkit.offline.spread import Dealt, agreed, same_source, spread_comm, write_then_commit
from ckptkit.offline.view import CheckpointView, ViewOptions
from ckptkit.offline.view import open as open_view
from ckptkit.options import Progress
from ckptkit.storage.base import ByteStore
from ckptkit.storage.url import open_store
from ckptkit_converters.common.failures import export_step
from ckptkit_converters.dcp.files import METADATA_NAME, Blob, Chunk, OutItem, OutTensor, build_metadata, data_file, save_blob
from ckptkit_converters.dcp.keys import ObjPath, check_unique, dcp_key, export_path, value_leaves
from ckptkit_converters.dcp.options import DcpExportOptions


@dataclass(frozen=True)
class DcpConvertResult(ConvertResult):
    """A conversion's figures, plus the items left out (non-tensor items an import skipped,
    per-rank values an export cannot express)."""

    skipped: tuple[str, ...] = ()


@dataclass
class _Export:
    """What every process of an export finds the same from the source, before anything is written."""

    view: CheckpointView
    out: ByteStore
    boxes: dict[int, list[tuple[str, Box]]]
    values: list[tuple[str, ObjPath, Any]]
    total: int
    read0: int

    @property
    def what(self) -> str:
        return f"exporting {self.view.url} to DCP at {self.out.url}"

    def rank_bytes(self) -> dict[int, int]:
        tensors = self.view.manifest.tensors
        return {r: sum(b.numel * DTYPES[tensors[k].dtype] for k, b in boxes) for r, boxes in self.boxes.items()}


Written = tuple[list[tuple[str, Chunk]], list[OutItem]]


def export_dcp(
    source: str | os.PathLike[str] | CheckpointView,
    dest: str | os.PathLike[str],
    *,
    options: DcpExportOptions = DcpExportOptions(),
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
    process_group: Any = None,
) -> DcpConvertResult:
    """Write the ckptkit checkpoint ``source`` as a DCP checkpoint at ``dest`` (empty or absent).

    Plain ``torch.distributed.checkpoint.load`` reads the result at any world size. On failure
    everything written is removed (``dest`` was empty). ``process_group``: spread the files over
    its processes (call on every one; see the module docstring); None writes them all here.
    """
    t0 = time.perf_counter()
    comm = spread_comm(process_group)
    exp = agreed(comm, lambda: _prepare(source, dest, options, storage_options))
    same_source(comm, exp.view.url, exp.view.manifest.attempt)
    # like DCP, every rank a file, empty or not
    dealt = Dealt(comm, exp.rank_bytes(), exp.view.manifest.world_size, progress, exp.total, "dcp-export")

    def write(mine: list[int]) -> list[Any]:
        return export_step(lambda: _to_json(_write_files(exp, mine, options, dealt.tick)), StorageError, exp.what)

    def commit(parts: list[Any]) -> None:
        export_step(lambda: _commit(exp, _merged(parts)), StorageError, exp.what)

    write_then_commit(comm, dealt, write, commit, lambda: _discard(exp.out))
    manifest = exp.view.manifest
    return DcpConvertResult(exp.view.url, exp.out.url, "dcp", len(manifest.tensors), exp.total,
                            exp.view.bytes_read - exp.read0, time.perf_counter() - t0, tuple(manifest.per_rank_keys))


def _prepare(source: str | os.PathLike[str] | CheckpointView, dest: str | os.PathLike[str], options: DcpExportOptions,
             storage_options: dict[str, Any] | None) -> _Export:
    view = source if isinstance(source, CheckpointView) else open_view(
        source, storage_options=storage_options, options=ViewOptions(options.io_threads))
    read0 = view.bytes_read
    out = open_store(dest, storage_options)
    if out.list_children():
        raise SaveError(f"{out.url} is not empty; a DCP export writes a new checkpoint (choose another path or remove it)")
    manifest = view.manifest
    values = [(key, path, leaf) for key, value in view.values.items() for path, leaf in value_leaves(key, value)]
    check_unique([(k, dcp_key(export_path(k))) for k in manifest.tensors] + [(k, dcp_key(p)) for k, p, _ in values],
                 view.url)
    total = sum(m.numel * DTYPES[m.dtype] for m in manifest.tensors.values())
    return _Export(view, out, _export_boxes(manifest, pieces_by_writer(manifest)), values, total, read0)


def _write_files(exp: _Export, ranks: Sequence[int], options: DcpExportOptions, tick: Callable[[int], None]) -> Written:
    chunks: list[tuple[str, Chunk]] = []
    items: list[OutItem] = []
    with ThreadPoolExecutor(max_workers=options.threads, thread_name_prefix="ckptkit-dcp-file") as files, \
            ThreadPoolExecutor(max_workers=max(1, options.threads * options.read_ahead),
                               thread_name_prefix="ckptkit-dcp-read") as reads:
        def write_file(rank: int) -> Written:
            return _write_rank_file(exp.view, exp.out, rank, exp.boxes.get(rank, []), exp.values if rank == 0 else [],
                                    reads, options.read_ahead, tick)

        for got_chunks, got_items in files.map(write_file, ranks):
            chunks.extend(got_chunks)
            items.extend(got_items)
    return chunks, items


def _commit(exp: _Export, written: Written) -> None:
    manifest = exp.view.manifest
    chunks: dict[str, list[Chunk]] = {key: [] for key in manifest.tensors}
    for key, chunk in written[0]:
        chunks[key].append(chunk)
    out_tensors = [OutTensor(dcp_key(export_path(k)), export_path(k), m.dtype, m.shape,
                             tuple(sorted(chunks[k], key=lambda c: c.box.offsets)))
                   for k, m in manifest.tensors.items()]
    data = build_metadata(out_tensors, written[1], exp.out.url)
    if not exp.out.put_if_absent(METADATA_NAME, data):  # DCP's commit: written last
        raise SaveError(f"{exp.out.url}: another writer created {METADATA_NAME} during the export")


def _to_json(written: Written) -> list[Any]:
    chunks, items = written
    return [[[k, list(c.box.offsets), list(c.box.sizes), c.blob.file, c.blob.offset, c.blob.length] for k, c in chunks],
            [[i.fqn, list(i.path), i.blob.file, i.blob.offset, i.blob.length] for i in items]]


def _merged(parts: list[Any]) -> Written:
    """Every process's chunks and items, back from JSON (items come from rank 0's file alone; one
    process alone takes the same way, so the two write the same ``.metadata``)."""
    # file names interned: one string per file, as one process's chunks share it (the pickled
    # .metadata then refers to it as one process's does, and is as small)
    chunks = [(k, Chunk(Box(tuple(o), tuple(s)), Blob(sys.intern(f), at, n)))
              for part in parts for k, o, s, f, at, n in part[0]]
    items = [OutItem(q, tuple(p), Blob(sys.intern(f), at, n)) for part in parts for q, p, f, at, n in part[1]]
    return chunks, items


def _export_boxes(manifest: Any, by_writer: dict[int, list[tuple[str, Region]]]) -> dict[int, list[tuple[str, Box]]]:
    """The DCP chunks of each writer rank: its stored boxes; a flat fragment as the boxes it
    decomposes into; a tensor without elements as one empty chunk on rank 0."""
    out: dict[int, list[tuple[str, Box]]] = {}
    for rank, items in by_writer.items():
        for key, region in items:
            for box in ([region.box] if region.flat is None else region.boxes()):
                out.setdefault(rank, []).append((key, box))
    for key, meta in manifest.tensors.items():
        if meta.numel == 0:
            out.setdefault(0, []).append((key, Box.full(meta.shape)))
    return out


def _write_rank_file(view: CheckpointView, out: ByteStore, rank: int, boxes: Sequence[tuple[str, Box]],
                     values: Sequence[tuple[str, ObjPath, Any]], reads: ThreadPoolExecutor, read_ahead: int,
                     tick: Callable[[int], None]) -> Written:
    """Stream one ``__{rank}_0.distcp``: the value items first (as DCP orders them), then each box,
    read through the view while the previous one is written."""
    name = data_file(rank)
    chunks: list[tuple[str, Chunk]] = []
    items: list[OutItem] = []
    pos = [0]

    def blob(data: bytes) -> Blob:
        b = Blob(name, pos[0], len(data))
        pos[0] += len(data)
        return b

    def read(i: int) -> bytes:
        key, box = boxes[i]
        return save_blob(view.read_box(key, box))

    def stream() -> Iterator[bytes]:
        for _, path, leaf in values:
            data = save_blob(leaf)
            items.append(OutItem(dcp_key(path), path, blob(data)))
            yield data
        for i, data in enumerate(ReadAhead(len(boxes), read, reads, read_ahead).in_order()):
            key, box = boxes[i]
            chunks.append((key, Chunk(box, blob(data))))
            yield data
            tick(box.numel * DTYPES[view.manifest.tensors[key].dtype])

    out.write_object(name, stream())
    return chunks, items


def _discard(out: ByteStore) -> None:
    """Remove a failed export (best effort): ``out`` was empty when it began, so all of it is the export's."""
    try:
        out.delete_all()
    except (CkptkitError, OSError):
        pass
