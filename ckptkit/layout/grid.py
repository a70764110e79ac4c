"""Grid layouts: a tensor split over a named device mesh, evaluable for any rank.

A :class:`GridLayout` is a *rule*: given a mesh coordinate it says which
elements of the global tensor that rank holds and where they sit in its local
tensor. It has the semantics of DTensor placements (``Shard`` with
``torch.chunk`` sizing, nested shards applied left to right over mesh
dimensions, ``_StridedShard``'s right-to-left order as FSDP2 + TP produce it,
``Replicate``) plus what Megatron-style layouts need: explicit uneven chunk
sizes (pipeline stages with different layer counts), ``On(i)`` (only mesh
coordinate ``i`` holds the tensor: the PP stage owning a layer, the EP rank
owning an expert), fused parts split separately (GLU ``[gate; up]``) and
padding that is not model space (vocab padding).

Because the manifest stores the rule rather than every rank's boxes, a
loading rank evaluates just the cells its target overlaps, and a 16k-rank
checkpoint's metadata does not grow as ranks x tensors.

Every tensor dimension is sharded by its own set of mesh dimensions, so the
held elements factor per dimension: a cell's pieces are the product of
per-dimension *runs*. Queries work dimension by dimension.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property, lru_cache
from math import prod

from ckptkit.errors import LayoutError, ManifestError
from ckptkit.layout.box import Box
from ckptkit.layout.strict_json import MAX_WORLD, as_dict, as_int, as_ints, as_list, as_str

# (global_start, local_start, length): a contiguous stretch of one tensor
# dimension and where it sits in the local tensor's dimension.
Run = tuple[int, int, int]


@dataclass(frozen=True, eq=False)
class Mesh:
    """Named mesh dimensions and the global rank at every coordinate (row-major)."""

    dims: tuple[str, ...]
    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.dims) != len(self.shape):
            raise LayoutError(f"mesh dims {self.dims} and shape {self.shape} differ in length")
        if any(s < 1 for s in self.shape):
            raise LayoutError(f"mesh shape {self.shape} must be positive")
        if len(self.ranks) != prod(self.shape):
            raise LayoutError(f"mesh of shape {self.shape} needs {prod(self.shape)} ranks, got {len(self.ranks)}")
        if len(set(self.ranks)) != len(self.ranks):
            raise LayoutError("mesh ranks must be distinct")
        # Meshes key caches of layout evaluations; hashing 16k ranks per lookup would dominate.
        object.__setattr__(self, "_hash", hash((self.dims, self.shape, self.ranks)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Mesh) or self._hash != other._hash:  # type: ignore[attr-defined]
            return False
        return (self.dims, self.shape, self.ranks) == (other.dims, other.shape, other.ranks)

    @staticmethod
    def arange(dims: tuple[str, ...], shape: tuple[int, ...], start: int = 0) -> Mesh:
        return Mesh(tuple(dims), tuple(shape), tuple(range(start, start + prod(shape))))

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rank_at(self, coord: tuple[int, ...]) -> int:
        lin = 0
        for c, n in zip(coord, self.shape):
            lin = lin * n + c
        return self.ranks[lin]

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        """The coordinate of ``rank`` in this mesh, or None if it is not a member.

        The rank -> coordinate table is kept on the mesh: looking it up in a cache keyed by the rank
        tuple would hash every rank of the mesh per call, and planners ask once per writer (a reshard
        to 1,024 ranks asked about 10^5 times, each hashing 1,024 ranks)."""
        coords = self.__dict__.get("_coords")
        if coords is None:
            coords = _coordinates(self.shape, self.ranks)
            object.__setattr__(self, "_coords", coords)
        return coords.get(rank)

    def to_json(self) -> dict:
        ranks: object = list(self.ranks)
        n = len(self.ranks)
        step = self.ranks[1] - self.ranks[0] if n > 1 else 1
        if step > 0 and all(self.ranks[i] == self.ranks[0] + i * step for i in range(n)):
            ranks = {"start": self.ranks[0], "step": step}
        return {"dims": list(self.dims), "shape": list(self.shape), "ranks": ranks}

    @staticmethod
    def from_json(value: object, max_ranks: int = MAX_WORLD) -> Mesh:
        """Parse a mesh; ``max_ranks`` (the world size) bounds its size before any rank list is built."""
        try:
            doc = as_dict(value, "mesh")
            dims = tuple(as_str(d, "mesh dims") for d in as_list(doc.get("dims"), "mesh dims"))
            shape = as_ints(doc.get("shape"), "mesh shape", minimum=1, maximum=max_ranks, max_len=64)
            size = prod(shape)
            if size > max_ranks:
                raise LayoutError(f"mesh of shape {list(shape)} has {size} ranks, more than the world of {max_ranks}")
            ranks_v = doc.get("ranks")
            if isinstance(ranks_v, dict):
                start = as_int(ranks_v.get("start"), "mesh ranks start", minimum=0, maximum=max_ranks)
                step = as_int(ranks_v.get("step"), "mesh ranks step", minimum=1, maximum=max_ranks)
                ranks = tuple(start + i * step for i in range(size))
            else:
                ranks = as_ints(ranks_v, "mesh ranks", minimum=0, maximum=max_ranks, max_len=size)
        except ManifestError as exc:
            raise LayoutError(f"malformed mesh: {exc}") from None
        return Mesh(dims, shape, ranks)


@lru_cache(maxsize=64)
def _coordinates(shape: tuple[int, ...], ranks: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
    return {r: coord for r, coord in zip(ranks, itertools.product(*(range(n) for n in shape)))}


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every coordinate along this mesh dimension holds the same data."""


