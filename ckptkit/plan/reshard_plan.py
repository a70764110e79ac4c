"""Planning an offline reshard: which target rank stores what, reading which source pieces.

``ckptkit reshard SRC DST --to tp4pp2`` rewrites a checkpoint so that it is
laid out as a job at the target layout would have saved it. Everything that
decides *what* is written is here, as pure arithmetic over the manifest
(no torch, no storage), so it is property-tested and the ``--dry-run`` plan
is exactly what the engine (:mod:`ckptkit.offline.resharding`) then executes:

* every tensor with a partition rule is evaluated at the target
  :class:`ParallelConfig` into a :class:`GridLayout`; each of its cells is
  stored once, by one replica (a rotation per tensor, chosen greedily, spreads
  the writes of replicated regions over the DP replicas), and the writer
  stores the cell as the pieces of its *own local tensor*, in local order —
  so a target rank later loads its data as contiguous bytes of its own object;
* a tensor without a rule is copied whole onto the least loaded rank (and
  listed: the planner does not know how it would be split);
* the memory budget fixes how many target ranks are written at once and how
  far reads run ahead; a region that does not fit even alone is split into
  consecutive sub-boxes of its row-major stream (they stay adjacent in the
  writer's object, so the bytes are still contiguous), and that tensor is then
  recorded with explicit pieces instead of a grid (its rule is kept).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

from ckptkit.errors import LayoutError, OptionsError, ReshardError
from ckptkit.layout.box import Box, Region
from ckptkit.layout.config import ParallelConfig
from ckptkit.layout.grid import GridLayout
from ckptkit.layout.manifest import DTYPES, ExplicitLayout, TensorMeta
from ckptkit.layout.rules import PartitionRule
from ckptkit.plan.load_plan import MAX_REQUEST

_MAX_ROTATIONS = 64  # rotations tried per tensor when balancing writers (replicas beyond this are rare)
_MAX_SPLIT_PIECES = 1 << 20


@dataclass(frozen=True)
class ReshardPlanOptions:
    """What the planner may do.

    ``max_memory``: bytes of tensor data (pieces being written, read-ahead,
    read scratch) the engine may hold at once, not counting the interpreter.
    ``threads``: most target ranks written concurrently; ``read_ahead``: most
    pieces read ahead per rank; ``io_threads``: reads in flight per piece.
    ``strict``: refuse tensors without a partition rule instead of copying them.
    ``num_layers``: the model's layer count, for per-layer rules (``layer=i``)
    when no stacked tensor (``layer_axis``) tells it. ``source_block``: the
    source's checksum block (reads are widened to whole blocks), for the estimate.
    """

    max_memory: int = 1 << 30
    threads: int = 2
    read_ahead: int = 1
    io_threads: int = 2
    strict: bool = False
    num_layers: int | None = None
    source_block: int = 4 << 20

    def __post_init__(self) -> None:
        if self.max_memory < 1:
            raise OptionsError(f"max_memory {self.max_memory} must be a positive number of bytes")
        if self.threads < 1 or self.io_threads < 1 or self.read_ahead < 0 or self.source_block < 0:
            raise OptionsError("threads and io_threads must be >= 1, read_ahead and source_block >= 0")


@dataclass(frozen=True)
class SourceRead:
    """A stored source piece a target piece reads from, and how many of its bytes it needs."""

    writer: int
    region: Region
    nbytes: int


@dataclass(frozen=True)
class TargetPiece:
    """One region a target rank stores (in this order in its data object), and its sources."""

    tensor: str
    rank: int
    box: Box
    nbytes: int
    reads: tuple[SourceRead, ...]

    @property
    def source_bytes(self) -> int:
        """Bytes of the source pieces this piece touches (what a read can span at most)."""
        return sum(r.region.numel for r in self.reads)


@dataclass(frozen=True)
class TensorPlan:
    """One logical tensor at the target layout.

    ``layout`` is the grid evaluated from the rule (None without a rule);
    ``split``: some region was cut to fit the budget, so the output records
    explicit pieces (with the rule) rather than the grid.
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    rule: PartitionRule | None
    layout: GridLayout | None
    rotation: int
    split: bool
    pieces: tuple[TargetPiece, ...]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * DTYPES[self.dtype]

    def meta(self) -> TensorMeta:
        """The output manifest's entry: the target grid with its rule, or explicit pieces."""
        if self.layout is not None and not self.split:
            return TensorMeta(self.key, self.dtype, self.shape, self.layout, self.rotation, self.rule)
        pieces = tuple((Region(p.box), p.rank) for p in self.pieces)
        return TensorMeta(self.key, self.dtype, self.shape, ExplicitLayout(pieces), 0, self.rule)


