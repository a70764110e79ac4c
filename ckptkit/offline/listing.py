"""Listing a run's checkpoints: which are committed, which are not and why, what retention keeps.

Operators ask "which of these checkpoints are complete?" on a login node, without a process group,
GPUs or the model code. This reads manifests only (versioned JSON, never pickle).
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ckptkit.engine.metadata_io import read_manifest
from ckptkit.errors import CheckpointNotFoundError, CkptkitError, UncommittedCheckpointError
from ckptkit.layout.manifest import MANIFEST_NAME
from ckptkit.retention import Record, RetentionPolicy, RollbackHold, decide, step_mismatch, stored_metrics
from ckptkit.storage.base import ByteStore
from ckptkit.storage.url import open_store

_STEP_NAME = re.compile(r"(?:^|[-_.])step[-_]?([0-9]+)$")


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory of a run, committed or not.

    ``reason`` says why an uncommitted one is not a checkpoint (a crashed or
    running save, an unreadable manifest), so a reader knows whether to wait,
    delete it, or look closer.
    """

    name: str
    url: str
    step: int | None
    committed: bool
    total_bytes: int
    world_size: int | None
    created: str | None
    reason: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    keep: tuple[str, ...] = ()  # why retention keeps it: latest, last, milestone, best, rollback

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def list_checkpoints(url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> list[CheckpointInfo]:
    """The checkpoints directly under run directory ``url`` (or ``url`` itself if it is one).

    Sorted by step (unnumbered last), then name. Raises
    CheckpointNotFoundError if ``url`` does not exist; a step folder that cannot be read is listed
    as not committed, with the reason.
    """
    store = open_store(url, storage_options)
    children = store.list_children()
    if MANIFEST_NAME in children or "index" in children or "data" in children:
        return [_info(store, store.url.rstrip("/").rsplit("/", 1)[-1])]
    if not children and not store.is_dir():  # an empty run directory is not an error; a missing one is
        raise CheckpointNotFoundError(f"no checkpoint or run directory at {store.url}")
    infos, policies = [], {}
    for name in children:
        if name.startswith("."):
            continue  # .leases and other hidden entries
        try:
            if store.size(name) is not None:
                continue  # a plain file next to the checkpoints (notes, a "latest" pointer)
            info, policy = _info_and_policy(store.child(name), name)
        except CkptkitError as exc:  # one hostile entry must not hide the other checkpoints
            match = _STEP_NAME.search(name)
            info = CheckpointInfo(name, f"{store.url.rstrip('/')}/{name}", int(match.group(1)) if match else None,
                                  False, 0, None, None, f"unreadable: {exc}")
            policy = None
        infos.append(info)
        policies[name] = policy
    infos.sort(key=lambda i: (i.step is None, i.step or 0, i.name))
    return _with_retention(infos, policies)


def _with_retention(infos: list[CheckpointInfo], policies: dict[str, Any]) -> list[CheckpointInfo]:
    """Mark why each committed checkpoint is kept, by the policy the newest one was saved under."""
    committed = [i for i in infos if i.committed and i.step is not None]
    if not committed:
        return infos
    newest = max(committed, key=lambda i: i.step or 0)
    doc = policies.get(newest.name)
    held = RollbackHold.from_json(doc.get("rollback")) if isinstance(doc, dict) else None
    decision = decide([Record(i.name, i.step or 0, True, i.metrics) for i in committed],
                      RetentionPolicy.from_json(doc), held)
    return [
        replace(i, keep=tuple(r for r in decision.keep.get(i.name, ()) if r != "all")) if i.committed else i
        for i in infos
    ]


def _info(store: ByteStore, name: str) -> CheckpointInfo:
    return _info_and_policy(store, name)[0]


def _info_and_policy(store: ByteStore, name: str) -> tuple[CheckpointInfo, Any]:
    """A checkpoint's summary and the retention policy it was saved under (None if unknown)."""
    match = _STEP_NAME.search(name)
    step = int(match.group(1)) if match else None
    try:
        manifest = read_manifest(store)
    except CkptkitError as exc:
        keys = store.list_keys()
        if not keys:
            reason = "empty directory"
        elif not any(k.startswith(("index/", "data/")) for k in keys):
            reason = f"not a checkpoint (no {MANIFEST_NAME}, index/ or data/)"
        elif isinstance(exc, UncommittedCheckpointError):
            reason = f"no {MANIFEST_NAME}: the save did not finish (or is still running)"
        else:
            reason = f"{MANIFEST_NAME} is unreadable: {exc}"
        total = sum(store.size(k) or 0 for k in keys)
        return CheckpointInfo(name, store.url, step, False, total, None, None, reason), None
    meta = manifest.meta
    user: Any = meta.get("user")
    user_step: Any = user.get("step") if isinstance(user, dict) else None
    if step is None and isinstance(user_step, int) and not isinstance(user_step, bool):
        step = user_step
    wrong = step_mismatch(user, step) if step is not None else None
    if wrong is not None:  # what a restore skips as damaged (run_folder): never shown as a checkpoint
        total = sum(store.size(k) or 0 for k in store.list_keys())
        return CheckpointInfo(name, store.url, step, False, total, manifest.world_size, created_of(meta),
                              f"damaged: {wrong}"), None
    # on-disk size, comparable with an uncommitted directory's: objects + indexes + manifest
    recorded = meta.get("stored_bytes")
    if isinstance(recorded, int):
        total = recorded + (store.size(MANIFEST_NAME) or 0)
    else:
        total = sum(store.size(k) or 0 for k in store.list_keys())
    metrics = stored_metrics(user)
    info = CheckpointInfo(
        name, store.url, step, True, total, manifest.world_size, created_of(meta),
        metrics=metrics,
    )
    return info, user.get("retention") if isinstance(user, dict) else None


def created_of(meta: dict[str, Any]) -> str | None:
    created = meta.get("created")
    return created if isinstance(created, str) else None
