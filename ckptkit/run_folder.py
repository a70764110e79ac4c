"""A run's folder of step checkpoints: what is in it, and the only code that deletes from it.

``CheckpointManager`` decides *when* to save and restore; this module knows the folder: step
folder names (ckptkit's ``step-0000500`` or torchtitan's ``step-500``, both read), each folder's
status read from its manifest (committed / uncommitted / damaged / unreadable — "absent" and
"could not be read" are never confused), retention, gc, rollback's discard of abandoned steps,
and read leases that keep a checkpoint a restore is reading from being deleted under it.

Every deletion here removes the manifest first (the checkpoint is then merely uncommitted) and
its objects after, so a crash mid-deletion never leaves a committed but partial checkpoint; and
nothing is deleted while any folder's state is unknown.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from ckptkit.engine.checkpoint_dir import remove_uncommitted
from ckptkit.engine.metadata_io import STEP_PATTERN, read_manifest  # noqa: F401 - STEP_PATTERN importable here
from ckptkit.errors import CkptkitError, OptionsError, StorageError, UncommittedCheckpointError
from ckptkit.layout.manifest import MANIFEST_NAME
from ckptkit.layout.strict_json import MAX_LAYOUT_INT
from ckptkit.retention import Record, RetentionPolicy, RollbackHold, decide, step_mismatch, stored_metrics, unknown
from ckptkit.storage.base import ByteStore

log = logging.getLogger("ckptkit")

MAX_STEP = MAX_LAYOUT_INT  # the newest step a restore looks at; a save of a later one is refused
LEASES = ".leases"


@dataclass(frozen=True)
class StepNaming:
    """How new step folders are named: ``step-{step:0{width}d}``. ckptkit's default (width 7:
    ``step-0000500``) sorts as text; ``StepNaming(width=0)`` writes torchtitan's ``step-500``.
    Folders of either form are always read."""

    width: int = 7

    def __post_init__(self) -> None:
        if not isinstance(self.width, int) or isinstance(self.width, bool) or not 0 <= self.width <= 20:
            raise OptionsError(f"StepNaming width must be an integer in [0, 20], got {self.width!r}")

    def name(self, step: int) -> str:
        return f"step-{step:0{self.width}d}" if self.width else f"step-{step}"


def step_dir(step: int) -> str:
    """The default name of step ``step``'s folder (``step-0000500``)."""
    return StepNaming().name(step)


