"""The functional API: ``save`` and ``load``.

Both are collective over ``process_group`` (default: the whole world when
torch.distributed is initialized, else a single process) and take a local
path, a ``file://`` URL, or any URL a configured backend supports.
"""

from __future__ import annotations

import os
from typing import Any

from ckptkit.engine.async_save import SaveHandle
from ckptkit.engine.collective import resolve_comm
from ckptkit.engine.loader import LoadResult, load_state
from ckptkit.engine.saver import SaveResult, save_state
from ckptkit.engine.state import flatten_state
from ckptkit.errors import OptionsError, SaveError
from ckptkit.options import AsyncOptions, LoadOptions, SaveOptions
from ckptkit.storage.url import open_store


def save(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    metadata: dict[str, Any] | None = None,
    options: SaveOptions = SaveOptions(),
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
) -> SaveResult:
    """Save ``state`` to ``path``: every rank writes only the pieces it stores.

    ``state`` is a nested dict of tensors, DTensors, :class:`ckptkit.Sharded`
    declarations, ``torch.Generator`` s, :class:`ckptkit.PerRank` values and
    JSON-like values. ``metadata`` (JSON-like) is kept in the manifest. The
    checkpoint exists only once every rank's data is durable and the manifest
    is committed; on any failure every rank raises :class:`ckptkit.SaveError`
    and no committed checkpoint is left at ``path``.
    """
    comm = resolve_comm(process_group)
    store = open_store(path, storage_options)
    return save_state(state, store, comm, block=options.block_size, metadata=metadata)


def load(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    options: LoadOptions = LoadOptions(),
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
) -> LoadResult:
    """Fill ``state`` in place from the checkpoint at ``path``, at this job's layout.

    Tensors are copied into; values are replaced in their containers. The
    checkpoint may have been saved at any other layout and world size.
    ``strict`` (default) refuses keys missing on either side.
    """
    comm = resolve_comm(process_group)
    store = open_store(path, storage_options)
    return load_state(flatten_state(state), store, comm, strict=strict, options=options)


_default_savers: dict[Any, Any] = {}


def save_async(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    metadata: dict[str, Any] | None = None,
    options: AsyncOptions = AsyncOptions(),
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    guard: Any = None,
) -> SaveHandle:
    """Snapshot ``state`` and save it to ``path`` in the background.

    Returns once the snapshot is taken (``handle.staged``); ``handle.committed``
    resolves when the checkpoint is durable and committed. At most one save is
    in flight per process group: a second call waits for the first. Collective.
    The first call creates the background machinery (two gloo groups, the
    staging buffer); :func:`wait_async` / :func:`close_async` finish it.

    ``guard``: the optimizer(s) whose ``step`` changes ``state`` (one, or a list; hooked once per
    saver). Required by ``options=AsyncOptions(snapshot="overlap")``, which returns before any copy:
    the guard's next ``step`` waits for the background copy, and until it begins nothing else may
    change a saved tensor (docs/overlap.md).
    """
    from ckptkit.engine.async_save import AsyncSaver

    if options.on_busy != "wait":  # a skipped save has no handle to return (it used to die on an assert)
        raise OptionsError(f"save_async(options=AsyncOptions(on_busy={options.on_busy!r})): a second call always waits "
                           "for the first here; skipping a save while one persists is CheckpointManager's "
                           "(CheckpointManager(..., asynchronous=AsyncOptions(on_busy='skip')))")
    key = (id(process_group), options)
    saver = _default_savers.get(key)
    if saver is None or saver.closed:
        saver = _default_savers[key] = AsyncSaver(process_group, options)
    if guard is not None:
        saver.guard(*(guard if isinstance(guard, (list, tuple)) else (guard,)))
    handle = saver.save(state, open_store(path, storage_options), metadata=metadata)
    if handle is None:
        raise SaveError(f"saving {path}: the save was skipped")  # unreachable with on_busy="wait"
    return handle


def close_async() -> None:
    """Wait for every in-flight asynchronous save and release its resources (raises a background failure)."""
    savers = list(_default_savers.values())
    _default_savers.clear()
    for saver in savers:
        saver.close()
