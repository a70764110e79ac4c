"""XOR parity with distributed shares: rebuilding any one lost member gives back its bytes exactly."""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.errors import CorruptCheckpointError
from ckptkit.memory import parity
from ckptkit.memory.bundle import pack_bundle, unpack_bundle
from ckptkit.memory.node_folder import NodeFolder

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.float64]


def _tensor_bytes(dtype: torch.dtype, n: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 256, (n * torch.tensor([], dtype=dtype).element_size(),), dtype=torch.uint8, generator=g)
    return t.view(dtype).view(torch.uint8).numpy().tobytes()


@settings(max_examples=150, deadline=None)
@given(g=st.integers(2, 7), data=st.data())
def test_any_one_lost_member_is_rebuilt_exactly(g, data):
    blobs = [_tensor_bytes(data.draw(st.sampled_from(DTYPES)), data.draw(st.integers(0, 300)), seed=i)
             for i in range(g)]
    c = parity.chunk_len(max(len(b) for b in blobs), g)
    shares = parity.encode(blobs, c)
    assert all(s.numel() == c for s in shares)
    assert sum(s.numel() for s in shares) <= g * (max(len(b) for b in blobs) / (g - 1) + 8)
    lost = data.draw(st.integers(0, g - 1))
    others = {i: blobs[i] for i in range(g) if i != lost}
    got = parity.rebuild(lost, len(blobs[lost]), others, {j: shares[j] for j in range(g) if j != lost}, g, c)
    assert got == blobs[lost]


def test_a_missing_second_member_is_refused():
    blobs = [b"a" * 10, b"b" * 20, b"c" * 5]
    c = parity.chunk_len(20, 3)
    shares = parity.encode(blobs, c)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        parity.rebuild(0, 10, {1: blobs[1]}, {1: shares[1], 2: shares[2]}, 3, c)


def test_every_chunk_goes_to_another_member_once():
    for g in range(2, 9):
        for i in range(g):
            holders = [parity.holder_of(i, t, g) for t in range(g - 1)]
            assert sorted(holders) == sorted(set(range(g)) - {i})
            assert all(parity.chunk_index(i, h, g) == t for t, h in enumerate(holders))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_hostile_bundles_are_refused_cleanly(blob):
    try:
        files = unpack_bundle(blob, "fuzz")
    except CorruptCheckpointError:
        return
    for name, _ in files:
        assert not name.startswith("/") and ".." not in name.split("/")


@pytest.mark.parametrize("name", ["../escape", "/abs", "a/../../b", "", "a//b"])
def test_bundle_names_outside_the_folder_are_refused(tmp_path, name):
    import json
    import struct

    from ckptkit.memory.bundle import MAGIC

    header = json.dumps({"files": [[name, 1], ["manifest.json", 2]]}).encode()
    blob = MAGIC + struct.pack("<Q", len(header)) + header + b"x{}"
    with pytest.raises(CorruptCheckpointError, match="outside its folder"):
        NodeFolder(str(tmp_path)).write_bundle(1, 0, blob)
    assert not (tmp_path.parent / "escape").exists()


def test_bundle_round_trip_and_truncation(tmp_path):
    import ckptkit

    src = tmp_path / "src"
    ckptkit.save({"w": torch.arange(1000, dtype=torch.float32), "n": 3}, str(src))
    from ckptkit.storage.local import LocalStore

    blob = pack_bundle(LocalStore(str(src)))
    folder = NodeFolder(str(tmp_path / "node"))
    store = folder.write_bundle(7, 2, blob)
    assert ckptkit.verify(store.url).ok
    assert hashlib.sha256(pack_bundle(store)).hexdigest() == hashlib.sha256(blob).hexdigest()
    for cut in (0, 5, len(blob) // 2, len(blob) - 1):
        with pytest.raises(CorruptCheckpointError):
            unpack_bundle(blob[:cut], "cut")
