"""The files of one zarr array node, checked before tensorstore reads them (local sources).

tensorstore's ``file`` kvstore opens what a path names: it follows a symlink wherever it points,
blocks forever opening a FIFO, and streams a device. An export folder may be damaged or hostile
(docs/trust.md), so :func:`check_node_metadata` and :func:`check_chunk_files` run the byte
store's own checks (:class:`ckptkit.storage.local.LocalStore`: a regular file whose real path lies
inside the source root; links that stay inside are followed) on every file tensorstore will open
for an array: its ``zarr.json`` before the array is opened, and then every chunk (or shard) file
of its grid before a byte of data is read.

The chunk files are the ones the array's metadata implies (its shape, regular chunk grid and
chunk key encoding, see :func:`chunk_keys`), not a directory listing: a listing would miss what
is not there. ckptkit's export writes every chunk (``store_data_equal_to_fill_value``), so a
chunk file that is missing is damage and is named here, instead of reading as the fill value.
An ``s3://`` source has no links, FIFOs or devices; a missing chunk there is reported by the read
itself (the arrays are opened with ``fill_missing_data_reads`` off, see
:mod:`ckptkit_converters.zarr.convert`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from itertools import product
from typing import Any

from ckptkit.errors import CorruptCheckpointError, ManifestError
from ckptkit.storage.base import ByteStore
from ckptkit.storage.local import LocalStore

ARRAY_METADATA = "zarr.json"


def local_store(store: ByteStore) -> LocalStore | None:
    """The local store under ``store`` (also under the tensorstore I/O engine's wrapper), None for S3."""
    from ckptkit.storage.tensorstore_kv import TensorstoreStore

    base = store.base if isinstance(store, TensorstoreStore) else store
    return base if isinstance(base, LocalStore) else None


def chunk_keys(metadata: dict[str, Any], where: str) -> Iterator[str]:
    """The key of every chunk (shard, when sharded) of a zarr v3 array, relative to its node.

    ``metadata`` is the array's metadata as tensorstore reports it (``spec().to_json()``):
    ``shape``, a ``regular`` ``chunk_grid`` and a ``default`` or ``v2`` ``chunk_key_encoding``
    (zarr v3's two). A zero-length dimension has no chunks; a 0-d array has one chunk, ``c``
    (``0`` in the v2 encoding). Anything else is a :class:`ManifestError` naming ``where``.
    """
    try:
        shape = [int(n) for n in metadata["shape"]]
        grid = metadata["chunk_grid"]
        chunk = [int(n) for n in grid["configuration"]["chunk_shape"]]
        encoding = metadata.get("chunk_key_encoding", {"name": "default"})
        name = encoding["name"]
        separator = (encoding.get("configuration") or {}).get("separator", "/" if name == "default" else ".")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ManifestError(f"{where}: array metadata without a readable shape, chunk grid or chunk key "
                            f"encoding ({type(exc).__name__}: {exc})") from None
    if grid.get("name") != "regular" or len(chunk) != len(shape) or any(c < 1 for c in chunk):
        raise ManifestError(f"{where}: chunk grid {grid!r} is not a regular grid of positive chunk sizes for shape "
                            f"{shape}; expected zarr v3's 'regular' grid, as ckptkit's export writes")
    if name not in ("default", "v2") or separator not in ("/", "."):
        raise ManifestError(f"{where}: chunk key encoding {encoding!r} is not one of zarr v3's ('default' or 'v2' "
                            "with separator '/' or '.')")
    counts = [math.ceil(n / c) for n, c in zip(shape, chunk)]
    for index in product(*(range(n) for n in counts)):
        parts = [str(i) for i in index]
        if name == "default":
            yield separator.join(["c", *parts])
        else:
            yield separator.join(parts) if parts else "0"


def check_node_metadata(store: LocalStore, path: str) -> None:
    """Refuse the array node at ``path`` unless its ``zarr.json`` is a regular file
    inside the source root (UnsafePathError for a link out, CorruptCheckpointError for a FIFO,
    device, directory or nothing), before tensorstore opens it."""
    store.checked_size(f"{path}/{ARRAY_METADATA}")


def check_chunk_files(store: LocalStore, path: str, key: str, metadata: dict[str, Any]) -> int:
    """Check every chunk file of the array of tensor ``key`` (node ``path``) before tensorstore reads
    it: a regular file inside the source root, present. Returns how many there are.

    A link out of the root is an UnsafePathError and a FIFO or device a CorruptCheckpointError (the
    store's messages name the file); a missing chunk (or a directory in its place) is a
    CorruptCheckpointError naming the array, the tensor and the chunk."""
    where = f"{store.root.rstrip('/')}/{path}"
    count = 0
    for chunk in chunk_keys(metadata, f"{where}/{ARRAY_METADATA}"):
        if store.size(f"{path}/{chunk}") is None:
            raise CorruptCheckpointError(
                f"{where}/{chunk}: chunk {chunk!r} of the array of tensor {key!r} is missing; ckptkit's zarr "
                "export writes every chunk of the grid, so the export is damaged (reading on would give the "
                "fill value in place of the saved values)")
        count += 1
    return count
