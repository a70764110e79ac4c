"""DCP's on-disk format, as the DCP converters read and write it: metadata, blobs, keys.

A checkpoint written by ``torch.distributed.checkpoint.save`` with the default
``FileSystemWriter`` / ``FsspecWriter`` (the format of torch 2.4 and later,
tested with 2.13; torchtitan's ``step-N`` folders) is a directory holding:

* ``.metadata``: a pickle of ``Metadata`` — ``state_dict_metadata`` (flattened
  key -> ``TensorStorageMetadata(properties.dtype, size, chunks)`` or
  ``BytesStorageMetadata``), ``storage_data`` (``MetadataIndex(fqn, chunk
  offsets)`` -> ``_StorageInfo(relative_path, offset, length,
  transform_descriptors)``) and ``planner_data`` (flattened key -> the path of
  keys and list indices it came from). Written last, by rank 0: its
  appearance is DCP's commit.
* ``__{rank}_{i}.distcp``: the items rank ``rank`` wrote (``i`` counts its
  writer threads), back to back. A tensor chunk is a ``torch.save`` archive
  of exactly that chunk (``offsets``/``sizes`` in the global tensor); a
  non-tensor item is a ``torch.save`` archive of the Python object.

:func:`parse_metadata` turns the unpickled metadata (see
:mod:`ckptkit_converters.common.safe_unpickle`) into plain frozen dataclasses, checking every
field it uses (types, dtypes, chunk boxes inside the tensor, safe relative
paths, no stream transforms). :func:`load_blob` decodes a blob admitting only what
``torch.load(weights_only=True)`` admits by default. :func:`build_metadata` is the export
side. Key mapping (both directions) is in :mod:`ckptkit_converters.dcp.keys`.
"""

from __future__ import annotations

import io
import pickle
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptkit.engine.state import dtype_name, torch_dtype
from ckptkit.errors import CkptkitError, CorruptCheckpointError, ManifestError
from ckptkit.layout.box import Box
from ckptkit.layout.manifest import DTYPES, check_object_key
from ckptkit.storage.base import ByteStore
from ckptkit_converters.common.safe_unpickle import UnsafeCheckpointError, restricted_torch_load

METADATA_NAME = ".metadata"
DCP_VERSION = "1.0.0"  # what torch 2.13's FileSystemWriter records
_DISTCP = re.compile(r"^__([0-9]+)_([0-9]+)\.distcp$")

PathItem = str | int
ObjPath = tuple[PathItem, ...]


