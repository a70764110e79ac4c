"""Every container a state can hold comes back from a load as it was saved: dicts (any key types),
lists, tuples and namedtuples, nested in any order, holding tensors and values side by side.

The class of defect: a tuple holding a tensor and a value (``(weight, 3)``) was saved and committed,
and every load into the same state then read the tensors and failed on the value ("cannot load a
value into a tuple"), after overwriting the tensors; a restore fell back step by step to the same
failure. A tuple cannot change, so the load now rebuilds the tuples between the value and the
nearest dict or list (a namedtuple as its own type), as a value in a dict is replaced.

Here hypothesis draws nested states; each is saved (sync and async), loaded into the same structure
holding zeros and placeholders, and must equal what was saved: types, values and tensor bytes.
The memory tier's restore puts values back the same way (one case).
"""

from __future__ import annotations

import enum
from collections import OrderedDict, defaultdict, namedtuple
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit
from tests.conftest import trials

Pair = namedtuple("Pair", ["first", "second"])


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


def _tensors(seed: int) -> st.SearchStrategy:
    return st.integers(1, 4).map(lambda n: torch.arange(n, dtype=torch.float32) + seed)


VALUES = st.one_of(st.integers(-10**20, 10**20), st.floats(allow_nan=False), st.text(max_size=4), st.none(),
                   st.booleans(), st.binary(max_size=3), st.binary(max_size=3).map(bytearray),
                   st.sampled_from(Level), st.lists(st.integers(0, 9), max_size=3).map(torch.Size))


def _nodes() -> st.SearchStrategy:
    leaves = st.one_of(VALUES, st.integers(0, 99).flatmap(_tensors))
    return st.recursive(leaves, lambda inner: st.one_of(
        st.lists(inner, min_size=1, max_size=3),
        st.lists(inner, min_size=1, max_size=3).map(tuple),
        st.tuples(inner, inner).map(lambda t: Pair(*t)),
        st.dictionaries(st.one_of(st.text("abc", min_size=1, max_size=2), st.integers(0, 5)), inner, min_size=1,
                        max_size=3),
        st.dictionaries(st.text("abc", min_size=1, max_size=2), inner, min_size=1, max_size=3).map(OrderedDict),
        st.dictionaries(st.text("abc", min_size=1, max_size=2), inner, min_size=1, max_size=3).map(
            lambda d: defaultdict(list, d)),
    ), max_leaves=8)


def blank(node: Any) -> Any:
    """The same structure with every tensor zeroed and every value replaced: by one of another type for
    JSON's own types (the checkpoint's type must win), by another of the same type for the types only
    the state can name (a bytearray, an IntEnum member, a torch.Size: the state's type must win)."""
    if isinstance(node, torch.Tensor):
        return torch.zeros_like(node)
    if isinstance(node, torch.Size):
        return torch.Size([7] * len(node))
    if isinstance(node, Level):
        return Level.HIGH if node is Level.LOW else Level.LOW
    if isinstance(node, bytearray):
        return bytearray(b"?")
    if isinstance(node, defaultdict):
        return defaultdict(node.default_factory, {k: blank(v) for k, v in node.items()})
    if isinstance(node, dict):
        return type(node)((k, blank(v)) for k, v in node.items())
    if hasattr(node, "_fields"):
        return type(node)._make(blank(v) for v in node)
    if isinstance(node, (list, tuple)):
        return type(node)(blank(v) for v in node)
    return ["placeholder"]


def same(a: Any, b: Any, where: str = "state") -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} saved, {type(b).__name__} loaded"
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        if isinstance(a, defaultdict):
            assert a.default_factory is b.default_factory, where
        for k in a:
            same(a[k], b[k], f"{where}/{k!r}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}/{i}")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} saved, {b!r} loaded"


@settings(max_examples=trials(40, 400), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=st.dictionaries(st.text("xyz", min_size=1, max_size=2), _nodes(), min_size=1, max_size=4),
       asynchronous=st.booleans())
def test_every_container_loads_back_as_it_was_saved(tmp_path_factory, tree, asynchronous):
    state = {"anchor": torch.ones(2), **tree}
    folder = tmp_path_factory.mktemp("containers") / "c"
    if asynchronous:
        ckptkit.save_async(state, folder).wait()
    else:
        ckptkit.save(state, folder)
    got = blank(state)
    ckptkit.load(got, folder)
    same(state, got)


def test_a_tensor_and_a_value_in_a_tuple(tmp_path):
    """The reported case, with the tuples above it and a namedtuple: rebuilt up to the nearest dict or
    list, the tensors loaded in place (the same objects)."""
    w = torch.arange(3.0)
    state = {"t": (w, 3), "deep": [((torch.ones(2), "a"), Pair(torch.zeros(1), 2.5))]}
    ckptkit.save(state, tmp_path / "c")
    w2, inner = torch.zeros(3), torch.zeros(2)
    got = {"t": (w2, 0), "deep": [((inner, "?"), Pair(torch.ones(1), 0.0))]}
    ckptkit.load(got, tmp_path / "c")
    same(state, got)
    assert got["t"][0] is w2 and got["deep"][0][0][0] is inner


def test_the_memory_tier_puts_values_in_tuples_back(tmp_path):
    state = {"w": torch.arange(4.0), "t": (torch.ones(2), 3), "p": Pair(torch.zeros(1), "x")}
    mgr = ckptkit.CheckpointManager(tmp_path / "run", save=ckptkit.SavePolicy(every_steps=1000),
                                    memory=ckptkit.MemoryTier(every_steps=1, replicas=0, root=tmp_path / "shm"))
    try:
        mgr.maybe_save(1, state)
        mgr.wait()
        got = blank(state)
        assert mgr.restore_latest(got) == 1 and mgr.last_restore.source == "memory"
        same(state, got)
    finally:
        mgr.close()


def test_the_states_types_are_used_only_where_they_fit():
    """The core rule, without torch: a type is taken from the state only where the saved value fits it;
    otherwise the checkpoint's value stands as decoded (never a bool made of an int, never a value lost)."""
    from ckptkit.layout.values import shaped_like

    assert shaped_like(5, True) == 5 and type(shaped_like(5, True)) is int
    assert shaped_like(2, Level.LOW) is Level.HIGH
    assert type(shaped_like(3, Level.LOW)) is int  # no member 3: the saved value stands
    assert shaped_like((1, 2, 3), Pair(0, 0)) == (1, 2, 3) and type(shaped_like((1, 2, 3), Pair(0, 0))) is tuple
    assert shaped_like((1, 2), Pair(0, 0)) == Pair(1, 2) and type(shaped_like((1, 2), Pair(0, 0))) is Pair
    assert type(shaped_like({"a": 1}, OrderedDict(b=2))) is dict  # other keys: as saved
    d = shaped_like({"a": [1]}, defaultdict(list, a=[]))
    assert type(d) is defaultdict and d.default_factory is list and d == {"a": [1]}
    assert shaped_like([1, (2, 3)], [0, Pair(0, 0)]) == [1, Pair(2, 3)]
    assert type(shaped_like(b"ab", bytearray())) is bytearray and type(shaped_like(b"ab", "s")) is bytes
    assert type(shaped_like(1.5, 3)) is float and type(shaped_like(3, 1.5)) is int
    numpy = pytest.importorskip("numpy")
    assert type(shaped_like(2.5, numpy.float64(0))) is numpy.float64
