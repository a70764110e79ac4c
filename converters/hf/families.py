"""Hugging Face key tables: which checkpoint tensor becomes which HF tensor, per model family.

A table is data, not code, so a reviewer can check it against the HF modeling file line by
line and a new family is a new table. Each :class:`Rule` names one checkpoint tensor (a
pattern: ``{l}`` is the layer number) and the HF tensor(s) it becomes (:class:`Out`; ``{l}``
the layer, ``{e}`` the routed expert). What a rule says about the tensor's axes drives the
slicing in :mod:`ckptkit_converters.hf.exporter`:

* ``layer_axis``: axis 0 is the layer (Megatron stacks ``decoder.layers.*`` along it);
* ``expert_axis``: the next axis is the routed expert (docs/moe.md: experts are stacked; HF
  keeps one tensor per expert, ``...experts.{e}.gate_proj.weight``);
* an :class:`Out` with ``take``: the tensor is fused, and this output is one part of it
  (Megatron's ``linear_qkv`` per query group; SwiGLU ``linear_fc1`` ``[gate; up]``);
* ``rope``: the rows are a rotary projection stored with interleaved pairs (torchtitan's
  ``ComplexRoPE``, Meta's reference layout), permuted to HF's rotate-half layout;
* ``vocab``: rows are the vocabulary; ``"trim"`` drops Megatron's padding rows past the HF
  ``vocab_size``, ``"check"`` only checks the count;
* ``tied``: the output projection, not written when the HF config ties it to the embedding.

Sources of two namings have tables: torchtitan's module names (``layers.3.attention.wq``,
facts taken from torchtitan 0.3.0's own ``state_dict_adapter.py`` files) and Megatron-core
GPT's sharded keys (``decoder.layers.self_attention.linear_qkv.weight``, megatron-core 0.16.1;
see :mod:`ckptkit_converters.megatron.names`). A family is picked by the HF ``config.json``'s
``model_type`` and the naming the checkpoint's keys show (:func:`family_for`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from ckptkit.errors import CkptkitError
from ckptkit_converters.megatron import names as megatron_names

TORCHTITAN = "torchtitan"
MEGATRON = "megatron"


@dataclass(frozen=True)
class Out:
    """One HF tensor a rule writes. ``take``: the part of a fused tensor (``"q"``, ``"k"``, ``"v"``
    of Megatron's per-group QKV; ``"gate"``, ``"up"`` of a SwiGLU fc1). ``rope``: ``"n_heads"`` or
    ``"n_kv_heads"`` when the rows are an interleaved rotary projection of that many heads."""

    hf: str
    take: str | None = None
    rope: str | None = None


@dataclass(frozen=True)
class Rule:
    """One checkpoint tensor (``ours``, without the state prefix) and the HF tensors it becomes."""

    ours: str
    outs: tuple[Out, ...]
    layer_axis: bool = False
    expert_axis: bool = False
    vocab: str | None = None  # "trim" | "check"
    tied: bool = False

    @property
    def per_layer(self) -> bool:
        return "{l}" in self.ours


@dataclass(frozen=True)
class Family:
    """A key table. ``drop``: checkpoint tensors known and deliberately not exported (with why in
    the table's comment); ``experts_field``: the config field with the routed expert count."""

    name: str
    model_type: str
    naming: str
    rules: tuple[Rule, ...]
    drop: tuple[str, ...] = ()
    experts_field: str | None = None
    tie_default: bool = False


def _r(ours: str, hf: str, **kw: object) -> Rule:
    rope = kw.pop("rope", None)
    return Rule(ours, (Out(hf, rope=rope),), **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------- torchtitan names

_TT_L = "layers.{l}."
_HF_L = "model.layers.{l}."

_TT_EDGE = (
    _r("tok_embeddings.weight", "model.embed_tokens.weight", vocab="check"),
    _r("norm.weight", "model.norm.weight"),
    _r("lm_head.weight", "lm_head.weight", vocab="check", tied=True),
)
_TT_NORMS = (
    _r(_TT_L + "attention_norm.weight", _HF_L + "input_layernorm.weight"),
    _r(_TT_L + "ffn_norm.weight", _HF_L + "post_attention_layernorm.weight"),
)
_TT_DENSE_FFN = (
    _r(_TT_L + "feed_forward.w1.weight", _HF_L + "mlp.gate_proj.weight"),
    _r(_TT_L + "feed_forward.w3.weight", _HF_L + "mlp.up_proj.weight"),
    _r(_TT_L + "feed_forward.w2.weight", _HF_L + "mlp.down_proj.weight"),
)


def _tt_gqa(rope: bool) -> tuple[Rule, ...]:
    qkv = _TT_L + "attention.qkv_linear."
    return (
        _r(qkv + "wq.weight", _HF_L + "self_attn.q_proj.weight", rope="n_heads" if rope else None),
        _r(qkv + "wk.weight", _HF_L + "self_attn.k_proj.weight", rope="n_kv_heads" if rope else None),
        _r(qkv + "wv.weight", _HF_L + "self_attn.v_proj.weight"),
        _r(_TT_L + "attention.wo.weight", _HF_L + "self_attn.o_proj.weight"),
    )


def _tt_experts(hf_expert: str, names: tuple[str, str, str], gate: str) -> tuple[Rule, ...]:
    """torchtitan GroupedExperts ``w1_EFD``/``w3_EFD`` ``[E, F, D]``, ``w2_EDF`` ``[E, D, F]``; the router."""
    inner = _TT_L + "moe.routed_experts.inner_experts."
    w1, w3, w2 = names
    return (
        Rule(inner + "w1_EFD", (Out(_HF_L + hf_expert + w1 + ".weight"),), expert_axis=True),
        Rule(inner + "w3_EFD", (Out(_HF_L + hf_expert + w3 + ".weight"),), expert_axis=True),
        Rule(inner + "w2_EDF", (Out(_HF_L + hf_expert + w2 + ".weight"),), expert_axis=True),
        _r(_TT_L + "moe.router.gate.weight", _HF_L + gate),
    )


LLAMA = Family("llama", "llama", TORCHTITAN, (
    *_TT_EDGE[:2], *_tt_gqa(rope=True), *_TT_DENSE_FFN, *_TT_NORMS, _TT_EDGE[2],
    _r("output.weight", "lm_head.weight", vocab="check", tied=True),  # torchtitan before 0.3
))
# Qwen3's RoPE (CosSinRoPE) already rotates halves, as HF does: no permutation; q/k RMSNorms per head.
_QWEN3_ATTN = (*_tt_gqa(rope=False),
               _r(_TT_L + "attention.q_norm.weight", _HF_L + "self_attn.q_norm.weight"),
               _r(_TT_L + "attention.k_norm.weight", _HF_L + "self_attn.k_norm.weight"))
QWEN3 = Family("qwen3", "qwen3", TORCHTITAN, (*_TT_EDGE, *_QWEN3_ATTN, *_TT_DENSE_FFN, *_TT_NORMS))
# HF Qwen3-MoE has no aux-loss-free balancing bias: torchtitan's adapter drops expert_bias_E too.
QWEN3_MOE = Family("qwen3_moe", "qwen3_moe", TORCHTITAN, (
    *_TT_EDGE, *_QWEN3_ATTN, *_TT_DENSE_FFN, *_TT_NORMS,
    *_tt_experts("mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj"), "mlp.gate.weight"),
), drop=(_TT_L + "moe.expert_bias_E",), experts_field="num_experts")
# Mixtral: Llama attention (the rotary permutation, for a torchtitan model with interleaved RoPE),
# block_sparse_moe naming; HF Mixtral has no expert bias (dropped).
MIXTRAL = Family("mixtral", "mixtral", TORCHTITAN, (
    *_TT_EDGE, *_tt_gqa(rope=True), *_TT_NORMS,
    *_tt_experts("block_sparse_moe.experts.{e}.", ("w1", "w3", "w2"), "block_sparse_moe.gate.weight"),
), drop=(_TT_L + "moe.expert_bias_E",), experts_field="num_local_experts")
# DeepSeek-V3: multi-head latent attention, dense first layers (feed_forward), shared experts, and the
# aux-loss-free bias as HF's e_score_correction_bias. torchtitan's adapter applies no rotary permutation
# (HF's DeepseekV3 config defaults to rope_interleave=true); neither does this table.
_A = _TT_L + "attention."
_SA = _HF_L + "self_attn."
DEEPSEEK_V3 = Family("deepseek_v3", "deepseek_v3", TORCHTITAN, (
    *_TT_EDGE,
    _r(_A + "wq.weight", _SA + "q_proj.weight"),  # q_lora_rank 0
    _r(_A + "wq_a.weight", _SA + "q_a_proj.weight"),
    _r(_A + "q_norm.weight", _SA + "q_a_layernorm.weight"),
    _r(_A + "wq_b.weight", _SA + "q_b_proj.weight"),
    _r(_A + "wkv_a.weight", _SA + "kv_a_proj_with_mqa.weight"),
    _r(_A + "kv_norm.weight", _SA + "kv_a_layernorm.weight"),
    _r(_A + "wkv_b.weight", _SA + "kv_b_proj.weight"),
    _r(_A + "wo.weight", _SA + "o_proj.weight"),
    *_TT_DENSE_FFN, *_TT_NORMS,
    *_tt_experts("mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj"), "mlp.gate.weight"),
    _r(_TT_L + "moe.expert_bias_E", _HF_L + "mlp.gate.e_score_correction_bias"),
    _r(_TT_L + "moe.shared_experts.w1.weight", _HF_L + "mlp.shared_experts.gate_proj.weight"),
    _r(_TT_L + "moe.shared_experts.w3.weight", _HF_L + "mlp.shared_experts.up_proj.weight"),
    _r(_TT_L + "moe.shared_experts.w2.weight", _HF_L + "mlp.shared_experts.down_proj.weight"),
), experts_field="n_routed_experts")


# ---------------------------------------------------------------- Megatron-core GPT names
# Megatron's names are spelled once, in ckptkit_converters.megatron.names (its partition rules use
# them too); this table only says which HF tensor each becomes.


def _m(name: str, *outs: Out, experts: bool = False) -> Rule:
    return Rule(megatron_names.LAYER_PREFIX + name, outs, layer_axis=True, expert_axis=experts)


def _megatron_base(qk_norm: bool) -> list[Rule]:
    """The dense GPT block every Megatron family has: embeddings, GQA attention (fused QKV), the layer
    norms (under the TE names both specs store), a SwiGLU MLP; q/k layernorms for Qwen3."""
    sa = _HF_L + "self_attn."
    rules: list[Rule] = [
        Rule(megatron_names.EMBEDDING, (Out("model.embed_tokens.weight"),), vocab="trim"),
        Rule(megatron_names.OUTPUT, (Out("lm_head.weight"),), vocab="trim", tied=True),
        Rule(f"{megatron_names.FINAL_NORM}.weight", (Out("model.norm.weight"),)),
        _m(f"{megatron_names.LINEAR_QKV}.weight", Out(sa + "q_proj.weight", "q"), Out(sa + "k_proj.weight", "k"),
           Out(sa + "v_proj.weight", "v")),
        _m(f"{megatron_names.LINEAR_QKV}.bias", Out(sa + "q_proj.bias", "q"), Out(sa + "k_proj.bias", "k"),
           Out(sa + "v_proj.bias", "v")),
        _m(f"{megatron_names.LINEAR_PROJ}.weight", Out(sa + "o_proj.weight")),
        _m(f"{megatron_names.INPUT_NORM}weight", Out(_HF_L + "input_layernorm.weight")),
        _m(f"{megatron_names.PRE_MLP_NORM}weight", Out(_HF_L + "post_attention_layernorm.weight")),
        _m(f"{megatron_names.LOCAL_PRE_MLP_NORM}weight", Out(_HF_L + "post_attention_layernorm.weight")),
        _m(f"{megatron_names.LINEAR_FC1}.weight", Out(_HF_L + "mlp.gate_proj.weight", "gate"),
           Out(_HF_L + "mlp.up_proj.weight", "up")),
        _m(f"{megatron_names.LINEAR_FC2}.weight", Out(_HF_L + "mlp.down_proj.weight")),
    ]
    if qk_norm:
        rules += [_m(f"{megatron_names.Q_LAYERNORM}.weight", Out(sa + "q_norm.weight")),
                  _m(f"{megatron_names.K_LAYERNORM}.weight", Out(sa + "k_norm.weight"))]
    return rules


def _megatron_routed(moe: str) -> list[Rule]:
    """The router and routed experts, named as the HF family names them (Mixtral: ``block_sparse_moe``,
    ``w1``/``w3``/``w2``; the others: ``mlp``, ``gate_proj``/``up_proj``/``down_proj``)."""
    mixtral = moe.startswith("block_sparse_moe")
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    router = "block_sparse_moe.gate.weight" if mixtral else "mlp.gate.weight"
    e = _HF_L + moe
    return [
        _m(f"{megatron_names.ROUTER}.weight", Out(_HF_L + router)),
        _m(f"{megatron_names.EXPERT_FC1}.weight", Out(e + gate + ".weight", "gate"), Out(e + up + ".weight", "up"),
           experts=True),
        _m(f"{megatron_names.EXPERT_FC2}.weight", Out(e + down + ".weight"), experts=True),
    ]


def _megatron_shared() -> list[Rule]:
    """Qwen2-MoE's ``shared_expert`` and its sigmoid gate."""
    s = _HF_L + "mlp.shared_expert."
    return [
        _m(f"{megatron_names.SHARED_FC1}.weight", Out(s + "gate_proj.weight", "gate"), Out(s + "up_proj.weight", "up")),
        _m(f"{megatron_names.SHARED_FC2}.weight", Out(s + "down_proj.weight")),
        _m(megatron_names.SHARED_GATE, Out(_HF_L + "mlp.shared_expert_gate.weight")),
    ]


def _megatron(model_type: str, *, qk_norm: bool, moe: str | None, shared: bool = False,
              experts_field: str | None = None) -> Family:
    """Megatron GPT (Llama/Qwen-style: RMSNorm, SwiGLU, GQA fused QKV, rotate-half RoPE) to ``model_type``.

    ``moe``: the HF prefix of the routed experts (``"mlp.experts.{e}."``) and their names follow the
    family; ``shared``: Qwen2-MoE's ``shared_expert`` and its sigmoid gate. Megatron's local and TE
    specs both store the layer norms under TE names (``linear_qkv.layer_norm_weight``,
    ``linear_fc1.layer_norm_weight``); an MoE layer's pre-MLP norm is ``pre_mlp_layernorm``.
    """
    rules = _megatron_base(qk_norm)
    # the live Megatron adapter keeps a saving layout's vocabulary padding rows in side tensors: not weights
    drop: tuple[str, ...] = tuple(key + megatron_names.VOCAB_PADDING_SUFFIX for key in megatron_names.VOCAB_TENSORS)
    if moe is not None:
        rules += _megatron_routed(moe)
        # these HF families have no aux-loss-free balancing bias
        drop += (f"{megatron_names.LAYER_PREFIX}{megatron_names.ROUTER}.expert_bias",)
    if shared:
        rules += _megatron_shared()
    return Family("megatron_" + model_type, model_type, MEGATRON, tuple(rules), drop=drop, experts_field=experts_field)


MEGATRON_LLAMA = _megatron("llama", qk_norm=False, moe=None)
MEGATRON_QWEN3 = _megatron("qwen3", qk_norm=True, moe=None)
MEGATRON_QWEN3_MOE = _megatron("qwen3_moe", qk_norm=True, moe="mlp.experts.{e}.", experts_field="num_experts")
MEGATRON_QWEN2_MOE = _megatron("qwen2_moe", qk_norm=False, moe="mlp.experts.{e}.", shared=True,
                               experts_field="num_experts")
MEGATRON_MIXTRAL = _megatron("mixtral", qk_norm=False, moe="block_sparse_moe.experts.{e}.",
                             experts_field="num_local_experts")

_TABLES: dict[str, Family] = {f.name: f for f in (
    LLAMA, QWEN3, QWEN3_MOE, MIXTRAL, DEEPSEEK_V3,
    MEGATRON_LLAMA, MEGATRON_QWEN3, MEGATRON_QWEN3_MOE, MEGATRON_QWEN2_MOE, MEGATRON_MIXTRAL)}

RENAMED_FAMILIES: dict[str, str] = {"llama3": "llama"}
"""Table names retired in this release -> the name now. Tables are named by the HF ``model_type``
they serve (torchtitan's) or ``megatron_<model_type>``; ``llama3`` was torchtitan's model name, not
HF's, so ``--hf-family llama3`` beside ``model_type: llama`` read as two different models. The old
name still finds its table for one release, with a DeprecationWarning naming the new one."""


def _current_name(name: str, stacklevel: int) -> str:
    """``name``, or the name a retired one has now (warning the caller that named it)."""
    new = RENAMED_FAMILIES.get(name)
    if new is None:
        return name
    warnings.warn(f"the key table {name!r} is now named {new!r} (the HF model_type it serves); {name!r} is "
                  "removed in the next release", DeprecationWarning, stacklevel=stacklevel + 1)
    return new


class FamilyTables(Mapping[str, Family]):
    """Every key table by its name, read-only. A retired name (:data:`RENAMED_FAMILIES`) is in it and
    looks its table up (warning), but is not listed: iteration, ``len`` and error messages give the
    names of today, while the CLI's and options' ``name in FAMILIES`` checks still accept the old one."""

    def __init__(self, tables: Mapping[str, Family]) -> None:
        self._tables = dict(tables)

    def __getitem__(self, name: str) -> Family:
        return self._tables[_current_name(name, stacklevel=2)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._tables or name in RENAMED_FAMILIES)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tables)

    def __len__(self) -> int:
        return len(self._tables)

    def __repr__(self) -> str:
        return f"FamilyTables({list(self._tables)})"


