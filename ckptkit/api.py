"""The functional API: ``save`` and ``load``.

Both are collective over ``process_group`` (default: the whole world when
torch.distributed is initialized, else a single process) and take a local
path, a ``file://`` URL, or any URL a configured backend supports.
"""

from __future__ import annotations

import os
from typing import Any

from ckptkit.engine.collective import resolve_comm
from ckptkit.engine.loader import LoadResult, load_state
from ckptkit.engine.saver import SaveResult, save_state
from ckptkit.engine.state import flatten_state
from ckptkit.options import LoadOptions, SaveOptions
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
    return save_state(flatten_state(state), store, comm, block=options.block_size, metadata=metadata)


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
