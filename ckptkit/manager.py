"""CheckpointManager: when to save, what to keep, the newest checkpoint to resume from.

    mgr = ckptkit.CheckpointManager(
        "runs/exp1",
        save=ckptkit.SavePolicy(every_steps=100),
        keep=ckptkit.RetentionPolicy(keep_last=3, keep_every=1000, keep_best=ckptkit.BestK("val_loss", 2)),
    )
    step = mgr.restore_latest(state) or 0        # newest checkpoint that loads and verifies
    for step in range(step + 1, total):
        train_step()
        mgr.maybe_save(step, state, metrics={"val_loss": v})   # blocks only for the snapshot
    mgr.close()

Every method is collective over the manager's ranks (call it on every rank).
Decisions that could differ between ranks (a time-based trigger, a
preemption request, which checkpoint is the newest one everybody can see,
whether a load failed) are agreed with tiny all-reduces, so ranks never
diverge into unmatched collectives. The folder itself — step names, each
checkpoint's status, retention, gc, read leases — is :mod:`ckptkit.run_folder`'s.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable


from ckptkit.engine.async_save import AsyncSaver, SaveHandle
from ckptkit.engine.collective import Comm, failure_text, first_rank_does, resolve_comm
from ckptkit.fallback import (newest_that_loads, prune_local_copies, replace_superseded, restore_state,
                              superseded_after)
from ckptkit.engine.saver import SaveResult, save_state
from ckptkit.errors import CheckpointUnreadableError, OptionsError, StorageError
from ckptkit.layout.manifest import MANIFEST_NAME
from ckptkit.manager_inputs import checked_step, metric_values, step_bound
from ckptkit.memory.options import MemoryTier
from ckptkit.options import AsyncOptions, LoadOptions
from ckptkit import run_identity
from ckptkit.retention import Record, RetentionPolicy, RollbackHold
from ckptkit.run_folder import LEASES, MAX_STEP, STEP_PATTERN, RunFolder, StepNaming, step_dir
from ckptkit.storage.tiered import TieredStore, run_cache_name
from ckptkit.storage.url import open_store, overlaps

log = logging.getLogger("ckptkit")

__all__ = ["CheckpointManager", "SavePolicy", "StepNaming", "LEASES", "STEP_PATTERN", "step_dir"]

@dataclass(frozen=True)
class SavePolicy:
    """When :meth:`CheckpointManager.maybe_save` saves: every ``every_steps`` steps, and/or once
    ``every_seconds`` have passed since the last save (agreed across ranks). Neither: only on
    demand (``mgr.save``) or on request (``mgr.request_save``).

    ``agree_requests``: in a job of several ranks, every ``maybe_save`` agrees on pending
    :meth:`~CheckpointManager.request_save` calls with a one-byte all-reduce (ranks see a signal
    at different steps), from the first step on every rank. False saves that all-reduce where the
    policy has no ``every_seconds`` (which needs it anyway); ``request_save`` is then refused.
    Until 2026-12-06 the agreement began on whichever rank got a request first, alone: its
    all-reduce paired with another rank's from a later step, the ranks saved different steps
    into one checkpoint, and the job hung."""

    every_steps: int | None = None
    every_seconds: float | None = None
    agree_requests: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.agree_requests, bool):
            raise OptionsError(f"agree_requests must be True or False, got {self.agree_requests!r}")
        if self.every_steps is not None and (not isinstance(self.every_steps, int) or self.every_steps < 1):
            raise OptionsError(f"every_steps must be a positive integer, got {self.every_steps!r}")
        if self.every_seconds is not None and not self.every_seconds >= 0:
            raise OptionsError(f"every_seconds must be >= 0, got {self.every_seconds!r}")


class CheckpointManager:
    """Periodic asynchronous checkpoints of one run under ``root`` (a path or URL).

    Policies, each a small frozen dataclass: ``save`` (when), ``keep`` (what retention keeps),
    ``asynchronous`` (:class:`AsyncOptions`, or None for synchronous saves), ``load`` (how
    restores read), ``naming`` (step folder names). ``local_dir``: node-local disk in front of an
    object store (storage/tiered.py). ``lease_seconds``: how long a restore's read lease
    protects a checkpoint from retention. ``memory``: a :class:`~ckptkit.MemoryTier` in front of
    the persistent checkpoints: snapshots into node memory every few steps, protected by peer
    replicas or parity, restored from first when they are the newest (docs/memory_tier.md).
    ``guard``: the optimizer(s) whose ``step`` changes the saved state (one, or a list). Needed by
    ``AsyncOptions(snapshot="overlap")``, where ``maybe_save`` returns before the state is copied
    and a guard's next ``step`` waits for the copy (see :meth:`guard`, docs/overlap.md); harmless
    otherwise.
    """

    def __init__(
        self,
        root: str,
        *,
        save: SavePolicy = SavePolicy(),
        keep: RetentionPolicy = RetentionPolicy(),
        asynchronous: AsyncOptions | None = AsyncOptions(),
        load: LoadOptions = LoadOptions(),
        naming: StepNaming = StepNaming(),
        local_dir: str | None = None,
        storage_options: dict[str, Any] | None = None,
        process_group: Any = None,
        lease_seconds: float = 3600.0,
        memory: MemoryTier | None = None,
        guard: Any = None,
    ) -> None:
        if asynchronous is not None and not isinstance(asynchronous, AsyncOptions):
            raise OptionsError(f"asynchronous must be AsyncOptions(...) or None (synchronous saves), got {asynchronous!r}")
        store = open_store(root, storage_options)
        if local_dir is not None:  # node-local disk in front of the (object) store: see storage/tiered.py
            if overlaps(local_dir, root):
                raise OptionsError(f"local_dir {local_dir} overlaps the run's folder {root}: give it a folder of its own")
            authoritative = {MANIFEST_NAME, run_identity.RUN_FILE, ".ckptkit/", f"{LEASES}/"}  # unchecksummed, changing
            local = open_store(local_dir).child(run_cache_name(store.url))  # this run's own folder in local_dir
            store = TieredStore(local, store, remote_only=frozenset(authoritative))
        self.root = store
        self.folder = RunFolder(store, naming, lease_seconds)
        self.save_policy = save
        self.retention = keep
        self.options = asynchronous if asynchronous is not None else AsyncOptions()
        self.load_options = load
        self._saver = AsyncSaver(process_group, asynchronous) if asynchronous is not None else None
        self._comm: Comm = self._saver.plan_comm if self._saver is not None else resolve_comm(process_group)
        self._last_save = time.monotonic()
        self._save_requested = threading.Event()
        # decided once, the same on every rank: a request seen by one rank is agreed at the next step
        self._agree_requests = save.agree_requests and self._comm.world_size > 1
        # step folders of saves started and not yet committed or failed: what gc must leave alone. A set
        # under a lock: one name, cleared by the previous save's commit while the next one waited for it,
        # let gc delete the save in flight (reproduced: the step still committed, and a restore fell back)
        self._inflight_names: set[str] = set()
        self._inflight_lock = threading.Lock()
        self._last_handle: SaveHandle | None = None
        #: (checkpoint, reason) of every damaged checkpoint the last restore skipped, newest first
        self.skipped: list[tuple[str, str]] = []
        self._superseded: dict[str, int] = {}  # rank 0: damaged step folders newer than the step restored
        #: what the last restore did (step, source, every rank's source, seconds); None before one
        self.last_restore: Any = None
        if memory is not None and not isinstance(memory, MemoryTier):
            raise OptionsError(f"memory must be ckptkit.MemoryTier(...) or None, got {memory!r}")
        self._memory: Any = None
        # the persistent steps this run's trajectory has committed (since its restore), and the newest
        # whose save it started: recorded in each memory snapshot, which a restore then refuses if the
        # committed one was deleted, or if a persistent step it never saved lies between them and it
        self._lineage: list[int] = []
        self._started = -1
        self._lineage_lock = threading.Lock()
        self._rollback_hold: RollbackHold | None = None  # what spike rollbacks may still restore
        if memory is not None:
            import torch.distributed as dist

            from ckptkit.memory.tier import MemorySnapshots

            ranks = (dist.get_process_group_ranks(process_group)
                     if process_group is not None and dist.is_initialized() else None)
            self._memory = MemorySnapshots(memory, self._comm, store.url, ranks,
                                           run_id=run_identity.agree(store, self._comm))
        if guard is not None:
            self.guard(*(guard if isinstance(guard, (list, tuple)) else (guard,)))

    @property
    def rank(self) -> int:
        return self._comm.rank

    # ------------------------------------------------------------------ saving
    def guard(self, *optimizers: Any) -> None:
        """Hook each optimizer's ``step`` (``register_step_pre_hook``) so that, with
        ``AsyncOptions(snapshot="overlap")``, it waits for the pending snapshot's background copy
        before it changes the state. Until a guard's step begins, nothing else may change a saved
        tensor in place; a change that does is caught and fails that save (docs/overlap.md)."""
        if self._saver is not None:
            self._saver.guard(*optimizers)

    def wait_snapshot(self) -> None:
        """Wait until the pending overlapped snapshot no longer needs the state unchanged (what a
        guard's hook does): call it before changing the saved state by a path no guard hooks."""
        if self._saver is not None:
            self._saver.wait_snapshot()

    def request_save(self) -> None:
        """Ask for a save at the next :meth:`maybe_save` (e.g. from a preemption signal handler); every
        rank saves at the first step at which any rank has asked (``SavePolicy.agree_requests``). A
        request stays pending until a save starts; one skipped as busy, refused or failed before it starts,
        or a synchronous one that failed, leaves it pending."""
        if self._comm.world_size > 1 and not self._agree_requests:
            log.error("%s: request_save ignored: this job's SavePolicy(agree_requests=False) does not agree on "
                      "requests, and a request seen by some ranks only would save different steps", self.root.url)
            return
        self._save_requested.set()

    def enable_save_requests(self) -> None:
        """Deprecated: requests are agreed from the start (``SavePolicy(agree_requests=True)``, the default)."""
        import warnings

        warnings.warn("CheckpointManager.enable_save_requests() is no longer needed: save requests are agreed from "
                      "the first step (SavePolicy(agree_requests=True), the default)", DeprecationWarning, stacklevel=2)

    def should_save(self, step: int) -> bool:
        """Whether :meth:`maybe_save` would save at ``step`` (collective in a job of several ranks when
        the policy has ``every_seconds`` or agrees on requests; call it on every rank)."""
        policy = self.save_policy
        wants = policy.every_steps is not None and step % policy.every_steps == 0
        local = self._save_requested.is_set() or (
            policy.every_seconds is not None and time.monotonic() - self._last_save >= policy.every_seconds)
        if self._comm.world_size == 1:
            return wants or local
        if policy.every_seconds is not None or self._agree_requests:
            return self._comm.any_flags([wants or local])[0]
        return wants

    def maybe_save(self, step: int, state: dict[str, Any], *, metrics: dict[str, Any] | None = None,
                   due: bool | None = None) -> SaveHandle | None:
        """Save if the policy says so; return the handle (None if nothing was saved).

        With a memory tier, also snapshot into node memory at its own interval (the snapshot
        blocks the step like a persistent save's does; its protection runs in the background).
        ``due``: :meth:`should_save`'s answer for this step when the caller already asked (it is
        collective with ``every_seconds`` or requests, and a second question could be answered
        otherwise); None asks it here. The memory tier's snapshot is taken either way: a caller
        that decided alone when to call :meth:`save` used to bypass it (the resilience controller
        did, so a tier under it never held a step)."""
        step = self._step(step)
        snapshot = self._memory is not None and step % self._memory.options.every_steps == 0
        due = self.should_save(step) if due is None else bool(due)
        mirror = None
        failed: Exception | None = None
        if snapshot:
            # a persistent save at the same step persists from the memory snapshot: one copy of the state
            lend = self._saver is not None and self.options.executor == "thread" and due
            base = self._lineage_base()
            started = max(base, step if due else self._started)
            try:
                _, mirror = self._memory.snapshot(step, state, lend=lend, base=base, started=started)
            except Exception as exc:  # noqa: BLE001 - raised below, once the persistent save due is under way
                # a failing memory tier (node memory full) must not cost the persistent checkpoints too:
                # every due one used to be skipped while the tier failed
                failed, mirror = exc, None
        handle = None
        if due:
            handle = self.save(step, mirror if mirror is not None else state, metrics=metrics,
                               private=mirror is not None)
            if handle is not None and mirror is not None:
                self._memory.lent_to(handle.committed)
        if failed is not None:
            if handle is not None:
                log.error("%s: the persistent save of step %d is under way (%s); the memory tier failed: %s",
                          self.root.url, step, handle.path, failed)
            raise failed
        return handle

    def _step(self, step: Any) -> int:
        return checked_step(step, self.root.url)

    def _bound(self, value: Any, what: str) -> int:
        return step_bound(value, what, self.root.url)

    def _lineage_base(self) -> int:
        """The newest persistent step committed on this trajectory (-1: none)."""
        with self._lineage_lock:
            return self._lineage[-1] if self._lineage else -1

    def _set_lineage(self, steps: list[int]) -> None:
        """After a restore or a discard (no save in flight): the committed steps are the started ones."""
        with self._lineage_lock:
            self._lineage = sorted(set(steps))
            self._started = self._lineage[-1] if self._lineage else -1
        self._last_handle = None  # a step saved before a restore or a rollback is not "saved already"

    def save(self, step: int, state: dict[str, Any], *, metrics: dict[str, Any] | None = None,
             deadline: float | None = None, private: bool = False) -> SaveHandle | None:
        """Save now (on demand). Asynchronous unless the manager was made with ``asynchronous=None``.
        The step this manager saved last (in flight or committed, since its last restore or discard)
        is not saved again once committed: its handle is returned (a final ``save`` after a ``maybe_save``).

        ``deadline`` (``time.monotonic()`` on rank 0): a save that could not be committed by then
        is abandoned cleanly — no manifest, leftovers removed (preemption grace periods).
        ``private``: the state's tensors are a private copy nothing changes until the save is
        committed (what :meth:`maybe_save` passes with the memory tier's snapshot of the same step),
        so they are persisted from without a second copy.
        """
        step = self._step(step)
        last = self._last_handle
        if last is not None and last.step == step and self._comm.all_min([int(not last.done() or last.succeeded())])[0]:
            # a final save after a periodic one; a failed save (on any rank's view) is saved again (not until 2026-12-06)
            log.info("%s: step %d is being or was saved already by this manager: its save is returned",
                     self.root.url, step)
            return last
        requested = self._save_requested.is_set()
        self._save_requested.clear()  # before the save starts: a request that comes during it is for the next
        try:
            handle = self._start_save(step, state, metrics, deadline, private)
        except BaseException:
            if requested:  # no save started (a metric refused, the last save's failure raised), or this one failed
                self._save_requested.set()  # still pending: until 2026-12-06 a preemption's request was lost here
            raise
        if handle is None and requested:  # skipped on every rank (on_busy="skip"): pending for the next step
            self._save_requested.set()
        return handle

    def _start_save(self, step: int, state: dict[str, Any], metrics: dict[str, Any] | None, deadline: float | None,
                    private: bool) -> SaveHandle | None:
        name = self.folder.naming.name(step)
        store = self.root.child(name)
        self._replace_superseded(step)
        retention = self.retention.to_json()
        if self._rollback_hold is not None:  # `ckptkit ls` then shows what the controller holds
            retention["rollback"] = self._rollback_hold.to_json()
        metadata = {"step": step, "metrics": metric_values(metrics, self.root.url), "retention": retention}
        if self._saver is None:
            result = save_state(state, store, self._comm, block=self.options.block_size,
                                metadata=metadata, deadline=deadline)
            self._last_save = time.monotonic()
            self._after_commit(name, step, result)
            self._started = max(self._started, step)
            done: Future[SaveResult] = Future()
            done.set_result(result)
            staged: Future[None] = Future()
            staged.set_result(None)
            self._last_handle = SaveHandle(store.url, step, staged, done, result.seconds)
            return self._last_handle
        with self._inflight_lock:
            self._inflight_names.add(name)
        try:
            handle = self._saver.save(
                state, store, step=step, metadata=metadata, after_commit=lambda r: self._after_commit(name, step, r),
                deadline=deadline, private=private,
            )
        except BaseException:
            self._settled(name)
            raise
        if handle is None:  # skipped on every rank (on_busy="skip")
            self._settled(name)
            return None
        handle.committed.add_done_callback(lambda _: self._settled(name))  # committed, or failed
        self._last_save = time.monotonic()
        self._last_handle = handle
        self._started = max(self._started, step)
        return handle

    def _settled(self, name: str) -> None:
        with self._inflight_lock:
            self._inflight_names.discard(name)

    def _note_superseded(self, restored: int | None) -> None:
        """Rank 0, after a restore: the damaged step folders newer than ``restored``, each replaced when
        the run saves its step again (:func:`ckptkit.fallback.superseded_after`)."""
        if self.rank == 0:
            try:  # rank 0 alone: a listing failing here must not fail a restore the other ranks finished
                self._superseded = superseded_after(self.folder, self.skipped, restored)
            except Exception as exc:  # noqa: BLE001 - bookkeeping: the damaged folders just stay (logged)
                log.warning("%s: could not list the damaged checkpoints newer than the one restored (%s); they stay, "
                            "and a save of their step will be refused until they are moved aside", self.root.url, exc)

    def _replace_superseded(self, step: int) -> None:
        if self.rank == 0:
            replace_superseded(self.folder, self._superseded, self.skipped, step)

    def wait(self) -> SaveResult | None:
        """Block until the in-flight save is committed (and the memory tier's snapshot protected);
        raise a background failure."""
        if self._memory is not None:
            self._memory.wait()
        return self._saver.wait() if self._saver is not None else None

    def acknowledge(self, handle: SaveHandle) -> None:
        """A failed save the caller has handled (e.g. an abandoned emergency save): not raised again."""
        if self._saver is not None:
            self._saver.acknowledge(handle)

    def close(self) -> None:
        try:
            if self._memory is not None:
                self._memory.close()
        finally:
            if self._saver is not None:
                self._saver.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --------------------------------------------------------------- the folder
    def hold_for_rollback(self, hold: RollbackHold | None) -> None:
        """From now on, keep whatever ``keep`` says the checkpoints spike rollbacks may still restore
        (:class:`~ckptkit.retention.RollbackHold`); None ends the hold. Read when a later commit
        applies retention.

        The :class:`~ckptkit.ResilienceController` calls it at every step. Without it,
        ``keep_last=1`` (or any ``keep_last`` covering fewer than ``Rollback.steps_before`` steps of
        saves) deleted every checkpoint old enough to roll back to, and the run stopped for a human
        at its first spike episode."""
        if hold is not None and not isinstance(hold, RollbackHold):
            raise OptionsError(f"hold_for_rollback takes a ckptkit.retention.RollbackHold or None, got {hold!r}")
        self._rollback_hold = hold

    def _after_commit(self, name: str, step: int, result: SaveResult) -> None:
        self._settled(name)
        with self._lineage_lock:
            self._lineage = sorted({*self._lineage, step})
        if self.rank == 0:
            self.folder.apply_retention(self.retention, after=name, rollback=self._rollback_hold,
                                        distrusted=frozenset(self._superseded.copy()))  # copy(): atomic
        if isinstance(self.root, TieredStore):
            with self._inflight_lock:
                keep = frozenset(self._inflight_names)
            prune_local_copies(self.root, step, keep)

    def discard_after(self, step: int) -> list[str]:
        """Delete committed checkpoints newer than ``step`` (rank 0; call on every rank, and each gets
        the names deleted).

        After a rollback those belong to an abandoned trajectory: the run will
        save those step numbers again, and a restart must never resume from them.
        A newer checkpoint that cannot be read right now is uncommitted all the
        same (its manifest deleted); if even that fails, this raises rather than
        leave a checkpoint a restart could resume from: on every rank (the
        outcome is broadcast), so none goes on training alone.
        """
        step = self._bound(step, "discard_after")
        self.wait()
        self._set_lineage([s for s in self._lineage if s <= step])
        if self._memory is not None:
            self._memory.discard_after(step)
        removed, failure = first_rank_does(self._comm, lambda: self.folder.discard_after(step),
                                           f"discarding the checkpoints after step {step}")
        if failure is not None:
            raise StorageError(f"{self.root.url}: discarding the checkpoints after step {step} failed on rank 0 "
                               f"(a restart could resume from one of them): {failure}")
        return [str(name) for name in removed]

    def records(self) -> list[Record]:
        """Every step folder under the root with its status (see :meth:`RunFolder.records`)."""
        return self.folder.records()

    def gc(self) -> list[str]:
        """Remove uncommitted step folders (leftovers of crashed saves). Rank 0 does the work.

        Only folders known to hold no manifest, checked again right before removal; unreadable
        and damaged ones are left for a human (``ckptkit ls`` says why)."""
        if self.rank != 0:
            return []
        with self._inflight_lock:
            keep = frozenset(self._inflight_names)
        return self.folder.gc(keep)

    # ---------------------------------------------------------------- restore
    def latest_common_step(self, at_most: int | None = None) -> int | None:
        """The newest committed step (<= ``at_most``) that every rank sees, or None (collective).

        Raises :class:`CheckpointUnreadableError` on every rank when some rank cannot read a
        checkpoint newer than that (a store failure, after retries): returning the older step
        would silently resume back in time. Damaged checkpoints (a manifest that fails its checks)
        are skipped with a warning."""
        return self._common_steps(None if at_most is None else self._bound(at_most, "at_most"))[0]

    def _common_steps(self, at_most: int | None) -> tuple[int | None, int, tuple[int, ...]]:
        """:meth:`latest_common_step`; the newest step folder holding a manifest (committed, or one
        that fails its checks; at any step) on any rank, -1 if none; and the steps of those this rank
        sees. What a memory snapshot's lineage is checked against (:func:`ckptkit.memory.restore._foreign`)."""
        bound = MAX_STEP if at_most is None else at_most
        try:
            everything, listing = self.records(), None
        except Exception as exc:  # noqa: BLE001 - agreed below: a rank failing alone left the others waiting
            everything, listing = [], f"listing the run's checkpoints failed: {failure_text(exc, 'listing')}"
        steps = tuple(r.step for r in everything if r.status != "uncommitted")
        present = max(steps, default=-1)
        records = [r for r in everything if r.step <= bound]
        mine = max((r.step for r in records if r.committed), default=-1)
        blind = [r for r in records if r.status == "unreadable" and r.step > mine]
        problem = listing or (f"{blind[-1].name}: {blind[-1].reason}" if blind else None)
        for r in records:
            if r.status == "damaged" and r.step > mine:
                log.warning("skipping %s: %s", r.name, r.reason)
        step, least_present = self._comm.all_min([mine, -present])
        problems = self._comm.all_gather(problem)
        seen = [(rank, p) for rank, p in enumerate(problems) if p is not None]
        if seen:
            rank, text = seen[0]
            raise CheckpointUnreadableError(
                f"{self.root.url}: cannot tell which checkpoint is the newest: {text} (rank {rank}); "
                f"not falling back to an older one. Retry when the store answers, or pass at_most= to "
                "restore an older step on purpose"
            )
        return None if step < 0 else step, -least_present, steps

    def step_url(self, step: int) -> str:
        """The URL of step ``step``'s folder (what the framework adapters load from)."""
        return self.folder.url_of(step)

    def restore_latest(self, state: dict[str, Any], *, strict: bool = True, at_most: int | None = None,
                       at_least: int | None = None) -> int | None:
        """Load the newest checkpoint (with step <= ``at_most``, if given) that every rank can see
        and that loads and verifies.

        Returns its step, or None when there is none. Damaged checkpoints
        (uncommitted, unreadable metadata, checksum failures, missing objects)
        are skipped with a logged reason, falling back to older ones; a state
        that does not match the checkpoint raises instead. ``at_least``: never fall back below
        that step (:class:`~ckptkit.errors.RestoreFloorError` instead), for a caller that knows
        of training there that an older step would throw away.

        With a memory tier, a step in node memory (own, a peer's copy, a parity rebuild) at least
        as new as the newest persistent checkpoint is restored from there instead. Either way
        :attr:`last_restore` says what happened.
        """
        t0 = time.perf_counter()
        at_most = None if at_most is None else self._bound(at_most, "at_most")
        floor = -1 if at_least is None else self._bound(at_least, "at_least")
        self.wait()
        self.skipped = []
        return restore_state(self, state, strict, at_most, floor, t0)

    def _restored_persistent(self, restore: Callable[[], int | None], t0: float,
                             memory: list[tuple[Any, int]] | None = None) -> int | None:
        """A restore from the persistent checkpoints (``restore()``: the step, None: none), whoever loads
        it, and what follows. A failed one went past damaged steps all the same: noted, for retention
        and for the saves of their steps (they counted as good, and deleted the run's new saves).
        ``memory``: where the fallback took a memory snapshot instead (its RestoreInfo, and the
        persistent step below it, its lineage), filled by ``restore()``."""
        try:
            step = restore()
        except BaseException:
            with contextlib.suppress(Exception):  # the restore's own failure is what the caller gets
                self._note_superseded(None)
            raise
        self._note_superseded(step)
        if memory:
            return self._restored_from_memory(*memory[-1])
        if step is not None:
            from ckptkit.memory.restore import RestoreInfo

            sources = ("persistent",) * self._comm.world_size
            self.last_restore = RestoreInfo(step, "persistent", sources, time.perf_counter() - t0)
            if self._memory is not None:
                self._memory.discard_after(step)
        self._set_lineage([] if step is None else [step])
        return step

    def _restored_from_memory(self, info: Any, base: int | None) -> int:
        """A restore the memory tier made (``info``, a RestoreInfo); ``base``: the newest persistent step
        below it (None or -1: none), the lineage the next snapshots record."""
        self.last_restore = info
        self._set_lineage([] if base is None or base < 0 else [base])
        return info.step

    def restore_latest_with(self, load: Callable[[str], Any], *, at_most: int | None = None,
                            at_least: int | None = None) -> tuple[int, Any] | None:
        """:meth:`restore_latest` for a caller that loads a checkpoint its own way (a framework adapter).

        ``load(url)`` loads the checkpoint folder at ``url`` into the caller's objects, collectively
        on the manager's ranks, and returns what the caller wants back. The newest committed step
        (<= ``at_most``, and never below ``at_least``) that loads: a damaged one (checksums, missing objects, bad metadata) is
        skipped with its reason logged and listed in :attr:`skipped`, and the next older one is
        tried; a mismatch between the caller's objects and the checkpoint is raised. Returns
        ``(step, what load returned)``, or None when nothing is committed. Persistent checkpoints only
        (the memory tier restores a state dict: :meth:`restore_latest`).

        The DeepSpeed and Megatron checkpointers loaded the newest committed step directly, so one
        whose data had been damaged failed every restart of the job, and it took a human to move it
        aside (until 2026-12-06)."""
        t0 = time.perf_counter()
        bound = MAX_STEP if at_most is None else self._bound(at_most, "at_most")
        floor = -1 if at_least is None else self._bound(at_least, "at_least")
        self.wait()
        self.skipped = []
        got: list[Any] = []

        def load_step(name: str) -> tuple[str, ...]:
            got[:] = [load(self.root.child(name).url)]
            return ()

        step = self._restored_persistent(lambda: newest_that_loads(self, load_step, bound, False, floor), t0)
        return None if step is None else (step, got[0])
