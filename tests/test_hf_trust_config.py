"""HF folders against their config: a tiny Llama and a tiny Qwen3-MoE saved by ``transformers``, then damaged.

Every tensor is deleted, reshaped and retyped in turn, tensors are added and duplicated, layer and
expert counts are raised past the files (to 10**9) and lowered under them, and every size of the config
is set to zero, a negative, a fraction, a string, a boolean, or to values that do not divide. Each case
goes through the library and the CLI (tests/test_hf_trust.py ``attempt``): a one-line error naming the
file and, for a tensor, the tensor and what the config implies, with nothing committed at DEST — or,
for the few legal variations (a tied ``lm_head`` kept), an import equal to the untouched folder's.
The module's last test prints the tally of the HF importer cases so far in the session.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_hf_trust import (  # noqa: F401 - built: a fixture
    LLAMA,
    TALLY,
    attempt,
    built,
    checkpoint_tensors,
    reference_import,
    report,
)

pytestmark = pytest.mark.timeout(300)
Tensors = dict[str, torch.Tensor]


def variant(src: Path, root: Path, *, tensors: Callable[[Tensors], None] | None = None,
            config: Callable[[dict], None] | None = None, shard: str | None = None) -> Path:
    """A copy of ``src`` with ``tensors`` applied to one shard's tensors (``shard``: which; default the one
    model.safetensors) and ``config`` to its config.json."""
    folder = root / f"case-{time.monotonic_ns()}"
    shutil.copytree(src, folder)
    if tensors is not None:
        path = folder / (shard or "model.safetensors")
        sd = load_file(str(path))
        tensors(sd)
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata={"format": "pt"})
    if config is not None:
        doc = json.loads((folder / "config.json").read_text())
        config(doc)
        (folder / "config.json").write_text(json.dumps(doc))
    return folder


def refused(kind: str, folder: Path, root: Path, names: str) -> None:
    attempt(kind, folder, folder / "config.json", expect="refuse", names=names, root=root)


def _names(src: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        return sorted(f.keys())


@pytest.fixture(scope="module")
def pristine(built, tmp_path_factory) -> Callable[[str], Tensors]:
    """What the untouched folders import as (the reference of the cases that must import)."""
    from ckptkit_converters.hf.importer import import_hf
    from ckptkit_converters.hf.mapping import HFConfig

    root, out = tmp_path_factory.mktemp("pristine"), {}

    def get(kind: str) -> Tensors:
        if kind not in out:
            src = built(kind)
            import_hf(str(src), str(root / kind), HFConfig.from_file(src / "config.json"))
            out[kind] = checkpoint_tensors(root / kind)
        return out[kind]

    return get


# ---------------------------------------------------------------- tensors against the config


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_every_tensor_deleted_reshaped_and_retyped_is_refused_naming_it(tmp_path, built, kind):
    src = built(kind)
    names = _names(src)
    retype = [torch.float16, torch.bfloat16, torch.int32, torch.float64, torch.uint8]
    for i, name in enumerate(names):
        folder = variant(src, tmp_path, tensors=lambda sd: sd.pop(name))
        refused(f"{kind}: tensor deleted", folder, tmp_path, name)

        def reshape(sd: Tensors, how: int = i) -> None:
            t = sd[name]
            square = t.dim() != 2 or t.shape[0] == t.shape[1]
            transposed = torch.zeros(2 * t.shape[0], *t.shape[1:]) if square else t.t()
            sd[name] = [torch.zeros(t.shape[0] + 1, *t.shape[1:]), t.reshape(-1)[:-1], t.reshape(1, *t.shape),
                        transposed][how % 4]

        refused(f"{kind}: tensor reshaped", variant(src, tmp_path, tensors=reshape), tmp_path, name)
        dtype = retype[i % len(retype)]
        folder = variant(src, tmp_path, tensors=lambda sd: sd.__setitem__(name, sd[name].to(dtype)))
        refused(f"{kind}: tensor retyped", folder, tmp_path, name)


def test_a_weight_deleted_from_a_shard_names_the_index_and_the_file(tmp_path, built):
    src = built("llama_sharded")
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    for name, shard in sorted(index.items()):
        folder = variant(src, tmp_path, tensors=lambda sd: sd.pop(name), shard=shard)
        refused("llama sharded: tensor deleted", folder, tmp_path, name)
    from ckptkit_converters.hf.importer import import_hf
    from ckptkit_converters.hf.mapping import HFConfig

    name, shard = sorted(index.items())[3]
    folder = variant(src, tmp_path, tensors=lambda sd: sd.pop(name), shard=shard)
    with pytest.raises(Exception, match=rf"no HF tensor '{name}' \(the index lists it in {shard}, which does not hold"
                                        rf" it; .*config.json implies a floating \["):
        import_hf(str(folder), str(tmp_path / "x"), HFConfig.from_file(folder / "config.json"))


EXTRA = {
    "llama": {"model.layers.2.input_layernorm.weight": (64,), "model.layers.0.mlp.extra.weight": (4,),
              "model.layers.0.self_attn.q_proj.bias": (64,), "lm_head.bias": (128,),
              "model.layers.0.mlp.experts.0.gate_proj.weight": (96, 64),
              "model.layers.7.self_attn.q_proj.weight": (64, 64), "model.rotary.weight": (4,), "": (1,)},
    "qwen3_moe": {"model.layers.0.mlp.experts.4.up_proj.weight": (24, 64),
                  "model.layers.1.mlp.gate_proj.weight": (96, 64),
                  "model.layers.0.mlp.gate.e_score_correction_bias": (4,),
                  "model.layers.1.mlp.shared_expert.up_proj.weight": (24, 64),
                  "model.layers.2.mlp.experts.0.up_proj.weight": (24, 64)},
}


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_extra_tensors_are_refused_naming_them(tmp_path, built, kind):
    for name, shape in EXTRA[kind].items():
        folder = variant(built(kind), tmp_path, tensors=lambda sd: sd.__setitem__(name, torch.zeros(shape)))
        refused(f"{kind}: tensor added", folder, tmp_path, repr(name))


def test_a_tensor_given_twice_is_refused(tmp_path, built):
    """The same name twice in one header (the strict JSON loader), and in two shards."""
    src = built("llama")
    folder = variant(src, tmp_path)
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].decode()
    first = header.index('"model.norm.weight"')
    entry = header[first:header.index("}", first) + 1]
    body = header.replace(entry, entry + "," + entry, 1).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(len(body).to_bytes(8, "little") + body + raw[8 + n:])
    refused("tensor duplicated", folder, tmp_path, "model.safetensors")
    sharded = built("llama_sharded")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    name, shard = sorted(index.items())[0]
    other = next(f for f in sorted(set(index.values())) if f != shard)
    value = load_file(str(sharded / shard))[name]
    folder = variant(sharded, tmp_path, tensors=lambda sd: sd.__setitem__(name, value), shard=other)
    refused("tensor duplicated", folder, tmp_path, name)


# ---------------------------------------------------------------- counts and sizes of the config

COUNTS = {
    "llama": [("num_hidden_layers", 3), ("num_hidden_layers", 10**9), ("num_hidden_layers", 2**70),
              ("num_hidden_layers", 1)],
    "qwen3_moe": [("num_local_experts", 5), ("num_local_experts", 10**9), ("num_local_experts", 3),
                  ("num_hidden_layers", 10**9), ("num_hidden_layers", 1), ("decoder_sparse_step", 2),
                  ("mlp_only_layers", [0]), ("mlp_only_layers", [1, 0])],
}


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_layer_and_expert_counts_beyond_or_under_the_files_are_refused_naming_the_field(tmp_path, built, kind):
    for field, value in COUNTS[kind]:
        folder = variant(built(kind), tmp_path, config=lambda d: d.__setitem__(field, value))
        t0 = time.monotonic()
        refused(f"{kind}: config counts", folder, tmp_path, field)
        assert time.monotonic() - t0 < 10, f"{field} {value}: the counts were enumerated"


SIZES = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim"]
BAD_VALUES = [0, -1, 2.5, "4", True, [4], -(10**30), 10**400]


def test_a_config_that_cannot_describe_the_model_is_refused_naming_the_field(tmp_path, built):
    src = built("llama")
    for field in SIZES:
        for value in BAD_VALUES:
            folder = variant(src, tmp_path, config=lambda d: d.__setitem__(field, value))
            refused("config: bad size", folder, tmp_path, field)
    dividing: list[tuple[str, Callable[[dict], Any]]] = [
        ("num_key_value_heads", lambda d: d.update(num_key_value_heads=3)),
        ("num_key_value_heads", lambda d: d.update(num_key_value_heads=8)),
        ("num_attention_heads", lambda d: (d.update(hidden_size=66), d.pop("head_dim"))),
        ("num_attention_heads", lambda d: d.update(num_attention_heads=8, num_key_value_heads=4)),  # shapes then
        ("head_dim", lambda d: d.update(head_dim=8)),
        ("intermediate_size", lambda d: d.update(intermediate_size=95)),
        ("vocab_size", lambda d: d.update(vocab_size=129)),
        ("hidden_size", lambda d: d.update(hidden_size=128)),
    ]
    for field, edit in dividing:
        folder = variant(src, tmp_path, config=edit)
        refused("config: sizes that do not fit", folder, tmp_path, field)
    others: list[tuple[str, Callable[[dict], Any]]] = [
        ("gpt2", lambda d: d.update(model_type="gpt2")),
        ("tie_word_embeddings", lambda d: d.update(tie_word_embeddings="yes")),
        ("mlp_only_layers", lambda d: d.update(mlp_only_layers=[-1])),
        ("config.json", lambda d: d.update(rope_parameters={"x": json.loads("[" * 200 + "]" * 200)})),
    ]
    for field, edit in others:
        refused("config: other fields", variant(src, tmp_path, config=edit), tmp_path, field)
    for text in (b"[]", b'{"a": NaN}', b'{"a": 1, "a": 2}', b"\xff"):
        folder = variant(src, tmp_path)
        (folder / "config.json").write_bytes(text)
        refused("config: not a JSON object", folder, tmp_path, "config.json")


def test_legal_variations_import_as_the_untouched_folder(tmp_path, built, pristine):
    """What a config may leave out or say differently: the same checkpoint comes out."""
    src = built("llama")
    want = pristine("llama")
    edits: list[Callable[[dict], Any]] = [
        lambda d: None,
        lambda d: d.update(tie_word_embeddings=True),  # lm_head kept: optional where tied
        lambda d: [d.pop(k) for k in ("head_dim", "intermediate_size", "vocab_size", "dtype", "num_hidden_layers")],
        lambda d: d.update(torch_dtype="float32"),
        # every weight stored in one dtype the config does not name (repos saved in bf16 whose config says
        # float32): imported as stored, with a warning; one weight off the others stays refused (above)
        lambda d: d.update(dtype="bfloat16", torch_dtype="bfloat16"),
    ]
    for edit in edits:
        folder = variant(src, tmp_path, config=edit)
        attempt("legal variation", folder, folder / "config.json", expect="import", names="", root=tmp_path,
                reference=lambda: want)
    moe = built("qwen3_moe")
    folder = variant(moe, tmp_path, config=lambda d: [d.pop(k) for k in ("num_local_experts", "decoder_sparse_step",
                                                                         "mlp_only_layers", "moe_intermediate_size")])
    attempt("legal variation", folder, folder / "config.json", expect="import", names="", root=tmp_path,
            reference=lambda: pristine("qwen3_moe"))


def _family_models() -> dict[str, tuple[Any, str, list[tuple[str, Callable[[dict], Any]]]]]:
    """(transformers model, key table by name (None: the config's model_type), config edits each folder must be
    refused under) per table."""
    transformers = pytest.importorskip("transformers")
    base = {**{k: v for k, v in LLAMA.items() if k != "num_hidden_layers"}, "num_hidden_layers": 3}
    moe = {"moe_intermediate_size": 24, "num_experts": 4, "num_experts_per_tok": 2}
    ds = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 24,
          "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
          "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 32,
          "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_shared_experts": 2}
    return {
        "qwen3": (transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**base, head_dim=16)), None,
                  [("head_dim", lambda d: d.update(head_dim=8))]),
        "qwen3_moe_mixed": (transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **base, **moe, head_dim=16, decoder_sparse_step=2)), None,
            [("decoder_sparse_step", lambda d: d.update(decoder_sparse_step=1)),
             ("mlp_only_layers", lambda d: d.update(mlp_only_layers=[1]))]),
        "mixtral": (transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **{**base, "intermediate_size": 24}, num_local_experts=4, num_experts_per_tok=2)), None,
            [("intermediate_size", lambda d: d.update(intermediate_size=96))]),
        "deepseek_v3": (transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**ds, q_lora_rank=16)),
                        None, [("q_lora_rank", lambda d: d.update(q_lora_rank=None)),
                                       ("first_k_dense_replace", lambda d: d.update(first_k_dense_replace=2)),
                                       ("n_shared_experts", lambda d: d.update(n_shared_experts=1))]),
        "deepseek_v3_no_lora": (transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **ds, q_lora_rank=None)), None, [("q_lora_rank", lambda d: d.update(q_lora_rank=16)),
                                                     ("qk_rope_head_dim", lambda d: d.update(qk_rope_head_dim=16))]),
        "qwen2_moe (Megatron names)": (transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **base, **moe, shared_expert_intermediate_size=40)), "megatron_qwen2_moe",
            [("shared_expert_intermediate_size", lambda d: d.update(shared_expert_intermediate_size=24)),
             ("attention_bias", lambda d: d.update(qkv_bias=False, attention_bias=False))]),
    }


def test_every_table_imports_what_transformers_saves_and_refuses_it_damaged(tmp_path):
    """Each key table against the folder transformers itself writes for it (dense, MoE with dense layers,
    Mixtral, DeepSeek-V3 with and without a low-rank query, Qwen2-MoE through the Megatron table): it
    imports as the package reads it; a weight deleted, or a config field changed, is refused."""
    for name, (model, family, edits) in _family_models().items():
        src = tmp_path / name.split()[0]
        model.save_pretrained(str(src))
        attempt(f"{name}: as saved", src, src / "config.json", expect="import", names="", root=tmp_path,
                family=family, reference=lambda: reference_import(src, src / "config.json", tmp_path, family))
        last = _names(src)[-1]
        folder = variant(src, tmp_path, tensors=lambda sd: sd.pop(last))
        attempt(f"{name}: tensor deleted", folder, folder / "config.json", expect="refuse", names=last,
                root=tmp_path, family=family)
        for field, edit in edits:
            folder = variant(src, tmp_path, config=edit)
            attempt(f"{name}: config edited", folder, folder / "config.json", expect="refuse", names=field,
                    root=tmp_path, family=family)


def test_hf_trust_config_counts():
    """Runs last in this module: the tally of every HF importer case so far in this session."""
    print("\n" + report("HF importer cases so far"))
