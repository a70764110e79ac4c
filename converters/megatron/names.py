"""Megatron GPT tensor names and their partition rules: the one name table converters use.

Keys are Megatron's *sharded* keys (``model.sharded_state_dict()``), which are
the model-space names ckptkit stores under ``model/``: per-layer tensors are
stacked along a prepended layer axis (``decoder.layers.self_attention.linear_qkv.weight``
is ``(L, qkv, h)``), and layer norms carry Transformer Engine names even with
the local (non-TE) spec, which maps ``input_layernorm.`` to
``self_attention.linear_qkv.layer_norm_`` and ``pre_mlp_layernorm.`` to
``mlp.linear_fc1.layer_norm_`` in ``sharded_state_dict_keys_map``.

The live Megatron adapter derives rules from parameter attributes
(``tensor_model_parallel``, ``partition_dim``); converters have no live model,
so they use :func:`rule_for`. Both must agree (an integrator's test).

Legacy checkpoints store the *module* ``state_dict`` instead: local layer
numbers (``decoder.layers.<i>.``, counted within a pipeline stage / virtual
chunk), TP-local tensors, and module-level norm names: :func:`legacy_key`
maps those to the sharded key.
"""

from __future__ import annotations

import re

from ckptkit.errors import LayoutError
from ckptkit.layout.rules import PartitionRule
from ckptkit_converters.common.renamed import divisible_by_renamed

# ---------------------------------------------------------------- the names
# Every Megatron tensor name ckptkit's converters know is spelled here once; the partition rules
# below and the Hugging Face key tables (converters/hf/families.py) are built from these.

EMBEDDING = "embedding.word_embeddings.weight"
POSITION_EMBEDDING = "embedding.position_embeddings.weight"
OUTPUT = "output_layer.weight"
VOCAB_TENSORS = (EMBEDDING, OUTPUT)
FINAL_NORM = "decoder.final_layernorm"
TOP_LEVEL_PREFIXES = ("decoder.", "embedding.", "output_layer.")
"""What every Megatron GPT model key starts with (how a checkpoint's naming is recognised)."""
LAYER_PREFIX = "decoder.layers."
VOCAB_PADDING_SUFFIX = ".vocab_padding"
"""``<vocab tensor>.vocab_padding``: the saving layout's padding rows the live adapter keeps beside the
true vocabulary (its ``PADDING_SUFFIX``; not a weight). Spelled here too because the adapter's module
imports torch, and the key tables must not."""

# Per-layer modules, named after LAYER_PREFIX; their tensors are "<module>.weight" / "<module>.bias".
LINEAR_QKV = "self_attention.linear_qkv"
LINEAR_PROJ = "self_attention.linear_proj"
Q_LAYERNORM = "self_attention.q_layernorm"
K_LAYERNORM = "self_attention.k_layernorm"
LINEAR_FC1 = "mlp.linear_fc1"
LINEAR_FC2 = "mlp.linear_fc2"
ROUTER = "mlp.router"
SHARED_FC1 = "mlp.shared_experts.linear_fc1"
SHARED_FC2 = "mlp.shared_experts.linear_fc2"
SHARED_GATE = "mlp.shared_experts.gate_weight"
"""A tensor, not a module: the sigmoid gate of a shared expert (Qwen2-MoE)."""
BUFFERS = (f"{ROUTER}.expert_bias",)
"""Name endings of tensors Megatron saves that are buffers, not parameters: no optimizer holds state for them
(the router's aux-loss-free balancing bias is updated outside the optimizer)."""
EXPERT_FC1 = "mlp.experts.experts.linear_fc1"
EXPERT_FC2 = "mlp.experts.experts.linear_fc2"
LINEAR_MODULES = (LINEAR_QKV, LINEAR_PROJ, LINEAR_FC1, LINEAR_FC2, SHARED_FC1, SHARED_FC2)
"""Linear modules that declare an ``_extra_state`` per layer (Transformer Engine's FP8 state)."""
EXPERT_LINEAR_MODULES = (EXPERT_FC1, EXPERT_FC2)
"""Routed experts' linear modules: an ``_extra_state`` per layer and global expert."""

# Layer norms. The sharded keys carry Transformer Engine's fused names even with the local spec:
# the input norm lives in linear_qkv, the pre-MLP norm in linear_fc1. The local spec's own module
# names appear in legacy checkpoints, and an MoE layer (no fused fc1) keeps "pre_mlp_layernorm".
INPUT_NORM = f"{LINEAR_QKV}.layer_norm_"
PRE_MLP_NORM = f"{LINEAR_FC1}.layer_norm_"
LOCAL_INPUT_NORM = "input_layernorm."
LOCAL_PRE_MLP_NORM = "pre_mlp_layernorm."

