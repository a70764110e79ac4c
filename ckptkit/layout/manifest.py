"""The on-disk metadata: one manifest per checkpoint, one index per writing rank.

Both are versioned JSON (never pickle) and validated field by field on read,
so a checkpoint from an untrusted bucket cannot run code and a malformed one
fails with a message that names the file and the field.

* The **manifest** (``manifest.json``, written last: its appearance is the
  commit) holds every logical tensor's dtype, global shape and layout — a
  grid rule for DTensor / rule-based tensors, or the directory of stored
  pieces for explicitly declared ones — the digest of every index file, and
  the replicated non-tensor state.
* An **index** (``index/rank-00007-<attempt>.json``) lists the pieces one
  rank wrote: object, byte offset and length, and a CRC32C per block of each
  piece, plus that rank's per-rank values (RNG states, data-loader positions).
  Its parsing lives in :mod:`ckptkit.layout.index`; this module holds the checks
  both files share (object keys, the format header).

Every byte a load can return is covered by a digest or checksum: data by the
CRC32Cs in the indexes, each index by the SHA-256 the manifest records, and
the manifest itself (values, layouts, metadata — format version 2) by a
SHA-256 of its own body, sealed as its last field (:func:`seal`), so a flipped
bit anywhere is found before anything is trusted. Version-1 manifests (no
seal) are still read.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from math import prod
from typing import Any

from ckptkit.errors import (
    CorruptCheckpointError,
    CoverageError,
    LayoutError,
    ManifestError,
    UnsafePathError,
    UnsupportedVersionError,
)
from ckptkit.layout.box import Box, Region
from ckptkit.layout.coverage import check_coverage, named_axes
from ckptkit.layout.flat_split import FlatSplit, find_split
from ckptkit.layout.grid import GridLayout, Mesh
from ckptkit.layout.piece_index import PieceIndex
from ckptkit.layout.rules import PartitionRule
from ckptkit.layout.strict_json import (
    MAX_WORLD,
    as_dict,
    as_int,
    as_list,
    check_depth,
    check_text,
    gc_paused,
    load_json,
)

FORMAT = "ckptkit"
VERSION = 2  # manifests written now: sealed by their own digest, attempt-named objects, rank_values
SPLIT_VERSION = 3  # a manifest with a FlatSplit layout (ZeRO-3's runs); otherwise as version 2
SPLIT_MIN_RUNS = 64  # pieces of a tensor recorded as a FlatSplit from this many runs on (ZeRO-3 over 64+ ranks)
READ_VERSIONS = (1, 2, 3)  # manifests this ckptkit reads
MANIFEST_NAME = "manifest.json"
SEAL_FIELD = "manifest_sha256"
MAX_NDIM = 64  # dimensions of a tensor (torch supports fewer)
_SEAL = re.compile(rb',"' + SEAL_FIELD.encode() + rb'":"([0-9a-f]{64})"\}$')

# Every dtype a manifest may name, with its bytes per element (so metadata-only
# tools never need torch to size a tensor). The names are torch's. A save refuses a tensor whose
# dtype is not here (ckptkit.engine.state.check_savable) before anything is written: a committed
# checkpoint always names only dtypes its reader knows.
DTYPES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,  # two 4-bit values per byte, as torch packs them
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
    "complex32": 4, "complex64": 8, "complex128": 16,
}
_SAFE_KEY = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")


def seal(body: bytes) -> bytes:
    """``body`` (a compact JSON object) with the SHA-256 of its bytes appended as its last field.

    The file stays plain JSON (``jq`` reads it); the digest covers every byte of the body
    exactly as written, so no re-serialisation is involved in checking it."""
    if not body.endswith(b"}") or body == b"{}":
        raise ValueError("seal needs a non-empty compact JSON object")
    return body[:-1] + b',"' + SEAL_FIELD.encode() + b'":"' + sha256_hex(body).encode() + b'"}'


def unseal(data: bytes, where: str) -> tuple[bytes, bool]:
    """The body of a sealed manifest and True; or ``data`` unchanged and False if it has no seal.

    CorruptCheckpointError when the seal is there but the body does not match it."""
    m = _SEAL.search(data, max(0, len(data) - 100))
    if m is None:
        return data, False
    body = data[:m.start()] + b"}"
    if sha256_hex(body) != m.group(1).decode():
        raise CorruptCheckpointError(
            f"{where}: the manifest does not match its own digest ({SEAL_FIELD}): it was damaged after it "
            "was written (a flipped bit, a partial overwrite)"
        )
    return body, True


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
    loading rank needs only the tensors it holds. Pieces that cut the tensor's
    flattening into equal runs (ZeRO-3) are kept as a :class:`FlatSplit`
    (``split``): a run length and the writers, whatever the number of ranks.
    """

    def __init__(self, pieces: tuple[tuple[Region, int], ...] | None = None, *, raw: Any = None,
                 shape: tuple[int, ...] = (), world: int = 0, where: str = "", key: str = "",
                 axes: dict[int, str] | None = None, split: FlatSplit | None = None) -> None:
        self._pieces = pieces
        self._raw = (raw, shape, world, where, key)
        self._axes = axes
        self._index: PieceIndex | None = None
        self.split = split

    @staticmethod
    def of(shape: tuple[int, ...], pieces: tuple[tuple[Region, int], ...]) -> ExplicitLayout:
        """The layout of checked pieces: as a FlatSplit when they are one of at least SPLIT_MIN_RUNS runs,
        else as listed (a few pieces cost nothing to list, and a manifest without a split stays version 2,
        which ckptkit versions before the split read)."""
        split = find_split(shape, pieces) if len(pieces) >= SPLIT_MIN_RUNS else None
        return ExplicitLayout(split=split) if split is not None else ExplicitLayout(pieces)

    def to_json(self) -> dict[str, Any]:
        if self.split is not None:
            return {"kind": "explicit", "split": self.split.to_json()}
        return {"kind": "explicit",
                "pieces": [[list(r.box.offsets), list(r.box.sizes), list(r.flat) if r.flat else None, w]
                           for r, w in self.pieces]}

    @staticmethod
    def from_json(raw: Any, shape: tuple[int, ...], world: int, where: str, key: str = "",
                  axes: dict[int, str] | None = None) -> ExplicitLayout:
        """``axes``: axes to name in a coverage error (see :func:`~ckptkit.layout.coverage.named_axes`)."""
        as_list(raw, f"{where}: pieces")
        return ExplicitLayout(raw=raw, shape=shape, world=world, where=where, key=key, axes=axes)

    @property
    def pieces(self) -> tuple[tuple[Region, int], ...]:
        """The stored pieces; parsed from the manifest on first use and checked to cover the tensor
        exactly once (so no read path can leave an element unfilled or fill one twice)."""
        if self._pieces is None and self.split is not None:
            self._pieces = self.split.pieces()  # consecutive runs of the whole flattening: exact by construction
        if self._pieces is None:
            raw, shape, world, where, key = self._raw
            with gc_paused():
                pieces = _parse_pieces(raw, shape, world, f"{where}: tensor {key!r}")
            try:
                check_coverage(key, shape, pieces, where, self._axes)
            except CoverageError as exc:
                raise CoverageError(f"{exc} (the manifest is damaged)") from None
            self._pieces = pieces
            self._raw = (None, (), 0, "", "")
        return self._pieces

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExplicitLayout) and self.pieces == other.pieces

    def __repr__(self) -> str:
        return f"ExplicitLayout({len(self.pieces)} pieces)"

    def overlapping(self, box: Box) -> list[tuple[Region, int]]:
        """The stored pieces sharing an element with ``box``, in stored order (an index built on first use)."""
        if self.split is not None:
            return self.split.overlapping(box)
        if self._index is None:
            self._index = PieceIndex(self.pieces)
        return self._index.overlapping(box)


