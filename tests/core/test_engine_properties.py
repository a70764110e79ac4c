"""Property tests of the real byte movers: random layouts saved by the real writer, read back
through ``ReadSession.read_box`` and ``ckptkit.open``, compared with the generated tensors.

tests/core/test_plan_properties.py checks the planners against a simulator of the byte
movement; here nothing is simulated. Hypothesis draws a world of 1-4 ranks, a few tensors of
random shape and dtype, each laid out as a random grid (tests/core/strategies.py: meshes, shards
with explicit sizes and split factors, ``On``, padding, fused parts; a random rotation picks the
writing replica) or as random explicit pieces (boxes and flat fragments, replicas: one holder
writes), random bytes for every tensor, and a checksum block of 4096 x 1..3 bytes. The offline
writer (``write_offline``: the saver's own persist, merge and publish) writes every rank's pieces
into a real ``LocalStore``; then random boxes are read with ``ReadSession(store).read_box`` and
random numpy-style indexes (ints, slices with steps, negative ones) with ``ckptkit.open``, each
compared bit for bit with the expected tensor computed here by plain indexing. Last, one byte of
a stored piece is flipped: reading that tensor raises CorruptCheckpointError naming it, ``verify``
reports it, and every other tensor still reads exactly.
"""

from __future__ import annotations

import tempfile
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.engine.offline_writer import OfflineCheckpoint, OfflineWriteOptions, write_offline
from ckptkit.engine.read_session import ReadSession
from ckptkit.errors import CorruptCheckpointError
from ckptkit.layout.box import Box, Region
from ckptkit.layout.manifest import ExplicitLayout, TensorMeta
from ckptkit.storage.url import open_store
from tests.conftest import trials

from .strategies import explicit_world, grid_layouts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64,
          "int64": torch.int64, "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-size integer views: compare bits