@dataclass(frozen=True, slots=True)
class Shard:
    """Split tensor ``axis`` over this mesh dimension.

    Default sizing is ``torch.chunk``'s (ceil-sized chunks, trailing chunks
    short or empty), as DTensor uses. ``split_factor > 1`` is DTensor's
    ``_StridedShard``. ``sizes`` gives explicit chunk sizes instead, dealt
    round-robin: coordinate ``c`` holds chunks ``c, c + k, c + 2k, ...`` of a
    mesh dimension of size ``k`` (uneven pipeline stages; virtual pipeline
    chunks when there are ``k * vpp`` sizes).
    """

    axis: int
    split_factor: int = 1
    sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.axis < 0:
            raise LayoutError(f"shard axis {self.axis} must be non-negative")
        if self.split_factor < 1:
            raise LayoutError(f"split factor {self.split_factor} must be >= 1")
        if self.sizes is not None and self.split_factor != 1:
            raise LayoutError("explicit shard sizes cannot be combined with a split factor")


@dataclass(frozen=True, slots=True)
class On:
    """Only mesh coordinate ``index`` along this dimension holds the tensor."""

    index: int


Placement = Replicate | Shard | On


def placement_to_json(p: Placement) -> list:
    if isinstance(p, Replicate):
        return ["r"]
    if isinstance(p, On):
        return ["on", p.index]
    out: list = ["s", p.axis]
    if p.split_factor != 1 or p.sizes is not None:
        out.append(p.split_factor)
    if p.sizes is not None:
        out.append(list(p.sizes))
    return out


def placement_from_json(v: object) -> Placement:
    try:
        if v == ["r"]:
            return Replicate()
        if isinstance(v, list) and len(v) == 2 and v[0] == "on":
            return On(as_int(v[1], "placement", minimum=0))
        if isinstance(v, list) and 2 <= len(v) <= 4 and v[0] == "s":
            sizes = as_ints(v[3], "shard sizes", minimum=0) if len(v) == 4 else None
            return Shard(as_int(v[1], "shard axis", minimum=0, maximum=64),
                         as_int(v[2], "split factor", minimum=1) if len(v) >= 3 else 1, sizes)
    except ManifestError:
        pass
    text = repr(v)
    raise LayoutError(f"unknown placement {text if len(text) < 80 else text[:77] + '...'}")


@dataclass(frozen=True, slots=True)
class Fused:
    """Tensor ``axis`` is a concatenation of ``parts`` (sizes), each sharded on its own.

    Megatron's SwiGLU ``linear_fc1`` is ``[gate; up]``: a TP rank holds
    ``[gate_shard; up_shard]``, not one contiguous slice of the fused tensor.
    """

    axis: int
    parts: tuple[int, ...]


def _take(runs: list[Run], p: int, q: int) -> list[Run]:
    """Positions [p, q) of the concatenation of ``runs`` (positions count elements)."""
    out: list[Run] = []
    pos = 0
    for g, l, n in runs:
        lo, hi = max(p, pos), min(q, pos + n)
        if hi > lo:
            out.append((g + lo - pos, l + lo - pos, hi - lo))
        pos += n
        if pos >= q:
            break
    return out