# ---------------------------------------------------------------- their partition rules

# per-layer tensors (name after LAYER_PREFIX): the tp axis in the *layer* tensor, i.e. without the layer axis
_LAYER_TP: dict[str, int | None] = {
    f"{LINEAR_QKV}.weight": 0,
    f"{LINEAR_QKV}.bias": 0,
    f"{LINEAR_PROJ}.weight": 1,
    f"{LINEAR_PROJ}.bias": None,
    f"{LINEAR_FC1}.weight": 0,
    f"{LINEAR_FC1}.bias": 0,
    f"{LINEAR_FC2}.weight": 1,
    f"{LINEAR_FC2}.bias": None,
    f"{INPUT_NORM}weight": None,
    f"{INPUT_NORM}bias": None,
    f"{PRE_MLP_NORM}weight": None,
    f"{PRE_MLP_NORM}bias": None,
    f"{Q_LAYERNORM}.weight": None,
    f"{Q_LAYERNORM}.bias": None,
    f"{K_LAYERNORM}.weight": None,
    f"{K_LAYERNORM}.bias": None,
    # MoE: the router (its expert_bias buffer for aux-loss-free balancing) and shared experts are
    # ordinary per-layer tensors; a shared expert is a SwiGLU MLP of its own size
    f"{ROUTER}.weight": None,
    f"{ROUTER}.bias": None,
    f"{ROUTER}.expert_bias": None,
    f"{SHARED_FC1}.weight": 0,
    f"{SHARED_FC1}.bias": 0,
    f"{SHARED_FC2}.weight": 1,
    f"{SHARED_FC2}.bias": None,
    SHARED_GATE: None,
}
# Routed experts (SequentialMLP), stacked [layers, experts, ...]: TP axis within one expert's tensor,
# split over the expert TP degree; the expert axis (1) splits over EP (docs/moe.md).
_EXPERT_TP: dict[str, int | None] = {
    f"{EXPERT_FC1}.weight": 0,
    f"{EXPERT_FC1}.bias": 0,
    f"{EXPERT_FC2}.weight": 1,
    f"{EXPERT_FC2}.bias": None,
}
_FC1 = tuple(f"{module}.{param}" for module in (LINEAR_FC1, SHARED_FC1, EXPERT_FC1) for param in ("weight", "bias"))
# the fc2 whose input size is a gated fc1's FFN size, by the fc1 tensor's last two name parts
_FC2_OF = {"linear_fc1.weight": "linear_fc2.weight", "linear_fc1.bias": "linear_fc2.weight"}

# module-state-dict names of the local spec -> the sharded (TE-style) names
_LEGACY_RENAME = {
    LOCAL_INPUT_NORM: INPUT_NORM,
    LOCAL_PRE_MLP_NORM: PRE_MLP_NORM,
}
_LEGACY_LAYER = re.compile(rf"^{re.escape(LAYER_PREFIX)}([0-9]+)\.(.+)$")
_PER_LAYER = _LEGACY_LAYER  # the same shape: Megatron's sharded per-layer keys carry the *global* layer


