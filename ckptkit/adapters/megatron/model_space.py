"""Megatron-core's own sharding declarations -> ckptkit pieces and partition rules.

Megatron's ``model.sharded_state_dict()`` already speaks model space: each
``ShardedTensor`` names a global tensor (stacked layers get a prepended layer
axis, ``prepend_axis_num``), its ``global_shape``, this rank's
``global_offset`` and a ``replica_id`` of ``(pipeline, tensor, data)``
replica indices where ``(0, 0, *)`` is the main copy. The SwiGLU ``linear_fc1``
is a ``ShardedTensorFactory`` whose build function cuts the local ``[gate;
up]`` block into two ShardedTensors (views of the parameter) at fragments
``rank`` and ``rank + tp`` of a ``2 * tp`` split. Nothing here guesses from
parameter names for *where bytes are*: those facts are read off the
declarations (factories are expanded with their own build function and each
view is located inside its parameter by storage offset).

What the declarations do not say is how a tensor would split at *another*
layout (at tp=1 every fragmentation is 1). That comes from the attributes
Megatron's parallel layers set on every parameter (``tensor_model_parallel``,
``partition_dim``), the factory kind, and the stacked-layer axis; the result
is a :class:`ckptkit.PartitionRule` recorded with the tensor so ``ckptkit
reshard --to`` can lay the checkpoint out for a target layout offline.

Routed experts (MoE) follow ckptkit's expert convention (docs/moe.md): one
tensor per expert weight kind, experts stacked along an expert axis. That is
what Megatron declares for ``SequentialMLP`` too: ``decoder.layers.mlp.
experts.experts.linear_fc1.weight`` of global shape ``[layers, experts,
rows, cols]`` (two prepended axes), each EP rank holding its experts. Expert
parameters are those of Megatron's expert modules (``SequentialMLP``); their replicas
are the expert-data-parallel group's, their TP split is the expert TP degree,
and their rule says so (``expert_axis``). Buffers Megatron declares (the
router's ``expert_bias``) are model space like parameters; they have no
optimizer state.

Vocabulary padding is not model space: with ``vocab_size`` given, the word
embedding and output layer are stored with the true vocabulary and the
padding rows of the saving layout go to a side tensor ``<key>.vocab_padding``
(restored where the loading layout's padding overlaps it, zero elsewhere).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from math import prod
import re
from typing import Any

import torch

from ckptkit.errors import LayoutError, StateMismatchError
from ckptkit.layout.box import Box
from ckptkit.layout.pieces import Piece, box_piece, flat_piece
from ckptkit.layout.rules import PartitionRule

VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
PADDING_SUFFIX = ".vocab_padding"


def unwrap(chunk: Any) -> Any:
    """The model inside Megatron's wrappers (DDP, Float16Module, ...): their ``sharded_state_dict``
    adds a ``module.`` prefix that Megatron's own checkpoints do not have."""
    while isinstance(getattr(chunk, "module", None), torch.nn.Module):
        chunk = chunk.module
    return chunk


@dataclass(frozen=True)
class Segment:
    """Rows ``[row, row + rows)`` of a parameter (all other axes whole) are box ``offsets`` of ``tensor``.

    Parameters are only ever cut along their first axis (TP chunks of a fused
    block, real vs padded vocab rows), so a segment is also a contiguous run
    ``[row * row_numel, (row + rows) * row_numel)`` of the parameter's
    flattening, which is what a distributed-optimizer shard is a range of.
    """

    row: int
    rows: int
    tensor: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]  # of the box in the global tensor; box sizes: (1,) * prepend + (rows, *rest)


