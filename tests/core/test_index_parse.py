"""A rank's index, parsed in two steps (ckptkit/layout/index.py): whole-file checks on read, each tensor's
entries when first asked for. Whatever a reader asks for comes back exactly as written or as a ManifestError
naming the file (and the tensor, for a per-entry defect); nothing a reader does not ask for is trusted, and
``entries`` (verify, describe, reshard) refuses every defect the old whole-file parse refused.

Pure Python: the layout core, no torch.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.errors import CkptkitError, ManifestError, UnsafePathError
from ckptkit.layout.box import Box, Region
from ckptkit.layout.index import Index, IndexEntry
from tests.conftest import trials

WHERE = "ckpt/index/rank-00003-x.json"
BLOCK = 64


@st.composite
def indexes(draw) -> Index:
    """A valid index: up to 6 tensors, each with up to 4 distinct pieces (some flat), packed into up to 3
    objects without sharing bytes, one CRC per block."""
    ntensors = draw(st.integers(0, 6))
    nobjects = draw(st.integers(1, 3))
    objects = {f"data/rank-00003-x-{i}.bin": 0 for i in range(nobjects)}
    names = list(objects)
    entries = []
    for t in range(ntensors):
        tensor = draw(st.sampled_from([f"model/layers.{t}.w", f"optim/state.{t}.exp_avg", f"t{t}"]))
        ndim = draw(st.integers(0, 3))
        regions = set()
        for _ in range(draw(st.integers(1, 4))):
            offsets = tuple(draw(st.integers(0, 9)) for _ in range(ndim))
            sizes = tuple(draw(st.integers(0, 5)) for _ in range(ndim))
            numel = 1
            for s in sizes:
                numel *= s
            flat = None
            if ndim and numel and draw(st.booleans()):
                a = draw(st.integers(0, numel - 1))
                flat = (a, draw(st.integers(a, numel)))
            regions.add(Region(Box(offsets, sizes), flat))
        for region in sorted(regions, key=lambda r: (r.box.offsets, r.box.sizes, r.flat or ())):
            obj = draw(st.sampled_from(names))
            nbytes = draw(st.integers(0, 300))
            offset = objects[obj] + draw(st.integers(0, 20))
            objects[obj] = offset + nbytes
            crcs = tuple(draw(st.integers(0, 0xFFFFFFFF)) for _ in range(max(1, -(-nbytes // BLOCK))))
            entries.append(IndexEntry(tensor, region, obj, offset, nbytes, crcs))
    order = draw(st.permutations(range(len(entries))))
    values = draw(st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3))
    return Index(3, BLOCK, objects, [entries[i] for i in order], values)


@settings(max_examples=trials(100, 2000), deadline=None)
@given(indexes(), st.data())
def test_a_parsed_index_gives_back_every_entry_as_written(index, data):
    parsed = Index.from_json_bytes(index.to_json_bytes(), WHERE)
    # asked tensor by tensor, in a random order, before or after the whole list
    if data.draw(st.booleans()):
        assert parsed.entries == index.entries
    for e in data.draw(st.permutations(index.entries)):
        assert parsed.entry(e.tensor, e.region) == e
    assert parsed.entries == index.entries and parsed == index
    assert (parsed.rank, parsed.block, parsed.objects, parsed.values) == (index.rank, index.block, index.objects,
                                                                          index.values)
    assert parsed.entry("no/such/tensor", Region(Box((), ()))) is None
    if index.entries:
        e = index.entries[0]
        other = Region(Box(tuple(o + 100 for o in e.region.box.offsets), e.region.box.sizes), e.region.flat)
        if other.key() not in {x.region.key() for x in index.entries if x.tensor == e.tensor}:
            assert parsed.entry(e.tensor, other) is None


def _doc() -> dict:
    """Two tensors, "a" (two pieces) and "b" (one), in one 400-byte object."""
    return {
        "format": "ckptkit-index", "version": 1, "rank": 3, "block": BLOCK,
        "objects": [["data/r3.bin", 400]],
        "pieces": [
            ["a", [0, 0], [2, 4], None, "data/r3.bin", 0, 32, [1]],
            ["b", [0], [16], None, "data/r3.bin", 100, 64, [2]],
            ["a", [2, 0], [2, 4], None, "data/r3.bin", 32, 32, [3]],
        ],
        "values": {"rng": "x"},
    }


def _with(edit) -> bytes:
    doc = _doc()
    edit(doc)
    return json.dumps(doc, separators=(",", ":")).encode()


def _piece(field: int, value):
    """Replace field ``field`` of b's piece."""
    return lambda d: d["pieces"][1].__setitem__(field, value)


# Defects of b's piece that need only that piece: refused when b is asked for, or all entries are.
PER_TENSOR = {
    "offsets-not-ints": (_piece(1, ["0"]), "expected a box"),
    "negative-size": (_piece(2, [-16]), "expected a box"),
    "ndim-mismatch-nested": (_piece(1, [[0]]), "expected a box"),
    "deep-nesting": (_piece(1, json.loads("[" * 150 + "]" * 150)), "expected a box"),
    "box-of-65-dims": (lambda d: d["pieces"][1].__setitem__(1, [0] * 65) or d["pieces"][1].__setitem__(2, [1] * 65),
                       "expected a box"),
    "flat-not-a-pair": (_piece(3, [0]), "expected a flat range"),
    "flat-a-bool": (_piece(3, [True, 4]), "expected a flat range"),
    "crcs-not-a-list": (_piece(7, 5), "crcs: expected a list"),
    "too-few-crcs": (_piece(7, []), "has 0 checksums for 64 bytes"),
    "too-many-crcs": (_piece(7, [1, 2]), "has 2 checksums for 64 bytes"),
    "crc-above-32-bits": (_piece(7, [1 << 32]), "crc: 4294967296 is above the limit"),
    "crc-a-float": (_piece(7, [1.5]), "crc: expected an integer"),
    "crc-huge": (_piece(7, [10**400]), "crc: an integer of 401 digits is above the limit"),
    "listed-twice": (lambda d: d["pieces"].append(["b", [0], [16], None, "data/r3.bin", 200, 64, [9]]),
                     r"piece \{'box': \[\[0\], \[16\]\]\} of tensor 'b' is listed twice"),
}

