"""XOR parity with distributed shares, a window at a time: rebuilding any one lost member gives back
its bytes exactly, and a rebuild's output is committed only when it is whole and matches its digest."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.errors import CorruptCheckpointError
from ckptkit.memory import digest, parity
from ckptkit.memory.bundle import MAGIC, BundleBytes
from ckptkit.memory.node_folder import NodeFolder
from ckptkit.storage.local import LocalStore
from tests.test_memory_bundle import blob_of, errors_within

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.float64]


def _tensor_bytes(dtype: torch.dtype, n: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 256, (n * torch.tensor([], dtype=dtype).element_size(),), dtype=torch.uint8, generator=g)
    return t.view(dtype).view(torch.uint8).numpy().tobytes()


def _raw(blob: bytes) -> BundleBytes:
    """Any byte string read the way the parity code reads a bundle (as its "header", no files)."""
    return BundleBytes(blob, [])


def encode(blobs: list, c: int, window: int = parity.WINDOW, *, recycled: bool = False) -> list[bytearray]:
    """Every member's share at once, walking each member's side of the parity rounds as the tier does:
    the first round's windows stored, the others XORed. ``recycled``: the shares start as junk (a
    spare file's former bytes) instead of zeros, which the first round must leave no trace of."""
    g = len(blobs)
    shares = [bytearray(random.Random(j).randbytes(c)) if recycled else bytearray(c) for j in range(g)]
    buf = bytearray(min(window, c) if c else 0)
    # round by round, as the rounds run (a member receives round t's windows before round t + 1's)
    rounds = sorted(((r.send_at // c, i, k), r) for i in range(g) for k, r in enumerate(parity.encode_rounds(i, g, c, window)))
    for (_, i, _), r in rounds:
        view = memoryview(buf)[: r.n]
        blobs[i].read_into(r.send_at, view)
        if r.first:
            memoryview(shares[r.to])[r.off:r.off + r.n] = view
        else:
            parity.xor_into(memoryview(shares[r.to])[r.off:r.off + r.n], view)
    return shares


def _rebuilt(lost: int, length: int, others: dict, shares: dict, g: int, c: int, window: int) -> bytes:
    """Member ``lost``'s bytes, walking the rebuild's windows as a restore does, with every input here."""
    parity.check_rebuild(lost, length, set(others) & set(shares), g, c)
    out = bytearray()
    acc, tmp = bytearray(min(window, c)), bytearray(min(window, c))
    for w in parity.rebuild_windows(lost, g, c, window):
        view = memoryview(acc)[: w.n]
        view[:] = memoryview(shares[w.share])[w.off:w.off + w.n]
        for i, at in zip(w.members, w.member_at):
            others[i].read_into(at, memoryview(tmp)[: w.n])
            parity.xor_into(view, memoryview(tmp)[: w.n])
        out += view[: max(0, min(w.n, length - w.at))]
    return bytes(out)


@settings(max_examples=150, deadline=None)
@given(g=st.integers(2, 7), window=st.integers(1, 12).map(lambda k: 8 * k), data=st.data())
def test_any_one_lost_member_is_rebuilt_exactly(g, window, data):
    blobs = [_tensor_bytes(data.draw(st.sampled_from(DTYPES)), data.draw(st.integers(0, 300)), seed=i)
             for i in range(g)]
    c = parity.chunk_len(max(len(b) for b in blobs), g)
    shares = encode([_raw(b) for b in blobs], c, window)
    assert all(len(s) == c for s in shares)
    assert sum(len(s) for s in shares) <= g * (max(len(b) for b in blobs) / (g - 1) + 8)
    # the windows change nothing: the same shares as one window per chunk
    assert shares == encode([_raw(b) for b in blobs], c, max(8, c))
    # nor do a recycled share's former bytes: the first round covers every share once, and all of it
    assert shares == encode([_raw(b) for b in blobs], c, window, recycled=True)
    for i in range(g):
        firsts = sorted((r.off, r.n) for r in parity.encode_rounds(i, g, c, window) if r.first)
        assert [off for off, _ in firsts] == list(itertools.accumulate([0] + [n for _, n in firsts[:-1]])) if firsts else c == 0
        assert sum(n for _, n in firsts) == c
    lost = data.draw(st.integers(0, g - 1))
    others = {i: _raw(blobs[i]) for i in range(g) if i != lost}
    got = _rebuilt(lost, len(blobs[lost]), others, {j: shares[j] for j in range(g) if j != lost}, g, c, window)
    assert got == blobs[lost]


@settings(max_examples=100, deadline=None)
@given(pieces=st.lists(st.binary(max_size=40), max_size=6), offset=st.integers(0, 300), n=st.integers(0, 100))
def test_a_bundle_read_at_any_offset_is_its_bytes_then_zeros(pieces, offset, n):
    blob = b"".join(pieces)
    bundle = BundleBytes(pieces[0] if pieces else b"", [memoryview(p) for p in pieces[1:]])
    assert bundle.length == len(blob) and bundle.digest() == digest.of(blob)
    out = bytearray(b"\xff" * n)
    bundle.read_into(offset, memoryview(out))
    assert bytes(out) == (blob[offset:offset + n] + bytes(n))[:n]


def test_a_missing_second_member_is_refused():
    blobs = [b"a" * 10, b"b" * 20, b"c" * 5]
    c = parity.chunk_len(20, 3)
    shares = encode([_raw(b) for b in blobs], c)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        _rebuilt(0, 10, {1: _raw(blobs[1])}, {1: shares[1], 2: shares[2]}, 3, c, parity.WINDOW)


def test_every_chunk_goes_to_another_member_once():
    for g in range(2, 9):
        for i in range(g):
            holders = [parity.holder_of(i, t, g) for t in range(g - 1)]
            assert sorted(holders) == sorted(set(range(g)) - {i})
            assert all(parity.chunk_index(i, h, g) == t for t, h in enumerate(holders))


def test_windows_cover_a_chunk_once_and_refuse_odd_sizes():
    assert list(parity.windows(40, 16)) == [(0, 16), (16, 16), (32, 8)]
    for bad in (0, 12, -8):
        with pytest.raises(ValueError):
            list(parity.windows(40, bad))


def _feed(sink, blob: bytes, cuts: list[int]) -> None:
    at = 0
    for cut in sorted(cuts) + [len(blob)]:
        sink.feed(memoryview(blob)[at:max(at, cut)])
        at = max(at, cut)


def _sink(folder: NodeFolder, blob: bytes, length: int | None = None):
    return folder.rebuilt(7, 2, len(blob) if length is None else length, digest.of(blob))


@settings(max_examples=300, deadline=None)
@given(blob=st.binary(max_size=400), cuts=st.lists(st.integers(0, 400), max_size=5))
def test_hostile_rebuilt_bytes_are_refused_cleanly(tmp_path_factory, blob, cuts):
    """Whatever bytes a rebuild yields (fed in any pieces), the sink commits a folder inside its own
    rank folder or refuses with CorruptCheckpointError, and a refusal commits nothing."""
    root = tmp_path_factory.mktemp("node")
    folder = NodeFolder(str(root / "mem"))
    try:
        with _sink(folder, blob) as sink:
            _feed(sink, blob, cuts)
            store = sink.commit()
    except CorruptCheckpointError:
        assert folder.ranks_at(7) == []
    else:
        assert store.root == folder.rank_store(7, 2).root
    assert sorted(os.listdir(root)) == ["mem"]


@pytest.mark.parametrize("name", ["../escape", "/abs", "a/../../b", "", "a//b"])
def test_rebuilt_names_outside_the_folder_are_refused(tmp_path, name):
    header = json.dumps({"files": [[name, 1], ["manifest.json", 2]]}).encode()
    blob = MAGIC + struct.pack("<Q", len(header)) + header + b"x{}"
    with pytest.raises(CorruptCheckpointError, match="outside its folder"):
        with _sink(NodeFolder(str(tmp_path / "node")), blob) as sink:
            sink.feed(blob)
    assert not (tmp_path / "escape").exists() and not (tmp_path / "node" / "escape").exists()


def test_a_header_whose_sizes_do_not_add_up_makes_no_file(tmp_path):
    header = json.dumps({"files": [["data", 1 << 40], ["manifest.json", 2]]}).encode()
    blob = MAGIC + struct.pack("<Q", len(header)) + header + b"x{}"
    folder = NodeFolder(str(tmp_path / "node"))
    with pytest.raises(CorruptCheckpointError, match="do not add up"):
        with _sink(folder, blob) as sink:
            sink.feed(blob)
    assert not os.path.exists(folder.rank_store(7, 2).root)


def test_rebuilt_round_trip_truncation_and_a_wrong_digest(tmp_path):
    src = tmp_path / "src"
    ckptkit.save({"w": torch.arange(1000, dtype=torch.float32), "n": 3}, str(src))
    blob = blob_of(LocalStore(str(src)))
    folder = NodeFolder(str(tmp_path / "node"))
    with _sink(folder, blob) as sink:
        _feed(sink, blob, [3, 17, len(blob) // 2])
        store = sink.commit()
    assert ckptkit.verify(store.url).ok and blob_of(store) == blob
    folder.remove_rank(7, 2)
    for cut in (0, 5, len(blob) // 2, len(blob) - 1):  # cut short: never committed
        with pytest.raises(CorruptCheckpointError):
            with _sink(folder, blob) as sink:
                sink.feed(memoryview(blob)[:cut])
                sink.commit()
        assert folder.ranks_at(7) == []
    flipped = bytearray(blob)
    flipped[-10] ^= 1  # inside the manifest: a digest mismatch, caught before the manifest is written
    for expected in (digest.of(blob), hashlib.sha256(blob).hexdigest()):  # block CRCs; version 1's SHA-256
        with pytest.raises(CorruptCheckpointError, match="digest"):
            with folder.rebuilt(7, 2, len(blob), expected) as sink:
                sink.feed(bytes(flipped))
                sink.commit()
        assert folder.ranks_at(7) == []
    with folder.rebuilt(7, 2, len(blob), hashlib.sha256(blob).hexdigest()) as sink:  # a version 1 digest still holds
        sink.feed(blob)
        assert blob_of(sink.commit()) == blob
    folder.remove_rank(7, 2)
    with pytest.raises(CorruptCheckpointError, match="more than"):
        with _sink(folder, blob) as sink:
            sink.feed(blob + b"\0")


@pytest.mark.parametrize("what", ["header", "bytes", "link"])
def test_a_hostile_share_is_refused_at_once(tmp_path, what):
    """A FIFO (or a link out of the folder) in place of a share's header or bytes: refused with a clear
    error, never waited on (a FIFO's open and read block for ever)."""
    from ckptkit.errors import CkptkitError
    from ckptkit.memory.node_folder import ShareHeader

    folder = NodeFolder(str(tmp_path / "node"))
    step = folder.step_path(3)
    os.makedirs(step)
    header = ShareHeader(3, (0, 1, 2), 1, 8, (8, 8, 8), ("0" * 64,) * 3, "0" * 64)
    json_path, bin_path = os.path.join(step, "share-00001.json"), os.path.join(step, "share-00001.bin")
    if what == "header":
        os.mkfifo(json_path)
    else:
        with open(json_path, "wb") as f:
            f.write(header.to_json())
        if what == "bytes":
            os.mkfifo(bin_path)
        else:
            (tmp_path / "outside").write_bytes(b"x" * 8)
            os.symlink(tmp_path / "outside", bin_path)
    errors = errors_within([lambda: folder.check_share(3, 1), lambda: folder.open_share(3, 1)], CkptkitError)
    assert len(errors) == 2, errors
