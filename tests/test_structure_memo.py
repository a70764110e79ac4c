"""The classification and layout fingerprint reused while a state's structure is unchanged.

A save of the same structure reuses the last declarations and fingerprint
(:class:`ckptkit.engine.structure.ClassifyMemo`, :class:`ckptkit.memory.local_view.FingerprintMemo`).
Whatever happens to the state between saves — a value changed, a tensor replaced, reshaped or
retyped in place (``.data = ...``), a key added, removed or renamed, a Sharded leaf's pieces
changed — the memo must answer exactly what classifying afresh answers."""

from __future__ import annotations

import gc

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.engine.saver import classify_state
from ckptkit.engine.state import flatten_state
from ckptkit.engine.structure import ClassifyMemo
from ckptkit.memory.local_view import FingerprintMemo, local_view

MUTATIONS = ("value", "new_tensor", "reshape_in_place", "retype_in_place", "add_key", "drop_key", "rename_key",
             "sharded_pieces", "nothing")


def _sharded(n: int, at: int) -> ckptkit.Sharded:
    return ckptkit.Sharded(torch.zeros(n), [ckptkit.box_piece("g", (n + at,), (at,), (n,))])


def _mutate(state: dict, what: str, k: int) -> None:
    keys = sorted(key for key in state["model"] if isinstance(state["model"][key], torch.Tensor))
    key = keys[k % len(keys)] if keys else None
    if what == "value":
        state["step"] += 1
    elif what == "new_tensor" and key:
        state["model"][key] = torch.zeros_like(state["model"][key])
    elif what == "reshape_in_place" and key:
        state["model"][key].data = torch.zeros(k % 3 + 1, 2)
    elif what == "retype_in_place" and key:
        t = state["model"][key]
        t.data = t.data.to(torch.float64 if t.dtype != torch.float64 else torch.bfloat16)
    elif what == "add_key":
        state["model"][f"extra{k}"] = torch.ones(k % 4 + 1)
    elif what == "drop_key" and len(keys) > 1:
        del state["model"][key]
    elif what == "rename_key" and key:
        state["model"][key + "x"] = state["model"].pop(key)
    elif what == "sharded_pieces":
        state["flat"] = _sharded(4, k % 3)


def _same(a, b) -> None:
    assert (a.grid, a.plain, a.explicit, a.fingerprint) == (b.grid, b.plain, b.explicit, b.fingerprint)
    assert len(a.tensors) == len(b.tensors) and all(x is y for x, y in zip(a.tensors, b.tensors))
    assert (a.values, a.per_rank_values, a.per_rank_keys) == (b.values, b.per_rank_values, b.per_rank_keys)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(MUTATIONS), st.integers(0, 20)), min_size=1, max_size=12),
       st.integers(0, 3))
def test_a_remembered_classification_is_the_classification(mutations, rank):
    state = {"model": {"w": torch.zeros(3, 2), "b": torch.zeros(2), "e": torch.zeros(0)}, "step": 0,
             "flat": _sharded(4, 0)}
    memo, fp_memo = ClassifyMemo(), FingerprintMemo()
    for what, k in [("nothing", 0), *mutations]:
        _mutate(state, what, k)
        _same(memo.classify(flatten_state(state), rank), classify_state(flatten_state(state), rank))
        assert local_view(state, 4, rank, fp_memo).fingerprint == local_view(state, 4, rank).fingerprint


def test_a_remembered_classification_follows_the_rank():
    state = {"w": torch.zeros(3)}
    memo = ClassifyMemo()
    for rank in (0, 1, 0):
        _same(memo.classify(flatten_state(state), rank), classify_state(flatten_state(state), rank))


def dtensor_layouts() -> dict:
    """2 ranks: DTensors sharded, then replicated, then sharded on the other dim; and the layout of a
    DTensor that is gone is forgotten with it (its id may be another's next)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ckptkit.engine import dtensor_grid

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    memo, fp_memo, checked = ClassifyMemo(), FingerprintMemo(), 0
    for placement in (Shard(0), Shard(0), Replicate(), Shard(1), Shard(1)):
        dt = distribute_tensor(base, mesh, [placement])
        state = {"w": dt, "opt": {"m": dt.detach().clone()}}
        for _ in range(2):
            _same(memo.classify(flatten_state(state), dist.get_rank()),
                  classify_state(flatten_state(state), dist.get_rank()))
            assert (local_view(state, 2, dist.get_rank(), fp_memo).fingerprint
                    == local_view(state, 2, dist.get_rank()).fingerprint)
            checked += 1
        ident = id(dt)
        assert ident in dtensor_grid._grid_cache
        del state, dt
        memo.last = memo.signature = None  # the memo's own references go too
        gc.collect()
        gone = ident not in dtensor_grid._grid_cache
        assert gone, "a dead DTensor's layout is still remembered under its id"
    return {"checked": checked}


def test_dtensor_layouts_are_remembered_only_while_they_hold(worlds):
    assert [r["checked"] for r in worlds.run(2, dtensor_layouts)] == [10, 10]