def bits(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    return (t.view(torch.uint8) if t.dtype == torch.bool else t.view(BITS[t.element_size()])).numpy()


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes of every kind (nan payloads, subnormals, -0.0 included); bools 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    n = prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def cut(t: torch.Tensor, region: Region) -> torch.Tensor:
    """The stored elements of ``region``: the box, row-major; a flat range of its flattening 1-D.
    Always a fresh row-major tensor (``.contiguous()`` may keep a one-element view's odd stride,
    which the writer once refused: see the test at the end)."""
    part = t[tuple(slice(o, o + s) for o, s in zip(region.box.offsets, region.box.sizes))]
    if region.flat is not None:
        part = part.reshape(-1)[region.flat[0]:region.flat[1]]
    return torch.empty(part.shape, dtype=part.dtype).copy_(part)


@st.composite
def large_shapes(draw, lo: int = 1500, hi: int = 6000) -> tuple[int, ...]:
    """1-3 dimensions, ``lo`` to ``hi`` elements (up to 48 KiB: pieces span several checksum blocks)."""
    dims: list[int] = []
    for _ in range(draw(st.integers(0, 2))):
        dims.append(draw(st.integers(2, 24)))
    rest = prod(dims)
    dims.append(draw(st.integers(-(-lo // rest), hi // rest)))
    return tuple(draw(st.permutations(dims)))


shapes = st.lists(st.integers(1, 12), min_size=0, max_size=3).map(tuple) | large_shapes()


@st.composite
def tensor_layouts(draw, key: str, world: int) -> tuple[TensorMeta, list[tuple[int, Region]]]:
    """A tensor's manifest entry and its stored pieces ``(writer, region)``, from a random layout."""
    shape = draw(shapes)
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    if shape and draw(st.booleans()):
        held: dict[tuple, tuple[Region, list[int]]] = {}
        for rank, tensors in draw(explicit_world(key, shape, world)).items():
            for local in tensors:
                for piece in local.pieces:
                    held.setdefault(piece.region.key(), (piece.region, []))[1].append(rank)
        stored = [(draw(st.sampled_from(sorted(holders))), region) for region, holders in held.values()]
        meta = TensorMeta(key, dtype, shape, ExplicitLayout(tuple((r, w) for w, r in stored)))
        return meta, stored
    layout = draw(grid_layouts(shape, world))
    rotation = draw(st.integers(0, 3))
    stored = [(layout.writer_rank(cell, rotation), Region(box)) for box, cell in layout.all_boxes() if box.numel]
    return TensorMeta(key, dtype, shape, layout, rotation), stored


@st.composite
def checkpoints(draw) -> dict[str, Any]:
    world = draw(st.integers(1, 4))
    metas, stored, data = {}, {}, {}
    for i in range(draw(st.integers(1, 3))):
        key = f"t{i}/w"
        metas[key], stored[key] = draw(tensor_layouts(key, world))
        data[key] = random_tensor(metas[key].shape, DTYPES[metas[key].dtype], draw(st.integers(0, 2**31)))
    block = 4096 * draw(st.integers(1, 3))
    regions = [(m, r) for k, m in metas.items() for _, r in stored[k]]
    event(f"world {world}")
    event("grid and explicit" if len({type(m.layout) for m, _ in regions}) > 1 else "one kind of layout")
    event("flat fragments" if any(r.flat for _, r in regions) else "boxes only")
    nbytes = [r.numel * torch.empty((), dtype=DTYPES[m.dtype]).element_size() for m, r in regions]
    event("a piece spans checksum blocks" if any(n > block for n in nbytes) else "pieces within one block")
    return {"world": world, "metas": metas, "stored": stored, "data": data, "block": block}


class Slices:
    """One virtual rank's pieces, cut from the generated tensors (the writer asks in write order)."""

    def __init__(self, data: dict[str, torch.Tensor], items: list[tuple[str, Region]]) -> None:
        self.data, self.items, self.bytes_read = data, items, 0

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, ref: int) -> torch.Tensor:
        key, region = self.items[ref]
        return cut(self.data[key], region)


def write(path: Path, ck: dict[str, Any]) -> None:
    pieces: dict[int, list[tuple[str, Region]]] = {}
    for key, items in ck["stored"].items():
        for writer, region in items:
            pieces.setdefault(writer, []).append((key, region))
    write_offline(open_store(path), OfflineCheckpoint(ck["world"], ck["metas"], pieces, layouts=ck["metas"]),
                  lambda rank, items: Slices(ck["data"], list(items)), options=OfflineWriteOptions(block_size=ck["block"]))


@st.composite
def boxes(draw, shape: tuple[int, ...]) -> Box:
    offsets, sizes = [], []
    for n in shape:
        a = draw(st.integers(0, n))
        b = draw(st.integers(a, n))
        offsets.append(a)
        sizes.append(b - a)
    return Box(tuple(offsets), tuple(sizes))


@st.composite
def indexes(draw, shape: tuple[int, ...]) -> tuple:
    out: list[Any] = []
    for n in shape:
        kind = draw(st.sampled_from(["int", "slice", "slice", "all"]))
        if kind == "int":
            out.append(draw(st.integers(-n, n - 1)))
        elif kind == "all":
            out.append(slice(None))
        else:
            bound = st.none() | st.integers(-n - 2, n + 2)
            out.append(slice(draw(bound), draw(bound), draw(st.sampled_from([None, 1, 2, 3, -1, -2]))))
    return tuple(out)


FAST = settings(max_examples=trials(100, 1500), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(checkpoints(), st.data())
def test_random_layouts_read_back_bit_exact_through_the_real_reader(ck, data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        write(path, ck)
        session = ReadSession(open_store(path))
        view = ckptkit.open(path)
        for key, want in ck["data"].items():
            assert np.array_equal(bits(view[key][...]), bits(want)), key  # the whole tensor
            for _ in range(3):
                box = data.draw(boxes(tuple(want.shape)), label=f"box of {key}")
                got = session.read_box(key, box)
                assert tuple(got.shape) == box.sizes and got.dtype == want.dtype
                assert np.array_equal(bits(got), bits(cut(want, Region(box)))), (key, box)
                index = data.draw(indexes(tuple(want.shape)), label=f"index of {key}")
                assert np.array_equal(bits(view[key][index]), bits(want)[index]), (key, index)


@FAST
@given(checkpoints(), st.data())
def test_a_flipped_byte_in_a_stored_piece_is_caught_and_names_its_tensor(ck, data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        write(path, ck)
        session = ReadSession(open_store(path))
        entries = [e for idx in session.indexes(set(range(ck["world"]))).values() for e in idx.entries if e.nbytes]
        entry = data.draw(st.sampled_from(sorted(entries, key=lambda e: (e.object, e.offset))), label="piece")
        pos = entry.offset + data.draw(st.integers(0, entry.nbytes - 1), label="byte")
        flip = data.draw(st.integers(1, 255), label="xor")
        obj = path / entry.object
        raw = bytearray(obj.read_bytes())
        raw[pos] ^= flip
        obj.write_bytes(bytes(raw))
        key = entry.tensor
        shape = tuple(ck["metas"][key].shape)
        for read in (lambda: ReadSession(open_store(path)).read_box(key, Box.full(shape)),
                     lambda: ckptkit.open(path)[key][...]):
            try:
                read()
            except CorruptCheckpointError as exc:
                assert repr(key) in str(exc) and "checksum mismatch" in str(exc), str(exc)
            else:
                raise AssertionError(f"a flipped byte at {entry.object}[{pos}] in a piece of {key!r} was not caught")
        report = ckptkit.verify(path)
        assert not report.ok and any(key in str(p) for p in report.problems), report.problems
        view = ckptkit.open(path)
        for other, want in ck["data"].items():  # checksums are per piece: nothing else is touched
            if other != key:
                assert np.array_equal(bits(view[other][...]), bits(want)), other


def test_a_one_element_view_with_an_odd_stride_is_saved(tmp_path):
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.bfloat16)
    one = t[:, 0].reshape(-1)[:1]  # shape (1,), stride (3,)
    assert one.is_contiguous() and one.contiguous().stride() == (3,)
    ckptkit.save({"w": one}, tmp_path / "c")
    assert torch.equal(ckptkit.open(tmp_path / "c")["w"][...], one)
    target = torch.zeros(2, 3, dtype=torch.bfloat16)[:, 0].reshape(-1)[:1]  # loaded into such a view too
    ckptkit.load({"w": target}, tmp_path / "c")
    assert torch.equal(target, one)