@dataclass(frozen=True)
class Blob:
    """Where one item's bytes are: ``length`` bytes at ``offset`` of ``file`` (relative to the checkpoint)."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class Chunk:
    """One stored chunk of a tensor: a box of the global tensor and its blob."""

    box: Box
    blob: Blob


@dataclass(frozen=True)
class DcpTensor:
    fqn: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class DcpBytes:
    """A non-tensor item: a ``torch.save`` archive of a Python object."""

    fqn: str
    blob: Blob


@dataclass(frozen=True)
class DcpCheckpoint:
    """A DCP checkpoint's metadata, validated: tensors and non-tensor items by flattened key,
    each key's path (``planner_data``; None when the metadata has none), and DCP's version."""

    tensors: dict[str, DcpTensor]
    items: dict[str, DcpBytes]
    paths: dict[str, ObjPath] | None
    version: str | None

    def files(self) -> dict[str, int]:
        """Every data file and the size its blobs need (its last blob's end)."""
        out: dict[str, int] = {}
        blobs = [c.blob for t in self.tensors.values() for c in t.chunks] + [i.blob for i in self.items.values()]
        for b in blobs:
            out[b.file] = max(out.get(b.file, 0), b.offset + b.length)
        return dict(sorted(out.items()))


def file_rank(name: str) -> int | None:
    """The rank that wrote ``__{rank}_{i}.distcp``; None for any other name."""
    m = _DISTCP.match(name)
    return int(m.group(1)) if m else None


def writer_ranks(files: Sequence[str]) -> dict[str, int]:
    """The rank that wrote each data file: ``__{rank}_{i}.distcp`` -> ``rank``; any other
    name (a custom writer) gets a rank of its own after the highest one."""
    ranks: dict[str, int] = {}
    other = []
    for name in sorted(files):
        rank = file_rank(name)
        if rank is not None:
            ranks[name] = rank
        else:
            other.append(name)
    nxt = max(ranks.values(), default=-1) + 1
    for i, name in enumerate(other):
        ranks[name] = nxt + i
    return ranks


# ---------------------------------------------------------------- reading


def parse_metadata(md: Any, where: str) -> DcpCheckpoint:
    """Validate an unpickled DCP ``Metadata`` and describe it with plain dataclasses."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    if not isinstance(md, Metadata):
        raise ManifestError(f"{where}: expected a torch.distributed.checkpoint Metadata, got {type(md).__name__}")
    sdm = md.state_dict_metadata
    storage = md.storage_data
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise ManifestError(f"{where}: state_dict_metadata and storage_data must be dicts "
                            "(was this written by the default FileSystemWriter / FsspecWriter?)")
    blobs: dict[tuple[str, tuple[int, ...] | None], Blob] = {}
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            raise ManifestError(f"{where}: storage_data key {index!r} is not a MetadataIndex")
        if not isinstance(info, _StorageInfo):
            raise ManifestError(f"{where}: storage_data of {index.fqn!r} is {type(info).__name__}, not _StorageInfo "
                                "(only the default FileSystemWriter / FsspecWriter layout is supported)")
        offset = None if index.offset is None else _ints(index.offset, f"{where}: {index.fqn!r} offset")
        blobs[(index.fqn, offset)] = _blob(info, index.fqn, where)
    tensors: dict[str, DcpTensor] = {}
    items: dict[str, DcpBytes] = {}
    for fqn, entry in sdm.items():
        if not isinstance(fqn, str):
            raise ManifestError(f"{where}: state_dict_metadata key {fqn!r} is not a string")
        if isinstance(entry, TensorStorageMetadata):
            tensors[fqn] = _tensor(fqn, entry, blobs, where)
        elif isinstance(entry, BytesStorageMetadata):
            blob = blobs.get((fqn, None))
            if blob is None:
                raise ManifestError(f"{where}: item {fqn!r} has no storage entry")
            items[fqn] = DcpBytes(fqn, blob)
        else:
            raise ManifestError(f"{where}: item {fqn!r} has unknown storage metadata {type(entry).__name__}")
    version = md.version if isinstance(md.version, str) else None
    return DcpCheckpoint(tensors, items, _paths(md.planner_data, sdm, where), version)


def _tensor(fqn: str, entry: Any, blobs: Mapping[tuple[str, Any], Blob], where: str) -> DcpTensor:
    name = f"{where}: tensor {fqn!r}"
    props = entry.properties
    dtype = getattr(props, "dtype", None)
    if not isinstance(dtype, torch.dtype) or dtype_name(dtype) not in DTYPES:
        raise ManifestError(f"{name}: unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    shape = _ints(entry.size, f"{name}: size")
    if not isinstance(entry.chunks, list):
        raise ManifestError(f"{name}: chunks must be a list")
    chunks = []
    for c in entry.chunks:
        offsets = _ints(getattr(c, "offsets", None), f"{name}: chunk offsets")
        sizes = _ints(getattr(c, "sizes", None), f"{name}: chunk sizes")
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise ManifestError(f"{name}: chunk {list(offsets)}+{list(sizes)} does not match rank {len(shape)}")
        box = Box(offsets, sizes)
        if not box.within(shape):
            raise ManifestError(f"{name}: chunk {box.to_json()} is outside shape {list(shape)}")
        blob = blobs.get((fqn, offsets))
        if blob is None:
            raise ManifestError(f"{name}: chunk at offsets {list(offsets)} has no storage entry")
        chunks.append(Chunk(box, blob))
    return DcpTensor(fqn, dtype_name(dtype), shape, tuple(chunks))


def _blob(info: Any, fqn: str, where: str) -> Blob:
    name = f"{where}: item {fqn!r}"
    if getattr(info, "transform_descriptors", None):
        raise ManifestError(f"{name} is stored through stream transforms {list(info.transform_descriptors)} "
                            "(e.g. DCP's experimental compression extension), which this converter does not read")
    path = check_object_key(info.relative_path, name)
    offset, length = info.offset, info.length
    for v, what in ((offset, "offset"), (length, "length")):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ManifestError(f"{name}: storage {what} {v!r} is not a non-negative integer")
    return Blob(path, offset, length)


def _ints(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ManifestError(f"{where}: expected a sequence of non-negative integers, got {value!r}")
    return tuple(value)


def _paths(planner_data: Any, sdm: Mapping[str, Any], where: str) -> dict[str, ObjPath] | None:
    """``planner_data`` as DCP's default planner writes it (key -> path whose parts, dot-joined,
    are the key); None when it is absent or not that (a custom planner's own data)."""
    if not isinstance(planner_data, dict) or not planner_data:
        return None
    out: dict[str, ObjPath] = {}
    for fqn in sdm:
        path = planner_data.get(fqn)
        if not isinstance(path, (tuple, list)) or not path or not all(
                isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool) and p >= 0) for p in path):
            return None
        if ".".join(map(str, path)) != fqn or not isinstance(path[0], str):
            return None
        out[fqn] = tuple(path)
    return out


# ---------------------------------------------------------------- blobs


