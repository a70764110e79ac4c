"""Moving tensor bytes: piece extraction for writes, strided placement for reads.

Bytes are always raw little-endian element bytes (``tensor.view(uint8)``),
which is how every dtype torch has — bfloat16 and float8 included — is stored
without conversion.
"""

from __future__ import annotations

import sys

import torch

from ckptkit.layout.box import Region
from ckptkit.layout.pieces import LocalBox, LocalPlace

if sys.byteorder != "little":  # pragma: no cover - no big-endian torch builds in practice
    raise ImportError("ckptkit stores little-endian bytes and needs a little-endian host")


def as_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    if flat.numel() == 1 and flat.stride() != (1,):
        # torch calls a one-element view of any stride contiguous (and .contiguous() keeps the stride),
        # but view(uint8) wants stride 1: the same element, re-viewed
        flat = torch.as_strided(flat, (1,), (1,))
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def piece_tensor(local: torch.Tensor, region: Region, place: LocalPlace) -> torch.Tensor:
    """The elements of one piece, in row-major order, as a contiguous CPU tensor (a view when possible)."""
    if isinstance(place, LocalBox):
        index = tuple(slice(o, o + s) for o, s in zip(place.offsets, region.box.sizes))
        view = local[index] if index else local
    else:
        flat = local.reshape(-1) if local.is_contiguous() else local.contiguous().reshape(-1)
        view = flat[place.start:place.start + region.numel]
    if view.device.type != "cpu":
        view = view.cpu()
    # a conjugate or negative view (x.conj()) holds other values in memory than it shows: materialised
    # here (a copy only when the bit is set), as a copy into staging materialises it
    return view.resolve_conj().resolve_neg().contiguous()


def strided(base: torch.Tensor, start: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> torch.Tensor:
    """A strided window of a 1-D contiguous tensor starting at element ``start``."""
    return torch.as_strided(base, shape, strides, base.storage_offset() + start)


def typed_window(buf: torch.Tensor, byte_offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes ``[byte_offset, byte_offset + nbytes)`` of a uint8 buffer viewed as ``dtype``."""
    return buf[byte_offset:byte_offset + nbytes].view(dtype)
