"""Staging in waves: a snapshot larger than the staging budget, through a bounded, reused buffer.

``AsyncOptions(max_staging_bytes=B, over_budget="waves")``. A rank whose data object is larger
than ``B`` does not get a buffer of the object's size. Its staging buffer holds ``SLOTS`` windows
of the object (``W`` bytes each, ``SLOTS * W <= B``), allocated once and reused. The training
thread copies window 0, 1, ... of the object into the slots in turn, and the writer streams each
filled slot into the *one* data object as it would stream a one-shot snapshot — so the object,
its index and the manifest are byte for byte those of a one-shot save, and a piece that is larger
than the whole budget is simply split across windows by byte range (the writer appends to the
object it is streaming; nothing needs a second object or a new layout).

Why this is safe — a window's slot is overwritten only after the writer released it, and the
writer releases a slot only when both

* the store is done with its bytes: stores that :attr:`~ckptkit.storage.base.ByteStore.streams_writes`
  have written or copied a chunk once they ask for the next one (waves refuse other stores), and
* the checksums of its bytes are computed (on the writer's helper thread, in window order).

The training thread returns once the last window is copied, never earlier: until then the state's
tensors are still being read, so the caller must not change them before ``save`` returns (the
same contract as a one-shot snapshot; the last windows then persist in the background).

The hand-off is two counting semaphores (windows filled, windows freed) and an abort event, the
threading kind for the thread executor and the multiprocessing kind (inherited by the writer
process when it starts) for the process executor. Either side that fails sets the abort event,
which wakes the other: a failed producer makes the writer's chunk iterator raise inside
``write_object`` (the save then fails and is cleaned up like any failed persist; nothing is
committed), a failed writer stops the producer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ckptkit.engine.block_crc import BlockCrcs
from ckptkit.engine.state import torch_dtype
from ckptkit.engine.tensor_bytes import as_bytes
from ckptkit.errors import SaveError
from ckptkit.layout.index import IndexEntry
from ckptkit.layout.pieces import LocalBox
from ckptkit.plan.save_plan import SavePlan, WriteItem
from ckptkit.storage.base import ByteStore

#: windows in the buffer: two, so copying one overlaps writing the other
SLOTS = 2
#: window sizes are multiples of this (every item offset is 64-byte aligned, so a window edge never
#: splits an element)
WINDOW_ALIGN = 4096
#: the smallest budget waves accept: one aligned window per slot
MIN_WAVES_BUDGET = SLOTS * WINDOW_ALIGN
_CHUNK = 64 << 20
_POLL = 0.05


class WavesAborted(SaveError):
    """The other side of a wave hand-off failed (its own error is reported by the save)."""


@dataclass(frozen=True)
class WaveSchedule:
    """Windows of a data object of ``size`` bytes through ``SLOTS`` slots of ``window`` bytes."""

    size: int
    window: int

    @classmethod
    def for_budget(cls, size: int, budget: int) -> WaveSchedule:
        window = budget // SLOTS // WINDOW_ALIGN * WINDOW_ALIGN
        if window <= 0:
            raise SaveError(f"staging in waves needs max_staging_bytes >= {MIN_WAVES_BUDGET}, got {budget}")
        return cls(size, window)

    @property
    def count(self) -> int:
        return max(1, -(-self.size // self.window))

    @property
    def buffer_bytes(self) -> int:
        return min(SLOTS, self.count) * self.window

    def span(self, j: int) -> tuple[int, int, int]:
        """Window ``j``: its object bytes ``[start, end)`` and where its slot starts in the buffer."""
        start = j * self.window
        return start, min(start + self.window, self.size), (j % SLOTS) * self.window


class WaveChannel:
    """The hand-off between the producer (training thread) and the writer; see the module."""

    def __init__(self, filled: Any, freed: Any, abort: Any) -> None:
        self._filled, self._freed, self._abort = filled, freed, abort

    @classmethod
    def for_threads(cls) -> WaveChannel:
        return cls(threading.Semaphore(0), threading.Semaphore(0), threading.Event())

    @classmethod
    def for_processes(cls, ctx: Any) -> WaveChannel:
        """Made before the writer process starts, which inherits it (the only way to share these)."""
        return cls(ctx.Semaphore(0), ctx.Semaphore(0), ctx.Event())

    def reset(self) -> None:
        """Before a save, while neither side runs: forget what an aborted save left."""
        self._abort.clear()
        for sem in (self._filled, self._freed):
            while sem.acquire(False):
                pass

    def abort(self) -> None:
        self._abort.set()

    @property
    def aborted(self) -> bool:
        return self._abort.is_set()

    def _take(self, sem: Any, waiting_for: str, alive: Callable[[], bool] | None) -> None:
        while True:
            if self._abort.is_set():
                raise WavesAborted(f"staging in waves was abandoned while waiting for {waiting_for}")
            if sem.acquire(True, _POLL):
                return
            if alive is not None and not alive():
                raise SaveError(f"staging in waves: the writer died while the trainer waited for {waiting_for}")

    # producer side
    def wait_free(self, j: int, alive: Callable[[], bool] | None = None) -> None:
        if j >= SLOTS:  # the slot's previous window must be written and checksummed
            self._take(self._freed, "the writer to free a staging slot", alive)

    def filled(self) -> None:
        self._filled.release()

    # writer side
    def wait_filled(self) -> None:
        self._take(self._filled, "the trainer to stage the next window", None)

    def freed(self) -> None:
        self._freed.release()


# ----------------------------------------------------------------- the producer (training thread)

def copy_elements(dst: torch.Tensor, src: torch.Tensor, e0: int, e1: int) -> None:
    """Copy elements ``[e0, e1)`` of ``src`` in row-major order into the 1-D ``dst`` — without ever
    materializing ``src`` whole (it may be a strided view far larger than the window)."""
    if e1 <= e0:
        return
    nb = src.device.type == "cuda"
    if src.dim() == 0:
        dst.copy_(src.reshape(1), non_blocking=nb)
        return
    if src.is_contiguous() or src.dim() == 1:
        dst.copy_(src.reshape(-1)[e0:e1] if src.is_contiguous() else src[e0:e1], non_blocking=nb)
        return
    row = src[0].numel()
    i0, off0 = divmod(e0, row)
    i1, off1 = divmod(e1, row)
    if i0 == i1:
        copy_elements(dst, src[i0], off0, off1)
        return
    pos = 0
    if off0:
        copy_elements(dst[:row - off0], src[i0], off0, row)
        pos, i0 = row - off0, i0 + 1
    if i1 > i0:
        whole = src[i0:i1]
        dst[pos:pos + whole.numel()].view(whole.shape).copy_(whole, non_blocking=nb)
        pos += whole.numel()
    if off1:
        copy_elements(dst[pos:], src[i1], 0, off1)


def _copy_item_bytes(slot: torch.Tensor, item: WriteItem, local: torch.Tensor, lo: int, hi: int) -> None:
    """Bytes ``[lo, hi)`` of ``item``'s piece (relative to the piece) into ``slot`` (exactly that long)."""
    dtype = torch_dtype(item.dtype)
    size = dtype.itemsize
    if lo % size or hi % size:
        raise AssertionError(f"tensor {item.tensor!r}: a wave edge splits an element ({lo}, {hi})")
    dst = slot.view(dtype)
    if isinstance(item.local, LocalBox):
        index = tuple(slice(o, o + s) for o, s in zip(item.local.offsets, item.region.box.sizes))
        copy_elements(dst, local[index] if index else local, lo // size, hi // size)
    else:
        start = item.local.start
        copy_elements(dst, local, start + lo // size, start + hi // size)


def stage_in_waves(plan: SavePlan, tensors: list[torch.Tensor], buffer: torch.Tensor, schedule: WaveSchedule,
                   channel: WaveChannel, alive: Callable[[], bool] | None = None) -> None:
    """Copy the data object window by window into ``buffer``'s slots, each after the writer freed
    it; return once the last window is copied. Zero padding is written where no piece lies (slots
    are reused, so they hold the previous window's bytes)."""
    items = sorted((i for i in plan.items if i.nbytes), key=lambda i: i.offset)
    on_device = any(t.device.type == "cuda" for t in tensors)
    first = 0
    with torch.no_grad():
        for j in range(schedule.count):
            channel.wait_free(j, alive)
            start, end, base = schedule.span(j)
            slot = buffer[base:base + end - start]
            pos = start
            k = first
            while k < len(items) and items[k].offset < end:
                item = items[k]
                lo, hi = max(start, item.offset), min(end, item.offset + item.nbytes)
                if lo > pos:
                    slot[pos - start:lo - start].zero_()
                _copy_item_bytes(slot[lo - start:hi - start], item, tensors[item.ref], lo - item.offset,
                                 hi - item.offset)
                pos = hi
                k += 1
            if pos < end:
                slot[pos - start:].zero_()
            while first < len(items) and items[first].offset + items[first].nbytes <= end:
                first += 1
            if on_device and torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()  # the writer reads host memory
            channel.filled()


# ----------------------------------------------------------------------------- the writer

class ItemCrcs:
    """Per item, the CRC32C of every checksum block, fed the object's bytes in order (a block may
    straddle two windows: its CRC is continued, not restarted)."""

    def __init__(self, items: tuple[WriteItem, ...], block: int) -> None:
        self.block = block
        self.items = sorted(range(len(items)), key=lambda i: items[i].offset)
        self.spans = items
        self.crcs = [BlockCrcs(block) for _ in items]
        self.first = 0

    def feed(self, start: int, data: memoryview) -> None:
        end = start + len(data)
        k = self.first
        while k < len(self.items) and self.spans[self.items[k]].offset < end:
            i = self.items[k]
            item = self.spans[i]
            lo, hi = max(start, item.offset), min(end, item.offset + item.nbytes)
            if hi > lo:
                self.crcs[i].update(data[lo - start:hi - start])
            k += 1
        while self.first < len(self.items) and self._end(self.items[self.first]) <= end:
            self.first += 1

    def _end(self, i: int) -> int:
        return self.spans[i].offset + self.spans[i].nbytes

    def entries(self) -> list[IndexEntry]:
        """In ``plan.items`` order, like :func:`~ckptkit.engine.writer.write_staged`."""
        out = []
        for i, item in enumerate(self.spans):
            out.append(IndexEntry(item.tensor, item.region, item.object, item.offset, item.nbytes, self.crcs[i].crcs()))
        return out


def write_waves(store: ByteStore, plan: SavePlan, buffer: torch.Tensor, block: int, schedule: WaveSchedule,
                channel: WaveChannel) -> list[IndexEntry]:
    """Stream the data object from the slots the producer fills; free each once written and
    checksummed. Any failure aborts the channel, so the producer never waits for a dead writer."""
    try:
        if not store.streams_writes:
            raise SaveError(f"{store.url}: staging in waves needs a store that streams writes (this one holds "
                            "every chunk until the object is written); raise AsyncOptions.max_staging_bytes or "
                            "use over_budget='error'")
        (obj,) = plan.objects
        data = as_bytes(buffer)
        crcs = ItemCrcs(plan.items, block)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptkit-crc") as crc_pool:

            def chunks() -> Iterator[memoryview]:
                for j in range(schedule.count):
                    channel.wait_filled()
                    start, end, base = schedule.span(j)
                    view = data[base:base + end - start]
                    crc = crc_pool.submit(crcs.feed, start, view)
                    for c in range(0, end - start, _CHUNK):
                        yield view[c:c + _CHUNK]
                    crc.result()  # the store asked for more: it is done with the slot; so is the CRC
                    channel.freed()

            store.write_object(obj, chunks())
        return crcs.entries()
    except BaseException:
        channel.abort()
        raise
