"""Asynchronous saves: only the snapshot blocks the step; persist and commit run in the background.

Per save, on the training thread:

1. classify the state and fingerprint its structure (local);
2. one tiny all-reduce of flags on the *planning* group: is any rank still
   persisting, did any rank's previous save fail, did any rank's structure
   change, did any rank fail to classify — so every rank takes the same
   branch (wait / skip / raise / replan) and no collective is left unmatched;
3. only if the structure changed: the planning all-gather; otherwise the
   cached plan is reused (steady-state saves run no planning collective);
4. the snapshot into the reusable staging buffer (:mod:`staging`) — or, for a
   rank whose data is larger than ``max_staging_bytes``, staging in waves
   (:mod:`waves`): the background writer starts first and streams each window
   of the data object while the training thread copies the next; ``save``
   returns once the last window is copied;
5. or, with ``AsyncOptions(snapshot="overlap")`` (:mod:`overlap`), no copy at
   all: the versions of the saved tensors are recorded, ``save`` returns, and the
   persist thread copies while training goes on; a guarded optimizer's next
   ``step`` waits for the copy (:mod:`guards`).

Then a background executor checks the target, writes the staged bytes and
the index, and commits, coordinating over a second, dedicated *commit*
group: a background thread never touches the training process group, and
the two checkpoint groups are never used by two threads at once.

A background failure is kept and raised on the next ``save``/``wait``/
``close`` on every rank; a failed save never leaves a committed manifest.
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ckptkit.engine.collective import LocalComm, Outcome, TorchComm
from ckptkit.engine.guards import Guards
from ckptkit.engine.overlap import OverlapSnapshot
from ckptkit.engine.saver import (
    Classified,
    Prepared,
    SaveResult,
    _fail,
    _raise_failures,
    bind,
    check_target_collective,
    commit,
    persist,
    plan_collective,
    write_index,
)
from ckptkit.engine.staging import Staged, StagingPool, snapshot, staged_views
from ckptkit.engine.waves import WaveChannel, WaveSchedule, stage_in_waves, write_waves
from ckptkit.engine.state import flatten_state
from ckptkit.engine.structure import ClassifyMemo
from ckptkit.engine.writer import write_staged
from ckptkit.errors import OptionsError, PreviousSaveFailedError, SaveError, SnapshotRaceError
from ckptkit.options import AsyncOptions
from ckptkit.plan.save_plan import SavePlan
from ckptkit.storage.base import ByteStore

log = logging.getLogger("ckptkit")


@dataclass
class _Waves:
    """A save staged in waves: its schedule, the slots' buffer, and the producer's error if it failed."""

    schedule: WaveSchedule
    buffer: Any
    error: BaseException | None = None


def _settle(future: Future[None], exc: BaseException | None = None) -> None:
    """Resolve ``future`` unless it already is (the training thread and the writer may both try)."""
    if future.done():
        return
    try:
        future.set_exception(exc) if exc is not None else future.set_result(None)
    except Exception:  # noqa: BLE001 - InvalidStateError: the other thread was first
        pass


@dataclass
class SaveHandle:
    """One asynchronous save: ``staged`` resolves when the snapshot is taken (training may
    then change the state freely), ``committed`` when the checkpoint is durable and committed."""

    path: str
    step: int | None
    staged: Future[None]
    committed: Future[SaveResult]
    blocked_seconds: float = 0.0
    #: how to view the staged copy of each saved tensor (rank-local savers only): made on demand,
    #: since only a snapshot lent to a persistent save of the same step needs them
    _views_of_staged: Callable[[], list[Any]] | None = None

    @property
    def staged_tensors(self) -> list[Any] | None:
        """Views of the staged copy of each saved tensor (see :func:`ckptkit.engine.staging.staged_views`)."""
        return self._views_of_staged() if self._views_of_staged is not None else None

    def wait(self, timeout: float | None = None) -> SaveResult:
        return self.committed.result(timeout)

    def done(self) -> bool:
        return self.committed.done()

    def succeeded(self) -> bool:
        """Wait for the save's outcome; whether it committed."""
        try:
            self.committed.result()
        except BaseException:  # noqa: BLE001 - failed, abandoned past its deadline, or cancelled
            return False
        return True


def _unguarded(where: str, here: bool) -> OptionsError:
    return OptionsError(
        f"saving {where}: AsyncOptions(snapshot='overlap') needs a guard on " + ("this rank" if here else "another rank")
        + ": save returns before the state is copied, so the first change of the state must wait for the copy, "
        "and nothing hooks that change. Pass the optimizer(s) that update the saved state (CheckpointManager("
        "guard=...), save_async(guard=...), AsyncSaver.guard(...)), or use snapshot='blocking'")


