"""Options for saving and loading, as small frozen dataclasses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ckptkit.errors import OptionsError

# A long operation's report of how far it is: (units done, units in total). Bytes for
# copies and conversions, elements for diffs; the CLI draws it as a progress bar.
Progress = Callable[[int, int], None]


def progress_counter(progress: Progress | None, total: int) -> Callable[[int], None]:
    """A thread-safe ``tick(n)`` that adds ``n`` units and reports the running sum to ``progress``
    (worker threads of a conversion or export report into one bar)."""
    import threading

    done, lock = [0], threading.Lock()

    def tick(n: int) -> None:
        with lock:
            done[0] += n
            if progress is not None:
                progress(done[0], total)

    return tick


@dataclass(frozen=True)
class SaveOptions:
    """How a save writes.

    ``block_size``: bytes covered by one CRC32C; a partial read (resharding)
    reads and verifies whole blocks, so smaller blocks read less extra and
    cost slightly larger indexes.
    """

    block_size: int = 4 << 20

    def __post_init__(self) -> None:
        if self.block_size < 4096 or self.block_size % 4096:
            raise OptionsError(f"block_size {self.block_size} must be a positive multiple of 4096")


@dataclass(frozen=True)
class LoadOptions:
    """How a load reads.

    ``io_threads``: read requests in flight per rank.
    ``per_rank_on_resize``: what happens to per-rank values (RNG states,
    ``PerRank``) when the world size changed: ``"error"`` refuses,
    ``"skip"`` leaves them as they are in the caller's state.
    ``read_once``: ranks that need the same stored bytes (data-parallel replicas of the weights)
    read them from storage once in the job, one reader sending them to the others over the
    process group (:mod:`ckptkit.engine.read_once`); False: every rank reads all it needs itself.
    """

    io_threads: int = 4
    per_rank_on_resize: Literal["error", "skip"] = "error"
    read_once: bool = True

    def __post_init__(self) -> None:
        if self.io_threads < 1:
            raise OptionsError(f"io_threads {self.io_threads} must be >= 1")
        if self.per_rank_on_resize not in ("error", "skip"):
            raise OptionsError(f"per_rank_on_resize must be 'error' or 'skip', got {self.per_rank_on_resize!r}")


@dataclass(frozen=True)
class AsyncOptions:
    """How asynchronous saves run.

    ``executor``: who persists the snapshot — ``"thread"`` (a background
    thread of the training process) or ``"process"`` (a persistent writer
    process reading the snapshot from shared memory).
    ``max_staging_bytes``: per-rank budget for the staging buffer; a save that
    needs more fails with a clear error (None: no budget).
    ``on_busy``: when a save is requested while the previous one is still
    persisting, ``"wait"`` for it (the default: no checkpoint is dropped) or
    ``"skip"`` the new one (training never waits; every rank skips together).
    """

    executor: Literal["thread", "process"] = "thread"
    max_staging_bytes: int | None = None
    on_busy: Literal["wait", "skip"] = "wait"
    block_size: int = 4 << 20

    def __post_init__(self) -> None:
        if self.executor not in ("thread", "process"):
            raise OptionsError(f"executor must be 'thread' or 'process', got {self.executor!r}")
        if self.on_busy not in ("wait", "skip"):
            raise OptionsError(f"on_busy must be 'wait' or 'skip', got {self.on_busy!r}")
        if self.max_staging_bytes is not None and self.max_staging_bytes < 0:
            raise OptionsError("max_staging_bytes must be >= 0")
        SaveOptions(block_size=self.block_size)  # same validation