@dataclass(frozen=True)
class ParamSpace:
    """Where one parameter's elements live in model space, and how they split at any layout."""

    name: str  # the first ShardedTensor key (for messages)
    param: torch.Tensor
    prepend: int
    segments: tuple[Segment, ...]
    main: bool  # Megatron's replica_id is (0, 0, *): this rank's copy is the one the TP/PP group writes
    dp_index: int
    dp_size: int
    rules: dict[str, PartitionRule | None]
    fresh_rows: tuple[tuple[int, int], ...] = ()
    """Rows ``[start, stop)`` of the TP-local parameter that the checkpoint does not hold (vocabulary
    padding grown past the saved one): set by :func:`padding_plan`, which zeroes them in the weight;
    the optimizer's copies of them are zeroed after the load (``optimizer_state.zero_fresh_rows``)."""

    @property
    def row_numel(self) -> int:
        return prod(self.param.shape[1:]) if self.param.dim() else 1

    def view(self, local: torch.Tensor | None = None) -> torch.Tensor:
        """``local`` (default: the parameter) with the prepended layer axes the boxes have."""
        t = self.param if local is None else local
        return t.view((1,) * self.prepend + tuple(self.param.shape))

    def box_pieces(self, prefix: str, *, for_save: bool) -> list[Piece]:
        """Pieces of the parameter-shaped tensor under ``prefix``; at save only main copies, balanced over DP."""
        if for_save and not self.main:
            return []
        replica = (self.dp_index, self.dp_size) if for_save and self.dp_size > 1 else None
        rest = tuple(self.param.shape[1:])
        out = []
        for s in self.segments:
            local = (0,) * self.prepend + (s.row,) + (0,) * len(rest)
            sizes = (1,) * self.prepend + (s.rows,) + rest
            out.append(box_piece(prefix + s.tensor, s.shape, s.offsets, sizes, local_offsets=local, replica=replica))
        return out

    def flat_pieces(self, prefix: str, start: int, stop: int, *, for_save: bool) -> list[Piece]:
        """Pieces of a 1-D shard holding elements ``[start, stop)`` of the parameter's flattening."""
        if for_save and not self.main:
            return []
        n = self.row_numel
        rest = tuple(self.param.shape[1:])
        out = []
        for s in self.segments:
            a, b = max(start, s.row * n), min(stop, (s.row + s.rows) * n)
            if a >= b:
                continue
            box = Box(s.offsets, (1,) * self.prepend + (s.rows,) + rest)
            out.append(flat_piece(prefix + s.tensor, s.shape, box, a - s.row * n, b - s.row * n, local_start=a - start))
        return out

    def tensors(self) -> list[str]:
        return sorted({s.tensor for s in self.segments})


@dataclass(frozen=True)
class DataParallelSizes:
    """The replica groups a declaration's ``replica_id[2]`` counts in: dense tensors replicate over the
    data-parallel group (with context parallel), routed experts over the expert-data-parallel one."""

    dense: int
    expert: int = 1

    def of(self, expert: bool) -> int:
        return self.expert if expert else self.dense


# Megatron's routed-expert modules: their parameters are declared with the expert offset and their
# replica ids count in the expert-data-parallel group, at every ep (ep=1 included).
EXPERT_MODULES = ("SequentialMLP", "TEGroupedMLP")


def routed_expert_params(model: Any) -> set[int]:
    """``id``s of the routed experts' parameters. Not ``allreduce = False``: Megatron sets that only at
    ep > 1 (at ep = 1 expert gradients reduce with the dense ones), while the declarations are the same."""
    return {id(p) for m in model.modules() if type(m).__name__ in EXPERT_MODULES for p in m.parameters()}


@dataclass(frozen=True)
class ModelSpaceOptions:
    """``vocab_size``: the true vocabulary (None: store Megatron's padded one as is);
    ``divisible_by``: Megatron's ``make_vocab_size_divisible_by``."""

    vocab_size: int | None
    divisible_by: int


def _expand(sd: Any) -> Iterator[tuple[str, Any]]:
    """(state key, ShardedTensor | factory | object) leaves of a nested sharded state dict."""
    if isinstance(sd, dict):
        for k, v in sd.items():
            for kk, leaf in _expand(v):
                yield (f"{k}.{kk}" if kk else str(k)), leaf
    elif isinstance(sd, (list, tuple)):
        for i, v in enumerate(sd):
            for kk, leaf in _expand(v):
                yield (f"{i}.{kk}" if kk else str(i)), leaf
    else:
        yield "", sd


