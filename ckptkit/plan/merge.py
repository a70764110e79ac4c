"""The coordinator's merge: per-rank reports -> one validated manifest.

Pure. Rank 0's work grows with ranks (one small report each) plus tensors
plus explicitly declared pieces, never with ranks x tensors for grid-laid
tensors: those are reported once, by the writer of their first cell, as a
rule every loader can evaluate.

Validation happens here, before the commit: ranks that disagree about a
mesh's replica plan, a tensor declared with two dtypes or shapes, and
explicit pieces that overlap or leave holes all fail the save instead of
producing a committed but unloadable checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptkit.errors import CoverageError, LayoutError
from ckptkit.layout.box import Box, Region
from ckptkit.layout.manifest import ExplicitLayout, IndexRef, Manifest, TensorMeta
from ckptkit.plan.save_plan import ExplicitReport


@dataclass(frozen=True)
class RankReport:
    """What one rank tells the coordinator after its data and index are durable."""

    rank: int
    index: IndexRef
    grid: tuple[TensorMeta, ...] = ()
    explicit: tuple[ExplicitReport, ...] = ()
    rotation_digest: dict[str, int] = field(default_factory=dict)
    per_rank_keys: tuple[str, ...] = ()


def merge_reports(
    reports: list[RankReport],
    *,
    world_size: int,
    values: dict[str, Any],
    meta: dict[str, Any],
    parallel: str | None,
    where: str,
) -> Manifest:
    digests: dict[str, tuple[int, int]] = {}
    for rep in reports:
        for tag, value in rep.rotation_digest.items():
            first = digests.setdefault(tag, (value, rep.rank))
            if first[0] != value:
                raise LayoutError(
                    f"{where}: ranks {first[1]} and {rep.rank} hold different sets of tensors on the same "
                    "device mesh; every rank of a mesh must hold the same DTensors (same keys, same placements)"
                )
    tensors: dict[str, TensorMeta] = {}
    for rep in reports:
        for t in rep.grid:
            if t.key in tensors:
                raise LayoutError(f"{where}: tensor {t.key!r} reported twice (ranks disagree about its layout)")
            tensors[t.key] = t
    explicit: dict[str, list[tuple[ExplicitReport, int]]] = {}
    for rep in reports:
        for e in rep.explicit:
            explicit.setdefault(e.tensor, []).append((e, rep.rank))
    for key, items in explicit.items():
        if key in tensors:
            raise LayoutError(f"{where}: tensor {key!r} is declared both as a grid tensor and by explicit pieces")
        first, first_rank = items[0]
        for e, rank in items:
            if e.dtype != first.dtype or e.shape != first.shape:
                raise LayoutError(
                    f"{where}: tensor {key!r} is {e.dtype}{list(e.shape)} on rank {rank} but "
                    f"{first.dtype}{list(first.shape)} on rank {first_rank}"
                )
            if e.rule != first.rule:
                raise LayoutError(
                    f"{where}: tensor {key!r} has partition rule {_rule_text(e.rule)} on rank {rank} but "
                    f"{_rule_text(first.rule)} on rank {first_rank}"
                )
        pieces = tuple(sorted(((e.region, rank) for e, rank in items), key=lambda p: (p[0].key(), p[1])))
        check_coverage(key, first.shape, pieces, where)
        tensors[key] = TensorMeta(key, first.dtype, first.shape, ExplicitLayout(pieces), rule=first.rule)
    per_rank: set[str] = set()
    for rep in reports:
        per_rank.update(rep.per_rank_keys)
    return Manifest(
        world_size=world_size,
        tensors=dict(sorted(tensors.items())),
        indexes={rep.rank: rep.index for rep in reports},
        values=values,
        per_rank_keys=tuple(sorted(per_rank)),
        parallel=parallel,
        meta=meta,
    )


def _rule_text(rule: Any) -> str:
    return "none" if rule is None else str(rule.to_json())


def check_coverage(key: str, shape: tuple[int, ...], pieces: tuple[tuple[Region, int], ...], where: str) -> None:
    """Stored pieces of a tensor must be disjoint and cover every element exactly once."""
    numel = 1
    for s in shape:
        numel *= s
    total = sum(r.numel for r, _ in pieces)
    by_box: dict[tuple, list[tuple[int, int, int]]] = {}
    for region, rank in pieces:
        a = region.stream_start
        by_box.setdefault((region.box.offsets, region.box.sizes), []).append((a, a + region.numel, rank))
    for (offs, sizes), ranges in by_box.items():
        ranges.sort()
        for (a0, b0, r0), (a1, b1, r1) in zip(ranges, ranges[1:]):
            if a1 < b0:
                raise CoverageError(
                    f"{where}: tensor {key!r}: pieces written by ranks {r0} and {r1} overlap in box "
                    f"{[list(offs), list(sizes)]} (elements [{a1}, {min(b0, b1)}))"
                )
    boxes = sorted(by_box, key=lambda b: b[0][:1])
    if len(boxes) > 1:
        _check_boxes_disjoint(key, boxes, by_box, pieces, where)
    if total != numel:
        raise CoverageError(
            f"{where}: tensor {key!r}: stored pieces hold {total} elements, the tensor of shape "
            f"{list(shape)} has {numel}; some elements are missing"
        )


def _check_boxes_disjoint(key: str, boxes: list[tuple], by_box: dict, pieces: tuple, where: str) -> None:
    """Sweep along axis 0: enclosing boxes that intersect must not share any stored element."""
    if not boxes[0][0]:
        raise CoverageError(f"{where}: tensor {key!r}: a 0-d tensor stored as more than one piece")
    active: list[tuple[int, Box]] = []
    for offs, sizes in boxes:
        box = Box(offs, sizes)
        active = [(end, b) for end, b in active if end > offs[0]]
        for _, other in active:
            if other.intersect(box) is None:
                continue
            mine = [Region(box, (a, b)) for a, b, _ in by_box[(offs, sizes)]]
            theirs = [Region(other, (a, b)) for a, b, _ in by_box[(other.offsets, other.sizes)]]
            for r1 in mine:
                for r2 in theirs:
                    for b1 in r1.boxes():
                        for b2 in r2.boxes():
                            if b1.intersect(b2) is not None:
                                raise CoverageError(
                                    f"{where}: tensor {key!r}: stored pieces {r1.to_json()} and {r2.to_json()} overlap"
                                )
        active.append((offs[0] + sizes[0], box))
