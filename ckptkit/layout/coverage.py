"""Coverage of a tensor by stored pieces: disjoint, and every element exactly once.

Pure. Checked when a save is merged (so an incomplete checkpoint never
commits) and again when a manifest's explicit layout is first used (so a
damaged or hostile manifest with duplicated, overlapping or missing pieces
can never make a read return memory that no stored byte filled).
"""

from __future__ import annotations

from ckptkit.errors import CoverageError
from ckptkit.layout.box import Box, Region


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
