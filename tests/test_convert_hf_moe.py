"""Hugging Face export/import of MoE models (qwen3 MoE, DeepSeek-V3) and of Megatron-core GPT names.

The reference for torchtitan models is torchtitan 0.3.0's own ``state_dict_adapter.to_hf`` (an
independent implementation of the renaming and the expert split) on tiny models built with
torchtitan's own layer builders. Megatron names are checked on a synthetic checkpoint whose
stacked tensors are packed here, head by head and expert by expert with plain loops, from the
HF tensors they must export to (Megatron jobs take ~30 s a world; this packing follows
megatron-core 0.16.1's ``get_query_key_value_tensors`` and ``SwiGLU`` ``chunk(2)``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckptkit_converters.hf.importer import import_hf, read_hf
from ckptkit_converters.hf.mapping import HFConfig
from ckptkit_converters.hf.exporter import INDEX_NAME, HFExportOptions, export_hf
from ckptkit_converters.registry import convert

import ckptkit
from tests import ckpt_files

torchtitan = pytest.importorskip("torchtitan")
from safetensors.torch import load_file, save_file

DIM, VOCAB, EXPERTS = 64, 128, 4


def _randomize(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
        for name, b in model.named_buffers():
            if name.endswith("expert_bias_E"):
                b.normal_()  # nonzero, so a dropped or misplaced bias shows
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def qwen3_moe():
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        Qwen3Model,
        _build_qwen3_moe_layers,
        _qwen3_norm,
        model_registry,
    )

    spec = model_registry("debugmodel_moe")
    cfg = Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=_qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=_build_qwen3_moe_layers(n_layers=2, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=16, moe_hidden_dim=24,
                                       num_experts=EXPERTS, top_k=2, attn_backend="flex", moe_comm_backend="standard",
                                       rope=CosSinRoPE.Config(dim=16, max_seq_len=64, theta=1e6)))
    model = cfg.build()
    hf_cfg = {"model_type": "qwen3_moe", "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "hidden_size": DIM, "vocab_size": VOCAB, "num_hidden_layers": 2, "num_experts": EXPERTS,
              "tie_word_embeddings": False}
    return spec, cfg, _randomize(model), hf_cfg


def deepseek_v3(q_lora_rank: int):
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.deepseek_v3 import (
        DeepSeekV3Model,
        _build_dsv3_layers,
        model_registry,
    )

    spec = model_registry("debugmodel")
    cfg = DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=RMSNorm.Config(normalized_shape=DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=_build_dsv3_layers(
            n_layers=3, n_dense_layers=1, dim=DIM, n_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mscale=0.7, dense_hidden_dim=96,
            moe_hidden_dim=24, num_experts=EXPERTS, num_shared_experts=2, router_top_k=2, router_score_func="softmax",
            attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
            rope=ComplexRoPE.Config(dim=8, max_seq_len=256, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                    beta_fast=32.0, beta_slow=1.0, original_seq_len=64)),
        mtp_layers=[])
    model = cfg.build()
    hf_cfg = {"model_type": "deepseek_v3", "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": VOCAB,
              "num_hidden_layers": 3, "n_routed_experts": EXPERTS, "first_k_dense_replace": 1,
              "q_lora_rank": q_lora_rank or None}
    return spec, cfg, _randomize(model), hf_cfg


def write_config(path: Path, doc: dict) -> str:
    path.write_text(json.dumps(doc))
    return str(path)


def load_export(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / INDEX_NAME).read_text()) if (folder / INDEX_NAME).exists() else None
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for f in files:
        part = load_file(str(folder / f))
        assert not set(part) & set(out)
        out.update(part)
    if index:
        assert index["weight_map"] == {k: f for f in files for k in load_file(str(folder / f))}
    return out


def assert_same(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(reference)
    for name, t in reference.items():
        assert ours[name].dtype == t.dtype and ours[name].shape == t.shape, name
        assert torch.equal(ours[name], t), name


# ---------------------------------------------------------------- torchtitan MoE models


def test_qwen3_moe_matches_torchtitans_adapter_and_imports_back(tmp_path):
    spec, cfg, sd, hf_cfg = qwen3_moe()
    ckptkit.save({"model": sd, "train": {"step": 1}}, str(tmp_path / "ckpt"))
    config = HFConfig.from_file(write_config(tmp_path / "config.json", hf_cfg))
    result = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), config,
                       options=HFExportOptions(max_shard_bytes=64 << 10))  # many shards: experts split over them
    assert len(result.shards) > 3 and result.family == "qwen3_moe" and result.prefix == "model/"
    assert result.dropped == ("layers.0.moe.expert_bias_E", "layers.1.moe.expert_bias_E")
    reference = spec.state_dict_adapter(cfg, None).to_hf(dict(sd))
    ours = load_export(tmp_path / "hf")
    assert_same(ours, reference)
    assert sum(".mlp.experts." in k for k in ours) == 2 * EXPERTS * 3

    kept = {k: v for k, v in sd.items() if not k.endswith("expert_bias_E")}
    assert_same(read_hf(str(tmp_path / "hf"), config), kept)
    # streamed import: a ckptkit checkpoint with the experts stacked again, one stored piece per expert
    import_hf(str(tmp_path / "hf"), str(tmp_path / "back"), config)
    view = ckptkit.open(str(tmp_path / "back"))
    assert sorted(view.keys()) == sorted("model/" + k for k in kept)
    assert_same({k[len("model/"):]: view[k][...] for k in view.keys()}, kept)
    w1 = view.manifest.tensors["model/layers.1.moe.routed_experts.inner_experts.w1_EFD"]
    assert len(w1.stored_pieces()) == EXPERTS


def test_qwen3_dense_tied_matches_torchtitans_adapter(tmp_path):
    """Dense Qwen3 with tied embeddings: no rotary permutation, q/k norms, and no lm_head written (the adapter
    drops it; HF re-ties it)."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers, _qwen3_norm, model_registry

    spec = model_registry("debugmodel")
    cfg = Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=_qwen3_norm(DIM), enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=_build_qwen3_layers(n_layers=2, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96,
                                   attn_backend="flex", rope=CosSinRoPE.Config(dim=16, max_seq_len=64, theta=1e6)))
    sd = _randomize(cfg.build())
    ckptkit.save({"model": sd}, str(tmp_path / "ckpt"))
    config = HFConfig.from_dict({"model_type": "qwen3", "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "vocab_size": VOCAB, "tie_word_embeddings": True})
    result = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), config)
    assert result.family == "qwen3" and result.dropped == ("lm_head.weight",)
    assert_same(load_export(tmp_path / "hf"), spec.state_dict_adapter(cfg, None).to_hf(dict(sd)))
    back = read_hf(str(tmp_path / "hf"), config)
    assert_same(back, {k: v for k, v in sd.items() if k != "lm_head.weight"})


