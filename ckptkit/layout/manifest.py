"""The on-disk metadata: one manifest per checkpoint, one index per writing rank.

Both are versioned JSON (never pickle) and validated field by field on read,
so a checkpoint from an untrusted bucket cannot run code and a malformed one
fails with a message that names the file and the field.

* The **manifest** (``manifest.json``, written last: its appearance is the
  commit) holds every logical tensor's dtype, global shape and layout — a
  grid rule for DTensor / rule-based tensors, or the directory of stored
  pieces for explicitly declared ones — the digest of every index file, and
  the replicated non-tensor state.
* An **index** (``index/rank-00007.json``) lists the pieces one rank wrote:
  object, byte offset and length, and a CRC32C per block of each piece, plus
  that rank's per-rank values (RNG states, data-loader positions).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from ckptkit.errors import LayoutError, ManifestError, UnsafePathError, UnsupportedVersionError
from ckptkit.layout.box import Box, Region
from ckptkit.layout.grid import GridLayout, Mesh
from ckptkit.layout.rules import PartitionRule

FORMAT = "ckptkit"
INDEX_FORMAT = "ckptkit-index"
VERSION = 1
MANIFEST_NAME = "manifest.json"

# Every dtype a manifest may name, with its bytes per element (so metadata-only
# tools never need torch to size a tensor).
DTYPES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
}
_SAFE_KEY = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")


def check_object_key(key: object, where: str) -> str:
    """Refuse object keys that could leave the checkpoint: absolute, ``..``, odd characters."""
    if not isinstance(key, str) or not _SAFE_KEY.match(key) or any(p in (".", "..") for p in key.split("/")):
        raise UnsafePathError(
            f"{where}: object key {key!r} is not a plain relative path inside the checkpoint "
            "(refusing absolute paths, '..' and unusual characters)"
        )
    return key


class ExplicitLayout:
    """The stored pieces of a tensor declared piece by piece: ``(region, writer rank)``.

    Read from a manifest, the pieces are parsed and validated on first use: at
    16k ranks the directories of all tensors are megabytes of JSON, and a
    loading rank needs only the tensors it holds.
    """

    def __init__(self, pieces: tuple[tuple[Region, int], ...] | None = None, *, raw: Any = None,
                 shape: tuple[int, ...] = (), world: int = 0, where: str = "") -> None:
        self._pieces = pieces
        self._raw = (raw, shape, world, where)

    @staticmethod
    def from_json(raw: Any, shape: tuple[int, ...], world: int, where: str) -> ExplicitLayout:
        _list(raw, f"{where}: pieces")
        return ExplicitLayout(raw=raw, shape=shape, world=world, where=where)

    @property
    def pieces(self) -> tuple[tuple[Region, int], ...]:
        if self._pieces is None:
            self._pieces = _parse_pieces(*self._raw)
            self._raw = (None, (), 0, "")
        return self._pieces

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExplicitLayout) and self.pieces == other.pieces

    def __repr__(self) -> str:
        return f"ExplicitLayout({len(self.pieces)} pieces)"

    def overlapping(self, box: Box) -> list[tuple[Region, int]]:
        out = []
        for region, writer in self.pieces:
            if any(b.intersect(box) is not None for b in region.boxes()):
                out.append((region, writer))
        return out


def _parse_pieces(raw: Any, shape: tuple[int, ...], world: int, where: str) -> tuple[tuple[Region, int], ...]:
    pieces = []
    try:
        for item in _list(raw, f"{where}: pieces"):
            if not isinstance(item, list) or len(item) != 4:
                raise ManifestError(f"{where}: malformed piece {item!r}")
            region = Region.from_json({"box": [item[0], item[1]], "flat": item[2]})
            if not region.box.within(shape):
                raise ManifestError(f"{where}: piece {region.to_json()} is outside shape {list(shape)}")
            writer = _int(item[3], f"{where}: writer rank", minimum=0)
            if writer >= world:
                raise ManifestError(f"{where}: piece written by rank {writer} in a world of {world}")
            pieces.append((region, writer))
    except LayoutError as exc:
        raise ManifestError(f"{where}: {exc}") from None
    return tuple(pieces)


@dataclass(frozen=True)
class TensorMeta:
    """A logical tensor: dtype, model-space shape, and where its pieces are."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    layout: GridLayout | ExplicitLayout
    rotation: int = 0
    rule: PartitionRule | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def stored_pieces(self) -> list[tuple[Region, int]]:
        """Every stored piece with the rank that wrote it (a grid's cells by their writer)."""
        if isinstance(self.layout, GridLayout):
            return [(Region(b), self.layout.writer_rank(cell, self.rotation)) for b, cell in self.layout.all_boxes()]
        return list(self.layout.pieces)

    def stored_overlapping(self, box: Box) -> list[tuple[Region, int]]:
        """The stored pieces (with their writers) that overlap ``box``."""
        if isinstance(self.layout, GridLayout):
            return [(Region(b), self.layout.writer_rank(cell, self.rotation)) for b, cell in self.layout.overlapping(box)]
        return self.layout.overlapping(box)


