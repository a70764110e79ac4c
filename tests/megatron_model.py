"""A tiny Megatron-core GPT trained for real on CPU: the model the Megatron tests checkpoint.

4 layers, hidden 64, 8 heads in 2 query groups (GQA, fused QKV), SwiGLU
``linear_fc1``, RMSNorm with TE-style names, vocabulary 250 padded by
Megatron's rule (``make_vocab_size_divisible_by * tp``). Built through
Megatron's own parallel_state, DDP wrapper, ``get_megatron_optimizer``
(plain or distributed) and ``get_forward_backward_func`` (1F1B, interleaved
with virtual pipeline chunks), so the tensors, flat optimizer buffers and
replica ids the adapter sees are Megatron's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from tests import megatron_cpu_shims

VOCAB = 250
SEQ = 16
MICRO_BATCH = 2
NUM_MICRO = 2  # microbatches a step: enough for 1F1B and the interleaved schedule at pp 2 (4 cost 20% more suite time)
LAYERS = 4
CLIP_GRAD = 2.0  # above every step's gradient norm here, so the cross-optimizer comparisons see no clipping (checked)


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    dist_opt: bool = True
    tied: bool = False
    divisible_by: int = 16
    pp_layers: tuple[int, ...] | None = None  # uneven first/last stage: (first, last)
    bf16: bool = False  # bf16 weights in Float16Module, fp32 main copies in the optimizer
    fp16: bool = False  # fp16 weights, fp32 main copies, Megatron's dynamic loss scaler (its scale grows every step)
    experts: int = 0  # MoE: routed SequentialMLP experts on every layer (0: dense MLP)
    ep: int = 1  # expert model parallel
    etp: int | None = None  # expert tensor parallel (None: Megatron's default, = tp)
    shared_expert: bool = False  # a shared expert beside the routed ones
    shared_gate: bool = False  # the shared expert's sigmoid gate (moe_shared_expert_gate; Qwen2-MoE has one)
    expert_bias: bool = False  # aux-loss-free balancing: moe_router_enable_expert_bias
    moe_layers: tuple[int, ...] | None = None  # 1 = MoE, 0 = dense, per layer (None: MoE on every layer)
    frozen: tuple[str, ...] = ()  # parameter names set requires_grad=False before DDP (Megatron-LM's --freeze-*)
    bias: bool = False  # biases on the linear layers (add_bias_linear): qkv's 96 rows are no multiple of 64
    overlap_param_gather: bool = False  # Megatron-LM's --overlap-param-gather: the step updates this rank's shard only
    hidden: int = 64  # larger sizes for benchmarks (benchmarks/bench_megatron_legacy_import.py)
    ffn: int = 96


def padded_vocab(layout: Layout) -> int:
    multiple = layout.divisible_by * layout.tp
    return -(-VOCAB // multiple) * multiple


@dataclass
class Trainer:
    layout: Layout
    model: list[Any]
    optimizer: Any
    scheduler: Any
    iteration: int = 0
    grad_norms: list[float] = field(default_factory=list)  # per step, before clipping (clip_grad = CLIP_GRAD)


def _dtype(layout: Layout) -> torch.dtype:
    return torch.bfloat16 if layout.bf16 else torch.float16 if layout.fp16 else torch.float32


def setup(layout: Layout, seed: int = 1234) -> Trainer:
    """Initialise Megatron's parallel state for ``layout`` in the running gloo world and build the trainer."""
    megatron_cpu_shims.install()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.transformer_config import TransformerConfig

    teardown()
    _track_groups()
    ps.initialize_model_parallel(layout.tp, layout.pp, virtual_pipeline_model_parallel_size=layout.vpp,
                                 expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    extra: dict[str, Any] = {}
    if layout.pp_layers is not None:
        first, last = layout.pp_layers
        extra.update(num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    # batch_p2p_comm=False: on gloo, batched isend/irecv between the same two stages can pair the
    # interleaved schedule's messages out of order (training-mode losses then differ from a forward-only
    # pass on the same weights); Megatron's unbatched p2p path pairs them in order
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=layout.hidden, num_attention_heads=8, num_query_groups=2,
        ffn_hidden_size=layout.ffn,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=False,
        add_bias_linear=layout.bias, normalization="RMSNorm", use_cpu_initialization=True,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp, pipeline_dtype=_dtype(layout), bf16=layout.bf16, fp16=layout.fp16,
        params_dtype=_dtype(layout),
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02, batch_p2p_comm=False,
        **_moe_config(layout), **extra,
    )
    chunks = []
    for vp in range(layout.vpp or 1):
        model = GPTModel(
            config=config, transformer_layer_spec=_layer_spec(layout, config, vp), vocab_size=padded_vocab(layout),
            max_sequence_length=SEQ, pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=layout.tied, position_embedding_type="rope", vp_stage=vp,
        )
        for name, param in model.named_parameters():
            if any(name == f or name.startswith(f + ".") for f in layout.frozen):
                param.requires_grad_(False)
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=layout.dist_opt, bucket_size=4096,
                                            overlap_param_gather=layout.overlap_param_gather,
                                            overlap_grad_reduce=layout.overlap_param_gather)
        if layout.bf16 or layout.fp16:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, model)
        chunks.append(DistributedDataParallel(config, ddp, model))
    opt_config = OptimizerConfig(optimizer="adam", lr=3e-3, min_lr=3e-4, weight_decay=0.01, use_distributed_optimizer=layout.dist_opt,
                                 clip_grad=CLIP_GRAD, bf16=layout.bf16, fp16=layout.fp16,
                                 initial_loss_scale=2.0**10, loss_scale_window=1, hysteresis=2)
    # what Megatron's trainer sets: the schedule then all-reduces (or, for the distributed optimizer,
    # reduce-scatters) gradients over DP and the tied embedding's across the first and last stage
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(opt_config, chunks)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=3,
                                        lr_decay_steps=20, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                        wd_incr_steps=20, wd_incr_style="constant")
    return Trainer(layout, chunks, optimizer, scheduler)


