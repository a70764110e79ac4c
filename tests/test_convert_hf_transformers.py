"""Exported weights load into Hugging Face ``transformers`` and give the torchtitan model's logits.

The strongest check an export can get short of a published checkpoint: ``from_pretrained`` reads
the shards ckptkit wrote (its own safetensors reader, its own key expectations, strict about
missing and unexpected keys in what it reports), and the forward pass of HF's modeling code on
a few tokens matches torchtitan's forward on the source model within 1e-4. Configs are written
here for tiny models. Skipped when ``transformers`` is not installed (it is not a ckptkit
dependency; ``pip install transformers==5.23.*``).
"""

from __future__ import annotations

import json

import pytest
import torch
from ckptkit_converters.hf.mapping import HFConfig
from ckptkit_converters.hf.exporter import HFExportOptions, export_hf

import ckptkit

pytest.importorskip("torchtitan")
transformers = pytest.importorskip("transformers")

V, D, HEADS, KV_HEADS, LAYERS = 128, 64, 4, 2, 2
BASE = {"vocab_size": V, "hidden_size": D, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "max_position_embeddings": 64}


def _finish(cfg):
    """Causal SDPA instead of FlexAttention (no CPU path for it in torch 2.13 here; every sample is one
    document, so it is the attention flex would compute), then random weights of a realistic scale."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    model = cfg.build()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model.eval()


def llama():
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.llama3 import _build_llama3_layers, model_registry

    cfg = model_registry("debugmodel").model
    cfg.vocab_size, cfg.dim = V, D
    cfg.tok_embeddings = Embedding.Config(num_embeddings=V, embedding_dim=D)
    cfg.norm = RMSNorm.Config(normalized_shape=D)
    cfg.lm_head = Linear.Config(in_features=D, out_features=V)
    cfg.layers = _build_llama3_layers(  # interleaved RoPE: the export permutes q/k rows
        n_layers=LAYERS, dim=D, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=96, attn_backend="flex",
        rope=ComplexRoPE.Config(dim=D // HEADS, max_seq_len=64, theta=500000, scaling="none"))
    config = {**BASE, "model_type": "llama", "intermediate_size": 96, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "tie_word_embeddings": False}
    return _finish(cfg), config, transformers.LlamaForCausalLM


def qwen3(moe: bool):
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        Qwen3Model,
        _build_qwen3_layers,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )

    rope = CosSinRoPE.Config(dim=16, max_seq_len=64, theta=1e6)
    common = {"n_layers": LAYERS, "dim": D, "n_heads": HEADS, "n_kv_heads": KV_HEADS, "head_dim": 16,
              "attn_backend": "flex", "rope": rope}
    layers = (_build_qwen3_moe_layers(**common, moe_hidden_dim=24, num_experts=4, top_k=2, moe_comm_backend="standard")
              if moe else _build_qwen3_layers(**common, hidden_dim=96))
    cfg = Qwen3Model.Config(vocab_size=V, dim=D, norm=_qwen3_norm(D), enable_weight_tying=not moe,
                            tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=D),
                            lm_head=Linear.Config(in_features=D, out_features=V), layers=layers)
    config = {**BASE, "model_type": "qwen3_moe" if moe else "qwen3", "head_dim": 16, "intermediate_size": 96,
              "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": not moe}
    if moe:
        config.update(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[])
    return _finish(cfg), config, (transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM)


def mixtral():
    """A torchtitan MoE (GroupedExperts, softmax top-2 router with renormalised weights, as Mixtral routes)
    with Llama attention: no q/k norm, interleaved RoPE, so the export permutes q/k rows."""
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.config_utils import make_gqa_config
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.qwen3 import (
        _LINEAR_INIT,
        Qwen3Model,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )

    rope = ComplexRoPE.Config(dim=16, max_seq_len=64, theta=1e6, scaling="none")
    layers = _build_qwen3_moe_layers(n_layers=LAYERS, dim=D, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=16,
                                     moe_hidden_dim=24, num_experts=4, top_k=2, attn_backend="flex",
                                     moe_comm_backend="standard", rope=rope)
    for layer in layers:
        layer.attention = make_gqa_config(dim=D, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=16, fuse_qkv=True,
                                          wqkv_param_init=_LINEAR_INIT, wo_param_init=_LINEAR_INIT, rope=rope,
                                          inner_attention=layer.attention.inner_attention, qk_norm=None)
    cfg = Qwen3Model.Config(vocab_size=V, dim=D, norm=_qwen3_norm(D), layers=layers,
                            tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=D),
                            lm_head=Linear.Config(in_features=D, out_features=V))
    config = {**BASE, "model_type": "mixtral", "head_dim": 16, "intermediate_size": 24, "rms_norm_eps": 1e-6,
              "rope_theta": 1e6, "num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False}
    return _finish(cfg), config, transformers.MixtralForCausalLM


def deepseek_v3(q_lora_rank: int):
    """DeepSeek-V3 (MLA with and without the query LoRA, one dense layer then MoE layers with a sigmoid router,
    its selection bias and a shared expert), every RMSNorm at eps 1e-6 as in DeepSeek's reference code and
    HF's modeling (HF builds the MLA's ``q_a_layernorm`` / ``kv_a_layernorm`` at 1e-6 whatever the config says;
    torchtitan's default is 1e-5, which alone moves these logits by 1e-4). The routers' selection biases are
    drawn at random, so a bias the export lost would route other experts."""
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers

    layers = _build_dsv3_layers(
        n_layers=3, n_dense_layers=1, dim=D, n_heads=HEADS, q_lora_rank=q_lora_rank, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mscale=1.0, dense_hidden_dim=96, moe_hidden_dim=24,
        num_experts=4, num_shared_experts=1, router_top_k=2, router_score_func="sigmoid", router_num_expert_groups=1,
        router_num_limited_groups=1, router_route_norm=True, router_route_scale=1.0, attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=8, max_seq_len=64, theta=10000.0, scaling="none"))
    for layer in layers:
        for norm in (layer.attention_norm, layer.ffn_norm, layer.attention.kv_norm, layer.attention.q_norm):
            norm.eps = 1e-6
    cfg = DeepSeekV3Model.Config(vocab_size=V, dim=D, norm=RMSNorm.Config(normalized_shape=D, eps=1e-6),
                                 tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=D),
                                 lm_head=Linear.Config(in_features=D, out_features=V), layers=layers, mtp_layers=[])
    model = _finish(cfg)
    biases = [b for name, b in model.named_buffers() if name.endswith("expert_bias_E")]
    assert len(biases) == 2
    with torch.no_grad():
        for b in biases:
            b.normal_(0, 0.5)
    config = {**BASE, "model_type": "deepseek_v3", "num_hidden_layers": 3, "num_key_value_heads": HEADS,
              "intermediate_size": 96, "moe_intermediate_size": 24, "n_routed_experts": 4, "n_shared_experts": 1,
              "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
              "norm_topk_prob": True, "routed_scaling_factor": 1.0, "q_lora_rank": q_lora_rank or None,
              "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "head_dim": 8,
              "rope_theta": 10000.0, "rope_scaling": None, "rope_interleave": True, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False}
    return model, config, transformers.DeepseekV3ForCausalLM


@pytest.mark.parametrize("build", [llama, lambda: qwen3(False), lambda: qwen3(True), mixtral,
                                   lambda: deepseek_v3(0), lambda: deepseek_v3(16)],
                         ids=["llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v3-q_lora"])
def test_transformers_loads_the_export_and_gives_the_same_logits(tmp_path, build):
    model, config, cls = build()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ckptkit.save({"model": sd}, str(tmp_path / "ckpt"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), HFConfig.from_file(tmp_path / "config.json"),
                       options=HFExportOptions(max_shard_bytes=40 << 10))
    assert len(result.shards) > 1  # the sharded index path, as for a real model
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    hf, info = cls.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf.eval()(tokens).logits
    assert ours.shape == theirs.shape == (2, 12, V)
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert ours.abs().max().item() > 0.1  # the logits are not trivially small