@dataclass(frozen=True)
class RankLoad:
    """What one target rank writes, and the source bytes its pieces need."""

    rank: int
    pieces: int
    bytes_written: int
    bytes_read: int


@dataclass(frozen=True)
class ReshardPlan:
    """The whole reshard: per tensor, per target rank, and the memory it will take."""

    target: ParallelConfig
    tensors: tuple[TensorPlan, ...]
    ranks: tuple[RankLoad, ...]
    threads: int
    read_ahead: int
    io_threads: int
    piece_limit: int
    peak_memory: int
    max_memory: int
    read_window: int = 0  # the largest scratch buffer one read of a piece needs (see _Window)

    @property
    def world_size(self) -> int:
        return self.target.world_size

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def unruled(self) -> tuple[str, ...]:
        return tuple(t.key for t in self.tensors if t.rule is None)

    @property
    def split(self) -> tuple[str, ...]:
        return tuple(t.key for t in self.tensors if t.split)

    def pieces_by_rank(self) -> dict[int, list[TargetPiece]]:
        """Each target rank's pieces in write order (tensor by tensor, local order within one)."""
        out: dict[int, list[TargetPiece]] = {}
        for t in self.tensors:
            for p in t.pieces:
                out.setdefault(p.rank, []).append(p)
        return out

    def experts_by_rank(self) -> dict[int, tuple[int, ...]]:
        """The routed experts each target rank holds (empty for a dense model). One expert tensor per
        placement tells it (stacked layers: one for all; per-layer keys: one per layer, whose stages differ):
        every expert tensor of a rule-laid-out model splits its experts over EP the same way."""
        out: dict[int, set[int]] = {}
        placements: set[int | None] = set()
        for t in self.tensors:
            rule = t.rule
            if rule is None or rule.expert_axis is None or t.layout is None or rule.layer in placements:
                continue
            placements.add(rule.layer)
            axis = rule.expert_axis
            for rank in range(self.world_size):
                coord = t.layout.mesh.coordinate(rank)
                held = t.layout.local_pieces(coord) if coord is not None else None
                mine = out.setdefault(rank, set())
                for _, box in (held[1] if held else []):
                    mine.update(range(box.offsets[axis], box.offsets[axis] + box.sizes[axis]))
        return {r: tuple(sorted(e)) for r, e in out.items()}

    def to_json(self) -> dict[str, Any]:
        experts = self.experts_by_rank()
        return {
            "target": str(self.target),
            "world_size": self.world_size,
            "expert_parallel": ({"ep": self.target.ep, "etp": self.target.expert_tp, "edp": self.target.expert_dp,
                                 "experts_by_rank": {str(r): list(e) for r, e in experts.items()}}
                                if experts else None),
            "bytes": self.nbytes,
            "threads": self.threads,
            "read_ahead": self.read_ahead,
            "io_threads": self.io_threads,
            "piece_limit": self.piece_limit,
            "peak_memory": self.peak_memory,
            "max_memory": self.max_memory,
            "read_window": self.read_window,
            "unruled": list(self.unruled),
            "split": list(self.split),
            "ranks": [{"rank": r.rank, "pieces": r.pieces, "bytes_written": r.bytes_written,
                       "bytes_read": r.bytes_read} for r in self.ranks],
            "tensors": [{"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes,
                         "rule": t.rule.to_json() if t.rule is not None else None,
                         "layout": "explicit" if t.layout is None or t.split else "grid",
                         "pieces": len(t.pieces), "writers": sorted({p.rank for p in t.pieces})}
                        for t in self.tensors],
        }


