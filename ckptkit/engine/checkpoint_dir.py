"""What ckptkit itself puts in a checkpoint directory, so cleanup never touches anything else.

A save attempt writes only ``data/rank-NNNNN-<attempt>.bin``,
``index/rank-NNNNN-<attempt>.json``, ``manifest.json`` and short-lived
``*.tmp-*`` temporaries of those (format version 1 wrote the same names
without ``-<attempt>``). Removing leftovers must not remove anything more:
pointed at a run directory by mistake, a save has to refuse, not wipe the run.

Objects carry the id of the attempt that wrote them, so cleanup can be exact:
a failed attempt removes only its own objects (another writer of the same
step may be mid-save), and once a manifest has committed one attempt the
objects of every other attempt are garbage (:func:`remove_other_attempts`).
"""

from __future__ import annotations

import re
import uuid

from ckptkit.errors import SaveError
from ckptkit.layout.manifest import MANIFEST_NAME
from ckptkit.storage.base import ByteStore

_ATTEMPT = r"[0-9a-f]{12}"
_OWN_KEY = re.compile(
    rf"^(?:(?:data/rank-(?:[0-9]{{5}}|[1-9][0-9]{{5,6}})(?:-(?P<a1>{_ATTEMPT}))?\.bin)|(?:index/rank-(?:[0-9]{{5}}|[1-9][0-9]{{5,6}})(?:-(?P<a2>{_ATTEMPT}))?\.json)"
    r"|manifest\.json)(?:\.tmp-[0-9a-z-]+)?$"
)


def new_attempt() -> str:
    """A fresh save-attempt id (48 random bits: two attempts of one step never collide)."""
    return uuid.uuid4().hex[:12]


def attempt_of(key: str) -> str | None:
    """The attempt id in an object name ckptkit wrote (None for the manifest and version-1 names)."""
    m = _OWN_KEY.match(key)
    return (m.group("a1") or m.group("a2")) if m else None


def foreign_keys(store: ByteStore) -> list[str]:
    """Objects under ``store`` that a ckptkit save would not have written."""
    return [k for k in store.list_keys() if not _OWN_KEY.match(k)]


def remove_uncommitted(store: ByteStore) -> list[str]:
    """Delete the leftovers of an uncommitted save; refuse if anything else is there.

    Returns the removed keys. Never deletes a manifest: ``manifest.json`` is never in the delete
    set, and the manifest is looked for again *after* the listing and before the first deletion,
    so a save that commits while this runs (between the first check and the listing) keeps its
    checkpoint. A commit landing after that second check, while the objects are being deleted,
    cannot be undone here: it is reported (SaveError naming the folder) rather than left silent.
    """
    _refuse_committed(store)
    keys = store.list_keys()
    foreign = [k for k in keys if not _OWN_KEY.match(k)]
    if foreign:
        shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise SaveError(
            f"{store.url} is not empty and holds files ckptkit did not write ({shown}); "
            "refusing to save there (is it a run directory rather than a checkpoint path?)"
        )
    doomed = [k for k in keys if k != MANIFEST_NAME]
    _refuse_committed(store)  # again: a manifest committed since the first check is listed with the rest
    for key in doomed:
        store.delete(key)
    store.prune_empty()  # the now-empty directories; never an object another writer just added
    if store.exists(MANIFEST_NAME):
        raise SaveError(
            f"{store.url}: a save committed here while its folder was being removed as uncommitted; "
            "its objects may be gone: run `ckptkit verify` on it (a folder another job is still saving "
            "to must not be cleaned)"
        )
    return doomed


def _refuse_committed(store: ByteStore) -> None:
    if store.exists(MANIFEST_NAME):
        raise SaveError(f"{store.url} holds a committed checkpoint; refusing to remove it")


def remove_attempt(store: ByteStore, attempt: str) -> list[str]:
    """Delete the data objects, indexes and temporaries of one save attempt, nothing else.

    What a failed or losing save does: another attempt at the same path (a racing job) may be
    writing, or may have committed, and its objects are not ours to touch."""
    keys = [k for k in store.list_keys() if k != MANIFEST_NAME and attempt_of(k) == attempt]
    for key in keys:
        store.delete(key)
    store.prune_empty()
    return keys


def remove_other_attempts(store: ByteStore, committed: str) -> list[str]:
    """After ``committed``'s manifest landed: delete ckptkit objects of every other attempt.

    Safe because a committed checkpoint is immutable (put-if-absent) and references only its own
    attempt's objects: no other attempt can ever commit here."""
    keys = [k for k in store.list_keys()
            if _OWN_KEY.match(k) and k != MANIFEST_NAME and attempt_of(k) != committed]
    for key in keys:
        store.delete(key)
    return keys
