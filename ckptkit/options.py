"""Options for saving and loading, as small frozen dataclasses."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

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
    ``stall_seconds``: the load watchdog (:mod:`ckptkit.engine.watchdog`). A rank that makes no
    progress for this long — no storage read finishes (reads are counted in chunks of at most
    64 MiB), no piece is placed, no phase ends — while it is not waiting for other ranks fails the
    load on *every* rank with :class:`~ckptkit.errors.LoadStalledError`, naming that rank and the
    object it was reading; the others learn it through the job's key-value store, not through a
    collective the stalled rank would have to join. The default, 600 s: a working load never
    comes near it (one 64 MiB chunk in ten minutes is 0.1 MB/s); it is torch's default NCCL
    collective timeout, the silence a training job already tolerates; and it ends a hung load
    with the rank and object named well before gloo's 30-minute default timeout would end it
    with neither. Progress resets the clock: a slow load that keeps moving is never stopped.
    None turns the watchdog off (the load then runs on the calling thread, as before). Must be
    the same on every rank, like the other collective arguments.
    ``on_progress``: called about every ``min(stall_seconds / 8, 5)`` seconds (every second
    without a watchdog) with this rank's :class:`~ckptkit.engine.load_progress.LoadProgress`
    (bytes read, pieces placed, phase, the object being read), and once more when the load ends;
    from the thread that called the load. An exception it raises is logged, never raised.
    """

    io_threads: int = 4
    per_rank_on_resize: Literal["error", "skip"] = "error"
    read_once: bool = True
    stall_seconds: float | None = 600.0
    on_progress: Callable[[Any], None] | None = None

    def __post_init__(self) -> None:
        if self.io_threads < 1:
            raise OptionsError(f"io_threads {self.io_threads} must be >= 1")
        if self.per_rank_on_resize not in ("error", "skip"):
            raise OptionsError(f"per_rank_on_resize must be 'error' or 'skip', got {self.per_rank_on_resize!r}")
        stall = self.stall_seconds
        if stall is not None and (isinstance(stall, bool) or not isinstance(stall, (int, float))
                                  or not math.isfinite(stall) or stall <= 0):
            raise OptionsError(f"stall_seconds must be a positive, finite number of seconds or None (no watchdog), "
                               f"got {stall!r}")
        if self.on_progress is not None and not callable(self.on_progress):
            raise OptionsError(f"on_progress must be callable or None, got {type(self.on_progress).__name__}")


@dataclass(frozen=True)
class AsyncOptions:
    """How asynchronous saves run.

    ``executor``: who persists the snapshot — ``"thread"`` (a background
    thread of the training process) or ``"process"`` (a persistent writer
    process reading the snapshot from shared memory).
    ``max_staging_bytes``: per-rank budget for the staging buffer, allocated
    once and reused (None: no budget, the buffer is the size of the rank's
    data). ``over_budget`` says what a save that needs more does:
    ``"waves"`` (the default) stages it in waves through a buffer of the
    budget's size: copy a window of the data, persist it while the next is
    copied, and so on (:mod:`ckptkit.engine.waves`); the checkpoint is byte
    for byte a one-shot save's. The default because whoever sets a budget
    wants host memory bounded (650 GB of staging per node OOM-killed 744B
    saves), and a save that fails protects nothing. Its cost: ``save`` then
    returns only once the *last* window is copied, so the step is blocked
    for about the time to persist all but the last two windows (about
    ``(1 - budget/state)`` of the persist time) instead of one copy. The
    state must not change until ``save`` returns (as always; ``handle.staged``
    is done by then). ``"error"``: such a save fails with a clear error
    (the behaviour before waves, for who would rather raise the budget than
    ever block on storage). Waves need ``max_staging_bytes >= 8192`` and a
    store that streams writes (local files, S3); a rank-local saver's
    ``staged_tensors`` are None for a save staged in waves.
    ``on_busy``: when a save is requested while the previous one is still
    persisting, ``"wait"`` for it (the default: no checkpoint is dropped) or
    ``"skip"`` the new one (training never waits; every rank skips together),
    except a save with a deadline (the resilience controller's emergency save on
    preemption), which waits.
    ``snapshot``: when the copy into staging happens. ``"blocking"`` (the
    default): ``save`` copies, then returns; the state may change the moment
    it returns. ``"overlap"``: ``save`` returns before any copy; the copy runs
    in the background (a thread on CPU; a side CUDA stream, ordered after the
    work queued before the save, for GPU tensors) while training goes on, and
    the first step of a *guard* (a torch optimizer hooked with
    ``register_step_pre_hook``: ``CheckpointManager(guard=...)``,
    ``save_async(guard=...)``, :meth:`AsyncSaver.guard`) waits for it. The
    contract: until a guard's step begins, nothing may change a saved tensor
    (forward, backward, ``zero_grad`` and gradient accumulation are fine:
    they read the saved tensors and write activations and gradients); every
    change of the state must go through a guarded optimizer's ``step``.
    An in-place change that bypasses it is caught by each tensor's version
    counter and fails that save (:class:`~ckptkit.errors.SnapshotRaceError`,
    naming the tensor; nothing is committed). The default stays
    ``"blocking"`` because it is what measured fastest on CPU, where the
    background copy competes with training for the same cores (docs/overlap.md).
    Refused: ``"overlap"`` with staging in waves under a budget (a wave is
    copied only once the writer freed its slot, so the state would have to stay
    unchanged for most of the persist time, not one copy).
    """

    executor: Literal["thread", "process"] = "thread"
    max_staging_bytes: int | None = None
    on_busy: Literal["wait", "skip"] = "wait"
    block_size: int = 4 << 20
    over_budget: Literal["waves", "error"] = "waves"
    snapshot: Literal["blocking", "overlap"] = "blocking"

    def __post_init__(self) -> None:
        if self.snapshot not in ("blocking", "overlap"):
            raise OptionsError(f"snapshot must be 'blocking' or 'overlap', got {self.snapshot!r}")
        if self.snapshot == "overlap" and self.max_staging_bytes is not None and self.over_budget == "waves":
            raise OptionsError(
                "snapshot='overlap' cannot stage in waves (max_staging_bytes with over_budget='waves'): a wave is "
                "copied only once the writer has persisted the one before, so the state would have to stay "
                "unchanged for most of the persist time, not for one background copy; use over_budget='error' "
                "(a budget the state must fit) or snapshot='blocking'")
        if self.executor not in ("thread", "process"):
            raise OptionsError(f"executor must be 'thread' or 'process', got {self.executor!r}")
        if self.on_busy not in ("wait", "skip"):
            raise OptionsError(f"on_busy must be 'wait' or 'skip', got {self.on_busy!r}")
        if self.max_staging_bytes is not None and self.max_staging_bytes < 0:
            raise OptionsError("max_staging_bytes must be >= 0")
        if self.over_budget not in ("waves", "error"):
            raise OptionsError(f"over_budget must be 'waves' or 'error', got {self.over_budget!r}")
        if (self.over_budget == "waves" and self.max_staging_bytes is not None
                and self.max_staging_bytes < 8192):
            raise OptionsError(f"max_staging_bytes={self.max_staging_bytes} is too small to stage in waves "
                               "(at least 8192: two 4 KiB windows); raise it or use over_budget='error'")
        SaveOptions(block_size=self.block_size)  # same validation