# A target rank's whole region of a tensor, with the source pieces it reads: ``(rank, box, reads)``.
_Placed = tuple[int, Box, tuple[SourceRead, ...]]


def plan_reshard(
    tensors: Mapping[str, TensorMeta],
    target: ParallelConfig,
    options: ReshardPlanOptions = ReshardPlanOptions(),
) -> ReshardPlan:
    """Plan rewriting the checkpoint whose manifest holds ``tensors`` at layout ``target``.

    Raises :class:`ReshardError` naming the tensor when its rule cannot be
    evaluated at ``target`` (a fused part or an axis that does not split over
    tp, layers that do not split over pp x vpp without ``pp_layers``, ...).
    """
    layouts = _target_layouts(tensors, target, options)
    regions, rotations = _place_regions(tensors, layouts, target.world_size)
    placed = {key: [(rank, box, _reads(tensors[key], box)) for rank, box in regs] for key, regs in regions.items()}
    largest, item_max, window = _read_needs(tensors, placed, options.source_block)
    threads, read_ahead, limit, peak = _budget(largest, item_max, window, options)
    plans = tuple(_tensor_plan(key, tensors[key], placed[key], layouts.get(key), rotations.get(key, 0), limit)
                  for key in sorted(tensors))
    return ReshardPlan(target, plans, _rank_loads(plans, target.world_size), threads, read_ahead,
                       options.io_threads, limit, peak, options.max_memory, window(limit))


def _target_layouts(tensors: Mapping[str, TensorMeta], target: ParallelConfig,
                    options: ReshardPlanOptions) -> dict[str, GridLayout]:
    """Each ruled tensor's grid at ``target``; an unruled one is skipped (or refused when strict), and a
    rule that cannot be evaluated there is an error naming the tensor, before anything is planned."""
    num_layers = _num_layers(tensors, options.num_layers)
    layouts: dict[str, GridLayout] = {}
    for key in sorted(tensors):
        meta = tensors[key]
        if meta.rule is None:
            if options.strict:
                raise ReshardError(f"tensor {key!r} has no partition rule; strict mode refuses to guess its layout "
                                   "(save it with Sharded(..., rule=PartitionRule(...)) or drop strict)")
            continue
        try:
            layouts[key] = meta.rule.evaluate(meta.shape, target, num_layers)
        except LayoutError as exc:
            raise ReshardError(
                f"tensor {key!r} of shape {list(meta.shape)} (rule {meta.rule.to_json()}) cannot be laid out at "
                f"{target}: {exc}") from None
    return layouts


def _place_regions(tensors: Mapping[str, TensorMeta], layouts: Mapping[str, GridLayout],
                   world: int) -> tuple[dict[str, list[tuple[int, Box]]], dict[str, int]]:
    """Whole regions per tensor as ``(writer, box)``, and each ruled tensor's rotation.

    Ruled tensors go by their grid, largest first, so that the rotations balance the bulk of the
    bytes; then each unruled tensor goes whole to the rank least loaded so far.
    """
    load = [0] * world
    regions: dict[str, list[tuple[int, Box]]] = {}
    rotations: dict[str, int] = {}
    for key in sorted(layouts, key=lambda k: (-tensors[k].numel * DTYPES[tensors[k].dtype], k)):
        rotations[key], regions[key] = _place_grid(layouts[key], DTYPES[tensors[key].dtype], load)
    for key in sorted(k for k in tensors if k not in layouts):
        meta = tensors[key]
        if meta.numel == 0:
            regions[key] = []
            continue
        rank = min(range(world), key=lambda r: (load[r], r))
        load[rank] += meta.numel * DTYPES[meta.dtype]
        regions[key] = [(rank, Box.full(meta.shape))]
    return regions, rotations


