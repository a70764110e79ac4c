"""What ckptkit itself puts in a checkpoint directory, so cleanup never touches anything else.

A save writes only ``data/rank-NNNNN.bin``, ``index/rank-NNNNN.json``,
``manifest.json`` and short-lived ``*.tmp-*`` temporaries of those. Removing
the leftovers of a crashed save must not remove anything more: pointed at a
run directory by mistake, a save has to refuse, not wipe the run.
"""

from __future__ import annotations

import re

from ckptkit.errors import SaveError
from ckptkit.layout.manifest import MANIFEST_NAME
from ckptkit.storage.base import ByteStore

_OWN_KEY = re.compile(
    r"^(data/rank-\d{5}\.bin|index/rank-\d{5}\.json|manifest\.json)(\.tmp-[0-9a-z-]+)?$"
)


def foreign_keys(store: ByteStore) -> list[str]:
    """Objects under ``store`` that a ckptkit save would not have written."""
    return [k for k in store.list_keys() if not _OWN_KEY.match(k)]


def remove_uncommitted(store: ByteStore) -> list[str]:
    """Delete the leftovers of an uncommitted save; refuse if anything else is there.

    Returns the removed keys. Never called on a committed checkpoint.
    """
    if store.exists(MANIFEST_NAME):
        raise SaveError(f"{store.url} holds a committed checkpoint; refusing to remove it")
    foreign = foreign_keys(store)
    if foreign:
        shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise SaveError(
            f"{store.url} is not empty and holds files ckptkit did not write ({shown}); "
            "refusing to save there (is it a run directory rather than a checkpoint path?)"
        )
    keys = store.list_keys()
    for key in keys:
        store.delete(key)
    if not store.list_keys():
        store.delete_all()  # the now-empty directories
    return keys
