"""DeepSpeed-MoE in native checkpoints: which files hold which experts, and how ZeRO cut their groups.

What ``engine.save_checkpoint`` writes for a model with ``deepspeed.moe.layer.MoE``
layers at ZeRO 1/2 (read from ``deepspeed/runtime/engine.py``:
``_save_moe_checkpoint``, ``_get_expert_ckpt_name``, ``_get_non_moe_state_dict``;
``deepspeed/utils/groups.py``: ``_create_expert_and_data_parallel``):

* ``mp_rank_00_model_states.pt``: the module *without* its routed experts, the
  usual metadata, ``num_experts`` (one entry per MoE layer, in module order) and
  ``param_shapes`` whose expert param groups name **rank 0's** local experts
  (``<moe>.deepspeed_moe.experts.deepspeed_experts.{j}.<param>``);
* ``layer_{L}_expert_{E}_mp_rank_00_model_states.pt``: expert ``E`` (global id)
  of MoE layer ``L``, keys renamed to the global id, in the training dtype;
* ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt``: every DP rank's partitions.
  A dense group is cut over the whole DP group; an expert group (``moe: True``,
  named ``ep_size_{ep}``) over its expert-data-parallel group of
  ``partition_count = dp / ep`` ranks. EP groups are consecutive ranks, so rank
  ``r`` holds the experts of EP rank ``r % ep`` (global ids
  ``(r % ep) * local + j``), partition ``r // ep`` of them.
  (``expp_rank_*_optim_states.pt`` files appear only without ZeRO, stage 0,
  which ckptkit's DeepSpeed support does not cover.)

In ckptkit's model space those experts are stacked tensors
``<moe>.deepspeed_moe.experts.deepspeed_experts.<param>`` of shape
``[num_experts, *param]`` (docs/moe.md, :mod:`ckptkit.adapters.deepspeed`).
"""

from __future__ import annotations

import math
import os
import re
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptkit.adapters.deepspeed import EXPERT_RULE, EXPERTS, Space
from ckptkit.errors import CoverageError, ManifestError, StateMismatchError
from ckptkit.layout.box import Box, Region
from ckptkit.layout.manifest import ExplicitLayout, TensorMeta
from ckptkit_converters.deepspeed import files as fmt
from ckptkit_converters.common.source_paths import regular_file

_LOCAL = re.compile(rf"^(?P<prefix>(?:.+\.)?{re.escape(EXPERTS)})\.(?P<j>[0-9]+)\.(?P<param>.+)$")


def split_expert_name(name: str) -> tuple[str, int, str] | None:
    """``moe.0.deepspeed_moe.experts.deepspeed_experts.3.fc1.weight`` -> (``moe.0.deepspeed_moe.experts.
    deepspeed_experts``, 3, ``fc1.weight``); None for a name that is not a routed expert's."""
    m = _LOCAL.match(name)
    return None if m is None else (m["prefix"], int(m["j"]), m["param"])