def _read_needs(tensors: Mapping[str, TensorMeta], placed: Mapping[str, list[_Placed]],
                source_block: int) -> tuple[int, int, _Window]:
    """What the memory budget depends on: the largest region's bytes, the largest element, and the
    read window (how far a read's span in the source pieces exceeds the bytes it needs)."""
    largest, amp, src_max, item_max = 0, 1.0, 0, 1
    for key, items in placed.items():
        itemsize = DTYPES[tensors[key].dtype]
        item_max = max(item_max, itemsize)
        shape = tensors[key].shape
        for _, box, reads in items:
            largest = max(largest, box.numel * itemsize)
            run = _run_of(box, shape)
            for r in reads:
                src_max = max(src_max, r.region.numel * itemsize)
                if run is not None and _flat_of_whole(r.region, shape):
                    continue  # one run of the flattening against a flat run: the span is what is needed
                amp = max(amp, _span(r.region, box) * itemsize / r.nbytes)
    return largest, item_max, _Window(amp, src_max, source_block)


def _tensor_plan(key: str, meta: TensorMeta, placed: list[_Placed], layout: GridLayout | None, rotation: int,
                 limit: int) -> TensorPlan:
    """A tensor's target pieces in its writers' local order, a region over ``limit`` bytes cut into
    consecutive sub-boxes (each then reading only the source pieces it overlaps)."""
    itemsize = DTYPES[meta.dtype]
    pieces: list[TargetPiece] = []
    split = False
    for rank, box, reads in placed:
        parts = split_box(box, itemsize, limit, key) if box.numel * itemsize > limit else [box]
        split |= len(parts) > 1
        for part in parts:
            part_reads = reads if len(parts) == 1 else _reads(meta, part)
            pieces.append(TargetPiece(key, rank, part, part.numel * itemsize, part_reads))
    return TensorPlan(key, meta.dtype, meta.shape, meta.rule, layout, rotation, split, tuple(pieces))


def _rank_loads(plans: Sequence[TensorPlan], world: int) -> tuple[RankLoad, ...]:
    """Per target rank: pieces, bytes written and source bytes read (what the plan reports)."""
    written, read, counts = [0] * world, [0] * world, [0] * world
    for t in plans:
        for p in t.pieces:
            written[p.rank] += p.nbytes
            read[p.rank] += sum(r.nbytes for r in p.reads)
            counts[p.rank] += 1
    return tuple(RankLoad(r, counts[r], written[r], read[r]) for r in range(world))


def _num_layers(tensors: Mapping[str, TensorMeta], given: int | None) -> int | None:
    """The model's layer count: given, or the (agreeing) length of every stacked layer axis, or, when no
    tensor is stacked (Megatron's per-layer keys for an MoE layer pattern), one past the highest layer a
    per-layer rule names (every transformer layer holds tensors, so the layers are numbered densely)."""
    seen: dict[int, str] = {}
    highest = -1
    for key, meta in tensors.items():
        rule = meta.rule
        if rule is not None and rule.layer_axis is not None and rule.layer_axis < len(meta.shape):
            seen.setdefault(meta.shape[rule.layer_axis], key)
        if rule is not None and rule.layer is not None:
            highest = max(highest, rule.layer)
    if given is not None:
        return given
    if not seen and highest >= 0:
        return highest + 1
    if len(seen) > 1:
        shown = ", ".join(f"{n} ({k!r})" for n, k in sorted(seen.items()))
        raise ReshardError(f"stacked layer tensors disagree about the number of layers: {shown}")
    return next(iter(seen), None)


def _place_grid(layout: GridLayout, itemsize: int, load: list[int]) -> tuple[int, list[tuple[int, Box]]]:
    """The rotation that balances this tensor's writers against ``load`` (updated), and the stored
    regions as ``(writer, box)`` in each writer's local order."""
    cells = [(box, cell) for box, cell in layout.all_boxes() if box.numel]
    best: tuple[tuple[int, int], int, dict[int, int]] | None = None
    for rotation in range(min(layout.num_replicas, _MAX_ROTATIONS)):
        added: dict[int, int] = {}
        for box, cell in cells:
            w = layout.writer_rank(cell, rotation)
            added[w] = added.get(w, 0) + box.numel * itemsize
        score = (max((load[w] + n for w, n in added.items()), default=0), sum(load[w] for w in added))
        if best is None or score < best[0]:
            best = (score, rotation, added)
    assert best is not None
    _, rotation, added = best
    out: list[tuple[int, Box]] = []
    for writer in sorted(added):
        load[writer] += added[writer]
        coord = layout.mesh.coordinate(writer)
        assert coord is not None
        held = layout.local_pieces(coord)
        assert held is not None, "a writer always holds the cell it writes"
        _, pieces = held
        out.extend((writer, box) for _, box in sorted(pieces, key=lambda p: p[0]) if box.numel)
    return rotation, out