def _parse_pieces(raw: Any, shape: tuple[int, ...], world: int, where: str) -> tuple[tuple[Region, int], ...]:
    pieces = []
    try:
        for item in as_list(raw, f"{where}: pieces"):
            if not isinstance(item, list) or len(item) != 4:
                raise ManifestError(f"{where}: malformed piece {short(item)}")
            region = Region.from_json({"box": [item[0], item[1]], "flat": item[2]})
            if not region.box.within(shape):
                raise ManifestError(f"{where}: piece {region.to_json()} is outside shape {list(shape)}")
            writer = as_int(item[3], f"{where}: writer rank", minimum=0)
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
        return prod(self.shape)

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
    """A committed checkpoint's metadata. ``values`` are the non-tensor values every rank that
    held them agreed on (JSON-encoded); ``rank_values`` are values whose holders disagreed, kept
    per rank: ``key -> ((encoded value, ranks holding it), ...)``. ``attempt`` names the save
    attempt whose objects the checkpoint references."""

    world_size: int
    tensors: dict[str, TensorMeta]
    indexes: dict[int, IndexRef]
    values: dict[str, Any] = field(default_factory=dict)
    per_rank_keys: tuple[str, ...] = ()
    parallel: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    version: int = VERSION
    attempt: str | None = None
    rank_values: dict[str, tuple[tuple[Any, tuple[int, ...]], ...]] = field(default_factory=dict)

    def to_doc(self) -> dict[str, Any]:
        """The manifest as a JSON document (unsealed; :meth:`to_json_bytes` is what is stored)."""
        meshes: dict[Mesh, str] = {}
        tensors = {}
        for key, t in self.tensors.items():
            entry: dict[str, Any] = {"dtype": t.dtype, "shape": list(t.shape)}
            if isinstance(t.layout, GridLayout):
                mesh_id = meshes.setdefault(t.layout.mesh, f"m{len(meshes)}")
                entry["layout"] = t.layout.to_json(mesh_id)
                entry["layout"]["rotation"] = t.rotation
            else:
                entry["layout"] = t.layout.to_json()
            if t.rule is not None:
                entry["rule"] = t.rule.to_json()
            tensors[key] = entry
        split = any(isinstance(t.layout, ExplicitLayout) and t.layout.split is not None for t in self.tensors.values())
        doc = {
            "format": FORMAT,
            "version": SPLIT_VERSION if split else VERSION,  # older readers refuse a split by its version
            "world_size": self.world_size,
            "parallel": self.parallel,
            "attempt": self.attempt,
            "meta": self.meta,
            "meshes": {mid: m.to_json() for m, mid in meshes.items()},
            "tensors": tensors,
            "indexes": [[r.rank, r.key, r.size, r.sha256] for r in sorted(self.indexes.values(), key=lambda r: r.rank)],
            "values": self.values,
            "rank_values": {k: [[v, list(ranks)] for v, ranks in groups] for k, groups in self.rank_values.items()},
            "per_rank_keys": list(self.per_rank_keys),
        }
        return doc

    def to_json_bytes(self) -> bytes:
        """The stored form: compact JSON, sealed by the SHA-256 of its body. Built with the collector
        paused, as an index is (:meth:`~ckptkit.layout.index.Index.to_json_bytes`): on rank 0 it is
        a document of every tensor's layout, made in the background of a save while training runs."""
        with gc_paused():
            return seal(json.dumps(self.to_doc(), separators=(",", ":"), allow_nan=False).encode())

    @staticmethod
    def from_json_bytes(data: bytes, where: str) -> Manifest:
        """Parse a stored manifest: check its seal (version 2 and later), then every field."""
        with gc_paused():
            return Manifest._parse(data, where)

    @staticmethod
    def _parse(data: bytes, where: str) -> Manifest:
        body, sealed = unseal(data, where)
        doc = load_json(body, where)
        if not sealed and doc.get("version") != 1 and doc.get("format") == FORMAT and doc.get("version") in READ_VERSIONS:
            raise CorruptCheckpointError(f"{where}: a version-{doc.get('version')} manifest without its digest "
                                         f"({SEAL_FIELD}): it is damaged or was edited")
        return Manifest._from_checked_doc(doc, where, complete=True)

    @staticmethod
    def from_doc(doc: dict, where: str) -> Manifest:
        """Parse a manifest document already loaded from JSON (e.g. embedded, without its index
        list, in a zarr export)."""
        check_depth(as_dict(doc, where), where, strings=True)
        return Manifest._from_checked_doc(doc, where, complete=False)

    @staticmethod
    def _from_checked_doc(doc: dict, where: str, complete: bool) -> Manifest:
        check_header(doc, FORMAT, where, READ_VERSIONS)
        world = as_int(doc.get("world_size"), f"{where}: world_size", minimum=1, maximum=MAX_WORLD)
        indexes = _indexes_from_json(doc.get("indexes"), world, where)
        if complete and len(indexes) != world:
            raise ManifestError(f"{where}: the manifest lists the indexes of {len(indexes)} ranks; the checkpoint "
                                f"was saved by {world} ranks and every rank writes one")
        # Meshes may be written compactly ({"start", "step"}); bound what parsing them materialises
        # by what the document itself holds (a stored manifest lists an index per rank).
        budget = 16 * world + 65536 if complete else 1 << 20
        meshes = {}
        for mid, mdoc in as_dict(doc.get("meshes", {}), f"{where}: meshes").items():
            try:
                meshes[mid] = Mesh.from_json(mdoc, max_ranks=min(world, budget))
            except LayoutError as exc:
                raise ManifestError(f"{where}: mesh {mid!r}: {exc}") from None
            budget -= meshes[mid].size
            if max(meshes[mid].ranks) >= world:
                raise ManifestError(f"{where}: mesh {mid!r} has ranks outside the world of {world}")
        tensors = {}
        for key, tdoc in as_dict(doc.get("tensors"), f"{where}: tensors").items():
            tensors[_state_key(key, f"{where}: tensors")] = _tensor_from_json(key, tdoc, meshes, world, where)
        values = as_dict(doc.get("values", {}), f"{where}: values")
        for key in values:
            _state_key(key, f"{where}: values")
        rank_values = _rank_values_from_json(doc.get("rank_values", {}), world, f"{where}: rank_values")
        per_rank = tuple(_state_key(k, f"{where}: per_rank_keys")
                         for k in as_list(doc.get("per_rank_keys", []), f"{where}: per_rank_keys"))
        parallel = doc.get("parallel")
        if parallel is not None and not isinstance(parallel, str):
            raise ManifestError(f"{where}: parallel must be a string")
        attempt = doc.get("attempt")
        if attempt is not None and (not isinstance(attempt, str) or not re.fullmatch(r"[0-9a-f]{12}", attempt)):
            raise ManifestError(f"{where}: malformed save attempt id {short(attempt)}")
        meta = as_dict(doc.get("meta", {}), f"{where}: meta")
        _check_disjoint_keys(tensors, values, rank_values, per_rank, where)
        return Manifest(world, tensors, indexes, values, per_rank, parallel, meta, doc["version"], attempt, rank_values)


