"""Lazy, read-only views of a checkpoint in model space.

Researchers want one layer's weights, or the Adam moments of one tensor, out
of a multi-TB checkpoint on a laptop. A :class:`CheckpointView` reads the
manifest only; indexing a tensor (``view["model/emb.weight"][128:256]``)
reads just the stored bytes that box needs, from whatever layout saved it.

There is no second reader here: a slice is a load *target* whose region is
the requested box of the global tensor, fed through the loader's planning
machinery (:func:`match_sources` -> :func:`plan_reads` ->
:func:`execute_reads`), so reads are coalesced, widened to checksum blocks
and verified exactly as a load is. The index of a writing rank is read the
first time a box needs one of its pieces, then cached for the view's life.

Indexing follows numpy: ints (negative from the end) drop a dimension,
slices clamp to the shape, ``...`` and ``None`` work; a slice with a step
other than 1 (negative included) reads its bounding box and is indexed in
torch afterwards.
"""

from __future__ import annotations

import difflib
import fnmatch
import operator
import os
from collections.abc import Iterator
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np
import torch

from ckptkit.engine.buffers import BufferPool
from ckptkit.engine.metadata_io import read_manifest
from ckptkit.engine.read_session import ReadSession
from ckptkit.engine.state import torch_dtype
from ckptkit.errors import (
    CkptkitError,
    MissingKeysError,
    OptionsError,
    SliceError,
)
from ckptkit.layout.box import Box
from ckptkit.layout.manifest import DTYPES, Manifest, TensorMeta
from ckptkit.layout.values import decode_value
from ckptkit.storage.base import ByteStore
from ckptkit.storage.url import open_store


@dataclass(frozen=True)
class ViewOptions:
    """How a view reads. ``io_threads``: read requests in flight per box read. ``scratch``: where
    reads that cannot land straight in the result (a box that is not a whole stored piece) stage
    their bytes; a shared :class:`~ckptkit.engine.buffers.BufferPool` bounds and reuses that memory
    (``None``: a fresh buffer per read)."""

    io_threads: int = 4
    scratch: BufferPool | None = None

    def __post_init__(self) -> None:
        if self.io_threads < 1:
            raise OptionsError(f"io_threads {self.io_threads} must be >= 1")


@dataclass(frozen=True)
class TensorEntry:
    """A logical tensor as the manifest describes it (model space: global, unpadded shape)."""

    key: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype]


def open(  # ckptkit.open mirrors zarr.open / tensorstore.open
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    options: ViewOptions = ViewOptions(),
) -> CheckpointView:
    """A lazy, read-only view of the committed checkpoint at ``path`` (local path or ``s3://`` URL).

    Reads the manifest only. Raises CheckpointNotFoundError /
    UncommittedCheckpointError like :func:`ckptkit.load`.
    """
    store = open_store(path, storage_options)
    return CheckpointView(store, read_manifest(store), options)


