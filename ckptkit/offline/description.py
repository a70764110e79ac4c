"""Describing a checkpoint from its metadata alone: tensors, layouts, meshes, pieces per rank.

What ``ckptkit inspect`` shows. Reads the manifest and the indexes (through the read engine,
:class:`~ckptkit.engine.read_session.ReadSession`), never a data object.
"""

from __future__ import annotations

import fnmatch
import os
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ckptkit.engine.read_session import ReadSession
from ckptkit.layout.grid import GridLayout, Mesh, On, Placement, Replicate
from ckptkit.layout.manifest import DTYPES, ExplicitLayout, TensorMeta
from ckptkit.offline.listing import created_of
from ckptkit.storage.url import open_store


@dataclass(frozen=True)
class MeshInfo:
    """A device mesh tensors were saved on: the layout of the job that wrote them."""

    name: str
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class TensorInfo:
    """One logical tensor; ``nbytes`` is its logical size, ``stored_pieces`` counts its index entries."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    nbytes: int
    layout_kind: str
    layout: str
    mesh: str | None
    stored_pieces: int


@dataclass(frozen=True)
class RankInfo:
    """What one rank wrote, from its index: how the save's I/O was spread."""

    rank: int
    index: str
    pieces: int
    nbytes: int
    value_keys: tuple[str, ...]


@dataclass(frozen=True)
class CheckpointDescription:
    """What a checkpoint holds and how it was laid out, from metadata alone (``meta`` is the raw JSON)."""

    url: str
    world_size: int
    version: int
    parallel: str | None
    created: str | None
    total_bytes: int
    meshes: tuple[MeshInfo, ...]
    tensors: tuple[TensorInfo, ...]
    ranks: tuple[RankInfo, ...]
    values: tuple[str, ...]
    per_rank_keys: tuple[str, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    def select(self, pattern: str) -> CheckpointDescription:
        """Only the tensors and values whose key matches the shell-style ``pattern`` (a torchtitan
        optimizer has a dozen values per parameter: unfiltered they would bury the tensors asked for)."""
        return replace(self, tensors=tuple(t for t in self.tensors if fnmatch.fnmatchcase(t.key, pattern)),
                       values=tuple(v for v in self.values if fnmatch.fnmatchcase(v, pattern)))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def describe(url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> CheckpointDescription:
    """Everything the metadata says about the checkpoint at ``url``; reads no data object.

    Raises the usual CkptkitError subclasses if the manifest or an index is
    missing or fails its integrity check (``verify`` reports those instead).
    """
    session = ReadSession(open_store(url, storage_options))
    store, manifest = session.store, session.manifest
    indexes = session.indexes(set(manifest.indexes))
    stored = Counter(e.tensor for idx in indexes.values() for e in idx.entries)
    meshes: dict[Mesh, MeshInfo] = {}  # named m0, m1, ... in manifest order, as the manifest file does
    tensors = []
    for key, t in manifest.tensors.items():
        mesh = None
        if isinstance(t.layout, GridLayout):
            m = t.layout.mesh
            mesh = meshes.setdefault(m, MeshInfo(f"m{len(meshes)}", m.dims, m.shape, m.ranks)).name
        kind = "grid" if isinstance(t.layout, GridLayout) else "explicit"
        nbytes = t.numel * DTYPES[t.dtype]
        tensors.append(TensorInfo(key, t.dtype, t.shape, t.numel, nbytes, kind, layout_summary(t), mesh, stored[key]))
    ranks = tuple(
        RankInfo(r, manifest.indexes[r].key, len(idx.entries), sum(e.nbytes for e in idx.entries), tuple(sorted(idx.values)))
        for r, idx in sorted(indexes.items())
    )
    meta = manifest.meta
    total = meta.get("tensor_bytes")
    total = total if isinstance(total, int) else sum(r.nbytes for r in ranks)
    return CheckpointDescription(
        store.url, manifest.world_size, manifest.version, manifest.parallel, created_of(meta), total,
        tuple(meshes.values()), tuple(tensors), ranks, tuple(sorted(manifest.values)), manifest.per_rank_keys, meta,
    )


def layout_summary(t: TensorMeta) -> str:
    """A short human reading of a layout: ``grid mesh (dp=4) [Shard(0)]``, ``explicit: 12 pieces``, with
    the expert axis of a routed expert's tensor (``· 8 experts on axis 1``)."""
    return _stored_summary(t) + _expert_summary(t)


def _expert_summary(t: TensorMeta) -> str:
    rule = t.rule
    if rule is None:
        return ""
    if rule.expert_axis is not None and rule.expert_axis < len(t.shape):
        return f" · {t.shape[rule.expert_axis]} experts on axis {rule.expert_axis}"
    if rule.expert is not None:
        return f" · expert {rule.expert} of {rule.num_experts}"
    return ""


def _stored_summary(t: TensorMeta) -> str:
    if isinstance(t.layout, ExplicitLayout):
        writers = {w for _, w in t.layout.pieces}
        n = len(t.layout.pieces)
        return f"explicit: {n} piece{'s' * (n != 1)} from {len(writers)} rank{'s' * (len(writers) != 1)}"
    g = t.layout
    dims = ", ".join(f"{d}={n}" for d, n in zip(g.mesh.dims, g.mesh.shape))
    out = f"grid mesh ({dims}) [{', '.join(_placement(p) for p in g.placements)}]"
    if g.padded is not None:
        out += f" padded to {list(g.padded)}"
    if g.fused is not None:
        out += f" fused axis {g.fused.axis} {list(g.fused.parts)}"
    return out


def _placement(p: Placement) -> str:
    if isinstance(p, Replicate):
        return "Replicate"
    if isinstance(p, On):
        return f"On({p.index})"
    extra = f", split={p.split_factor}" if p.split_factor != 1 else ""
    extra += f", sizes={list(p.sizes)}" if p.sizes is not None else ""
    return f"Shard({p.axis}{extra})"