def _indexes_from_json(raw: Any, world: int, where: str) -> dict[int, IndexRef]:
    indexes: dict[int, IndexRef] = {}
    for item in as_list(raw, f"{where}: indexes"):
        if not isinstance(item, list) or len(item) != 4:
            raise ManifestError(f"{where}: malformed index entry {short(item)}")
        rank = as_int(item[0], f"{where}: index rank", minimum=0)
        if rank >= world:
            raise ManifestError(f"{where}: index for rank {rank} in a world of {world}")
        if rank in indexes:
            raise ManifestError(f"{where}: two index entries for rank {rank}")
        ikey = check_object_key(item[1], f"{where}: index of rank {rank}")
        size = as_int(item[2], f"{where}: index size", minimum=0)
        if not isinstance(item[3], str) or not re.fullmatch(r"[0-9a-f]{64}", item[3]):
            raise ManifestError(f"{where}: index of rank {rank} has a malformed sha256")
        indexes[rank] = IndexRef(rank, ikey, size, item[3])
    return indexes


def _rank_values_from_json(raw: Any, world: int, where: str) -> dict[str, tuple[tuple[Any, tuple[int, ...]], ...]]:
    out: dict[str, tuple[tuple[Any, tuple[int, ...]], ...]] = {}
    for key, groups in as_dict(raw, where).items():
        _state_key(key, where)
        seen: set[int] = set()
        parsed = []
        for group in as_list(groups, f"{where} {key!r}"):
            if not isinstance(group, list) or len(group) != 2:
                raise ManifestError(f"{where} {key!r}: malformed entry {short(group)}")
            ranks = tuple(as_int(r, f"{where} {key!r}: rank", minimum=0, maximum=world - 1)
                          for r in as_list(group[1], f"{where} {key!r}: ranks"))
            if seen.intersection(ranks) or len(set(ranks)) != len(ranks):
                raise ManifestError(f"{where} {key!r}: a rank is listed twice")
            seen.update(ranks)
            parsed.append((group[0], ranks))
        out[key] = tuple(parsed)
    return out


