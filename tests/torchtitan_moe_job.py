"""Rank-side functions of tests/test_torchtitan_moe.py: torchtitan MoE models trained with FSDP2 + EP
(+ TP) in real gloo worlds, checkpointed by ``CkptkitCheckpointManager``.

Three model families, each built from torchtitan 0.3's own layer builders at a size a 2-core machine
trains in seconds, and parallelized by the family's own parallelize function (gpt_oss is built,
saved and loaded, not trained: :func:`_gpt_oss_config`):

* ``qwen3``: Qwen3-MoE blocks (``_build_qwen3_moe_layers``: GQA with q/k norms, softmax router,
  ``GroupedExperts`` ``w1_EFD``/``w2_EDF``/``w3_EFD``, the ``expert_bias_E`` buffer of
  auxiliary-loss-free load balancing).
* ``deepseek_v3``: DeepSeek-V3 blocks (``build_mla_moe_layers``: MLA attention, a dense first layer,
  shared experts, routed experts with ``expert_bias_E``) and one MTP layer.
* ``gpt_oss``: gpt-oss blocks (attention sinks, ``GptOssGroupedExperts`` whose biases stack the
  experts too).

Expert parallelism is torchtitan's: experts are DTensors ``(_StridedShard(0), Shard(0))`` on the
(``efsdp``, ``ep``) mesh; with EP off and TP on, experts are TP-sharded on the dense mesh. The
training step is ``torchtitan_job``'s (sum loss over the global token count), plus torchtitan's MoE
load-balancing hook (``register_moe_load_balancing_hook``), which updates ``expert_bias_E`` from
the all-reduced token counts before every optimizer step.

CPU shims are those of tests/torchtitan_job.py (CPU device module, causal SDPA instead of
FlexAttention, SUM instead of PREMUL_SUM), see docs/torchtitan.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.models.common import Embedding, Linear
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE

from tests import torchtitan_job as dense
from tests.torchtitan_job import SEQ, STEPS, VOCAB

# layout name -> (dp_shard, tp, ep); the world is dp_shard * tp, EP is carved out of it
LAYOUTS = {
    "fsdp4_ep2": (4, 1, 2),
    "fsdp4_ep4": (4, 1, 4),
    "fsdp4": (4, 1, 1),
    "fsdp2_ep2": (2, 1, 2),
    "fsdp2_tp2_ep2": (2, 2, 2),
    "fsdp2_tp2": (2, 2, 1),
    "single": (1, 1, 1),
    "hsdp2x2_ep2": (2, 1, 2),
}
REPLICATE = {"hsdp2x2_ep2": 2}
"""HSDP layouts -> dp_replicate (tests/torchtitan_job.py): here 2 replicas of FSDP 2 with EP 2 carved out of
the shard dimension, so each replica group holds the experts once, over its 2 EP ranks."""


def world_size(layout: str) -> int:
    dp, tp, _ = LAYOUTS[layout]
    return REPLICATE.get(layout, 1) * dp * tp
NUM_EXPERTS = 8
DIM = 64


def _qwen3_config() -> tuple[Any, Any]:
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        _build_qwen3_moe_layers,
        _qwen3_norm,
        parallelize_qwen3,
    )
    from torchtitan.models.qwen3.model import Qwen3Model

    head_dim = 16
    cfg = Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=_qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=2, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=head_dim, moe_hidden_dim=32,
            num_experts=NUM_EXPERTS, top_k=2, attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=4 * SEQ, theta=1000000.0)),
    )
    return cfg, parallelize_qwen3


def _deepseek_config() -> tuple[Any, Any]:
    from torchtitan.models.deepseek_v3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        DeepSeekV3Model,
        _build_dsv3_layers,
        _build_mtp_layers,
        _output_linear_init,
        parallelize_deepseekv3,
    )

    rope_dim = 16
    layers = _build_dsv3_layers(
        n_layers=2, n_dense_layers=1, dim=DIM, n_heads=4, q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=rope_dim, v_head_dim=16, mscale=0.70, dense_hidden_dim=128, moe_hidden_dim=32,
        num_experts=NUM_EXPERTS, num_shared_experts=1, router_top_k=2, router_score_func="softmax",
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=4 * SEQ, theta=10000.0))
    cfg = DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=layers, mtp_layers=_build_mtp_layers(layers[-1], dim=DIM, num_mtp_layers=1),
    )
    return cfg, parallelize_deepseekv3


def _gpt_oss_config() -> tuple[Any, Any]:
    """gpt-oss blocks (``_build_gptoss_layers``: fused QKV with per-head attention sinks, a router with a bias,
    ``GptOssGroupedExperts`` whose weights *and biases* stack the experts: ``mlp1_weight_EGD``,
    ``mlp1_bias_EG``, ``mlp2_weight_EDF``, ``mlp2_bias_ED``). Built and parallelized only: its attention
    needs the log-sum-exp of FlexAttention or varlen attention, neither of which runs on CPU here, so
    it is not trained (tests/test_torchtitan_moe.py checks its recorded rules at every degree)."""
    from torchtitan.models.gpt_oss import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        GptOssModel,
        _build_gptoss_layers,
        _output_linear_init,
        parallelize_gptoss,
    )

    cfg = GptOssModel.Config(
        vocab_size=VOCAB, dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_gptoss_layers(
            fuse_qkv=True, dim=DIM, n_layers=2, hidden_dim=32, num_experts=NUM_EXPERTS, top_k=2,
            load_balance_coeff=1e-3, attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=64, max_seq_len=4 * SEQ, theta=150000.0)),
    )
    return cfg, parallelize_gptoss


MODELS = {"qwen3": _qwen3_config, "deepseek_v3": _deepseek_config, "gpt_oss": _gpt_oss_config}


def model_config(family: str) -> tuple[Any, Any]:
    """The tiny model's config and its parallelize function, with causal SDPA as inner attention (shim 2;
    not for gpt_oss, whose attention is never run: :func:`_gpt_oss_config`)."""
    cfg, parallelize = MODELS[family]()
    if family == "gpt_oss":
        return cfg, parallelize
    for layer in list(cfg.layers) + list(getattr(cfg, "mtp_layers", None) or []):
        attention = getattr(layer, "attention", None)
        if attention is not None and hasattr(attention, "inner_attention"):
            attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg, parallelize


class MoEJob(dense.Job):
    """tests/torchtitan_job.Job with an MoE model, expert parallelism and the load-balancing hook."""

    def __init__(self, family: str, layout: str, checkpoint: Any, *, seed: int = 0) -> None:
        dp, tp, ep = LAYOUTS[layout]
        cfg, parallelize = model_config(family)
        self.build(cfg, parallelize, checkpoint, dp=dp, tp=tp, ep=ep, seed=seed, replicate=REPLICATE.get(layout, 1))

    def after_optimizers(self) -> None:
        """The MoE families' ``post_optimizer_build_fn``: expert-bias updates before every optimizer step."""
        register_moe_load_balancing_hook(self.optimizers, [self.model], self.parallel_dims)

    def loss_sum(self, pred: Any, labels: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3 with MTP layers returns [main logits, one per MTP layer]: torchtitan's MTPLoss
        (positions: every sample is one document)."""
        if not isinstance(pred, list):
            return super().loss_sum(pred, labels)
        from torchtitan.models.deepseek_v3 import MTPLoss

        positions = torch.arange(labels.shape[1]).expand(labels.shape[0], -1)
        loss = MTPLoss(MTPLoss.Config())(pred, labels, positions=positions)
        return loss[0] if isinstance(loss, tuple) else loss


def placements(family: str, layout: str) -> dict[str, Any]:
    """What torchtitan's parallelize made of every model tensor: (type, mesh dims, placements, shape)."""
    job = MoEJob(family, layout, dense._config("/nonexistent-unused"))
    out = {}
    for k, v in job.model.state_dict().items():
        if hasattr(v, "placements"):
            out[k] = ("DTensor", list(v.device_mesh.mesh_dim_names), [repr(p) for p in v.placements], list(v.shape))
        else:
            out[k] = ("Tensor", None, None, list(v.shape))
    return out


def train(family: str, layout: str, folder: str, *, resume_step: int, reference: str | None = None,
          **kw: Any) -> dict[str, Any]:
    """The uninterrupted run, checkpointing every 2 steps (tests/torchtitan_job.train_job with an MoE job)."""
    return dense.train_job(MoEJob(family, layout, dense._config(folder, **kw)), resume_step=resume_step,
                           reference=reference)


def resume(family: str, layout: str, folder: str, *, load_step: int, reference: str | None = None,
           control: str | None = None, **kw: Any) -> dict[str, Any]:
    """Load ``load_step`` at ``layout`` (load_only), then train to STEPS; with ``reference``, also the
    reference run at this layout (tests/torchtitan_job.resume_job)."""
    return dense.resume_job(lambda config, seed: MoEJob(family, layout, config, seed=seed), folder,
                            load_step=load_step, reference=reference, control=control, **kw)


def parallel_config(layout: str) -> Any:
    """ckptkit's name for a torchtitan layout: with EP on, torchtitan does not TP-shard experts (etp 1)."""
    from ckptkit.layout.config import ParallelConfig

    dp, tp, ep = LAYOUTS[layout]
    assert layout not in REPLICATE, "a ParallelConfig has no replicate degree: HSDP shards over dp_shard only"
    return ParallelConfig(tp=tp, dp=dp, ep=ep, etp=1 if ep > 1 else tp)


def rules_predict_layout(family: str, layout: str) -> dict[str, Any]:
    """For every model and optimizer DTensor, as the manager would save it: the rule read off its grid
    (with the expert mark), evaluated at ckptkit's ParallelConfig for this layout, must give this rank
    exactly the pieces torchtitan gave it. Returns the rules (as JSON) and the mismatches."""
    from ckptkit.adapters.torchtitan_experts import mark_model, mark_optimizer
    from ckptkit.engine.dtensor_grid import grid_of, is_dtensor
    from ckptkit.engine.state import Experts
    from ckptkit.layout.rules import rule_from_grid

    job = MoEJob(family, layout, dense._config("/nonexistent-unused"))
    axes = job.checkpointer.expert_axes
    config = parallel_config(layout)
    items = {**{"model/" + k: v for k, v in mark_model(job.model.state_dict(), axes).items()},
             **{"optimizer/" + k: v for k, v in mark_optimizer(job.optimizers.state_dict(), axes).items()}}
    rules, wrong = {}, []
    rank = dist.get_rank()
    for key, value in items.items():
        axis = value.axis if isinstance(value, Experts) else None
        t = value.tensor if isinstance(value, Experts) else value
        if not (isinstance(t, torch.Tensor) and is_dtensor(t)):
            continue
        grid, coord = grid_of(t, key)
        rule = rule_from_grid(grid, axis)
        rules[key] = None if rule is None else rule.to_json()
        if rule is None:
            wrong.append((key, "no rule"))
            continue
        predicted = rule.evaluate(tuple(t.shape), config)
        have = grid.local_pieces(coord)
        want = predicted.local_pieces(predicted.mesh.coordinate(rank))
        if sorted(b for _, b in have[1]) != sorted(b for _, b in want[1]):
            wrong.append((key, f"{have[1]} vs {want[1]}"))
    job.close()
    return {"rules": rules, "wrong": wrong, "expert_keys": sorted(axes)}


def load_error(family: str, layout: str, folder: str, *, load_step: int, **kw: Any) -> str:
    """The message of the error a load of ``load_step`` raises (the test expects one)."""
    job = MoEJob(family, layout, dense._config(folder, load_step=load_step, load_only=True, **kw), seed=123)
    try:
        job.checkpointer.load(step=load_step)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    finally:
        job.close()
    raise AssertionError("the load succeeded")


def save_without_training(family: str, layout: str, folder: str) -> dict[str, str]:
    """For a family that cannot train here (gpt_oss): one optimizer step on random gradients (so the Adam
    moments exist and every tensor holds layout-independent random bytes), saved at step 2 by the
    manager; the digests of what was saved."""
    job = MoEJob(family, layout, dense._config(folder))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in sorted(job.model.named_parameters()):  # full tensors drawn alike on every rank, then sliced
            full = torch.randn(tuple(p.shape), generator=gen) * 0.1
            p.copy_(_like(p, full))
            p.grad = _like(p, torch.randn(tuple(p.shape), generator=gen))
    job.optimizers.step()
    job.train_state.step = 2
    job.checkpointer.save(2, last_step=False)
    digests = job.digests()
    job.close()
    return digests


def _like(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as ``p`` is (a DTensor with p's mesh and placements, or a plain tensor)."""
    if hasattr(p, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full, p.device_mesh, p.placements)
    return full


def load_digests(family: str, layout: str, folder: str, *, load_step: int) -> dict[str, dict[str, str]]:
    """A fresh job at ``layout`` (other initial weights) loads ``load_step``: its digests before and after."""
    job = MoEJob(family, layout, dense._config(folder, load_step=load_step, load_only=True), seed=123)
    before = job.digests()
    assert job.checkpointer.load(step=load_step) is True
    digests = job.digests()
    job.close()
    return {"before": before, "after": digests}
