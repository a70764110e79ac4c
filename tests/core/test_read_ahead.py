"""ReadAhead (ckptkit/engine/prefetch.py): skipped read-ahead is freed, and in-flight reads stay bounded.

Every streaming conversion (reshard, the DCP and zarr imports, the DCP and HF exports) reads through
this one piece, so what it promises about memory is what they promise: results held for later never
exceed ``read_ahead``, and read-ahead of an item the consumer skips is let go at once.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ckptkit.engine.buffers import BufferPool
from ckptkit.engine.prefetch import PrefetchedPieces, ReadAhead


class Fetched:
    """A fetched result whose lifetime the test can watch (a weak reference)."""

    def __init__(self, index: int) -> None:
        self.index = index


class Recorder:
    """A fetch function that records every call, its live results, and how many calls run at once."""

    def __init__(self, delay: float = 0.0, gate: dict[int, threading.Event] | None = None) -> None:
        self.delay = delay
        self.gate = gate or {}
        self.calls: list[int] = []
        self.finished: dict[int, threading.Event] = {}
        self.alive: dict[int, weakref.ref[Fetched]] = {}
        self.now = 0
        self.most = 0
        self.most_on_pool = 0
        self.on_pool = 0
        self.lock = threading.Lock()
        self.consumer = threading.get_ident()

    def __call__(self, index: int) -> Fetched:
        pooled = threading.get_ident() != self.consumer
        with self.lock:
            self.calls.append(index)
            self.finished.setdefault(index, threading.Event())
            self.now += 1
            self.on_pool += pooled
            self.most = max(self.most, self.now)
            self.most_on_pool = max(self.most_on_pool, self.on_pool)
        try:
            if index in self.gate:
                assert self.gate[index].wait(10)
            time.sleep(self.delay)
            out = Fetched(index)
            self.alive[index] = weakref.ref(out)
            return out
        finally:
            with self.lock:
                self.now -= 1
                self.on_pool -= pooled
                self.finished[index].set()

    def wait_finished(self, *indices: int) -> None:
        for i in indices:
            deadline = time.monotonic() + 10
            while i not in self.finished and time.monotonic() < deadline:
                time.sleep(0.001)
            assert self.finished[i].wait(10), f"fetch {i} never finished"

    def live(self, collect: bool = True) -> set[int]:
        if collect:
            gc.collect()
        return {i for i, ref in self.alive.items() if ref() is not None}

    def settles_to(self, expected: set[int]) -> set[int]:
        """The live results once a fetch that has just returned is done with (its future set): ``expected``
        within a few seconds, or what is still alive then."""
        deadline = time.monotonic() + 5
        while self.live(collect=False) != expected and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.live()


def test_skipped_read_ahead_is_freed_not_held_until_the_end() -> None:
    fetch = Recorder()
    with ThreadPoolExecutor(max_workers=4) as pool:
        ahead = ReadAhead(10, fetch, pool, read_ahead=3)
        first = ahead[0]
        fetch.wait_finished(1, 2, 3)
        assert fetch.live() == {0, 1, 2, 3}  # read ahead, held for the consumer
        # the fetches returned, but their futures' done callbacks (which tell the read-ahead they are over)
        # may not have run yet: until they have, 1-3 still count against read_ahead and asking for 4
        # starts fewer than 3 fetches (seen once on a loaded machine)
        deadline = time.monotonic() + 10
        while ahead.running and time.monotonic() < deadline:
            time.sleep(0.001)
        assert ahead.running == 0
        del first
        got = ahead[4]  # 1, 2 and 3 are skipped: no one will ask for them
        assert got.index == 4
        fetch.wait_finished(5, 6, 7)
        assert fetch.settles_to({4, 5, 6, 7}) == {4, 5, 6, 7}, "the skipped read-ahead (1, 2, 3) must be freed"
        del got
        ahead.close()
        assert fetch.settles_to(set()) == set()


def test_queued_skipped_read_ahead_never_runs_and_running_one_is_freed_when_done() -> None:
    gate = {1: threading.Event()}
    fetch = Recorder(gate=gate)
    dropped: list[int] = []
    with ThreadPoolExecutor(max_workers=1) as pool:  # 1 runs (blocked), 2 and 3 wait in the queue
        ahead = ReadAhead(10, fetch, pool, read_ahead=3, on_drop=dropped.append)
        assert ahead[0].index == 0
        assert ahead.running == 3
        got = ahead[4]
        assert got.index == 4 and sorted(fetch.calls) == [0, 1, 4]
        assert sorted(dropped) == [2, 3]  # cancelled before they started: over at once
        # fetch 1 still runs and still counts against the limit: only 2 more may start (5, 6; not 7)
        assert ahead.running == 3
        gate[1].set()
        fetch.wait_finished(1, 5, 6)
        ahead.close()
    assert 2 not in fetch.calls and 3 not in fetch.calls and 7 not in fetch.calls
    assert sorted(dropped) == [1, 2, 3, 5, 6]
    del got
    assert fetch.settles_to(set()) == set()


@pytest.mark.parametrize("read_ahead", [0, 1, 3])
def test_reads_in_flight_stay_bounded_by_read_ahead(read_ahead: int) -> None:
    fetch = Recorder(delay=0.002)
    asked = [0, 1, 2, 4, 5, 9, 10, 11, 12, 20, 21, 22, 23, 24, 30, 39]
    with ThreadPoolExecutor(max_workers=16) as pool:  # more workers than read-ahead: the bound is ReadAhead's
        ahead = ReadAhead(40, fetch, pool, read_ahead)
        for i in asked:
            assert ahead[i].index == i
            assert ahead.running <= read_ahead  # fetches ahead of the consumer
        ahead.close()
    assert fetch.most <= read_ahead + 1  # and the one the consumer asked for
    if read_ahead:
        assert fetch.most_on_pool >= 1  # it does read ahead
    else:
        assert sorted(fetch.calls) == asked and fetch.most_on_pool == 0  # nothing but what was asked


def test_in_order_reads_every_item_and_closes_when_stopped_early() -> None:
    fetch = Recorder()
    with ThreadPoolExecutor(max_workers=2) as pool:
        assert [x.index for x in ReadAhead(7, fetch, pool, 2).in_order()] == list(range(7))
        ahead = ReadAhead(7, fetch, pool, 2)
        items = ahead.in_order()
        assert next(items).index == 0
        items.close()  # the consumer stops: read-ahead is dropped, further asks refused
        with pytest.raises(Exception, match="closed"):
            ahead[1]


def test_prefetched_pieces_give_back_the_buffers_of_skipped_pieces() -> None:
    n, read_ahead = 12, 2
    buffers = BufferPool(read_ahead + 2, 64 * 4)

    def layout(ref: int) -> tuple[torch.dtype, tuple[int, ...], int]:
        return torch.float32, (64,), 64 * 4

    def fetch(ref: int, out: torch.Tensor | None) -> torch.Tensor:
        assert out is not None
        return out.fill_(float(ref))

    with ThreadPoolExecutor(max_workers=4) as pool:
        pieces = PrefetchedPieces(n, layout, fetch, pool, read_ahead, buffers)
        for ref in range(0, n, 3):  # 2 of every 3 pieces skipped: their buffers must come back
            got = pieces[ref]
            assert torch.equal(got, torch.full((64,), float(ref)))
            pieces.release(ref)
        pieces.close()
    taken: list[torch.Tensor] = []
    grab = threading.Thread(target=lambda: taken.extend(buffers.acquire(64 * 4) for _ in range(buffers.count)))
    grab.start()
    grab.join(5)
    assert not grab.is_alive() and len(taken) == buffers.count, "a skipped piece kept its pooled buffer"
    for buf in taken:
        buffers.release(buf)
