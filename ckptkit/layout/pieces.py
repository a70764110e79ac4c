"""Pieces: how a rank's local tensor maps onto global tensors.

A local tensor is described by one or more :class:`Piece` s. Each piece takes
some elements of the local tensor (a sub-box of it, or a contiguous run of its
flattening) and says which elements of which global tensor they are (a
:class:`~ckptkit.layout.box.Region`). Elements correspond in row-major order on
both sides. This covers:

* a plain shard: one piece, local box = whole tensor, global box = its place;
* fused GLU ``[gate_shard; up_shard]``: two pieces, one per fused part;
* vocab padding: the piece covers only the real rows, padding rows have none;
* a ZeRO / distributed-optimizer flat buffer: one flat piece per parameter
  fragment, possibly for many different global tensors;
* replicas: ``replica=(index, count)`` says ``count`` ranks hold the very same
  piece; exactly one of them writes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ckptkit.errors import LayoutError
from ckptkit.layout.box import Box, Region


@dataclass(frozen=True, slots=True)
class LocalBox:
    """The piece occupies sub-box ``offsets`` (sizes = the global box's sizes) of the local tensor."""

    offsets: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LocalFlat:
    """The piece occupies elements ``[start, start + numel)`` of the local tensor's flattening."""

    start: int


LocalPlace = LocalBox | LocalFlat


@dataclass(frozen=True, slots=True)
class Piece:
    """Maps part of one local tensor to a region of one global tensor.

    ``tensor`` is the global tensor's key; ``shape`` its global (model-space)
    shape. ``replica`` is ``(index, count)`` when ``count`` ranks hold
    identical copies of this piece (0 <= index < count), else None.
    """

    tensor: str
    shape: tuple[int, ...]
    region: Region
    local: LocalPlace
    replica: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not self.region.box.within(self.shape):
            raise LayoutError(
                f"tensor {self.tensor!r}: box {self.region.box.to_json()} is outside global shape {list(self.shape)}"
            )
        if isinstance(self.local, LocalBox):
            if self.region.flat is not None:
                raise LayoutError(
                    f"tensor {self.tensor!r}: a flat region needs a LocalFlat place in the local tensor"
                )
            if len(self.local.offsets) != self.region.box.ndim:
                raise LayoutError(
                    f"tensor {self.tensor!r}: local offsets {self.local.offsets} do not match box rank {self.region.box.ndim}"
                )
        elif self.local.start < 0:
            raise LayoutError(f"tensor {self.tensor!r}: local flat start {self.local.start} is negative")
        if self.replica is not None:
            index, count = self.replica
            if not (0 <= index < count):
                raise LayoutError(f"tensor {self.tensor!r}: replica index {index} not in [0, {count})")

    @property
    def numel(self) -> int:
        return self.region.numel

    def check_fits(self, local_shape: tuple[int, ...]) -> None:
        """Raise LayoutError unless the piece lies inside a local tensor of ``local_shape``."""
        if isinstance(self.local, LocalBox):
            local_box = Box(self.local.offsets, self.region.box.sizes)
            if not local_box.within(local_shape):
                raise LayoutError(
                    f"tensor {self.tensor!r}: piece at local offsets {list(self.local.offsets)} with sizes "
                    f"{list(self.region.box.sizes)} does not fit the local tensor of shape {list(local_shape)}"
                )
        elif self.local.start + self.numel > prod(local_shape):
            raise LayoutError(
                f"tensor {self.tensor!r}: flat piece [{self.local.start}, {self.local.start + self.numel}) "
                f"does not fit the local tensor of {prod(local_shape)} elements"
            )


def box_piece(
    tensor: str,
    shape: tuple[int, ...],
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    *,
    local_offsets: tuple[int, ...] | None = None,
    replica: tuple[int, int] | None = None,
) -> Piece:
    """A box of a global tensor held at ``local_offsets`` (default: the local tensor's origin)."""
    local = LocalBox(tuple(local_offsets) if local_offsets is not None else tuple(0 for _ in sizes))
    return Piece(tensor, tuple(shape), Region(Box(tuple(offsets), tuple(sizes))), local, replica)


def flat_piece(
    tensor: str,
    shape: tuple[int, ...],
    box: Box,
    start: int,
    stop: int,
    *,
    local_start: int = 0,
    replica: tuple[int, int] | None = None,
) -> Piece:
    """Elements ``[start, stop)`` of the row-major flattening of ``box`` of a global tensor,
    held at elements ``[local_start, local_start + stop - start)`` of the local tensor."""
    return Piece(tensor, tuple(shape), Region(box, (start, stop)), LocalFlat(local_start), replica)
