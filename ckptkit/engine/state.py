"""Walking a user's state: which leaves are tensors, declared shards, or values.

``state`` is a nested structure of dicts, lists and tuples whose leaves are
tensors, DTensors, :class:`Sharded` declarations, :class:`Experts` marks, ``torch.Generator`` s,
:class:`PerRank` values or JSON-like values. Each leaf is returned with its
key and the container slot it sits in, so a load can write values back in
place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptkit.errors import LayoutError, SaveError
from ckptkit.layout.manifest import DTYPES
from ckptkit.layout.values import check_key, shaped_like
from ckptkit.layout.pieces import Piece
from ckptkit.layout.rules import PartitionRule
from ckptkit.layout.strict_json import gc_paused


@dataclass(frozen=True)
class Sharded:
    """A local tensor described by explicit pieces of global tensors.

    The mechanism the framework adapters build on: a Megatron shard, a
    fused GLU block, a vocab-padded embedding, a ZeRO flat buffer holding
    fragments of many parameters. See :mod:`ckptkit.layout.pieces`.

    ``rule``, when given, is how every tensor the pieces name is split at
    *any* parallel layout (:class:`ckptkit.PartitionRule`). It is recorded in
    the manifest so ``ckptkit reshard --to`` can lay the checkpoint out for a
    target layout offline; the pieces alone describe only the saving layout.
    """

    local: torch.Tensor
    pieces: tuple[Piece, ...]
    rule: PartitionRule | None = None

    def __init__(self, local: torch.Tensor, pieces: Sequence[Piece], rule: PartitionRule | None = None) -> None:
        if not isinstance(local, torch.Tensor):
            raise LayoutError(f"Sharded needs a torch.Tensor, got {type(local).__name__}")
        if rule is not None and not isinstance(rule, PartitionRule):
            raise LayoutError(f"Sharded rule must be a PartitionRule, got {type(rule).__name__}")
        object.__setattr__(self, "local", local)
        object.__setattr__(self, "pieces", tuple(pieces))
        object.__setattr__(self, "rule", rule)
        for p in self.pieces:
            p.check_fits(tuple(local.shape))


@dataclass(frozen=True)
class Experts:
    """A tensor (usually a DTensor) that stacks routed experts along ``axis``.

    ckptkit's convention for mixture-of-experts weights (docs/moe.md): one tensor per weight kind,
    experts stacked. A DTensor on an expert-parallel mesh already says so through its ``ep``
    dimension; at ep = 1 the experts sit on the dense mesh and nothing in the DTensor tells them
    apart from a dense weight. Wrapping it records the expert axis in the tensor's rule, so an
    ep = 1 save can be laid out for ep = 4 offline (``ckptkit reshard``) and ``inspect`` shows the
    experts. It changes nothing else: the tensor is saved and loaded as if unwrapped.
    """

    tensor: torch.Tensor
    axis: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.tensor, torch.Tensor):
            raise LayoutError(f"Experts needs a torch.Tensor, got {type(self.tensor).__name__}")
        if not 0 <= self.axis < self.tensor.dim():  # a 0-d tensor has no axis to stack experts on
            raise LayoutError(f"Experts axis {self.axis} is outside a tensor of shape {list(self.tensor.shape)}")


@dataclass
class PerRank:
    """A value that differs per rank (a data-loader position, a counter).

    Stored in the rank's own index; restored to the same rank when the world
    size is unchanged. On a resize the load option ``per_rank_on_resize``
    decides (see :class:`ckptkit.LoadOptions`).
    """

    value: Any


@dataclass
class Leaf:
    key: str
    obj: Any
    parent: Any = None
    slot: Any = None
    expert_axis: int | None = None  # set by an Experts wrapper
    #: the key's parts as strings (``split_key(key)``, without parsing it again)
    path: tuple[str, ...] = ()


@dataclass
class FlatState:
    tensors: list[Leaf] = field(default_factory=list)  # torch.Tensor and DTensor
    sharded: list[Leaf] = field(default_factory=list)
    generators: list[Leaf] = field(default_factory=list)
    per_rank: list[Leaf] = field(default_factory=list)
    values: list[Leaf] = field(default_factory=list)
    root: Any = None  # the state walked: a value inside a tuple is put back through it

    def tensor_objects(self) -> list[Any]:
        """Every tensor leaf as the state holds it, in the order a save classifies them (plain tensors and
        DTensors, then each ``Sharded``'s local tensor): what an in-place change of the state moves the
        version counter of (a DTensor's own, besides its local tensor's)."""
        return [leaf.obj for leaf in self.tensors] + [leaf.obj.local for leaf in self.sharded]

    def assign(self, leaf: Leaf, value: Any) -> None:
        """Put a loaded value where ``leaf`` was, with the container and scalar types the state holds
        there (:func:`~ckptkit.layout.values.shaped_like`: a namedtuple stays one). Inside a tuple
        (``(weight, 3)``), which cannot change, the tuples between the value and the nearest dict or
        list above it are rebuilt with the new value (a namedtuple as its own type), as a value in a
        dict is replaced: a save of such a state used to commit, and every load of it then failed
        after reading the tensors."""
        value = shaped_like(value, leaf.obj)
        if not isinstance(leaf.parent, tuple):
            leaf.parent[leaf.slot] = value
            return
        chain: list[tuple[Any, Any]] = []  # (container, slot) from the root down to the value
        node = self.root
        for part in leaf.path:
            slot = int(part) if isinstance(node, (list, tuple)) else next(k for k in node if str(k) == part)
            chain.append((node, slot))
            node = node[slot]
        while isinstance(chain[-1][0], tuple):
            container, slot = chain.pop()
            items = list(container)
            items[slot] = value
            value = type(container)._make(items) if hasattr(container, "_fields") else type(container)(items)
        container, slot = chain[-1]
        container[slot] = value


def _has_state(obj: Any) -> bool:
    if isinstance(obj, (torch.Tensor, Sharded, torch.Generator, PerRank, Experts)):
        return True
    if isinstance(obj, dict):
        return any(_has_state(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_state(v) for v in obj)
    return False


def check_state_root(state: Any) -> None:
    """LayoutError unless ``state`` is a dict (a mistake in the calling code, the same on every rank:
    raised at once, before any collective)."""
    if not isinstance(state, dict):
        raise LayoutError(f"state must be a dict, got {type(state).__name__}")


def flatten_state(state: Any) -> FlatState:
    """``state``'s leaves. Walked with the collector paused: a leaf per tensor, at every save and snapshot
    (docs/design-notes.md, "The training thread's GIL and collector")."""
    check_state_root(state)
    out = FlatState(root=state)
    with gc_paused():
        _walk(state, "", (), None, None, out)
    return out


def _check_distinct_keys(obj: dict, key: str) -> None:
    """Refuse a dict two of whose keys are one key in a checkpoint (``1`` and ``"1"``: keys are stored as
    text), naming both: saved, one of the two values would be lost without a word. Only a dict with a
    key that is not a string can have such a pair (string keys are escaped, so they never collide)."""
    seen: dict[str, Any] = {}
    for k in obj:
        text = str(k)
        if text in seen:
            where = f"the dict at {key!r}" if key else "the state"
            raise LayoutError(f"{where} has the keys {seen[text]!r} and {k!r}, which are both {text!r} in a "
                              "checkpoint (keys are stored as text): one of their values would be lost; rename one")
        seen[text] = k


def _walk(obj: Any, key: str, path: tuple[str, ...], parent: Any, slot: Any, out: FlatState) -> None:
    """``key`` is ``join_key`` of the path, built a part at a time (a snapshot every few steps walks a
    state of thousands of leaves: joining every path from its root again was most of its cost)."""
    if isinstance(obj, torch.Tensor):
        out.tensors.append(Leaf(key, obj, parent, slot, None, path))
    elif isinstance(obj, Experts):
        out.tensors.append(Leaf(key, obj.tensor, parent, slot, obj.axis, path))
    elif isinstance(obj, Sharded):
        out.sharded.append(Leaf(key, obj, parent, slot, None, path))
    elif isinstance(obj, torch.Generator):
        out.generators.append(Leaf(key, obj, parent, slot, None, path))
    elif isinstance(obj, PerRank):
        out.per_rank.append(Leaf(key, obj, parent, slot, None, path))
    elif isinstance(obj, dict) and obj:
        odd = False  # a key that is not a string: only then can two keys be one text (_check_distinct_keys)
        for k, v in obj.items():
            if type(k) is str:
                text = k
            else:
                text, odd = str(k), True
            # the part as join_key escapes it (inline: a snapshot walks thousands of keys)
            part = text.replace("%", "%25").replace("/", "%2F") if "%" in text or "/" in text else text
            _walk(v, f"{key}/{part}" if path else part, (*path, text), obj, k, out)
        if odd and len(obj) > 1:
            _check_distinct_keys(obj, key)
    elif isinstance(obj, (list, tuple)) and obj and _has_state(obj):
        for i, v in enumerate(obj):
            _walk(v, f"{key}/{i}" if path else str(i), (*path, str(i)), obj, i, out)
    else:
        if not path:
            return
        out.values.append(Leaf(key, obj, parent, slot, None, path))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_savable(key: str, t: torch.Tensor, shapes_only: bool = False) -> None:
    """Refuse, naming ``key``, a tensor whose elements are not plain bytes in memory that a load can
    put back exactly as they were: before anything is written, so a committed checkpoint never holds
    a tensor its reader cannot load (a save used to commit ``uint16`` tensors that every load then
    refused as an unknown dtype) or bytes that are not the tensor's values (a quantized tensor's
    integers without its scales).

    A conjugate or negative view (``x.conj()``) is savable: its values are materialised when its
    bytes are taken (:func:`ckptkit.engine.tensor_bytes.piece_tensor`). ``shapes_only``: a meta tensor
    passes (only planned, never written)."""
    check_key(key)
    why = not_dense_memory(t, meta_ok=shapes_only)
    if why is None and dtype_name(t.dtype) not in DTYPES:
        why = f"of dtype {dtype_name(t.dtype)}, which the checkpoint format does not name (it names {', '.join(DTYPES)})"
    if why is not None:
        raise SaveError(f"tensor {key!r} cannot be saved: it is {why}")


def not_dense_memory(t: torch.Tensor, *, meta_ok: bool = False) -> str | None:
    """Why ``t``'s elements are not plain values in memory, one after another at its strides (what a
    save reads and a load writes), or None. Asked before the tensor's shape: a nested one has none."""
    if t.is_nested:
        return "a nested (ragged) tensor; save its components as a list of tensors"
    if t.layout != torch.strided:
        return f"a {str(t.layout).removeprefix('torch.')} tensor; save it dense (.to_dense()) or its index and value tensors"
    if t.is_quantized:
        return (f"a quantized tensor ({dtype_name(t.dtype)}), whose integers mean nothing without its scales; "
                "save .int_repr() with its q_scale()/q_zero_point(), or .dequantize()")
    if t.device.type == "meta" and not meta_ok:
        return "a meta tensor, which has a shape but no values (materialise it first, e.g. to_empty() and init)"
    return None


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise LayoutError(f"unknown dtype {name!r}")
    return dt
