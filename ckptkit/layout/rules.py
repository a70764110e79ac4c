"""Partition rules: how a logical tensor is split, as a function of the parallel degrees.

A grid layout describes the layout that *was*; a rule describes the layout
that *would be* at any :class:`ParallelConfig`. The manifest keeps both, so
``ckptkit reshard --to tp4pp2`` can compute every target rank's pieces
without the framework. Rules are data (frozen dataclasses, JSON round trip),
evaluated into :class:`GridLayout` s.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ckptkit.errors import LayoutError
from ckptkit.layout.strict_json import MAX_LAYOUT_INT
from ckptkit.layout.config import ParallelConfig
from ckptkit.layout.grid import Fused, GridLayout, On, Placement, Replicate, Shard


@dataclass(frozen=True)
class PartitionRule:
    """One logical tensor's partitioning, independent of the degrees.

    * ``tp_axis``: split over tensor parallelism along this axis (column
      parallel: 0, row parallel: 1); None: replicated over TP.
    * ``fused``: model-space sizes of fused parts along ``tp_axis``, each
      split over TP on its own (SwiGLU ``[gate; up]``).
    * ``vocab_multiple``: ``tp_axis`` is padded to a multiple of
      ``vocab_multiple * tp`` (Megatron's ``make_vocab_size_divisible_by``);
      the padding is not model space.
    * ``layer``: the tensor belongs to this global layer and lives on the
      pipeline stage that owns it; ``stage``: lives on this stage (negative
      counts from the last: embeddings on 0, the output layer on -1);
      ``layer_axis``: layers are stacked along this axis and split by the stage
      assignment. None of the three: replicated over PP.
    * ``expert`` / ``num_experts``: lives on the EP rank owning expert
      ``expert``; ``expert_axis``: experts stacked along this axis, split
      over EP (ckptkit's model-space convention for routed experts, see
      docs/moe.md). Either makes the tensor an expert tensor: it is laid out
      on the expert mesh, ``tp_axis`` splits over the expert TP degree
      (``etp``) and ``dp_axis`` over expert data parallel.
    * ``dp_axis``: additionally sharded over the data-parallel group along
      this axis (ZeRO-3 / FSDP style optimizer or parameter sharding).
    * ``chunked``: splits follow ``torch.chunk`` (DTensor's sizing): an axis need
      not split evenly. Megatron-style rules (False) refuse uneven splits, as
      Megatron does.
    """

    tp_axis: int | None = None
    fused: tuple[int, ...] | None = None
    vocab_multiple: int | None = None
    layer: int | None = None
    stage: int | None = None
    layer_axis: int | None = None
    expert: int | None = None
    num_experts: int | None = None
    expert_axis: int | None = None
    dp_axis: int | None = None
    chunked: bool | None = None

    def __post_init__(self) -> None:
        placed = [x for x in (self.layer, self.stage, self.layer_axis) if x is not None]
        if len(placed) > 1:
            raise LayoutError("a rule takes at most one of layer, stage and layer_axis")
        if (self.fused is not None or self.vocab_multiple is not None) and self.tp_axis is None:
            raise LayoutError("fused parts and vocab padding apply along tp_axis; set tp_axis")
        if self.expert is not None and self.num_experts is None:
            raise LayoutError("an expert rule needs num_experts")
        if self.expert is not None and self.expert_axis is not None:
            raise LayoutError("a rule takes expert or expert_axis, not both")

    def check_shape(self, shape: tuple[int, ...]) -> None:
        """Raise :class:`LayoutError` unless the rule fits a tensor of ``shape`` (its axes inside it, its
        fused parts summing to its ``tp_axis``): what :meth:`evaluate` needs at every layout. Checked when
        a save is merged, since a rule that does not fit used to commit and fail every reshard later."""
        ndim = len(shape)
        for name in ("tp_axis", "layer_axis", "expert_axis", "dp_axis"):
            axis = getattr(self, name)
            if axis is not None and not (0 <= axis < ndim):
                raise LayoutError(f"rule {name}={axis} is outside a tensor of shape {list(shape)}")
        if self.fused is not None and sum(self.fused) != shape[self.tp_axis]:  # type: ignore[index]
            raise LayoutError(f"fused parts {list(self.fused)} do not sum to axis {self.tp_axis} of {list(shape)}")

    def evaluate(self, shape: tuple[int, ...], config: ParallelConfig, num_layers: int | None = None) -> GridLayout:
        """The grid layout of a tensor of model-space ``shape`` under ``config``."""
        shape = tuple(shape)
        self.check_shape(shape)
        padded = None
        fused = None
        if self.tp_axis is not None and self.vocab_multiple is not None:
            multiple = self.vocab_multiple * config.tp
            n = shape[self.tp_axis]
            padded_list = list(shape)
            padded_list[self.tp_axis] = -(-n // multiple) * multiple
            padded = tuple(padded_list)
        if self.fused is not None:
            for part in self.fused:
                if part % config.tp and not self.is_expert:
                    raise LayoutError(f"fused part of {part} does not split evenly over tp={config.tp}")
            fused = Fused(self.tp_axis, self.fused)  # type: ignore[arg-type]

        pp: Placement = Replicate()
        if self.layer is not None:
            if num_layers is None:
                raise LayoutError("a per-layer rule needs the model's number of layers")
            pp = On(config.layer_owner(self.layer, num_layers)[0])
        elif self.stage is not None:
            stage = self.stage % config.pp
            pp = On(stage)
        elif self.layer_axis is not None:
            n = shape[self.layer_axis]
            pp = Shard(self.layer_axis, sizes=config.chunk_layers(n))
        if self.is_expert:
            return self._expert_layout(shape, config, pp, fused)
        tp_size = config.tp
        # dense mesh (config.MESH_DIMS): pp, dp, cp, tp
        dp_sf = tp_size if (self.dp_axis is not None and self.dp_axis == self.tp_axis and tp_size > 1) else 1
        dp: Placement = Shard(self.dp_axis, split_factor=dp_sf) if self.dp_axis is not None else Replicate()
        self._check_even_tp(shape, tp_size, fused is not None or padded is not None)
        tp: Placement = Shard(self.tp_axis) if self.tp_axis is not None else Replicate()
        return GridLayout(config.mesh(), (pp, dp, Replicate(), tp), shape, padded, fused)

    @property
    def is_expert(self) -> bool:
        """A routed expert's tensor: laid out on the expert mesh (EP, and ETP for ``tp_axis``)."""
        return self.expert is not None or self.expert_axis is not None

    def _expert_layout(self, shape: tuple[int, ...], config: ParallelConfig, pp: Placement,
                       fused: Fused | None) -> GridLayout:
        """Expert mesh (config.EXPERT_MESH_DIMS): pp, edp, ep, etp. ``tp_axis`` splits over the expert TP
        degree and ``dp_axis`` over expert data parallel, as Megatron's expert groups do."""
        etp = config.expert_tp
        if self.vocab_multiple is not None:
            raise LayoutError("an expert tensor has no vocabulary padding")
        if fused is not None:
            for part in fused.parts:
                if part % etp:
                    raise LayoutError(f"fused expert part of {part} does not split evenly over etp={etp}")
        if self.expert is not None:
            if self.num_experts % config.ep:  # type: ignore[operator]
                raise LayoutError(f"{self.num_experts} experts do not split evenly over ep={config.ep}")
            ep: Placement = On(self.expert // (self.num_experts // config.ep))  # type: ignore[operator]
        else:
            if shape[self.expert_axis] % config.ep:  # type: ignore[index]
                raise LayoutError(f"{shape[self.expert_axis]} experts do not split evenly over ep={config.ep}")  # type: ignore[index]
            ep = Shard(self.expert_axis)  # type: ignore[arg-type]
        # FSDP inside the EP region shards within each EP (and ETP) rank's part of its axis
        dp_sf = 1
        if self.dp_axis is not None:
            dp_sf *= etp if self.dp_axis == self.tp_axis else 1
            dp_sf *= config.ep if self.dp_axis == self.expert_axis else 1
        edp: Placement = Shard(self.dp_axis, split_factor=dp_sf) if self.dp_axis is not None else Replicate()
        self._check_even_tp(shape, etp, fused is not None)
        tp: Placement = Shard(self.tp_axis) if self.tp_axis is not None else Replicate()
        return GridLayout(config.expert_mesh(), (pp, edp, ep, tp), shape, None, fused)

    def _check_even_tp(self, shape: tuple[int, ...], size: int, sized_elsewhere: bool) -> None:
        if self.tp_axis is not None and not sized_elsewhere and shape[self.tp_axis] % size and not self.chunked:
            raise LayoutError(f"axis {self.tp_axis} of {list(shape)} does not split evenly over tp={size}")

    def to_json(self) -> dict:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None:
                out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @staticmethod
    def from_json(value: object) -> PartitionRule:
        if not isinstance(value, dict):
            raise LayoutError(f"expected a partition rule object, got {value!r}")
        known = {f.name for f in fields(PartitionRule)}
        unknown = set(value) - known
        if unknown:
            raise LayoutError(f"partition rule has unknown fields {sorted(unknown)}")
        kwargs = {}
        for k, v in value.items():
            if k == "fused":
                if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                      and 0 <= x <= MAX_LAYOUT_INT for x in v):
                    raise LayoutError(f"partition rule field fused must be a list of sizes, got {str(v)[:80]}")
                kwargs[k] = tuple(v)
            elif k == "chunked" and v is not None:
                if not isinstance(v, bool):
                    raise LayoutError(f"partition rule field chunked={str(v)[:80]} must be true or false")
                kwargs[k] = v
            elif v is not None:
                if not isinstance(v, int) or isinstance(v, bool) or abs(v) > MAX_LAYOUT_INT:
                    raise LayoutError(f"partition rule field {k}={str(v)[:80]} must be an integer")
                kwargs[k] = v
        return PartitionRule(**kwargs)


# Mesh-dimension names, as torchtitan, FSDP2 and TP examples name them, that say what a DTensor's
# Shard placement along that dimension means in ParallelConfig terms.
TP_DIM_NAMES = frozenset({"tp", "tensor", "tensor_parallel", "model"})
DP_SHARD_DIM_NAMES = frozenset({"dp", "dp_shard", "dp_shard_cp", "fsdp", "shard", "data", "data_parallel"})
# Expert parallelism (torchtitan's sparse mesh: "ep", and FSDP inside the EP region: "efsdp"; the
# names of earlier torchtitan releases too).
EP_DIM_NAMES = frozenset({"ep", "expert", "expert_parallel"})
EDP_DIM_NAMES = frozenset({"efsdp", "edp", "expert_dp", "dp_shard_mod_ep", "dp_shard_in_ep"})


def rule_from_grid(layout: GridLayout, expert_axis: int | None = None) -> PartitionRule | None:
    """The degree-independent rule of a DTensor-style grid, read off its mesh-dimension names.

    ``Shard(a)`` along a dimension named like TP is ``tp_axis=a``; along one named like FSDP's data
    dimension, ``dp_axis=a`` (FSDP2 over a TP-sharded axis is ``_StridedShard`` with the TP size as
    split factor: the same rule); ``Replicate`` anywhere is replication. Along an expert-parallel
    dimension (``ep``) it is ``expert_axis=a``, and FSDP inside the EP region (``efsdp``) is
    ``dp_axis`` over expert data parallel (``_StridedShard`` with the EP size when both split the
    expert axis, as torchtitan lays out ``GroupedExperts``).

    ``expert_axis``: the caller knows the tensor stacks routed experts along this axis (torchtitan's
    ``GroupedExperts``: axis 0) even where the mesh does not say so, as at ep = 1, where the experts
    sit on the dense mesh. Without it, a job saved at ep = 1 would record dense rules and a
    ``reshard --to ...ep4`` could not spread its experts (docs/moe.md).

    Anything else (an unknown dimension name that shards, explicit chunk sizes, two dims sharding
    for one role, an EP split of another axis than the declared one) has no rule: None, and
    ``reshard`` copies such a tensor whole, as before. Splits keep ``torch.chunk`` sizing.
    """
    roles: dict[str, tuple[int, int, int, int]] = {}  # role -> (mesh position, axis, size, split factor)
    for i, (name, size, p) in enumerate(zip(layout.mesh.dims, layout.mesh.shape, layout.placements)):
        if isinstance(p, Replicate):
            continue
        if not isinstance(p, Shard) or p.sizes is not None:
            return None
        role = ("tp" if name in TP_DIM_NAMES else "ep" if name in EP_DIM_NAMES
                else "dp" if name in DP_SHARD_DIM_NAMES or name in EDP_DIM_NAMES else None)
        if role is None or role in roles or (role != "dp" and p.split_factor != 1):
            return None
        roles[role] = (i, p.axis, size, p.split_factor)
    tp_axis = roles["tp"][1] if "tp" in roles else None
    dp_axis = roles["dp"][1] if "dp" in roles else None
    ep_axis = roles["ep"][1] if "ep" in roles else None
    if ep_axis is not None and expert_axis is not None and ep_axis != expert_axis:
        return None
    expert = ep_axis if ep_axis is not None else expert_axis
    if "dp" in roles:
        # FSDP over an axis TP or EP also splits must shard within each TP/EP part: DTensor's
        # _StridedShard on the outer dimension with the inner split's size as split factor
        position, _, _, split = roles["dp"]
        inner = [roles[r] for r in ("tp", "ep") if r in roles and roles[r][1] == dp_axis and roles[r][2] > 1]
        if len(inner) > 1:
            return None
        want = inner[0][2] if inner else 1
        if split != want or (inner and inner[0][0] < position):
            return None
    if layout.padded is not None or layout.fused is not None:
        return None
    return PartitionRule(tp_axis=tp_axis, dp_axis=dp_axis, expert_axis=expert, chunked=True)


def column_parallel(**kw: int) -> PartitionRule:
    return PartitionRule(tp_axis=0, **kw)


def row_parallel(**kw: int) -> PartitionRule:
    return PartitionRule(tp_axis=1, **kw)


def replicated(**kw: int) -> PartitionRule:
    return PartitionRule(**kw)
