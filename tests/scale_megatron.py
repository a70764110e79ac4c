"""Every rank of a large Megatron-core job, built one after another in one process: fake process group,
meta tensors.

Why: ckptkit's Megatron adapter reads each rank's real declarations
(``model.sharded_state_dict()``, the distributed optimizer's shard ranges), and
at tp4·pp8·dp4 there are 128 ranks of them, 1,024 at dp32. For each rank this
module initialises torch.distributed with torch's fake process group at that
rank (collectives return at once, nothing is sent), Megatron's parallel_state
for the layout, and builds the rank's real Megatron-core GPTModel, its
Float16Module/DDP wrappers and its DistributedOptimizer on the meta device
(no memory: a 70B model's shapes cost nothing), then hands them to the
adapter (``megatron_state`` to save, ``load_entries`` to load).

What differs from a job: tensors are meta (the CUDA shims of
tests/megatron_cpu_shims.py point at "meta"), the gloo groups Megatron asks
for are made on the fake backend, and the optimizer's Adam moments are
created by the adapter's own ``prime`` (as a load would) since a meta model
cannot step. The model object may hold fewer layers than the model it stands
for (``layers``), to keep a test fast; the rank count and every tensor's
shape are the real ones.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from tests import megatron_cpu_shims


@dataclass(frozen=True)
class GPTShape:
    """A GPT's shapes (Llama-style: RMSNorm, SwiGLU, GQA, rotary, untied output layer)."""

    name: str
    hidden: int
    layers: int
    ffn: int
    heads: int
    groups: int
    vocab: int
    experts: int = 0  # routed experts per layer (0: dense)
    moe_ffn: int | None = None
    topk: int = 2


LLAMA3_70B = GPTShape("llama3-70b", hidden=8192, layers=80, ffn=28672, heads=64, groups=8, vocab=128256)
MIXTRAL_8X7B = GPTShape("mixtral-8x7b", hidden=4096, layers=32, ffn=14336, heads=32, groups=8, vocab=32000,
                        experts=8, moe_ffn=14336)
DIVISIBLE_BY = 128  # make_vocab_size_divisible_by


@dataclass(frozen=True)
class MegatronJob:
    """A model at a layout: ``tp``, ``pp``, ``dp``, ``ep``, ``etp`` (None: tp), distributed optimizer, bf16."""

    shape: GPTShape
    tp: int
    pp: int
    dp: int
    ep: int = 1
    etp: int | None = None

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def layout(self) -> str:
        extra = f"ep{self.ep}" + (f"etp{self.etp}" if self.etp is not None else "") if self.ep > 1 else ""
        return f"tp{self.tp}pp{self.pp}dp{self.dp}{extra}"

    def with_layers(self, layers: int) -> MegatronJob:
        return replace(self, shape=replace(self.shape, layers=layers))


