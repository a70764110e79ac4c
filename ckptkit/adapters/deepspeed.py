"""DeepSpeed ZeRO engines on ckptkit: save straight from the flat partitions, load at any DP size and stage.

    from ckptkit.adapters import deepspeed as ds_ckpt

    handle = ds_ckpt.save(engine, "runs/exp1/step-0000100", client_state={"epoch": 3}, asynchronous=True)
    ...
    client_state = ds_ckpt.load(engine, "runs/exp1/step-0000100")   # any DP size, ZeRO 1/2/3

What a checkpoint holds, in model space (one logical tensor per parameter):

* ``optimizer/fp32/<name>``: the fp32 master weights, saved as flat pieces of
  each rank's flat partition (ZeRO-1/2 ``single_partition_of_fp32_groups``,
  ZeRO-3 ``fp32_partitioned_groups_flat``): no gather at save time, padding
  is not stored;
* ``optimizer/<state>/<name>``: every base-optimizer state tensor shaped like
  the flat partition (Adam's ``exp_avg``, ``exp_avg_sq``, amsgrad's
  ``max_exp_avg_sq``), the same way; scalar states (Adam's ``step``) and the
  param groups' hyper-parameters go to JSON;
* ``model/<name>``: the module's parameters in their training dtype, from the
  bit16 flat partitions (ZeRO-1/2) or each parameter's ``ds_tensor``
  (ZeRO-3), and module buffers (written once across DP replicas);
* the JSON value ``deepspeed``: engine counters (``global_steps``,
  ``global_samples``, ``skipped_steps``, ``micro_steps``), the LR scheduler's
  ``state_dict``, the client state, the saving layout and per-parameter shapes.

Loading fills the target engine's own partitions in place (ckptkit reads the
overlapping stored bytes of each fragment), then lets DeepSpeed re-derive the
training-dtype weights from the fp32 masters exactly as its own loader does
(ZeRO-1/2 ``update_lp_params``; ZeRO-3 copies each sub-group's fp32 partition
into the parameters' ``ds_tensor`` and re-gathers persistent parameters), so
a checkpoint moves between DP sizes and between ZeRO 1/2 and 3, and between
bf16 and fp32 training, directly.

Where the partition facts come from: :mod:`ckptkit.layout.zero_partition`.
Every live engine's layout is checked against it before anything is saved or
loaded. Supported: data parallelism over the whole world (no tensor/pipeline
parallelism), with or without DeepSpeed-MoE expert parallelism at ZeRO 1/2,
no CPU/NVMe offload, bf16 or fp32 (fp16's loss scaler state is not carried:
refused). DeepSpeed is imported here only.

DeepSpeed-MoE (``deepspeed.moe.layer.MoE``): each EP rank holds its local
experts as ``<moe>.deepspeed_moe.experts.deepspeed_experts.{local}.<param>``,
and ZeRO partitions their param group over the expert-data-parallel group.
In model space they follow ckptkit's expert convention (docs/moe.md): one
tensor per weight kind, ``<moe>.deepspeed_moe.experts.deepspeed_experts.<param>``
of shape ``[num_experts, *param]``, the experts stacked along axis 0 by
*global* id (``ep_rank * local + j``, as DeepSpeed's per-expert files number
them) with rule ``PartitionRule(expert_axis=0)``. Each rank saves the flat
fragments of its expert-DP partition as flat pieces of its experts' boxes, so
a checkpoint saved at one EP / DP size loads at any other.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import ckptkit
from ckptkit.adapters.deepspeed_record import (  # FORMAT, META: the record's names, kept importable here
    FORMAT, META, RECORD_KEY, Counters, FrameworkState, RecordSources, SavedLayout, build_record, client_state_record,
    parse_record, scalar_record, scalar_value,
)
from ckptkit.engine.metadata_io import read_manifest
from ckptkit.engine.state import Sharded
from ckptkit.errors import LayoutError, MissingKeysError, OptionsError, StateMismatchError
from ckptkit.layout.box import Box
from ckptkit.layout.pieces import Piece, box_piece, flat_piece
from ckptkit.layout.rules import PartitionRule
from ckptkit.layout.values import decode_value
from ckptkit.layout.zero_partition import (
    Fragment,
    Zero3SubGroup,
    Zero12Group,
    param_alignment,
)
from ckptkit.options import AsyncOptions, LoadOptions
from ckptkit.storage.url import open_store

FP32 = "fp32"
EXPERTS = "deepspeed_moe.experts.deepspeed_experts"
"""Where ``deepspeed.moe.layer.MoE`` keeps its local experts (a ModuleList indexed by local expert id)."""
EXPERT_RULE = PartitionRule(expert_axis=0)


def model_key(name: str) -> str:
    return f"model/{name}"


def optim_key(state: str, name: str) -> str:
    return f"optimizer/{state}/{name}"


@dataclass(frozen=True)
class Space:
    """Where one live parameter sits in model space: the tensor ``name`` of ``shape``, the ``box`` of it
    the parameter is (the whole tensor, or one expert's slice of a stacked expert tensor)."""

    name: str
    shape: tuple[int, ...]
    box: Box

    @staticmethod
    def whole(name: str, shape: tuple[int, ...]) -> Space:
        return Space(name, shape, Box.full(shape))


@dataclass(frozen=True)
class FlatGroup:
    """One flat partition of a live engine: a ZeRO-1/2 group or a ZeRO-3 sub-group on this rank.

    ``names``/``shapes`` are the members' model-space tensors in the group's
    param order (several local experts share one stacked name); ``spaces``
    where each member sits in it; ``fragments`` this rank's pieces of them in
    ``fp32`` (and the optimizer state tensors, which have its shape); ``lp``
    the training-dtype flat partition with the same fragments (ZeRO-1/2) or
    None (ZeRO-3: the members' ``ds_tensor`` s, see ``lp_params``); ``group``
    the base optimizer's param-group index; ``moe`` the expert group's name
    (``ep_size_2``) for an expert param group, whose partitions span the
    expert-DP group, else None.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    fragments: tuple[Fragment, ...]
    fp32: torch.Tensor
    lp: torch.Tensor | None
    lp_params: tuple[Any, ...]
    group: int
    spaces: tuple[Space, ...] = ()
    moe: str | None = None

    @property
    def rule(self) -> PartitionRule | None:
        return EXPERT_RULE if self.moe is not None else None


@dataclass(frozen=True)
class EngineLayout:
    """What ckptkit needs of a live engine: its stage, DP size and rank, and its flat partitions."""

    stage: int
    dp: int
    rank: int
    groups: tuple[FlatGroup, ...]
    lp_dtype: torch.dtype
    experts: Mapping[int, Space] | None = None
    """Model-space place of every local expert parameter (by ``id``); empty without MoE layers."""
    expert_meta: Mapping[str, Any] | None = None
    """Per stacked expert tensor: MoE layer, number of experts, EP size (recorded in the checkpoint)."""


# ------------------------------------------------------------------ layout
def _names(engine: Any) -> dict[int, str]:
    return {id(p): n for n, p in engine.module.named_parameters()}


def _shape(p: Any) -> tuple[int, ...]:
    return tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)


def _check_supported(engine: Any) -> None:
    stage = engine.zero_optimization_stage()
    where = f"DeepSpeed engine (rank {dist.get_rank() if dist.is_initialized() else 0})"
    if stage not in (1, 2, 3):
        raise StateMismatchError(f"{where}: ZeRO stage {stage}; ckptkit's DeepSpeed adapter needs ZeRO stage 1, 2 or 3")
    kind = type(engine.optimizer).__name__
    if kind not in ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3"):
        raise StateMismatchError(
            f"{where}: optimizer wrapper {kind} (e.g. BF16_Optimizer, which DeepSpeed picks for ZeRO-1 with bf16 "
            "parameters and fp32 gradient accumulation); ckptkit's DeepSpeed adapter reads DeepSpeedZeroOptimizer "
            "and DeepSpeedZeroOptimizer_Stage3 partitions")
    if engine.fp16_enabled():
        raise StateMismatchError(f"{where}: fp16 training; the dynamic loss scaler's state is not carried by "
                                 "ckptkit's DeepSpeed adapter (use bf16 or fp32)")
    if engine.zero_cpu_offload() or engine.zero_nvme_offload_optimizer():
        raise StateMismatchError(f"{where}: optimizer offload is not supported by ckptkit's DeepSpeed adapter")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if engine.mpu is not None or engine.dp_world_size != world:
        raise StateMismatchError(
            f"{where}: data-parallel size {engine.dp_world_size} in a world of {world} (tensor or pipeline "
            "parallelism); ckptkit's DeepSpeed adapter supports data parallelism over the whole world (with or "
            "without MoE expert parallelism)")
    if getattr(engine, "has_moe_layers", False) and stage == 3:
        raise StateMismatchError(f"{where}: MoE layers with ZeRO stage 3; ckptkit's DeepSpeed adapter handles "
                                 "DeepSpeed-MoE expert groups at ZeRO stage 1 and 2")


def expert_spaces(engine: Any) -> tuple[dict[int, Space], dict[str, Any]]:
    """Every local expert parameter of the engine's ``deepspeed.moe.layer.MoE`` layers -> its box of the
    stacked model-space tensor (global expert id ``ep_rank * num_local_experts + j``, DeepSpeed's own
    numbering of its per-expert files), and per stacked tensor what the checkpoint records of it."""
    if not getattr(engine, "has_moe_layers", False):
        return {}, {}
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    spaces: dict[int, Space] = {}
    meta: dict[str, Any] = {}
    layer = 0
    for mname, module in engine.module.named_modules():
        if not isinstance(module, MoE):
            continue
        if getattr(module, "enable_expert_tensor_parallelism", False):
            raise StateMismatchError(f"DeepSpeed MoE layer {mname!r}: expert tensor parallelism is not supported")
        local, total = module.num_local_experts, module.num_experts
        ep_rank = groups._get_expert_parallel_rank(module.expert_group_name)
        prefix = f"{mname}.{EXPERTS}" if mname else EXPERTS
        for j, expert in enumerate(module.deepspeed_moe.experts.deepspeed_experts):
            e = ep_rank * local + j
            for pname, p in expert.named_parameters():
                shape = tuple(p.shape)
                name = f"{prefix}.{pname}"
                spaces[id(p)] = Space(name, (total, *shape), Box((e,) + (0,) * len(shape), (1, *shape)))
                meta[name] = {"layer": layer, "module": prefix, "param": pname, "num_experts": total,
                              "ep": module.ep_size, "group": module.expert_group_name}
        layer += 1
    return spaces, meta


def engine_layout(engine: Any) -> EngineLayout:
    """This rank's flat partitions, each checked against :mod:`ckptkit.layout.zero_partition`."""
    _check_supported(engine)
    opt = engine.optimizer
    stage = engine.zero_optimization_stage()
    experts, expert_meta = expert_spaces(engine)
    names = _names(engine)
    spaces = {i: experts.get(i) or Space.whole(n, _shape(p))
              for n, p in engine.module.named_parameters() for i in [id(p)]}
    dp = engine.dp_world_size
    rank = dist.get_rank(group=engine.data_parallel_group) if dist.is_initialized() else 0
    groups = []
    if stage < 3:
        for g, params in enumerate(opt.bit16_groups):
            moe = None
            g_dp, g_rank = dp, rank
            if experts and opt.is_moe_param_group[g]:  # partitioned over the expert-data-parallel group
                moe = str(opt.optimizer.param_groups[g]["name"])
                g_dp = dist.get_world_size(group=opt.real_dp_process_group[g])
                g_rank = dist.get_rank(group=opt.real_dp_process_group[g])
                outside = [names[id(p)] for p in params if id(p) not in experts]
                if outside or g_dp != opt.partition_count[g]:
                    raise _mismatch(f"expert param group {g} ({moe})", "expert parameters only, partitioned over "
                                    f"{g_dp} ranks", f"non-expert {outside[:3]}, partition count {opt.partition_count[g]}")
            elif any(id(p) in experts for p in params):
                raise StateMismatchError(
                    f"DeepSpeed engine (rank {rank}): param group {g} mixes expert parameters "
                    f"({[names[id(p)] for p in params if id(p) in experts][:3]}) into a non-MoE group; build the "
                    "optimizer with deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer")
            groups.append(_zero12_group(opt, g, params, spaces, g_dp, g_rank, moe))
        lp_dtype = opt.bit16_groups[0][0].dtype
    else:
        for j, params in enumerate(opt.fp16_groups):
            groups.append(_zero3_group(opt, j, params, names, dp, rank))
        lp_dtype = opt.fp16_groups[0][0].ds_tensor.dtype
    return EngineLayout(stage, dp, rank, tuple(groups), lp_dtype, experts, expert_meta)


def _mismatch(what: str, ours: Any, theirs: Any) -> LayoutError:
    return LayoutError(f"DeepSpeed layout differs from ckptkit's model of it (ckptkit/layout/zero_partition.py): "
                       f"{what}: ckptkit computes {ours}, the engine has {theirs}")


def _zero12_group(opt: Any, g: int, params: list, spaces: dict[int, Space], dp: int, rank: int,
                  moe: str | None) -> FlatGroup:
    flat_params = opt.round_robin_bit16_groups[g]
    position = {id(p): i for i, p in enumerate(params)}
    order = tuple(position[id(p)] for p in flat_params)
    offsets_engine = list(opt.round_robin_bit16_offsets[g])
    numels = tuple(p.numel() for p in params)
    # per-parameter padding shows only where a parameter ends off the alignment; none at all means 1 is exact
    align = param_alignment(params[0].element_size(), any(opt.round_robin_bit16_padding[g]))
    layout = Zero12Group(numels, dp, order, align)
    ours = [layout.offsets[i] for i in order]
    fp32 = opt.single_partition_of_fp32_groups[g]
    if ours != offsets_engine:
        raise _mismatch(f"group {g} parameter offsets", ours, offsets_engine)
    if layout.partition_numel != fp32.numel() or layout.padding(rank) != opt.groups_padding[g]:
        raise _mismatch(f"group {g} rank {rank} partition (numel, padding)",
                        (layout.partition_numel, layout.padding(rank)), (fp32.numel(), opt.groups_padding[g]))
    lp = opt.parallel_partitioned_bit16_groups[g][rank]
    members = tuple(spaces[id(p)] for p in params)
    return FlatGroup(tuple(s.name for s in members), tuple(s.shape for s in members),
                     tuple(layout.fragments(rank)), fp32, lp, tuple(params), g, members, moe)


def _zero3_group(opt: Any, j: int, params: list, names: dict[int, str], dp: int, rank: int) -> FlatGroup:
    layout = Zero3SubGroup(tuple(p.ds_numel for p in params), dp)
    theirs = tuple(p.ds_tensor.ds_numel for p in params)
    if layout.partition_numels != theirs:
        raise _mismatch(f"sub-group {j} ds_tensor sizes", layout.partition_numels, theirs)
    fp32 = opt.fp32_partitioned_groups_flat[j]
    if fp32.numel() != layout.partition_numel:
        raise _mismatch(f"sub-group {j} fp32 partition numel", layout.partition_numel, fp32.numel())
    shapes = tuple(_shape(p) for p in params)
    return FlatGroup(tuple(names[id(p)] for p in params), shapes, tuple(layout.fragments(rank)), fp32, None,
                     tuple(params), opt.sub_group_to_group_id[j],
                     tuple(Space.whole(names[id(p)], s) for p, s in zip(params, shapes)))


def _pieces(group: FlatGroup, key: Callable[[str], str]) -> list[Piece]:
    """Flat pieces of the group's fragments (an expert's fragment is a flat run of its box of the stack)."""
    return [flat_piece(key(s.name), s.shape, s.box, f.start, f.stop, local_start=f.local_start)
            for f in group.fragments for s in [group.spaces[f.param]]]


def _lp_pieces(layout: EngineLayout, group: FlatGroup) -> list[tuple[torch.Tensor, list[Piece]]]:
    """The training-dtype weights of a group as (local tensor, pieces)."""
    if group.lp is not None:
        return [(group.lp, _pieces(group, model_key))]
    out = []
    for name, shape, p in zip(group.names, group.shapes, group.lp_params):
        f = Zero3SubGroup((p.ds_numel,), layout.dp).param_fragment(0, layout.rank)
        if f is not None:
            out.append((p.ds_tensor, [flat_piece(model_key(name), shape, Box.full(shape), f.start, f.stop)]))
    return out


def _frozen_and_buffers(engine: Any, layout: EngineLayout) -> dict[str, tuple[torch.Tensor, list[Piece]]]:
    """Module tensors no optimizer group holds: frozen parameters and buffers, by model key."""
    optimized = {id(p) for g in layout.groups for p in g.lp_params}
    out = {}
    for name, p in engine.module.named_parameters():
        if id(p) in optimized:
            continue
        if layout.experts and id(p) in layout.experts:
            raise StateMismatchError(f"DeepSpeed engine: expert parameter {name!r} is in no optimizer group (frozen "
                                     "expert parameters are not supported by ckptkit's DeepSpeed adapter)")
        shape = _shape(p)
        if hasattr(p, "ds_tensor"):
            f = Zero3SubGroup((p.ds_numel,), layout.dp).param_fragment(0, layout.rank)
            pieces = [] if f is None else [flat_piece(model_key(name), shape, Box.full(shape), f.start, f.stop)]
            out[model_key(name)] = (p.ds_tensor, pieces)
        else:
            out[model_key(name)] = (p.data, [box_piece(model_key(name), shape, (0,) * len(shape), shape,
                                                       replica=(layout.rank, layout.dp))])
    for name, b in engine.module.named_buffers():
        if layout.experts and f"{EXPERTS}." in name:
            raise StateMismatchError(f"DeepSpeed engine: expert buffer {name!r}; buffers of routed experts differ "
                                     "per EP rank and are not supported by ckptkit's DeepSpeed adapter")
        shape = tuple(b.shape)
        out[model_key(name)] = (b, [box_piece(model_key(name), shape, (0,) * len(shape), shape,
                                              replica=(layout.rank, layout.dp))])
    return out


# -------------------------------------------------------------------- save
def _shared(engine: Any) -> dict[str, str]:
    """Tied parameters: every alias name -> the name ``named_parameters`` reports (zero_to_fp32 adds aliases)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def group_entries(layout: EngineLayout, base_state: Mapping[Any, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Each flat partition's fp32 masters, base-optimizer state tensors and training-dtype weights as Sharded
    declarations, and each group's scalar state (apart, so tests/scale_zero3.py declares 512 ranks' partitions)."""
    state: dict[str, Any] = {}
    scalars: list[dict[str, Any]] = []
    for i, g in enumerate(layout.groups):
        entry: dict[str, Any] = {FP32: Sharded(g.fp32, _pieces(g, lambda n: optim_key(FP32, n)), g.rule)}
        group_scalars: dict[str, Any] = {}
        for key, value in base_state.get(g.fp32, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == g.fp32.shape:
                entry[key] = Sharded(value, _pieces(g, lambda n, k=key: optim_key(k, n)), g.rule)
            else:
                group_scalars[key] = scalar_record(value, f"DeepSpeed optimizer state {key!r} of group {i}")
        for j, (local, pieces) in enumerate(_lp_pieces(layout, g)):
            entry[f"lp{j}"] = Sharded(local, pieces, g.rule)
        state[f"g{i}"] = entry
        scalars.append(group_scalars)
    return state, scalars


def engine_state(engine: Any, client_state: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ckptkit state of a live engine (see the module docstring); tensors are the engine's own."""
    layout = engine_layout(engine)
    if engine.micro_steps % engine.gradient_accumulation_steps():
        raise StateMismatchError(
            f"DeepSpeed engine: micro step {engine.micro_steps} is inside a gradient-accumulation window of "
            f"{engine.gradient_accumulation_steps()}; save after engine.step() completes a global step")
    state, scalars = group_entries(layout, engine.optimizer.optimizer.state)
    for key, (local, pieces) in _frozen_and_buffers(engine, layout).items():
        state[key] = Sharded(local, pieces)
    state_keys = sorted({k for e in state.values() if isinstance(e, dict) for k in e
                         if not k.startswith("lp") and k != FP32})
    state[META] = json.dumps(_engine_record(engine, layout, scalars, state_keys, client_state or {}))
    return {"deepspeed_engine": state}


def _engine_record(engine: Any, layout: EngineLayout, scalars: list[dict[str, Any]], state_keys: list[str],
                   client_state: Mapping[str, Any]) -> dict[str, Any]:
    """The ``deepspeed`` record of a live engine, through the builder the importer calls too
    (:func:`ckptkit.adapters.deepspeed_record.build_record`): one set of keys and rules for both."""
    where = "DeepSpeed engine"
    kept, refused = client_state_record(client_state, where)
    if refused:  # the caller can fix its client state; an import of a native folder lists them instead
        raise next(iter(refused.values()))
    optimized = {id(q) for g in layout.groups for q in g.lp_params}
    saved = SavedLayout(
        zero_stage=layout.stage, dp=layout.dp, lp_dtype=layout.lp_dtype,
        flat_groups=[{"group": g.group, "names": list(dict.fromkeys(g.names)), "moe": g.moe} for g in layout.groups],
        param_shapes={n: list(sh) for g in layout.groups for n, sh in zip(g.names, g.shapes)},
        optimizer_scalars=scalars, optimizer_state_keys=state_keys,
        buffers=[n for n, _ in engine.module.named_buffers()],
        frozen=[n for n, p in engine.module.named_parameters() if id(p) not in optimized],
        shared=_shared(engine), experts=dict(layout.expert_meta or {}))
    counters = Counters(engine.global_steps, engine.global_samples, engine.skipped_steps, engine.micro_steps,
                        engine.gradient_accumulation_steps())
    sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    return build_record(saved, counters, FrameworkState(engine.optimizer.optimizer.param_groups, sched, engine.config,
                                                        kept, RecordSources(where, where)))


def save(engine: Any, path: str | os.PathLike[str], *, client_state: Mapping[str, Any] | None = None,
         asynchronous: bool = False, options: AsyncOptions = AsyncOptions(),
         storage_options: dict[str, Any] | None = None) -> Any:
    """Save ``engine`` to ``path`` (collective). Synchronous: returns the SaveResult. Asynchronous:
    returns a :class:`ckptkit.SaveHandle` once the snapshot is taken; training may continue at once.
    With ``options=AsyncOptions(snapshot="overlap")`` it returns before the copy, and the engine's
    next optimizer step waits for it (:func:`guards`)."""
    state = engine_state(engine, client_state)
    if asynchronous:
        guard = guards(engine) if options.snapshot == "overlap" else None
        return ckptkit.save_async(state, path, options=options, storage_options=storage_options, guard=guard)
    return ckptkit.save(state, path, storage_options=storage_options)


def guards(engine: Any) -> list[Any]:
    """What guards an overlapped snapshot of ``engine``: the base torch optimizer inside its ZeRO
    optimizer. ``engine.step()`` changes the saved state (fp32 masters, moments, then the bit16
    partitions copied from the masters) only inside or after the base optimizer's ``step``, which
    ZeRO calls once per parameter group; backward and gradient accumulation touch gradients only."""
    inner = getattr(getattr(engine, "optimizer", None), "optimizer", None)
    if inner is None or not callable(getattr(inner, "register_step_pre_hook", None)):
        raise OptionsError(
            "snapshot='overlap' needs the DeepSpeed engine's base torch optimizer (engine.optimizer.optimizer) "
            f"to hook its step, and this engine has {type(inner).__name__ if inner is not None else 'none'}; "
            "use snapshot='blocking'")
    return [inner]


# -------------------------------------------------------------------- load
def read_meta(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``deepspeed`` JSON record of a checkpoint (read from its manifest; no tensor is touched)."""
    store = open_store(path, storage_options)
    manifest = read_manifest(store)
    if RECORD_KEY not in manifest.values:
        raise MissingKeysError(f"{store.url}: not a checkpoint of ckptkit's DeepSpeed adapter "
                               f"(no {RECORD_KEY!r} value)")
    meta = parse_record(decode_value(manifest.values[RECORD_KEY], f"{store.url}: {RECORD_KEY}"), store.url)
    meta["_tensors"] = set(manifest.tensors)
    return meta


_GROUP_IDENTITY = ("name", "moe")
"""Param-group keys that say which group it is, not how it trains: DeepSpeed-MoE names an expert group
after its EP size (``ep_size_2``) and looks its process groups up by that name, so a resume at another
EP size keeps its own."""


def _prime_state(base: Any, g: FlatGroup, keys: list[str], scalars: Mapping[str, Any]) -> dict[str, Any]:
    """The base optimizer's state for ``g``, created like the checkpoint's when the optimizer has not stepped."""
    st = base.state.setdefault(g.fp32, {})
    for key in keys:
        if key not in st:
            st[key] = torch.zeros_like(g.fp32, memory_format=torch.preserve_format)
    for key, rec in scalars.items():
        if rec["dtype"] is None:
            st[key] = rec["value"]
        elif key in st and isinstance(st[key], torch.Tensor):
            st[key].fill_(rec["value"])
        else:
            st[key] = scalar_value(rec)
    return st


def load(engine: Any, path: str | os.PathLike[str], *, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True, options: LoadOptions = LoadOptions(),
         storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load a checkpoint of this adapter into ``engine`` (collective), at this engine's DP size, ZeRO
    stage and MoE expert-parallel size, whatever the saving job's were. Returns the client state."""
    meta = read_meta(path, storage_options)
    layout = engine_layout(engine)
    base = engine.optimizer.optimizer
    where = str(path)
    need = [optim_key(FP32, n) for g in layout.groups for n in dict.fromkeys(g.names)]
    keys = list(meta["optimizer_state_keys"]) if load_optimizer_states else []
    need += [optim_key(k, n) for k in keys for g in layout.groups for n in dict.fromkeys(g.names)]
    frozen = _frozen_and_buffers(engine, layout)
    need += list(frozen)
    missing = sorted(k for k in need if k not in meta["_tensors"])
    if missing:
        raise MissingKeysError(f"{where}: {len(missing)} tensor(s) this engine needs are not in the checkpoint: "
                               f"{', '.join(repr(k) for k in missing[:8])}")
    saved_scalars = {n: meta["optimizer_scalars"][i] for i, fg in enumerate(meta["flat_groups"]) for n in fg["names"]}
    if engine.zero_optimization_stage() == 3:
        engine.optimizer.checkpoint_event_prologue()
    state: dict[str, Any] = {}
    for i, g in enumerate(layout.groups):
        entry: dict[str, Any] = {FP32: Sharded(g.fp32, _pieces(g, lambda n: optim_key(FP32, n)), g.rule)}
        if load_optimizer_states:
            scalars = {}
            for n in g.names:  # every member of a flat group shares its scalars; check the checkpoint agrees
                if scalars and saved_scalars[n] != scalars:
                    raise StateMismatchError(f"{where}: optimizer scalars of {n!r} ({saved_scalars[n]}) differ from "
                                             f"those of its new flat group ({scalars}); cannot merge them")
                scalars = saved_scalars[n]
            st = _prime_state(base, g, keys, scalars)
            for key in keys:
                entry[key] = Sharded(st[key], _pieces(g, lambda n, k=key: optim_key(k, n)), g.rule)
        state[f"g{i}"] = entry
    for key, (local, pieces) in frozen.items():
        state[key] = Sharded(local, pieces)
    ckptkit.load({"deepspeed_engine": state}, path, strict=False, options=options, storage_options=storage_options)
    _restore_training_dtype(engine, layout)
    if load_optimizer_states:
        saved_groups = meta["param_groups"]
        if len(saved_groups) != len(base.param_groups):
            raise StateMismatchError(f"{where}: {len(saved_groups)} optimizer param group(s) saved, the engine has "
                                     f"{len(base.param_groups)}")
        for pg, saved in zip(base.param_groups, saved_groups):
            for k, v in saved.items():
                if k in _GROUP_IDENTITY:
                    continue
                pg[k] = tuple(v) if isinstance(pg.get(k), tuple) else v
    if load_lr_scheduler_states and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    engine.global_steps = meta["global_steps"]
    engine.global_samples = meta["global_samples"]
    engine.skipped_steps = meta["skipped_steps"]
    engine.micro_steps = meta["global_steps"] * engine.gradient_accumulation_steps()
    return meta["client_state"]


@torch.no_grad()
def _restore_training_dtype(engine: Any, layout: EngineLayout) -> None:
    """Re-derive the training-dtype weights from the loaded fp32 masters, as DeepSpeed's own loader does."""
    opt = engine.optimizer
    if layout.stage < 3:
        opt.update_lp_params()  # copy this rank's fp32 partition into its bit16 slice, then all-gather
        return
    for g in layout.groups:
        at = 0
        for p in g.lp_params:  # (fp32 training: ds_tensor may be this very slice; the copy is then a no-op)
            n = p.ds_tensor.ds_numel
            p.ds_tensor.data.copy_(g.fp32.narrow(0, at, n))
            at += n
    opt.checkpoint_event_epilogue()  # re-gathers persistent parameters from their partitions


# --------------------------------------------------------------- manager
class DeepSpeedCheckpointer:
    """Periodic checkpoints of one engine through :class:`ckptkit.CheckpointManager`.

    Step folders (``step-0000100``) named by ``engine.global_steps``, retention
    (``keep_last``) and asynchronous saves come from the manager; this class
    supplies the engine's state and restores it at whatever DP size and ZeRO
    stage the resuming job has::

        ckpt = DeepSpeedCheckpointer(engine, "runs/exp1", every_steps=500, keep_last=3)
        client_state = ckpt.restore_latest() or {}
        for batch in loader:
            ...; engine.step()
            ckpt.maybe_save(client_state={"epoch": epoch})
        ckpt.close()
    """

    def __init__(self, engine: Any, root: str, *, every_steps: int | None = None, keep_last: int | None = None,
                 asynchronous: bool = True, options: AsyncOptions = AsyncOptions(),
                 storage_options: dict[str, Any] | None = None) -> None:
        self.engine = engine
        self.storage_options = storage_options
        self.manager = ckptkit.CheckpointManager(
            root, save=ckptkit.SavePolicy(every_steps=every_steps), keep=ckptkit.RetentionPolicy(keep_last=keep_last),
            asynchronous=options if asynchronous else None, storage_options=storage_options,
            guard=guards(engine) if asynchronous and options.snapshot == "overlap" else None)

    def maybe_save(self, *, client_state: Mapping[str, Any] | None = None) -> Any:
        """Save if ``every_steps`` says so at ``engine.global_steps``; the handle, or None."""
        if not self.manager.should_save(self.engine.global_steps):
            return None
        return self.save(client_state=client_state)

    def save(self, *, client_state: Mapping[str, Any] | None = None) -> Any:
        """Save now (blocks only for the snapshot when asynchronous)."""
        return self.manager.save(self.engine.global_steps, engine_state(self.engine, client_state))

    def restore_latest(self) -> dict[str, Any] | None:
        """Load the newest step every rank sees committed; its client state, or None if there is none."""
        step = self.manager.latest_common_step()
        if step is None:
            return None
        return load(self.engine, self.manager.step_url(step), storage_options=self.storage_options)

    def wait(self) -> None:
        self.manager.wait()

    def close(self) -> None:
        """Wait for the last save; raise a background failure."""
        self.manager.close()
