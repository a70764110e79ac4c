"""The snapshot: copy this rank's pieces into a reusable staging buffer.

This is the only part of an asynchronous save that blocks training. The
staging buffer has exactly the layout of the data object the rank will write
(pieces at their planned offsets, zero padding between), so the snapshot is
one ``copy_`` per piece and persisting is one sequential write of the buffer.

The buffer is allocated once per plan and reused by every later save of the
same structure. It is pinned host memory when the tensors live on a GPU (the
device-to-host copies are then asynchronous and ordered on the current
stream), shared memory when a separate writer process persists it, plain
host memory otherwise. Its size is known before the first save and checked
against a budget: a save that does not fit is staged in waves through a
buffer of the budget's size (:mod:`ckptkit.engine.waves`), or, with
``over_budget="error"``, fails with a clear error, never allocating without bound.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ckptkit.engine.state import torch_dtype
from ckptkit.errors import SaveError
from ckptkit.layout.pieces import LocalBox
from ckptkit.plan.save_plan import SavePlan, WriteItem

log = logging.getLogger("ckptkit")


@dataclass
class Staged:
    """A snapshot in a staging buffer, and the event to wait on before its bytes are final."""

    buffer: torch.Tensor
    ready: Any = None  # a torch.cuda.Event when device copies are still in flight

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


class StagingPool:
    """One staging buffer per data object size, reused across saves."""

    def __init__(self, max_bytes: int | None = None, shared: bool = False) -> None:
        self.max_bytes = max_bytes
        self.shared = shared
        self._buffer: torch.Tensor | None = None
        self._destinations: tuple[SavePlan, torch.Tensor, list[torch.Tensor]] | None = None
        self.kind = "host"

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def destinations(self, plan: SavePlan, buf: torch.Tensor) -> list[torch.Tensor]:
        """Every planned piece's place in ``buf`` (:func:`piece_destination`), made once per plan and
        buffer: a snapshot every few steps of the same structure copies into the same views."""
        cached = self._destinations
        if cached is None or cached[0] is not plan or cached[1] is not buf:
            cached = self._destinations = (plan, buf, [piece_destination(item, buf) for item in plan.items])
        return cached[2]

    def release(self) -> None:
        """Drop the buffer: the next snapshot allocates a new one. For a buffer lent to a reader
        that may still be reading it (it stays alive as long as the reader holds views of it)."""
        self._buffer = None
        self._destinations = None  # its views would keep the lent buffer's memory alive

    def over_budget(self, plan: SavePlan) -> bool:
        return self.max_bytes is not None and sum(plan.objects.values()) > self.max_bytes

    def buffer_for(self, plan: SavePlan, on_device: bool) -> torch.Tensor:
        size = sum(plan.objects.values())
        if self.max_bytes is not None and size > self.max_bytes:
            raise SaveError(
                f"rank {plan.rank}: a snapshot needs {size / 2**30:.3f} GiB of staging memory, over the "
                f"configured budget of {self.max_bytes / 2**30:.3f} GiB (AsyncOptions.max_staging_bytes)"
            )
        return self._buffer_of(size, on_device, plan.rank)

    def buffer_of(self, size: int, on_device: bool, rank: int) -> torch.Tensor:
        """A buffer of exactly ``size`` bytes, within the budget (staging in waves asks for its
        slots this way: :mod:`ckptkit.engine.waves`)."""
        if self.max_bytes is not None and size > self.max_bytes:
            raise SaveError(f"rank {rank}: {size} bytes of staging asked for, over the budget of {self.max_bytes}")
        return self._buffer_of(size, on_device, rank)

    def _buffer_of(self, size: int, on_device: bool, rank: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() != size:
            self._buffer = self._destinations = None  # release the old one before allocating the new one
            pin = on_device and torch.cuda.is_available() and not self.shared
            if self.shared:
                # fresh shared pages are already zero (padding stays zero): no fill, no copy
                buf = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(size))
            else:
                buf = torch.zeros(size, dtype=torch.uint8, pin_memory=pin)
            self.kind = "pinned" if pin else ("shared" if self.shared else "host")
            log.info("ckptkit staging pool on rank %d: %.3f GiB of %s memory", rank, size / 2**30, self.kind)
            self._buffer = buf
        return self._buffer


def snapshot(plan: SavePlan, tensors: list[torch.Tensor], pool: StagingPool) -> Staged:
    """Copy every piece this rank writes into the pool's buffer at its planned offset."""
    on_device = any(t.device.type != "cpu" for t in tensors)
    buf = pool.buffer_for(plan, on_device)
    with torch.no_grad():
        for item, dst in zip(plan.items, pool.destinations(plan, buf)):
            src = piece_source(item, tensors[item.ref])
            dst.copy_(src, non_blocking=src.device.type == "cuda")
    ready = None
    if on_device and torch.cuda.is_available():
        ready = torch.cuda.Event()
        ready.record()
    return Staged(buf, ready)


def piece_pair(item: WriteItem, local: torch.Tensor, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, destination) of one planned piece: its part of ``local``, and its place in the
    staging buffer ``buf``, shaped alike so that one ``copy_`` stages it."""
    return piece_source(item, local), piece_destination(item, buf)


def piece_destination(item: WriteItem, buf: torch.Tensor) -> torch.Tensor:
    """A planned piece's place in the staging buffer ``buf``, shaped as its source."""
    dst = buf[item.offset:item.offset + item.nbytes].view(torch_dtype(item.dtype))
    return dst.view(item.region.box.sizes) if isinstance(item.local, LocalBox) else dst


def piece_source(item: WriteItem, local: torch.Tensor) -> torch.Tensor:
    """A planned piece's part of ``local``: a box of it, or a run of its flattened elements. A box
    that is all of ``local`` is ``local`` itself (no view to make)."""
    if isinstance(item.local, LocalBox):
        sizes = item.region.box.sizes
        if not any(item.local.offsets) and tuple(local.shape) == tuple(sizes):
            return local
        index = tuple(slice(o, o + s) for o, s in zip(item.local.offsets, sizes))
        return local[index] if index else local
    flat = local.reshape(-1) if local.is_contiguous() else local.contiguous().reshape(-1)
    return flat[item.local.start:item.local.start + item.region.numel]


def staged_views(plan: SavePlan, tensors: list[torch.Tensor], buffer: torch.Tensor) -> list[torch.Tensor | None]:
    """Per tensor of ``tensors``: a view of its staged copy in ``buffer``, when one planned piece holds
    the whole tensor (always so for a one-rank save of plain tensors), else None.

    The memory tier lends these to a persistent save of the same step, which then persists from
    them instead of copying the state a second time."""
    items: dict[int, list] = {}
    for item in plan.items:
        items.setdefault(item.ref, []).append(item)
    out: list[torch.Tensor | None] = []
    for ref, t in enumerate(tensors):
        mine = items.get(ref, [])
        whole = len(mine) == 1 and mine[0].nbytes == t.numel() * t.element_size() and t.numel() > 0
        if not whole:
            out.append(None)
            continue
        item = mine[0]
        out.append(buffer[item.offset:item.offset + item.nbytes].view(torch_dtype(item.dtype)).view(t.shape))
    return out