def _sharded_tensors(leaf: Any) -> list[Any]:
    """A ShardedTensor as is; a factory expanded by its own build function into ShardedTensor views."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
    )

    if isinstance(leaf, ShardedTensor):
        return [leaf]
    if isinstance(leaf, ShardedTensorFactory):
        built = leaf.build_fn(leaf.key, leaf.data, leaf.replica_id, None)
        out = [t for _, t in _expand(built)]
        bad = [type(t).__name__ for t in out if not isinstance(t, ShardedTensor)]
        if bad:
            raise StateMismatchError(f"Megatron factory {leaf.key!r} builds {bad}; ckptkit reads factories that build "
                                     "ShardedTensors (GLU fc1, QKV)")
        return out
    return []


def storage_id(t: torch.Tensor) -> int:
    """Identity of the storage ``t`` views (shared by every view of it).

    Not ``data_ptr()``: on the meta device (a model built without memory, as large-layout checks
    and deferred initialisation do) every storage's pointer is 0, so distinct parameters would look
    like views of one another. The storage object's own handle tells them apart on every device."""
    return t.untyped_storage()._cdata


class _Owners:
    """The model's parameters and buffers by storage, sorted by offset: which one holds a declared view.

    A bisection per view, so a model chunk with thousands of parameters (many local experts) costs
    ``n log n``, not a scan of every parameter per view."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        runs: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
        for p in tensors:
            runs.setdefault(storage_id(p), []).append((p.storage_offset(), p.storage_offset() + p.numel(), p))
        self._runs = {k: sorted(v, key=lambda r: (r[0], r[1])) for k, v in runs.items()}
        self._starts = {k: [r[0] for r in v] for k, v in self._runs.items()}

    def owner(self, view: torch.Tensor) -> torch.Tensor:
        key, at = storage_id(view), view.storage_offset()
        runs = self._runs.get(key, [])
        for i in range(bisect_right(self._starts.get(key, []), at) - 1, -1, -1):
            start, stop, p = runs[i]
            if at + view.numel() <= stop:
                return p
        raise LayoutError(f"a ShardedTensor of shape {tuple(view.shape)} is not a view of any model parameter or buffer")


def _tp_axis(param: torch.Tensor, sts: list[Any], prepend: int, key: str) -> int | None:
    """The axis tensor parallelism splits, at any layout.

    Where the declarations are split beyond their prepended (layer, expert) axes, i.e. at tp > 1
    (etp > 1 for experts), that axis is the answer. Megatron's per-parameter attributes
    (``tensor_model_parallel``, ``partition_dim``) are only the fallback for an unsplit layout:
    Megatron sets them on weights only while initialising, so a model built with
    ``perform_initialization=False`` (Megatron-LM's ``--no-initialization``, common when resuming a
    large model) has none, and Megatron-LM's ``get_model`` then defaults them to "not parallel"."""
    split = {i for st in sts for i, f in enumerate(st.axis_fragmentations or ()) if i >= prepend and f > 1}
    if len(split) > 1:
        raise LayoutError(f"{key}: declared split along several axes {sorted(split)}; ckptkit reads one "
                          "tensor-parallel axis per tensor")
    if split:
        return split.pop()
    if getattr(param, "tensor_model_parallel", False):
        return prepend + int(getattr(param, "partition_dim", 0))
    return None


def _rule(tp_axis: int | None, prepend: int, n_parts: int, key: str, vocab: ModelSpaceOptions, global_shape: tuple,
          stage: int | None, expert: bool) -> PartitionRule:
    """How the tensor splits at any layout (``tp_axis`` from :func:`_tp_axis`)."""
    fused = None
    if n_parts > 1:
        if tp_axis is None:
            raise LayoutError(f"{key}: a fused ({n_parts}-part) tensor that is not tensor-parallel")
        part = global_shape[tp_axis] // n_parts
        fused = (part,) * n_parts
    vocab_multiple = vocab.divisible_by if (key in VOCAB_KEYS and vocab.vocab_size is not None) else None
    layer = layer_of(key)
    stacked = prepend - (1 if expert else 0)  # prepended axes besides the expert axis: 1 = the layer axis
    if stacked not in (0, 1) or (stacked == 0 and layer is None and expert) or (stacked == 1 and layer is not None):
        raise LayoutError(f"{key}: declared with {prepend} prepended axes; ckptkit reads Megatron's stacked layers "
                          "([layers, ...], routed experts [layers, experts, ...]) and per-layer keys "
                          "(decoder.layers.<i>., with experts [experts, ...]), not this layout")
    placed: dict[str, int | None] = {"layer_axis": 0} if stacked else \
        ({"layer": layer} if layer is not None else {"stage": stage})
    if expert:
        return PartitionRule(tp_axis=tp_axis, fused=fused, expert_axis=stacked, **placed)
    return PartitionRule(tp_axis=tp_axis, fused=fused, vocab_multiple=vocab_multiple, **placed)