@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_deepseek_v3_matches_torchtitans_adapter_and_round_trips(tmp_path, q_lora_rank):
    spec, cfg, sd, hf_cfg = deepseek_v3(q_lora_rank)
    ckptkit.save({"model": sd}, str(tmp_path / "ckpt"))
    config = HFConfig.from_file(write_config(tmp_path / "config.json", hf_cfg))
    result = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), config)
    assert result.family == "deepseek_v3" and result.dropped == () and result.shards == ("model.safetensors",)
    reference = spec.state_dict_adapter(cfg, None).to_hf(dict(sd))
    ours = load_export(tmp_path / "hf")
    assert_same(ours, reference)
    assert "model.layers.0.mlp.gate_proj.weight" in ours and "model.layers.0.mlp.gate.weight" not in ours  # dense
    assert torch.equal(ours["model.layers.2.mlp.gate.e_score_correction_bias"], sd["layers.2.moe.expert_bias_E"])
    assert ("model.layers.1.self_attn.q_a_proj.weight" in ours) == bool(q_lora_rank)
    assert_same(read_hf(str(tmp_path / "hf"), config), sd)  # everything comes back, the expert bias included


def test_a_missing_expert_in_the_checkpoint_fails_before_writing_naming_layer_and_expert(tmp_path):
    _, _, sd, hf_cfg = qwen3_moe()
    config = HFConfig.from_dict(hf_cfg)
    ckptkit.save({"model": sd}, str(tmp_path / "ckpt"))
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), config)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "stacked"), config)  # one stored piece per expert
    key = "model/layers.1.moe.routed_experts.inner_experts.w2_EDF"

    def drop(doc):
        pieces = doc["tensors"][key]["layout"]["pieces"]
        keep = [p for p in pieces if p[0][0] != 2]  # [offsets, sizes, flat, writer]: expert 2
        assert len(keep) == len(pieces) - 1
        doc["tensors"][key]["layout"]["pieces"] = keep

    ckpt_files.edit_manifest(tmp_path / "stacked", drop)
    with pytest.raises(ckptkit.CoverageError, match=r"w2_EDF.*expert 2 \(of 4\)"):
        export_hf(str(tmp_path / "stacked"), str(tmp_path / "hf2"), config)
    assert not (tmp_path / "hf2").exists() or not any((tmp_path / "hf2").iterdir())


