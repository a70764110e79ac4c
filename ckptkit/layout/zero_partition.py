"""DeepSpeed ZeRO's flat partitioning, as data: which elements of which parameter each DP rank holds.

Every fact about how DeepSpeed lays a parameter group out across data-parallel
ranks lives here, and nowhere else in ckptkit: the DeepSpeed adapter uses it to
describe a live engine's flat buffers as flat pieces, and the converters use
it to read and write DeepSpeed's native checkpoint files at any DP size.
Standard library only, so it is property-tested without torch or a process
group (tests/core/test_zero_partition.py) and cross-checked against live
engines (tests/test_deepspeed_layout.py).

The facts, read from DeepSpeed 0.19 (no code copied):

ZeRO stages 1 and 2 (``deepspeed/runtime/zero/stage_1_and_2.py``,
``DeepSpeedZeroOptimizer.__init__``):

* A group's trainable parameters are flattened in the order of the optimizer
  param group, or, with ``round_robin_gradients``, in the order of
  ``_round_robin_reorder``: parameter ``i`` goes to bucket ``i % dp``, buckets
  are concatenated in bucket order, each keeping the original order.
* With ``zero_optimization.parameter_alignment`` every parameter but the last
  is followed by padding up to a multiple of ``16 // gcd(16, element size)``
  elements (the ``param_padding`` / ``round_robin_bit16_offsets`` lists).
* The whole flat buffer is then padded at its end up to a multiple of
  ``nccl_start_alignment_factor * dp`` = ``2 * dp`` elements
  (``flatten_dense_tensors_aligned`` -> ``deepspeed/runtime/utils.py:align_dense_tensors``).
* ``get_data_parallel_partitions`` cuts it into ``dp`` contiguous slices, the
  first ``numel % dp`` one element longer; after the alignment above all
  slices are equal. Rank ``r`` owns slice ``r``; its fp32 master copy is
  ``single_partition_of_fp32_groups[g]`` and the Adam moments have its shape.
* ``groups_padding[g]`` on a rank = how many trailing elements of its slice
  lie past the (per-parameter padded) group end. The per-parameter fragment
  inside a slice is what ``param_slice_mappings`` records (name ->
  ``fragment_address(numel, start)`` with ``start`` relative to the slice;
  ``deepspeed/utils/tensor_fragment.py:get_hp_fragment_mapping``).

ZeRO stage 3 (``deepspeed/runtime/zero/partition_parameters.py``,
``Init._partition_param`` / ``_padding_size``; ``deepspeed/runtime/zero/stage3.py``):

* Each parameter is partitioned on its own: padded to a multiple of ``dp``,
  rank ``r`` holds elements ``[r * P, (r + 1) * P)`` with ``P = ceil(numel / dp)``
  (its ``ds_tensor``; the last ranks' tails past ``numel`` are padding).
* A param group is split into sub-groups by ``_create_fp16_sub_groups``: params
  are appended in order and a sub-group is closed once the sum of the
  members' partition sizes reaches ``sub_group_size`` (or at the last param).
* A sub-group's flat buffer (``fp16_partitioned_groups_flat``, and the fp32
  master ``fp32_partitioned_groups_flat`` with the moments of its shape) is the
  concatenation of its members' ``ds_tensor`` s, each ``P`` long.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ckptkit.errors import LayoutError

NCCL_START_ALIGNMENT_FACTOR = 2
"""Stage 1/2 pads a group to a multiple of this times dp (stage_1_and_2.py: ``nccl_start_alignment_factor``)."""


@dataclass(frozen=True, slots=True)
class Fragment:
    """Elements ``[start, stop)`` of the flattening of group member ``param`` (its index in the
    group's param order), held at ``[local_start, local_start + stop - start)`` of a rank's flat buffer."""

    param: int
    start: int
    stop: int
    local_start: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def _check(numels: Sequence[int], dp: int) -> None:
    if dp < 1:
        raise LayoutError(f"ZeRO partition: dp size {dp} must be >= 1")
    if not numels:
        raise LayoutError("ZeRO partition: a parameter group needs at least one parameter")
    bad = [n for n in numels if n < 0]
    if bad:
        raise LayoutError(f"ZeRO partition: parameter sizes must be >= 0, got {bad[:4]}")


def param_alignment(element_size: int, enabled: bool) -> int:
    """Per-parameter alignment in elements (stage 1/2 ``parameter_alignment``): 16 bytes, or 1 when off."""
    return 16 // math.gcd(16, element_size) if enabled else 1


def round_robin_order(n_params: int, dp: int) -> list[int]:
    """The flattening order of stage 1/2 with ``round_robin_gradients``: original indices, in flat order."""
    return [i for bucket in range(min(dp, n_params)) for i in range(bucket, n_params, dp)]


@dataclass(frozen=True)
class Zero12Group:
    """One ZeRO-1/2 parameter group at one DP size.

    ``numels`` are the group's parameter sizes in the optimizer param group's
    order; ``order`` the flattening order (indices into ``numels``; default:
    the same order); ``align`` the per-parameter alignment (1 = off).
    """

    numels: tuple[int, ...]
    dp: int
    order: tuple[int, ...] | None = None
    align: int = 1

    def __post_init__(self) -> None:
        _check(self.numels, self.dp)
        if self.order is not None and sorted(self.order) != list(range(len(self.numels))):
            raise LayoutError(f"ZeRO-1/2 group: flattening order {list(self.order)} is not a permutation "
                              f"of {len(self.numels)} parameters")
        if self.align < 1:
            raise LayoutError(f"ZeRO-1/2 group: parameter alignment {self.align} must be >= 1")

    @property
    def flat_order(self) -> tuple[int, ...]:
        return self.order if self.order is not None else tuple(range(len(self.numels)))

    @property
    def offsets(self) -> tuple[int, ...]:
        """Each parameter's start in the flat buffer, indexed like ``numels``."""
        out = [0] * len(self.numels)
        at = 0
        order = self.flat_order
        for k, i in enumerate(order):
            out[i] = at
            at += self.numels[i]
            if k != len(order) - 1:
                at += (-at) % self.align
        return tuple(out)

    @property
    def used_numel(self) -> int:
        """Flat elements up to the end of the last parameter (per-parameter padding included)."""
        last = self.flat_order[-1]
        return self.offsets[last] + self.numels[last]

    @property
    def flat_numel(self) -> int:
        """The flat buffer's length: ``used_numel`` rounded up to ``2 * dp``."""
        unit = NCCL_START_ALIGNMENT_FACTOR * self.dp
        return -(-self.used_numel // unit) * unit

    @property
    def partition_numel(self) -> int:
        """Every rank's slice length (equal after the alignment)."""
        return self.flat_numel // self.dp

    def padding(self, rank: int) -> int:
        """Trailing elements of ``rank``'s slice past the used part (DeepSpeed's ``groups_padding``)."""
        lo = rank * self.partition_numel
        return self.partition_numel - max(0, min(self.partition_numel, self.used_numel - lo))

    def fragments(self, rank: int) -> list[Fragment]:
        """``rank``'s fragments, in flat order; ``local_start`` is relative to its slice."""
        if not 0 <= rank < self.dp:
            raise LayoutError(f"ZeRO-1/2 group: rank {rank} is outside dp size {self.dp}")
        lo = rank * self.partition_numel
        hi = lo + self.partition_numel
        offsets = self.offsets
        out = []
        for i in self.flat_order:
            a, b = max(lo, offsets[i]), min(hi, offsets[i] + self.numels[i])
            if a < b:
                out.append(Fragment(i, a - offsets[i], b - offsets[i], a - lo))
        return out


def zero3_partition_numel(numel: int, dp: int) -> int:
    """A ZeRO-3 parameter's per-rank ``ds_tensor`` length: ``ceil(numel / dp)``."""
    return -(-numel // dp)


def zero3_sub_groups(numels: Sequence[int], dp: int, sub_group_size: int) -> list[list[int]]:
    """Split a ZeRO-3 param group (indices into ``numels``) into DeepSpeed's sub-groups at ``dp``."""
    _check(numels, dp)
    sizes = [zero3_partition_numel(n, dp) for n in numels]
    if sub_group_size >= sum(sizes):
        return [list(range(len(numels)))]
    groups: list[list[int]] = []
    current: list[int] = []
    acc = 0
    for i, size in enumerate(sizes):
        current.append(i)
        acc += size
        if acc >= sub_group_size or i == len(numels) - 1:
            groups.append(current)
            current, acc = [], 0
    return groups


@dataclass(frozen=True)
class Zero3SubGroup:
    """One ZeRO-3 sub-group (its members' sizes, in order) at one DP size."""

    numels: tuple[int, ...]
    dp: int

    def __post_init__(self) -> None:
        _check(self.numels, self.dp)

    @property
    def partition_numels(self) -> tuple[int, ...]:
        return tuple(zero3_partition_numel(n, self.dp) for n in self.numels)

    @property
    def partition_numel(self) -> int:
        """The sub-group's flat buffer length on every rank."""
        return sum(self.partition_numels)

    def param_offsets(self) -> tuple[int, ...]:
        """Each member's ``ds_tensor`` start in the sub-group's flat buffer."""
        out, at = [], 0
        for p in self.partition_numels:
            out.append(at)
            at += p
        return tuple(out)

    def fragments(self, rank: int) -> list[Fragment]:
        """``rank``'s fragments; ``local_start`` is relative to the sub-group's flat buffer."""
        if not 0 <= rank < self.dp:
            raise LayoutError(f"ZeRO-3 sub-group: rank {rank} is outside dp size {self.dp}")
        out = []
        for i, (n, p, at) in enumerate(zip(self.numels, self.partition_numels, self.param_offsets())):
            a, b = min(n, rank * p), min(n, (rank + 1) * p)
            if a < b:
                out.append(Fragment(i, a, b, at))
        return out

    def param_fragment(self, i: int, rank: int) -> Fragment | None:
        """Member ``i``'s fragment on ``rank`` with ``local_start`` relative to its own ``ds_tensor``."""
        n, p = self.numels[i], self.partition_numels[i]
        a, b = min(n, rank * p), min(n, (rank + 1) * p)
        return Fragment(i, a, b, 0) if a < b else None