def _reads(meta: TensorMeta, box: Box) -> tuple[SourceRead, ...]:
    """The stored source pieces overlapping ``box``, with the bytes of each that ``box`` needs."""
    itemsize = DTYPES[meta.dtype]
    out = []
    run = _run_of(box, meta.shape)
    for region, writer in meta.stored_overlapping(box):
        if run is not None and _flat_of_whole(region, meta.shape):  # ZeRO runs: two ranges' overlap
            n = max(0, min(run[1], region.flat[1]) - max(run[0], region.flat[0]))  # type: ignore[index]
        else:
            n = region.elements_in(box)
        if n:
            out.append(SourceRead(writer, region, n * itemsize))
    if sum(r.nbytes for r in out) != box.numel * itemsize:
        raise ReshardError(f"tensor {meta.key!r}: the source's stored pieces do not cover box {box.to_json()} "
                           "exactly once; the source checkpoint is inconsistent")
    return tuple(out)


@dataclass(frozen=True)
class _Window:
    """How much a read of a ``p``-byte piece buffers: the span its elements cover in the source
    pieces (``amp`` times its bytes at most), widened to whole checksum blocks, never more than the
    largest source piece nor one request."""

    amp: float
    src_max: int
    block: int

    def __call__(self, piece: int) -> int:
        return min(MAX_REQUEST, self.src_max, int(self.amp * piece) + 2 * self.block)


def _estimate(threads: int, read_ahead: int, io_threads: int, piece: int, window: _Window) -> int:
    """Tensor bytes held at once: per rank being written, the piece being written plus those read
    ahead, and per read in flight a scratch buffer of its window."""
    return threads * ((1 + read_ahead) * piece + io_threads * window(piece))


def _budget(largest: int, item_max: int, window: _Window, o: ReshardPlanOptions) -> tuple[int, int, int, int]:
    """``(threads, read_ahead, piece_limit, peak_estimate)`` for the budget: the most concurrency
    that fits the largest region whole; failing that, one rank at a time with pieces cut to fit."""
    for threads, ahead in ((o.threads, o.read_ahead), (o.threads, 0), (1, o.read_ahead), (1, 0)):
        peak = _estimate(threads, ahead, o.io_threads, largest, window)
        if peak <= o.max_memory:
            return threads, ahead, max(largest, 1), peak
    lo, hi = 0, largest  # the estimate grows with the piece size: the largest piece that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _estimate(1, 0, o.io_threads, mid, window) <= o.max_memory:
            lo = mid
        else:
            hi = mid - 1
    if lo < item_max:
        need = _estimate(1, 0, o.io_threads, item_max, window)
        raise ReshardError(f"a memory budget of {o.max_memory} bytes is too small for this reshard: even one "
                           f"element at a time needs about {need} bytes of read buffers (the largest region is "
                           f"{largest} bytes); raise --max-memory")
    return 1, 0, lo, _estimate(1, 0, o.io_threads, lo, window)


