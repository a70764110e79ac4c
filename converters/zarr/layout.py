"""How a checkpoint maps onto a zarr v3 group: chunking, node names, stored dtypes, root attributes.

Pure decisions and the versioned JSON schema, kept apart from the
tensorstore I/O in :mod:`ckptkit_converters.zarr.convert` so they can be tested
(and read) on their own; nothing here imports tensorstore.

* **Chunking** follows the common read, one stored piece (a TP shard, an
  FSDP shard) at a time: the inner (read) chunk is the stored pieces' box
  when they tile the tensor regularly, divided (by a divisor where possible,
  so chunks stay aligned to the pieces) to at most ``chunk_bytes`` and grown
  to at least an eighth of that; shards (the objects) hold whole chunks,
  growing along dim 0 first up to about ``shard_bytes``.
* **Names**: a tensor key's components become node names, percent-escaping
  what zarr or a file system would not take.
* **Dtypes**: bfloat16 and float8 are stored as they are, or, "portable", as
  float32 (bf16 bit by bit, float8 by value) for readers without them.
* **Root attributes** (``attributes.ckptkit``): the source manifest without
  its index list, the key -> array table, and where per-rank values are.
"""

from __future__ import annotations

import datetime
import json
import math
import string
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import product
from typing import Any

import numpy as np
import torch

from ckptkit.engine.state import torch_dtype
from ckptkit.errors import (
    CheckpointNotFoundError,
    LayoutError,
    ManifestError,
    UnsafePathError,
    UnsupportedVersionError,
)
from ckptkit.layout.box import Box
from ckptkit.layout.grid import GridLayout
from ckptkit.layout.manifest import DTYPES, Manifest, TensorMeta
from ckptkit.offline.view import ML_DTYPES, NO_NUMPY_DTYPES, to_numpy
from ckptkit.storage.base import ByteStore
from ckptkit.version import __version__

FORMAT = "ckptkit-zarr"
VERSION = 1
ATTRIBUTE = "ckptkit"
GROUP_METADATA = "zarr.json"
PER_RANK_GROUP = "ckptkit-per-rank"  # a child group whose attributes hold the per-rank values
# Not readable by numpy / zarr-python; ``portable`` stores them as float32.
_NARROW_FLOATS = ML_DTYPES
# Named by the checkpoint format but by no zarr v3 data type (tensorstore has neither, as numpy has
# neither): an export refuses them by name before it writes anything.
NOT_STORABLE = NO_NUMPY_DTYPES

# ---------------------------------------------------------------- chunking (pure)


