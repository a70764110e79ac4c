"""The memory tier at work: snapshots into node memory, copies to peers or parity, retirement.

Per snapshot, on the training thread (:meth:`MemorySnapshots.snapshot`), nothing collective:

1. if this rank's previous snapshot is still being protected, wait for it; if it failed, raise
   (its outcome was agreed by every rank in the background, so every rank raises here alike);
2. the copy of this rank's local state into a reusable staging buffer (the only part that
   blocks the step: it is :class:`~ckptkit.engine.async_save.AsyncSaver`'s snapshot, with a
   rank-local saver).

Then, on one background thread per rank: the staged bytes are written to the node's memory
folder as a one-rank ckptkit checkpoint (manifest, index, checksums, commit); every rank agrees
that every own copy is written (one tiny all-reduce on the tier's own gloo group, so a node whose
write failed stops every rank's copies at once instead of leaving its peers waiting for bytes
until the group's timeout); the copies are sent to the replica holders or folded into the parity
shares of the rank's group; and once every rank agrees its copies are complete (a second
all-reduce, also the barrier) the previous step's copies are retired. So a node holds at most
two steps: the newest complete one and the one in flight.

Why the agreement runs in the background, not on the step: a rank's protection of step ``s`` ends
with an all-reduce every rank joins, so once its own protection is done every rank's copies of
``s`` are, and the outcome it returns is every rank's. Waiting for one's own previous snapshot is
therefore enough to keep the background copies matched, and the step never waits on a collective
for the slowest rank (on 4 ranks sharing 2 cores that flag all-reduce was most of a snapshot's
blocking time).

Restores are :mod:`ckptkit.memory.restore`'s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ckptkit.engine.async_save import AsyncSaver, SaveHandle
from ckptkit.engine.collective import Comm
from ckptkit.errors import SaveError
from ckptkit.memory import parity
from ckptkit.memory.exchange import Link
from ckptkit.memory.local_view import FingerprintMemo, local_view, mirror_state
from ckptkit.memory.bundle import BundleBytes
from ckptkit.memory.node_folder import NodeFolder, ShareHeader
from ckptkit.memory.options import MemoryTier
from ckptkit.memory.topology import Topology
from ckptkit.options import AsyncOptions

log = logging.getLogger("ckptkit")

TIER_VERSION = 1


def default_root(run_url: str) -> str:
    """``/dev/shm/ckptkit-<hash of the run's URL>``: shared memory, one folder per run and node."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, "ckptkit-" + hashlib.sha256(run_url.encode()).hexdigest()[:16])


