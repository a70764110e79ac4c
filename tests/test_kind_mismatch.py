"""A key that is one kind of thing in the checkpoint and another in the state never loads silently.

The class of defect: a plain value saved and loaded into a ``PerRank`` (or a generator), or the other
way round, loaded strict without a word and left the state's value as it was (the saved one was
never put anywhere); a generator's state loaded into a ``PerRank`` became a dict of base64. Now every
pair of kinds either loads exactly (the same kind) or fails naming the key and both kinds, and a
``strict=False`` load that leaves a key out says so in ``missing``. A missing key's error says what
the checkpoint holds under that name instead (a tensor, a value, a dict).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit import PerRank
from ckptkit.layout.box import Box
from ckptkit.layout.pieces import flat_piece
from tests.conftest import trials

KINDS = ("tensor", "value", "per_rank", "generator", "dict", "tensor_list", "sharded")


def make(kind: str, seed: int):
    """A leaf (or small subtree) of ``kind`` whose content depends on ``seed``."""
    if kind == "tensor":
        return torch.full((3,), float(seed))
    if kind == "value":
        return {"v": seed}["v"]
    if kind == "per_rank":
        return PerRank(seed)
    if kind == "generator":
        return torch.Generator().manual_seed(seed)
    if kind == "dict":
        return {"a": seed, "t": torch.full((2,), float(seed))}
    if kind == "tensor_list":
        return [torch.full((1,), float(seed)), torch.full((2,), float(seed))]
    return ckptkit.Sharded(torch.full((4,), float(seed)), [flat_piece("x", (4,), Box.full((4,)), 0, 4)])


def content(obj):
    """What a leaf holds, comparable across a load."""
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, PerRank):
        return ("per_rank", obj.value)
    if isinstance(obj, torch.Generator):
        return ("generator", obj.get_state().tolist())
    if isinstance(obj, ckptkit.Sharded):
        return ("sharded", obj.local.tolist())
    if isinstance(obj, dict):
        return {k: content(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [content(v) for v in obj]
    return obj


@settings(max_examples=trials(40, 300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(saved=st.sampled_from(KINDS), loaded=st.sampled_from(KINDS), strict=st.booleans())
def test_every_pair_of_kinds_loads_exactly_or_fails_naming_the_key(tmp_path_factory, saved, loaded, strict):
    folder = tmp_path_factory.mktemp("kinds") / "c"
    ckptkit.save({"anchor": torch.ones(1), "x": make(saved, 7)}, folder)
    state = {"anchor": torch.zeros(1), "x": make(loaded, 1)}
    before = content(state["x"])
    try:
        result = ckptkit.load(state, folder, strict=strict)
    except ckptkit.StateMismatchError as exc:
        assert saved != loaded, f"{saved} -> {loaded}: {exc}"
        assert "'x" in str(exc), exc
        assert content(state["x"]) == before  # refused before anything was put into the state
        return
    assert torch.equal(state["anchor"], torch.ones(1))
    if saved == loaded:
        assert content(state["x"]) == content(make(saved, 7)), f"{saved} loaded as {content(state['x'])}"
    else:  # only a strict=False load may leave it out, and it must say so
        assert not strict and content(state["x"]) == before, f"{saved} -> {loaded} loaded silently"
        assert any(k == "x" or k.startswith("x/") for k in result.missing), (saved, loaded, result.missing)


@pytest.mark.parametrize("saved,loaded,words", [
    ("value", "per_rank", "is a plain value in the checkpoint, the state holds a per-rank value"),
    ("per_rank", "value", "is a per-rank value in the checkpoint"),
    ("generator", "value", "is a per-rank value in the checkpoint"),
    ("value", "generator", "is a plain value in the checkpoint"),
    ("generator", "per_rank", "is a torch.Generator's state in the checkpoint"),
    ("per_rank", "generator", "is a ckptkit.PerRank value in the checkpoint"),
    ("tensor", "value", "'x' (a tensor in the checkpoint)"),
    ("value", "tensor", "'x' (a value in the checkpoint)"),
    ("dict", "value", "'x' (a dict or list in the checkpoint"),
])
def test_the_error_says_what_each_side_holds(tmp_path, saved, loaded, words):
    ckptkit.save({"x": make(saved, 7)}, tmp_path / "c")
    with pytest.raises(ckptkit.StateMismatchError, match=words.replace("(", r"\(").replace(")", r"\)")):
        ckptkit.load({"x": make(loaded, 1)}, tmp_path / "c")


def test_a_per_rank_dict_shaped_like_a_generator_state_is_not_taken_for_one(tmp_path):
    """``__generator__`` is a value tag: a PerRank holding such a dict is stored tagged, loads back as
    the dict, and a generator never takes it."""
    odd = {"__generator__": "AAAA"}
    ckptkit.save({"p": PerRank(odd)}, tmp_path / "c")
    got = PerRank(None)
    ckptkit.load({"p": got}, tmp_path / "c")
    assert got.value == odd
    with pytest.raises(ckptkit.StateMismatchError, match="is a ckptkit.PerRank value in the checkpoint"):
        ckptkit.load({"p": torch.Generator()}, tmp_path / "c")


def test_a_generator_state_is_checked_for_the_generator_it_goes_into(tmp_path):
    """The probe runs on the target's device (a CUDA generator's 16 bytes were called corrupt by a CPU
    probe: tests/test_gpu_paths.py); bytes that fit no generator are corrupt, as before."""
    from ckptkit.engine.loader import _generator_state

    g = torch.Generator().manual_seed(3)
    encoded = {"__generator__": __import__("base64").b64encode(g.get_state().numpy().tobytes()).decode()}
    assert torch.equal(_generator_state(encoded, "g", "here", 0, torch.device("cpu")), g.get_state())
    with pytest.raises(ckptkit.CorruptCheckpointError, match="not a valid generator state"):
        _generator_state({"__generator__": "AAAA"}, "g", "here", 0, torch.device("cpu"))