def _run_of(box: Box, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """``box`` as one run ``[first, stop)`` of the tensor's flattening, if it is one."""
    return box.run_in(Box.full(shape)) if box.within(shape) else None


def _flat_of_whole(region: Region, shape: tuple[int, ...]) -> bool:
    """A flat range of the whole tensor's flattening (ZeRO's partitions)."""
    return region.flat is not None and region.box.sizes == shape and not any(region.box.offsets)


def _span(region: Region, box: Box) -> int:
    """Elements of ``region``'s row-major stream from the first to the last element ``box`` needs."""
    src = region.box
    hit = src.intersect(box)
    if hit is None:
        return 0
    first = src.position(hit.offsets)
    last = src.position(tuple(e - 1 for e in hit.ends))
    if region.flat is not None:
        first, last = max(first, region.flat[0]), min(last, region.flat[1] - 1)
    return max(0, last - first + 1)


def split_box(box: Box, itemsize: int, limit: int, key: str = "") -> list[Box]:
    """Consecutive sub-boxes of ``box``'s row-major stream, each of at most ``limit`` bytes.

    Cuts along the first axis into runs of whole slices; a single slice that is
    still too big is cut along the next axis, and so on. Every sub-box is a
    contiguous run of the box's row-major order, and they come in that order,
    so written one after another they are byte-for-byte the unsplit region.
    """
    if itemsize > limit:
        raise ReshardError(f"tensor {key!r}: one element ({itemsize} bytes) exceeds the piece limit of {limit} bytes")
    out: list[Box] = []

    def rec(offsets: tuple[int, ...], sizes: tuple[int, ...], d: int) -> None:
        if prod(sizes) * itemsize <= limit or d == len(sizes):
            out.append(Box(offsets, sizes))
            return
        slice_bytes = prod(sizes[d + 1:]) * itemsize
        if slice_bytes <= limit:
            step = max(1, limit // slice_bytes)
            for i in range(0, sizes[d], step):
                n = min(step, sizes[d] - i)
                out.append(Box(offsets[:d] + (offsets[d] + i,) + offsets[d + 1:], sizes[:d] + (n,) + sizes[d + 1:]))
            return
        for i in range(sizes[d]):
            if len(out) > _MAX_SPLIT_PIECES:
                raise ReshardError(f"tensor {key!r}: splitting region {box.to_json()} to {limit}-byte pieces makes "
                                   f"more than {_MAX_SPLIT_PIECES} pieces; raise --max-memory")
            rec(offsets[:d] + (offsets[d] + i,) + offsets[d + 1:], sizes[:d] + (1,) + sizes[d + 1:], d + 1)

    rec(box.offsets, box.sizes, 0)
    return out


def plan_summary_lines(plan: ReshardPlan, human: Any = str) -> list[str]:
    """A few lines describing the plan for people (the CLI's ``--dry-run``)."""
    lines = [
        f"target {plan.target} ({plan.world_size} ranks): {len(plan.tensors)} tensors, {human(plan.nbytes)}",
        f"memory: estimated peak {human(plan.peak_memory)} of a {human(plan.max_memory)} budget "
        f"({plan.threads} rank(s) at once, read-ahead {plan.read_ahead}, pieces up to {human(plan.piece_limit)})",
    ]
    experts = plan.experts_by_rank()
    if experts:
        t = plan.target
        counts = sorted({len(e) for e in experts.values()})
        lines.append(f"experts: {len(set().union(*experts.values()))} routed experts over ep={t.ep} "
                     f"({'/'.join(map(str, counts))} per rank), expert tensor parallel etp={t.expert_tp}, "
                     f"expert data parallel edp={t.expert_dp}; world size {plan.world_size}")
    if plan.split:
        lines.append(f"split to fit the budget (stored as explicit pieces): {', '.join(plan.split)}")
    if plan.unruled:
        lines.append(f"no partition rule, copied whole to one rank: {', '.join(plan.unruled)}")
    return lines


def check_plan(plan: ReshardPlan) -> None:
    """The output manifest entries must describe exactly the planned pieces and writers.

    The engine writes the planned pieces but records :meth:`TensorPlan.meta`
    (a grid rule for most tensors); a reader finds bytes through the latter,
    so a mismatch would make a committed checkpoint unreadable. Cheap next to
    the copy, so it runs before every reshard.
    """
    for t in plan.tensors:
        planned = sorted((Region(p.box).key(), p.rank) for p in t.pieces)
        recorded = sorted((r.key(), w) for r, w in t.meta().stored_pieces() if r.numel)
        if planned != recorded:
            raise AssertionError(f"tensor {t.key!r}: planned pieces differ from the recorded layout")
