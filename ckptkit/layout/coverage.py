"""Coverage of a tensor by stored pieces: disjoint, and every element exactly once.

Pure. Checked when a save is merged (so an incomplete checkpoint never
commits) and again when a manifest's explicit layout is first used (so a
damaged or hostile manifest with duplicated, overlapping or missing pieces
can never make a read return memory that no stored byte filled).
"""

from __future__ import annotations

from math import prod

from ckptkit.errors import CoverageError
from ckptkit.layout.box import Box, Region


def named_axes(rule: object) -> dict[int, str]:
    """Axes of a tensor worth naming in an error (``expert``, ``layer``), from its partition rule."""
    out: dict[int, str] = {}
    for attr, name in (("layer_axis", "layer"), ("expert_axis", "expert")):
        axis = getattr(rule, attr, None)
        if isinstance(axis, int):
            out[axis] = name
    return out


def incomplete_indices(shape: tuple[int, ...], pieces: tuple[tuple[Region, int], ...], axis: int) -> list[int]:
    """Indices along ``axis`` whose slice the pieces do not fill (pieces assumed disjoint)."""
    per_index = prod(s for i, s in enumerate(shape) if i != axis)
    have = [0] * shape[axis]
    for region, _ in pieces:
        for box in region.boxes():
            each = box.numel // box.sizes[axis] if box.sizes[axis] else 0
            for j in range(box.offsets[axis], box.offsets[axis] + box.sizes[axis]):
                if 0 <= j < len(have):
                    have[j] += each
    return [j for j, n in enumerate(have) if n < per_index]


def describe_indices(name: str, indices: list[int], total: int) -> str:
    shown = ", ".join(str(i) for i in indices[:8]) + (", ..." if len(indices) > 8 else "")
    return f"{name}{'s' if len(indices) > 1 else ''} {shown} (of {total})"


def region_text(region: Region, shape: tuple[int, ...], axes: dict[int, str]) -> str:
    """`` (experts 4, 5 (of 8))``: what a piece holds along the named axes, for errors about it."""
    parts = []
    for axis, name in sorted(axes.items()):
        if axis >= len(shape):
            continue
        held = sorted({j for box in region.boxes() for j in range(box.offsets[axis], box.offsets[axis] + box.sizes[axis])})
        if held:
            parts.append(describe_indices(name, held, shape[axis]))
    return f" ({' and '.join(parts)})" if parts else ""


def check_coverage(key: str, shape: tuple[int, ...], pieces: tuple[tuple[Region, int], ...], where: str,
                   axes: dict[int, str] | None = None) -> None:
    """Stored pieces of a tensor must be disjoint and cover every element exactly once.

    ``axes`` names axes (``{1: "expert"}``) so that a gap is reported as the
    experts / layers it leaves unwritten, not only as an element count.
    """
    numel = prod(shape)
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
        gaps = []
        for axis, name in sorted((axes or {}).items(), key=lambda x: x[1] != "expert"):
            if 0 <= axis < len(shape) and total < numel:
                missing = incomplete_indices(shape, pieces, axis)
                if missing:
                    gaps.append(describe_indices(name, missing, shape[axis]))
        detail = f": nothing stored for parts of {' and '.join(gaps)}" if gaps else ""
        raise CoverageError(
            f"{where}: tensor {key!r}: stored pieces hold {total} elements, the tensor of shape "
            f"{list(shape)} has {numel}; some elements are missing{detail}"
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
