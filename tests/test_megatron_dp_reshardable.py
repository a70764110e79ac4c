"""The import of Megatron's default distributed-optimizer form, ``dp_reshardable``, over what one real job cannot vary.

Megatron's own saves (tests/test_megatron.py) show the import equals the model-space form bit for bit and resumes;
here tests/dp_reshardable_sim.py lays buckets out by Megatron's rules with everything the walk must not depend on
varied by hypothesis: parameter order, bucket count, where DP ranks split parameters, bf16/fp16 casts, gaps holding
copies of their neighbours' values. Then the damage a checkpoint folder can carry, each refused by name before
anything is committed, and equal weights, which are imported only where it cannot matter which is which.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.errors import CkptkitError
from ckptkit.layout.box import Box
from ckptkit_converters.dcp.files import Chunk, OutTensor
from ckptkit_converters.megatron.importer import import_torch_dist
from tests import dp_reshardable_sim as sim

FIX = "--dist-ckpt-optim-fully-reshardable"


def _imported(folder: Path) -> dict[str, torch.Tensor]:
    view = ckptkit.open(str(folder))
    return {k: view[k].read() for k in view.keys()}


def _check(s: sim.Sim, root: Path) -> None:
    src = sim.write(s, root / "torch_dist")
    result = import_torch_dist(str(src), str(root / "out"))
    got, want = _imported(root / "out"), sim.expected(s)
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert result.skipped == ()
    meta = result.meta["optimizer"]
    assert meta["main"] and meta["tensor_states"] == ["exp_avg", "exp_avg_sq"]
    assert meta["scalars"]["step"]["value"] == s.step


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tp=st.sampled_from([1, 2, 4]), dp=st.integers(1, 5), layers=st.integers(1, 3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       order=st.none() | st.integers(0, 1000), bucket_size=st.none() | st.integers(64, 700),
       gap_fill=st.sampled_from(["random", "copies"]), seed=st.integers(0, 1000))
def test_any_bucket_layout_imports_every_state_of_every_weight(tmp_path_factory, tp, dp, layers, dtype, order,
                                                                 bucket_size, gap_fill, seed):
    """Whatever the order, bucketing, DP split and dtype: every weight gets its own main copy and moments."""
    _check(sim.Sim(tp=tp, dp=dp, layers=layers, dtype=dtype, order=order, bucket_size=bucket_size,
                   gap_fill=gap_fill, seed=seed), tmp_path_factory.mktemp("dp"))


def test_equal_weights_with_equal_states_import(tmp_path):
    """Norms equal to each other (untrained, or bf16 for many steps) with equal states: any placement is right."""
    _check(sim.Sim(equal=(sim.QKV_NORM, sim.FC1_NORM), equal_states=True, dtype=torch.bfloat16), tmp_path)


@pytest.mark.parametrize("form", ["dp_reshardable", "fully_reshardable"])
def test_a_chained_optimizers_part_imports_in_either_form(tmp_path, form):
    """An MoE job's dense or expert optimizer, saved with the ``chained_<i>.`` prefix Megatron adds to the
    buckets (and to the model-space form when ``chained_optim_avoid_prefix`` is off)."""
    _check(sim.Sim(chain="chained_1.", form=form), tmp_path)


def _refused(s: sim.Sim, root: Path, *needles: str) -> str:
    """The import fails with an error naming what is wrong, and leaves nothing at its destination."""
    src = sim.write(s, root / "torch_dist")
    with pytest.raises(CkptkitError) as err:
        import_torch_dist(str(src), str(root / "out"))
    message = str(err.value)
    for needle in needles:
        assert needle in message, message
    assert not (root / "out").exists() or not os.listdir(root / "out")
    return message


@pytest.mark.parametrize("tp, dp, layers, bucket_size", [(2, 2, 2, None), (1, 3, 3, None), (4, 1, 2, 400)])
def test_equal_weights_with_different_states_are_told_apart_by_the_saved_key_order(tmp_path, tp, dp, layers,
                                                                                   bucket_size):
    """Every norm equal (bf16 early in a run) with its own moments: Megatron's buckets run in the reverse of the
    registration order the checkpoint's key order records, which the other parameters confirm; each norm's slot
    lies between its layer's neighbours. Every norm gets its own state."""
    _check(sim.Sim(tp=tp, dp=dp, layers=layers, bucket_size=bucket_size, dtype=torch.bfloat16,
                   equal=(sim.QKV_NORM, sim.FC1_NORM)), tmp_path)


def test_equal_weights_in_a_bucket_that_does_not_follow_the_key_order_are_refused(tmp_path):
    """Which state is whose is then not in the checkpoint: refused, naming the weights and the fix, never guessed."""
    _refused(sim.Sim(equal=(sim.QKV_NORM, sim.FC1_NORM), order=7), tmp_path, sim.QKV_NORM, sim.FC1_NORM, sim.FINAL,
             "key order", FIX)


def _param_of(bucket, key):
    return next((start, end) for start, end, k, _ in bucket if k == key)


def _change_main(key):
    def hook(state, group, index, bucket, flat):
        if state == "param" and group == 0 and index == 0:
            start, _ = _param_of(bucket, key)
            flat[start + 3] += 0.5
    return hook


def _garbage_main(key, groups=(0,)):
    def hook(state, group, index, bucket, flat):
        if state == "param" and group in groups and index == 0:
            start, end = _param_of(bucket, key)
            flat[start:end] = torch.randn(end - start) + 11
    return hook


