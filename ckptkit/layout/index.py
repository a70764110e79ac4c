"""A rank's index (``index/rank-00007-<attempt>.json``): the pieces it wrote and its per-rank values.

Each entry says where one stored piece's bytes are (object, offset, length) and carries a CRC32C per
block of them. The file is untrusted input (docs/trust.md), parsed in two steps:

* **On read, for every entry**: the header, the objects, and each entry's shape (an 8-field list
  naming a tensor), its object (declared), its byte range (inside that object) and that no two
  entries share bytes of an object. These are the checks that need the whole file.
* **When a reader first asks for a tensor's pieces** (:meth:`Index.entry`): that tensor's entries'
  regions and checksums, and that none of them is listed twice. :attr:`Index.entries` does this
  for every tensor (verify, describe, reshard, which read everything).

Why two steps: a loading rank of a resharded job needs a few pieces from each of many writers.
A torchtitan rank loading fsdp16·tp8 at fsdp32·tp4 reads all 128 indexes (24 MB of JSON) and uses
about one entry in a hundred; validating every entry of every index took 3.4 s of its 4.3 s load
plan (docs/benchmarks.md). An entry that no reader asks for is never trusted, so it need not be
built. The outcome for every entry a reader uses is the same as before, error messages included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NoReturn

from ckptkit.errors import LayoutError, ManifestError
from ckptkit.layout.box import Region
from ckptkit.layout.manifest import check_header, check_object_key, short
from ckptkit.layout.strict_json import MAX_WORLD, as_dict, as_int, as_list, check_text, gc_paused, load_json

INDEX_FORMAT = "ckptkit-index"
INDEX_VERSION = 1  # the index format is unchanged since version 1
PIECE_FIELDS = 8  # tensor, box offsets, box sizes, flat range or null, object, offset, nbytes, crcs


@dataclass(frozen=True)
class IndexEntry:
    """One stored piece: where its bytes are and their block checksums."""

    tensor: str
    region: Region
    object: str
    offset: int
    nbytes: int
    crcs: tuple[int, ...]


class Index:
    """One rank's index. Built from entries (a save) or parsed from its JSON (:meth:`from_json_bytes`),
    in which case each tensor's entries are validated and built when first asked for."""

    def __init__(self, rank: int, block: int, objects: dict[str, int], entries: list[IndexEntry],
                 values: dict[str, Any] | None = None, version: int = INDEX_VERSION) -> None:
        self.rank = rank
        self.block = block
        self.objects = objects
        self.values: dict[str, Any] = {} if values is None else values
        self.version = version
        self.where = f"index of rank {rank}"
        self._entries: list[IndexEntry] | None = list(entries)
        self._pieces: list[list[Any]] = []  # a parsed index's raw entries, by position
        self._positions: dict[str, list[int]] = {}  # tensor -> positions of its raw entries
        self._built: dict[str, dict[tuple, IndexEntry]] = {}  # tensor -> region key -> entry

    # ------------------------------------------------------------ queries

    @property
    def entries(self) -> list[IndexEntry]:
        """Every entry, in file order (validates all of them on first use: ManifestError if one is bad)."""
        if self._entries is None:
            made: dict[int, IndexEntry] = {}
            for tensor, positions in self._positions.items():
                for pos, e in zip(positions, self._of_tensor(tensor).values()):
                    made[pos] = e
            self._entries = [made[pos] for pos in range(len(self._pieces))]
        return self._entries

    def entry(self, tensor: str, region: Region) -> IndexEntry | None:
        """The entry of ``tensor``'s stored piece ``region``, or None if this index has none."""
        return self._of_tensor(tensor).get(region.key())

    def _of_tensor(self, tensor: str) -> dict[tuple, IndexEntry]:
        """``tensor``'s entries by region key, validated and built once (in file order). Two threads that
        ask at once build equal entries; either result is kept."""
        got = self._built.get(tensor)
        if got is not None:
            return got
        got = {}
        if self._entries is not None and not self._pieces:  # built from entries: group them once
            for e in self._entries:
                self._built.setdefault(e.tensor, {})[e.region.key()] = e
            return self._built.get(tensor, {})
        for pos in self._positions.get(tensor, ()):
            e = self._entry_at(pos)
            key = e.region.key()
            if key in got:
                raise ManifestError(f"{self.where}: piece {e.region.to_json()} of tensor {tensor!r} is listed twice")
            got[key] = e
        self._built[tensor] = got
        return got

    def _entry_at(self, pos: int) -> IndexEntry:
        """The raw entry at ``pos`` (shape, object and byte range already checked on read) as an IndexEntry."""
        where = self.where
        tensor, offsets, sizes, flat, obj, offset, nbytes, crcs_raw = self._pieces[pos]
        check_text(tensor, where)
        try:
            region = Region.from_json({"box": [offsets, sizes], "flat": flat})
        except LayoutError as exc:
            raise ManifestError(f"{where}: tensor {tensor!r}: {exc}") from None
        crcs_raw = as_list(crcs_raw, f"{where}: crcs")
        if len(crcs_raw) != max(1, -(-nbytes // self.block)):
            raise ManifestError(f"{where}: tensor {tensor!r} has {len(crcs_raw)} checksums for {nbytes} bytes")
        crcs = tuple(as_int(c, f"{where}: crc", minimum=0, maximum=0xFFFFFFFF) for c in crcs_raw)
        return IndexEntry(tensor, region, obj, offset, nbytes, crcs)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Index):
            return NotImplemented
        return (self.rank, self.block, self.objects, self.entries, self.values, self.version) == (
            other.rank, other.block, other.objects, other.entries, other.values, other.version)

    def __repr__(self) -> str:
        return f"Index(rank={self.rank}, {len(self._pieces) or len(self._entries or ())} pieces)"

    # ------------------------------------------------------------ JSON

    def to_json_bytes(self) -> bytes:
        """The stored form. Built with the collector paused (:func:`gc_paused`): a rank's thousands of
        entries become as many short-lived lists, whose allocations set off collections (full ones
        included) that find nothing to free, in the background of a save while training runs."""
        with gc_paused():
            return self._encode()

    def _encode(self) -> bytes:
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
        with gc_paused():
            return Index._parse(data, where)

    @staticmethod
    def _parse(data: bytes, where: str) -> Index:
        # "pieces" and "objects" are checked field by field below (and "pieces" entry by entry on demand):
        # the generic nesting walk is for "values", whose depth our decoders recurse into.
        doc = load_json(data, where, checked_by_caller=("pieces", "objects"))
        check_header(doc, INDEX_FORMAT, where, (INDEX_VERSION,))
        rank = as_int(doc.get("rank"), f"{where}: rank", minimum=0, maximum=MAX_WORLD)
        block = as_int(doc.get("block"), f"{where}: block", minimum=1)
        objects: dict[str, int] = {}
        for item in as_list(doc.get("objects"), f"{where}: objects"):
            if not isinstance(item, list) or len(item) != 2:
                raise ManifestError(f"{where}: malformed object entry {short(item)}")
            obj = check_object_key(item[0], where)
            if obj in objects:
                raise ManifestError(f"{where}: object {obj!r} is declared twice")
            objects[obj] = as_int(item[1], f"{where}: object size", minimum=0)
        pieces = as_list(doc.get("pieces"), f"{where}: pieces")
        positions = _check_pieces(pieces, objects, where)
        values = as_dict(doc.get("values", {}), f"{where}: values")
        index = Index(rank, block, objects, [], values, doc["version"])
        index.where = where
        index._entries, index._pieces, index._positions = None, pieces, positions
        return index


def _check_pieces(pieces: list, objects: dict[str, int], where: str) -> dict[str, list[int]]:
    """The whole-file checks of the entries: each is an 8-field list naming a tensor, inside a declared
    object, and no two share bytes. Returns each tensor's entry positions."""
    positions: dict[str, list[int]] = {}
    spans = []
    for pos, item in enumerate(pieces):
        if type(item) is not list or len(item) != PIECE_FIELDS:
            raise ManifestError(f"{where}: malformed piece entry")
        tensor, obj, offset, nbytes = item[0], item[4], item[5], item[6]
        if type(tensor) is not str:
            raise ManifestError(f"{where}: piece tensor key must be a string")
        size = objects.get(obj) if type(obj) is str else None
        if not (size is not None and type(offset) is int and type(nbytes) is int
                and offset >= 0 and nbytes >= 0 and offset + nbytes <= size):
            _refuse_range(tensor, obj, offset, nbytes, objects, where)
        positions.setdefault(tensor, []).append(pos)
        if nbytes:
            spans.append((obj, offset, offset + nbytes, tensor))
    spans.sort()
    for (o1, _, end1, t1), (o2, start2, _, t2) in zip(spans, spans[1:]):
        if o1 == o2 and start2 < end1:
            raise ManifestError(f"{where}: pieces of {t1!r} and {t2!r} overlap in object {o1!r}")
    return positions


def _refuse_range(tensor: str, obj: Any, offset: Any, nbytes: Any, objects: dict[str, int], where: str) -> NoReturn:
    """The error for an entry whose object or byte range the fast check refused (raises)."""
    obj = check_object_key(obj, f"{where}: tensor {tensor!r}")
    if obj not in objects:
        raise ManifestError(f"{where}: tensor {tensor!r} points into undeclared object {obj!r}")
    offset = as_int(offset, f"{where}: offset", minimum=0)
    nbytes = as_int(nbytes, f"{where}: nbytes", minimum=0)
    raise ManifestError(
        f"{where}: tensor {tensor!r} bytes [{offset}, {offset + nbytes}) exceed object {obj!r} of {objects[obj]} bytes"
    )
