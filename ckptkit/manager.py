"""CheckpointManager: step folders, save policies, retention, newest-valid restore, gc.

    mgr = ckptkit.CheckpointManager("runs/exp1", every_steps=100, keep_last=3, keep_every=1000,
                                    keep_best=("val_loss", 2))
    step = mgr.restore_latest(state) or 0        # newest checkpoint that loads and verifies
    for step in range(step + 1, total):
        train_step()
        mgr.maybe_save(step, state, metrics={"val_loss": v})   # blocks only for the snapshot
    mgr.close()

Every method is collective over the manager's ranks (call it on every rank).
Decisions that could differ between ranks (a time-based trigger, a
preemption request, which checkpoint is the newest one everybody can see,
whether a load failed) are agreed with tiny all-reduces, so ranks never
diverge into unmatched collectives.

Retention runs on rank 0 after each commit and deletes a checkpoint by
removing its manifest first (it is then merely uncommitted) and its files
after, so a crash mid-deletion never leaves a committed but partial
checkpoint. A checkpoint being read by a restore holds a lease and is not
deleted.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any

from ckptkit.engine.async_save import AsyncSaver, SaveHandle
from ckptkit.engine.checkpoint_dir import remove_uncommitted
from ckptkit.engine.collective import Comm, resolve_comm
from ckptkit.engine.loader import load_state
from ckptkit.engine.metadata_io import read_manifest
from ckptkit.engine.saver import SaveResult, save_state
from ckptkit.engine.state import flatten_state
from ckptkit.errors import (
    CheckpointNotFoundError,
    CheckpointUnreadableError,
    CkptkitError,
    CorruptCheckpointError,
    CoverageError,
    ManifestError,
    PeerFailureError,
    StorageError,
    UncommittedCheckpointError,
)
from ckptkit.layout.manifest import MANIFEST_NAME
from ckptkit.options import AsyncOptions, LoadOptions
from ckptkit.retention import BestK, Record, RetentionPolicy, decide, unknown
from ckptkit.storage.tiered import TieredStore
from ckptkit.storage.url import open_store

log = logging.getLogger("ckptkit")

STEP_PATTERN = re.compile(r"^step-(\d+)$")
LEASES = ".leases"
# Failures that mean "this checkpoint is unusable, try an older one" — not "the state is wrong",
# and not a storage or network failure (StorageError), which says nothing about the checkpoint:
# falling back on those would silently restore an older step, or none.
_DAMAGED = (CorruptCheckpointError, ManifestError, CheckpointNotFoundError, CoverageError)


def step_dir(step: int) -> str:
    return f"step-{step:07d}"


def _best(value: Any) -> BestK | None:
    if value is None or isinstance(value, BestK):
        return value
    return BestK(*value)


class CheckpointManager:
    """Periodic asynchronous checkpoints of one run under ``root`` (a path or URL)."""

    def __init__(
        self,
        root: str,
        *,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: tuple | BestK | None = None,
        asynchronous: bool = True,
        options: AsyncOptions = AsyncOptions(),
        load_options: LoadOptions = LoadOptions(),
        process_group: Any = None,
        storage_options: dict[str, Any] | None = None,
        lease_seconds: float = 3600.0,
        local_dir: str | None = None,
    ) -> None:
        self.root = open_store(root, storage_options)
        if local_dir is not None:
            # node-local disk in front of the (object) store: see storage/tiered.py
            self.root = TieredStore(open_store(local_dir), self.root)
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.retention = RetentionPolicy(keep_last, keep_every, _best(keep_best))
        self.options = options
        self.load_options = load_options
        self.lease_seconds = lease_seconds
        self._saver = AsyncSaver(process_group, options) if asynchronous else None
        self._comm: Comm = self._saver.plan_comm if self._saver is not None else resolve_comm(process_group)
        self._last_save = time.monotonic()
        self._save_requested = threading.Event()
        self._agree_requests = False
        self._records: dict[str, Record] = {}
        self._inflight_name: str | None = None
        self._last_handle: SaveHandle | None = None
        #: (checkpoint, reason) of every damaged checkpoint the last restore skipped, newest first
        self.skipped: list[tuple[str, str]] = []

    @property
    def rank(self) -> int:
        return self._comm.rank

    # ------------------------------------------------------------------ saving
    def request_save(self) -> None:
        """Ask for a save at the next :meth:`maybe_save` (e.g. from a preemption signal handler).

        Ranks may see the request at different steps, so once requests are
        in use every ``maybe_save`` agrees on it with a one-byte all-reduce.
        """
        self._agree_requests = True
        self._save_requested.set()

    def enable_save_requests(self) -> None:
        """Agree on save requests at every step from now on (call on every rank)."""
        self._agree_requests = True

    def should_save(self, step: int) -> bool:
        """Whether :meth:`maybe_save` would save at ``step`` (collective when time or requests matter)."""
        wants = self.every_steps is not None and step % self.every_steps == 0
        if self.every_seconds is not None or self._agree_requests:
            local = self._save_requested.is_set() or (
                self.every_seconds is not None and time.monotonic() - self._last_save >= self.every_seconds
            )
            wants = self._comm.any_flags([wants or local])[0]
        return wants

    def maybe_save(self, step: int, state: dict[str, Any], *, metrics: dict[str, Any] | None = None) -> SaveHandle | None:
        """Save if the policy says so; return the handle (None if nothing was saved)."""
        if not self.should_save(step):
            return None
        return self.save(step, state, metrics=metrics)

    def save(self, step: int, state: dict[str, Any], *, metrics: dict[str, Any] | None = None,
             deadline: float | None = None) -> SaveHandle | None:
        """Save now (on demand). Asynchronous unless the manager was made with ``asynchronous=False``.

        ``deadline`` (``time.monotonic()`` on rank 0): a save that could not be committed by then
        is abandoned cleanly — no manifest, leftovers removed (preemption grace periods).
        """
        self._save_requested.clear()
        self._last_save = time.monotonic()
        name = step_dir(step)
        store = self.root.child(name)
        metadata = {"step": step, "metrics": dict(metrics or {}), "retention": self.retention.to_json()}
        if self._saver is None:
            result = save_state(flatten_state(state), store, self._comm, block=self.options.block_size,
                                metadata=metadata, deadline=deadline)
            self._after_commit(name, result)
            done: Future[SaveResult] = Future()
            done.set_result(result)
            staged: Future[None] = Future()
            staged.set_result(None)
            return SaveHandle(store.url, step, staged, done, result.seconds)
        self._inflight_name = name
        handle = self._saver.save(
            state, store, step=step, metadata=metadata, after_commit=lambda r: self._after_commit(name, r),
            deadline=deadline,
        )
        if handle is not None:
            self._last_handle = handle
        return handle

    def wait(self) -> SaveResult | None:
        """Block until the in-flight save is committed; raise a background failure."""
        return self._saver.wait() if self._saver is not None else None

    def acknowledge(self, handle: SaveHandle) -> None:
        """A failed save the caller has handled (e.g. an abandoned emergency save): not raised again."""
        if self._saver is not None:
            self._saver.acknowledge(handle)

    def close(self) -> None:
        if self._saver is not None:
            self._saver.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --------------------------------------------------------------- retention
    def _after_commit(self, name: str, result: SaveResult) -> None:
        self._inflight_name = None
        if self.rank != 0 or self.retention.keeps_everything:
            return
        try:
            records = self.records()
            blind = unknown(records)
            if blind:  # never delete on uncertainty: the unreadable one may be the newest committed
                log.warning("retention after %s: skipped, %s could not be read (%s)", name, blind[0].name,
                            blind[0].reason)
                return
            decision = decide(records, self.retention)
            for victim in decision.delete:
                if self._leased(victim):
                    log.info("retention: keeping %s for now, a restore is reading it", victim)
                    continue
                self._delete(victim)
        except (CkptkitError, OSError) as exc:  # retention never fails a save
            log.warning("retention after %s failed: %s", name, exc)

    def _delete(self, name: str) -> None:
        store = self.root.child(name)
        store.delete(MANIFEST_NAME)  # uncommit first: a crash from here on leaves garbage, never a partial checkpoint
        self._records.pop(name, None)
        try:
            remove_uncommitted(store)
            log.info("retention: deleted %s", name)
        except CkptkitError as exc:
            log.warning("retention: %s is uncommitted now but not removed: %s", name, exc)

    def discard_after(self, step: int) -> list[str]:
        """Delete committed checkpoints newer than ``step`` (rank 0; call on every rank).

        After a rollback those belong to an abandoned trajectory: the run will
        save those step numbers again, and a restart must never resume from them.
        A newer checkpoint that cannot be read right now is uncommitted all the
        same (its manifest deleted); if even that fails, this raises rather than
        leave a checkpoint a restart could resume from.
        """
        self.wait()
        removed: list[str] = []
        if self.rank == 0:
            for rec in self.records():
                if rec.status != "uncommitted" and rec.step > step:
                    self._delete(rec.name)
                    removed.append(rec.name)
        return removed

    def records(self) -> list[Record]:
        """Every step folder under the root with its status, read once per committed manifest.

        Listing failures raise. A folder whose manifest cannot be read because the store failed is
        ``unreadable`` (with the reason), never mistaken for an uncommitted one."""
        out = []
        for name in self.root.list_children():
            m = STEP_PATTERN.match(name)
            if m is None:
                continue
            cached = self._records.get(name)
            if cached is not None:
                out.append(cached)
                continue
            rec = self._read_record(name, int(m.group(1)))
            if rec.committed:
                self._records[name] = rec
            out.append(rec)
        return sorted(out, key=lambda r: r.step)

    def _read_record(self, name: str, step: int) -> Record:
        store = self.root.child(name)
        try:
            if not store.exists(MANIFEST_NAME):
                return Record(name, step, False)
            meta = read_manifest(store).meta.get("user", {})
        except UncommittedCheckpointError:  # deleted between the two reads
            return Record(name, step, False)
        except (StorageError, OSError) as exc:
            return Record(name, step, False, status="unreadable", reason=str(exc))
        except CkptkitError as exc:
            return Record(name, step, False, status="damaged", reason=str(exc))
        metrics = meta.get("metrics") if isinstance(meta, dict) else None
        return Record(name, step, True, metrics if isinstance(metrics, dict) else {})

    def gc(self) -> list[str]:
        """Remove uncommitted step folders (leftovers of crashed saves). Rank 0 does the work.

        Only folders known to hold no manifest, checked again right before removal; unreadable
        and damaged ones are left for a human (``ckptkit ls`` says why)."""
        removed: list[str] = []
        if self.rank != 0:
            return removed
        for rec in self.records():
            if rec.status != "uncommitted" or rec.name == self._inflight_name:
                continue
            try:
                remove_uncommitted(self.root.child(rec.name))
                removed.append(rec.name)
                log.info("gc: removed uncommitted %s", rec.name)
            except CkptkitError as exc:
                log.warning("gc: left %s in place: %s", rec.name, exc)
        return removed

    # ---------------------------------------------------------------- restore
    def latest_common_step(self, at_most: int | None = None) -> int | None:
        """The newest committed step (<= ``at_most``) that every rank sees, or None (collective).

        Raises :class:`CheckpointUnreadableError` on every rank when some rank cannot read a
        checkpoint newer than that (a store failure, after retries): returning the older step
        would silently resume back in time. Damaged checkpoints (a manifest that fails its checks)
        are skipped with a warning."""
        bound = 2**62 if at_most is None else at_most
        records = [r for r in self.records() if r.step <= bound]
        mine = max((r.step for r in records if r.committed), default=-1)
        blind = [r for r in records if r.status == "unreadable" and r.step > mine]
        problem = f"{blind[-1].name}: {blind[-1].reason}" if blind else None
        for r in records:
            if r.status == "damaged" and r.step > mine:
                log.warning("skipping %s: %s", r.name, r.reason)
        step = self._comm.all_min([mine])[0]
        problems = self._comm.all_gather(problem)
        seen = [(rank, p) for rank, p in enumerate(problems) if p is not None]
        if seen:
            rank, text = seen[0]
            raise CheckpointUnreadableError(
                f"{self.root.url}: cannot tell which checkpoint is the newest: {text} (rank {rank}); "
                f"not falling back to an older one. Retry when the store answers, or pass at_most= to "
                "restore an older step on purpose"
            )
        return None if step < 0 else step

    def step_url(self, step: int) -> str:
        """The URL of step ``step``'s folder (what the framework adapters load from)."""
        return f"{self.root.url}/{step_dir(step)}"

    def restore_latest(self, state: dict[str, Any], *, strict: bool = True, at_most: int | None = None) -> int | None:
        """Load the newest checkpoint (with step <= ``at_most``, if given) that every rank can see
        and that loads and verifies.

        Returns its step, or None when there is none. Damaged checkpoints
        (uncommitted, unreadable metadata, checksum failures, missing objects)
        are skipped with a logged reason, falling back to older ones; a state
        that does not match the checkpoint raises instead.
        """
        self.wait()
        bound = 2**62 if at_most is None else at_most
        self.skipped = []
        while True:
            step = self.latest_common_step(bound)
            if step is None:
                return None
            name = step_dir(step)
            damaged: BaseException | None = None
            other: BaseException | None = None
            lease = self._acquire_lease(name)
            try:
                load_state(flatten_state(state), self.root.child(name), self._comm, strict=strict, options=self.load_options)
            except PeerFailureError as exc:
                damaged = exc  # another rank failed; its own flag says why
            except _DAMAGED as exc:
                damaged = exc
            except Exception as exc:  # noqa: BLE001 - decided together below
                other = exc
            finally:
                self._release_lease(lease)
            any_damaged, any_other = self._comm.any_flags([damaged is not None and not isinstance(damaged, PeerFailureError), other is not None])
            if any_other:
                if other is not None:
                    raise other
                raise PeerFailureError(f"restoring {name} failed on another rank")
            if not any_damaged:
                log.info("restored %s", name)
                return step
            reason = str(damaged) if damaged is not None else "damaged on another rank"
            log.warning("skipping %s: %s", name, reason)
            self.skipped.append((name, reason))
            bound = step - 1

    def _acquire_lease(self, name: str) -> str:
        key = f"{LEASES}/{name}.{self.rank}.{uuid.uuid4().hex[:12]}"
        try:
            self.root.put_bytes(key, repr(time.time()).encode())
        except (CkptkitError, OSError) as exc:
            log.warning("could not take a read lease on %s: %s", name, exc)
        return key

    def _release_lease(self, key: str) -> None:
        try:
            self.root.delete(key)
        except (CkptkitError, OSError):
            pass

    def _leased(self, name: str) -> bool:
        now = time.time()
        for key in self.root.list_keys(LEASES):
            base = key.rsplit("/", 1)[-1]
            if not base.startswith(name + "."):
                continue
            try:
                taken = float(self.root.read_bytes(key).decode())
            except (CkptkitError, OSError, ValueError):
                continue
            if now - taken < self.lease_seconds:
                return True
        return False
