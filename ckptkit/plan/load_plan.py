"""Load planning: box intersection and coalesced byte-range reads.

Pure functions. Phase one (:func:`match_sources`) intersects every target
piece with the stored pieces of the checkpoint and yields element-level copy
operations; it needs only the manifest, so the loader learns which ranks'
indexes it must read. Phase two (:func:`plan_reads`) turns copies into byte
ranges of stored objects, widened to whole checksum blocks and merged, so
each byte is read at most once and every byte read is verified.

All positions are element offsets into row-major streams: a stored piece's
stream is its region's elements in row-major order; a target's stream is its
local tensor's flattening (local tensors are contiguous row-major).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod

from ckptkit.errors import CoverageError, CorruptCheckpointError
from ckptkit.layout.coverage import named_axes
from ckptkit.layout.box import Box, Region, row_major_strides
from ckptkit.layout.index import IndexEntry
from ckptkit.layout.manifest import TensorMeta
from ckptkit.layout.pieces import LocalBox, LocalPlace

SourceKey = tuple[int, str, tuple]  # (writer rank, tensor, region key)


@dataclass(frozen=True)
class Target:
    """A piece of a local tensor the caller wants filled."""

    ref: int
    tensor: str
    region: Region
    local_shape: tuple[int, ...]
    local: LocalPlace


@dataclass(frozen=True)
class CopyOp:
    """Copy a strided block of a stored piece's stream into a local tensor's stream."""

    writer: int
    tensor: str
    source: Region
    src_start: int
    src_strides: tuple[int, ...]
    shape: tuple[int, ...]
    ref: int
    dst_start: int
    dst_strides: tuple[int, ...]

    @property
    def source_key(self) -> SourceKey:
        return (self.writer, self.tensor, self.source.key())

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def src_span(self) -> tuple[int, int]:
        """Element range [lo, hi) of the source stream this op touches."""
        hi = self.src_start + sum((n - 1) * st for n, st in zip(self.shape, self.src_strides)) + 1
        return self.src_start, hi if self.numel else self.src_start


def _compact(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    expected = 1
    for n, st in zip(reversed(sizes), reversed(strides)):
        if n == 1:
            continue
        if st != expected:
            return False
        expected *= n
    return True


def _local_stream(local: LocalPlace, local_shape: tuple[int, ...], region: Region, g: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """Local stream position of global element ``g`` of ``region`` and the strides around it."""
    if isinstance(local, LocalBox):
        lstrides = row_major_strides(local_shape)
        pos = sum((lo + gi - o) * st for lo, gi, o, st in zip(local.offsets, g, region.box.offsets, lstrides))
        return pos, lstrides
    pos = local.start + region.box.position(g) - region.stream_start
    return pos, row_major_strides(region.box.sizes)


def _make_op(writer: int, tensor: str, source: Region, target: Target, j: Box) -> CopyOp:
    src_start = source.box.position(j.offsets) - source.stream_start
    src_strides = row_major_strides(source.box.sizes)
    dst_start, dst_strides = _local_stream(target.local, target.local_shape, target.region, j.offsets)
    shape = j.sizes
    if _compact(shape, src_strides) and _compact(shape, dst_strides):
        n = j.numel
        return CopyOp(writer, tensor, source, src_start, (1,), (n,), target.ref, dst_start, (1,))
    return CopyOp(writer, tensor, source, src_start, src_strides, shape, target.ref, dst_start, dst_strides)


def match_sources(targets: list[Target], tensors: dict[str, TensorMeta], where: str) -> list[CopyOp]:
    """Copy ops that fill every target from the stored pieces; CoverageError if any element is missing."""
    ops: list[CopyOp] = []
    for t in targets:
        meta = tensors[t.tensor]
        covered = 0
        target_boxes = t.region.boxes()
        seen: set[tuple] = set()
        for tb in target_boxes:
            for source, writer in meta.stored_overlapping(tb):
                if source.box == t.region.box and (writer, source.key()) not in seen:
                    # Same enclosing box (ZeRO fragments at another DP size, same-layout
                    # loads): intersect as stream ranges, one op per stored piece.
                    seen.add((writer, source.key()))
                    lo = max(source.stream_start, t.region.stream_start)
                    hi = min(source.stream_start + source.numel, t.region.stream_start + t.region.numel)
                    if hi > lo:
                        ops.extend(_linear_ops(writer, t, source, lo, hi))
                        covered += hi - lo
                    continue
                if source.box == t.region.box:
                    continue
                for sb in source.boxes():
                    j = sb.intersect(tb)
                    if j is not None and not j.is_empty():
                        ops.append(_make_op(writer, t.tensor, source, t, j))
                        covered += j.numel
        if covered != t.region.numel:
            raise CoverageError(
                f"{where}: tensor {t.tensor!r}: the stored pieces cover {covered} of the {t.region.numel} "
                f"elements of {t.region.to_json()} this rank needs (shape {list(meta.shape)}){_span(meta, t)}; "
                "the checkpoint is incomplete or the target layout asks for elements it does not hold"
            )
    return ops


def _span(meta: TensorMeta, t: Target) -> str:
    """The experts / layers a target region spans, for messages (``, expert 5 of 8, layer 2 of 4``)."""
    box = t.region.box
    parts = []
    for axis, name in sorted(named_axes(meta.rule).items(), key=lambda x: x[1] != "expert"):
        if axis < len(box.offsets):
            lo, n = box.offsets[axis], box.sizes[axis]
            which = str(lo) if n == 1 else f"{lo}-{lo + n - 1}"
            parts.append(f"{name}{'s' if n > 1 else ''} {which} of {meta.shape[axis]}")
    return f", {', '.join(parts)}" if parts else ""


def _linear_ops(writer: int, t: Target, source: Region, lo: int, hi: int) -> list[CopyOp]:
    """Ops for stream range [lo, hi) of the shared box: one op when the target side is linear."""
    target_linear = not isinstance(t.local, LocalBox) or _compact(
        t.region.box.sizes, row_major_strides(t.local_shape)
    )
    if target_linear:
        if isinstance(t.local, LocalBox):
            dst0, _ = _local_stream(t.local, t.local_shape, t.region, t.region.box.offsets)
            dst = dst0 + lo - t.region.stream_start
        else:
            dst = t.local.start + lo - t.region.stream_start
        return [CopyOp(writer, t.tensor, source, lo - source.stream_start, (1,), (hi - lo,), t.ref, dst, (1,))]
    sub = Region(source.box, (lo, hi))
    return [_make_op(writer, t.tensor, source, t, j) for j in sub.boxes()]


@dataclass(frozen=True)
class BlockCheck:
    """Bytes [offset, offset + length) of an object must have CRC32C ``crc``."""

    offset: int
    length: int
    crc: int
    tensor: str


@dataclass(frozen=True)
class PlacedOp:
    op: CopyOp
    itemsize: int
    src_byte: int  # byte offset of the op's first source element within the request buffer


@dataclass(frozen=True)
class ReadRequest:
    writer: int
    object: str
    offset: int
    length: int
    checks: tuple[BlockCheck, ...]
    ops: tuple[PlacedOp, ...]
    # Every op fills one whole stored piece into contiguous destination memory: the
    # reader scatters the file bytes straight into the destinations (one vectored
    # read, no staging buffer), skipping the alignment gaps between pieces.
    direct: bool


MAX_REQUEST = 64 << 20  # bytes per request: bounds staging memory and keeps several reads in flight


def plan_reads(
    ops: list[CopyOp],
    entry_of: Callable[[CopyOp], IndexEntry],
    itemsize_of: Callable[[str], int],
    block_of: Callable[[int], int],
    coalesce_gap: int = 1 << 16,
    max_request: int = MAX_REQUEST,
) -> list[ReadRequest]:
    """Byte-range reads, widened to checksum blocks and merged, that serve ``ops``."""
    # Needed block ranges per stored piece.
    per_piece: dict[SourceKey, tuple[IndexEntry, int, list[tuple[int, int]], list[CopyOp]]] = {}
    for op in ops:
        entry = entry_of(op)
        isz = itemsize_of(op.tensor)
        if entry.nbytes != op.source.numel * isz:
            raise CorruptCheckpointError(
                f"index of rank {op.writer}: tensor {op.tensor!r} piece {op.source.to_json()} has "
                f"{entry.nbytes} bytes, expected {op.source.numel * isz}"
            )
        block = block_of(op.writer)
        lo, hi = op.src_span()
        blo = (lo * isz // block) * block
        bhi = min(entry.nbytes, -(-(hi * isz) // block) * block)
        slot = per_piece.setdefault(op.source_key, (entry, block, [], []))
        slot[2].append((blo, bhi))
        slot[3].append(op)
    segments: list[_Segment] = []
    for key, (entry, block, ranges, piece_ops) in per_piece.items():
        whole = len(piece_ops) == 1 and piece_ops[0].src_start == 0 and piece_ops[0].shape == (piece_ops[0].source.numel,)
        for lo, hi in _merge(sorted(ranges), 0):
            checks = tuple(
                BlockCheck(entry.offset + b * block, min(block, entry.nbytes - b * block), entry.crcs[b], entry.tensor)
                for b in range(lo // block, -(-hi // block))
            )
            direct = whole and lo == 0 and hi == entry.nbytes
            segments.append(_Segment(key[0], entry.object, entry.offset + lo, entry.offset + hi, checks, entry, piece_ops, direct))
    segments.sort(key=lambda s: (s.writer, s.object, s.lo))
    requests: list[ReadRequest] = []
    i = 0
    while i < len(segments):
        first = segments[i]
        lo, hi = first.lo, first.hi
        group = [first]
        j = i + 1
        while j < len(segments):
            nxt = segments[j]
            if (nxt.writer, nxt.object, nxt.direct) != (first.writer, first.object, first.direct):
                break
            if nxt.lo > hi + coalesce_gap or max(hi, nxt.hi) - lo > max_request:
                break
            hi = max(hi, nxt.hi)
            group.append(nxt)
            j += 1
        placed: dict[int, PlacedOp] = {}
        all_checks: list[BlockCheck] = []
        for seg in group:
            all_checks.extend(seg.checks)
            for op in seg.ops:
                isz = itemsize_of(op.tensor)
                byte = seg.entry.offset + op.src_span()[0] * isz
                if seg.lo <= byte < seg.hi:  # an op belongs to the segment holding its first byte
                    placed.setdefault(id(op), PlacedOp(op, isz, byte - lo))
        requests.append(ReadRequest(first.writer, first.object, lo, hi - lo, tuple(all_checks), tuple(placed.values()), first.direct))
        i = j
    return requests


@dataclass(frozen=True)
class _Segment:
    writer: int
    object: str
    lo: int
    hi: int
    checks: tuple[BlockCheck, ...]
    entry: IndexEntry
    ops: list[CopyOp]
    direct: bool


def _merge(ranges: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if out and lo <= out[-1][1] + gap:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out