def choose_chunking(
    shape: tuple[int, ...], itemsize: int, stored_boxes: Iterable[Box], chunk_bytes: int, shard_bytes: int,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(inner chunk shape, shard shape)`` for an array of ``shape``; see the module docstring."""
    if not shape:
        return (), ()
    boxes = list(stored_boxes)
    chunk = [_regular_step(shape[d], {(b.offsets[d], b.ends[d]) for b in boxes}) for d in range(len(shape))]
    _cap(chunk, itemsize, chunk_bytes)
    _grow(chunk, shape, itemsize, max(1, chunk_bytes // 8), reversed(range(len(shape))), multiple=False)
    shard = list(chunk)
    _grow(shard, shape, itemsize, shard_bytes, range(len(shape)), multiple=True)
    return tuple(chunk), tuple(shard)


def _regular_step(n: int, intervals: set[tuple[int, int]]) -> int:
    """The common size of intervals that tile ``[0, n)`` regularly (the last may be short), else n."""
    if n == 0:
        return 1
    runs = sorted(intervals)
    if not runs:
        return n
    step = runs[0][1] - runs[0][0]
    pos = 0
    for i, (lo, hi) in enumerate(runs):
        size = hi - lo
        if lo != pos or size <= 0 or size > step or (size < step and i != len(runs) - 1):
            return n
        pos = hi
    return step if pos == n else n


def _nbytes(shape: list[int], itemsize: int) -> int:
    return math.prod(shape) * itemsize


def _cap(chunk: list[int], itemsize: int, limit: int) -> None:
    """Split leading dims until the chunk is at most ``limit`` bytes, by divisors where possible."""
    for d in range(len(chunk)):
        size = _nbytes(chunk, itemsize)
        if size <= limit:
            return
        need = -(-size // limit)
        if chunk[d] <= need:
            chunk[d] = 1
            continue
        divisor = next((k for k in range(need, min(chunk[d], 2 * need) + 1) if chunk[d] % k == 0), None)
        chunk[d] = chunk[d] // divisor if divisor else -(-chunk[d] // need)


def _grow(chunk: list[int], shape: tuple[int, ...], itemsize: int, target: int, dims: Iterable[int], *, multiple: bool) -> None:
    """Enlarge ``chunk`` along ``dims`` in turn until it reaches ``target`` bytes or covers the array.

    ``multiple``: keep each dimension a multiple of its starting size (shards
    must hold whole inner chunks)."""
    for d in dims:
        size = _nbytes(chunk, itemsize)
        if size >= target or size == 0:
            return
        factor = max(1, target // size)
        if multiple:
            chunk[d] *= max(1, min(factor, -(-shape[d] // chunk[d])))
        else:
            chunk[d] = min(max(shape[d], 1), chunk[d] * factor)


def shard_boxes(shape: tuple[int, ...], shard: tuple[int, ...]) -> Iterator[Box]:
    """The shards of an array, clipped to its shape, in row-major order (one empty box for 0-d)."""
    if any(n == 0 for n in shape):
        return
    ranges = [range(0, n, s) for n, s in zip(shape, shard)]
    for offs in product(*ranges):
        yield Box(tuple(offs), tuple(min(s, n - o) for o, s, n in zip(offs, shard, shape)))


def stored_boxes(meta: TensorMeta) -> list[Box]:
    """The boxes the checkpoint stores the tensor in (the enclosing box of flat fragments)."""
    if isinstance(meta.layout, GridLayout):
        return [b for b, _ in meta.layout.all_boxes()]
    return list({r.box for r, _ in meta.layout.pieces})


# ---------------------------------------------------------------- names and dtypes

_SAFE = frozenset(string.ascii_letters + string.digits + "._-%")
_RESERVED = frozenset({GROUP_METADATA, PER_RANK_GROUP})


def node_path(key: str) -> str:
    """The zarr node path of a tensor key: its components, with characters outside
    ``[A-Za-z0-9._-%]``, a leading ``__`` (reserved by zarr) and names ckptkit or
    zarr use at the root percent-escaped. Keys already escape ``/`` and ``%``."""
    out = []
    for comp in key.split("/"):
        name = "".join(ch if ch in _SAFE else "".join(f"%{b:02X}" for b in ch.encode()) for ch in comp)
        if not name:
            name = "%"  # a literal % is always escaped as %25 in keys, so a lone % is free
        if name.startswith("__"):
            name = "%5F" + name[1:]
        if set(name) == {"."} or name in _RESERVED:
            name = name.replace(".", "%2E")
        out.append(name)
    return "/".join(out)


def stored_dtype(dtype: str, portable: bool) -> str:
    """The zarr data type a tensor of ``dtype`` is stored as. LayoutError for :data:`NOT_STORABLE`."""
    if dtype in NOT_STORABLE:
        raise LayoutError(f"zarr has no data type for {dtype}: convert the tensor (e.g. complex32 to complex64) "
                          "before exporting")
    return "float32" if portable and dtype in _NARROW_FLOATS else dtype


def to_stored(t: torch.Tensor, dtype: str, stored: str) -> np.ndarray:
    """A tensor's elements as the numpy array the zarr array stores (bit-exact for bf16 -> float32)."""
    if stored == dtype:
        return to_numpy(t)
    if dtype == "bfloat16":  # the bf16 bits are the high half of the float32
        return (t.contiguous().view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return t.to(torch.float32).numpy()


def from_stored(a: np.ndarray, dtype: str, stored: str) -> torch.Tensor:
    """Inverse of :func:`to_stored`."""
    if stored != dtype:
        if dtype == "bfloat16":
            return torch.from_numpy((a.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a).to(torch_dtype(dtype))
    if dtype in _NARROW_FLOATS:
        as_int = np.int16 if DTYPES[dtype] == 2 else np.uint8
        return torch.from_numpy(a.view(as_int)).view(torch_dtype(dtype))
    return torch.from_numpy(a)


# ---------------------------------------------------------------- root attributes


def group_json(attributes: dict[str, Any] | None = None) -> bytes:
    """A zarr v3 group's ``zarr.json`` (groups are explicit in v3: every level of the hierarchy has one)."""
    doc = {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def root_attributes(source: str, manifest: Manifest, paths: dict[str, str], stored: dict[str, str],
                    per_rank: bool, chunking: dict[str, Any]) -> dict[str, Any]:
    """The ``attributes.ckptkit`` document of an export's root group (versioned JSON)."""
    doc = manifest.to_doc()
    del doc["indexes"]  # they name files of the source checkpoint, which the group does not have
    return {
        "format": FORMAT,
        "version": VERSION,
        "ckptkit_version": __version__,
        "exported": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": source,
        "arrays": {k: {"path": paths[k], "stored_dtype": stored[k]} for k in sorted(paths)},
        "per_rank_values": PER_RANK_GROUP if per_rank else None,
        "chunking": chunking,
        "manifest": doc,
    }


@dataclass(frozen=True)
class ExportInfo:
    """A parsed export: the source manifest (indexes omitted), array paths and stored dtypes, per-rank values."""

    manifest: Manifest
    arrays: dict[str, tuple[str, str]]
    per_rank: dict[int, dict[str, Any]]


def _inside_group(path: str) -> bool:
    parts = path.split("/")
    return bool(path) and "\\" not in path and "\x00" not in path and all(p not in ("", ".", "..") for p in parts)


def read_export(store: ByteStore) -> ExportInfo:
    """Parse and validate the root attributes (and per-rank values) of an export."""
    where = f"{store.url}/{GROUP_METADATA}"
    if not store.exists(GROUP_METADATA):
        if store.list_children():
            raise CheckpointNotFoundError(
                f"{store.url} has no {GROUP_METADATA}: not a zarr group, or an export that did not finish "
                "(the root metadata is written last)")
        raise CheckpointNotFoundError(f"no zarr group at {store.url}")
    try:
        root = json.loads(store.read_bytes(GROUP_METADATA))
        attrs = root["attributes"][ATTRIBUTE]
    except (ValueError, KeyError, TypeError):
        raise ManifestError(f"{where}: not a ckptkit zarr export (no attributes.{ATTRIBUTE})") from None
    if not isinstance(attrs, dict) or attrs.get("format") != FORMAT:
        raise ManifestError(f"{where}: attributes.{ATTRIBUTE}.format is not {FORMAT!r}")
    if attrs.get("version") != VERSION:
        raise UnsupportedVersionError(
            f"{where}: ckptkit zarr export version {attrs.get('version')!r}; this ckptkit reads version {VERSION}")
    doc = attrs.get("manifest")
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: attributes.{ATTRIBUTE}.manifest is missing")
    manifest = Manifest.from_doc({**doc, "indexes": []}, f"{where} (manifest)")
    arrays: dict[str, tuple[str, str]] = {}
    raw_arrays = attrs.get("arrays")
    for key, meta in manifest.tensors.items():
        entry = raw_arrays.get(key) if isinstance(raw_arrays, dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or entry.get("stored_dtype") not in DTYPES:
            raise ManifestError(f"{where}: no array path / stored dtype for tensor {key!r}")
        if not _inside_group(entry["path"]):
            raise UnsafePathError(f"{where}: tensor {key!r}: array path {entry['path'][:80]!r} is not a plain relative "
                                  "path inside the group (refusing absolute paths, '..' and empty components)")
        if entry["stored_dtype"] != stored_dtype(meta.dtype, entry["stored_dtype"] == "float32"):
            raise ManifestError(f"{where}: tensor {key!r} ({meta.dtype}) cannot be stored as {entry['stored_dtype']}")
        arrays[key] = (entry["path"], entry["stored_dtype"])
    per_rank: dict[int, dict[str, Any]] = {}
    if attrs.get("per_rank_values"):
        try:
            doc = json.loads(store.read_bytes(f"{PER_RANK_GROUP}/{GROUP_METADATA}"))["attributes"][ATTRIBUTE]
            if doc["version"] != VERSION:
                raise ValueError(f"version {doc['version']!r}")
            per_rank = {int(r): dict(v) for r, v in doc["ranks"].items()}
        except (ValueError, KeyError, TypeError, CheckpointNotFoundError) as exc:
            raise ManifestError(f"{store.url}/{PER_RANK_GROUP}: per-rank values are missing or malformed ({exc})") from None
        if any(not 0 <= r < manifest.world_size for r in per_rank):
            raise ManifestError(f"{store.url}/{PER_RANK_GROUP}: a rank outside the world of {manifest.world_size}")
    return ExportInfo(manifest, arrays, per_rank)
