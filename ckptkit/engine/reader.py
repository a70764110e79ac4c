"""Execute read requests: ranged reads, checksum verification, placement into tensors.

A *direct* request (one whole stored piece landing in contiguous
destination memory, the common same-layout case) is read straight into the
destination tensor. Others are read into a scratch buffer and scattered with
strided copies. Every byte read is covered by a checksum block and verified
before the request is considered done.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import crc32c
import torch

from ckptkit.engine.tensor_bytes import as_bytes, strided, typed_window
from ckptkit.errors import CorruptCheckpointError
from ckptkit.plan.load_plan import ReadRequest
from ckptkit.storage.base import ByteStore


def _verify(req: ReadRequest, data: memoryview, where: str) -> None:
    for check in req.checks:
        lo = check.offset - req.offset
        got = crc32c.crc32c(data[lo:lo + check.length])
        if got != check.crc:
            raise CorruptCheckpointError(
                f"{where}: checksum mismatch in {req.object} (written by rank {req.writer}) at bytes "
                f"[{check.offset}, {check.offset + check.length}) of tensor {check.tensor!r}: "
                f"stored crc32c {check.crc:08x}, read {got:08x}"
            )


def execute_request(req: ReadRequest, store: ByteStore, targets: list[torch.Tensor], dtypes: dict[str, torch.dtype], where: str) -> int:
    if req.direct:
        placed = req.ops[0]
        op = placed.op
        dest = targets[op.ref].view(-1)[op.dst_start:op.dst_start + op.numel]
        view = as_bytes(dest)
        store.read_into(req.object, req.offset, view)
        _verify(req, view, where)
        return req.length
    buf = torch.empty(req.length, dtype=torch.uint8)
    view = as_bytes(buf)
    store.read_into(req.object, req.offset, view)
    _verify(req, view, where)
    for placed in req.ops:
        op = placed.op
        lo, hi = op.src_span()
        src = typed_window(buf, placed.src_byte, (hi - lo) * placed.itemsize, dtypes[op.tensor])
        src_view = strided(src, 0, op.shape, op.src_strides)
        dst = strided(targets[op.ref].view(-1), op.dst_start, op.shape, op.dst_strides)
        dst.copy_(src_view)
    return req.length


def execute_reads(
    requests: list[ReadRequest],
    store: ByteStore,
    targets: list[torch.Tensor],
    dtypes: dict[str, torch.dtype],
    where: str,
    threads: int,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Run ``requests`` with up to ``threads`` in flight; return bytes read."""
    if threads <= 1 or len(requests) <= 1:
        total = 0
        for req in requests:
            n = execute_request(req, store, targets, dtypes, where)
            total += n
            if progress is not None:
                progress(n)
        return total
    total = 0
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckptkit-read") as pool:
        futures = [pool.submit(execute_request, r, store, targets, dtypes, where) for r in requests]
        for fut in futures:
            n = fut.result()
            total += n
            if progress is not None:
                progress(n)
    return total
