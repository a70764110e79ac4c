"""ZeRO's flat partitions of a model at one DP size: which parameters each holds, and how it is cut.

Both directions need the same geometry: the import checks every native rank's flat fp32 partition
against it and stores that rank's fragments; the export fills each target rank's partition from the
model-space tensors. The cut itself (flattening order, alignment, padding, ZeRO-3 sub-groups) is
:mod:`ckptkit.layout.zero_partition`; this module groups it by DeepSpeed's param groups.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ckptkit.layout.zero_partition import (
    Fragment,
    Zero3SubGroup,
    Zero12Group,
    round_robin_order,
    zero3_sub_groups,
)
from ckptkit_converters.common.renamed import zero_stage_renamed

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size default


@dataclass(frozen=True)
class FlatLayout:
    """One flat partition (ZeRO-1/2 group or ZeRO-3 sub-group) at one DP size: its members and cut."""

    group: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    cut: Zero12Group | Zero3SubGroup

    def fragments(self, rank: int) -> list[Fragment]:
        return self.cut.fragments(rank)


@zero_stage_renamed
def flat_layouts(groups: Sequence[Sequence[tuple[str, tuple[int, ...]]]], zero_stage: int, dp: int, *,
                 round_robin: bool = False, align: int = 1,
                 sub_group_size: int = DEFAULT_SUB_GROUP_SIZE) -> list[FlatLayout]:
    """Every flat partition of a model whose param groups hold ``groups`` (name, shape), at ``dp``:
    one per group at ZeRO 1/2, one per sub-group at ZeRO 3 (``stage=``: the old keyword, one release)."""
    out = []
    for g, members in enumerate(groups):
        names = tuple(n for n, _ in members)
        shapes = tuple(tuple(s) for _, s in members)
        numels = tuple(math.prod(s) for s in shapes)
        if zero_stage < 3:
            order = tuple(round_robin_order(len(numels), dp)) if round_robin else None
            out.append(FlatLayout(g, names, shapes, Zero12Group(numels, dp, order, align)))
        else:
            for sub in zero3_sub_groups(numels, dp, sub_group_size):
                out.append(FlatLayout(g, tuple(names[i] for i in sub), tuple(shapes[i] for i in sub),
                                      Zero3SubGroup(tuple(numels[i] for i in sub), dp)))
    return out
