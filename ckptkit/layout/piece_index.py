"""Which stored pieces of a tensor overlap a box: an index on the first axis.

Pure. A loading rank asks, for every piece it needs, which stored pieces
overlap it; so does the reshard planner for every target region. Scanning all
stored pieces per question costs pieces x questions, and both grow with the
job: a distributed-optimizer moment of a 70B model saved by 1,024 ranks is
stored as thousands of flat fragments, and a loading rank asks about hundreds
of regions. The index sorts the pieces by where they start on axis 0 (a flat
fragment by the rows it really covers, not its enclosing box) and answers
with two bisections plus an exact test of the few candidates.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from ckptkit.layout.box import Box, Region


class PieceIndex:
    """``(region, writer)`` pieces, searchable by overlap with a box; answers keep the pieces' order."""

    def __init__(self, pieces: Sequence[tuple[Region, int]]) -> None:
        items = []
        for order, (region, writer) in enumerate(pieces):
            boxes = region.boxes()
            if not boxes:
                continue
            if not boxes[0].offsets:  # a 0-d tensor: one element, no axis to sort on
                items.append((0, 1, order, region, writer, boxes))
                continue
            lo = min(b.offsets[0] for b in boxes)
            hi = max(b.offsets[0] + b.sizes[0] for b in boxes)
            items.append((lo, hi, order, region, writer, boxes))
        items.sort(key=lambda it: (it[0], it[2]))
        self._items = items
        self._starts = [it[0] for it in items]
        # a piece overlapping [q0, q1) on axis 0 starts in [q0 - longest + 1, q1)
        self._longest = max((it[1] - it[0] for it in items), default=0)

    def overlapping(self, box: Box) -> list[tuple[Region, int]]:
        """The pieces that share at least one element with ``box``, in the order they were given."""
        if box.offsets:
            q0, q1 = box.offsets[0], box.offsets[0] + box.sizes[0]
        else:
            q0, q1 = 0, 1
        i = bisect_left(self._starts, q0 - self._longest + 1)
        j = bisect_left(self._starts, q1)
        hits = [it for it in self._items[i:j] if it[1] > q0 and any(b.intersect(box) is not None for b in it[5])]
        hits.sort(key=lambda it: it[2])
        return [(it[3], it[4]) for it in hits]