class CheckpointView:
    """The logical tensors and values of one checkpoint, read on demand.

    Thread-safe: several threads may read boxes at once (the diff and the
    zarr export do). ``bytes_read`` counts every data byte fetched so far,
    checksum-block widening included. Reads go through the checkpoint's
    :class:`~ckptkit.engine.read_session.ReadSession`, the same engine a load uses.
    """

    def __init__(self, store: ByteStore, manifest: Manifest | None = None, options: ViewOptions = ViewOptions(),
                 session: ReadSession | None = None) -> None:
        self._session = session if session is not None else ReadSession(store, manifest, io_threads=options.io_threads)
        self._store = self._session.store
        self._manifest = self._session.manifest
        self._options = options
        self._values: dict[str, Any] | None = None

    # ------------------------------------------------------------ metadata

    @property
    def url(self) -> str:
        return self._store.url

    @property
    def store(self) -> ByteStore:
        return self._store

    @property
    def session(self) -> ReadSession:
        return self._session

    @property
    def manifest(self) -> Manifest:
        return self._manifest

    @property
    def world_size(self) -> int:
        return self._manifest.world_size

    @property
    def meta(self) -> dict[str, Any]:
        """The manifest's metadata: creation time, ckptkit version, ``user`` (what ``save(metadata=...)`` got)."""
        return dict(self._manifest.meta)

    @property
    def bytes_read(self) -> int:
        return self._session.bytes_read

    @property
    def indexes_loaded(self) -> tuple[int, ...]:
        """The writer ranks whose index this view has read so far (only those its reads needed)."""
        return self._session.indexes_loaded

    @property
    def values(self) -> dict[str, Any]:
        """The non-tensor state every rank that held it agreed on (step, scheduler, ...), decoded
        from JSON. Values the saving ranks disagreed about: :meth:`per_rank_values`."""
        if self._values is None:
            where = f"{self.url}: values"
            self._values = {k: decode_value(v, f"{where} {k!r}") for k, v in self._manifest.values.items()}
        return dict(self._values)

    def per_rank_values(self, rank: int) -> dict[str, Any]:
        """The per-rank values (RNG states, ``PerRank``) rank ``rank`` saved, as stored (JSON)."""
        if rank not in self._manifest.indexes:
            raise CkptkitError(f"{self.url}: no rank {rank} in a checkpoint saved by {self.world_size} ranks")
        return dict(self._session.indexes({rank})[rank].values)

    def all_per_rank_values(self) -> dict[int, dict[str, Any]]:
        """Every rank's per-rank values, as stored (reads every index, in parallel)."""
        indexes = self._session.indexes(set(self._manifest.indexes))
        return {r: dict(idx.values) for r, idx in sorted(indexes.items())}

    def values_of(self, rank: int) -> dict[str, Any]:
        """Every value rank ``rank`` gets back at the saving world size: the agreed ones and those the
        saving ranks disagreed about (``rank``'s own), decoded."""
        return {**self.values, **self._split_values(rank)}

    def _split_values(self, rank: int) -> dict[str, Any]:
        out = {}
        for key, groups in self._manifest.rank_values.items():
            for encoded, ranks in groups:
                if rank in ranks:
                    out[key] = decode_value(encoded, f"{self.url}: value {key!r} of rank {rank}")
        return out

    def tensors(self, pattern: str | None = None) -> list[TensorEntry]:
        """Every logical tensor (or those whose key matches the shell ``pattern``), sorted by key."""
        return [
            TensorEntry(k, t.dtype, t.shape)
            for k, t in sorted(self._manifest.tensors.items())
            if pattern is None or fnmatch.fnmatchcase(k, pattern)
        ]

    def keys(self) -> list[str]:
        return sorted(self._manifest.tensors)

    def __contains__(self, key: object) -> bool:
        return key in self._manifest.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._manifest.tensors)

    def __getitem__(self, key: str) -> TensorView:
        return TensorView(self, self.meta_of(key))

    def __repr__(self) -> str:
        return f"CheckpointView({self.url!r}, {len(self)} tensors, saved by {self.world_size} ranks)"

    def meta_of(self, key: str) -> TensorMeta:
        """The manifest entry of ``key``; MissingKeysError with the closest keys if there is none."""
        meta = self._manifest.tensors.get(key)
        if meta is not None:
            return meta
        keys = list(self._manifest.tensors)
        close = difflib.get_close_matches(key, keys, n=5, cutoff=0.5)
        close += [k for k in keys if k.endswith("/" + key) and k not in close][:5]
        hint = f"; close matches: {', '.join(repr(k) for k in close)}" if close else ""
        raise MissingKeysError(
            f"{self.url}: no tensor {key!r} among its {len(keys)} tensors{hint} "
            "(keys are state paths joined with '/', e.g. 'model/layers.0.weight'; see view.tensors())"
        )

    # ------------------------------------------------------------ reading

    def read_box(self, key: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        """The elements of ``box`` of tensor ``key`` as a contiguous CPU tensor.

        Only the stored bytes the box overlaps are read (widened to whole
        checksum blocks), and every byte read is verified. ``out``, when given,
        receives them (a contiguous CPU tensor of the box's shape and the
        tensor's dtype, e.g. a reused buffer) and is returned; else a new
        tensor is.
        """
        meta = self.meta_of(key)
        where = self.url
        if not box.within(meta.shape):
            raise SliceError(f"{where}: box {box.to_json()} is outside tensor {key!r} of shape {list(meta.shape)}")
        dtype = torch_dtype(meta.dtype)
        if out is not None and (out.dtype != dtype or tuple(out.shape) != tuple(box.sizes) or not out.is_contiguous()
                                or out.is_cuda):
            raise SliceError(f"{where}: read_box out= must be a contiguous CPU {dtype} tensor of shape "
                             f"{list(box.sizes)}, got {out.dtype} {list(out.shape)}")
        return self._session.read_box(key, box, out, scratch=self._options.scratch)


class TensorView:
    """One logical tensor of a :class:`CheckpointView`; indexing it reads only what the index needs."""

    def __init__(self, view: CheckpointView, meta: TensorMeta) -> None:
        self._view = view
        self._meta = meta

    @property
    def key(self) -> str:
        return self._meta.key

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self._meta.dtype)

    @property
    def dtype_name(self) -> str:
        return self._meta.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self._meta.shape

    @property
    def ndim(self) -> int:
        return len(self._meta.shape)

    @property
    def numel(self) -> int:
        return self._meta.numel

    @property
    def nbytes(self) -> int:
        return self._meta.numel * DTYPES[self._meta.dtype]

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError(f"len() of the 0-d tensor {self.key!r}")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"TensorView({self.key!r}, {self.dtype_name}, shape={list(self.shape)})"

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.read(index)

    def read(self, index: Any = Ellipsis) -> torch.Tensor:
        """``tensor[index]`` as a torch tensor (a fresh CPU tensor; the whole tensor by default)."""
        sel = select(index, self.shape, f"{self._view.url}: tensor {self.key!r}")
        data = self._view.read_box(self.key, sel.box)
        if sel.flip:
            data = torch.flip(data, sel.flip)
        out = data[sel.post] if sel.post else data
        return out.contiguous() if sel.strided else out

    def numpy(self, index: Any = Ellipsis) -> np.ndarray:
        """``tensor[index]`` as a numpy array; bfloat16 and float8 as ``ml_dtypes`` arrays."""
        return to_numpy(self.read(index))