class RunFolder:
    """The step folders under one run root (a store). Not collective: the manager coordinates."""

    def __init__(self, root: ByteStore, naming: StepNaming = StepNaming(), lease_seconds: float = 3600.0) -> None:
        self.root = root
        self.naming = naming
        self.lease_seconds = lease_seconds
        self._committed: dict[str, Record] = {}  # committed manifests never change: read once

    # ------------------------------------------------------------ reading

    def records(self) -> list[Record]:
        """Every step folder with its status, sorted by step. Listing failures raise. A folder whose
        manifest the store failed to return is ``unreadable`` (with the reason)."""
        out = []
        for name in self.root.list_children():
            m = STEP_PATTERN.match(name)
            if m is None:
                continue
            rec = self._committed.get(name) or self.read_record(name, int(m.group(1)))
            if rec.committed:
                self._committed[name] = rec
            out.append(rec)
        return sorted(out, key=lambda r: (r.step, r.name))

    def read_record(self, name: str, step: int) -> Record:
        """The status of step folder ``name`` (of ``step``), read now."""
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
        wrong = step_mismatch(meta, step)
        if wrong is not None:  # restoring it as this step would resume from another step's state
            return Record(name, step, False, status="damaged", reason=f"{wrong} (rename it "
                          f"{self.naming.name(meta['step'])}, or load it by path)")
        return Record(name, step, True, stored_metrics(meta))

    def name_of(self, step: int) -> str:
        """The folder of step ``step``: the committed one if there is one (of either naming), else
        the name a new save would get."""
        for rec in self._committed.values():
            if rec.step == step:
                return rec.name
        for rec in self.records():
            if rec.step == step and rec.committed:
                return rec.name
        return self.naming.name(step)

    def url_of(self, step: int) -> str:
        return f"{self.root.url}/{self.name_of(step)}"

    # ------------------------------------------------------------ deleting

    def delete(self, name: str) -> None:
        """Uncommit (manifest first), then remove a checkpoint's objects."""
        store = self.root.child(name)
        store.delete(MANIFEST_NAME)  # a crash from here on leaves garbage, never a partial checkpoint
        self._committed.pop(name, None)
        try:
            remove_uncommitted(store)
            log.info("deleted %s", name)
        except CkptkitError as exc:
            log.warning("%s is uncommitted now but not removed: %s", name, exc)

    def apply_retention(self, policy: RetentionPolicy, after: str, rollback: RollbackHold | None = None,
                        distrusted: frozenset[str] = frozenset()) -> list[str]:
        """Delete what ``policy`` does not keep, nor ``rollback`` holds (never a leased one; nothing at
        all while any folder is unreadable: it may be the newest committed one), and never ``after``,
        the checkpoint just committed (a newer one left by a rewind, or a ``distrusted`` one, passed
        for the newest before 2026-12-06, and the save was deleted as it committed). ``distrusted``:
        see :func:`~ckptkit.retention.decide`. Never raises: retention never fails a save (it runs on
        rank 0 alone; an exception there would leave the other ranks waiting)."""
        if policy.keeps_everything:
            return []
        deleted: list[str] = []
        try:
            records = self.records()
            blind = unknown(records)
            if blind:
                log.warning("retention after %s: skipped, %s could not be read (%s)", after, blind[0].name,
                            blind[0].reason)
                return []
            for victim in decide(records, policy, rollback, distrusted).delete:
                if victim == after:
                    continue
                if self.leased(victim):
                    log.info("retention: keeping %s for now, a restore is reading it", victim)
                    continue
                self.delete(victim)
                deleted.append(victim)
        except Exception as exc:  # noqa: BLE001 - see above
            log.warning("retention after %s failed: %s: %s", after, type(exc).__name__, exc)
        return deleted

    def discard_after(self, step: int) -> list[str]:
        """Delete every checkpoint newer than ``step`` that is not known to be uncommitted (after a
        rollback they belong to an abandoned trajectory). Raises if a deletion fails."""
        removed = []
        for rec in self.records():
            if rec.status != "uncommitted" and rec.step > step:
                self.delete(rec.name)
                removed.append(rec.name)
        return removed

    def gc(self, keep: frozenset[str] = frozenset()) -> list[str]:
        """Remove step folders known to hold no manifest, except ``keep`` (a save in flight);
        damaged and unreadable ones are left for a human.

        Never deletes a manifest: :func:`remove_uncommitted` leaves ``manifest.json`` out of what
        it deletes and checks for one again after listing the folder, so a checkpoint committed
        while gc runs stays whole."""
        removed: list[str] = []
        for rec in self.records():
            if rec.status != "uncommitted" or rec.name in keep:
                continue
            try:
                remove_uncommitted(self.root.child(rec.name))
                removed.append(rec.name)
                log.info("gc: removed uncommitted %s", rec.name)
            except CkptkitError as exc:
                log.warning("gc: %s: %s", rec.name, exc)
        return removed

    # ------------------------------------------------------------ leases

    def acquire_lease(self, name: str, rank: int) -> str:
        """Mark ``name`` as being read (best effort: a store that refuses gets a warning)."""
        key = f"{LEASES}/{name}.{rank}.{uuid.uuid4().hex[:12]}"
        try:
            self.root.put_bytes(key, repr(time.time()).encode())
        except (CkptkitError, OSError) as exc:
            log.warning("could not take a read lease on %s: %s", name, exc)
        return key

    def release_lease(self, key: str) -> None:
        try:
            self.root.delete(key)
        except (CkptkitError, OSError):
            pass

    def leased(self, name: str) -> bool:
        now = time.time()
        for key in self.root.list_keys(LEASES):
            base = key.rsplit("/", 1)[-1]
            if not base.startswith(name + "."):
                continue
            try:
                taken = float(self.root.read_bytes(key, limit=64).decode())
            except (CkptkitError, OSError, ValueError):
                continue
            if now - taken < self.lease_seconds:
                return True
        return False
