"""Real torch.distributed worlds for tests: N gloo processes kept alive and reused.

Starting a gloo world costs seconds (importing torch in every process), so a
world of each size is started once per test session and runs many test
functions. A function is sent by reference (module + name) to every rank,
runs there with a real process group, and its per-rank results come back. If
any rank fails or the call times out, the whole world is torn down (a rank
stuck in a collective cannot be recovered) and the next use starts a fresh
one.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import socket
import traceback
from typing import Any, Callable

_CTX = mp.get_context("spawn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# One thread per rank, set before torch is imported: the ranks of a world share this machine's cores,
# and a thread count that followed the machine would change how CPU kernels split their sums.
_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def _worker(rank: int, world: int, port: int, conn: Any, env: dict[str, str]) -> None:
    os.environ.update(_THREADS)
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything to the test process
            conn.send(("err", traceback.format_exc()))
    dist.destroy_process_group()


HEAVY = ("megatron", "deepspeed", "torchtitan", "transformers")
"""Frameworks whose import makes a rank heavy (hundreds of MB, patched by test shims)."""


def imported_frameworks() -> list[str]:
    import sys

    return [name for name in HEAVY if name in sys.modules]


class WorldError(AssertionError):
    pass


class World:
    def __init__(self, size: int, timeout: float = 180.0, env: dict[str, str] | None = None) -> None:
        self.size = size
        self.timeout = timeout
        port = free_port()
        self.conns = []
        self.procs = []
        for rank in range(size):
            parent, child = _CTX.Pipe()
            # not daemonic: ranks may start helper processes of their own (ckptkit's writer process)
            p = _CTX.Process(target=_worker, args=(rank, size, port, child, env or {}), daemon=False)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for rank, c in enumerate(self.conns):
            if not c.poll(timeout):
                self.close()
                raise WorldError(f"rank {rank} of a {size}-process world did not start")
            c.recv()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results."""
        if self.broken:
            raise WorldError("world is broken")
        for c in self.conns:
            c.send((fn, args, kwargs))
        results: list[Any] = [None] * self.size
        errors = []
        for rank, c in enumerate(self.conns):
            # once a rank has failed, peers stuck in a collective will not finish: wait briefly
            wait = min(30.0, timeout or self.timeout) if errors else (timeout or self.timeout)
            if not c.poll(wait):
                self.broken = True
                self.close()
                raise WorldError(f"rank {rank} did not finish {fn.__name__} in time" + (f"; errors: {errors}" if errors else ""))
            status, value = c.recv()
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise WorldError("\n".join(errors))
        return results

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self.broken = True


class Worlds:
    """Session cache: one live world per size."""

    def __init__(self) -> None:
        self._worlds: dict[int, World] = {}
        atexit.register(self.close)  # worlds are not daemonic: never leave them behind

    def get(self, size: int) -> World:
        w = self._worlds.get(size)
        if w is None or w.broken:
            w = World(size)
            self._worlds[size] = w
        return w

    def run(self, size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        world = self.get(size)
        try:
            return world.run(fn, *args, **kwargs)
        except WorldError:
            # a rank that raised may have left peers inside a collective: start over next time
            world.close()
            raise

    def retire(self, size: int) -> None:
        """Close the world of ``size``; the next use starts a fresh one (after a module that patched its
        processes, e.g. the Megatron CPU shims, so no later test runs under those patches)."""
        w = self._worlds.pop(size, None)
        if w is not None:
            w.close()

    def retire_heavy(self) -> list[int]:
        """Close every world whose ranks imported a framework (Megatron, DeepSpeed, torchtitan,
        transformers): such ranks hold hundreds of MB each and may carry a module's CPU shims, so they
        never outlive the test module that loaded them. Bare torch worlds stay for the next module.
        Returns the sizes closed."""
        closed = []
        for size, world in list(self._worlds.items()):
            try:
                heavy = world.broken or any(world.run(imported_frameworks, timeout=30))
            except WorldError:
                heavy = True
            if heavy:
                self.retire(size)
                closed.append(size)
        return closed

    def close(self) -> None:
        for w in self._worlds.values():
            w.close()
        self._worlds.clear()