def _moe_config(layout: Layout) -> dict[str, Any]:
    """Megatron's MoE arguments for ``layout`` (none for a dense model).

    The token dispatcher is ``allgather`` (``alltoall`` needs CUDA streams); the
    router's aux loss is on so the router's gradient is exercised.
    """
    if not layout.experts:
        return {}
    out: dict[str, Any] = dict(
        num_moe_experts=layout.experts, moe_router_topk=2, moe_ffn_hidden_size=48, moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="aux_loss",
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
    )
    if layout.shared_expert:
        out["moe_shared_expert_intermediate_size"] = 32
        out["moe_shared_expert_gate"] = layout.shared_gate
    if layout.expert_bias:
        out.update(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                   moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    if layout.moe_layers is not None:
        out["moe_layer_freq"] = list(layout.moe_layers)
    return out


def _layer_spec(layout: Layout, config: Any, vp: int) -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    if not layout.experts:
        return get_gpt_layer_local_spec()
    if layout.moe_layers is None:
        return get_gpt_layer_local_spec(num_experts=layout.experts, moe_grouped_gemm=False)
    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp)


_GROUPS: list[Any] = []


def _track_groups() -> None:
    """Record the process groups Megatron creates, so that :func:`teardown` can destroy them.

    ``destroy_model_parallel`` only forgets its groups; torch keeps each one
    (two gloo threads per group and rank) for the life of the world. One test
    module sets Megatron up for many layouts in the same 4-rank world, and MoE
    layouts create ~50 groups each: ~1300 threads per rank piled up until the
    world crawled.
    """
    import torch.distributed as dist

    if getattr(dist.new_group, "_tracked", False):
        return
    original = dist.new_group

    def new_group(*args: Any, **kwargs: Any) -> Any:
        group = original(*args, **kwargs)
        _GROUPS.append(group)
        return group

    new_group._tracked = True  # type: ignore[attr-defined]
    dist.new_group = new_group


def teardown() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    live = dist.distributed_c10d._world.pg_map  # groups torch still holds (a group may be recorded twice)
    while _GROUPS:
        group = _GROUPS.pop()
        if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER and group in live:
            dist.destroy_process_group(group)


def batch(step: int, micro: int) -> dict[str, torch.Tensor]:
    """The same global batch at any layout: every DP rank sees a slice of it (here dp is the data index)."""
    from megatron.core import parallel_state as ps

    dp, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    g = torch.Generator().manual_seed(10_000 * step + micro)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH * 4, SEQ + 1), generator=g)
    per = tokens.shape[0] // dp_size
    mine = tokens[dp * per:(dp + 1) * per]
    return {"tokens": mine[:, :-1], "labels": mine[:, 1:]}


def _forward_step(step: int, data_iterator: Any, model: Any) -> Any:
    micro = next(data_iterator)
    b = batch(step, micro)
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(b["tokens"])
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).tril().logical_not()
    out = model(b["tokens"], positions, mask, labels=b["labels"])

    def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = per_token.float().mean()
        return loss, {"loss": loss.detach()}

    return out, loss_func


def _run(trainer: Trainer, step: int, forward_only: bool) -> float:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    fb = get_forward_backward_func()
    n_chunks = len(trainer.model)
    iters = [iter(range(NUM_MICRO)) for _ in range(n_chunks)]
    losses = fb(
        forward_step_func=partial(_forward_step, step), data_iterator=iters if n_chunks > 1 else iters[0],
        model=trainer.model if n_chunks > 1 else trainer.model[0], num_microbatches=NUM_MICRO,
        seq_length=SEQ, micro_batch_size=MICRO_BATCH * 4 // ps.get_data_parallel_world_size(),
        forward_only=forward_only,
    )
    # the loss lives on the last stage; average over DP and share with every rank
    value = torch.zeros(1, dtype=torch.float64)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        value[0] = sum(float(x["loss"]) for x in losses)
    torch.distributed.all_reduce(value, group=ps.get_pipeline_model_parallel_group())
    torch.distributed.all_reduce(value, group=ps.get_data_parallel_group())
    return float(value[0]) / ps.get_data_parallel_world_size()


def train_step(trainer: Trainer) -> float:
    for chunk in trainer.model:
        chunk.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    loss = _run(trainer, trainer.iteration + 1, forward_only=False)
    ok, grad_norm, _ = trainer.optimizer.step()
    assert ok, "optimizer step skipped"
    trainer.grad_norms.append(float(grad_norm))
    trainer.scheduler.step(increment=1)
    trainer.iteration += 1
    return loss


def eval_loss(trainer: Trainer) -> float:
    """Loss of the current weights on a fixed held-out batch (step 0's data), no update.

    In eval mode: an MoE layer refuses a training-mode forward at TP > 1 without sequence parallelism,
    and a training-mode forward would count tokens toward the next expert-bias update."""
    for chunk in trainer.model:
        chunk.eval()
    try:
        with torch.no_grad():
            return _run(trainer, 0, forward_only=True)
    finally:
        for chunk in trainer.model:
            chunk.train()
