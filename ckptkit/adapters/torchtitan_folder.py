"""What else a torchtitan checkpoint folder may hold besides ckptkit's checkpoints, and what a resume does about it.

A run that switches from torchtitan's own checkpoint manager (``torch.distributed.checkpoint``, DCP)
to ckptkit's keeps its folder: ``step-N`` directories with a ``.metadata`` file and ``__R_0.distcp``
shards. ckptkit's manager does not read them (they are pickle-based; converting them is
``ckptkit convert --from dcp``'s job, in ``converters/``). What matters is that a resume never
goes past one silently: a DCP step newer than the newest ckptkit checkpoint means the run got
further than ckptkit can resume, and starting from scratch or from the older ckptkit step would
throw that training away without a word (and the save of that step would fail later, since
ckptkit never writes into a folder holding files it did not write).
"""

from __future__ import annotations

import logging
from typing import Any

from ckptkit.errors import CkptkitError, ForeignCheckpointError
from ckptkit.run_folder import STEP_PATTERN

log = logging.getLogger("ckptkit")

DCP_METADATA = ".metadata"
"""The file torch.distributed.checkpoint writes into every checkpoint folder (its pickled plan)."""


def dcp_steps_after(root: Any, latest: int | None) -> list[str]:
    """Step folders of ``root`` (a Store) after ``latest`` (all, when None) holding a DCP ``.metadata``.

    One whose ``.metadata`` cannot be inspected (a FIFO, a device or a link out of the folder in its
    place) counts as foreign too: it is no ckptkit checkpoint either, and the caller must reach the
    ranks' agreement rather than raise on its own."""
    out = []
    for name in root.list_children():
        m = STEP_PATTERN.match(name)
        if m is None or (latest is not None and int(m.group(1)) <= latest):
            continue
        try:
            foreign = root.size(f"{name}/{DCP_METADATA}") is not None
        except CkptkitError:
            foreign = True
        if foreign:
            out.append(name)
    return out


def refuse_newer_dcp(root: Any, folder: str, comm: Any, latest: int | None) -> None:
    """Raise :class:`~ckptkit.errors.ForeignCheckpointError` on every rank if a DCP checkpoint is newer
    than ``latest``, the newest ckptkit checkpoint of ``folder`` (any, when None). Rank 0 looks, all
    agree; a folder rank 0 cannot list fails the resume too (it cannot tell that nothing is newer)."""
    newer: list[str] = []
    unlisted = ""
    if comm.rank == 0:
        try:
            newer = dcp_steps_after(root, latest)
        except CkptkitError as exc:
            unlisted = str(exc)
    found, failed = comm.any_flags([bool(newer), bool(unlisted)])
    if failed:
        raise ForeignCheckpointError(
            f"{folder}: could not list the folder to make sure no checkpoint there is newer than "
            f"{'none' if latest is None else f'step {latest}'} ({unlisted or 'on rank 0'}); retry once it answers")
    if not found:
        return
    where = ", ".join(f"{folder}/{n}" for n in newer[:4]) or f"step folders under {folder} (seen by rank 0)"
    src = f"{folder}/{newer[0]}" if newer else "SRC"
    raise ForeignCheckpointError(
        f"{where}: a torch.distributed.checkpoint (DCP) checkpoint, newer than "
        f"{'any' if latest is None else f'the newest ckptkit checkpoint (step {latest})'} there; this manager "
        "reads ckptkit checkpoints only, and resuming without it would go back in time. To resume from it: "
        f"`ckptkit convert {src} DST --from dcp`, then start with initial_load_path=DST in a new checkpoint folder "
        "(in this one, a ckptkit step would win over initial_load_path). To resume from what ckptkit saved here "
        "instead: move it out of the folder")


def warn_foreign_folders(root: Any, folder: str) -> None:
    """No committed ckptkit checkpoint, yet step folders: crashed saves (a fresh start is right), said."""
    names = [n for n in root.list_children() if STEP_PATTERN.match(n)]
    if names:
        log.warning("%s holds step folders %s but no committed ckptkit checkpoint (saves that did not commit); "
                    "a fresh start", folder, names[:4])