def _bucket(tensors, state):
    return next(i for i, t in enumerate(tensors) if t.fqn.endswith(f"bucket_idx_0.{state}") and "idx_0." in t.fqn)


def _merge_chunks(tensors, items, files):
    i = _bucket(tensors, "exp_avg")
    a, b, *rest = tensors[i].chunks
    tensors[i] = dataclasses.replace(tensors[i], chunks=(Chunk(Box(a.box.offsets, (a.box.sizes[0] + b.box.sizes[0],)),
                                                               a.blob), *rest))


def _drop_state(state):
    def hook(tensors, items, files):
        del tensors[_bucket(tensors, state)]
    return hook


def _rename_state(tensors, items, files):
    i = _bucket(tensors, "exp_avg_sq")
    fqn = tensors[i].fqn.replace("exp_avg_sq", "exp_avg_cubed")
    tensors[i] = dataclasses.replace(tensors[i], fqn=fqn, path=(fqn,))


def _overlap(tensors, items, files):
    for i, t in enumerate(tensors):
        if "optimizer.distributed" in t.fqn:
            c = t.chunks[1]
            moved = Chunk(Box((c.box.offsets[0] - 1,), c.box.sizes), c.blob)
            tensors[i] = dataclasses.replace(t, chunks=(t.chunks[0], moved, *t.chunks[2:]))


def _model_space_too(tensors, items, files):
    emb = next(t for t in tensors if t.fqn == sim.EMB)
    fqn = f"optimizer.state.exp_avg.{sim.EMB}"
    tensors.append(OutTensor(fqn, (fqn,), emb.dtype, emb.shape, emb.chunks))


def _wrong_dtype(state, group, index, bucket, flat):
    if state == "param" and group == 0 and index == 0:
        flat.data = flat.data.to(torch.float64)  # saved as float64 where the metadata says float32


DAMAGE = {
    "a main copy changed": (dict(flat_hook=_change_main(sim.QKV)), ("match no weight", "bucket_idx_0", FIX)),
    "a parameter's main copy lost": (dict(flat_hook=_garbage_main(sim.FC2)), (sim.FC2, "not a whole optimizer", FIX)),
    "a replicated norm's main copy lost everywhere": (dict(flat_hook=_garbage_main(sim.FINAL, groups=(0, 1))),
                                                      (sim.FINAL, "no main copy", FIX)),
    "states chunked differently": (dict(metadata_hook=_merge_chunks), ("chunked differently",)),
    "no main copies": (dict(metadata_hook=_drop_state("param")), ("'param'",)),
    "an unknown state": (dict(metadata_hook=_rename_state), ("exp_avg_cubed",)),
    "overlapping chunks": (dict(metadata_hook=_overlap), ("do not tile",)),
    "groups disagree on the step": (dict(group_steps={1: 6.0}), ("different param groups",)),
    "both optimizer forms": (dict(metadata_hook=_model_space_too), ("saved twice",)),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_bucket_checkpoint_is_refused_by_name(tmp_path, case):
    options, needles = DAMAGE[case]
    _refused(sim.Sim(**options), tmp_path, *needles)


def test_a_replicated_norm_lost_in_one_tensor_parallel_group_comes_from_another(tmp_path):
    """A norm every TP rank holds, damaged in one rank's buckets: its state is the other rank's, as saved."""
    _check(sim.Sim(flat_hook=_garbage_main(sim.FINAL)), tmp_path)


def test_a_chunk_of_another_dtype_is_refused(tmp_path):
    """A blob that is not what the metadata says is named, not cast."""
    with pytest.raises(CkptkitError, match="float64"):
        src = sim.write(sim.Sim(flat_hook=_wrong_dtype), tmp_path / "torch_dist")
        import_torch_dist(str(src), str(tmp_path / "out"))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_a_flipped_bit_in_the_main_copies_is_refused_or_harmless(tmp_path_factory, seed, where, bit):
    """A bit flipped anywhere in a main-copy blob: the import refuses, or (the bit was in a gap or in the
    archive's slack) imports exactly what was saved. Never another parameter's state, never a crash."""
    root = tmp_path_factory.mktemp("flip")
    blobs = []

    def collect(tensors, items, files):
        blobs.extend(c.blob for t in tensors if t.fqn.endswith(".param") for c in t.chunks)
    s = sim.Sim(seed=seed, dp=3, metadata_hook=collect)
    src = sim.write(s, root / "torch_dist")
    blob = blobs[int(where * len(blobs))]
    path = src / blob.file
    data = bytearray(path.read_bytes())
    data[blob.offset + int(where * 7919) % blob.length] ^= 1 << bit
    path.write_bytes(bytes(data))
    try:
        import_torch_dist(str(src), str(root / "out"))
    except CkptkitError:
        return
    got, want = _imported(root / "out"), sim.expected(s)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_without_buckets_the_model_space_path_is_taken(tmp_path):
    """A torch_dist folder with no bucket tensors imports its weights alone, the groups' items listed as
    skipped: no walk, and no optimizer record claiming state it does not hold."""
    src = sim.write(sim.Sim(metadata_hook=lambda tensors, items, files: tensors.__setitem__(
        slice(None), [t for t in tensors if "optimizer" not in t.fqn])), tmp_path / "torch_dist")
    result = import_torch_dist(str(src), str(tmp_path / "out"))
    assert result.meta["optimizer"] is None
    assert result.skipped == ("optimizer.distributed.dp_group_idx_0.optimizer",
                              "optimizer.distributed.dp_group_idx_1.optimizer")
    assert not any(k.startswith("optimizer/") for k in _imported(tmp_path / "out"))