def _chunk(n: int, k: int, c: int) -> tuple[int, int]:
    """torch.chunk's chunk ``c`` of ``n`` elements into ``k`` chunks, as [start, stop)."""
    size = -(-n // k)
    start = min(n, size * c)
    return start, min(n, start + size)


def _apply(p: Shard, k: int, c: int, runs: list[Run], where: str) -> list[Run]:
    n = sum(r[2] for r in runs)
    if p.sizes is not None:
        if len(p.sizes) % k or sum(p.sizes) != n:
            raise LayoutError(
                f"{where}: explicit shard sizes {list(p.sizes)} must be a multiple of {k} sizes summing to {n}"
            )
        out_sized: list[Run] = []
        start = 0
        for j, size in enumerate(p.sizes):
            if j % k == c:
                out_sized.extend(_take(runs, start, start + size))
            start += size
        return out_sized
    if p.split_factor == 1:
        return _take(runs, *_chunk(n, k, c))
    out: list[Run] = []
    for j in range(p.split_factor):
        a, b = _chunk(n, p.split_factor, j)
        part = _take(runs, a, b)
        m = b - a
        out.extend(_take(part, *_chunk(m, k, c)))
    return out


@dataclass(frozen=True)
class GridLayout:
    """How one global tensor of ``shape`` is laid out over ``mesh``.

    ``padded`` is the shape the sharding is computed on (>= ``shape``); the
    elements beyond ``shape`` are padding: they occupy local memory but are
    not model space, never stored and never loaded.
    """

    mesh: Mesh
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    padded: tuple[int, ...] | None = None
    fused: Fused | None = None

    def __post_init__(self) -> None:
        where = f"layout of a tensor of shape {list(self.shape)}"
        if len(self.placements) != len(self.mesh.shape):
            raise LayoutError(f"{where}: {len(self.placements)} placements for a {len(self.mesh.shape)}-d mesh")
        ndim = len(self.shape)
        for i, p in enumerate(self.placements):
            if isinstance(p, Shard) and p.axis >= ndim:
                raise LayoutError(f"{where}: mesh dim {self.mesh.dims[i]} shards axis {p.axis}")
            if isinstance(p, On) and not (0 <= p.index < self.mesh.shape[i]):
                raise LayoutError(f"{where}: On({p.index}) outside mesh dim {self.mesh.dims[i]} of size {self.mesh.shape[i]}")
        if self.padded is not None and (
            len(self.padded) != ndim or any(p < s for p, s in zip(self.padded, self.shape))
        ):
            raise LayoutError(f"{where}: padded shape {self.padded} must be >= shape per dimension")
        if self.fused is not None:
            if self.fused.axis >= ndim or sum(self.fused.parts) != self.full_shape[self.fused.axis]:
                raise LayoutError(f"{where}: fused parts {list(self.fused.parts)} must sum to axis {self.fused.axis}")

    @property
    def full_shape(self) -> tuple[int, ...]:
        return self.padded if self.padded is not None else self.shape

    @cached_property
    def shard_dims(self) -> tuple[int, ...]:
        """Mesh dimensions that split the tensor (a cell is a coordinate along these)."""
        return tuple(i for i, p in enumerate(self.placements) if isinstance(p, Shard))

    @cached_property
    def replica_dims(self) -> tuple[int, ...]:
        return tuple(i for i, p in enumerate(self.placements) if isinstance(p, Replicate))

    @cached_property
    def num_replicas(self) -> int:
        return prod(self.mesh.shape[i] for i in self.replica_dims)

    @cached_property
    def num_cells(self) -> int:
        return prod(self.mesh.shape[i] for i in self.shard_dims)

    @cached_property
    def _meshdims_by_axis(self) -> tuple[tuple[int, ...], ...]:
        return tuple(
            tuple(i for i in self.shard_dims if self.placements[i].axis == d)  # type: ignore[union-attr]
            for d in range(len(self.shape))
        )

    @cached_property
    def _on(self) -> tuple[tuple[int, int], ...]:
        return tuple((i, p.index) for i, p in enumerate(self.placements) if isinstance(p, On))

    def _dim_meshdims(self, d: int) -> tuple[int, ...]:
        return self._meshdims_by_axis[d]

    @cached_property
    def _runs_cache(self) -> dict[tuple[int, tuple[int, ...]], tuple[list[Run], int]]:
        return {}

    def dim_runs(self, d: int, coords: tuple[int, ...]) -> tuple[list[Run], int]:
        """Runs held along tensor dim ``d`` for ``coords`` (one per mesh dim sharding ``d``),
        clipped to model space, and the local size of that dimension (padding included)."""
        key = (d, coords)
        hit = self._runs_cache.get(key)
        if hit is None:
            hit = self._runs_cache[key] = _dim_runs(self, d, coords)
        return hit

    def local_pieces(self, coord: tuple[int, ...]) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], Box]]] | None:
        """The local shape and ``(local_offsets, global_box)`` pieces at mesh ``coord``; None if not held."""
        for i, index in self._on:
            if coord[i] != index:
                return None
        per_dim = []
        local_shape = []
        for d in range(len(self.shape)):
            runs, n = self.dim_runs(d, tuple(coord[i] for i in self._dim_meshdims(d)))
            per_dim.append(runs)
            local_shape.append(n)
        pieces = [
            (tuple(r[1] for r in combo), Box(tuple(r[0] for r in combo), tuple(r[2] for r in combo)))
            for combo in itertools.product(*per_dim)
        ]
        return tuple(local_shape), pieces

    def cell_of(self, coord: tuple[int, ...]) -> int:
        """Linear index of the cell (coordinate along the shard dims) of ``coord``."""
        lin = 0
        for i in self.shard_dims:
            lin = lin * self.mesh.shape[i] + coord[i]
        return lin

    def replica_of(self, coord: tuple[int, ...]) -> int:
        lin = 0
        for i in self.replica_dims:
            lin = lin * self.mesh.shape[i] + coord[i]
        return lin

    def writer_rank(self, cell_coords: dict[int, int], rotation: int) -> int:
        """The rank that stores a cell: replica ``(rotation + cell) mod replicas`` of it."""
        coord = [0] * len(self.placements)
        for i, c in cell_coords.items():
            coord[i] = c
        for i, p in enumerate(self.placements):
            if isinstance(p, On):
                coord[i] = p.index
        replica = (rotation + self.cell_of(tuple(coord))) % self.num_replicas
        for i in reversed(self.replica_dims):
            replica, coord[i] = divmod(replica, self.mesh.shape[i])
        return self.mesh.rank_at(tuple(coord))

    def is_writer(self, coord: tuple[int, ...], rotation: int) -> bool:
        if any(coord[i] != index for i, index in self._on):
            return False
        return (rotation + self.cell_of(coord)) % self.num_replicas == self.replica_of(coord)

    def overlapping(self, box: Box) -> list[tuple[Box, dict[int, int]]]:
        """Stored boxes that intersect ``box``, with the cell (mesh dim -> coordinate) holding each.

        Works dimension by dimension and descends the placements of each
        dimension computing only the coordinates whose chunk can overlap, so
        the cost follows the number of overlapping cells, not the mesh size.
        """
        per_dim: list[list[tuple[dict[int, int], Run]]] = []
        for d in range(len(self.shape)):
            lo, hi = box.offsets[d], box.offsets[d] + box.sizes[d]
            hits = _dim_hits(self, d, lo, hi)
            if not hits:
                return []
            per_dim.append(hits)
        out = []
        for combo in itertools.product(*per_dim):
            cell: dict[int, int] = {}
            for coords, _ in combo:
                cell.update(coords)
            out.append((Box(tuple(r[0] for _, r in combo), tuple(r[2] for _, r in combo)), cell))
        return out

    def all_boxes(self) -> list[tuple[Box, dict[int, int]]]:
        return self.overlapping(Box.full(self.shape))

    def to_json(self, mesh_id: str) -> dict:
        out: dict = {"kind": "grid", "mesh": mesh_id, "placements": [placement_to_json(p) for p in self.placements]}
        if self.padded is not None:
            out["padded"] = list(self.padded)
        if self.fused is not None:
            out["fused"] = {"axis": self.fused.axis, "parts": list(self.fused.parts)}
        return out

    @staticmethod
    def from_json(value: dict, mesh: Mesh, shape: tuple[int, ...]) -> GridLayout:
        try:
            placements = tuple(placement_from_json(p) for p in as_list(value.get("placements"), "placements"))
            padded = as_ints(value["padded"], "padded shape", minimum=0) if "padded" in value else None
            fused = None
            if "fused" in value:
                fdoc = as_dict(value["fused"], "fused")
                fused = Fused(as_int(fdoc.get("axis"), "fused axis", minimum=0, maximum=64),
                              as_ints(fdoc.get("parts"), "fused parts", minimum=0))
        except ManifestError as exc:
            raise LayoutError(f"malformed grid layout: {exc}") from None
        return GridLayout(mesh, placements, shape, padded, fused)


