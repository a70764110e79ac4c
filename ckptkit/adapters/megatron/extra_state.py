"""Transformer Engine's ``_extra_state`` (FP8 scaling factors, amax history), carried as Megatron declares it.

Megatron declares every linear module's extra state as a ``ShardedObject``
(``make_sharded_object_for_checkpoint``): key ``<module key>._extra_state``,
global offsets of the layer (and routed expert) the module holds, replica id
``(0, tp rank, dp rank)``. So there is one object per layer (and expert),
written by tensor-parallel rank 0 of data-parallel replica 0, and read by every
rank that holds that layer at the loading layout. ckptkit keeps exactly that:
each non-empty payload is a raw uint8 tensor named ``extra/<Megatron's unique
key>`` (``extra/decoder.layers.self_attention.linear_qkv._extra_state/shard_3_4``),
written by the rank Megatron names as the main replica. Hence:

* at the saving layout every module gets its layer's payload back; a TP rank
  other than 0 gets TP rank 0's, as from Megatron's own load (TE keeps the FP8
  scales of a TP group equal when it reduces amaxes over the group, its default);
* at another TP/PP/EP layout every module gets the payload of the layer (and
  expert) it now holds, from the saving job's TP rank 0: Megatron's rule.

The payload is Transformer Engine 2.x's form (``pickle.dumps`` of the state in a
1-D uint8 tensor); its earlier ``io.BytesIO`` form is refused by name. An empty
payload (TE without FP8) or None (Megatron's local linears) is not stored, and a
load leaves such a module as it is: what ``set_extra_state`` does with either.
Every payload a load would hand to a module is vetted first
(:mod:`.te_payload`), all of them before any module receives one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptkit.adapters.megatron import te_payload
from ckptkit.adapters.megatron.model_space import layer_of
from ckptkit.engine.state import Sharded
from ckptkit.engine.collective import resolve_comm
from ckptkit.errors import StateMismatchError, UnsafeCheckpointError
from ckptkit.layout.pieces import box_piece
from ckptkit.layout.rules import PartitionRule

PREFIX = "extra/"
SUFFIX = "._extra_state"
_EXTRA_STATE = re.compile(r"\._extra_state([0-9]*)$")  # a grouped-GEMM module numbers its experts' from 1
_STACKED = "decoder.layers."
MAX_PAYLOAD_BYTES = 64 << 20
"""TE's payloads are kilobytes (a 1,024-step amax history of a module: about 22 KiB); a stored one
declared larger than this is refused before its buffer is made."""


@dataclass(frozen=True)
class ExtraState:
    """One module's declared extra state: the tensor it is stored as, the module that takes it
    back, whether this rank writes it, and (at a save) its payload."""

    name: str
    path: str
    module: Any
    main: bool
    rule: PartitionRule | None
    payload: torch.Tensor | None


def declared(chunks: Sequence[Any], objects: Sequence[tuple[int, str, Any]], *, saving: bool = True) -> list[
        ExtraState]:
    """The extra states among the ShardedObjects ``(chunk, state path, object)`` of the model chunks
    (already unwrapped); other objects are refused by name. ``saving``: take (and check) the payloads the
    modules hold now; at a load (False) they are not used, so a form ckptkit does not carry is no reason
    to refuse the load."""
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    out = []
    for chunk, path, obj in objects:
        found = _EXTRA_STATE.search(path)
        if found is None:
            raise StateMismatchError(f"Megatron object {obj.key!r} (state {path!r}) is not a module's _extra_state; "
                                     "ckptkit's Megatron adapter carries only those")
        module = chunks[chunk].get_submodule(path[: found.start()])
        if found.group(1) or getattr(module, "num_gemms", 1) > 1:  # _extra_state<i>, or a grouped GEMM's own
            if saving:
                _refuse_grouped(obj, path)
            continue
        out.append(ExtraState(PREFIX + obj.unique_key, path, module, is_main_replica(obj.replica_id),
                              _rule(obj), _payload(obj, path) if saving else None))
    return out


def _refuse_grouped(obj: Any, path: str) -> None:
    """A grouped-GEMM module (``TEGroupedMLP``'s ``TEGroupedLinear``): Megatron splits its FP8 state per
    expert at the save and merges it back in a ``load_state_dict`` pre-hook, which a ``set_extra_state``
    per object would bypass. Without FP8 state (empty payloads) there is nothing to carry; with it, refused."""
    if _payload(obj, path) is not None:
        raise StateMismatchError(
            f"Megatron module {path!r} is a grouped-GEMM linear (TEGroupedMLP) with FP8 state; ckptkit does not carry "
            "its per-expert _extra_state (Megatron merges it in a load hook): save without FP8, or with "
            "SequentialMLP experts")


def _payload(obj: Any, path: str) -> torch.Tensor | None:
    data = obj.data
    if data is None:
        return None
    if isinstance(data, torch.Tensor) and data.dtype == torch.uint8 and data.dim() == 1:
        return data.detach().cpu().contiguous() if data.numel() else None
    raise StateMismatchError(
        f"Megatron module {path!r} holds a {type(data).__name__} as its _extra_state; ckptkit carries Transformer "
        "Engine 2.x's form, a 1-D uint8 tensor (TE 1.x's io.BytesIO form is not carried: upgrade TE, or save "
        "without FP8 state)")


def _rule(obj: Any) -> PartitionRule | None:
    return rule_of(obj.key, tuple(obj.global_offset), tuple(obj.global_shape))


def rule_of(key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> PartitionRule | None:
    """Where a payload lives at any layout: on the pipeline stage of its layer, on its expert's EP rank
    (``ckptkit reshard`` places it there; every rank holding the layer reads it at a load)."""
    layer = layer_of(key)
    stacked = layer is None and key.startswith(_STACKED) and len(offsets) >= 1
    if stacked:
        layer = offsets[0]
    expert_axis = 1 if stacked else 0
    if ".experts." in key and len(offsets) > expert_axis:
        return PartitionRule(layer=layer, expert=offsets[expert_axis], num_experts=shape[expert_axis])
    return PartitionRule(layer=layer) if layer is not None else None


def parse_name(name: str) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """``extra/<key>/shard_<offsets>_<shape>`` -> (key, offsets, shape), as Megatron's
    ``ShardedObject.unique_key`` spells them; :class:`ValueError` for another form."""
    key, sep, shard = name.removeprefix(PREFIX).rpartition("/shard_")
    offsets, _, shape = shard.partition("_")
    if not (name.startswith(PREFIX) and sep and key.endswith(SUFFIX.lstrip("."))):
        raise ValueError(f"{name!r} is not an extra state's name ({PREFIX}<key>._extra_state/shard_<offsets>_<shape>)")
    try:
        return key, tuple(int(x) for x in offsets.split(".")), tuple(int(x) for x in shape.split("."))
    except ValueError:
        raise ValueError(f"{name!r}: offsets and shape are not dot-separated integers") from None


def save_entries(states: Sequence[ExtraState]) -> dict[str, Sharded]:
    """What a save stores: the payloads this rank writes, one tensor each."""
    out = {}
    for i, s in enumerate(states):
        if s.main and s.payload is not None:
            n = s.payload.numel()
            out[f"x{i}"] = Sharded(s.payload, [box_piece(s.name, (n,), (0,), (n,))], rule=s.rule)
    return out


def check_size(name: str, shape: Sequence[int], where: str) -> int:
    """A stored payload's length, refused (before anything is allocated) unless it is 1-D and at most
    :data:`MAX_PAYLOAD_BYTES`: a manifest may declare any shape, and the buffer is made before the read."""
    if len(shape) != 1 or not 0 <= shape[0] <= MAX_PAYLOAD_BYTES:
        raise UnsafeCheckpointError(f"{where}: tensor {name!r} declares shape {list(shape)}; an _extra_state payload "
                                    f"is 1-D and at most {MAX_PAYLOAD_BYTES} bytes")
    return int(shape[0])


def load_entries(states: Sequence[ExtraState], shapes: Mapping[str, tuple[int, ...]], where: str = "") -> dict[
        str, Sharded]:
    """What a load reads: the stored payload of every declared extra state (into fresh buffers)."""
    out = {}
    for i, s in enumerate(states):
        shape = shapes.get(s.name)
        if shape is not None:
            check_size(s.name, shape, where)
            buf = torch.empty(tuple(shape), dtype=torch.uint8)
            out[f"x{i}"] = Sharded(buf, [box_piece(s.name, tuple(shape), (0,) * len(shape), tuple(shape))])
    return out


def stores_any(shapes: Mapping[str, tuple[int, ...]]) -> bool:
    """Whether a checkpoint (its manifest's tensor shapes) holds any payload: the same answer on every rank."""
    return any(name.startswith(PREFIX) for name in shapes)


def restore(states: Sequence[ExtraState], loaded: Mapping[str, Sharded], where: str) -> int:
    """Vet every loaded payload, then hand each to its module's ``set_extra_state`` (as Megatron's
    ``load_state_dict`` does); the number restored. Collective: a payload refused on one rank is
    refused on every rank (each holds other layers), so no rank goes on with a half-restored job.
    Call it on every rank or on none (:func:`stores_any`: a checkpoint without payloads needs no call)."""
    picked = [(s, loaded[f"x{i}"].local) for i, s in enumerate(states) if f"x{i}" in loaded]
    refusal = None
    try:
        for s, buf in picked:
            if buf.dim() != 1:
                raise UnsafeCheckpointError(f"{where}: tensor {s.name!r} has shape {list(buf.shape)}, an "
                                            "_extra_state payload is 1-D")
            te_payload.check(buf.numpy().tobytes(), f"{where}: tensor {s.name!r} (module {s.path!r})")
    except UnsafeCheckpointError as exc:
        refusal = str(exc)
    refused = [(rank, r) for rank, r in enumerate(resolve_comm().all_gather_json(refusal)) if r]
    if refused:
        rank, first = refused[0]
        more = f" ({len(refused) - 1} more rank(s) refused theirs)" if len(refused) > 1 else ""
        raise UnsafeCheckpointError(f"rank {rank}: {first}{more}; no module was handed a payload")
    for s, buf in picked:
        s.module.set_extra_state(buf)
    return len(picked)
