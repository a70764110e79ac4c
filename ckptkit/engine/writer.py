"""Persist one rank's pieces: one sequential write per data object, checksums on the fly.

Pieces go out in offset order straight from tensor memory (zero-copy for
contiguous CPU pieces), with zero padding for alignment, and the CRC32C of
every checksum block is computed from the same buffer as it is written,
never by reading the file back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ckptkit.engine.block_crc import block_crcs
from ckptkit.engine.tensor_bytes import as_bytes, piece_tensor
from ckptkit.layout.index import IndexEntry
from ckptkit.plan.save_plan import SavePlan, WriteItem
from ckptkit.storage.base import ByteStore

_ZEROS = bytes(4096)

# Supplies the tensor an item's bytes come from: the live local tensor for a
# synchronous save, its staged snapshot for an asynchronous one.
TensorFor = Callable[[WriteItem], torch.Tensor]

# Told when an item's bytes are no longer needed: written to the store and checksummed (a
# streaming source then reuses the buffer they were in).
Release = Callable[[WriteItem], None]


# Checksum tasks take consecutive pieces together up to this many bytes (a piece this size or more
# is a task of its own): a rank of thousands of small tensors then queues tens of tasks, not
# thousands (see write_staged_spans). Not when pieces are released as they are done: a source that
# hands out its next piece only once an earlier one is released would wait for a batch that waits
# for it.
CRC_BATCH_BYTES = 8 << 20


class _CrcBatches:
    """Pieces' bytes handed to the checksum thread a batch at a time, in order, as they are handed to
    the store (a batch is checksummed while its last piece is written); each piece's CRCs, and its
    release once the store has taken it and it is checksummed."""

    def __init__(self, pool: ThreadPoolExecutor, block: int, release: Release | None) -> None:
        self.pool, self.block, self.release = pool, block, release
        self.limit = 0 if release is not None else CRC_BATCH_BYTES
        self.done: list[tuple[WriteItem, Future[list[tuple[int, ...]]], int]] = []
        self._items: list[WriteItem] = []
        self._data: list[memoryview] = []
        self._bytes = 0

    def add(self, item: WriteItem, data: memoryview) -> None:
        self._items.append(item)
        self._data.append(data)
        self._bytes += len(data)
        if self._bytes >= self.limit:
            self.flush()

    def flush(self) -> None:
        if not self._items:
            return
        items, data = self._items, self._data
        future = self.pool.submit(lambda: [block_crcs(d, self.block) for d in data])
        self.done += [(item, future, k) for k, item in enumerate(items)]
        self._items, self._data, self._bytes = [], [], 0

    def written(self, item: WriteItem) -> None:
        """The store has taken ``item``'s bytes (it asked for the next chunk): released once checksummed.
        With a release every piece is a batch of its own, submitted when it was added."""
        if self.release is not None:
            release, (last, future, _) = self.release, self.done[-1]
            assert last is item
            future.add_done_callback(lambda _f: release(item))


def write_pieces(
    store: ByteStore,
    plan: SavePlan,
    tensor_for: TensorFor,
    block: int,
    progress: Callable[[int], None] | None = None,
    release: Release | None = None,
) -> list[IndexEntry]:
    """Write every object of ``plan`` and return the index entries of its pieces.

    Checksums run on a helper thread while the same bytes are being written
    (crc32c releases the GIL), so they cost almost nothing on top of the write;
    consecutive small pieces are checksummed as one task (:data:`CRC_BATCH_BYTES`) unless
    released as they are done.
    ``release(item)``, when given, is called once the item's bytes are both
    written and checksummed (from the checksum thread or this one): once its
    batch is checksummed and the store has asked for the chunk after it, if it
    :attr:`~ByteStore.streams_writes` (each piece a batch of its own then), else once the whole
    object is written.
    """
    entries: list[IndexEntry] = []
    streaming = store.streams_writes
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptkit-crc") as crc_pool:
        for obj in plan.objects:
            items = sorted((i for i in plan.items if i.object == obj), key=lambda i: i.offset)
            batches = _CrcBatches(crc_pool, block, release if streaming else None)

            def chunks(items: list[WriteItem] = items, batches: _CrcBatches = batches) -> Iterator[memoryview | bytes]:
                pos = 0
                for item in items:
                    while pos < item.offset:
                        pad = min(len(_ZEROS), item.offset - pos)
                        yield _ZEROS[:pad]
                        pos += pad
                    data = as_bytes(piece_tensor(tensor_for(item), item.region, item.local))
                    if len(data) != item.nbytes:
                        raise AssertionError(f"tensor {item.tensor!r}: piece has {len(data)} bytes, plan says {item.nbytes}")
                    batches.add(item, data)
                    yield data
                    batches.written(item)
                    pos += item.nbytes
                    if progress is not None:
                        progress(item.nbytes)
                batches.flush()
                while pos < plan.objects[obj]:
                    pad = min(len(_ZEROS), plan.objects[obj] - pos)
                    yield _ZEROS[:pad]
                    pos += pad

            store.write_object(obj, chunks())
            for item, crcs, k in batches.done:
                entries.append(IndexEntry(item.tensor, item.region, item.object, item.offset, item.nbytes, crcs.result()[k]))
                if release is not None and not streaming:  # the store may have held every chunk until now
                    release(item)
    return entries


def write_staged(store: ByteStore, plan: SavePlan, staging: torch.Tensor, block: int) -> list[IndexEntry]:
    """Write a snapshot whose buffer already has the data object's layout; checksum it meanwhile.

    Only valid for plans with a single data object (what :func:`plan_save` produces).
    """
    (obj,) = plan.objects
    spans = [(i.offset, i.nbytes) for i in plan.items]
    crcs = write_staged_spans(store, obj, as_bytes(staging), spans, block)
    return [IndexEntry(i.tensor, i.region, i.object, i.offset, i.nbytes, c) for i, c in zip(plan.items, crcs)]


def write_staged_spans(store: ByteStore, obj: str, data: memoryview, spans: list[tuple[int, int]],
                       block: int) -> list[tuple[int, ...]]:
    """Write ``data`` as the object ``obj``; return the block CRCs of each ``(offset, nbytes)`` span.

    The checksums of every span are one task of the checksum thread, not one each: a rank with
    thousands of tensors otherwise queued thousands of futures, whose allocations set off the
    garbage collector's full collections and whose hand-offs passed the GIL back and forth between
    the two threads, while the training thread waited for it (``benchmarks/bench_launch_stall.py``).
    """
    chunk = 64 << 20
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptkit-crc") as crc_pool:
        crcs = crc_pool.submit(_span_crcs, data, spans, block)
        store.write_object(obj, (data[i:i + chunk] for i in range(0, len(data), chunk)))
        return crcs.result()


def _span_crcs(data: memoryview, spans: list[tuple[int, int]], block: int) -> list[tuple[int, ...]]:
    return [block_crcs(data[offset:offset + nbytes], block) for offset, nbytes in spans]
