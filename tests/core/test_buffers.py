"""BufferPool (reused buffers for streaming) and the writer's release hook."""

from __future__ import annotations

import threading

import torch

from ckptkit.engine.buffers import BufferPool, PoolClosedError
from ckptkit.engine.offline_writer import OfflineCheckpoint, write_offline
from ckptkit.layout.box import Box, Region
from ckptkit.layout.manifest import TensorMeta, ExplicitLayout
from ckptkit.storage.local import LocalStore


def test_pool_reuses_buffers_and_bounds_them() -> None:
    pool = BufferPool(2, 1024)
    a = pool.acquire(100)
    b = pool.acquire(1024)
    assert a.numel() == 100 and b.numel() == 1024 and pool.allocated == 2
    got: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(10)))
    t.start()
    t.join(0.2)
    assert t.is_alive()  # both in use: waits
    a_ptr = a.data_ptr()
    pool.release(a)
    t.join(5)
    assert got and got[0].data_ptr() == a_ptr and pool.allocated == 2  # the same memory again
    pool.release(got[0])
    big = pool.acquire(4096)  # larger than the buffers: a one-off, not kept
    pool.release(big)
    pool.release(b)
    assert pool.allocated == 2


def test_close_wakes_waiters() -> None:
    pool = BufferPool(1, 8)
    held = pool.acquire(8)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            pool.acquire(8)
        except PoolClosedError as exc:
            errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    pool.close()
    t.join(5)
    assert errors and not t.is_alive()
    pool.release(held)


class _Source:
    """Pieces from a 2-buffer pool, released by the writer: more pieces than buffers, no deadlock."""

    def __init__(self, n: int, pool: BufferPool) -> None:
        self.n, self.pool, self.bytes_read = n, pool, 0
        self.held: dict[int, torch.Tensor] = {}
        self.released: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, ref: int) -> torch.Tensor:
        buf = self.pool.acquire(64 * 4)
        self.held[ref] = buf
        out = buf.view(torch.float32)
        out.fill_(float(ref))
        return out

    def release(self, ref: int) -> None:
        self.released.append(ref)
        self.pool.release(self.held.pop(ref))


def test_writer_releases_each_piece_once_written(tmp_path) -> None:
    import ckptkit

    n = 6
    pool = BufferPool(2, 64 * 4)
    sources: list[_Source] = []
    tensors = {"t": TensorMeta("t", "float32", (n * 64,), ExplicitLayout(()))}
    pieces = {0: [("t", Region(Box((i * 64,), (64,)))) for i in range(n)]}

    def factory(rank: int, items: object) -> _Source:
        sources.append(_Source(n, pool))
        return sources[-1]

    write_offline(LocalStore(str(tmp_path / "c")), OfflineCheckpoint(1, tensors, pieces), factory)
    assert sorted(sources[0].released) == list(range(n)) and not sources[0].held
    got = ckptkit.open(tmp_path / "c")["t"].read()
    assert torch.equal(got, torch.arange(n, dtype=torch.float32).repeat_interleave(64))