_LAYER_KEY = re.compile(r"^decoder\.layers\.([0-9]+)\.")


def layer_of(key: str) -> int | None:
    """The global layer of a per-layer key: Megatron declares ``decoder.layers.<global layer>.`` instead
    of stacking when layers differ (an MoE layer pattern ``moe_layer_freq``, heterogeneous blocks,
    ``singleton_local_shards``)."""
    m = _LAYER_KEY.match(key)
    return int(m.group(1)) if m else None


def _replica(st: Any, dp_size: int) -> tuple[bool, int]:
    rid = st.replica_id if isinstance(st.replica_id, tuple) else (0, 0, st.replica_id)
    if len(rid) != 3:
        raise StateMismatchError(f"Megatron tensor {st.key!r}: replica_id {st.replica_id} is not (pp, tp, dp)")
    main = rid[0] == 0 and rid[1] == 0
    if not 0 <= rid[2] < dp_size:
        raise StateMismatchError(f"Megatron tensor {st.key!r}: data-parallel replica {rid[2]} outside a group of {dp_size}")
    return main, rid[2]


def chunk_params(chunks: Iterable[Any], vocab: ModelSpaceOptions, dp_sizes: DataParallelSizes) -> tuple[
        list[ParamSpace], list[tuple[int, str, Any]]]:
    """Every declared parameter and buffer of the model chunks with its model space, and the
    ShardedObjects (``_extra_state``) as ``(chunk, state path, object)``."""
    spaces: list[ParamSpace] = []
    objects: list[tuple[int, str, Any]] = []
    for index, chunk in enumerate(chunks):
        model = unwrap(chunk)
        _refuse_transposed_experts(model)
        experts = routed_expert_params(model)
        tensors = [*model.parameters(), *(b for b in model.buffers() if b.numel())]
        owners = _Owners(tensors)
        grouped: dict[int, list[Any]] = {}
        for path, leaf in _expand(model.sharded_state_dict()):
            sts = _sharded_tensors(leaf)
            if not sts:
                if leaf is not None and hasattr(leaf, "key"):
                    objects.append((index, path, leaf))
                continue
            for st in sts:
                owner = owners.owner(st.data)
                grouped.setdefault(id(owner), [owner]).append(st)
        for owner, *sts in grouped.values():
            expert = id(owner) in experts
            spaces.append(_param_space(owner, sts, vocab, dp_sizes.of(expert), n_parts=len(sts), expert=expert))
    return spaces, objects


def _refuse_transposed_experts(model: Any) -> None:
    """``GroupedMLP`` (the legacy grouped-GEMM experts) keeps all local experts in one transposed
    ``[hidden, E_local * ffn / etp]`` weight and declares copies re-laid out to the SequentialMLP model
    space, not views of it: ckptkit could save them but would load into copies. Refused by name; its
    torch_dist checkpoints (same keys and shapes as SequentialMLP's) import through converters/."""
    for name, module in model.named_modules():
        if type(module).__name__ == "GroupedMLP":
            raise StateMismatchError(
                f"Megatron module {name!r} is a GroupedMLP (legacy grouped GEMM, moe_use_legacy_grouped_gemm): "
                "its expert weights are not laid out as the checkpoint's model space, and ckptkit's live adapter "
                "does not transpose them; use SequentialMLP or TEGroupedMLP, or save with Megatron's "
                "dist_checkpointing and import with `ckptkit convert --format megatron`")


