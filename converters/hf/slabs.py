"""An HF export under a memory budget: each HF tensor written in slabs of rows.

Without a budget the export holds a whole HF tensor (and its source slice, and one read ahead):
the embedding of a 128k-vocabulary 405B model is 4 GiB of it. With ``max_memory`` every output
tensor is cut into slabs of rows whose bytes (the source rows read, the output rows made, and
the cast between) stay under the budget, and written as they are made.

What makes this exact whatever the transform: every transform of :func:`.mapping.apply` (the
QKV split, ``[gate; up]``, the vocabulary trim, the rotary permutation) moves whole rows of the
source slice. So the transform is applied once to a column of row numbers (:func:`row_maps`):
output row ``j`` of output ``i`` is source row ``maps[i][j]``. A slab of output rows reads the
bounding range of the source rows it needs (one contiguous read; the QKV split's k and v rows
between two query groups are read and dropped) and picks its rows from it. Slabs of a rotary
output hold whole heads, so each head's permuted rows are read in one range. The bytes written
are the unbudgeted export's, byte for byte.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ckptkit.errors import CkptkitError
from ckptkit_converters.hf.mapping import HFConfig, Unit, apply, rope_heads


@dataclass(frozen=True)
class Slab:
    """Output rows ``[start, stop)`` of one output tensor, made from source rows ``[lo, hi)``."""

    start: int
    stop: int
    lo: int
    hi: int


def row_maps(unit: Unit, rows: int, ndim: int, cfg: HFConfig, permute: bool) -> list[np.ndarray]:
    """For each output of ``unit``, the source row of every output row (the transform applied to row numbers)."""
    idx = torch.arange(rows, dtype=torch.int64).reshape(rows, *([1] * (ndim - 1)))
    return [m.reshape(m.shape[0], -1)[:, 0].numpy() for m in apply(unit, idx, cfg, permute)]


def plan_slabs(sources: np.ndarray, align: int, row_read: int, row_made: int, budget: int, where: str) -> list[Slab]:
    """Slabs of whole ``align``-row blocks covering the output rows in order, each reading the source range
    it needs (``row_read`` bytes a row) and making its rows (``row_made`` bytes a row) within ``budget``.
    A slab starts at the size the budget allows for contiguous rows and halves until its range fits
    (the QKV split's and the rotary permutation's ranges are wider than their rows): a few numpy
    reductions a slab, not a loop over rows."""
    n = len(sources)
    out: list[Slab] = []
    full = max(align, budget // (row_read + row_made) // align * align)
    start = 0
    while start < n:
        size = min(full, n - start)
        while True:
            part = sources[start:start + size]
            lo, hi = int(part.min()), int(part.max()) + 1
            if (hi - lo) * row_read + size * row_made <= budget:
                break
            if size <= align:
                raise CkptkitError(f"{where}: max_memory {budget} bytes cannot hold {size} row(s) of it "
                                   f"({(hi - lo) * row_read + size * row_made} bytes read and made); raise max_memory")
            size = max(align, size // 2 // align * align)
        out.append(Slab(start, start + size, lo, hi))
        start += size
    return out


def _align(unit: Unit, out: int, rows: int, cfg: HFConfig, permute: bool) -> int:
    """Rows a slab of output ``out`` is made of: whole heads for a rotary output (its permutation stays
    inside a head), single rows otherwise."""
    rope = unit.rule.outs[out].rope
    return rows // rope_heads(cfg, rope, unit.key) if rope is not None and permute else 1


def check_budget(unit: Unit, src_shape: tuple[int, ...], src_dtype: torch.dtype, cast: torch.dtype | None,
                 cfg: HFConfig, permute: bool, budget: int) -> None:
    """Refuse (naming the tensor) a budget too small for the unit's smallest slab: checked for every unit
    before an export writes anything."""
    for i, sources, align, row_read, row_made in _outputs(unit, src_shape, src_dtype, cast, cfg, permute):
        plan_slabs(sources, align, row_read, row_made, budget, f"tensor {unit.key!r} ({unit.names[i]})")


def _outputs(unit: Unit, src_shape: tuple[int, ...], src_dtype: torch.dtype, cast: torch.dtype | None,
             cfg: HFConfig, permute: bool) -> Iterator[tuple[int, np.ndarray, int, int, int]]:
    """Per output: its index, row map, slab alignment, and bytes read and made per row."""
    rest = math.prod(src_shape[1:])
    made_dtype = cast or src_dtype
    row_read = rest * src_dtype.itemsize
    row_made = rest * (src_dtype.itemsize + made_dtype.itemsize)  # the picked rows, and their cast copy
    for i, sources in enumerate(row_maps(unit, src_shape[0], len(src_shape), cfg, permute)):
        yield i, sources, _align(unit, i, len(sources), cfg, permute), row_read, row_made


def unit_slabs(unit: Unit, read: Callable[[int, int], torch.Tensor], src_shape: tuple[int, ...],
               src_dtype: torch.dtype, cast: torch.dtype | None, cfg: HFConfig, permute: bool,
               budget: int) -> Iterator[tuple[int, torch.Tensor]]:
    """The unit's output tensors, in order, as ``(output, slab)``: rows under ``budget`` bytes
    (``read(lo, hi)`` returns source rows ``[lo, hi)`` of the unit's slice, of shape ``src_shape``)."""
    for i, sources, align, row_read, row_made in _outputs(unit, src_shape, src_dtype, cast, cfg, permute):
        for s in plan_slabs(sources, align, row_read, row_made, budget, f"tensor {unit.key!r} ({unit.names[i]})"):
            block = read(s.lo, s.hi)
            picked = block[torch.from_numpy(sources[s.start:s.stop] - s.lo)]
            del block
            yield i, (picked if cast is None or picked.dtype == cast else picked.to(cast))
