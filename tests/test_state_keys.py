"""Keys of a state that are one key in a checkpoint: refused by name, never a value lost.

A checkpoint stores a state's keys as text, so a dict holding both ``1`` and ``"1"`` (or ``None`` and
``"None"``, ``(1, 2)`` and ``"(1, 2)"``) has two entries that would share one key. Saved, one value
silently replaced the other, and a load then put the survivor in both places. Now a save refuses
such a dict naming both keys, on every path; a state without such a pair loads back whole.
(A dict inside a JSON-like value keeps its key types and never collides: tested here too.)
The same refusal on one rank of a gloo world: tests/test_tensor_kinds.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptkit
from tests.conftest import trials
from tests.test_flatten_keys import colliding_keys as _pair  # the first pair of keys of one dict that are one text

KEYS = [1, "1", None, "None", True, "True", (1, 2), "(1, 2)", 2.5, "2.5", "a", 0, "0", "s\ud800", "a/b", "%2F"]


def _leaf(kind: int, seed: int):
    return torch.full((2,), float(seed)) if kind == 0 else (seed if kind == 1 else [seed, "x"])


@st.composite
def states(draw):
    """A dict of up to 5 keys drawn from KEYS (distinct as Python keys, perhaps not as text), each holding
    a tensor, a value or a nested dict of the same kind."""
    def level(depth: int) -> dict:
        keys = draw(st.lists(st.sampled_from(KEYS), max_size=5, unique_by=lambda k: (k, type(k).__name__)))
        out = {}
        for k in keys:
            if k in out:  # True == 1 and 1.0 == 1 are one Python key already
                continue
            if depth < 2 and draw(st.booleans()):
                out[k] = level(depth + 1) or {"leaf": 0}
            else:
                out[k] = _leaf(draw(st.integers(0, 2)), draw(st.integers(0, 1000)))
        return out
    return {"root": level(0) or {"only": 1}}


def _has_surrogate(obj) -> bool:
    return isinstance(obj, dict) and any("\ud800" in str(k) or _has_surrogate(v) for k, v in obj.items())


def _blank(obj):
    if isinstance(obj, dict):
        return {k: _blank(v) for k, v in obj.items()}
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    return None


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b and type(a) is type(b)


@pytest.fixture(scope="module", autouse=True)
def _close_savers():
    yield
    ckptkit.close_async()


@settings(max_examples=trials(40, 400), deadline=None)
@given(state=states(), asynchronous=st.booleans())
def test_a_save_keeps_every_value_or_refuses_the_colliding_keys_by_name(tmp_path_factory, state, asynchronous):
    dest = tmp_path_factory.mktemp("keys") / "c"
    pair, surrogate = _pair(state), _has_surrogate(state)
    try:
        if asynchronous:
            ckptkit.save_async(state, dest).wait()
        else:
            ckptkit.save(state, dest)
    except ckptkit.SaveError as exc:
        assert not (dest / "manifest.json").exists()
        if pair is not None and f"has the keys {pair[0]!r} and {pair[1]!r}" in str(exc):
            return
        assert surrogate and "is not valid Unicode" in str(exc), (str(exc), pair)
        return
    assert pair is None and not surrogate, f"committed although {pair} collide or a key is not Unicode"
    got = _blank(state)
    ckptkit.load(got, dest)
    assert _equal(got, state)


def test_the_reported_cases(tmp_path):
    for i, bad in enumerate(({1: torch.ones(2), "1": torch.zeros(2)}, {None: 1, "None": 2},
                             {"opt": {"state": {0: {"step": 3}, "0": {"step": 4}}}})):
        with pytest.raises(ckptkit.SaveError, match="which are both .* in a checkpoint"):
            ckptkit.save({"s": bad}, tmp_path / f"c{i}")
    # inside a JSON-like value (no tensors below it) keys keep their types: nothing collides
    value = [{1: "a", "1": "b"}, {None: 1, "None": 2}]
    ckptkit.save({"v": value}, tmp_path / "v")
    got = {"v": None}
    ckptkit.load(got, tmp_path / "v")
    assert got["v"] == value and list(got["v"][0]) == [1, "1"]