def pieces_by_writer(manifest: Manifest) -> dict[int, list[tuple[str, Region]]]:
    """Every non-empty stored piece of a checkpoint, grouped by the rank that wrote it.

    What an offline writer needs to rewrite a checkpoint with its original
    writer ranks (zarr and DCP imports and exports).
    """
    out: dict[int, list[tuple[str, Region]]] = {}
    for key, meta in manifest.tensors.items():
        for region, writer in meta.stored_pieces():
            if region.numel:
                out.setdefault(writer, []).append((key, region))
    return out


@dataclass(frozen=True)
class IndexRef:
    rank: int
    key: str
    size: int
    sha256: str


@dataclass
class Manifest:
    world_size: int
    tensors: dict[str, TensorMeta]
    indexes: dict[int, IndexRef]
    values: dict[str, Any] = field(default_factory=dict)
    per_rank_keys: tuple[str, ...] = ()
    parallel: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    version: int = VERSION

    def to_json_bytes(self) -> bytes:
        meshes: dict[Mesh, str] = {}
        tensors = {}
        for key, t in self.tensors.items():
            entry: dict[str, Any] = {"dtype": t.dtype, "shape": list(t.shape)}
            if isinstance(t.layout, GridLayout):
                mesh_id = meshes.setdefault(t.layout.mesh, f"m{len(meshes)}")
                entry["layout"] = t.layout.to_json(mesh_id)
                entry["layout"]["rotation"] = t.rotation
            else:
                entry["layout"] = {
                    "kind": "explicit",
                    "pieces": [
                        [list(r.box.offsets), list(r.box.sizes), list(r.flat) if r.flat else None, w]
                        for r, w in t.layout.pieces
                    ],
                }
            if t.rule is not None:
                entry["rule"] = t.rule.to_json()
            tensors[key] = entry
        doc = {
            "format": FORMAT,
            "version": self.version,
            "world_size": self.world_size,
            "parallel": self.parallel,
            "meta": self.meta,
            "meshes": {mid: m.to_json() for m, mid in meshes.items()},
            "tensors": tensors,
            "indexes": [[r.rank, r.key, r.size, r.sha256] for r in sorted(self.indexes.values(), key=lambda r: r.rank)],
            "values": self.values,
            "per_rank_keys": list(self.per_rank_keys),
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()

    @staticmethod
    def from_json_bytes(data: bytes, where: str) -> Manifest:
        doc = _load_json(data, where)
        _check_header(doc, FORMAT, where)
        world = _int(doc.get("world_size"), f"{where}: world_size", minimum=1)
        meshes_doc = _dict(doc.get("meshes", {}), f"{where}: meshes")
        meshes = {}
        for mid, mdoc in meshes_doc.items():
            try:
                meshes[mid] = Mesh.from_json(mdoc)
            except LayoutError as exc:
                raise ManifestError(f"{where}: mesh {mid!r}: {exc}") from None
            if max(meshes[mid].ranks) >= world:
                raise ManifestError(f"{where}: mesh {mid!r} has ranks outside the world of {world}")
        tensors = {}
        for key, tdoc in _dict(doc.get("tensors"), f"{where}: tensors").items():
            tensors[key] = _tensor_from_json(key, tdoc, meshes, world, f"{where}: tensor {key!r}")
        indexes = {}
        for item in _list(doc.get("indexes"), f"{where}: indexes"):
            if not isinstance(item, list) or len(item) != 4:
                raise ManifestError(f"{where}: malformed index entry {item!r}")
            rank = _int(item[0], f"{where}: index rank", minimum=0)
            if rank >= world:
                raise ManifestError(f"{where}: index for rank {rank} in a world of {world}")
            ikey = check_object_key(item[1], f"{where}: index of rank {rank}")
            size = _int(item[2], f"{where}: index size", minimum=0)
            if not isinstance(item[3], str) or not re.fullmatch(r"[0-9a-f]{64}", item[3]):
                raise ManifestError(f"{where}: index of rank {rank} has a malformed sha256")
            indexes[rank] = IndexRef(rank, ikey, size, item[3])
        values = _dict(doc.get("values", {}), f"{where}: values")
        per_rank = tuple(str(k) for k in _list(doc.get("per_rank_keys", []), f"{where}: per_rank_keys"))
        parallel = doc.get("parallel")
        if parallel is not None and not isinstance(parallel, str):
            raise ManifestError(f"{where}: parallel must be a string")
        meta = _dict(doc.get("meta", {}), f"{where}: meta")
        return Manifest(world, tensors, indexes, values, per_rank, parallel, meta, doc["version"])


def _tensor_from_json(key: str, tdoc: Any, meshes: dict[str, Mesh], world: int, where: str) -> TensorMeta:
    tdoc = _dict(tdoc, where)
    dtype = tdoc.get("dtype")
    if dtype not in DTYPES:
        raise ManifestError(f"{where}: unknown dtype {dtype!r}")
    shape = tuple(_int(s, f"{where}: shape", minimum=0) for s in _list(tdoc.get("shape"), f"{where}: shape"))
    ldoc = _dict(tdoc.get("layout"), f"{where}: layout")
    rule = None
    try:
        if "rule" in tdoc:
            rule = PartitionRule.from_json(tdoc["rule"])
        if ldoc.get("kind") == "grid":
            mesh = meshes.get(ldoc.get("mesh"))  # type: ignore[arg-type]
            if mesh is None:
                raise ManifestError(f"{where}: layout names unknown mesh {ldoc.get('mesh')!r}")
            layout: GridLayout | ExplicitLayout = GridLayout.from_json(ldoc, mesh, shape)
            rotation = _int(ldoc.get("rotation", 0), f"{where}: rotation", minimum=0)
            return TensorMeta(key, dtype, shape, layout, rotation, rule)
        if ldoc.get("kind") == "explicit":
            layout_e = ExplicitLayout.from_json(ldoc.get("pieces"), shape, world, where)
            return TensorMeta(key, dtype, shape, layout_e, 0, rule)
    except LayoutError as exc:
        raise ManifestError(f"{where}: {exc}") from None
    raise ManifestError(f"{where}: unknown layout kind {ldoc.get('kind')!r}")


@dataclass(frozen=True)
class IndexEntry:
    """One stored piece: where its bytes are and their block checksums."""

    tensor: str
    region: Region
    object: str
    offset: int
    nbytes: int
    crcs: tuple[int, ...]


@dataclass
class Index:
    rank: int
    block: int
    objects: dict[str, int]
    entries: list[IndexEntry]
    values: dict[str, Any] = field(default_factory=dict)
    version: int = VERSION

    def to_json_bytes(self) -> bytes:
        doc = {
            "format": INDEX_FORMAT,
            "version": self.version,
            "rank": self.rank,
            "block": self.block,
            "objects": [[k, n] for k, n in self.objects.items()],
            "pieces": [
                [
                    e.tensor, list(e.region.box.offsets), list(e.region.box.sizes),
                    list(e.region.flat) if e.region.flat else None,
                    e.object, e.offset, e.nbytes, list(e.crcs),
                ]
                for e in self.entries
            ],
            "values": self.values,
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()

    @staticmethod
    def from_json_bytes(data: bytes, where: str) -> Index:
        doc = _load_json(data, where)
        _check_header(doc, INDEX_FORMAT, where)
        rank = _int(doc.get("rank"), f"{where}: rank", minimum=0)
        block = _int(doc.get("block"), f"{where}: block", minimum=1)
        objects: dict[str, int] = {}
        for item in _list(doc.get("objects"), f"{where}: objects"):
            if not isinstance(item, list) or len(item) != 2:
                raise ManifestError(f"{where}: malformed object entry {item!r}")
            objects[check_object_key(item[0], where)] = _int(item[1], f"{where}: object size", minimum=0)
        entries = []
        for item in _list(doc.get("pieces"), f"{where}: pieces"):
            if not isinstance(item, list) or len(item) != 8:
                raise ManifestError(f"{where}: malformed piece entry")
            tensor = item[0]
            if not isinstance(tensor, str):
                raise ManifestError(f"{where}: piece tensor key must be a string")
            try:
                region = Region.from_json({"box": [item[1], item[2]], "flat": item[3]})
            except LayoutError as exc:
                raise ManifestError(f"{where}: tensor {tensor!r}: {exc}") from None
            obj = check_object_key(item[4], f"{where}: tensor {tensor!r}")
            if obj not in objects:
                raise ManifestError(f"{where}: tensor {tensor!r} points into undeclared object {obj!r}")
            offset = _int(item[5], f"{where}: offset", minimum=0)
            nbytes = _int(item[6], f"{where}: nbytes", minimum=0)
            if offset + nbytes > objects[obj]:
                raise ManifestError(
                    f"{where}: tensor {tensor!r} bytes [{offset}, {offset + nbytes}) exceed object {obj!r} "
                    f"of {objects[obj]} bytes"
                )
            crcs = tuple(_int(c, f"{where}: crc", minimum=0) for c in _list(item[7], f"{where}: crcs"))
            if len(crcs) != max(1, -(-nbytes // block)):
                raise ManifestError(f"{where}: tensor {tensor!r} has {len(crcs)} checksums for {nbytes} bytes")
            entries.append(IndexEntry(tensor, region, obj, offset, nbytes, crcs))
        spans = sorted((e.object, e.offset, e.offset + e.nbytes, e.tensor) for e in entries if e.nbytes)
        for (o1, _, end1, t1), (o2, start2, _, t2) in zip(spans, spans[1:]):
            if o1 == o2 and start2 < end1:
                raise ManifestError(f"{where}: pieces of {t1!r} and {t2!r} overlap in object {o1!r}")
        values = _dict(doc.get("values", {}), f"{where}: values")
        return Index(rank, block, objects, entries, values, doc["version"])


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _load_json(data: bytes, where: str) -> dict:
    try:
        doc = json.loads(data, parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise ManifestError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: expected a JSON object")
    return doc


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _check_header(doc: dict, fmt: str, where: str) -> None:
    if doc.get("format") != fmt:
        raise ManifestError(f"{where}: format is {doc.get('format')!r}, expected {fmt!r}")
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ManifestError(f"{where}: missing format version")
    if version != VERSION:
        raise UnsupportedVersionError(
            f"{where}: format version {version} is not supported by this ckptkit (reads version {VERSION}); "
            + ("upgrade ckptkit" if version > VERSION else "convert it with an older ckptkit")
        )


def _int(value: Any, where: str, minimum: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ManifestError(f"{where}: expected an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ManifestError(f"{where}: {value} is below {minimum}")
    return value


def _dict(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ManifestError(f"{where}: expected an object, got {type(value).__name__}")
    return value


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise ManifestError(f"{where}: expected a list, got {type(value).__name__}")
    return value