def test_an_hf_folder_missing_one_expert_is_refused_naming_layer_and_expert(tmp_path):
    spec, cfg, sd, hf_cfg = qwen3_moe()
    reference = spec.state_dict_adapter(cfg, None).to_hf(dict(sd))
    (tmp_path / "hf").mkdir()
    broken = {k: v.contiguous() for k, v in reference.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"}
    save_file(broken, str(tmp_path / "hf" / "model.safetensors"))
    for config in (HFConfig.from_dict(hf_cfg), HFConfig.from_dict({**hf_cfg, "num_experts": None})):
        # with the config's expert count, and without it (the other layer shows there are 4)
        with pytest.raises(ckptkit.MissingKeysError, match=r"layer 1, expert 3 \(of 4\).*experts\.3\.up_proj"):
            read_hf(str(tmp_path / "hf"), config)
        with pytest.raises(ckptkit.MissingKeysError, match=r"layer 1, expert 3"):
            import_hf(str(tmp_path / "hf"), str(tmp_path / "out"), config)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    # the last expert of every layer gone, with the config's count: still named
    save_file({k: v.contiguous() for k, v in reference.items() if ".experts.3." not in k},
              str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(ckptkit.MissingKeysError, match=r"layer 0, expert 3 \(of 4\)"):
        read_hf(str(tmp_path / "hf"), HFConfig.from_dict(hf_cfg))


def test_damaged_hf_files_are_refused_naming_the_file(tmp_path):
    _, _, sd, hf_cfg = qwen3_moe()
    config = HFConfig.from_dict(hf_cfg)
    ckptkit.save({"model": sd}, str(tmp_path / "ckpt"))
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), config)
    shard = tmp_path / "hf" / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])  # truncated: the last tensor's offsets run past the end
    with pytest.raises(ckptkit.CorruptCheckpointError, match=r"model.safetensors: tensor .* data offsets"):
        read_hf(str(tmp_path / "hf"), config)
    shard.write_bytes((10**9).to_bytes(8, "little") + data[8:])  # a header length past the file
    with pytest.raises(ckptkit.CorruptCheckpointError, match=r"model.safetensors: header of 1000000000 bytes"):
        read_hf(str(tmp_path / "hf"), config)
    index = tmp_path / "hf" / INDEX_NAME
    doc = json.loads(index.read_text())
    doc["weight_map"]["lm_head.weight"] = "../outside.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(ckptkit.CorruptCheckpointError, match="not a plain .safetensors file name"):
        read_hf(str(tmp_path / "hf"), config)


def test_the_configs_expert_and_layer_counts_are_checked(tmp_path):
    _, _, sd, hf_cfg = qwen3_moe()
    ckptkit.save({"model": sd}, str(tmp_path / "ckpt"))
    with pytest.raises(ckptkit.MissingKeysError, match=r"layer 0, tensor .*w1_EFD.*4 experts stored.*says 8"):
        export_hf(str(tmp_path / "ckpt"), str(tmp_path / "a"), HFConfig.from_dict({**hf_cfg, "num_experts": 8}))
    with pytest.raises(ckptkit.MissingKeysError, match=r"layer\(s\) \[2\] of 3"):
        export_hf(str(tmp_path / "ckpt"), str(tmp_path / "b"), HFConfig.from_dict({**hf_cfg, "num_hidden_layers": 3}))
    with pytest.raises(ckptkit.CkptkitError, match=r"128 vocabulary rows.*vocab_size 100"):
        export_hf(str(tmp_path / "ckpt"), str(tmp_path / "c"), HFConfig.from_dict({**hf_cfg, "vocab_size": 100}))


# ---------------------------------------------------------------- where the model is, which table


