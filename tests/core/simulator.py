"""A pure-Python executor for save and load plans, for property tests of the layout core.

It plays every rank of a world in one process: local tensors are lists of
ints, data objects are bytearrays of little-endian int32, checksums are
zlib.crc32 over tiny blocks (so block logic is exercised). Save and load go
through the real planners, the real coordinator merge and a JSON round trip of
the manifest and every index: only the byte movement is simulated.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from math import prod

from ckptkit.layout.box import Box, Region, row_major_strides
from ckptkit.layout.grid import GridLayout
from ckptkit.layout.index import Index, IndexEntry
from ckptkit.layout.manifest import IndexRef, Manifest, sha256_hex
from ckptkit.layout.pieces import LocalBox, Piece
from ckptkit.plan.load_plan import Target, match_sources, plan_reads
from ckptkit.plan.merge import RankReport, merge_reports
from ckptkit.plan.save_plan import ExplicitDecl, GridDecl, index_object_key, plan_save

ITEMSIZE = 4
BLOCK = 12  # bytes: three elements, so pieces span several checksum blocks
PAD = -7


@dataclass
class LocalTensor:
    """One local tensor of one rank and the pieces that describe it."""

    shape: tuple[int, ...]
    grid: tuple[str, GridLayout, tuple[int, ...]] | None = None  # (key, layout, coord)
    pieces: tuple[Piece, ...] = ()
    data: list[int] = field(default_factory=list)


def global_value(key: str, shape: tuple[int, ...], index: tuple[int, ...]) -> int:
    """Element values encode tensor and position, so misplaced bytes are caught."""
    lin = 0
    for i, n in zip(index, shape):
        lin = lin * n + i
    return (zlib.crc32(key.encode()) % 1000) * 100000 + lin


def pieces_of(t: LocalTensor) -> list[tuple[str, tuple[int, ...], Region, object]]:
    """(tensor, global shape, region, local place) for every piece of a local tensor."""
    if t.grid is not None:
        key, layout, coord = t.grid
        held = layout.local_pieces(coord)
        if held is None:
            return []
        return [(key, layout.shape, Region(b), LocalBox(lo)) for lo, b in held[1] if not b.is_empty()]
    return [(p.tensor, p.shape, p.region, p.local) for p in t.pieces]


def _elements(region: Region) -> list[tuple[int, ...]]:
    """Global indices of a region in stream order."""
    box = region.box
    out = []
    for i in range(box.numel):
        idx = []
        rest = i
        for st, o in zip(row_major_strides(box.sizes), box.offsets):
            q, rest = divmod(rest, st) if st else (0, rest)
            idx.append(o + q)
        out.append(tuple(idx))
    if region.flat is not None:
        return out[region.flat[0]:region.flat[1]]
    return out


def local_positions(local_shape: tuple[int, ...], region: Region, local: object) -> list[int]:
    """Local stream positions of a piece's elements, in the piece's stream order."""
    if isinstance(local, LocalBox):
        strides = row_major_strides(local_shape)
        return [
            sum((lo + gi - o) * st for lo, gi, o, st in zip(local.offsets, g, region.box.offsets, strides))
            for g in _elements(region)
        ]
    return list(range(local.start, local.start + region.numel))  # type: ignore[attr-defined]


def fill_expected(t: LocalTensor) -> list[int]:
    data = [PAD] * prod(t.shape)
    for key, shape, region, local in pieces_of(t):
        for pos, g in zip(local_positions(t.shape, region, local), _elements(region)):
            data[pos] = global_value(key, shape, g)
    return data


@dataclass
class Stored:
    manifest_json: bytes
    objects: dict[tuple[int, str], bytes]
    indexes: dict[int, bytes]


def save(world: list[list[LocalTensor]]) -> Stored:
    """Every rank plans and writes; the coordinator merges; all metadata goes through JSON."""
    objects: dict[tuple[int, str], bytes] = {}
    indexes: dict[int, bytes] = {}
    reports = []
    for rank, tensors in enumerate(world):
        grid, explicit = [], []
        for ref, t in enumerate(tensors):
            if t.grid is not None:
                key, layout, coord = t.grid
                grid.append(GridDecl(ref, key, "int32", ITEMSIZE, t.shape, layout, coord))
            else:
                explicit.append(ExplicitDecl(ref, "int32", ITEMSIZE, t.shape, t.pieces))
        plan = plan_save(rank, grid, explicit)
        buf = {k: bytearray(n) for k, n in plan.objects.items()}
        entries = []
        for item in plan.items:
            t = tensors[item.ref]
            positions = local_positions(t.shape, item.region, item.local)
            payload = struct.pack(f"<{len(positions)}i", *(t.data[p] for p in positions))
            buf[item.object][item.offset:item.offset + item.nbytes] = payload
            crcs = tuple(zlib.crc32(payload[b:b + BLOCK]) for b in range(0, max(1, len(payload)), BLOCK))
            entries.append(IndexEntry(item.tensor, item.region, item.object, item.offset, item.nbytes, crcs))
        for k, b in buf.items():
            objects[(rank, k)] = bytes(b)
        index_json = Index(rank, BLOCK, dict(plan.objects), entries).to_json_bytes()
        indexes[rank] = index_json
        ref = IndexRef(rank, index_object_key(rank), len(index_json), sha256_hex(index_json))
        reports.append(RankReport(rank, ref, plan.grid_reports, plan.explicit_reports, plan.rotation_digest))
    manifest = merge_reports(reports, world_size=len(world), values={}, meta={}, parallel=None, where="sim")
    return Stored(manifest.to_json_bytes(), objects, indexes)


@dataclass
class LoadStats:
    reads: list[tuple[int, int, str, int, int]] = field(default_factory=list)

    def bytes_read_twice(self) -> int:
        """Bytes some loading rank read more than once (ranks reading the same byte is fine)."""
        seen: dict[tuple[int, int, str], set[int]] = {}
        twice = 0
        for loader, writer, obj, off, n in self.reads:
            s = seen.setdefault((loader, writer, obj), set())
            for b in range(off, off + n):
                if b in s:
                    twice += 1
                s.add(b)
        return twice


def load(stored: Stored, world: list[list[LocalTensor]], stats: LoadStats | None = None) -> None:
    """Fill every rank's local tensors (in place) from ``stored``."""
    manifest = Manifest.from_json_bytes(stored.manifest_json, "sim")
    cache: dict[int, dict[tuple, IndexEntry]] = {}
    for loader, tensors in enumerate(world):
        targets = []
        for ref, t in enumerate(tensors):
            for key, _, region, local in pieces_of(t):
                targets.append(Target(ref, key, region, t.shape, local))  # type: ignore[arg-type]
        ops = match_sources(targets, manifest.tensors, "sim")
        for w in {op.writer for op in ops}:
            if w not in cache:
                assert sha256_hex(stored.indexes[w]) == manifest.indexes[w].sha256
                idx = Index.from_json_bytes(stored.indexes[w], f"index {w}")
                cache[w] = {(e.tensor, e.region.key()): e for e in idx.entries}
        requests = plan_reads(
            ops,
            entry_of=lambda op: cache[op.writer][(op.tensor, op.source.key())],
            itemsize_of=lambda _: ITEMSIZE,
            block_of=lambda _: BLOCK,
        )
        for req in requests:
            data = stored.objects[(req.writer, req.object)][req.offset:req.offset + req.length]
            assert len(data) == req.length
            if stats is not None:
                stats.reads.append((loader, req.writer, req.object, req.offset, req.length))
            for check in req.checks:
                lo = check.offset - req.offset
                assert zlib.crc32(data[lo:lo + check.length]) == check.crc, "checksum mismatch"
            for placed in req.ops:
                op = placed.op
                dst = tensors[op.ref].data
                for i in range(op.numel):
                    rest, s_off, d_off = i, 0, 0
                    for n, ss, ds, st in zip(op.shape, op.src_strides, op.dst_strides, row_major_strides(op.shape)):
                        q, rest = divmod(rest, st)
                        s_off += q * ss
                        d_off += q * ds
                    b = placed.src_byte + s_off * ITEMSIZE
                    dst[op.dst_start + d_off] = struct.unpack_from("<i", data, b)[0]


def fresh_copy(world: list[list[LocalTensor]]) -> list[list[LocalTensor]]:
    return [[LocalTensor(t.shape, t.grid, t.pieces, [PAD] * prod(t.shape)) for t in ts] for ts in world]


def boxes_cover(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    return sum(b.numel for b in boxes) == prod(shape)
