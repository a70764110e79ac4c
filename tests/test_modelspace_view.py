"""Lazy model-space views: random slices of checkpoints saved at several layouts (DTensor Shard(0),
Shard(1), FSDP x TP with _StridedShard, ZeRO and Megatron-style flat fragments) equal the same slice
of the full tensor, and read only the bytes (and indexes) the slice needs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.offline.view import SliceError, select, to_numpy
from tests import modelspace_job as job
from tests.ckpt_files import data_object

LAYOUTS = ("explicit", "fsdp", "fsdp_tp")


@pytest.fixture(scope="module")
def saved(worlds, tmp_path_factory):
    return job.saved_checkpoints(worlds, tmp_path_factory)


def as_bits(t: torch.Tensor) -> np.ndarray:
    """Element bits as integers, so comparisons are bit-exact for every dtype (bf16 included)."""
    size = t.element_size()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]).numpy()


@st.composite
def index_strategy(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple:
    """numpy-style indexes: ints (negative too), slices with any step and bounds, '...' and None."""
    items: list = []
    for n in shape:
        if n and draw(st.integers(0, 3)) == 0:
            items.append(draw(st.integers(-n, n - 1)))
        else:
            bound = st.integers(-n - 3, n + 3) | st.none()
            items.append(slice(draw(bound), draw(bound), draw(st.sampled_from([None, 1, 1, 2, 3, -1, -2, 5]))))
    if items and draw(st.booleans()):
        items = items[:draw(st.integers(0, len(items)))] + [Ellipsis]  # the trailing dims via '...'
    if draw(st.booleans()):
        items.insert(draw(st.integers(0, len(items))), None)
    return tuple(items)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_reads_equal_the_saved_tensors(saved, layout):
    path, ref = saved[layout]
    view = ckptkit.open(path)
    assert sorted(view.keys()) == sorted(ref)
    for key, expected in ref.items():
        got = view[key][...]
        assert got.dtype == expected.dtype and tuple(got.shape) == tuple(expected.shape), key
        assert np.array_equal(as_bits(got), as_bits(expected)), key


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_slices_equal_the_slice_of_the_full_tensor(saved, layout, data):
    path, ref = saved[layout]
    view = ckptkit.open(path)
    key = data.draw(st.sampled_from(sorted(ref)))
    expected = ref[key]
    index = data.draw(index_strategy(tuple(expected.shape)))
    got = view[key][index]
    want = as_bits(expected)[index]
    assert tuple(got.shape) == want.shape, (key, index)
    assert np.array_equal(as_bits(got.contiguous()), want), (key, index)


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple), data=st.data())
def test_index_selection_matches_numpy(shape, data):
    """The pure part alone, on many shapes: box + flips + post-index == numpy indexing."""
    full = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    index = data.draw(index_strategy(shape))
    sel = select(index, shape, "t")
    region = full[tuple(slice(o, o + s) for o, s in zip(sel.box.offsets, sel.box.sizes))]
    got = torch.from_numpy(np.array(region))  # a 0-d region stays 0-d
    if sel.flip:
        got = torch.flip(got, sel.flip)
    if sel.post:
        got = got[sel.post]
    assert np.array_equal(got.numpy(), full[index])


def test_a_slice_reads_only_its_blocks_and_indexes(saved):
    path, ref = saved["explicit"]
    view = ckptkit.open(path)
    rows = view["params/big"][130:132]  # 2 rows x 256 fp32 = 2 KiB, inside rank 1's shard [128, 256)
    assert torch.equal(rows, ref["params/big"][130:132])
    assert view.indexes_loaded == (1,)
    assert view.bytes_read <= 2 * job.BLOCK  # widened to whole 4 KiB checksum blocks, no more
    before = view.bytes_read
    col = view["params/wide"][:, 50]  # Shard(1): column 50 lives on rank 1 (33 columns each)
    assert torch.equal(col, ref["params/wide"][:, 50])
    assert view.indexes_loaded == (1,)
    assert view.bytes_read - before < ref["params/wide"].nbytes // 2
    frag = view["mega/exp_avg_sq/w"][13, 2:5]  # in TP box 1 (rows 12..23), DP fragment 0
    assert torch.equal(frag, ref["mega/exp_avg_sq/w"][13, 2:5])
    whole = sum(os.path.getsize(os.path.join(path, "data", f)) for f in os.listdir(os.path.join(path, "data")))
    assert view.bytes_read < whole / 20


def test_optimizer_state_and_values_are_visible(saved):
    path, ref = saved["fsdp_tp"]
    view = ckptkit.open(path)
    entries = {e.key: e for e in view.tensors("optim/state/*exp_avg_sq")}
    assert entries and all(e.dtype == "bfloat16" for e in entries.values())
    for key, e in entries.items():
        assert e.shape == tuple(ref[key].shape)
        assert e.nbytes == ref[key].numel() * 2
    explicit = ckptkit.open(saved["explicit"][0])
    assert explicit.values == {"train/step": 7, "train/sched/lr": 0.1, "train/sched/betas": (0.9, 0.95)}
    assert explicit.meta["user"] == {"run": "x"}
    assert explicit.per_rank_values(2)["loader"] == {"position": 2007}
    assert sorted(explicit.all_per_rank_values()) == [0, 1, 2, 3]
    assert explicit["scalar"][()].item() == job.full_tensor("scalar").item()
    assert explicit["params/tall"].numpy(slice(0, 2)).dtype.name == "bfloat16"
    np.testing.assert_array_equal(to_numpy(job.full_tensor("params/big")[:3]), explicit["params/big"].numpy(slice(0, 3)))


def test_clear_errors(saved, tmp_path):
    view = ckptkit.open(saved["explicit"][0])
    with pytest.raises(ckptkit.MissingKeysError, match=r"no tensor 'params/bigg'.*close matches: 'params/big'"):
        view["params/bigg"]
    with pytest.raises(ckptkit.MissingKeysError, match=r"'params/big'"):
        view["big"]  # suffix of a key: offered as a close match
    t = view["params/big"]
    with pytest.raises(SliceError, match=r"tensor 'params/big': index 512 is out of range for dimension 0 of size 512"):
        t[512]
    with pytest.raises(IndexError, match=r"has 2 dimension\(s\), the index has 3"):
        t[0, 0, 0]
    with pytest.raises(SliceError, match="step cannot be zero"):
        t[::0]
    with pytest.raises(SliceError, match="index of type list is not supported"):
        t[[1, 2]]
    with pytest.raises(SliceError, match="boolean masks"):
        t[True]
    assert t[600:700].shape == (0, 256)  # slices clamp, as in numpy
    with pytest.raises(ckptkit.UncommittedCheckpointError):
        os.makedirs(tmp_path / "half" / "data")
        ckptkit.open(tmp_path / "half")


def test_damaged_bytes_are_detected_by_the_slices_that_read_them(tmp_path):
    path = str(tmp_path / "c")
    w = torch.randn(64, 1024)  # 256 KiB: 64 checksum blocks of 4 KiB
    ckptkit.save({"w": w}, path, options=ckptkit.SaveOptions(block_size=4096))
    obj = data_object(path)
    with open(obj, "r+b") as f:
        f.seek(40 * 4096 + 10)  # inside row 40
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    view = ckptkit.open(path)
    assert torch.equal(view["w"][:39], w[:39])  # other blocks still read fine
    with pytest.raises(ckptkit.CorruptCheckpointError, match=r"checksum mismatch in data/rank-00000-[0-9a-f]{12}.bin.*'w'"):
        view["w"][40, :5]
