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
    (crc32c releases the GIL), so they cost almost nothing on top of the write.
    ``release(item)``, when given, is called once the item's bytes are both
    written and checksummed (from the checksum thread or this one): as soon as
    the store has asked for the next chunk if it :attr:`~ByteStore.streams_writes`,
    else once the whole object is written.
    """
    entries: list[IndexEntry] = []
    streaming = store.streams_writes
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptkit-crc") as crc_pool:
        for obj in plan.objects:
            items = sorted((i for i in plan.items if i.object == obj), key=lambda i: i.offset)
            pending: list[tuple[WriteItem, Future[tuple[int, ...]]]] = []

            def chunks(items: list[WriteItem] = items, pending: list = pending) -> Iterator[memoryview | bytes]:
                pos = 0
                for item in items:
                    while pos < item.offset:
                        pad = min(len(_ZEROS), item.offset - pos)
                        yield _ZEROS[:pad]
                        pos += pad
                    data = as_bytes(piece_tensor(tensor_for(item), item.region, item.local))
                    if len(data) != item.nbytes:
                        raise AssertionError(f"tensor {item.tensor!r}: piece has {len(data)} bytes, plan says {item.nbytes}")
                    crc = crc_pool.submit(block_crcs, data, block)
                    pending.append((item, crc))
                    yield data
                    if release is not None and streaming:  # written (the store asked for the next chunk)
                        crc.add_done_callback(lambda _f, item=item: release(item))
                    pos += item.nbytes
                    if progress is not None:
                        progress(item.nbytes)
                while pos < plan.objects[obj]:
                    pad = min(len(_ZEROS), plan.objects[obj] - pos)
                    yield _ZEROS[:pad]
                    pos += pad

            store.write_object(obj, chunks())
            for item, crcs in pending:
                entries.append(IndexEntry(item.tensor, item.region, item.object, item.offset, item.nbytes, crcs.result()))
                if release is not None and not streaming:  # the store may have held every chunk until now
                    release(item)
    return entries


def write_staged(store: ByteStore, plan: SavePlan, staging: torch.Tensor, block: int) -> list[IndexEntry]:
    """Write a snapshot whose buffer already has the data object's layout; checksum it meanwhile.

    Only valid for plans with a single data object (what :func:`plan_save` produces).
    """
    (obj,) = plan.objects
    data = as_bytes(staging)
    chunk = 64 << 20
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptkit-crc") as crc_pool:
        crcs = [
            (item, crc_pool.submit(block_crcs, data[item.offset:item.offset + item.nbytes], block))
            for item in plan.items
        ]
        store.write_object(obj, (data[i:i + chunk] for i in range(0, len(data), chunk)))
        return [IndexEntry(i.tensor, i.region, i.object, i.offset, i.nbytes, f.result()) for i, f in crcs]
