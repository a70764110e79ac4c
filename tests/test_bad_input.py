"""Bad input gets a ckptkit error naming what is wrong, and loses nothing."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch

import ckptkit
from tests.ckpt_files import data_object, edit_index, edit_manifest, index_file


def make_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).to(torch.bfloat16)},
        "step": 7,
    }


def zeros_like_state(state: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0}


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "step-1"
    state = make_state()
    ckptkit.save(state, path)
    return path, state


def untouched(state: dict) -> bool:
    return all(torch.count_nonzero(v) == 0 for v in state["model"].values()) and state["step"] == 0


def test_round_trip_baseline(ckpt):
    path, state = ckpt
    target = zeros_like_state(state)
    ckptkit.load(target, path)
    assert torch.equal(target["model"]["w"], state["model"]["w"])
    assert torch.equal(target["model"]["b"], state["model"]["b"])
    assert target["step"] == 7


def test_missing_checkpoint(tmp_path):
    target = zeros_like_state(make_state())
    with pytest.raises(ckptkit.CheckpointNotFoundError, match="no checkpoint at .*nowhere"):
        ckptkit.load(target, tmp_path / "nowhere")
    assert untouched(target)


def test_uncommitted_checkpoint_is_never_loaded(ckpt):
    path, state = ckpt
    os.remove(path / "manifest.json")
    target = zeros_like_state(state)
    with pytest.raises(ckptkit.UncommittedCheckpointError, match="no committed manifest"):
        ckptkit.load(target, path)
    assert untouched(target)


def test_unknown_manifest_version(ckpt):
    path, state = ckpt
    edit_manifest(path, lambda d: d.update(version=99))
    with pytest.raises(ckptkit.UnsupportedVersionError, match="version 99 is not supported"):
        ckptkit.load(zeros_like_state(state), path)


def test_malformed_manifest(ckpt):
    path, state = ckpt
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(ckptkit.ManifestError, match="manifest.json: not valid JSON"):
        ckptkit.load(zeros_like_state(state), path)
    edit_json_doc = {"format": "ckptkit", "version": 1, "world_size": 1, "tensors": {"w": {"dtype": "float99"}},
                     "indexes": [[0, "index/rank-00000.json", 10, "0" * 64]]}
    (path / "manifest.json").write_text(json.dumps(edit_json_doc))
    with pytest.raises(ckptkit.ManifestError, match="tensor 'w': unknown dtype 'float99'"):
        ckptkit.load(zeros_like_state(state), path)


def test_truncated_data_object_is_caught_before_touching_the_state(ckpt):
    path, state = ckpt
    data = data_object(path)
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size - 10)
    target = zeros_like_state(state)
    with pytest.raises(ckptkit.CorruptCheckpointError, match=r"rank-00000-[0-9a-f]{12}.bin \(written by rank 0\) is truncated"):
        ckptkit.load(target, path)
    assert untouched(target)


def test_corrupt_byte_fails_checksum_and_names_tensor(ckpt):
    path, state = ckpt
    data = data_object(path)
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF  # inside model/w (the first piece)
    data.write_bytes(bytes(raw))
    with pytest.raises(ckptkit.CorruptCheckpointError, match=r"checksum mismatch .* tensor 'model/w'.*partially overwritten"):
        ckptkit.load(zeros_like_state(state), path)


@pytest.mark.parametrize("bad", ["../evil.json", "/etc/passwd", "index/../../x.json", "index//x.json"])
def test_manifest_key_outside_checkpoint_is_refused(ckpt, bad):
    path, state = ckpt
    edit_manifest(path, lambda d: d["indexes"][0].__setitem__(1, bad))
    with pytest.raises(ckptkit.UnsafePathError, match="not a plain relative path inside the checkpoint"):
        ckptkit.load(zeros_like_state(state), path)


def test_index_object_key_outside_checkpoint_is_refused(ckpt, tmp_path):
    path, state = ckpt
    (tmp_path / "secret.bin").write_bytes(b"x" * 4096)
    def evil(doc):
        doc["objects"][0][0] = "../secret.bin"
        for p in doc["pieces"]:
            p[4] = "../secret.bin"

    edit_index(path, evil)
    target = zeros_like_state(state)
    with pytest.raises(ckptkit.UnsafePathError, match=r"'\.\./secret\.bin'"):
        ckptkit.load(target, path)
    assert untouched(target)


def test_tampered_index_fails_digest(ckpt):
    path, state = ckpt
    edit_index(path, lambda d: d["pieces"][0].__setitem__(5, 0), reseal=False)
    with pytest.raises(ckptkit.CorruptCheckpointError, match="does not match the manifest's digest"):
        ckptkit.load(zeros_like_state(state), path)


def test_tensor_missing_from_checkpoint(ckpt):
    path, state = ckpt
    target = zeros_like_state(state)
    target["model"]["extra"] = torch.zeros(3)
    with pytest.raises(ckptkit.MissingKeysError, match="'model/extra'.*strict=False"):
        ckptkit.load(target, path)
    assert untouched(target)
    result = ckptkit.load(target, path, strict=False)
    assert result.missing == ("model/extra",)
    assert torch.equal(target["model"]["w"], state["model"]["w"])


def test_tensor_in_checkpoint_not_in_state(ckpt):
    path, state = ckpt
    target = zeros_like_state(state)
    del target["model"]["b"]
    with pytest.raises(ckptkit.UnexpectedKeysError, match="'model/b'"):
        ckptkit.load(target, path)
    assert untouched({"model": target["model"], "step": target["step"]})
    result = ckptkit.load(target, path, strict=False)
    assert result.unexpected == ("model/b",)


def test_dtype_mismatch(ckpt):
    path, state = ckpt
    target = zeros_like_state(state)
    target["model"]["b"] = torch.zeros(32, dtype=torch.float32)
    with pytest.raises(ckptkit.DTypeMismatchError, match="'model/b' is bfloat16 in the checkpoint, the state expects float32"):
        ckptkit.load(target, path)
    assert untouched(target)


def test_shape_mismatch(ckpt):
    path, state = ckpt
    target = zeros_like_state(state)
    target["model"]["w"] = torch.zeros(64, 31)
    with pytest.raises(ckptkit.ShapeMismatchError, match=r"'model/w' has global shape \[64, 32\].*expects \[64, 31\]"):
        ckptkit.load(target, path)
    assert untouched(target)


def explicit_state(full: torch.Tensor) -> dict:
    """A tensor declared as two row blocks held in one local buffer."""
    local = full.clone()
    pieces = [
        ckptkit.box_piece("t", (8, 4), (0, 0), (5, 4)),
        ckptkit.box_piece("t", (8, 4), (5, 0), (3, 4), local_offsets=(5, 0)),
    ]
    return {"t": ckptkit.Sharded(local, pieces)}


def test_target_not_covered_by_stored_pieces(tmp_path):
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    ckptkit.save(explicit_state(full), tmp_path / "c")

    def drop_piece(doc):
        doc["tensors"]["t"]["layout"]["pieces"].pop()

    edit_manifest(tmp_path / "c", drop_piece)
    target = {"t": torch.zeros(8, 4)}
    with pytest.raises(ckptkit.CoverageError, match="tensor 't': stored pieces hold 20 elements.*some elements are missing \\(the manifest is damaged\\)"):
        ckptkit.load(target, tmp_path / "c")
    assert torch.count_nonzero(target["t"]) == 0


def test_incomplete_declaration_fails_the_save_and_commits_nothing(tmp_path):
    local = torch.ones(5, 4)
    state = {"t": ckptkit.Sharded(local, [ckptkit.box_piece("t", (8, 4), (0, 0), (5, 4))])}
    with pytest.raises(ckptkit.SaveError, match="tensor 't'.*some elements are missing"):
        ckptkit.save(state, tmp_path / "c")
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_overlapping_declaration_fails_the_save(tmp_path):
    local = torch.ones(8, 4)
    pieces = [ckptkit.box_piece("t", (8, 4), (0, 0), (5, 4)), ckptkit.box_piece("t", (8, 4), (3, 0), (5, 4), local_offsets=(3, 0))]
    with pytest.raises(ckptkit.SaveError, match="tensor 't'.*overlap"):
        ckptkit.save({"t": ckptkit.Sharded(local, pieces)}, tmp_path / "c")


@pytest.mark.parametrize("rule", [ckptkit.PartitionRule(tp_axis=2), ckptkit.PartitionRule(expert_axis=5, num_experts=4),
                                  ckptkit.PartitionRule(tp_axis=0, fused=(3, 3))])
def test_a_rule_that_does_not_fit_its_tensor_fails_the_save(tmp_path, rule):
    """It committed, and every reshard of the checkpoint failed later (found by a hunt, 2026-12-06)."""
    local = torch.ones(8, 4)
    with pytest.raises(ckptkit.SaveError, match="tensor 't': its partition rule does not fit it"):
        ckptkit.save({"t": ckptkit.Sharded(local, [ckptkit.box_piece("t", (8, 4), (0, 0), (8, 4))], rule=rule)},
                     tmp_path / "c")
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_experts_of_a_zero_dim_tensor_are_refused():
    with pytest.raises(ckptkit.LayoutError, match="Experts axis 0 is outside a tensor of shape"):
        ckptkit.Experts(torch.tensor(3.0))


def test_piece_outside_local_tensor_is_refused():
    with pytest.raises(ckptkit.LayoutError, match="does not fit the local tensor of shape \\[4, 4\\]"):
        ckptkit.Sharded(torch.zeros(4, 4), [ckptkit.box_piece("t", (8, 4), (0, 0), (5, 4))])


def test_existing_checkpoint_is_never_overwritten(ckpt):
    path, state = ckpt
    other = make_state()
    other["model"]["w"] += 1
    with pytest.raises(ckptkit.SaveError, match="already holds a committed checkpoint"):
        ckptkit.save(other, path)
    target = zeros_like_state(state)
    ckptkit.load(target, path)
    assert torch.equal(target["model"]["w"], state["model"]["w"])


def test_leftovers_of_a_crashed_save_are_removed_once_the_new_one_commits(ckpt, tmp_path):
    path, state = ckpt
    crashed = tmp_path / "crashed"
    shutil.copytree(path, crashed)
    os.remove(crashed / "manifest.json")
    (crashed / "data" / "rank-00007.bin").write_bytes(b"junk")  # from a crashed save at a larger world
    (crashed / "index" / "rank-00007.json.tmp-99-abc").write_bytes(b"{")
    ckptkit.save(state, crashed)
    assert not (crashed / "data" / "rank-00007.bin").exists()
    assert [p.name for p in (crashed / "index").iterdir()] == [index_file(crashed).name]
    assert [p.name for p in (crashed / "data").iterdir()] == [data_object(crashed).name]
    target = zeros_like_state(state)
    ckptkit.load(target, crashed)
    assert torch.equal(target["model"]["w"], state["model"]["w"])


def test_unsupported_value_is_refused_with_its_key(tmp_path):
    state = make_state()
    state["cfg"] = {"fn": object()}
    with pytest.raises(ckptkit.SaveError, match="state key 'cfg/fn': cannot store a value of type object"):
        ckptkit.save(state, tmp_path / "c")
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_load_and_inspection_never_unpickle(ckpt, monkeypatch):
    path, state = ckpt

    def refuse(*_a, **_k):
        raise AssertionError("unpickling on a ckptkit load path")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    target = zeros_like_state(state)
    ckptkit.load(target, path)
    assert torch.equal(target["model"]["w"], state["model"]["w"])


def test_saving_onto_a_run_directory_refuses_and_deletes_nothing(ckpt):
    path, state = ckpt
    run = path.parent
    (run / "notes.txt").write_text("keep me")
    with pytest.raises(ckptkit.SaveError, match="holds files ckptkit did not write .*step-1/manifest.json"):
        ckptkit.save(state, run)
    assert (run / "notes.txt").read_text() == "keep me"
    target = zeros_like_state(state)
    ckptkit.load(target, path)
    assert torch.equal(target["model"]["w"], state["model"]["w"])
