"""Real torch.distributed worlds for tests: N gloo processes kept alive and reused.

A world of each size is started when a test first needs it and runs many test
functions. A function is sent by reference (module + name) to every rank,
runs there with a real process group, and its per-rank results come back. If
any rank fails or the call times out, the whole world is torn down (a rank
stuck in a collective cannot be recovered) and the next use starts a fresh
one.

Ranks are forked from a fork server that imported torch once (the
``forkserver`` start method with torch preloaded): a fresh interpreter per rank
spent 2-4 s of CPU importing torch and its distributed modules, four or eight
ranks at a time, on every world start of the session (a 4-rank world now starts
in ~0.2 s instead of ~3.5 s). Each rank still starts clean of anything a test
ran: the server itself never runs a test function, and a server that has run no
torch work forks safely (tests/peak_memory.py's zygote does the same). At most
:data:`MAX_LIVE_RANKS` ranks are kept alive at once (the least recently used
worlds are closed to make room), so a module that uses worlds of several sizes
does not leave them all idling.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from multiprocessing import forkserver
from typing import Any, Callable

_CTX = mp.get_context("forkserver")
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.tensor",
            "torch.distributed.fsdp",
            # the frameworks' modules the framework tests' ranks import: 3-6 s of CPU per rank, paid once here
            # instead of on every framework world's start (measured: all of them 5.9 s in one process)
            "megatron.core", "megatron.core.models.gpt.gpt_model", "megatron.core.models.gpt.gpt_layer_specs",
            "megatron.core.optimizer", "megatron.core.distributed", "megatron.core.dist_checkpointing",
            "megatron.core.transformer.moe", "megatron.core.pipeline_parallel", "megatron.core.optimizer_param_scheduler",
            "torchtitan.trainer", "torchtitan.models.llama3", "torchtitan.models.qwen3", "torchtitan.models.deepseek_v3",
            "deepspeed", "deepspeed.moe.layer", "deepspeed.runtime.zero.partition_parameters", "deepspeed.checkpoint",
            "tests.forkserver_gc_freeze"]  # last: freezes what the imports above made (see that module)
"""What the fork server imports before it forks any rank: torch, the distributed modules ckptkit's ranks use,
and the frameworks' modules, imported only (no test code, no shims, nothing that ran: a forked rank shares
these pages until it writes to them). A rank counts as a framework rank once it *uses* a framework
(:func:`imported_frameworks`), not for what it inherited."""
MAX_LIVE_RANKS = 8
"""The most ranks kept alive at once: the largest world a test uses. An idle rank costs no CPU (measured: under
0.01 s per minute) but ~270 MB of memory bare and ~550 MB with a framework imported."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# One thread per rank, set before torch is imported (in the fork server, and again in each rank): the ranks of a
# world share this machine's cores, and a thread count that followed the machine would change how CPU kernels
# split their sums.
_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set, for a child started meanwhile; restored afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _start_fork_server() -> None:
    """Start the fork server (once per session) with torch imported under the ranks' thread settings (and
    DeepSpeed told it runs on the CPU, as tests/deepspeed_job.py tells it)."""
    _CTX.set_forkserver_preload(_PRELOAD)
    with _environ({**_THREADS, "DS_ACCELERATOR": "cpu"}):
        forkserver.ensure_running()


_AT_START: set[str] = set()
"""The modules a rank had when it started (inherited from the fork server): not a sign of use."""


_STACKS: list[Any] = []
"""The open file a rank's stack dump goes to (kept referenced: faulthandler writes to its descriptor)."""


def _dump_stacks_on_request(path: str) -> None:
    """On SIGUSR1, write every thread's Python stack to ``path``: the harness asks for it when a call times
    out, so a hang that does not come back under a debugger still says where each rank was. faulthandler
    writes from the signal handler itself, so a rank blocked in a C call (a gloo collective) answers too."""
    import faulthandler

    f = open(path, "w")  # noqa: SIM115 - must outlive this function
    _STACKS.append(f)
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)


def _worker(rank: int, world: int, port: int, conn: Any, env: dict[str, str], stacks: str) -> None:
    _AT_START.update(sys.modules)
    _dump_stacks_on_request(os.path.join(stacks, f"rank-{rank}.txt"))
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
    _exit_without_teardown()