# Defects that the whole file is refused for, whichever tensor a reader asks for.
WHOLE_FILE = {
    "piece-not-a-list": (lambda d: d["pieces"].__setitem__(1, {"b": 1}), "malformed piece entry"),
    "piece-of-7-fields": (lambda d: d["pieces"][1].pop(), "malformed piece entry"),
    "tensor-not-a-string": (_piece(0, 7), "piece tensor key must be a string"),
    "undeclared-object": (_piece(4, "data/other.bin"), "points into undeclared object 'data/other.bin'"),
    "object-escapes": (_piece(4, "../../etc/passwd"), "is not a plain relative path"),
    "object-not-a-string": (_piece(4, ["data/r3.bin"]), "is not a plain relative path"),
    "negative-offset": (_piece(5, -1), "offset: -1 is below 0"),
    "offset-a-bool": (_piece(5, True), "offset: expected an integer, got True"),
    "nbytes-a-float": (_piece(6, 64.0), "nbytes: expected an integer, got 64.0"),
    "offset-huge": (_piece(5, 10**400), "offset: an integer of 401 digits is above the limit"),
    "past-the-object": (_piece(5, 380), r"bytes \[380, 444\) exceed object 'data/r3.bin' of 400 bytes"),
    "shares-bytes-with-a": (_piece(5, 40), "pieces of 'a' and 'b' overlap in object 'data/r3.bin'"),
    "lone-surrogate-tensor": (_piece(0, "\ud800"), "not valid Unicode"),
    "values-too-deep": (lambda d: d.__setitem__("values", {"v": json.loads("[" * 101 + "]" * 101)}),
                        "nested deeper than 100"),
    "pieces-deeper-than-json-allows": (_piece(1, "DEEP"), "nested too deeply"),
}


def _bytes_of(edit) -> bytes:
    data = _with(edit)
    if b'"DEEP"' in data:  # deeper than the JSON decoder's recursion allows
        data = data.replace(b'"DEEP"', b"[" * 100_000 + b"]" * 100_000)
    return data


A_FIRST = Region(Box((0, 0), (2, 4)))
B_PIECE = Region(Box((0,), (16,)))


@pytest.mark.parametrize("defect", list(PER_TENSOR))
def test_a_bad_entry_is_refused_when_its_tensor_is_asked_for_and_by_entries(defect):
    edit, message = PER_TENSOR[defect]
    index = Index.from_json_bytes(_bytes_of(edit), WHERE)
    assert index.entry("a", A_FIRST) == IndexEntry("a", A_FIRST, "data/r3.bin", 0, 32, (1,))  # a is unaffected
    assert index.values == {"rng": "x"}
    for ask in (lambda: index.entry("b", B_PIECE), lambda: index.entries):
        with pytest.raises(ManifestError, match=re.escape(WHERE) + ".*" + message):
            ask()
    assert index.entry("a", A_FIRST) is not None  # a failed ask for b spoils nothing else


@pytest.mark.parametrize("defect", list(WHOLE_FILE))
def test_a_whole_file_defect_is_refused_on_read(defect):
    edit, message = WHOLE_FILE[defect]
    with pytest.raises(CkptkitError, match=message) as info:
        Index.from_json_bytes(_bytes_of(edit), WHERE)
    assert isinstance(info.value, (ManifestError, UnsafePathError)) and WHERE in str(info.value)
    assert len(str(info.value)) < 400


def test_the_pristine_document_reads():
    index = Index.from_json_bytes(_with(lambda d: None), WHERE)
    assert [e.tensor for e in index.entries] == ["a", "b", "a"]
    assert index.entry("b", B_PIECE) == IndexEntry("b", B_PIECE, "data/r3.bin", 100, 64, (2,))


@settings(max_examples=trials(100, 2000), deadline=None)
@given(st.integers(0, 2), st.integers(0, 7),
       st.one_of(st.none(), st.booleans(), st.integers(-5, 500), st.integers(2**62, 2**70), st.floats(allow_nan=False),
                 st.text(max_size=4), st.lists(st.integers(-1, 20), max_size=3), st.just({"k": 1}),
                 st.just("data/r3.bin")))
def test_any_field_of_any_entry_replaced_reads_back_exactly_or_is_a_manifest_error(piece, field, value):
    """An edited entry (resealed, as a hostile writer would): every entry a reader gets equals the document's,
    and the first-step checks plus ``entries`` refuse what the old whole-file parse refused."""
    data = _with(lambda d: d["pieces"][piece].__setitem__(field, value))
    try:
        index = Index.from_json_bytes(data, WHERE)
        got = index.entries
    except (ManifestError, UnsafePathError) as exc:
        assert WHERE in str(exc)
        return
    doc = json.loads(data)
    assert [[e.tensor, list(e.region.box.offsets), list(e.region.box.sizes),
             list(e.region.flat) if e.region.flat else None, e.object, e.offset, e.nbytes, list(e.crcs)]
            for e in got] == doc["pieces"]
