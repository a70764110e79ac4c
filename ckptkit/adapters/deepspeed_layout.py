"""What a DeepSpeed ZeRO engine holds, in model space: its flat groups, their fragments and pieces.

:mod:`ckptkit.adapters.deepspeed` saves and loads through this: the keys (``model/<name>``,
``optimizer/<state>/<name>``), each parameter's space (whole, or an expert's box in the stacked
``[num_experts, ...]`` tensor of DeepSpeed-MoE), the engine's layout checked against
:mod:`ckptkit.layout.zero_partition`, and the state entries of each flat group. DeepSpeed is imported
here only for what the engine exposes (no framework call is made).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ckptkit.adapters.deepspeed_record import scalar_record
from ckptkit.engine.state import Sharded
from ckptkit.errors import LayoutError, StateMismatchError
from ckptkit.layout.box import Box
from ckptkit.layout.pieces import Piece, box_piece, flat_piece
from ckptkit.layout.rules import PartitionRule
from ckptkit.layout.zero_partition import (
    Fragment,
    Zero3SubGroup,
    Zero12Group,
    param_alignment,
)

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


def group_pieces(group: FlatGroup, key: Callable[[str], str]) -> list[Piece]:
    """Flat pieces of the group's fragments (an expert's fragment is a flat run of its box of the stack)."""
    return [flat_piece(key(s.name), s.shape, s.box, f.start, f.stop, local_start=f.local_start)
            for f in group.fragments for s in [group.spaces[f.param]]]


def _lp_pieces(layout: EngineLayout, group: FlatGroup) -> list[tuple[torch.Tensor, list[Piece]]]:
    """The training-dtype weights of a group as (local tensor, pieces)."""
    if group.lp is not None:
        return [(group.lp, group_pieces(group, model_key))]
    out = []
    for name, shape, p in zip(group.names, group.shapes, group.lp_params):
        f = Zero3SubGroup((p.ds_numel,), layout.dp).param_fragment(0, layout.rank)
        if f is not None:
            out.append((p.ds_tensor, [flat_piece(model_key(name), shape, Box.full(shape), f.start, f.stop)]))
    return out


def frozen_and_buffers(engine: Any, layout: EngineLayout) -> dict[str, tuple[torch.Tensor, list[Piece]]]:
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
def shared_parameters(engine: Any) -> dict[str, str]:
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
        entry: dict[str, Any] = {FP32: Sharded(g.fp32, group_pieces(g, lambda n: optim_key(FP32, n)), g.rule)}
        group_scalars: dict[str, Any] = {}
        for key, value in base_state.get(g.fp32, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == g.fp32.shape:
                entry[key] = Sharded(value, group_pieces(g, lambda n, k=key: optim_key(k, n)), g.rule)
            else:
                group_scalars[key] = scalar_record(value, f"DeepSpeed optimizer state {key!r} of group {i}")
        for j, (local, pieces) in enumerate(_lp_pieces(layout, g)):
            entry[f"lp{j}"] = Sharded(local, pieces, g.rule)
        state[f"g{i}"] = entry
        scalars.append(group_scalars)
    return state, scalars