def padded_vocab(job: MegatronJob) -> int:
    """Megatron's padded vocabulary: a multiple of ``make_vocab_size_divisible_by * tp``."""
    multiple = DIVISIBLE_BY * job.tp
    return -(-job.shape.vocab // multiple) * multiple


_READY = {"done": False}


def install() -> None:
    """The meta-device Megatron shims, and Megatron's gloo groups made on the default (fake) backend."""
    if _READY["done"]:
        return
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    megatron_cpu_shims.install("meta")
    from megatron.core import parallel_state as ps

    create_group = ps.create_group
    last: dict[str, Any] = {}

    def on_default_backend(ranks: Any = None, *args: Any, backend: str | None = None, **kwargs: Any) -> Any:
        """Megatron makes each group twice, for NCCL and gloo, in that order: the fake backend serves both,
        so the second is the first again (half the groups to make, at every rank of thousands)."""
        key = repr(list(ranks) if ranks is not None else None)
        if backend == "gloo" and key in last:
            return last.pop(key)
        group = create_group(ranks, *args, backend=None if backend == "gloo" else backend, **kwargs)
        last.clear()
        last[key] = group
        return group

    ps.create_group = on_default_backend
    _READY["done"] = True


def enter_rank(job: MegatronJob, rank: int) -> None:
    """Become ``rank`` of ``job``'s world: a fake process group at that rank, Megatron's groups for the layout."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    install()
    leave()
    hook = sys.excepthook  # each init wraps it to prefix "[rankN]:", which would pile up over thousands of ranks
    dist.init_process_group("fake", rank=rank, world_size=job.world, store=FakeStore())
    sys.excepthook = hook
    ps.initialize_model_parallel(job.tp, job.pp, expert_model_parallel_size=job.ep,
                                 expert_tensor_parallel_size=job.etp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def leave() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _config(job: MegatronJob, perform_initialization: bool) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    s = job.shape
    moe: dict[str, Any] = {}
    if s.experts:
        moe = dict(num_moe_experts=s.experts, moe_router_topk=s.topk, moe_ffn_hidden_size=s.moe_ffn,
                   moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=1e-2,
                   expert_model_parallel_size=job.ep, expert_tensor_parallel_size=job.etp)
    return TransformerConfig(
        num_layers=s.layers, hidden_size=s.hidden, num_attention_heads=s.heads, num_query_groups=s.groups,
        ffn_hidden_size=s.ffn, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        bias_activation_fusion=False, add_bias_linear=False, normalization="RMSNorm",
        use_cpu_initialization=True, perform_initialization=perform_initialization,
        tensor_model_parallel_size=job.tp, pipeline_model_parallel_size=job.pp, pipeline_dtype=torch.bfloat16,
        bf16=True, params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0, **moe,
    )


def build(job: MegatronJob, *, perform_initialization: bool = True) -> tuple[list[Any], Any]:
    """This rank's model chunk (Float16Module in DDP) and DistributedOptimizer, on the meta device,
    as Megatron-LM builds them for bf16 training with ``--use-distributed-optimizer``."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    config = _config(job, perform_initialization)
    spec = get_gpt_layer_local_spec(num_experts=job.shape.experts or None, moe_grouped_gemm=False)
    with torch.device("meta"):
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=padded_vocab(job),
                         max_sequence_length=8192, pre_process=ps.is_pipeline_first_stage(),
                         post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=False,
                         position_embedding_type="rope")
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    chunk = DistributedDataParallel(config, ddp_config, Float16Module(config, model))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True,
                                                       use_distributed_optimizer=True), [chunk])
    return [chunk], optimizer


def save_state(job: MegatronJob, rank: int, *, perform_initialization: bool = True) -> dict[str, Any]:
    """Rank ``rank``'s ckptkit state, as the adapter's ``save`` would hand it to ckptkit.save."""
    from ckptkit.adapters import megatron as mckpt
    from ckptkit.adapters.megatron import optimizer_state as opt_state
    from ckptkit.adapters.megatron.model_space import ModelSpaceOptions

    enter_rank(job, rank)
    chunks, optimizer = build(job, perform_initialization=perform_initialization)
    options = mckpt.MegatronOptions(vocab_size=job.shape.vocab, make_vocab_size_divisible_by=DIVISIBLE_BY)
    # a job that has trained holds Adam moments and a step; a meta model cannot step, so the adapter's
    # own prime creates them (as a load does), shaped like each shard
    states = opt_state.param_states(optimizer, mckpt._spaces(chunks, ModelSpaceOptions(job.shape.vocab, DIVISIBLE_BY)))
    from ckptkit.adapters.primed_states import PrimedStates

    opt_state.prime(PrimedStates(), states, ["exp_avg", "exp_avg_sq"], {"step": {"dtype": "float32", "value": 1000.0}})
    return mckpt.megatron_state(chunks, optimizer=optimizer, iteration=1000, extra={"consumed_samples": 1 << 30},
                                options=options)


def load_state(job: MegatronJob, rank: int, meta: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Rank ``rank``'s ckptkit state for a load at ``job``'s layout, as the adapter's ``load`` builds it."""
    from ckptkit.adapters import megatron as mckpt

    enter_rank(job, rank)
    chunks, optimizer = build(job)
    entries, _, _ = mckpt.load_entries(chunks, meta, shapes, optimizer=optimizer, where=f"load rank {rank}")
    return {mckpt.ROOT: entries}


def save_states(job: MegatronJob) -> Iterator[tuple[int, dict[str, Any]]]:
    for rank in range(job.world):
        yield rank, save_state(job, rank)


def rules_by_tensor(state: dict[str, Any]) -> dict[str, Any]:
    """The partition rule of every tensor a rank's state names (what the manifest records for reshard)."""
    from ckptkit.engine.state import Sharded

    out: dict[str, Any] = {}
    for value in state["megatron"].values():
        if isinstance(value, Sharded):
            for p in value.pieces:
                out[p.tensor] = value.rule
    return out