class MemorySnapshots:
    """One rank's side of the memory tier. Construct on every rank (collective: makes the tier's group)."""

    def __init__(self, options: MemoryTier, comm: Comm, run_url: str, ranks: list[int] | None = None, *,
                 run_id: str) -> None:
        """``run_id``: the run's identity (:mod:`ckptkit.run_identity`), recorded in every snapshot:
        only snapshots of this id are restored (a new run at the same URL never gets an old one's)."""
        self.options = options
        self.run_id = run_id
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.topology = Topology(self.world_size, options.node_size(), options.copies, options.parity)
        self.folder = NodeFolder(options.root or default_root(run_url), private=options.root is None)
        if options.reuse_files:
            self.folder.keep_spares(self.rank, self.claims)
        self.link = Link(ranks, options.timeout_seconds) if self.world_size > 1 else None
        if self.link is not None:
            self._check_placement()
        self._saver = AsyncSaver(None, AsyncOptions(), rank_local=True)
        self._view_memo = FingerprintMemo()  # the last snapshot's layout fingerprint, while unchanged
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptkit-memory")
        self._inflight: Future[int] | None = None
        self._closed = False
        self._lent: Future[Any] | None = None  # a persistent save persisting from the staging buffer
        self._budget_checked = False
        #: the last protected step's (step, seconds to write and protect it)
        self.last_protected: tuple[int, float] | None = None

    def local_id(self) -> str:
        """Ranks whose ids are equal read the same memory folder (same host, same path)."""
        import socket

        return json.dumps([socket.gethostname(), self.folder.root])

    def _check_placement(self) -> None:
        """Warn when a rank's protection lands in its own memory folder (collective). ``ranks_per_node``
        smaller than the ranks a host runs puts "another node" on the same host: the replica or
        parity shares then die with the host they are meant to outlive, and nothing else would say so."""
        ids = self.comm.all_gather_json(self.local_id())
        if self.rank != 0:
            return
        for r in range(self.world_size):
            if self.topology.parity is not None:
                peers = [m for m in self.topology.parity_group(r) if m != r]
            else:
                peers = list(self.topology.replica_holders(r))
            same = [h for h in peers if ids[h] == ids[r]]
            if same:
                log.warning("memory tier: rank %d's %s held by rank(s) %s, which share its memory folder (%s): they "
                            "do not outlive the loss of that host. ranks_per_node=%d: set it to the ranks each host "
                            "runs (the launcher's LOCAL_WORLD_SIZE)", r,
                            "parity group is" if self.topology.parity is not None else "replicas are",
                            same, ids[r], self.topology.ranks_per_node)
                return

    # ------------------------------------------------------------------ claims
    def claims(self, rank: int) -> bool:
        """Whether this process manages entries named for ``rank`` in a node folder it may share with
        its node mates: each local slot manages its own (and, after a restart that moved ranks
        around, an even share of the rest)."""
        n = self.topology.ranks_per_node
        return rank % n == self.rank % n

    # ---------------------------------------------------------------- snapshot
    def snapshot(self, step: int, state: dict[str, Any], *, lend: bool = False,
                 base: int = -1, started: int = -1) -> tuple[SaveHandle, dict[str, Any] | None]:
        """Snapshot ``state`` at ``step`` into memory and protect it in the background. Collective.

        ``base``: the newest persistent step committed on this run's trajectory (-1: none), which
        a restore requires to be still there; ``started``: the newest whose save it started (this
        step's included; never below ``base``), after which a restore requires no persistent step
        up to this one.
        ``lend``: also return ``state`` with every tensor replaced by its staged copy (None when
        that is not possible), for a persistent save of the same step to persist from; call
        :meth:`lent_to` with that save's completion."""
        if self._closed:
            raise SaveError(f"memory snapshot of step {step}: the memory tier was closed (CheckpointManager.close)")
        prev = self._inflight
        if prev is not None:
            self._wait_quietly()  # its outcome is agreed by every rank: all raise here, or none
            exc = prev.exception()
            if exc is not None:
                self._inflight = None
                raise SaveError(f"the previous memory snapshot failed: {exc}") from exc
        try:
            return self._take(step, state, lend, base, started)
        except Exception as exc:
            # this rank has no snapshot of `step`, but every other rank's background waits to agree on
            # it: this rank's joins with its failure, so every rank fails the step together and the
            # ranks' agreements stay in step (one left out would pair the next step's with this one's)
            self._inflight = self._executor.submit(self._refuse, step, exc)
            raise

    def _take(self, step: int, state: dict[str, Any], lend: bool, base: int,
              started: int) -> tuple[SaveHandle, dict[str, Any] | None]:
        view = local_view(state, self.world_size, self.rank, self._view_memo)
        if not self._budget_checked:
            self._check_budget(view.nbytes)
        if self._lent is not None and not self._lent.done():
            self._saver.pool.release()  # still being persisted from: stage into a new buffer
        self._lent = None
        self.folder.own_step(step)  # a file or a link planted in its place: removed, never written through
        self.folder.remove_rank(step, self.rank)  # a leftover of an abandoned trajectory
        meta = {"memory_tier": TIER_VERSION, "step": step, "rank": self.rank, "world_size": self.world_size,
                "fingerprint": view.fingerprint, "run": self.run_id, "base": base,
                "started": started}
        handle = self._saver.save(view.state, self.folder.rank_store(step, self.rank), step=step, metadata=meta)
        assert handle is not None  # a rank-local saver with on_busy="wait" never skips
        lent = mirror_state(state, view, handle.staged_tensors) if lend else None
        self._inflight = self._executor.submit(self._protect, step, handle)  # last: nothing after it can fail
        return handle, lent

    def lent_to(self, done: Future[Any]) -> None:
        """The staged snapshot is being persisted from until ``done`` resolves: the next snapshot
        then stages into a fresh buffer rather than overwrite it."""
        self._lent = done

    def wait(self) -> None:
        """Block until the snapshot in flight is written and protected; raise its failure."""
        if self._inflight is not None:
            try:
                self._inflight.result()
            except SaveError:
                raise
            except Exception as exc:  # noqa: BLE001 - a copy to a peer, a write to node memory
                raise SaveError(f"memory snapshot failed on rank {self.rank}: {type(exc).__name__}: {exc}") from exc
            finally:
                self._inflight = None

    def _wait_quietly(self) -> None:
        if self._inflight is not None:
            try:
                self._inflight.result()
            except BaseException:  # noqa: BLE001 - reported by the caller through the agreed flag
                pass

    def close(self) -> None:
        """Wait for the snapshot in flight, release what the tier holds (its snapshots stay, for a
        restart), and raise that snapshot's failure, as :meth:`wait` does (it was swallowed)."""
        if self._closed:
            return
        self._closed = True
        failure: SaveError | None = None
        try:
            try:
                self.wait()
            except SaveError as exc:
                failure = exc
            self._saver.close()
            if self.folder.spares is not None:
                self.folder.spares.close()  # the snapshots stay for a restart; spares are only memory
        finally:
            self._executor.shutdown(wait=True)
            if self.link is not None:
                self.link.close()
        if failure is not None:
            raise failure

    # ------------------------------------------------------------- background
    def _protect(self, step: int, handle: SaveHandle) -> int:
        """Write, copy and retire, agreeing with every rank after the write and after the copies:
        the outcome this returns (or raises) is every rank's."""
        t0 = time.perf_counter()
        self._tidy(f"removing steps newer than {step}", lambda: self._drop_newer(step))
        error = self._attempt(handle.wait)  # the own copy is committed in node memory
        if error is not None:
            self._saver.acknowledge(handle)  # reported here, by every rank: the saver must not raise it again
        if not self._agree(step, error, "writing it into node memory"):
            raise self._failed(step, error, "writing it into node memory")
        if self.link is not None:
            rounds = self._parity_rounds if self.topology.parity is not None else self._replica_rounds
            error = self._attempt(lambda: rounds(step))
            if not self._agree(step, error, "copying it to its holders"):  # also the barrier
                raise self._failed(step, error, "copying it to its holders")
        # every rank's copies of `step` are complete: older steps may go
        self._tidy(f"retiring steps before {step}", lambda: self.retire_before(step))
        self.last_protected = (step, time.perf_counter() - t0)
        log.debug("memory snapshot of step %d protected in %.3fs", step, self.last_protected[1])
        return step

    @staticmethod
    def _attempt(work: Callable[[], object]) -> BaseException | None:
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - agreed with every rank, then raised by _failed
            return exc
        return None

    def _agree(self, step: int, error: BaseException | None, doing: str) -> bool:
        """Whether no rank failed (alone in the job: whether this one did not); the agreement itself
        failing (a lost peer: the group's timeout) is raised as this step's failure, so the outcome
        always names the step."""
        if self.link is None:
            return error is None
        try:
            return self.link.all_ok(error is None)
        except Exception as exc:  # noqa: BLE001 - raised as the snapshot's failure
            raise self._failed(step, error or exc, doing + " (agreeing on it with every rank)") from exc

    def _refuse(self, step: int, error: BaseException) -> None:
        """The background of a snapshot this rank could not take (:meth:`snapshot`): its failure, agreed."""
        self._agree(step, error, "being taken")
        raise self._failed(step, error, "being taken")

    def _failed(self, step: int, error: BaseException | None, doing: str) -> SaveError:
        where = f"on rank {self.rank}: {type(error).__name__}: {error}" if error is not None else "on another rank"
        exc = SaveError(f"the memory snapshot of step {step} failed {doing} {where}")
        exc.__cause__ = error
        return exc

    def _replica_rounds(self, step: int) -> None:
        """Stream this rank's folder to each replica holder while receiving a source's, file by file
        (:meth:`~ckptkit.memory.exchange.Link.swap_bundles`)."""
        assert self.link is not None
        with self.folder.outgoing(step, self.rank) as out:
            for holder, source in zip(self.topology.replica_holders(self.rank),
                                      self.topology.replica_sources(self.rank)):
                header = self.link.swap(holder, out.header, source)
                with self.folder.incoming(step, source, header) as sink:
                    self.link.swap_bundles(holder, out, source, sink)
                    sink.commit()

    def _parity_rounds(self, step: int) -> None:
        """Fold every member's chunks into the shares of this rank's group: ``g - 1`` rounds (in
        round ``t`` member ``i`` sends its chunk for member ``i + 1 + t`` and receives from
        ``i - 1 - t``), each a window at a time, read from this rank's mapped files and XORed into
        its share's mapped file: the rounds hold two windows, never a chunk."""
        assert self.link is not None and self.topology.parity is not None
        g = self.topology.parity
        members = self.topology.parity_group(self.rank)
        me = members.index(self.rank)
        with self.folder.outgoing(step, self.rank) as out:
            blob = BundleBytes(out.header, out.parts)
            facts = self.link.all_gather((blob.length, blob.digest()))
            lengths = tuple(facts[m][0] for m in members)
            c = parity.chunk_len(max(lengths), g)
            width = min(parity.WINDOW, c)
            send, got = bytearray(width), bytearray(width)
            with self.folder.new_share(step, self.rank, c) as share:
                for r in parity.encode_rounds(me, g, c, width):
                    out_view, in_view = memoryview(send)[: r.n], memoryview(got)[: r.n]
                    blob.read_into(r.send_at, out_view)
                    self.link.swap_parts(members[r.to], [out_view], members[r.frm], [in_view])
                    if r.first:
                        share.view[r.off:r.off + r.n] = in_view
                    else:
                        parity.xor_into(share.view[r.off:r.off + r.n], in_view)
                header = ShareHeader(step, members, me, c, lengths, tuple(facts[m][1] for m in members), share.digest(),
                                     self.run_id)
                self.folder.commit_share(step, self.rank, share, header)

    # ------------------------------------------------------------- retirement
    def retire_before(self, step: int) -> None:
        """Remove this process's entries of steps older than ``step`` (a complete newer one exists),
        keeping their data files as the next snapshot's spares, up to the size of ``step``'s
        (:mod:`ckptkit.memory.spares`: the node folder never holds more than two steps)."""
        spares = self.folder.spares
        if spares is not None:
            spares.drop()  # the ones this step did not need
        room = self.folder.data_bytes(step, self.claims) if spares is not None else 0
        for s in self.folder.steps():
            if s < step:
                room -= self.folder.retire_claimed(s, self.claims, room)

    def discard_after(self, step: int) -> None:
        """Remove this process's entries of steps newer than ``step`` (an abandoned trajectory)."""
        self._wait_quietly()
        self._tidy(f"removing steps newer than {step}", lambda: self._drop_newer(step))

    def _tidy(self, what: str, work: Callable[[], object]) -> None:
        """Remove entries no longer in use; a failure (something in the folder that cannot be
        removed: a directory planted where a share should be, a file without permission) is logged,
        never raised. Raised, it would fail one rank's snapshot or restore alone, after the
        agreements every rank joins: the others would carry on into collectives it never joins.
        What is left is retried at the next snapshot, and a restore checks whatever it finds."""
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - see above
            log.warning("memory tier: %s in %s failed, left for the next snapshot: %s: %s",
                        what, self.folder.root, type(exc).__name__, exc)

    def _drop_newer(self, step: int) -> None:
        """Entries of steps newer than ``step``: a trajectory the run has left (a rollback, a fresh
        start, another run's leftovers). Removed at each snapshot too, so that they never come back
        into use once the run's persistent history again reaches the step they say they followed."""
        for s in self.folder.steps():
            if s > step:
                self.folder.remove_claimed(s, self.claims)

    def _check_budget(self, mine: int) -> None:
        """The node's snapshots (two steps, with their protection) against the budget. Collective.

        Against the folder's free space, what this process's entries already hold there counts as
        room it has: after a restart the folder keeps the newest step, the older of the two the
        budget counts, which the next snapshot's retirement frees or reuses. Counted once as part of
        ``needed`` and again as space taken, it failed every snapshot after a restart on a folder
        sized for two steps (until 2026-12-06)."""
        held = sum(self.folder.data_bytes(s, self.claims) for s in self.folder.steps())
        sizes = self.comm.all_gather((mine, held))
        node = self.topology.node_of(self.rank)
        state = sum(b for r, (b, _) in enumerate(sizes) if self.topology.node_of(r) == node)
        needed = int(2 * self.options.host_factor() * state)
        if self.options.max_host_bytes is not None:
            budget, what, room = self.options.max_host_bytes, "MemoryTier.max_host_bytes", 0
        else:
            budget, what = shutil.disk_usage(self.folder.root).free, f"the free space of {self.folder.root}"
            room = sum(h for r, (_, h) in enumerate(sizes) if self.topology.node_of(r) == node)
        over = needed - room > budget
        if self.comm.any_flags([over])[0]:
            kept = f" (less {_size(room)} its snapshots already hold there)" if room else ""
            raise SaveError(
                f"memory tier: node {node} needs {_size(needed)} of host memory for its snapshots{kept} "
                f"(2 steps x {self.options.host_factor():.2f} x {_size(state)} of state) but {what} is "
                f"{_size(budget)}" if over else "memory tier: another node's snapshots exceed its budget"
            )
        self._budget_checked = True


def _size(n: int | float) -> str:
    """``n`` bytes in the unit that shows it (a 3 MiB state read "0.00 GiB" before)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{int(n)} bytes"
