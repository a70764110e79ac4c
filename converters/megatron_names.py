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

LAYER_PREFIX = "decoder.layers."
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
VOCAB_TENSORS = (EMBEDDING, OUTPUT)

# per-layer tensors (name after "decoder.layers."): (tp axis in the *layer* tensor, i.e. without the layer axis)
_LAYER_TP: dict[str, int | None] = {
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "self_attention.linear_proj.bias": None,
    "mlp.linear_fc1.weight": 0,
    "mlp.linear_fc1.bias": 0,
    "mlp.linear_fc2.weight": 1,
    "mlp.linear_fc2.bias": None,
    "self_attention.linear_qkv.layer_norm_weight": None,
    "self_attention.linear_qkv.layer_norm_bias": None,
    "mlp.linear_fc1.layer_norm_weight": None,
    "mlp.linear_fc1.layer_norm_bias": None,
    "self_attention.q_layernorm.weight": None,
    "self_attention.q_layernorm.bias": None,
    "self_attention.k_layernorm.weight": None,
    "self_attention.k_layernorm.bias": None,
}
_FC1 = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")

# module-state-dict names of the local spec -> the sharded (TE-style) names
_LEGACY_RENAME = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
_LEGACY_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def padded_vocab(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: ``ceil(V / (divisible_by * tp)) * divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def layer_tp_axis(name: str) -> int | None:
    """TP split axis of a per-layer tensor (``name`` after ``decoder.layers.``), without the layer axis."""
    if name not in _LAYER_TP:
        raise LayoutError(f"unknown Megatron per-layer tensor 'decoder.layers.{name}' (not in converters/megatron_names.py)")
    return _LAYER_TP[name]


def is_fused_glu(key: str) -> bool:
    return key.startswith(LAYER_PREFIX) and key[len(LAYER_PREFIX):] in _FC1


def rule_for(key: str, *, divisible_by: int, ffn: int | None = None) -> PartitionRule:
    """The partition rule of Megatron GPT tensor ``key`` (a sharded key, no ``model/``).

    ``ffn``: the FFN hidden size when ``linear_fc1`` is gated (SwiGLU: ``[gate; up]``,
    each part split over TP on its own); None for a plain MLP. Unknown keys raise
    :class:`LayoutError` naming them: guessing a split would load wrong weights.
    """
    if key == EMBEDDING:
        return PartitionRule(tp_axis=0, vocab_multiple=divisible_by, stage=0)
    if key == OUTPUT:
        return PartitionRule(tp_axis=0, vocab_multiple=divisible_by, stage=-1)
    if key == "embedding.position_embeddings.weight":
        return PartitionRule(stage=0)
    if key in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias"):
        return PartitionRule(stage=-1)
    if key.startswith(LAYER_PREFIX):
        name = key[len(LAYER_PREFIX):]
        axis = layer_tp_axis(name)
        if axis is None:
            return PartitionRule(layer_axis=0)
        if name in _FC1 and ffn is not None:
            return PartitionRule(tp_axis=axis + 1, layer_axis=0, fused=(ffn, ffn))
        return PartitionRule(tp_axis=axis + 1, layer_axis=0)
    raise LayoutError(f"unknown Megatron tensor {key!r}: no partition rule in converters/megatron_names.py")


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
