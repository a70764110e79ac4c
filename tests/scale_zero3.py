"""A DeepSpeed ZeRO-3 job of 512 ranks, declared on one machine: each rank's flat partitions, meta tensors.

Why: ckptkit's DeepSpeed adapter declares a live engine's flat partitions
with :mod:`ckptkit.layout.zero_partition` (which every live engine is checked
against before a save: ``engine_layout`` raises on any difference) and the
adapter's :func:`~ckptkit.adapters.deepspeed.group_entries`. A 70B engine
cannot be built here, at 512 ranks or at one, so this module computes each
rank's partitions from ``zero_partition`` as ``engine_layout`` would find
them — per param group, DeepSpeed's sub-groups (``sub_group_size``, default
1e9 elements), each rank's fragments of them — and hands them to the same
``group_entries`` with meta tensors of the partitions' sizes.

The model is Llama-3-70B under Hugging Face names, its parameters in
``named_parameters`` order, in two param groups as the Hugging Face Trainer
makes them (weight decay on the matrices, none on the norms). Left out: the
``deepspeed`` JSON record (engine counters, param shapes; tens of kB once per
checkpoint) and module buffers (none in this model's checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ckptkit.adapters.deepspeed import EngineLayout, FlatGroup, Space, group_entries
from ckptkit.layout.zero_partition import Zero3SubGroup, zero3_partition_numel, zero3_sub_groups

SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's default zero_optimization.sub_group_size


@dataclass(frozen=True)
class Zero3Job:
    """A Llama-style model (``hidden``, ``layers``, ``ffn``, ``heads``, ``groups``, ``vocab``) at ZeRO-3 over ``dp``."""

    dp: int = 512
    hidden: int = 8192
    layers: int = 80
    ffn: int = 28672
    heads: int = 64
    groups: int = 8
    vocab: int = 128256

    @property
    def world(self) -> int:
        return self.dp

    @property
    def layout(self) -> str:
        return f"zero3dp{self.dp}"


def hf_params(job: Zero3Job) -> list[tuple[str, tuple[int, ...]]]:
    """The model's parameters in ``named_parameters`` order (Hugging Face LlamaForCausalLM names)."""
    h, kv = job.hidden, job.hidden // job.heads * job.groups
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (job.vocab, h))]
    for i in range(job.layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (job.ffn, h)), (p + "mlp.up_proj.weight", (job.ffn, h)),
                (p + "mlp.down_proj.weight", (h, job.ffn)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (job.vocab, h))]


@dataclass
class PartitionedParam:
    """What ZeRO-3's partitioner attaches to a parameter and the adapter reads: its full size
    (``ds_numel``) and this rank's partition of it (``ds_tensor``)."""

    ds_numel: int
    ds_tensor: torch.Tensor


def param_groups(job: Zero3Job) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The optimizer's param groups: weight decay on matrices, none on norms (the Hugging Face Trainer's split)."""
    params = hf_params(job)
    return [[p for p in params if len(p[1]) > 1], [p for p in params if len(p[1]) == 1]]


def layout_of(job: Zero3Job, rank: int) -> EngineLayout:
    """Rank ``rank``'s flat partitions, as ``engine_layout`` finds them on a live ZeRO-3 engine."""
    groups = []
    for group_id, params in enumerate(param_groups(job)):
        numels = [torch.Size(shape).numel() for _, shape in params]
        for members in zero3_sub_groups(numels, job.dp, SUB_GROUP_SIZE):
            sub = Zero3SubGroup(tuple(numels[i] for i in members), job.dp)
            names = tuple(params[i][0] for i in members)
            shapes = tuple(params[i][1] for i in members)
            lp = tuple(PartitionedParam(numels[i], torch.empty(zero3_partition_numel(numels[i], job.dp),
                                                                  dtype=torch.bfloat16, device="meta"))
                       for i in members)
            fp32 = torch.empty(sub.partition_numel, dtype=torch.float32, device="meta")
            groups.append(FlatGroup(names, shapes, tuple(sub.fragments(rank)), fp32, None, lp, group_id,
                                    tuple(Space.whole(n, s) for n, s in zip(names, shapes))))
    return EngineLayout(3, job.dp, rank, tuple(groups), torch.bfloat16)


def rank_state(job: Zero3Job, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s state as the adapter's ``engine_state`` declares it (Adam moments and step included)."""
    layout = layout_of(job, rank)
    base = {g.fp32: {"exp_avg": torch.empty_like(g.fp32), "exp_avg_sq": torch.empty_like(g.fp32),
                     "step": torch.tensor(1000.0)} for g in layout.groups}
    state, _ = group_entries(layout, base)
    return {"deepspeed_engine": state}
