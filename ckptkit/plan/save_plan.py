"""Save planning: which pieces this rank writes, where, and what it reports.

Pure functions over layout declarations. No collective is needed to plan:

* a grid-laid tensor (DTensor, rule-based) is written by one replica per
  cell, ``(rotation + cell) mod replicas``; rotations are chosen per mesh by a
  longest-first greedy over the bytes every replica would write, a
  computation every rank of the mesh repeats identically (SPMD);
* an explicit piece with ``replica=(index, count)`` is written by replica
  ``crc32(tensor, region) mod count`` — decided from the piece alone, so
  replicas can never disagree even if their other pieces differ.

Pieces are laid out back to back in one data object per rank, aligned, so
the persist step is one large sequential write.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace
from functools import lru_cache
from math import prod

from ckptkit.errors import LayoutError
from ckptkit.layout.box import Region
from ckptkit.layout.grid import GridLayout, Mesh, On
from ckptkit.layout.manifest import TensorMeta
from ckptkit.layout.pieces import LocalBox, LocalPlace, Piece
from ckptkit.layout.rules import PartitionRule
from ckptkit.layout.strict_json import gc_paused

SMALL_PIECE = 64 << 10
GATHER_SMALL_REPLICAS = 64  # from this many replicas on, a group's small tensors share one writer
SMALL_ALIGN = 64
LARGE_ALIGN = 4096


@dataclass(frozen=True)
class GridDecl:
    """A local tensor whose layout is a grid rule (a DTensor, or a rule-based tensor)."""

    ref: int
    key: str
    dtype: str
    itemsize: int
    local_shape: tuple[int, ...]
    layout: GridLayout
    coord: tuple[int, ...]
    rule: PartitionRule | None = None


@dataclass(frozen=True)
class ExplicitDecl:
    """A local tensor described piece by piece."""

    ref: int
    dtype: str
    itemsize: int
    local_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    rule: PartitionRule | None = None


@dataclass(frozen=True)
class WriteItem:
    tensor: str
    dtype: str
    region: Region
    ref: int
    local: LocalPlace
    nbytes: int
    object: str
    offset: int


@dataclass(frozen=True)
class ExplicitReport:
    tensor: str
    dtype: str
    shape: tuple[int, ...]
    region: Region
    rule: PartitionRule | None = None


@dataclass(frozen=True)
class SavePlan:
    rank: int
    items: tuple[WriteItem, ...]
    objects: dict[str, int]
    grid_reports: tuple[TensorMeta, ...]
    explicit_reports: tuple[ExplicitReport, ...]
    rotation_digest: dict[str, int]

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    def for_attempt(self, attempt: str | None) -> SavePlan:
        """This plan with its objects named for save attempt ``attempt`` (see :func:`data_object_key`).

        Plans are cached across saves of one structure; every save is a new attempt, so the names
        are bound per save, just before persisting."""
        if attempt is None:
            return self
        names = {obj: _with_attempt(obj, attempt) for obj in self.objects}
        with gc_paused():  # one item per local piece, rebuilt in the background of every save (Index.to_json_bytes)
            items = tuple(replace(i, object=names[i.object]) for i in self.items)
        return replace(self, items=items, objects={names[o]: n for o, n in self.objects.items()})


def data_object_key(rank: int, attempt: str | None = None) -> str:
    """``data/rank-00003-<attempt>.bin``: every save attempt names its own objects.

    Two writers of one step (two jobs racing, a retried save) must never share an object name:
    the loser would overwrite the winner's bytes after its manifest committed them. The attempt
    id is recorded in the manifest; objects of other attempts are garbage."""
    return _with_attempt(f"data/rank-{rank:05d}.bin", attempt)


def index_object_key(rank: int, attempt: str | None = None) -> str:
    return _with_attempt(f"index/rank-{rank:05d}.json", attempt)


def _with_attempt(key: str, attempt: str | None) -> str:
    if attempt is None:
        return key
    stem, dot, ext = key.rpartition(".")
    return f"{stem}-{attempt}{dot}{ext}"


def grid_rotations(decls: list[GridDecl]) -> dict[str, int]:
    """Per-tensor replica rotation balancing written bytes across replicas of each mesh.

    Tensors under SMALL_PIECE bytes of a group of at least GATHER_SMALL_REPLICAS replicas share one
    writer: balancing them gains nothing, and spreading them sends every loading rank to every
    writer's index (torchtitan's per-parameter Adam ``step`` scalars, replicated over 1,024 ranks,
    went to 563 writers: each loading rank read 94 MiB of indexes)."""
    groups: dict[str, list[GridDecl]] = {}
    for d in decls:
        groups.setdefault(replica_group_tag(d.layout), []).append(d)
    out: dict[str, int] = {}
    for group in groups.values():
        replicas = group[0].layout.num_replicas
        load = [0] * replicas
        numel = {d.key: prod(d.layout.shape) * d.itemsize for d in group}
        small_rotation: int | None = None
        for d in sorted(group, key=lambda d: (-numel[d.key], d.key)):
            if replicas == 1:
                out[d.key] = 0
                continue
            cells = d.layout.num_cells
            per_cell = numel[d.key] / cells
            rot = load.index(min(load))
            if numel[d.key] < SMALL_PIECE and replicas >= GATHER_SMALL_REPLICAS:
                rot = small_rotation = rot if small_rotation is None else small_rotation
            if cells < replicas:
                for c in range(cells):
                    load[(rot + c) % replicas] += per_cell
            else:
                q, rem = divmod(cells, replicas)
                for j in range(replicas):
                    load[j] += per_cell * (q + (1 if (j - rot) % replicas < rem else 0))
            out[d.key] = rot
    return out


def replica_group_tag(layout: GridLayout) -> str:
    """A process-independent name for the set of ranks that replicate a grid tensor's cells.

    Tensors with the same tag are held by the same ranks (SPMD), so every
    holder balances them identically.
    """
    on = tuple((i, p.index) for i, p in enumerate(layout.placements) if isinstance(p, On))
    return f"{mesh_fingerprint(layout.mesh)}-{zlib.crc32(repr((layout.replica_dims, on)).encode()):08x}"


@lru_cache(maxsize=256)
def mesh_fingerprint(mesh: Mesh) -> str:
    text = repr((mesh.dims, mesh.shape, mesh.ranks))
    return f"{zlib.crc32(text.encode()):08x}{len(text):x}"


def explicit_writer(piece: Piece) -> bool:
    """True if this replica of ``piece`` is the one that stores it."""
    if piece.replica is None:
        return True
    index, count = piece.replica
    digest = zlib.crc32(repr((piece.tensor, piece.region.key())).encode())
    return digest % count == index


def plan_save(rank: int, grid: list[GridDecl], explicit: list[ExplicitDecl]) -> SavePlan:
    """Everything this rank writes, laid out in its data object, plus what it reports."""
    seen_keys: set[str] = set()
    for d in grid:
        if d.key in seen_keys:
            raise LayoutError(f"tensor {d.key!r} appears twice in the state")
        seen_keys.add(d.key)
    rotations = grid_rotations(grid)
    obj = data_object_key(rank)
    items: list[WriteItem] = []
    offset = 0

    def add(tensor: str, dtype: str, region: Region, ref: int, local: LocalPlace, nbytes: int) -> None:
        nonlocal offset
        align = LARGE_ALIGN if nbytes >= SMALL_PIECE else SMALL_ALIGN
        offset = -(-offset // align) * align
        items.append(WriteItem(tensor, dtype, region, ref, local, nbytes, obj, offset))
        offset += nbytes

    grid_reports: list[TensorMeta] = []
    held_on: dict[str, list[str]] = {}  # replica group -> "key:rotation" of what this rank holds there
    for d in grid:
        held = d.layout.local_pieces(d.coord)
        if held is None:
            continue
        local_shape, pieces = held
        if tuple(local_shape) != tuple(d.local_shape):
            raise LayoutError(
                f"tensor {d.key!r}: local shape {list(d.local_shape)} does not match the layout's "
                f"{list(local_shape)} at mesh coordinate {list(d.coord)}"
            )
        rot = rotations[d.key]
        mesh_tag = replica_group_tag(d.layout)
        held_on.setdefault(mesh_tag, []).append(f"{d.key}:{rot}")
        if not d.layout.is_writer(d.coord, rot):
            continue
        for local_off, box in pieces:
            if box.is_empty():
                continue
            add(d.key, d.dtype, Region(box), d.ref, LocalBox(local_off), box.numel * d.itemsize)
        if d.layout.cell_of(d.coord) == 0:
            grid_reports.append(TensorMeta(d.key, d.dtype, d.layout.shape, d.layout, rot, d.rule))
    explicit_reports: list[ExplicitReport] = []
    for e in explicit:
        for p in e.pieces:
            p.check_fits(e.local_shape)
            if p.tensor in seen_keys:
                raise LayoutError(f"tensor {p.tensor!r} is declared both as a grid tensor and by explicit pieces")
            if not explicit_writer(p) or p.numel == 0:
                continue
            add(p.tensor, e.dtype, p.region, e.ref, p.local, p.numel * e.itemsize)
            explicit_reports.append(ExplicitReport(p.tensor, e.dtype, p.shape, p.region, e.rule))
    # what the holders of a replica group compare: independent of the order the state lists tensors in
    digest = {tag: zlib.crc32("\n".join(sorted(items)).encode()) for tag, items in held_on.items()}
    return SavePlan(rank, tuple(items), {obj: offset}, tuple(grid_reports), tuple(explicit_reports), digest)