FAMILIES: Mapping[str, Family] = FamilyTables(_TABLES)
"""Every key table by name: torchtitan's by the HF ``model_type`` (``llama``, ``qwen3``, ...), Megatron's
``megatron_<model_type>``. Look one up with :func:`family_named`."""


def family_named(name: str) -> Family:
    """The key table called ``name`` (a retired name finds its table, with a DeprecationWarning naming
    the new one); an unknown name is refused, listing the tables there are."""
    current = _current_name(name, stacklevel=2)
    if current not in _TABLES:
        raise CkptkitError(f"unknown model family {name!r} (known: {', '.join(_TABLES)})")
    return _TABLES[current]


def __getattr__(name: str) -> Family:
    """``LLAMA3``, the table's constant before it was named by its ``model_type``: one more release."""
    if name == "LLAMA3":
        warnings.warn("ckptkit_converters.hf.families.LLAMA3 is now LLAMA (the table is named by the HF "
                      "model_type it serves); LLAMA3 is removed in the next release", DeprecationWarning,
                      stacklevel=2)
        return LLAMA
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def family_for(model_type: str | None, naming: str) -> Family:
    """The table for an HF ``model_type`` and a checkpoint naming (``torchtitan`` / ``megatron``).

    No ``model_type`` (head counts given directly): Llama. Refuses pairs without a table, naming
    the ones that exist.
    """
    mt = model_type or "llama"
    for f in FAMILIES.values():
        if f.model_type == mt and f.naming == naming:
            return f
    known = sorted(f.model_type for f in FAMILIES.values() if f.naming == naming)
    raise CkptkitError(f"no Hugging Face key table for model_type {mt!r} from a {naming}-named checkpoint "
                       f"(tables for {naming} names: {', '.join(known)})")


def naming_of(names: list[str]) -> str:
    """``megatron`` when the names are Megatron GPT's (``decoder.``, ``embedding.``, ``output_layer.``), else
    ``torchtitan``."""
    megatron = sum(n.startswith(megatron_names.TOP_LEVEL_PREFIXES) for n in names)
    return MEGATRON if megatron * 2 > len(names) else TORCHTITAN