def test_the_model_is_found_at_the_top_level_of_a_torchtitan_dcp_checkpoint(tmp_path):
    """A torchtitan DCP save (model keys at the top level beside optimizer, train_state, lr_scheduler, dataloader)
    exports straight from the DCP folder: the registry imports it on the fly, the export finds the model."""
    import torch.distributed.checkpoint as dcp

    spec, cfg, sd, hf_cfg = qwen3_moe()
    state = {**sd, "optimizer": {"state": {k: {"exp_avg": torch.zeros_like(v)} for k, v in list(sd.items())[:3]}},
             "train_state": {"step": torch.tensor(7)}, "lr_scheduler": {"lr": torch.tensor(0.1)},
             "dataloader": {"pos": torch.tensor(3)}}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    result = convert(tmp_path / "dcp", tmp_path / "hf", to_format="hf",
                     target_options=HFExportOptions(config=write_config(tmp_path / "config.json", hf_cfg)))
    assert result.prefix == "" and result.family == "qwen3_moe"
    assert_same(load_export(tmp_path / "hf"), spec.state_dict_adapter(cfg, None).to_hf(dict(sd)))
    # the same state saved by ckptkit with the model at the top level; and an explicit prefix still wins
    ckptkit.save(state, str(tmp_path / "flat"))
    assert export_hf(str(tmp_path / "flat"), str(tmp_path / "hf2"), HFConfig.from_dict(hf_cfg)).prefix == ""
    with pytest.raises(ckptkit.MissingKeysError, match="no tensors under 'model/'"):
        export_hf(str(tmp_path / "flat"), str(tmp_path / "hf3"), HFConfig.from_dict(hf_cfg),
                  options=HFExportOptions(prefix="model/"))
    ckptkit.save({"weights": {"a": torch.ones(2)}}, str(tmp_path / "nothing"))
    with pytest.raises(ckptkit.MissingKeysError, match="no model weights found.*--prefix"):
        export_hf(str(tmp_path / "nothing"), str(tmp_path / "hf4"), HFConfig.from_dict(hf_cfg))


def test_the_table_comes_from_the_configs_model_type_via_the_cli(tmp_path):
    from click.testing import CliRunner

    from ckptkit.cli.main import cli

    spec, cfg, sd, hf_cfg = deepseek_v3(0)
    ckptkit.save({"model": sd}, str(tmp_path / "ckpt"))
    conf = write_config(tmp_path / "config.json", hf_cfg)
    res = CliRunner().invoke(cli, ["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--format", "hf",
                                   "--hf-config", conf])
    assert res.exit_code == 0, res.output
    assert_same(load_export(tmp_path / "hf"), spec.state_dict_adapter(cfg, None).to_hf(dict(sd)))
    res = CliRunner().invoke(cli, ["convert", str(tmp_path / "hf"), str(tmp_path / "back"), "--from", "hf",
                                   "--hf-config", conf])
    assert res.exit_code == 0, res.output
    view = ckptkit.open(str(tmp_path / "back"))
    assert all(torch.equal(view["model/" + k][...], v) for k, v in sd.items()) and len(view) == len(sd)

    gpt2 = write_config(tmp_path / "gpt2.json", {**hf_cfg, "model_type": "gpt2"})
    res = CliRunner().invoke(cli, ["convert", str(tmp_path / "ckpt"), str(tmp_path / "x"), "--format", "hf",
                                   "--hf-config", gpt2])
    assert res.exit_code != 0 and "model_type 'gpt2'" in res.output and "deepseek_v3" in res.output
    # the wrong table for these names: every unknown tensor is named, nothing is written
    llama = write_config(tmp_path / "llama.json", {**hf_cfg, "model_type": "llama"})
    res = CliRunner().invoke(cli, ["convert", str(tmp_path / "ckpt"), str(tmp_path / "y"), "--format", "hf",
                                   "--hf-config", llama])
    assert res.exit_code != 0 and "no llama HF name" in res.output and "wkv_a" in res.output
    assert not (tmp_path / "y" / INDEX_NAME).exists()


def test_a_config_without_what_the_table_needs_names_the_field(tmp_path):
    from tests.test_convert_hf import debug_model

    _, _, model = debug_model()
    ckptkit.save({"model": {k: v.detach() for k, v in model.state_dict().items()}}, str(tmp_path / "ckpt"))
    conf = write_config(tmp_path / "config.json", {"model_type": "llama", "vocab_size": 2048})
    with pytest.raises(ckptkit.CkptkitError, match=r"config.json: no 'num_attention_heads', needed for the rotary"):
        export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), HFConfig.from_file(conf))
    with pytest.raises(ckptkit.CkptkitError, match="'num_attention_heads' must be a positive integer"):
        HFConfig.from_dict({"num_attention_heads": "8"})


