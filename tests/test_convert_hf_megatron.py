"""A real Megatron-core GPT, saved by Megatron's own ``dist_checkpointing``, exported to HF and run by ``transformers``.

tests/megatron_model.py's tiny GPT (GQA 8 heads in 2 query groups, SwiGLU, RMSNorm, RoPE,
vocabulary 250 padded to 256), dense and MoE (8 SequentialMLP experts, top-2 softmax routing,
no shared expert: Mixtral's architecture), weights redrawn at a scale where every transform
matters. A one-process gloo world builds it with megatron-core 0.16.1, records its logits on
a few tokens and saves it as ``torch_dist``. A third model adds Qwen2-MoE's gated shared expert
(``moe_shared_expert_gate``, intermediate size 32) beside the routed ones. The test converts that folder with
``ckptkit convert --format hf`` (the registry imports the foreign folder on the fly: Megatron's
fused QKV split per query group, ``[gate; up]`` split, experts split from
``[layers, experts, 2F, h]``, vocabulary padding dropped), loads it with ``transformers``
(``LlamaForCausalLM`` / ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM``, configs written here) and compares the logits
with Megatron's within 1e-4. Skipped without megatron-core or transformers.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from ckptkit_converters.hf.options import HFExportOptions  # noqa: E402
from ckptkit_converters.megatron.options import MegatronImportOptions  # noqa: E402
from ckptkit_converters.registry import convert  # noqa: E402

VOCAB, SEQ = 250, 16


@pytest.fixture(scope="module", autouse=True)
def retire_world(worlds):
    """The Megatron CPU shims stay installed in the world's process: close it after this module."""
    yield
    worlds.retire(1)


KINDS = ("dense", "moe", "shared")
"""The models: dense (Llama), routed experts only (Mixtral), routed experts and a gated shared one (Qwen2-MoE)."""


def save_and_logits(folder: str, kind: str) -> torch.Tensor:
    """(rank function) Build the model at tp1pp1, redraw its weights, save torch_dist; Megatron's logits."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from tests import megatron_convert_job as cjob
    from tests import megatron_model as mm

    layout = mm.Layout(tp=1, pp=1, dist_opt=False, experts=0 if kind == "dense" else 8,
                       shared_expert=kind == "shared", shared_gate=kind == "shared")
    trainer = mm.setup(layout)
    module = trainer.model[0].module
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.ndim == 1 else 0.0))  # norms near 1
    module.eval()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).tril().logical_not()
    with torch.no_grad():
        logits = module(tokens, positions, mask)
    os.makedirs(folder, exist_ok=True)
    dist_checkpointing.save({"model": module.sharded_state_dict(), "iteration": 1, "checkpoint_version": 3.0,
                             "args": cjob.mlm_args(layout)}, folder)
    mm.teardown()
    dist.barrier()
    return logits.detach().clone()


def hf_config(kind: str) -> dict:
    doc = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8,
           "num_key_value_heads": 2, "intermediate_size": 96, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "max_position_embeddings": 64, "tie_word_embeddings": False, "model_type": "llama", "head_dim": 8}
    if kind == "moe":
        doc.update(model_type="mixtral", intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
    if kind == "shared":  # Megatron's softmax top-k renormalises over the chosen experts: norm_topk_prob
        doc.update(model_type="qwen2_moe", moe_intermediate_size=48, shared_expert_intermediate_size=32,
                   num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                   mlp_only_layers=[], qkv_bias=False)
    return doc


FAMILY = {"dense": "megatron_llama", "moe": "megatron_mixtral", "shared": "megatron_qwen2_moe"}


@pytest.mark.parametrize("kind", KINDS)
def test_megatron_torch_dist_exports_to_transformers_with_the_same_logits(worlds, tmp_path, kind):
    folder = str(tmp_path / "iter_0000001")
    (logits,) = worlds.run(1, save_and_logits, folder, kind)
    config = hf_config(kind)
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = convert(folder, tmp_path / "hf", to_format="hf",
                     source_options=MegatronImportOptions(vocab_size=VOCAB),
                     target_options=HFExportOptions(config=str(tmp_path / "config.json")))
    assert result.family == FAMILY[kind]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    cls = {"dense": transformers.LlamaForCausalLM, "moe": transformers.MixtralForCausalLM,
           "shared": transformers.Qwen2MoeForCausalLM}[kind]
    hf, info = cls.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf.eval()(tokens).logits
    assert logits.shape[-1] == 256 and theirs.shape == (2, SEQ, VOCAB)  # Megatron's padded vocabulary
    assert (logits[..., :VOCAB] - theirs).abs().max().item() <= 1e-4
    assert theirs.abs().max().item() > 0.5
