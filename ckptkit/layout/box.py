"""Boxes and regions in model space.

A *box* is a hyper-rectangle ``(offsets, sizes)`` in a global logical tensor.
A *region* is a box, or an element range ``[start, stop)`` of the row-major
flattening of a box (a ZeRO / distributed-optimizer flat fragment).
Resharding is intersection of regions, so everything here is pure integer
arithmetic, small enough to test exhaustively.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ckptkit.errors import LayoutError
from ckptkit.layout.strict_json import MAX_LAYOUT_INT


def row_major_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a contiguous row-major array of ``sizes``."""
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    return tuple(strides)


@dataclass(frozen=True, slots=True)
class Box:
    """A hyper-rectangle in a tensor: ``offsets[d] <= i_d < offsets[d] + sizes[d]``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise LayoutError(f"box offsets {self.offsets} and sizes {self.sizes} differ in rank")
        if any(o < 0 for o in self.offsets) or any(s < 0 for s in self.sizes):
            raise LayoutError(f"box offsets {self.offsets} / sizes {self.sizes} must be non-negative")

    @staticmethod
    def full(shape: tuple[int, ...]) -> Box:
        return Box(tuple(0 for _ in shape), tuple(shape))

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        return prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def is_empty(self) -> bool:
        return any(s == 0 for s in self.sizes)

    def within(self, shape: tuple[int, ...]) -> bool:
        """True if the box lies inside a tensor of ``shape``."""
        return len(shape) == self.ndim and all(e <= n for e, n in zip(self.ends, shape))

    def contains(self, other: Box) -> bool:
        return all(
            o <= oo and oo + os <= o + s
            for o, s, oo, os in zip(self.offsets, self.sizes, other.offsets, other.sizes)
        )

    def intersect(self, other: Box) -> Box | None:
        """The common box, or None when the boxes do not overlap (or one is empty)."""
        offs = []
        sizes = []
        for o1, s1, o2, s2 in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo = max(o1, o2)
            hi = min(o1 + s1, o2 + s2)
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        if self.ndim == 0:
            return self
        return Box(tuple(offs), tuple(sizes))

    def run_in(self, outer: Box) -> tuple[int, int] | None:
        """``[first, stop)``: the row-major positions in ``outer`` this box covers, when they are one
        consecutive run (the box is full in every axis after the last one it cuts, and one element
        wide in every axis before it); None when the box is not such a run, or is empty. ``self``
        must lie within ``outer``. Lets flat pieces (ZeRO runs) be matched by arithmetic instead of
        box decomposition: at dp 1,024 a reshard plan asks this a million times."""
        if self.is_empty():
            return None
        cut = -1
        for d in range(len(self.sizes) - 1, -1, -1):
            if self.sizes[d] != outer.sizes[d]:
                cut = d
                break
        if any(self.sizes[d] != 1 for d in range(cut)):
            return None
        first = outer.position(self.offsets)
        return first, first + self.numel

    def position(self, index: tuple[int, ...]) -> int:
        """Row-major position, within this box, of a global element index."""
        pos = 0
        for i, o, st in zip(index, self.offsets, row_major_strides(self.sizes)):
            pos += (i - o) * st
        return pos

    def to_json(self) -> list[list[int]]:
        return [list(self.offsets), list(self.sizes)]

    @staticmethod
    def from_json(value: object) -> Box:
        if (
            not isinstance(value, list)
            or len(value) != 2
            or not all(isinstance(v, list) for v in value)
            or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_LAYOUT_INT
                       for v in value for x in v)
            or len(value[0]) > 64
        ):
            text = repr(value)
            raise LayoutError(f"expected a box [[offsets...], [sizes...]] of integers in [0, 2**62], got "
                              f"{text if len(text) < 80 else text[:77] + '...'}")
        return Box(tuple(value[0]), tuple(value[1]))


@dataclass(frozen=True, slots=True)
class Region:
    """Where a stored piece lies in its global tensor.

    ``flat is None``: the whole box, stored row-major. Otherwise the elements
    ``[flat[0], flat[1])`` of the row-major flattening of ``box`` — exactly what
    ZeRO and Megatron's distributed optimizer hold per rank. Stored bytes are
    always those elements in row-major order.
    """

    box: Box
    flat: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.flat is not None:
            a, b = self.flat
            if not (0 <= a <= b <= self.box.numel):
                raise LayoutError(
                    f"flat range [{a}, {b}) is outside box {self.box.to_json()} of {self.box.numel} elements"
                )

    @property
    def numel(self) -> int:
        if self.flat is None:
            return self.box.numel
        return self.flat[1] - self.flat[0]

    @property
    def stream_start(self) -> int:
        """Row-major position in ``box`` of the region's first element."""
        return 0 if self.flat is None else self.flat[0]

    def boxes(self) -> list[Box]:
        """The region as disjoint boxes, each contiguous in the row-major stream.

        A full box is itself; a flat range of an N-D box splits into at most
        2N-1 boxes (a partial leading row, whole rows, a partial trailing row,
        recursively).
        """
        if self.flat is None:
            return [] if self.box.is_empty() else [self.box]
        a, b = self.flat
        if a == b:
            return []
        return _flat_range_boxes(self.box.offsets, self.box.sizes, a, b)

    def elements_in(self, box: Box) -> int:
        """How many of the region's elements lie in ``box`` (a box of the same tensor): its boxes
        intersected with it. (A reshard plan counts ZeRO's flat runs against a run of the tensor by
        range arithmetic instead, once per target box: ``reshard_plan._reads``.)"""
        n = 0
        for b in self.boxes():
            hit = b.intersect(box)
            if hit is not None:
                n += hit.numel
        return n

    def key(self) -> tuple:
        """A hashable identity: equal regions are the same stored piece."""
        return (self.box.offsets, self.box.sizes, self.flat)

    def to_json(self) -> dict:
        out: dict = {"box": self.box.to_json()}
        if self.flat is not None:
            out["flat"] = [self.flat[0], self.flat[1]]
        return out

    @staticmethod
    def from_json(value: object) -> Region:
        if not isinstance(value, dict) or "box" not in value:
            raise LayoutError(f"expected a region {{'box': ..., 'flat'?: ...}}, got {value!r}")
        flat = value.get("flat")
        if flat is not None:
            if (
                not isinstance(flat, list)
                or len(flat) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_LAYOUT_INT for x in flat)
            ):
                text = repr(flat)
                raise LayoutError(f"expected a flat range [start, stop], got {text if len(text) < 80 else text[:77] + '...'}")
            flat = (flat[0], flat[1])
        return Region(Box.from_json(value["box"]), flat)