# ---------------------------------------------------------------- Megatron-core GPT names

L, H, NG, QPG, HD, FFN, E, MFFN, SFFN, V, PADDED = 2, 32, 2, 2, 8, 40, 4, 12, 20, 250, 256


def megatron_model(tied: bool, moe: bool, *, shared: bool = True, qkv_bias: bool = True,
                   qk_norm: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(Megatron sharded state, the HF tensors it must export to). The HF side is drawn first; the Megatron
    tensors are packed from it with loops, in megatron-core's own layouts. ``shared``: Qwen2-MoE's shared
    expert and its gate (MoE only); ``qkv_bias``: the QKV biases; ``qk_norm``: Qwen3's per-head-dim q/k
    layernorms (``self_attention.q_layernorm`` / ``k_layernorm``, stacked over layers)."""
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g)
    hf: dict[str, torch.Tensor] = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": r(H)}
    emb = torch.cat([hf["model.embed_tokens.weight"], r(PADDED - V, H)])  # Megatron's padding rows
    meg: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": emb, "decoder.final_layernorm.weight":
                                    hf["model.norm.weight"]}
    if not tied:
        hf["lm_head.weight"] = r(V, H)
        meg["output_layer.weight"] = torch.cat([hf["lm_head.weight"], r(PADDED - V, H)])
    qkv, qkv_b, proj, ln1, ln2, fc1, fc2 = [], [], [], [], [], [], []
    router, bias, e_fc1, e_fc2, s_fc1, s_fc2, s_gate, q_ln, k_ln = [], [], [], [], [], [], [], [], []
    for layer in range(L):
        p = f"model.layers.{layer}."
        q, k, v = r(NG * QPG * HD, H), r(NG * HD, H), r(NG * HD, H)
        qb, kb, vb = r(NG * QPG * HD), r(NG * HD), r(NG * HD)
        hf.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
                   p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb, p + "self_attn.v_proj.bias": vb,
                   p + "self_attn.o_proj.weight": r(H, NG * QPG * HD), p + "input_layernorm.weight": r(H),
                   p + "post_attention_layernorm.weight": r(H)})
        rows, brows = [], []
        for grp in range(NG):  # [ng, (q_per_group + 2) * head_dim, h]: a group's queries, then its key and value
            for j in range(QPG):
                head = grp * QPG + j
                rows.append(q[head * HD:(head + 1) * HD])
                brows.append(qb[head * HD:(head + 1) * HD])
            rows += [k[grp * HD:(grp + 1) * HD], v[grp * HD:(grp + 1) * HD]]
            brows += [kb[grp * HD:(grp + 1) * HD], vb[grp * HD:(grp + 1) * HD]]
        qkv.append(torch.cat(rows))
        qkv_b.append(torch.cat(brows))
        if not qkv_bias:
            for name in ("q_proj", "k_proj", "v_proj"):
                del hf[p + f"self_attn.{name}.bias"]
        if qk_norm:
            hf[p + "self_attn.q_norm.weight"], hf[p + "self_attn.k_norm.weight"] = r(HD), r(HD)
            q_ln.append(hf[p + "self_attn.q_norm.weight"])
            k_ln.append(hf[p + "self_attn.k_norm.weight"])
        proj.append(hf[p + "self_attn.o_proj.weight"])
        ln1.append(hf[p + "input_layernorm.weight"])
        ln2.append(hf[p + "post_attention_layernorm.weight"])
        if not moe:
            gate, up, down = r(FFN, H), r(FFN, H), r(H, FFN)
            hf.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": down})
            fc1.append(torch.cat([gate, up]))  # SwiGLU: chunk(2) -> (gate, linear)
            fc2.append(down)
            continue
        hf[p + "mlp.gate.weight"] = r(E, H)
        router.append(hf[p + "mlp.gate.weight"])
        bias.append(r(E))
        ef1, ef2 = [], []
        for e in range(E):
            gate, up, down = r(MFFN, H), r(MFFN, H), r(H, MFFN)
            x = p + f"mlp.experts.{e}."
            hf.update({x + "gate_proj.weight": gate, x + "up_proj.weight": up, x + "down_proj.weight": down})
            ef1.append(torch.cat([gate, up]))
            ef2.append(down)
        e_fc1.append(torch.stack(ef1))
        e_fc2.append(torch.stack(ef2))
        if not shared:
            continue
        gate, up, down = r(SFFN, H), r(SFFN, H), r(H, SFFN)
        hf.update({p + "mlp.shared_expert.gate_proj.weight": gate, p + "mlp.shared_expert.up_proj.weight": up,
                   p + "mlp.shared_expert.down_proj.weight": down, p + "mlp.shared_expert_gate.weight": r(1, H)})
        s_fc1.append(torch.cat([gate, up]))
        s_fc2.append(down)
        s_gate.append(hf[p + "mlp.shared_expert_gate.weight"])
    d = "decoder.layers."
    if qkv_bias:
        meg[d + "self_attention.linear_qkv.bias"] = torch.stack(qkv_b)
    if qk_norm:
        meg[d + "self_attention.q_layernorm.weight"] = torch.stack(q_ln)
        meg[d + "self_attention.k_layernorm.weight"] = torch.stack(k_ln)
    meg.update({d + "self_attention.linear_qkv.weight": torch.stack(qkv),
                d + "self_attention.linear_proj.weight": torch.stack(proj),
                d + "self_attention.linear_qkv.layer_norm_weight": torch.stack(ln1),
                d + "mlp.linear_fc1.layer_norm_weight": torch.stack(ln2)})
    if moe:
        meg.update({d + "mlp.router.weight": torch.stack(router), d + "mlp.router.expert_bias": torch.stack(bias),
                    d + "mlp.experts.experts.linear_fc1.weight": torch.stack(e_fc1),  # [layers, experts, 2*ffn, h]
                    d + "mlp.experts.experts.linear_fc2.weight": torch.stack(e_fc2)})
    if moe and shared:
        meg.update({d + "mlp.shared_experts.linear_fc1.weight": torch.stack(s_fc1),
                    d + "mlp.shared_experts.linear_fc2.weight": torch.stack(s_fc2),
                    d + "mlp.shared_experts.gate_weight": torch.stack(s_gate)})
    if not moe:
        meg.update({d + "mlp.linear_fc1.weight": torch.stack(fc1), d + "mlp.linear_fc2.weight": torch.stack(fc2)})
    return meg, hf


def test_megatron_moe_names_export_with_the_qkv_and_glu_splits_and_import_back(tmp_path):
    meg, hf = megatron_model(tied=False, moe=True)
    padding = {"embedding.word_embeddings.weight.vocab_padding": torch.zeros(6, H)}  # the live adapter's side tensor
    ckptkit.save({"model": {**meg, **padding}, "optimizer": {"exp_avg": {k: torch.zeros(1) for k in list(meg)[:2]}}},
                 str(tmp_path / "ckpt"))
    conf = {"model_type": "qwen2_moe", "num_attention_heads": NG * QPG, "num_key_value_heads": NG, "vocab_size": V,
            "num_hidden_layers": L, "num_experts": E}
    result = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), HFConfig.from_dict(conf),
                       options=HFExportOptions(max_shard_bytes=16 << 10))
    assert result.family == "megatron_qwen2_moe"
    assert sorted(result.dropped) == ["decoder.layers.mlp.router.expert_bias",
                                      "embedding.word_embeddings.weight.vocab_padding"]
    assert_same(load_export(tmp_path / "hf"), hf)  # padding rows gone, QKV and [gate; up] split, experts per key
    transformers = pytest.importorskip("transformers")  # the names and shapes transformers' own Qwen2-MoE has
    write_config(tmp_path / "hf" / "config.json", {
        **conf, "hidden_size": H, "head_dim": HD, "intermediate_size": FFN, "moe_intermediate_size": MFFN,
        "shared_expert_intermediate_size": SFFN, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "tie_word_embeddings": False})
    model, info = transformers.Qwen2MoeForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32,
                                                                  output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    gate = model.model.layers[1].mlp.shared_expert_gate.weight.detach()
    assert torch.equal(gate, hf["model.layers.1.mlp.shared_expert_gate.weight"])

    back = read_hf(str(tmp_path / "hf"), HFConfig.from_dict(conf), naming="megatron")
    expected = {k: v for k, v in meg.items() if k != "decoder.layers.mlp.router.expert_bias"}
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        expected[key] = meg[key][:V]  # model space holds the true vocabulary
    assert_same(back, expected)


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
def test_megatron_qwen3_qk_norms_export_into_a_transformers_model(tmp_path, moe):
    """megatron_qwen3 / megatron_qwen3_moe: Megatron's q/k layernorms become HF's ``q_norm`` / ``k_norm``
    (no QKV bias, no shared expert), bit for bit; transformers' own Qwen3 / Qwen3-MoE model loads the export
    with no key missing, unexpected or of another shape, its q/k norms holding the Megatron values; and it
    imports back to Megatron's names."""
    transformers = pytest.importorskip("transformers")
    meg, hf = megatron_model(tied=False, moe=moe, shared=False, qkv_bias=False, qk_norm=True)
    conf = {"model_type": "qwen3_moe" if moe else "qwen3", "num_attention_heads": NG * QPG,
            "num_key_value_heads": NG, "vocab_size": V, "num_hidden_layers": L, "hidden_size": H, "head_dim": HD,
            "intermediate_size": FFN, "tie_word_embeddings": False}
    if moe:
        conf.update({"num_experts": E, "moe_intermediate_size": MFFN, "num_experts_per_tok": 2,
                     "decoder_sparse_step": 1, "mlp_only_layers": []})
    ckptkit.save({"model": meg}, str(tmp_path / "ckpt"))
    result = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), HFConfig.from_dict(conf))
    assert result.family == ("megatron_qwen3_moe" if moe else "megatron_qwen3")
    exported = load_export(tmp_path / "hf")
    assert_same(exported, hf)
    assert any(k.endswith("self_attn.q_norm.weight") for k in exported)
    model_cls = transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM
    config_cls = transformers.Qwen3MoeConfig if moe else transformers.Qwen3Config
    write_config(tmp_path / "hf" / "config.json", conf)
    model, info = model_cls.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32, output_loading_info=True)
    assert isinstance(model.config, config_cls)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    for i in range(L):
        attn = model.model.layers[i].self_attn
        assert torch.equal(attn.q_norm.weight.detach(), hf[f"model.layers.{i}.self_attn.q_norm.weight"])
        assert torch.equal(attn.k_norm.weight.detach(), hf[f"model.layers.{i}.self_attn.k_norm.weight"])
    back = read_hf(str(tmp_path / "hf"), HFConfig.from_dict(conf), naming="megatron")
    expected = dict(meg)
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        expected[key] = meg[key][:V]  # model space holds the true vocabulary
    if moe:
        del expected["decoder.layers.mlp.router.expert_bias"]  # qwen3_moe has no balancing bias: dropped
    assert_same(back, expected)


