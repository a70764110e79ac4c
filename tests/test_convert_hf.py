"""Hugging Face safetensors export: names, the rotary permutation, shards, and a numerical round trip.

The reference is torchtitan's own llama3 state-dict adapter (an independent
implementation of the same renaming and permutation) on torchtitan's debug model.
"""

from __future__ import annotations

import json

import pytest
import torch

import ckptkit
from ckptkit_converters.hf.exporter import (
    INDEX_NAME,
    AttentionHeads,
    HFExportOptions,
    export_hf,
    read_hf,
    rope_from_hf,
    rope_to_hf,
)

torchtitan = pytest.importorskip("torchtitan")


def debug_model(n_kv_heads: int | None = None):
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    cfg = spec.model
    if n_kv_heads is not None:  # grouped-query attention: keys and values have fewer heads
        # torchtitan's own layer builder (private, test-only use) with the debug model's settings
        from torchtitan.models.common.rope import ComplexRoPE
        from torchtitan.models.llama3 import _build_llama3_layers, compute_ffn_hidden_dim

        dim, n_heads = cfg.dim, cfg.layers[0].attention.n_heads
        cfg.layers = _build_llama3_layers(
            n_layers=len(cfg.layers), dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=256),
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=131072, theta=500000, scaling="llama"),
            attn_backend="flex")
    torch.manual_seed(0)
    model = cfg.build()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return spec, cfg, model


@pytest.mark.parametrize("n_kv_heads", [None, 4])
def test_export_matches_torchtitans_adapter_and_round_trips(tmp_path, n_kv_heads):
    spec, cfg, model = debug_model(n_kv_heads)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ckpt = tmp_path / "ckpt"
    ckptkit.save({"model": sd, "train": {"step": 3}}, str(ckpt))
    attn = cfg.layers[0].attention
    heads = AttentionHeads(attn.n_heads, attn.n_kv_heads or attn.n_heads)
    # small shards: several files and an index, as for a real model
    result = export_hf(str(ckpt), str(tmp_path / "hf"), heads, options=HFExportOptions(max_shard_bytes=2 << 20))
    assert len(result.shards) > 1 and result.tensors == len(sd)
    index = json.loads((tmp_path / "hf" / INDEX_NAME).read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(result.shards)

    from safetensors.torch import load_file

    ours = {}
    for f in result.shards:
        ours.update(load_file(str(tmp_path / "hf" / f)))
    reference = spec.state_dict_adapter(cfg, None).to_hf(dict(sd))
    assert sorted(ours) == sorted(reference)
    for name, t in reference.items():
        assert torch.equal(ours[name], t), name
    back = read_hf(str(tmp_path / "hf"), heads)
    assert sorted(back) == sorted(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_export_casts_and_refuses_unknown_names_and_reused_destinations(tmp_path):
    _, cfg, model = debug_model()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ckptkit.save({"model": sd}, str(tmp_path / "a"))
    heads = AttentionHeads(cfg.layers[0].attention.n_heads, cfg.layers[0].attention.n_heads)
    export_hf(str(tmp_path / "a"), str(tmp_path / "hf"), heads, options=HFExportOptions(dtype="bfloat16"))
    back = read_hf(str(tmp_path / "hf"), heads)
    assert all(back[k].dtype == torch.bfloat16 and torch.equal(back[k], sd[k].to(torch.bfloat16)) for k in sd)
    with pytest.raises(ckptkit.CkptkitError, match="model.safetensors exists: an HF export writes its weights into a folder that holds none"):
        export_hf(str(tmp_path / "a"), str(tmp_path / "hf"), heads)
    ckptkit.save({"model": {**sd, "mystery.weight": torch.ones(2)}}, str(tmp_path / "b"))
    with pytest.raises(ckptkit.MissingKeysError, match="mystery.weight"):
        export_hf(str(tmp_path / "b"), str(tmp_path / "hf2"), heads)
    assert not (tmp_path / "hf2" / INDEX_NAME).exists()


def test_rope_permutation_is_a_per_head_bijection():
    w = torch.arange(8 * 16 * 3, dtype=torch.float32).reshape(8 * 16, 3)
    assert torch.equal(rope_from_hf(rope_to_hf(w, 8), 8), w)
    hf = rope_to_hf(w, 8)
    assert torch.equal(hf[:8], w[0:16:2]) and torch.equal(hf[8:16], w[1:16:2])  # head 0: evens, then odds
    with pytest.raises(ckptkit.CkptkitError, match="cannot have 3 heads"):
        rope_to_hf(w, 3)


def test_cli_exports_with_head_counts_from_an_hf_config(tmp_path):
    from click.testing import CliRunner

    from ckptkit.cli.main import cli

    _, cfg, model = debug_model()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ckptkit.save({"model": sd}, str(tmp_path / "ckpt"))
    n = cfg.layers[0].attention.n_heads
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": n, "num_key_value_heads": n}))
    res = CliRunner().invoke(cli, ["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--format", "hf",
                                   "--hf-config", str(tmp_path / "config.json")])
    assert res.exit_code == 0, res.output
    assert "57 tensors" in res.output
    back = read_hf(str(tmp_path / "hf"), AttentionHeads(n, n))
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    res = CliRunner().invoke(cli, ["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf2"), "--format", "hf"])
    assert res.exit_code != 0 and "head counts" in res.output


def test_a_failed_export_leaves_only_the_users_files_whichever_write_fails(tmp_path, monkeypatch):
    """The disk fills up at any write of an export, a shard's or the index's (written last): the user's
    folder keeps its own files and nothing of the export. A failed index write left every shard behind (a
    folder no loader can use, refused by the retry), found by a hunt on 2026-12-06."""
    from ckptkit.storage.local import LocalStore

    _, cfg, model = debug_model()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ckptkit.save({"model": sd}, str(tmp_path / "a"))
    heads = AttentionHeads(cfg.layers[0].attention.n_heads, cfg.layers[0].attention.n_heads)
    options = HFExportOptions(max_shard_bytes=2 << 20)
    writes = {"count": 0, "fail_at": None}

    def counting(real, chunked: bool):
        def write(self, name, data):
            writes["count"] += 1
            if writes["count"] == writes["fail_at"]:
                blob = b"".join(bytes(c) for c in data) if chunked else bytes(data)
                half = blob[: len(blob) // 2]
                real(self, name, [half] if chunked else half)  # half of it lands, then the disk is full
                raise OSError(28, "No space left on device", name)
            return real(self, name, data)
        return write

    monkeypatch.setattr(LocalStore, "write_object", counting(LocalStore.write_object, True))
    monkeypatch.setattr(LocalStore, "put_bytes", counting(LocalStore.put_bytes, False))
    total = len(export_hf(str(tmp_path / "a"), str(tmp_path / "probe"), heads, options=options).shards) + 1
    for fail_at in range(1, total + 1):
        out = tmp_path / f"hf{fail_at}"
        out.mkdir()
        (out / "config.json").write_text("{}")
        writes.update(count=0, fail_at=fail_at)
        with pytest.raises((ckptkit.CkptkitError, OSError)):
            export_hf(str(tmp_path / "a"), str(out), heads, options=options)
        assert sorted(p.name for p in out.iterdir()) == ["config.json"], fail_at
    writes["fail_at"] = None
    export_hf(str(tmp_path / "a"), str(tmp_path / f"hf{total}"), heads, options=options)  # the retry goes through