# ---------------------------------------------------------------- indexing


@dataclass(frozen=True)
class Selection:
    """How an index is served: read ``box``, flip dims ``flip``, then apply ``post`` (a torch index)."""

    box: Box
    flip: tuple[int, ...]
    post: tuple[Any, ...]
    strided: bool  # post-indexing leaves a strided view: copy it so the bounding box is freed


def select(index: Any, shape: tuple[int, ...], name: str) -> Selection:
    """Turn a numpy-style ``index`` of a tensor of ``shape`` into the box to read and what to do after.

    ``name`` (e.g. ``"ckpt: tensor 'w'"``) starts every error message. Pure (no
    reads), so it is tested against numpy directly.
    """
    items = index if isinstance(index, tuple) else (index,)
    ellipses = sum(1 for it in items if it is Ellipsis)
    if ellipses > 1:
        raise SliceError(f"{name}: an index can only have a single ellipsis ('...')")
    consuming = sum(1 for it in items if it is not None and it is not Ellipsis)
    if consuming > len(shape):
        raise SliceError(
            f"{name} of shape {list(shape)} has {len(shape)} dimension(s), the index has {consuming}"
        )
    expanded: list[Any] = []
    for it in items:
        if it is Ellipsis:
            expanded.extend([slice(None)] * (len(shape) - consuming))
        else:
            expanded.append(it)
    if not ellipses:
        expanded.extend([slice(None)] * (len(shape) - consuming))
    offsets: list[int] = []
    sizes: list[int] = []
    flip: list[int] = []
    post: list[Any] = []
    strided = False
    dim = 0
    for it in expanded:
        if it is None:
            post.append(None)
            continue
        n = shape[dim]
        if isinstance(it, slice):
            start, stop, step = it.indices(n) if it.step != 0 else (0, 0, 0)
            if step == 0:
                raise SliceError(f"{name}: slice step cannot be zero (dimension {dim})")
            count = len(range(start, stop, step))
            if count == 0:
                offsets.append(0)
                sizes.append(0)
                post.append(slice(None))
            elif step > 0:
                offsets.append(start)
                sizes.append((count - 1) * step + 1)
                post.append(slice(None, None, step) if step != 1 else slice(None))
                strided |= step != 1
            else:
                last = start + (count - 1) * step
                offsets.append(last)
                sizes.append(start - last + 1)
                flip.append(len(offsets) - 1)
                post.append(slice(None, None, -step) if step != -1 else slice(None))
                strided |= step != -1
        else:
            if isinstance(it, (bool, np.bool_)) or (isinstance(it, torch.Tensor) and it.dtype == torch.bool):
                raise SliceError(f"{name}: boolean masks are not supported; read a box and mask it in torch")
            try:
                i = operator.index(it)
            except TypeError:
                raise SliceError(
                    f"{name}: index of type {type(it).__name__} is not supported "
                    "(use ints, slices, '...' and None; read a box and index it in torch for anything else)"
                ) from None
            if not -n <= i < n:
                raise SliceError(f"{name}: index {i} is out of range for dimension {dim} of size {n}")
            offsets.append(i % n)
            sizes.append(1)
            post.append(0)
        dim += 1
    trivial = all(p == slice(None) for p in post)
    return Selection(Box(tuple(offsets), tuple(sizes)), tuple(flip), () if trivial else tuple(post), strided)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as numpy; dtypes numpy lacks (bfloat16, float8) become ``ml_dtypes`` arrays (bit-exact)."""
    name = str(t.dtype).removeprefix("torch.")
    if name in NO_NUMPY_DTYPES:
        raise CkptkitError(f"numpy has no {name}; use the torch tensor")
    if name not in ML_DTYPES:
        return t.numpy()
    try:
        import ml_dtypes
    except ImportError:
        raise CkptkitError(
            f"numpy has no {name}; install ml_dtypes (it comes with tensorstore) or use the torch tensor"
        ) from None
    as_int = {1: torch.uint8, 2: torch.int16}[t.element_size()]
    return t.view(as_int).numpy().view(getattr(ml_dtypes, name))


NO_NUMPY_DTYPES = ("complex32", "float4_e2m1fn_x2")
"""Checkpoint dtypes with no numpy (nor ``ml_dtypes``, nor zarr) type: read as torch tensors only."""
ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
"""Checkpoint dtypes numpy lacks and ``ml_dtypes`` has: read into numpy as ``ml_dtypes`` arrays."""