class _BufferReader(io.RawIOBase):
    """A seekable read-only file over a buffer, without ``io.BytesIO``'s copy of a bytearray."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, out: Any) -> int:
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n


def read_blob(src: ByteStore, blob: Blob) -> bytearray:
    """The bytes of one blob, read through the store (the checkpoint folder's own bounds and checks)."""
    buf = bytearray(blob.length)
    if blob.length:
        src.read_into(blob.file, blob.offset, memoryview(buf))
    return buf


def load_blob(data: bytes | bytearray | memoryview, where: str) -> Any:
    """Decode one ``torch.save`` blob admitting exactly what ``torch.load(weights_only=True)`` admits by
    default (tensors and plain containers;
    :func:`ckptkit_converters.common.safe_unpickle.restricted_torch_load`, which neither trusts nor
    touches the process-wide ``add_safe_globals`` set, as blobs decode on reader threads); anything else raises :class:`UnsafeCheckpointError` (nothing is executed)."""
    try:
        return restricted_torch_load(_BufferReader(data), where=where)
    except UnsafeCheckpointError as exc:
        detail = str(exc).removeprefix(f"{where}: ")
        raise UnsafeCheckpointError(f"{where}: refused by torch.load(weights_only=True)'s allow-list, which admits "
                                    f"only tensors and plain containers: {detail}") from None
    except CkptkitError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch reports damaged archives with plain RuntimeErrors
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
        raise CorruptCheckpointError(
            f"{where}: not a readable torch.save archive ({type(exc).__name__}: {lines[0] if lines else ''}); "
            "the file may be damaged, or written by a non-default DCP writer (e.g. serialization_format=SAFETENSORS)"
        ) from None


def load_chunk(data: bytes | bytearray | memoryview, tensor: DcpTensor, chunk: Chunk, where: str) -> torch.Tensor:
    """A tensor chunk's blob as a contiguous CPU tensor, checked against the metadata's dtype and box."""
    t = load_blob(data, where)
    if not isinstance(t, torch.Tensor):
        raise CorruptCheckpointError(
            f"{where}: expected a tensor chunk of {tensor.fqn!r}, the blob holds a {type(t).__name__}")
    if dtype_name(t.dtype) != tensor.dtype:
        raise CorruptCheckpointError(f"{where}: chunk of {tensor.fqn!r} is {dtype_name(t.dtype)}, the metadata says {tensor.dtype}")
    if tuple(t.shape) != chunk.box.sizes:
        raise CorruptCheckpointError(
            f"{where}: chunk of {tensor.fqn!r} at offsets {list(chunk.box.offsets)} has shape {list(t.shape)}, "
            f"the metadata says {list(chunk.box.sizes)}")
    return t.detach().contiguous()


def read_chunk(src: ByteStore, tensor: DcpTensor, chunk: Chunk) -> torch.Tensor:
    """One tensor chunk read through the store and decoded (``weights_only``), checked against the metadata;
    errors name the file, the chunk and the tensor."""
    where = f"{src.url}/{chunk.blob.file} (chunk {list(chunk.box.offsets)} of {tensor.fqn!r})"
    return load_chunk(read_blob(src, chunk.blob), tensor, chunk, where)


def save_blob(obj: Any) -> bytes:
    """What DCP writes for an item: a ``torch.save`` archive (of a tensor chunk or a Python value)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# ---------------------------------------------------------------- writing


@dataclass(frozen=True)
class OutTensor:
    fqn: str
    path: ObjPath
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class OutItem:
    fqn: str
    path: ObjPath
    blob: Blob


def build_metadata(tensors: Sequence[OutTensor], items: Sequence[OutItem], checkpoint_id: str) -> bytes:
    """The pickled ``Metadata`` DCP's reader expects for these tensors and items (the export's commit)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, ObjPath] = {}
    for item in items:
        sdm[item.fqn] = BytesStorageMetadata()
        storage[MetadataIndex(item.fqn)] = _StorageInfo(item.blob.file, item.blob.offset, item.blob.length)
        planner[item.fqn] = item.path
    for t in tensors:
        chunks = [ChunkStorageMetadata(torch.Size(c.box.offsets), torch.Size(c.box.sizes)) for c in t.chunks]
        sdm[t.fqn] = TensorStorageMetadata(TensorProperties(dtype=torch_dtype(t.dtype)), torch.Size(t.shape), chunks)
        for i, c in enumerate(t.chunks):
            storage[MetadataIndex(t.fqn, c.box.offsets, i)] = _StorageInfo(c.blob.file, c.blob.offset, c.blob.length)
        planner[t.fqn] = t.path
    md = Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage,
                  storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=str(uuid.uuid4())),
                  version=DCP_VERSION)
    return pickle.dumps(md)


def data_file(rank: int) -> str:
    """The data file of writer rank ``rank``, named as DCP's FileSystemWriter names it."""
    return f"__{rank}_0.distcp"