def _check_disjoint_keys(tensors: dict, values: dict, rank_values: dict, per_rank: tuple[str, ...], where: str) -> None:
    """One state key is one kind of thing — a tensor, a value, or a per-rank value — or a load could
    not say which to return."""
    owner: dict[str, str] = {}
    for kind, keys in (("tensor", tensors), ("value", values), ("per-rank value", rank_values)):
        for k in keys:
            if owner.setdefault(k, kind) != kind:
                raise ManifestError(f"{where}: state key {k!r} is recorded as both a {owner[k]} and a {kind}")
    for k in per_rank:
        if k in owner:
            raise ManifestError(f"{where}: state key {k!r} is recorded as both a {owner[k]} and a per-rank value")


def _state_key(key: str, where: str) -> str:
    return check_text(key, where)


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _tensor_from_json(key: str, tdoc: Any, meshes: dict[str, Mesh], world: int, file: str) -> TensorMeta:
    where = f"{file}: tensor {key!r}"
    tdoc = as_dict(tdoc, where)
    dtype = tdoc.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ManifestError(f"{where}: unknown dtype {short(dtype)}")
    shape = tuple(as_int(s, f"{where}: shape", minimum=0) for s in as_list(tdoc.get("shape"), f"{where}: shape"))
    if len(shape) > MAX_NDIM:
        raise ManifestError(f"{where}: {len(shape)} dimensions, at most {MAX_NDIM} supported")
    ldoc = as_dict(tdoc.get("layout"), f"{where}: layout")
    rule = None
    try:
        if "rule" in tdoc:
            rule = PartitionRule.from_json(tdoc["rule"])
        if ldoc.get("kind") == "grid":
            mesh_id = ldoc.get("mesh")
            mesh = meshes.get(mesh_id) if isinstance(mesh_id, str) else None
            if mesh is None:
                raise ManifestError(f"{where}: layout names unknown mesh {short(mesh_id)}")
            layout: GridLayout | ExplicitLayout = GridLayout.from_json(ldoc, mesh, shape)
            rotation = as_int(ldoc.get("rotation", 0), f"{where}: rotation", minimum=0)
            return TensorMeta(key, dtype, shape, layout, rotation, rule)
        if ldoc.get("kind") == "explicit" and "split" in ldoc:
            return TensorMeta(key, dtype, shape, ExplicitLayout(split=FlatSplit.from_json(ldoc["split"], shape, world,
                                                                                        where)), 0, rule)
        if ldoc.get("kind") == "explicit":
            layout_e = ExplicitLayout.from_json(ldoc.get("pieces"), shape, world, file, key, named_axes(rule))
            return TensorMeta(key, dtype, shape, layout_e, 0, rule)
    except LayoutError as exc:
        raise ManifestError(f"{where}: {exc}") from None
    raise ManifestError(f"{where}: unknown layout kind {short(ldoc.get('kind'))}")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_header(doc: dict, fmt: str, where: str, versions: tuple[int, ...]) -> None:
    if doc.get("format") != fmt:
        raise ManifestError(f"{where}: format is {short(doc.get('format'))}, expected {fmt!r}")
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ManifestError(f"{where}: missing format version")
    if version not in versions:
        newest = max(versions)
        raise UnsupportedVersionError(
            f"{where}: format version {short(version)} is not supported by this ckptkit (reads versions "
            f"{', '.join(map(str, versions))}); "
            + ("upgrade ckptkit" if version > newest else "convert it with an older ckptkit")
        )


def dropped_per_rank_values(meta: dict[str, Any]) -> list[str]:
    """The per-rank values ``ckptkit reshard`` dropped from a checkpoint (and earlier reshards from its
    source), as its metadata records them: an adapter refuses a checkpoint that lost its user's per-rank
    value by name, instead of reading it as never stored."""
    earlier = meta.get("resharded_from")
    listed = earlier.get("dropped_per_rank_values") if isinstance(earlier, dict) else None
    return [k for k in listed if isinstance(k, str)] if isinstance(listed, list) else []
