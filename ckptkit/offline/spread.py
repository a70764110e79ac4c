"""The offline operations' part of a spread (``torchrun``) run: agreeing before writing.

The write itself is spread by :mod:`ckptkit.engine.offline_spread`. Before it,
every process plans on its own (the plan is a pure function of the source's
manifest, so each finds the same one without exchanging it). What can differ
between processes is failure: one that cannot read the source, or finds the
destination committed, must not leave the others waiting at the write's
first collective. :func:`agreed` runs a step on every process and, if any
failed, fails it on all of them, naming the process.

A source of another format is imported once, by process 0
(:func:`spread_source`), to a folder every process can read: a local
temporary folder when all processes run on one machine, else a hidden
folder beside the destination (a shared file system, as multi-node jobs
have). Process 0 removes it after every process is done.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from datetime import timedelta
from typing import Any, TypeVar

from ckptkit.engine.collective import Comm, init_process_group, resolve_comm
from ckptkit.errors import CkptkitError
from ckptkit.options import Progress, progress_counter

T = TypeVar("T")
SourceFactory = Callable[[str | None], AbstractContextManager[tuple[str, dict[str, Any] | None]]]
"""``factory(scratch_parent)``: the context manager yielding a ckptkit source's URL and storage options
(importing a foreign source into a temporary folder under ``scratch_parent``; None: the system's)."""


class SpreadError(CkptkitError):
    """Another process of a spread operation failed; its message is in this one."""


def spread_comm(process_group: Any) -> Comm | None:
    """The communicator over ``process_group``; None for None (this process alone)."""
    if process_group is None:
        return None
    comm = resolve_comm(process_group)
    return comm if comm.world_size > 1 else None


def agreed(comm: Comm | None, step: Callable[[], T]) -> T:
    """``step()`` on every process; if it raised on any, it raises on all (collective: one exchange
    of JSON). A process's own error is raised as it is; the others raise :class:`SpreadError`."""
    if comm is None:
        return step()
    error: BaseException | None = None
    try:
        value = step()
    except Exception as exc:  # noqa: BLE001 - told to every process, raised below
        error = exc
    errors = comm.all_gather_json(None if error is None else str(error) or type(error).__name__)
    if error is not None:
        raise error
    failed = [(p, e) for p, e in enumerate(errors) if e is not None]
    if failed:
        p, e = failed[0]
        raise SpreadError(f"process {p} of {comm.world_size} failed: {e}")
    return value


def same_source(comm: Comm | None, url: str, attempt: str | None) -> None:
    """Every process reads the same checkpoint at ``url``: the save attempt its manifest names is
    process 0's (collective when spread). A multi-node job whose nodes see different folders at one
    path would otherwise write a mix of two checkpoints under one commit."""
    if comm is None:
        return
    attempts = comm.all_gather_json(attempt)
    odd = [p for p, a in enumerate(attempts) if a != attempts[0]]
    if odd:
        raise SpreadError(f"process {odd[0]} of {comm.world_size} reads another checkpoint at {url} than process 0 "
                          f"(save attempt {attempts[odd[0]]}, process 0's {attempts[0]}): every process must see "
                          "the same source (a shared file system or object store)")


class Dealt:
    """This process's share of ``count`` work units (files, shards) and its progress ``tick``: all of
    them alone (``comm`` None), or those :func:`~ckptkit.engine.offline_spread.share_of` deals it by
    ``sizes``, the same on every process with no exchange, with one progress bar on process 0
    counting every process's bytes (collective when spread: one exchange names the bar's counter).
    :meth:`close` when the writing ends, :meth:`finish` once the result is committed."""

    def __init__(self, comm: Comm | None, sizes: Mapping[int, int], count: int, progress: Progress | None,
                 total: int, what: str) -> None:
        from ckptkit.engine.offline_spread import SharedProgress, share_of

        self._bar: Any = None
        if comm is None:
            self.mine: list[int] = list(range(count))
            self.tick: Callable[[int], None] = progress_counter(progress, total)
            return
        self.mine = share_of(sizes, count, comm.world_size)[comm.rank]
        key = f"ckptkit/{what}/{comm.all_gather_json(uuid.uuid4().hex)[0]}/bytes"
        self._bar = SharedProgress(comm, progress, total, sum(sizes.get(i, 0) for i in self.mine), key)
        self.tick = self._bar.tick

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.finish()


def write_then_commit(comm: Comm | None, dealt: Dealt, write: Callable[[list[int]], Any],
                      commit: Callable[[list[Any]], None] | None, discard: Callable[[], None], *,
                      every_process_discards: bool = False) -> list[Any]:
    """The write protocol of a spread export: ``write(dealt.mine)`` on every process (its result
    JSON-able: it travels to process 0), then ``commit(every process's result, in process order)``
    on process 0 alone. A failure of either step on any process fails it on every process, after
    all of them stopped writing; then ``discard()`` removes what was written, on process 0 (or on
    every process, each removing its own). One process alone (``comm`` None) runs the same steps.
    Returns every process's result."""
    try:
        mine = agreed(comm, lambda: write(dealt.mine))
        parts = [mine] if comm is None else comm.all_gather_json(mine)
        if commit is not None:
            agreed(comm, lambda: commit(parts) if comm is None or comm.rank == 0 else None)
    except BaseException:
        if every_process_discards or comm is None or comm.rank == 0:
            discard()
        raise
    finally:
        dealt.close()
    dealt.finish()
    return parts


@contextmanager
def spread_source(comm: Comm | None, factory: SourceFactory, source: str | os.PathLike[str],
                  dest: str | os.PathLike[str],
                  storage_options: dict[str, Any] | None) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """The ckptkit source every process reads: ``factory``'s, entered by process 0 only when spread
    (a foreign source is imported once), its URL told to all. A URL other than ``source`` is an
    import, read without the caller's storage options (as ``factory`` itself yields it). Collective
    when spread."""
    if comm is None:
        with factory(None) as found:
            yield found
        return
    hosts = comm.all_gather_json(socket.gethostname())
    with ExitStack() as held:

        def enter() -> str:
            if comm.rank != 0:
                return ""
            return held.enter_context(factory(None if len(set(hosts)) == 1 else _beside(dest)))[0]

        try:
            url = comm.all_gather_json(agreed(comm, enter))[0]
            yield url, (storage_options if url == os.fspath(source) else None)
        finally:
            comm.all_gather_json(None)  # every process is done with the source before process 0 removes it


def launched_by_torchrun() -> bool:
    """Whether this process is one of several that ``torchrun`` (or a launcher setting its
    variables) started: ``WORLD_SIZE`` > 1 and a ``RANK``."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
    except ValueError:
        return False


SPREAD_TIMEOUT = timedelta(hours=6)
"""The process group's collective timeout in a spread CLI run: a process waits at the commit for the
slowest one's whole share (and, for a foreign source, for process 0's import first), which at
terabytes takes long; a process that dies ends the job through torchrun, not through this timeout."""


@contextmanager
def torchrun_group() -> Iterator[Any]:
    """The process group of a ``torchrun`` launch (gloo over every process, made here and destroyed on
    exit), or None when this process runs alone. What ``python -m ckptkit reshard`` spreads over."""
    if not launched_by_torchrun():
        yield None
        return
    import torch.distributed as dist

    made = not dist.is_initialized()
    if made:
        init_process_group("gloo", timeout=SPREAD_TIMEOUT)
    try:
        yield dist.group.WORLD
    finally:
        if made and dist.is_initialized():
            dist.destroy_process_group()


def _beside(dest: str | os.PathLike[str]) -> str:
    """The folder that holds ``dest``: where a multi-node job imports a foreign source (shared storage)."""
    path = os.fspath(dest)
    if "://" in path and not path.startswith("file://"):
        raise CkptkitError(
            f"a source of another format is imported before it is resharded; with processes on several "
            f"machines it goes beside the destination, and {path} is not a file-system path: import it "
            "first (ckptkit convert SRC DIR --format ckptkit), then reshard DIR")
    path = path.removeprefix("file://")
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    return parent
