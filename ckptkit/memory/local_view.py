"""A rank's own state as a flat dict of local tensors and values, and a fingerprint of its layout.

A memory snapshot is a checkpoint of one rank's *local* state (the bytes it holds: a DTensor's
local shard, a :class:`~ckptkit.Sharded` declaration's local tensor), saved as a one-rank
checkpoint. It is only ever restored to the same rank of a job at the same layout, so the
layout itself is not stored — only its fingerprint, which must match before a snapshot is used:
the same local shapes can hold different parts of a tensor at another layout (tp2 vs dp2 on the
same four ranks), and loading them would be silently wrong.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from ckptkit.engine.dtensor_grid import grid_of, is_dtensor, local_of
from ckptkit.engine.state import FlatState, Leaf, flatten_state
from ckptkit.engine.structure import structure_signature
from ckptkit.layout.strict_json import gc_paused


def _put(view: dict[str, Any], leaf: Leaf, value: Any) -> None:
    """Place ``value`` at ``leaf``'s path, so the snapshot stores it under the user's own key."""
    parts = leaf.path
    node = view
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _get(view: dict[str, Any], leaf: Leaf) -> Any:
    node: Any = view
    for part in leaf.path:
        node = node[part]
    return node


@dataclass
class LocalView:
    """The view to save or load (``state``) and how to put loaded values back into the user's."""

    state: dict[str, Any]
    flat: FlatState
    fingerprint: str

    @property
    def nbytes(self) -> int:
        """This rank's tensor bytes (walked on demand: the budget check asks once)."""
        return sum(t.numel() * t.element_size() for t in _tensors(self.state))

    def write_back(self) -> None:
        """After a load into :attr:`state`: values and per-rank values back into the user's state
        (tensors and generators were loaded in place)."""
        for leaf in self.flat.values:
            self.flat.assign(leaf, _get(self.state, leaf))
        for leaf in self.flat.per_rank:
            leaf.obj.value = _get(self.state, leaf)


@dataclass
class FingerprintMemo:
    """The last view's layout signature and its fingerprint: a snapshot every few steps of the same
    tensors hashes their layout once, not every time (:mod:`ckptkit.engine.structure`)."""

    signature: tuple[Any, ...] | None = None
    fingerprint: str = ""


def local_view(state: dict[str, Any], world_size: int, rank: int, memo: FingerprintMemo | None = None) -> LocalView:
    """The rank's own tensors and values of ``state``, and what they may be restored to. Built with
    the collector paused: a leaf, a view entry and a signature entry per tensor, on the training
    thread at every snapshot (docs/design-notes.md, "The training thread's GIL and collector")."""
    with gc_paused():
        return _local_view(state, world_size, rank, memo)


def _local_view(state: dict[str, Any], world_size: int, rank: int, memo: FingerprintMemo | None) -> LocalView:
    flat = flatten_state(state)
    view: dict[str, Any] = {}
    held: set[int] = set()  # one tensor under several keys (tied weights, Sharded declarations over one local)
    for leaf in flat.tensors:
        t = leaf.obj
        local = local_of(t) if is_dtensor(t) else t
        if id(local) not in held:  # is held once: its first key restores all of it
            held.add(id(local))
            _put(view, leaf, local.detach())
    for leaf in flat.sharded:
        if id(leaf.obj.local) not in held:
            held.add(id(leaf.obj.local))
            _put(view, leaf, leaf.obj.local.detach())
    for leaf in flat.generators:
        _put(view, leaf, leaf.obj)
    for leaf in flat.per_rank:
        _put(view, leaf, leaf.obj.value)
    for leaf in flat.values:
        _put(view, leaf, leaf.obj)
    if memo is None:
        return LocalView(view, flat, layout_fingerprint(flat, world_size, rank))
    sig = (world_size, rank, structure_signature(flat), tuple(leaf.key for leaf in flat.generators),
           tuple(leaf.key for leaf in flat.per_rank), tuple(leaf.key for leaf in flat.values))
    if memo.signature != sig:
        memo.signature, memo.fingerprint = sig, layout_fingerprint(flat, world_size, rank)
    return LocalView(view, flat, memo.fingerprint)


def layout_fingerprint(flat: FlatState, world_size: int, rank: int) -> str:
    """What a snapshot may only be restored to: the rank, the world, and every leaf's key, dtype,
    shapes and (for a DTensor) grid layout and coordinate."""
    h = hashlib.sha256(repr((world_size, rank)).encode())
    for leaf in flat.tensors:
        t = leaf.obj
        if is_dtensor(t):
            layout, coord = grid_of(t, leaf.key)
            h.update(repr((leaf.key, str(t.dtype), tuple(t.shape), tuple(local_of(t).shape), layout.mesh.shape,
                           layout.placements, layout.padded, layout.fused, coord)).encode())
        else:
            h.update(repr((leaf.key, str(t.dtype), tuple(t.shape))).encode())
    for leaf in flat.sharded:
        s = leaf.obj
        h.update(repr((leaf.key, str(s.local.dtype), tuple(s.local.shape), s.pieces)).encode())
    for leaf in flat.generators:
        h.update(repr((leaf.key, "generator")).encode())
    for leaf in flat.per_rank:
        h.update(repr((leaf.key, "per_rank")).encode())
    for leaf in flat.values:
        h.update(repr((leaf.key, "value")).encode())
    return h.hexdigest()


def _tensors(node: Any) -> Any:
    if isinstance(node, torch.Tensor):
        yield node
    elif isinstance(node, dict):
        for v in node.values():
            yield from _tensors(v)


def mirror_state(state: dict[str, Any], view: LocalView, staged: list[Any] | None) -> dict[str, Any] | None:
    """``state`` with every tensor replaced by its staged copy, or None when some tensor has none.

    ``staged``: one view per tensor of the snapshot, in the order the snapshot's save took them
    (the flattening of ``view.state``). The persistent save of the same step persists from the
    result: the state is copied once for both tiers."""
    from ckptkit.engine.state import Experts, Sharded

    keys = [leaf.key for leaf in flatten_state(view.state).tensors]
    if staged is None or len(staged) != len(keys) or any(v is None for v in staged):
        return None
    by_key = dict(zip(keys, staged))
    by_local: dict[int, torch.Tensor] = {}  # a tensor held once (under its first key) serves every key naming it
    for leaf in view.flat.tensors:
        if leaf.key in by_key:
            by_local[id(local_of(leaf.obj) if is_dtensor(leaf.obj) else leaf.obj)] = by_key[leaf.key]
    for leaf in view.flat.sharded:
        if leaf.key in by_key:
            by_local[id(leaf.obj.local)] = by_key[leaf.key]
    by_id: dict[int, torch.Tensor] = {}
    for leaf in view.flat.tensors:
        by_id[id(leaf.obj)] = by_local[id(local_of(leaf.obj) if is_dtensor(leaf.obj) else leaf.obj)]
    for leaf in view.flat.sharded:
        by_id[id(leaf.obj.local)] = by_local[id(leaf.obj.local)]

    def tensor(t: torch.Tensor) -> torch.Tensor:
        view = by_id[id(t)]
        if not is_dtensor(t):
            return view
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            return DTensor.from_local(view, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                      stride=t.stride())

    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return tensor(obj)
        if isinstance(obj, Experts):
            return Experts(tensor(obj.tensor), obj.axis)
        if isinstance(obj, Sharded):
            return Sharded(by_id[id(obj.local)], obj.pieces, obj.rule)
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(walk(v) for v in obj)
        return obj

    return walk(state)