def _segments(layout: GridLayout, d: int) -> list[list[Run]]:
    """Tensor dim ``d`` before sharding: one segment, or one per fused part."""
    if layout.fused is not None and layout.fused.axis == d:
        segments: list[list[Run]] = []
        start = 0
        for size in layout.fused.parts:
            segments.append([(start, 0, size)])
            start += size
        return segments
    return [[(0, 0, layout.full_shape[d])]]


def _positions(runs: list[Run], lo: int, hi: int) -> list[tuple[int, int]]:
    """Position intervals, within the concatenation of ``runs``, of global indices in [lo, hi)."""
    out = []
    pos = 0
    for g, _, n in runs:
        a, b = max(lo, g), min(hi, g + n)
        if b > a:
            out.append((pos + a - g, pos + b - g))
        pos += n
    return out


def _candidates(p: Shard, k: int, runs: list[Run], lo: int, hi: int) -> list[int]:
    """Coordinates along a mesh dim of size ``k`` whose chunk of ``runs`` may meet [lo, hi)."""
    if p.sizes is not None:
        return list(range(k))
    n = sum(r[2] for r in runs)
    found: set[int] = set()
    for a, b in _positions(runs, lo, hi):
        if p.split_factor == 1:
            size = -(-n // k)
            found.update(range(a // size, min(k, -(-b // size))))
            continue
        part = -(-n // p.split_factor)
        for j in range(a // part, min(p.split_factor, -(-b // part))):
            start, stop = j * part, min(n, (j + 1) * part)
            ra, rb = max(a, start) - start, min(b, stop) - start
            size = -(-(stop - start) // k)
            if rb > ra and size:
                found.update(range(ra // size, min(k, -(-rb // size))))
    return sorted(found)


def _dim_hits(layout: GridLayout, d: int, lo: int, hi: int) -> list[tuple[dict[int, int], Run]]:
    """(mesh coords, stored run) pairs along tensor dim ``d`` that meet [lo, hi) in model space."""
    mdims = layout._dim_meshdims(d)
    limit = layout.shape[d]
    found: dict[tuple[int, ...], list[Run]] = {}

    def descend(level: int, runs: list[Run], coords: tuple[int, ...]) -> None:
        if not _positions(runs, lo, hi):
            return
        if level == len(mdims):
            found.setdefault(coords, []).extend(runs)
            return
        i = mdims[level]
        p = layout.placements[i]
        k = layout.mesh.shape[i]
        for c in _candidates(p, k, runs, lo, hi):  # type: ignore[arg-type]
            descend(level + 1, _apply(p, k, c, runs, f"tensor axis {d}"), (*coords, c))  # type: ignore[arg-type]

    for seg in _segments(layout, d):
        descend(0, seg, ())
    hits = []
    for coords, runs in found.items():
        cell = dict(zip(mdims, coords))
        for g, _, n in runs:
            n = min(n, limit - g)
            if n > 0 and g < hi and lo < g + n:
                hits.append((cell, (g, 0, n)))
    return hits


def _dim_runs(layout: GridLayout, d: int, coords: tuple[int, ...]) -> tuple[list[Run], int]:
    where = f"tensor axis {d}"
    segments = _segments(layout, d)
    mdims = layout._dim_meshdims(d)
    runs: list[Run] = []
    for seg in segments:
        for i, c in zip(mdims, coords):
            seg = _apply(layout.placements[i], layout.mesh.shape[i], c, seg, where)  # type: ignore[arg-type]
        runs.extend(seg)
    # Re-number local positions in held order, then drop padding (model space ends at shape[d]).
    local = 0
    placed: list[Run] = []
    for g, _, n in runs:
        placed.append((g, local, n))
        local += n
    limit = layout.shape[d]
    clipped = [(g, l, min(n, limit - g)) for g, l, n in placed if g < limit and n > 0]
    return clipped, local