def test_megatron_dense_tied_and_per_layer_keys(tmp_path):
    meg, hf = megatron_model(tied=True, moe=False)
    conf = {"model_type": "llama", "num_attention_heads": NG * QPG, "num_key_value_heads": NG, "vocab_size": V,
            "tie_word_embeddings": True}
    ckptkit.save({"model": meg}, str(tmp_path / "ckpt"))
    llama = HFConfig.from_dict(conf)
    result = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), llama)
    assert result.family == "megatron_llama"
    assert_same(load_export(tmp_path / "hf"), hf)
    # Megatron's per-layer keys (an MoE layer pattern declares decoder.layers.<i>.*): the same export
    per_layer = {k: v for k, v in meg.items() if not k.startswith("decoder.layers.")}
    for k, v in meg.items():
        if k.startswith("decoder.layers."):
            per_layer.update({f"decoder.layers.{i}.{k[len('decoder.layers.'):]}": v[i] for i in range(L)})
    ckptkit.save({"model": per_layer}, str(tmp_path / "per_layer"))
    export_hf(str(tmp_path / "per_layer"), str(tmp_path / "hf2"), llama)
    assert_same(load_export(tmp_path / "hf2"), hf)
    # no output layer, and a config that does not say the embeddings are tied: refused
    with pytest.raises(ckptkit.CkptkitError, match="no output_layer.weight.*tie_word_embeddings"):
        export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf3"), HFConfig.from_dict({**conf, "tie_word_embeddings": None}))
    with pytest.raises(ckptkit.CkptkitError, match="no 'vocab_size', needed for removing Megatron's vocabulary"):
        export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf4"), HFConfig.from_dict({**conf, "vocab_size": None}))
    with pytest.raises(ckptkit.CkptkitError, match="do not split into 3 query groups"):
        export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf5"),
                  HFConfig.from_dict({**conf, "num_attention_heads": 6, "num_key_value_heads": 3}))
