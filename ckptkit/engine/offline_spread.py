"""An offline write spread over the processes of a ``torch.distributed`` job (``torchrun``).

:func:`~ckptkit.engine.offline_writer.write_offline` writes a checkpoint as N
*virtual* ranks. One process does that at about one process's I/O rate; a
1-4 TB reshard then takes most of an hour. Spread, every process of the job
writes the virtual ranks of its share, and the job still commits once:

1. process 0 checks the target and names the attempt (a broadcast);
2. each process writes its share (:func:`share_of`: the virtual ranks dealt
   by bytes, largest first, to the least loaded process, so the same on every
   process with no exchange) — its data objects and indexes, exactly as the
   single-process writer would, so the output is the same byte for byte;
3. process 0 gathers every process's rank reports (or its error), merges and
   publishes the manifest, and broadcasts the outcome: one failure anywhere
   fails the write on every process, naming the process, and removes the
   partial output.

Why ``torch.distributed`` and not a work queue of our own: the user already
has ``torchrun`` (or Slurm launching it) to place processes on nodes, its
rendezvous, and its failure handling (one dead process ends the job's other
processes, so none waits forever at a collective).

Progress is one bar on process 0, counting the bytes of every process: each
adds what it wrote to a counter in the job's rendezvous store every few MiB;
process 0 reads it a few times a second.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from ckptkit.engine.collective import Comm
from ckptkit.options import Progress

_FLUSH_BYTES = 16 << 20
_POLL_SECONDS = 0.2


def share_of(rank_bytes: Mapping[int, int], world_size: int, processes: int) -> list[list[int]]:
    """Virtual ranks ``0..world_size-1`` dealt to ``processes`` processes, balanced by bytes.

    Largest rank first, each to the process with the fewest bytes so far (lowest index on a tie),
    each process's ranks then in ascending order. Deterministic from its arguments, so every
    process computes the same shares without exchanging anything. Ranks that store nothing still
    write an index; they are dealt too, by count, so no process is left with all of them."""
    if processes < 1:
        raise ValueError(f"processes {processes} must be >= 1")
    load = [(0, 0)] * processes  # (bytes, ranks) per process
    shares: list[list[int]] = [[] for _ in range(processes)]
    for rank in sorted(range(world_size), key=lambda r: (-rank_bytes.get(r, 0), r)):
        p = min(range(processes), key=lambda i: (load[i], i))
        shares[p].append(rank)
        load[p] = (load[p][0] + rank_bytes.get(rank, 0), load[p][1] + 1)
    return [sorted(s) for s in shares]


class SharedProgress:
    """One progress bar on process 0 for the bytes every process writes.

    ``tick(n)`` is called from any writer thread of any process. A process adds its bytes to a
    counter in the job's rendezvous store (the c10d store ``init_process_group`` made) every
    :data:`_FLUSH_BYTES`; process 0 polls it and reports to ``progress``. Without such a store
    (a group made some other way), process 0's bar counts its own share only, against that share."""

    def __init__(self, comm: Comm, progress: Progress | None, total: int, own_total: int, key: str) -> None:
        self._progress, self._total, self._key = progress, total, key
        self._lock = threading.Lock()
        self._pending = 0
        self._own_done = 0
        self._own_total = own_total
        self._store = _rendezvous_store() if progress is not None or comm.rank != 0 else None
        self._is_root = comm.rank == 0
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        if self._is_root and progress is not None and self._store is not None:
            self._poller = threading.Thread(target=self._poll, name="ckptkit-spread-progress", daemon=True)
            self._poller.start()

    def tick(self, n: int) -> None:
        with self._lock:
            self._pending += n
            self._own_done += n
            flush = self._pending >= _FLUSH_BYTES
            if flush:
                n, self._pending = self._pending, 0
            own = self._own_done
        if flush:
            self._add(n)
        if self._is_root and self._progress is not None and self._store is None:
            self._progress(own, self._own_total)

    def close(self) -> None:
        """Flush what is left and stop polling (the bar's last word comes from :meth:`finish`)."""
        with self._lock:
            n, self._pending = self._pending, 0
        if n:
            self._add(n)
        self._stop.set()
        if self._poller is not None:
            self._poller.join()

    def finish(self) -> None:
        """Process 0, once the write committed: the bar at its total."""
        if self._is_root and self._progress is not None:
            self._progress(self._total, self._total)

    def _add(self, n: int) -> None:
        if self._store is None:
            return
        try:
            self._store.add(self._key, n)
        except Exception:  # noqa: BLE001 - a progress bar must never fail a write
            self._store = None

    def _poll(self) -> None:
        assert self._progress is not None
        while not self._stop.wait(_POLL_SECONDS):
            store = self._store
            if store is None:
                return
            try:
                done = int(store.add(self._key, 0))
            except Exception:  # noqa: BLE001 - see _add
                return
            self._progress(min(done, self._total), self._total)


def _rendezvous_store() -> Any:
    """The key-value store of the default process group (torchrun's), or None."""
    try:
        from torch.distributed import distributed_c10d

        getter: Callable[[], Any] | None = getattr(distributed_c10d, "_get_default_store", None)
        return getter() if getter is not None else None
    except Exception:  # noqa: BLE001 - no store: process 0 shows its own share
        return None