def expert_file(folder: str, layer: int, expert: int) -> str:
    return os.path.join(folder, f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt")


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer of a native checkpoint: its index ``layer`` (the ``L`` of the file names), module
    prefix, expert count and EP size."""

    layer: int
    prefix: str
    num_experts: int
    ep: int
    group: str

    @property
    def local(self) -> int:
        return self.num_experts // self.ep


@dataclass(frozen=True)
class NativeMoE:
    """The MoE facts of a native checkpoint: its layers (by prefix) and, per param group, the EP size
    (1 for dense groups: cut over the whole DP group)."""

    layers: Mapping[str, MoELayer]
    group_ep: tuple[int, ...]
    dp: int

    def group_rank(self, group: int, rank: int) -> int:
        """The partition of param group ``group`` DP rank ``rank`` holds."""
        return rank // self.group_ep[group]

    def group_dp(self, group: int) -> int:
        return self.dp // self.group_ep[group]

    def space(self, group: int, rank: int, name: str, shape: tuple[int, ...]) -> Space:
        """Where DP rank ``rank``'s parameter ``name`` (a local name) of ``group`` sits in model space."""
        if self.group_ep[group] == 1 and split_expert_name(name) is None:
            return Space.whole(name, shape)
        parts = split_expert_name(name)
        if parts is None or parts[0] not in self.layers:
            raise ManifestError(f"parameter {name!r} of expert param group {group} is not a routed expert of a "
                                "MoE layer the checkpoint lists")
        prefix, j, param = parts
        layer = self.layers[prefix]
        e = (rank % layer.ep) * layer.local + j
        return Space(f"{prefix}.{param}", (layer.num_experts, *shape), Box((e,) + (0,) * len(shape), (1, *shape)))

    def expert_meta(self, shapes: Sequence[Mapping[str, tuple[int, ...]]]) -> dict[str, Any]:
        """The adapter's ``experts`` record (per stacked tensor)."""
        out = {}
        for group in shapes:
            for name in group:
                parts = split_expert_name(name)
                if parts is not None and parts[0] in self.layers:
                    layer = self.layers[parts[0]]
                    out[f"{parts[0]}.{parts[2]}"] = {"layer": layer.layer, "module": parts[0], "param": parts[2],
                                                     "num_experts": layer.num_experts, "ep": layer.ep,
                                                     "group": layer.group}
        return out


def native_moe(root: str, folder: str, model0: Mapping[str, Any], shapes: Sequence[Mapping[str, tuple[int, ...]]],
               rec0: Mapping[str, Any], param_groups: Sequence[Mapping[str, Any]], dp: int, zero_stage: int,
               where: str) -> NativeMoE | None:
    """The MoE facts of the native checkpoint in ``folder`` (a tag directory of the checkpoint folder
    ``root``) from its model-states and rank-0 optimizer records; None when the checkpoint has no MoE layers."""
    num_experts = model0.get("num_experts")
    moe_groups = [bool(pg.get("moe")) for pg in param_groups]
    if not any(moe_groups):
        return None
    if zero_stage == 3:
        raise StateMismatchError(f"{where}: a ZeRO-3 MoE checkpoint; the import handles DeepSpeed-MoE at ZeRO 1/2")
    cfg = model0.get("ds_config") or {}
    if cfg.get("use_data_before_expert_parallelism"):
        raise StateMismatchError(f"{where}: use_data_before_expert_parallelism lays EP groups out strided; the "
                                 "import handles DeepSpeed's default (consecutive) EP groups")
    if not isinstance(num_experts, list) or not all(isinstance(n, int) and n > 0 for n in num_experts):
        raise ManifestError(f"{where}: expert param groups but no per-layer 'num_experts' list ({num_experts!r})")
    counts = rec0.get("partition_count")
    if not isinstance(counts, list) or len(counts) != len(param_groups):
        raise ManifestError(f"{where}: 'partition_count' {counts!r} does not list the {len(param_groups)} groups")
    group_ep = []
    for g, (is_moe, count) in enumerate(zip(moe_groups, counts)):
        if not is_moe:
            if int(count) != dp:
                raise ManifestError(f"{where}: dense param group {g} partitioned over {count} ranks, DP is {dp}")
            group_ep.append(1)
            continue
        if int(count) <= 0 or dp % int(count):
            raise ManifestError(f"{where}: expert param group {g} partitioned over {count} ranks of DP {dp}")
        group_ep.append(dp // int(count))
    prefixes: dict[str, int] = {}
    for g, group in enumerate(shapes):
        for name in group:
            parts = split_expert_name(name)
            if parts is not None:
                if not moe_groups[g]:
                    raise ManifestError(f"{where}: expert parameter {name!r} in the dense param group {g}")
                prefixes.setdefault(parts[0], g)
    if len(prefixes) != len(num_experts):
        raise ManifestError(f"{where}: {len(prefixes)} MoE layers in the param groups, 'num_experts' lists "
                            f"{len(num_experts)}")
    # which module is layer L: the keys of its expert-0 file say (DeepSpeed numbers MoE modules in
    # named_modules order, which the parameter names alone do not pin down)
    layers = {}
    for layer, total in enumerate(num_experts):
        path = expert_file(folder, layer, 0)
        if not os.path.lexists(path):
            raise CoverageError(f"{path}: missing: nothing stored for expert 0 (of {total}) of MoE layer {layer}")
        found = {p for p in (split_expert_name(k) for k in fmt.load_file(regular_file(root, path))) if p is not None}
        prefix = {p[0] for p in found}
        if len(prefix) != 1 or next(iter(prefix)) not in prefixes or {p[1] for p in found} != {0}:
            raise ManifestError(f"{path}: expected the parameters of expert 0 of one MoE layer, found keys of "
                                f"{sorted(prefix)} experts {sorted({p[1] for p in found})}")
        prefix_ = next(iter(prefix))
        g = prefixes[prefix_]
        ep = group_ep[g]
        if total % ep:
            raise ManifestError(f"{where}: MoE layer {layer} has {total} experts, not divisible by EP {ep}")
        layers[prefix_] = MoELayer(layer, prefix_, total, ep, fmt.group_name(param_groups[g], where))
    return NativeMoE(layers, tuple(group_ep), dp)


def check_expert_files(root: str, folder: str, moe: NativeMoE) -> dict[tuple[int, int], str]:
    """Every ``layer_{L}_expert_{E}`` file of the tag directory ``folder`` of ``root``; a missing one is a
    CoverageError naming the layer, the expert and the file; one that is not a regular file inside
    ``root`` is refused before it is read."""
    out = {}
    for layer in moe.layers.values():
        for e in range(layer.num_experts):
            path = expert_file(folder, layer.layer, e)
            if not os.path.lexists(path):
                raise CoverageError(f"{path}: missing: nothing stored for expert {e} (of {layer.num_experts}) of "
                                    f"MoE layer {layer.layer} ({layer.prefix})")
            out[(layer.layer, e)] = regular_file(root, path)
    return out


def layouts_with_rules(specs: Mapping[str, Any], pieces: Mapping[int, Sequence[tuple[str, Region]]],
                       experts: set[str]) -> dict[str, TensorMeta]:
    """Manifest entries for an offline write, recording ``EXPERT_RULE`` on the stacked expert tensors
    ``experts`` (model-space keys), as the live adapter does; pieces sorted exactly as the merge sorts them."""
    by_key: dict[str, list[tuple[Region, int]]] = {k: [] for k in specs}
    for rank, items in pieces.items():
        for key, region in items:
            by_key[key].append((region, rank))
    return {k: TensorMeta(k, s.dtype, s.shape, ExplicitLayout(tuple(sorted(by_key[k], key=lambda p: (p[0].key(), p[1])))),
                          rule=EXPERT_RULE if k in experts else None)
            for k, s in sorted(specs.items())}


class ExpertFiles:
    """The ``layer_{L}_expert_{E}`` files of a native checkpoint, each read on first use (the last few kept)."""

    def __init__(self, root: str, folder: str, moe: NativeMoE, keep: int = 4) -> None:
        self.moe = moe
        self.paths = check_expert_files(root, folder, moe)
        self.keep = keep
        self.cache: OrderedDict[tuple[int, int], dict[str, Any]] = OrderedDict()

    def boxes(self, shapes: Sequence[Mapping[str, tuple[int, ...]]]
              ) -> Iterator[tuple[str, Box, int, int, str]]:
        """(stacked name, the expert's box of it, layer, global expert, key in the expert's file) for every
        parameter of every expert; the parameters of an expert are those of local expert 0 in ``shapes``."""
        for group in shapes:
            for name, shape in group.items():
                parts = split_expert_name(name)
                if parts is None or parts[1] != 0 or parts[0] not in self.moe.layers:
                    continue
                prefix, _, param = parts
                layer = self.moe.layers[prefix]
                for e in range(layer.num_experts):
                    yield (f"{prefix}.{param}", Box((e,) + (0,) * len(shape), (1, *shape)), layer.layer, e,
                           f"{prefix}.{e}.{param}")

    def tensor(self, layer: int, expert: int, key: str) -> Any:
        if (layer, expert) not in self.cache:
            self.cache[(layer, expert)] = fmt.load_file(self.paths[(layer, expert)])
            while len(self.cache) > self.keep:
                self.cache.popitem(last=False)
        data = self.cache[(layer, expert)]
        if key not in data:
            raise ManifestError(f"{self.paths[(layer, expert)]}: no {key!r} (expert {expert} of MoE layer {layer}); "
                                f"the file holds {sorted(data)[:6]}")
        return data[key]


@dataclass(frozen=True)
class LocalMember:
    """One local expert parameter of an export's expert param group: its DeepSpeed name on the EP rank
    (``<moe>....deepspeed_experts.{j}.<param>``), its shape, and the stacked tensor it is a slice of."""

    local: str
    shape: tuple[int, ...]
    stacked: str
    j: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def local_members(group: Sequence[tuple[str, tuple[int, ...]]], experts: Mapping[str, Any],
                  ep: int) -> list[LocalMember] | None:
    """The members of an expert param group as an EP rank at ``ep`` holds them, in DeepSpeed's order
    (``model.parameters()``: layer by layer, local expert by local expert, then the expert's parameters);
    None for a dense group."""
    if not any(n in experts for n, _ in group):
        return None
    if not all(n in experts for n, _ in group):
        raise ManifestError(f"param group mixes stacked expert tensors and dense ones: {[n for n, _ in group][:4]}")
    modules: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for n, shape in group:
        modules.setdefault(experts[n]["module"], []).append((n, tuple(shape)))
    out = []
    for module, params in modules.items():
        total = int(experts[params[0][0]]["num_experts"])
        if total % ep:
            raise StateMismatchError(f"{module}: {total} experts do not split over EP {ep}")
        for j in range(total // ep):
            for n, shape in params:
                out.append(LocalMember(f"{module}.{j}.{experts[n]['param']}", shape[1:], n, j))
    return out