def _param_space(param: torch.Tensor, sts: list[Any], vocab: ModelSpaceOptions, dp_size: int,
                 n_parts: int, expert: bool = False) -> ParamSpace:
    first = sts[0]
    key = first.key
    if any(st.key != key for st in sts):
        raise LayoutError(f"a parameter is declared under several keys: {sorted({st.key for st in sts})}")
    prepend = first.prepend_axis_num
    mains = {_replica(st, dp_size) for st in sts}
    if len(mains) != 1:
        raise LayoutError(f"{key}: parts of one parameter disagree about their replica ids")
    main, dp_index = mains.pop()
    row_numel = prod(param.shape[1:]) if param.dim() else 1
    if param.dim() == 0 or not param.is_contiguous():
        raise LayoutError(f"{key}: ckptkit needs a contiguous parameter of rank >= 1, got shape {tuple(param.shape)}")
    segments = []
    for st in sts:
        if tuple(st.data.shape[1:]) != tuple(param.shape[1:]) or (st.data.dim() > 1 and not st.data.is_contiguous()):
            raise LayoutError(f"{key}: a declared part of shape {tuple(st.data.shape)} is not a block of whole rows "
                              f"of its parameter {tuple(param.shape)}")
        rel = st.data.storage_offset() - param.storage_offset()
        if rel % row_numel:
            raise LayoutError(f"{key}: a declared part starts inside a row of its parameter")
        global_shape = tuple(st.global_shape)
        offsets = tuple(st.global_offset)
        segments.extend(_vocab_split(key, rel // row_numel, st.data.shape[0], global_shape, offsets, prepend, vocab))
    stage = 0 if key.startswith("embedding.") else -1
    if not prepend and layer_of(key) is None and key not in VOCAB_KEYS \
            and not key.startswith(("decoder.final", "output_layer", "embedding.")):
        raise LayoutError(f"{key}: a tensor outside the layer stack that ckptkit cannot place on a pipeline stage "
                          "(expected embedding.*, decoder.final_layernorm.*, output_layer.*)")
    rule = _rule(_tp_axis(param, sts, prepend, key), prepend, n_parts, key, vocab, tuple(sts[0].global_shape), stage,
                 expert)
    rules: dict[str, PartitionRule | None] = {key: rule}
    if any(s.tensor.endswith(PADDING_SUFFIX) for s in segments):
        rules[key + PADDING_SUFFIX] = None
    return ParamSpace(key, param, prepend, tuple(segments), main, dp_index, dp_size, rules)


def _vocab_split(key: str, row: int, rows: int, global_shape: tuple, offsets: tuple, prepend: int,
                 vocab: ModelSpaceOptions) -> list[Segment]:
    """One segment, or for a padded vocabulary the real rows and the padding rows apart."""
    if key not in VOCAB_KEYS or vocab.vocab_size is None:
        return [Segment(row, rows, key, global_shape, offsets)]
    v, padded = vocab.vocab_size, global_shape[0]
    if padded < v:
        raise StateMismatchError(f"{key}: the model's vocabulary of {padded} rows is smaller than vocab_size={v}")
    start = offsets[0]
    out = []
    real = max(0, min(start + rows, v) - start)
    rest = global_shape[1:]
    if real:
        out.append(Segment(row, real, key, (v, *rest), offsets))
    if rows - real:
        pad_at = max(start, v) - v
        out.append(Segment(row + real, rows - real, key + PADDING_SUFFIX, (padded - v, *rest), (pad_at, *offsets[1:])))
    return out


def padding_plan(spaces: Iterable[ParamSpace], stored: dict[str, tuple[int, ...]], prefix: str) -> list[ParamSpace]:
    """Clip padding segments to the padding the checkpoint stores; zero the rows it does not have.

    The loading layout may pad the vocabulary more than the saving one did.
    Rows past the saved padding start at zero (a zero output row gives logit
    0; the exporter to Megatron's torch_dist does the same). The padded logits
    enter Megatron's softmax, so a loss is preserved exactly only where the
    padding does not grow: choose ``make_vocab_size_divisible_by`` so it does not.
    """
    out: list[ParamSpace] = []
    for s in spaces:
        keep = []
        fresh = []
        for seg in s.segments:
            if not seg.tensor.endswith(PADDING_SUFFIX):
                keep.append(seg)
                continue
            have = stored.get(prefix + seg.tensor, (0,))[0]
            usable = max(0, min(seg.rows, have - seg.offsets[0]))
            if usable:
                keep.append(Segment(seg.row, usable, seg.tensor, (have, *seg.shape[1:]), seg.offsets))
            if usable < seg.rows:
                fresh.append((seg.row + usable, seg.row + seg.rows))
                with torch.no_grad():
                    s.param[seg.row + usable: seg.row + seg.rows].zero_()
        out.append(replace(s, segments=tuple(keep), fresh_rows=tuple(fresh)))
    return out
