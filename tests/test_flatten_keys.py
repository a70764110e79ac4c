"""Flattening builds every key a part at a time; it must equal ``join_key`` of the leaf's path, and
the path it records must be what ``split_key`` gives back, for any keys (``/`` and ``%`` in them,
integers, nesting in dicts, lists and tuples)."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.engine.state import _has_state, flatten_state
from ckptkit.errors import LayoutError
from ckptkit.layout.values import join_key, split_key

_keys = st.one_of(st.text(alphabet="ab/%2F5.", min_size=0, max_size=5), st.integers(-3, 12))
_leaves = st.one_of(st.just("tensor"), st.integers(), st.text(max_size=3), st.none())


def _build(shape):
    if shape == "tensor":
        return torch.zeros(1)
    if isinstance(shape, dict):
        return {k: _build(v) for k, v in shape.items()}
    if isinstance(shape, list):
        return [_build(v) for v in shape]
    return shape


def _reference(obj, path=(), out=None):
    """(kind, key, leaf) in order, each key joined from the whole path at its leaf: the walk as it was."""
    out = [] if out is None else out
    if isinstance(obj, torch.Tensor):
        out.append(("tensor", join_key(path), obj))
    elif isinstance(obj, dict) and obj:
        for k, v in obj.items():
            _reference(v, (*path, k), out)
    elif isinstance(obj, (list, tuple)) and obj and _has_state(obj):
        for i, v in enumerate(obj):
            _reference(v, (*path, i), out)
    elif path:
        out.append(("value", join_key(path), obj))
    return out


def colliding_keys(obj):
    """The first pair of keys of one dict, in the walk's order, that are the same text (5 and "5")."""
    if isinstance(obj, dict):
        for v in obj.values():
            inner = colliding_keys(v)
            if inner is not None:
                return inner
        seen = {}
        for k in obj:
            if str(k) in seen:
                return seen[str(k)], k
            seen[str(k)] = k
    elif isinstance(obj, (list, tuple)) and _has_state(obj):
        for v in obj:
            inner = colliding_keys(v)
            if inner is not None:
                return inner
    return None


_shapes = st.recursive(_leaves, lambda inner: st.one_of(st.dictionaries(_keys, inner, max_size=4),
                                                        st.lists(inner, max_size=3)), max_leaves=20)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(_keys, _shapes, max_size=5))
def test_every_key_is_the_join_of_its_path_and_splits_back(shape):
    state = _build(shape)
    pair = colliding_keys(state)
    if pair is not None:  # 5 and "5" in one dict: one key in a checkpoint, so refused (test_state_keys.py)
        with pytest.raises(LayoutError, match=re.escape(f"has the keys {pair[0]!r} and {pair[1]!r}")):
            flatten_state(state)
        return
    flat = flatten_state(state)
    leaves = flat.tensors + flat.values
    for leaf in leaves:
        assert leaf.key == join_key(leaf.path)
        assert leaf.path == split_key(leaf.key)
    got = [("tensor", leaf.key, leaf.obj) for leaf in flat.tensors] + [("value", leaf.key, leaf.obj) for leaf in flat.values]
    want = _reference(state)
    want = [w for w in want if w[0] == "tensor"] + [w for w in want if w[0] == "value"]
    assert [(k, key) for k, key, _ in got] == [(k, key) for k, key, _ in want]
    assert all(a is b for (_, _, a), (_, _, b) in zip(got, want))