def _exit_without_teardown() -> None:
    """End a closed rank: run its exit handlers (ckptkit's; multiprocessing's, which stops the rank's daemonic
    helpers such as ckptkit's writer process), flush, and leave without the interpreter's teardown, which frees
    every object of every module one by one: 5-12 s of CPU per Megatron or DeepSpeed rank (measured when ranks
    were spawned interpreters), four ranks at a time, after every module that used a framework. A forked rank
    that returned would skip the exit handlers as well (multiprocessing ends it with ``os._exit``); here they run."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


HEAVY = ("megatron", "deepspeed", "torchtitan", "transformers")
"""Frameworks whose import makes a rank heavy (hundreds of MB, patched by test shims)."""


def imported_frameworks() -> list[str]:
    """The frameworks this rank has used since it started: a framework module imported since (beyond the
    fork server's), a test module imported since that holds a framework's objects (a framework job), or
    the Megatron CPU shims installed."""
    import inspect

    used = set()
    for name in set(sys.modules) - _AT_START:
        root = name.split(".")[0]
        if root in HEAVY:
            used.add(root)
        elif root == "tests" and sys.modules[name] is not None:
            for value in list(vars(sys.modules[name]).values()):
                origin = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", None)
                if isinstance(origin, str) and origin.split(".")[0] in HEAVY:
                    used.add(origin.split(".")[0])
    shims = sys.modules.get("tests.megatron_cpu_shims")
    if shims is not None and getattr(shims, "_installed", None) is not None:
        used.add("megatron")
    return sorted(used)


class WorldError(AssertionError):
    pass


class World:
    #: starts tried: a rendezvous port free when picked can be taken before rank 0 binds it (EADDRINUSE; the
    #: ranks then die before saying hello), which a fresh port fixes; a world that fails thrice is broken
    STARTS = 3

    def __init__(self, size: int, timeout: float = 180.0, env: dict[str, str] | None = None) -> None:
        self.size = size
        self.timeout = timeout
        _start_fork_server()
        for attempt in range(self.STARTS):
            self.conns: list[Any] = []
            self.procs: list[Any] = []
            self.stacks = tempfile.mkdtemp(prefix="ckptkit-world-stacks-")
            try:
                self._start(free_port(), env or {})
                break
            except EOFError:  # a rank died before its hello: its rendezvous port was taken meanwhile
                self.close()
                if attempt + 1 == self.STARTS:
                    raise WorldError(f"a {size}-process world did not start in {self.STARTS} tries") from None
        self.broken = False

    def _start(self, port: int, env: dict[str, str]) -> None:
        for rank in range(self.size):
            parent, child = _CTX.Pipe()
            # not daemonic: ranks may start helper processes of their own (ckptkit's writer process)
            p = _CTX.Process(target=_worker, args=(rank, self.size, port, child, env, self.stacks), daemon=False)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for rank, c in enumerate(self.conns):
            if not c.poll(self.timeout):
                self.close()
                raise WorldError(f"rank {rank} of a {self.size}-process world did not start")
            c.recv()

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
                stacks = self.stacks_now()
                self.close(grace=1.0)  # the late rank will not answer; the others leave at once or are killed
                raise WorldError(f"rank {rank} did not finish {fn.__name__} in time"
                                 + (f"; errors: {errors}" if errors else "") + f"\n{stacks}")
            status, value = c.recv()
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise WorldError("\n".join(errors))
        return results

    def stacks_now(self, wait: float = 2.0, lines: int = 80) -> str:
        """Every live rank's Python stacks, each thread's, asked for by SIGUSR1 (the last ``lines`` of each
        rank's dump): what a timed-out call was doing, for a hang seen once under load."""
        asked = []
        for rank, p in enumerate(self.procs):
            if p.is_alive() and p.pid:
                with contextlib.suppress(OSError):
                    os.kill(p.pid, signal.SIGUSR1)
                    asked.append(os.path.join(self.stacks, f"rank-{rank}.txt"))
        deadline = time.monotonic() + wait  # until every asked rank has written, at most ``wait``
        while time.monotonic() < deadline and not all(os.path.exists(f) and os.path.getsize(f) for f in asked):
            time.sleep(0.05)
        time.sleep(0.1)  # a rank with many threads may still be writing its last ones
        out = []
        for rank in range(self.size):
            try:
                with open(os.path.join(self.stacks, f"rank-{rank}.txt"), encoding="utf-8", errors="replace") as f:
                    text = f.read().splitlines()
            except OSError:
                text = ["(no stack dump)"]
            out.append(f"--- rank {rank} stacks ---\n" + "\n".join(text[-lines:] or ["(empty: the rank did not answer)"]))
        return "\n".join(out)

    def close(self, grace: float = 5.0) -> None:
        """Ask every rank to leave, wait ``grace`` seconds for all of them together, kill the rest (a rank stuck
        in a collective of a broken world never reads the request: waiting for each in turn cost ``grace`` per
        stuck rank)."""
        for c in self.conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + grace
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
        self.broken = True
        shutil.rmtree(self.stacks, ignore_errors=True)


class Worlds:
    """Session cache: one live world per size, at most :data:`MAX_LIVE_RANKS` ranks in all."""

    def __init__(self, max_live_ranks: int = MAX_LIVE_RANKS) -> None:
        self.max_live_ranks = max_live_ranks
        self._worlds: dict[int, World] = {}  # least recently used first
        atexit.register(self.close)  # worlds are not daemonic: never leave them behind

    def get(self, size: int) -> World:
        w = self._worlds.pop(size, None)
        if w is None or w.broken:
            self._make_room(size)
            w = World(size)
        self._worlds[size] = w  # now the most recently used
        return w

    def _make_room(self, size: int) -> None:
        """Close the least recently used worlds until a new one of ``size`` fits in the budget."""
        while self._worlds and self.live_ranks() + size > self.max_live_ranks:
            self.retire(next(iter(self._worlds)))

    def live_ranks(self) -> int:
        return sum(w.size for w in self._worlds.values() if not w.broken)

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