def _new_comm(process_group: Any) -> LocalComm | TorchComm:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(process_group) == 1:
        return LocalComm()
    ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
    return TorchComm(dist.new_group(ranks=ranks, backend="gloo"), owned=True)


class AsyncSaver:
    """Runs asynchronous saves for one set of ranks. Construct it on every rank (collective unless
    ``rank_local``)."""

    def __init__(self, process_group: Any = None, options: AsyncOptions = AsyncOptions(), *,
                 rank_local: bool = False) -> None:
        """``rank_local``: every rank saves its own checkpoint of its own state, alone (no collective
        at all; the memory tier's per-rank snapshots). Not collective then."""
        self.options = options
        self.rank_local = rank_local
        self.plan_comm = LocalComm() if rank_local else _new_comm(process_group)
        self.commit_comm = LocalComm() if rank_local else _new_comm(process_group)
        self.pool = StagingPool(options.max_staging_bytes, shared=options.executor == "process")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptkit-persist")
        self._writer: Any = None
        self._channel: WaveChannel | None = None
        if options.executor == "process":
            from ckptkit.engine.writer_process import WriterProcess

            self._writer = WriterProcess()
            self._channel = self._writer.channel
        elif options.over_budget == "waves" and options.max_staging_bytes is not None:
            self._channel = WaveChannel.for_threads()
        self._inflight: SaveHandle | None = None
        self._acknowledged: SaveHandle | None = None  # a save whose failure the caller has dealt with
        self._overlap: OverlapSnapshot | None = None  # the overlapped snapshot whose gate is not passed yet
        self._side_streams: dict[Any, Any] = {}
        self.guards = Guards(self.wait_snapshot)
        self._plans: dict[str, SavePlan] = {}
        self._classified = ClassifyMemo()  # the structure of the last save, reused while unchanged
        self._lock = threading.Lock()
        self.closed = False

    @property
    def rank(self) -> int:
        return self.plan_comm.rank

    # ------------------------------------------------------------------ public
    def guard(self, *optimizers: Any) -> None:
        """Make each optimizer's ``step`` wait for an overlapped snapshot (``AsyncOptions(snapshot=
        "overlap")``) before it changes the state: its ``register_step_pre_hook`` calls
        :meth:`wait_snapshot`. Adding one twice hooks it once. Harmless in the blocking mode."""
        self.guards.add(*optimizers)

    def wait_snapshot(self) -> None:
        """Wait until the pending overlapped snapshot no longer needs the state unchanged: on the CPU
        until its copy is done; for GPU tensors until every copy is queued, then the current stream
        waits for them. Then check that no saved tensor changed in place since the save call (such a
        change fails that save). What a guard's hook calls; call it yourself before changing the state
        by any other path. Does nothing when no snapshot is pending."""
        snap = self._overlap
        if snap is not None:
            snap.pass_gate()
            if self._overlap is snap:
                self._overlap = None

    def save(
        self,
        state: dict[str, Any],
        store: ByteStore,
        *,
        step: int | None = None,
        metadata: dict[str, Any] | None = None,
        after_commit: Callable[[SaveResult], None] | None = None,
        deadline: float | None = None,
        private: bool = False,
    ) -> SaveHandle | None:
        """Snapshot ``state`` and persist it in the background. None if skipped (``on_busy="skip"``).
        ``deadline`` (``time.monotonic()``, decided by rank 0): past it, the commit is abandoned. A save
        with one waits for the save in flight even with ``on_busy="skip"``.
        ``private``: the state's tensors are already a private copy that nothing changes until the
        save is committed (the memory tier's staged snapshot of the same step): persisted from as
        they are, with no second copy. Ignored with the process executor, whose writer reads the
        staging buffer it shares."""
        if self.closed:
            raise SaveError("this AsyncSaver is closed")
        t0 = time.perf_counter()
        self.wait_snapshot()  # the previous snapshot's copy is final before anything reuses its buffer
        direct = private and self._writer is None
        overlap = self.options.snapshot == "overlap" and not direct
        cls: Classified | None = None
        failure = Outcome(True)
        try:
            metadata = copy.deepcopy(metadata)  # as at the call: the commit encodes it later (it took later values)
            cls = self._classified.classify(flatten_state(state), self.rank)
        except Exception as exc:  # noqa: BLE001 - carried through the flags below
            failure = _fail(exc)
        prev = self._inflight
        busy = prev is not None and not prev.done()
        prev_failed = prev is not None and prev.done() and self._unacknowledged_failure(prev)
        changed = cls is not None and cls.fingerprint not in self._plans
        any_busy, any_prev_failed, any_changed, any_failed, any_unguarded, any_deadline = self.plan_comm.any_flags(
            [busy, prev_failed, changed, not failure.ok, overlap and not self.guards, deadline is not None]
        )
        if any_unguarded:
            raise _unguarded(store.url, overlap and not self.guards)
        if any_prev_failed:
            self._raise_previous(prev)
        if any_busy:
            # a save with a deadline (a preemption's emergency save) is never skipped: skipped, it left
            # the job training on through its grace period with nothing saved since the one in flight
            if self.options.on_busy == "skip" and not any_deadline:
                log.warning("skipping the save to %s: the previous save is still persisting", store.url)
                return None
            self._wait_inflight()
            if prev is not None and self._unacknowledged_failure(prev):
                # every rank's commit outcome is the same broadcast, so every rank raises here
                self._raise_previous(prev)
        if any_failed:  # every rank is here: one more gather tells each which rank failed, and why
            _raise_failures(self.plan_comm.all_gather(failure), self.rank, store.url, "preparation")
        assert cls is not None
        self._renew_dead_writer()
        plan, planned = self._plan(cls, failure, store.url) if any_changed else (self._plans[cls.fingerprint], Outcome(True))
        prep = bind(plan, cls) if plan is not None else None
        staged_future: Future[None] = Future()
        staged: Staged | None = None
        waves: _Waves | None = None
        snap: OverlapSnapshot | None = None
        if prep is not None and not direct:
            try:
                staged, waves, snap = self._stage(prep, overlap, store.url)
            except Exception as exc:  # noqa: BLE001 - carried to the commit
                planned, prep = _fail(exc), None
        if waves is None and snap is None and (staged is None or staged.ready is None):
            staged_future.set_result(None)
        handle = SaveHandle(store.url, step, staged_future, Future(), time.perf_counter() - t0)
        if self.rank_local and staged is not None and prep is not None:
            handle._views_of_staged = functools.partial(staged_views, prep.plan, prep.tensors, staged.buffer)
        self._inflight = handle
        self._overlap = snap
        self._executor.submit(self._persist, handle, prep, staged, planned, store, metadata, after_commit, deadline,
                              direct, waves, snap)
        if waves is not None and prep is not None:
            self._produce(waves, prep, handle)
            handle.blocked_seconds = time.perf_counter() - t0
        return handle

    def _stage(self, prep: Prepared, overlap: bool,
               where: str) -> tuple[Staged | None, _Waves | None, OverlapSnapshot | None]:
        """One of: the snapshot taken now (blocking), a save to stage in waves (once the writer runs),
        or an overlapped snapshot (copied by the persist thread; the gate is its own until passed)."""
        if overlap:
            return None, None, OverlapSnapshot(prep.plan, prep.tensors,
                                               functools.partial(self.pool.buffer_for, prep.plan), where, prep.watched)
        if self.options.over_budget == "waves" and self.pool.over_budget(prep.plan):
            return None, self._waves_for(prep.plan, prep.tensors), None
        return snapshot(prep.plan, prep.tensors, self.pool), None, None

    def _plan(self, cls: Classified, failure: Outcome, where: str) -> tuple[SavePlan | None, Outcome]:
        """Plan a new structure (collective), refuse it when over the staging budget with
        ``over_budget="error"``, and cache it: one structure at a time, its buffer is the pool's."""
        plan, planned = plan_collective(cls, failure, self.plan_comm, where)
        over = plan is not None and self.pool.over_budget(plan) and self.options.over_budget == "error"
        if self.plan_comm.any_flags([over])[0]:
            raise SaveError(
                f"saving {where}: a snapshot does not fit the staging budget of "
                f"{self.options.max_staging_bytes} bytes on "
                + (f"this rank ({sum(plan.objects.values())} bytes needed)" if over and plan else "another rank")
                + " (AsyncOptions.max_staging_bytes; over_budget='waves' stages it in waves instead)"
            )
        if plan is not None:
            self._plans = {cls.fingerprint: plan}
        return plan, planned

    def wait(self) -> SaveResult | None:
        """Block until the in-flight save (if any) is committed; raise its error."""
        self.wait_snapshot()
        handle = self._inflight
        if handle is None:
            return None
        try:
            return handle.committed.result()
        except BaseException:
            self._inflight = None  # reported once
            if handle is self._acknowledged:
                return None
            raise

    def acknowledge(self, handle: SaveHandle) -> None:
        """The caller has dealt with ``handle``'s failure, now or when it comes: do not raise it again.

        A save still running may be acknowledged: the resilience controller gives up waiting for an
        emergency save at the end of the grace period and records it as abandoned. Acknowledging only
        a finished one made :meth:`wait` (and so ``close``) raise that failure again, and the job's
        clean shutdown after a preemption stopped there."""
        if self._inflight is handle:
            self._acknowledged = handle
            if handle.done():
                self._inflight = None

    def _unacknowledged_failure(self, handle: SaveHandle) -> bool:
        """``handle`` (done) failed, and the caller has not said it dealt with that."""
        return handle.committed.exception() is not None and handle is not self._acknowledged

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.wait()
        finally:
            self.closed = True
            self.guards.remove_all()
            self._executor.shutdown(wait=True)
            if self._writer is not None:
                self._writer.close()
            for comm in (self.plan_comm, self.commit_comm):
                comm.close()  # their gloo threads joined now, not in the interpreter's teardown

    # ------------------------------------------------------------- internals
    def _renew_dead_writer(self) -> None:
        """Start a new writer process if the last one died (the kernel's OOM killer, a signal):
        the save it was writing failed and said so, and every later save used to fail as well
        ("the ckptkit writer process died"), so the job went on without checkpoints or stopped.
        Called with no save in flight (nothing else uses the writer or its channel); rank-local."""
        if self._writer is None or self._writer.alive():
            return
        from ckptkit.engine.writer_process import WriterProcess

        log.warning("the ckptkit writer process died (exit code %s); starting a new one for this save",
                    self._writer.exitcode)
        self._writer.close()
        self._writer = WriterProcess()
        self._channel = self._writer.channel

    def _waves_for(self, plan: SavePlan, tensors: list[Any]) -> _Waves:
        """The schedule and the slots' buffer (the pool's, allocated once at the budget's size) of a
        save staged in waves. The channel is reset here: the previous save is over on both sides."""
        assert self._channel is not None and self.options.max_staging_bytes is not None
        schedule = WaveSchedule.for_budget(sum(plan.objects.values()), self.options.max_staging_bytes)
        on_device = any(t.device.type != "cpu" for t in tensors)
        buffer = self.pool.buffer_of(schedule.buffer_bytes, on_device, plan.rank)
        self._channel.reset()
        return _Waves(schedule, buffer)

    def _produce(self, waves: _Waves, prep: Prepared, handle: SaveHandle) -> None:
        """On the training thread: copy every window, each once the writer freed its slot. A failure
        aborts the writer (the save then fails at its commit, on every rank, and is cleaned up) and
        is reported by ``handle.committed``, as any persist failure is; ``handle.staged`` says it."""
        assert self._channel is not None
        alive = self._writer.alive if self._writer is not None else None
        try:
            stage_in_waves(prep.plan, prep.tensors, waves.buffer, waves.schedule, self._channel, alive)
        except BaseException as exc:
            if not self._channel.aborted:  # our own failure, not the writer's: the save reports it
                waves.error = exc
                self._channel.abort()
            _settle(handle.staged, exc)
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt and the like are the caller's
            return
        _settle(handle.staged)

    def _wait_inflight(self) -> None:
        handle = self._inflight
        if handle is not None:
            try:
                handle.committed.result()
            except BaseException:  # reported through the prev_failed flag on the next save
                pass

    def _raise_previous(self, prev: SaveHandle | None) -> None:
        self._wait_inflight()
        self._inflight = None
        exc = prev.committed.exception() if prev is not None else None
        if exc is not None:
            raise PreviousSaveFailedError(f"the previous checkpoint save failed: {exc}") from exc
        raise PreviousSaveFailedError("the previous checkpoint save failed on another rank")

    def _persist(
        self,
        handle: SaveHandle,
        prep: Prepared | None,
        staged: Staged | None,
        planned: Outcome,
        store: ByteStore,
        metadata: dict[str, Any] | None,
        after_commit: Callable[[SaveResult], None] | None,
        deadline: float | None,
        direct: bool = False,
        waves: _Waves | None = None,
        snap: OverlapSnapshot | None = None,
    ) -> None:
        t0 = time.perf_counter()
        try:
            try:  # this rank's part before the first collective: a failure is carried through them
                if snap is not None:
                    staged, planned = self._copy_overlapped(snap, handle, planned)
                if staged is not None:
                    staged.wait()
                    if not handle.staged.done():
                        handle.staged.set_result(None)
            except Exception as exc:  # noqa: BLE001
                _settle(handle.staged, exc)
                staged, planned = None, _fail(exc) if planned.ok else planned
            comm = self.commit_comm
            target = check_target_collective(store, comm)
            if prep is not None:
                prep = prep.for_attempt(target.attempt)  # the staged bytes' layout is unchanged
            report = planned
            if prep is not None and direct and planned.ok:
                try:  # the tensors are a private copy already: written as they are
                    report = Outcome(True, persist(prep, store, self.options.block_size))
                except Exception as exc:  # noqa: BLE001 - carried through the commit
                    report = _fail(exc)
            elif prep is not None and waves is not None and planned.ok:
                report = self._write_waves(waves, prep, store)
            elif prep is not None and staged is not None and planned.ok:
                try:
                    if self._writer is not None:
                        entries = self._writer.write(store, prep.plan, staged.buffer, self.options.block_size)
                    else:
                        entries = write_staged(store, prep.plan, staged.buffer, self.options.block_size)
                    report = Outcome(True, write_index(prep, store, self.options.block_size, entries))
                except Exception as exc:  # noqa: BLE001 - carried through the commit
                    report = _fail(exc)
            race = snap.verdict() if snap is not None and report.ok else None
            if race is not None:
                report = _fail(race)
            try:
                total = commit(report, prep, store, comm, metadata, deadline, target)
            except SaveError as exc:
                found = race if race is not None else (snap.error if snap is not None else None)
                if isinstance(found, SnapshotRaceError):  # this rank saw it: raised as what it is
                    raise found from exc
                raise
            assert prep is not None
            result = SaveResult(store.url, prep.plan.nbytes, total, handle.blocked_seconds + time.perf_counter() - t0)
            log.info(
                "saved %s asynchronously: %.3f GiB on rank %d (blocked %.3fs, persisted in %.2fs)",
                store.url, prep.plan.nbytes / 2**30, comm.rank, handle.blocked_seconds, time.perf_counter() - t0,
            )
            if after_commit is not None:
                after_commit(result)
            self._stop_waves(waves)
            handle.committed.set_result(result)
        except BaseException as exc:  # noqa: BLE001 - kept for the next save/wait/close
            if snap is not None:
                snap.abandon(exc)
            if waves is None:  # with waves, the training thread owns ``staged``
                _settle(handle.staged, exc)
            self._stop_waves(waves)
            handle.committed.set_exception(exc)

    def _stop_waves(self, waves: Any) -> None:
        """Abort the wave channel (a producer still waiting stops) *before* the handle resolves: the
        resolution wakes the training thread, whose next save resets the channel and stages into it.
        Aborted after (in a ``finally``), it killed that next save ("staging in waves was abandoned"),
        reproduced with a done-callback on the handle (2026-12-06)."""
        if waves is not None and self._channel is not None:
            self._channel.abort()

    def _copy_overlapped(self, snap: OverlapSnapshot, handle: SaveHandle,
                         planned: Outcome) -> tuple[Staged | None, Outcome]:
        """The persist thread's first task in the overlapped mode: the copy into staging. Its failure
        (or a race it saw) fails the save at the commit, on every rank; ``handle.staged`` says it."""
        side = None
        if snap.device is not None:
            import torch

            side = self._side_streams.get(snap.device)
            if side is None:
                side = self._side_streams[snap.device] = torch.cuda.Stream(device=snap.device)
        snap.copy(side)
        if snap.error is not None or snap.buffer is None:
            error = snap.error or SaveError("no staging buffer")
            _settle(handle.staged, error)
            return None, _fail(error) if planned.ok else planned
        return Staged(snap.buffer), planned

    def _write_waves(self, waves: _Waves, prep: Prepared, store: ByteStore) -> Outcome:
        """Stream the data object as the training thread stages it; then the index."""
        assert self._channel is not None
        try:
            if self._writer is not None:
                entries = self._writer.write(store, prep.plan, waves.buffer, self.options.block_size, waves.schedule)
            else:
                entries = write_waves(store, prep.plan, waves.buffer, self.options.block_size, waves.schedule,
                                      self._channel)
            return Outcome(True, write_index(prep, store, self.options.block_size, entries))
        except Exception as exc:  # noqa: BLE001 - carried through the commit
            return _fail(waves.error if waves.error is not None else exc)