def _flat_range_boxes(offsets: tuple[int, ...], sizes: tuple[int, ...], a: int, b: int) -> list[Box]:
    """Decompose elements [a, b) of the row-major box (offsets, sizes) into boxes."""
    if not sizes:
        return [Box((), ())]  # a 0-d tensor: the only range is [0, 1)
    if len(sizes) == 1:
        return [Box((offsets[0] + a,), (b - a,))]
    row = prod(sizes[1:])
    first_row, first_col = divmod(a, row)
    last_row, last_col = divmod(b, row)  # exclusive
    out: list[Box] = []
    if first_row == last_row:
        # inside one row: recurse into that row's sub-box
        for inner in _flat_range_boxes(offsets[1:], sizes[1:], first_col, last_col):
            out.append(Box((offsets[0] + first_row, *inner.offsets), (1, *inner.sizes)))
        return out
    if first_col:
        for inner in _flat_range_boxes(offsets[1:], sizes[1:], first_col, row):
            out.append(Box((offsets[0] + first_row, *inner.offsets), (1, *inner.sizes)))
        first_row += 1
    if last_row > first_row:
        out.append(Box((offsets[0] + first_row, *offsets[1:]), (last_row - first_row, *sizes[1:])))
    if last_col:
        for inner in _flat_range_boxes(offsets[1:], sizes[1:], 0, last_col):
            out.append(Box((offsets[0] + last_row, *inner.offsets), (1, *inner.sizes)))
    return out
