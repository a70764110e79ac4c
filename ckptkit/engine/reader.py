"""Execute read requests: ranged reads, checksum verification, placement into tensors.

A *direct* request (whole stored pieces landing in contiguous destination
memory, the common same-layout case) is one vectored read straight into the
destination tensors. Others are read into a scratch buffer and scattered with
strided copies. Every byte read is covered by a checksum block and verified
before the request is considered done.
"""

from __future__ import annotations

from collections.abc import Callable
import bisect
import logging
from concurrent.futures import ThreadPoolExecutor

import crc32c
import torch

from ckptkit.engine.buffers import BufferPool
from ckptkit.engine.tensor_bytes import as_bytes, strided, typed_window
from ckptkit.errors import CorruptCheckpointError
from ckptkit.plan.load_plan import ReadRequest
from ckptkit.storage.base import ByteStore

log = logging.getLogger("ckptkit")


def _verify_view(req: ReadRequest, offset: int, data: memoryview, checks: list, where: str) -> None:
    """Check every block in ``checks``; ``data`` holds request bytes from ``offset`` on."""
    for check in checks:
        lo = check.offset - req.offset - offset
        got = crc32c.crc32c(data[lo:lo + check.length])
        if got != check.crc:
            raise CorruptCheckpointError(
                f"{where}: checksum mismatch in {req.object} (written by rank {req.writer}) at bytes "
                f"[{check.offset}, {check.offset + check.length}) of tensor {check.tensor!r}: "
                f"stored crc32c {check.crc:08x}, read {got:08x}"
            )


def _execute_direct(req: ReadRequest, store: ByteStore, targets: list[torch.Tensor], where: str) -> int:
    """Scatter the request's bytes straight into the destination tensors, then verify them there."""
    placed = sorted(req.ops, key=lambda p: p.src_byte)
    buffers: list[memoryview] = []
    views: list[tuple[int, memoryview]] = []
    scratch: memoryview | None = None
    pos = 0
    for p in placed:
        gap = p.src_byte - pos
        if gap:
            if scratch is None or len(scratch) < gap:
                scratch = memoryview(bytearray(max(gap, 4096)))
            buffers.append(scratch[:gap])
        op = p.op
        dest = as_bytes(targets[op.ref].view(-1)[op.dst_start:op.dst_start + op.numel])
        buffers.append(dest)
        views.append((p.src_byte, dest))
        pos = p.src_byte + len(dest)
    store.read_into_vectored(req.object, req.offset, buffers)
    starts = [start for start, _ in views]
    by_view: dict[int, list] = {}
    for check in req.checks:
        rel = check.offset - req.offset
        i = bisect.bisect_right(starts, rel) - 1
        by_view.setdefault(i, []).append(check)
    for i, checks in by_view.items():
        start, view = views[i]
        _verify_view(req, start, view, checks, where)
    return req.length


def execute_request(req: ReadRequest, store: ByteStore, targets: list[torch.Tensor], dtypes: dict[str, torch.dtype],
                    where: str, scratch: BufferPool | None = None) -> int:
    """Read, verify and place one request. A checksum mismatch is read once more before it counts
    as damage (bytes can be corrupted in transit or by a flaky device; declaring a good checkpoint
    damaged would make a restore fall back to an older one), then from the fallback tier if any."""
    try:
        return _execute(req, store, targets, dtypes, where, scratch)
    except CorruptCheckpointError as exc:
        log.warning("%s; reading it again", exc)
        try:
            return _execute(req, store, targets, dtypes, where, scratch)
        except CorruptCheckpointError as again:
            fallback = store.fallback
            if fallback is None:
                raise again from None
            # a tiered store: the local copy failed verification, the bucket's copy may not
            log.warning("%s; reading %s from %s instead", again, req.object, fallback.url)
            return _execute(req, fallback, targets, dtypes, where, scratch)


def _execute(req: ReadRequest, store: ByteStore, targets: list[torch.Tensor], dtypes: dict[str, torch.dtype], where: str,
             scratch: BufferPool | None) -> int:
    if req.direct:
        return _execute_direct(req, store, targets, where)
    if scratch is None:
        return _execute_scattered(req, store, targets, dtypes, where, torch.empty(req.length, dtype=torch.uint8))
    with scratch.take(req.length) as buf:
        return _execute_scattered(req, store, targets, dtypes, where, buf)


def _execute_scattered(req: ReadRequest, store: ByteStore, targets: list[torch.Tensor], dtypes: dict[str, torch.dtype],
                       where: str, buf: torch.Tensor) -> int:
    """Read the request's span into ``buf`` (``req.length`` bytes), verify it, copy the ops out of it."""
    view = as_bytes(buf)
    store.read_into(req.object, req.offset, view)
    _verify_view(req, 0, view, list(req.checks), where)
    place(req, buf, targets, dtypes)
    return req.length


def read_verified(req: ReadRequest, store: ByteStore, where: str) -> torch.Tensor:
    """The request's bytes, every block verified (read again once, then from the fallback tier, as
    :func:`execute_request` does): what a read-once reader sends to the ranks that share the request."""
    def attempt(source: ByteStore) -> torch.Tensor:
        buf = torch.empty(req.length, dtype=torch.uint8)
        view = as_bytes(buf)
        source.read_into(req.object, req.offset, view)
        _verify_view(req, 0, view, list(req.checks), where)
        return buf

    try:
        return attempt(store)
    except CorruptCheckpointError as exc:
        log.warning("%s; reading it again", exc)
        try:
            return attempt(store)
        except CorruptCheckpointError as again:
            if store.fallback is None:
                raise again from None
            log.warning("%s; reading %s from %s instead", again, req.object, store.fallback.url)
            return attempt(store.fallback)


def place(req: ReadRequest, buf: torch.Tensor, targets: list[torch.Tensor], dtypes: dict[str, torch.dtype]) -> None:
    """Copy every op of ``req`` out of ``buf`` (the request's verified bytes) into its target."""
    for placed in req.ops:
        op = placed.op
        lo, hi = op.src_span()
        src = typed_window(buf, placed.src_byte, (hi - lo) * placed.itemsize, dtypes[op.tensor])
        src_view = strided(src, 0, op.shape, op.src_strides)
        dst = strided(targets[op.ref].view(-1), op.dst_start, op.shape, op.dst_strides)
        dst.copy_(src_view)


def execute_reads(
    requests: list[ReadRequest],
    store: ByteStore,
    targets: list[torch.Tensor],
    dtypes: dict[str, torch.dtype],
    where: str,
    threads: int,
    progress: Callable[[int], None] | None = None,
    scratch: BufferPool | None = None,
    done: Callable[[ReadRequest], None] | None = None,
) -> int:
    """Run ``requests`` with up to ``threads`` in flight; return bytes read.

    Requests that are not read straight into their targets go through a
    scratch buffer of their span: taken from ``scratch`` when given (reused,
    bounded), else allocated per request. ``done`` is told of each request
    once it is read, verified and placed, on the thread that did it (a
    load's progress counts placed pieces as they land).
    """
    def one(req: ReadRequest) -> int:
        n = execute_request(req, store, targets, dtypes, where, scratch)
        if done is not None:
            done(req)
        return n

    if threads <= 1 or len(requests) <= 1:
        total = 0
        for req in requests:
            n = one(req)
            total += n
            if progress is not None:
                progress(n)
        return total
    total = 0
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckptkit-read") as pool:
        futures = [pool.submit(one, r) for r in requests]
        for fut in futures:
            n = fut.result()
            total += n
            if progress is not None:
                progress(n)
    return total