@divisible_by_renamed
def padded_vocab(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary, ``ceil(V / (make_vocab_size_divisible_by * tp)) *
    make_vocab_size_divisible_by * tp``: what its embedding and output layer hold at ``tp``.
    (``divisible_by=``: the old keyword, one more release, with a DeprecationWarning.)"""
    multiple = make_vocab_size_divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def layer_tp_axis(name: str) -> int | None:
    """TP split axis of a per-layer tensor (``name`` after ``decoder.layers.``), without the layer axis
    (and, for a routed expert's tensor, without the expert axis)."""
    if name in _EXPERT_TP:
        return _EXPERT_TP[name]
    if name not in _LAYER_TP:
        raise LayoutError(f"unknown Megatron per-layer tensor '{LAYER_PREFIX}{name}' "
                          "(not in converters/megatron/names.py)")
    return _LAYER_TP[name]


def _layer_name(key: str) -> str | None:
    """``mlp.linear_fc1.weight`` of a stacked or a per-layer key, else None."""
    m = _PER_LAYER.match(key)
    if m is not None:
        return m.group(2)
    return key[len(LAYER_PREFIX):] if key.startswith(LAYER_PREFIX) else None


def layer_of(key: str, offsets: tuple[int, ...]) -> int | None:
    """The global layer a model-space chunk at ``offsets`` of ``key`` belongs to: a per-layer key's number, a
    stacked key's first offset (its layer axis); None for the tensors outside the layers."""
    m = _PER_LAYER.match(key)
    if m is not None:
        return int(m.group(1))
    return offsets[0] if key.startswith(LAYER_PREFIX) and offsets else None


def is_fused_glu(key: str) -> bool:
    """A SwiGLU ``linear_fc1`` (dense, shared or routed expert): ``[gate; up]`` stacked, each part split
    over TP on its own, so it cannot be cut as one block."""
    return _layer_name(key) in _FC1


def is_expert(key: str) -> bool:
    """A routed expert's tensor (stacked ``[layers, experts, ...]`` or per-layer ``[experts, ...]``)."""
    return _layer_name(key) in _EXPERT_TP


def gated_ffn(key: str, shapes: dict[str, tuple[int, ...]]) -> int | None:
    """The FFN size of a gated ``linear_fc1`` (``[gate; up]``: twice its ``linear_fc2``'s input), read
    off the stored shapes; None for any other tensor or an ungated MLP. Dense MLPs, shared experts
    and routed experts each have their own size."""
    if not is_fused_glu(key):
        return None
    for fc1, fc2 in _FC2_OF.items():
        if key.endswith(fc1):
            other = key[: -len(fc1)] + fc2
            fc1_key = key[: -len(fc1)] + "linear_fc1.weight"
            if other not in shapes or fc1_key not in shapes:
                return None
            axis = (1 if is_expert(key) else 0) + (0 if _PER_LAYER.match(key) else 1)
            rows, ffn = shapes[fc1_key][axis], shapes[other][-1]
            return ffn if rows == 2 * ffn else None
    return None


def rule_for(key: str, *, divisible_by: int, ffn: int | None = None) -> PartitionRule:
    """The partition rule of Megatron GPT tensor ``key`` (a sharded key, no ``model/``).

    ``ffn``: the FFN hidden size when this ``linear_fc1`` is gated (SwiGLU: ``[gate; up]``,
    each part split over TP on its own; :func:`gated_ffn` reads it off the shapes); None
    for a plain MLP. Unknown keys raise
    :class:`LayoutError` naming them: guessing a split would load wrong weights.
    """
    if key == EMBEDDING:
        return PartitionRule(tp_axis=0, vocab_multiple=divisible_by, stage=0)
    if key == OUTPUT:
        return PartitionRule(tp_axis=0, vocab_multiple=divisible_by, stage=-1)
    if key == POSITION_EMBEDDING:
        return PartitionRule(stage=0)
    if key in (f"{FINAL_NORM}.weight", f"{FINAL_NORM}.bias"):
        return PartitionRule(stage=-1)
    per_layer = _PER_LAYER.match(key)
    if per_layer is not None:  # an MoE layer pattern: per-layer keys, routed experts [experts, ...]
        layer, name = int(per_layer.group(1)), per_layer.group(2)
        axis = layer_tp_axis(name)
        experts = {"expert_axis": 0} if name in _EXPERT_TP else {}
        prepend = len(experts)
        fused = (ffn, ffn) if name in _FC1 and ffn is not None and axis is not None else None
        return PartitionRule(tp_axis=None if axis is None else axis + prepend, layer=layer, fused=fused, **experts)
    if key.startswith(LAYER_PREFIX):
        name = key[len(LAYER_PREFIX):]
        axis = layer_tp_axis(name)
        experts = {"expert_axis": 1} if name in _EXPERT_TP else {}
        prepend = 1 + len(experts)
        if axis is None:
            return PartitionRule(layer_axis=0, **experts)
        if name in _FC1 and ffn is not None:
            return PartitionRule(tp_axis=axis + prepend, layer_axis=0, fused=(ffn, ffn), **experts)
        return PartitionRule(tp_axis=axis + prepend, layer_axis=0, **experts)
    raise LayoutError(f"unknown Megatron tensor {key!r}: no partition rule in converters/megatron/names.py")


def legacy_key(name: str) -> tuple[str, int | None] | None:
    """A legacy module-state-dict name -> (sharded key, local layer number or None).

    None for entries that are not model tensors (``_extra_state``).
    """
    if name.endswith("_extra_state"):
        return None
    m = _LEGACY_LAYER.match(name)
    if m is None:
        return name, None
    rest = m.group(2)
    for old, new in _LEGACY_RENAME.items():
        if rest.startswith(old):
            rest = new + rest[len(old):]
    return LAYER_PREFIX + rest, int(m.group(1))
