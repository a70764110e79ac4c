"""The facts an HF conversion needs and the tensor transforms, shared by export and import.

* :class:`HFConfig`: what a Hugging Face ``config.json`` says that the tensors do not (head
  counts for the rotary permutation and Megatron's fused QKV, the true vocabulary size, the
  expert and layer counts to check completeness against, whether embeddings are tied, the sizes
  an import checks every tensor's shape against). Each field is checked as it is read (the JSON
  type, sizes positive, head counts that divide); a field is asked for only where a conversion
  needs it (:meth:`HFConfig.need`), and a missing one is an error naming the file, the field and
  why it is needed.
* :class:`Unit`: one read of the checkpoint (a tensor, or one layer / one expert slice of a
  stacked tensor, ``view[key][l, e]``) and the HF tensors made from it. Units are what bounds
  memory: the export never holds more than a unit or two.
* the transforms, each with its inverse: the rotary row permutation, Megatron's per-query-group
  QKV split (``[ng, (q_per_group + 2) * head_dim, h]``, as megatron-core 0.16.1's
  ``get_query_key_value_tensors`` splits it), the SwiGLU ``[gate; up]`` split.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cache

import torch
from ckptkit_converters.hf.families import FAMILIES, Family, Out, Rule
from ckptkit_converters.hf.files import read_local_json, shown

from ckptkit.errors import CkptkitError

_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
_CONFIG_NAMES = {"n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "vocab_size": "vocab_size",
                 "model_type": "model_type"}  # HFConfig field -> its name in config.json


@dataclass(frozen=True)
class AttentionHeads:
    """Head counts of the attention layers (needed for the rotary permutation)."""

    n_heads: int
    n_kv_heads: int

    @staticmethod
    def from_hf_config(path: str | os.PathLike[str]) -> AttentionHeads:
        """From a Hugging Face ``config.json`` (``num_attention_heads``, ``num_key_value_heads``)."""
        cfg = HFConfig.from_file(path)
        n = cfg.need("n_heads", "the attention head counts")
        return AttentionHeads(n, cfg.n_kv_heads or n)


@dataclass(frozen=True)
class HFConfig:
    """The fields of an HF ``config.json`` a conversion may need (None: not given).

    ``model_type`` picks the key table; ``n_heads`` / ``n_kv_heads`` (``num_attention_heads``,
    ``num_key_value_heads``), ``vocab_size``, ``num_layers`` (``num_hidden_layers``),
    ``num_experts`` (``num_experts``, ``num_local_experts`` or ``n_routed_experts``: the
    family's own name, kept in ``experts_field``), ``tie_word_embeddings``. ``source`` names the
    file in errors. The rest are the sizes an import checks every tensor's shape against
    (:mod:`ckptkit_converters.hf.expect`): ``q_lora_rank`` is 0 where the config says null (no
    low-rank query), None where it does not say; ``dtype`` is ``torch_dtype`` / ``dtype``.
    """

    model_type: str | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    vocab_size: int | None = None
    num_layers: int | None = None
    num_experts: int | None = None
    tie_word_embeddings: bool | None = None
    source: str = "the HF config"
    hidden_size: int | None = None
    intermediate_size: int | None = None
    head_dim: int | None = None
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    n_shared_experts: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    first_k_dense_replace: int | None = None
    decoder_sparse_step: int | None = None
    mlp_only_layers: tuple[int, ...] | None = None
    attention_bias: bool | None = None
    dtype: str | None = None
    experts_field: str = "num_experts"

    @staticmethod
    def from_file(path: str | os.PathLike[str]) -> HFConfig:
        """From a local ``config.json``: a regular file (links followed: a hub snapshot's is one), parsed
        strictly (no duplicate keys, NaN or deep nesting) and checked (:meth:`from_dict`)."""
        return HFConfig.from_dict(read_local_json(path), os.fspath(path))

    @staticmethod
    def from_dict(doc: dict[str, object], source: str = "the HF config") -> HFConfig:
        """The fields, each of the JSON type it must have, and a model they can describe: sizes positive,
        ``num_attention_heads`` a multiple of ``num_key_value_heads``, ``hidden_size`` a multiple of
        ``num_attention_heads`` where the head size comes from it (no ``head_dim``)."""
        def integer(name: str, minimum: int = 1) -> int | None:
            v = doc.get(name)
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
                raise CkptkitError(f"{source}: {name!r} must be {what}, got {shown(v)}")
            return v

        def flag(name: str) -> bool | None:
            v = doc.get(name)
            if v is not None and not isinstance(v, bool):
                raise CkptkitError(f"{source}: {name!r} must be true or false, got {shown(v)}")
            return v

        def text(name: str) -> str | None:
            v = doc.get(name)
            if v is not None and not isinstance(v, str):
                raise CkptkitError(f"{source}: {name!r} must be a string, got {shown(v)}")
            return v

        field = next((f for f in _EXPERT_FIELDS if doc.get(f) is not None), "num_experts")
        n = integer("num_attention_heads")
        kv = integer("num_key_value_heads") or n
        return HFConfig(text("model_type"), n, kv, integer("vocab_size"), integer("num_hidden_layers"),
                       integer(field), flag("tie_word_embeddings"), source,
                       hidden_size=integer("hidden_size"), intermediate_size=integer("intermediate_size"),
                       head_dim=integer("head_dim"), moe_intermediate_size=integer("moe_intermediate_size"),
                       shared_expert_intermediate_size=integer("shared_expert_intermediate_size"),
                       n_shared_experts=integer("n_shared_experts"),
                       q_lora_rank=(0 if "q_lora_rank" in doc and doc["q_lora_rank"] is None
                                    else integer("q_lora_rank")),
                       kv_lora_rank=integer("kv_lora_rank"), qk_nope_head_dim=integer("qk_nope_head_dim"),
                       qk_rope_head_dim=integer("qk_rope_head_dim"), v_head_dim=integer("v_head_dim"),
                       first_k_dense_replace=integer("first_k_dense_replace", 0),
                       decoder_sparse_step=integer("decoder_sparse_step"),
                       mlp_only_layers=_layer_list(doc.get("mlp_only_layers"), source),
                       attention_bias=flag("attention_bias"), dtype=text("torch_dtype") or text("dtype"),
                       experts_field=field)

    def __post_init__(self) -> None:
        """Sizes that must divide do (CkptkitError naming the fields), however the config was made."""
        n, kv = self.n_heads, self.n_kv_heads
        if n is not None and kv is not None and n % kv:
            raise CkptkitError(f"{self.source}: num_attention_heads {n} is not a multiple of num_key_value_heads "
                               f"{kv} (each key/value head serves a whole group of query heads)")
        if (n is not None and self.hidden_size is not None and self.head_dim is None
                and self.model_type != "deepseek_v3" and self.hidden_size % n):
            raise CkptkitError(f"{self.source}: hidden_size {self.hidden_size} is not a multiple of "
                               f"num_attention_heads {n}, and no head_dim says the head size")

    @staticmethod
    def of(heads: HFConfig | AttentionHeads | None) -> HFConfig:
        if heads is None:
            return HFConfig()
        if isinstance(heads, AttentionHeads):
            return HFConfig(n_heads=heads.n_heads, n_kv_heads=heads.n_kv_heads, source="the head counts given")
        return heads

    def need(self, field: str, why: str) -> int:
        v = getattr(self, field)
        if v is None:
            raise CkptkitError(f"{self.source}: no {_CONFIG_NAMES.get(field, field)!r}, needed for {why} "
                               f"(CLI: --hf-config config.json)")
        return v


# ---------------------------------------------------------------- names


@cache
def _ours_re(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(pattern).replace(r"\{l\}", r"(?P<l>[0-9]+)") + "$")


@cache
def _hf_re(pattern: str) -> re.Pattern[str]:
    body = re.escape(pattern).replace(r"\{l\}", r"(?P<l>[0-9]+)").replace(r"\{e\}", r"(?P<e>[0-9]+)")
    return re.compile("^" + body + "$")


_PER_LAYER_M = re.compile(r"^decoder\.layers\.([0-9]+)\.(.+)$")


@dataclass(frozen=True)
class Match:
    """A checkpoint name matched to a rule: ``layer`` from the name (torchtitan ``layers.3.``, Megatron's
    per-layer ``decoder.layers.3.``), None when the layer is an axis or there is none."""

    rule: Rule
    layer: int | None
    stacked: bool  # axis 0 holds the layers


def match_name(family: Family, name: str) -> Match | None:
    """The rule for checkpoint tensor ``name`` (no prefix), or None."""
    for rule in family.rules:
        m = _ours_re(rule.ours).match(name)
        if m:
            return Match(rule, int(m.group("l")) if rule.per_layer else None, rule.layer_axis)
    m = _PER_LAYER_M.match(name)  # Megatron with an MoE layer pattern: per-layer keys, no layer axis
    if m is not None:
        stacked_name = "decoder.layers." + m.group(2)
        for rule in family.rules:
            if rule.layer_axis and rule.ours == stacked_name:
                return Match(rule, int(m.group(1)), False)
    return None


def is_dropped(family: Family, name: str) -> bool:
    return any(_ours_re(p).match(name) for p in family.drop) or any(
        _ours_re(p).match("decoder.layers." + m.group(2)) for p in family.drop
        for m in [_PER_LAYER_M.match(name)] if m is not None)


def to_hf_name(name: str, family: str = "llama") -> tuple[str, str | None] | None:
    """(HF name, rope heads) of a per-layer checkpoint tensor name with one output, or None (kept for
    callers of the first version; the export itself works on :class:`Unit`)."""
    m = match_name(FAMILIES[family], name)
    if m is None or len(m.rule.outs) != 1 or m.rule.expert_axis or m.stacked:
        return None
    out = m.rule.outs[0]
    return out.hf.format(l=m.layer), out.rope


def from_hf_name(name: str, family: str = "llama") -> tuple[str, str | None] | None:
    """The inverse of :func:`to_hf_name` (the first rule wins where two map to one HF name)."""
    for rule, out, layer, expert in match_hf(FAMILIES[family], name):
        if len(rule.outs) == 1 and not rule.expert_axis and not rule.layer_axis:
            return rule.ours.format(l=layer), out.rope
    return None


def match_hf(family: Family, name: str) -> list[tuple[Rule, Out, int | None, int | None]]:
    """Every (rule, output, layer, expert) an HF tensor name can come from, in table order."""
    found = []
    for rule in family.rules:
        for out in rule.outs:
            m = _hf_re(out.hf).match(name)
            if m:
                d = m.groupdict()
                found.append((rule, out, int(d["l"]) if "l" in d else None, int(d["e"]) if "e" in d else None))
    return found


# ---------------------------------------------------------------- units


@dataclass(frozen=True)
class Unit:
    """One read (``view[key][index]``) and the HF tensors made from it: ``names[i]`` of ``shapes[i]``."""

    key: str
    index: tuple[int, ...]
    rule: Rule
    layer: int | None
    expert: int | None
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]


def out_shapes(rule: Rule, shape: tuple[int, ...], cfg: HFConfig, where: str) -> tuple[tuple[int, ...], ...]:
    """The HF shape of each output of ``rule`` from a slice of ``shape``."""
    out = []
    for o in rule.outs:
        if o.take in ("q", "k", "v"):
            q, kv, _ = qkv_rows(shape[0], cfg, where)
            out.append(((q if o.take == "q" else kv), *shape[1:]))
        elif o.take in ("gate", "up"):
            if shape[0] % 2:
                raise CkptkitError(f"{where}: a fused [gate; up] projection with an odd number of rows ({shape[0]})")
            out.append((shape[0] // 2, *shape[1:]))
        elif rule.vocab == "trim":
            v = cfg.need("vocab_size", f"removing Megatron's vocabulary padding from {where}")
            if shape[0] < v:
                raise CkptkitError(f"{where}: {shape[0]} vocabulary rows, fewer than {cfg.source}'s vocab_size {v}")
            out.append((v, *shape[1:]))
        else:
            if rule.vocab == "check" and cfg.vocab_size is not None and shape[0] != cfg.vocab_size:
                raise CkptkitError(f"{where}: {shape[0]} vocabulary rows, {cfg.source} says vocab_size "
                                   f"{cfg.vocab_size}")
            out.append(tuple(shape))
    return tuple(out)


def qkv_rows(rows: int, cfg: HFConfig, where: str) -> tuple[int, int, int]:
    """(query rows, key rows, head_dim) of Megatron's fused QKV with ``rows`` rows."""
    n = cfg.need("n_heads", f"splitting Megatron's fused QKV {where}")
    ng = cfg.n_kv_heads or n
    if n % ng:
        raise CkptkitError(f"{cfg.source}: {n} attention heads are not a multiple of {ng} key/value heads")
    per = n // ng + 2
    if rows % (ng * per):
        raise CkptkitError(f"{where}: {rows} fused QKV rows do not split into {ng} query groups of "
                           f"{n // ng} query heads + key + value")
    hd = rows // (ng * per)
    return n * hd, ng * hd, hd


def apply(unit: Unit, t: torch.Tensor, cfg: HFConfig, permute: bool) -> list[torch.Tensor]:
    """The HF tensors of ``unit`` from its slice ``t`` (each contiguous; views where nothing moves)."""
    rule = unit.rule
    takes = {o.take for o in rule.outs}
    parts: dict[str | None, torch.Tensor] = {}
    if takes & {"q", "k", "v"}:
        parts.update(zip(("q", "k", "v"), split_qkv(t, cfg, unit.key)))
    elif takes & {"gate", "up"}:
        half = t.shape[0] // 2
        parts.update(gate=t[:half], up=t[half:])
    res = []
    for o, shape in zip(rule.outs, unit.shapes):
        x = parts[o.take] if o.take is not None else t
        if rule.vocab == "trim":
            x = x[: shape[0]]
        if o.rope is not None and permute:
            x = rope_to_hf(x, rope_heads(cfg, o.rope, unit.key))
        res.append(x.contiguous())
    return res


def invert(rule: Rule, parts: list[torch.Tensor], cfg: HFConfig, permute: bool, where: str) -> torch.Tensor:
    """The checkpoint slice of ``rule`` from its HF tensors (in ``rule.outs`` order): :func:`apply` undone."""
    xs = []
    for o, x in zip(rule.outs, parts):
        if o.rope is not None and permute:
            x = rope_from_hf(x, rope_heads(cfg, o.rope, where))
        xs.append(x)
    takes = [o.take for o in rule.outs]
    if takes == ["q", "k", "v"]:
        return merge_qkv(xs[0], xs[1], xs[2], cfg, where)
    if takes == ["gate", "up"]:
        return torch.cat(xs, 0)
    return xs[0]


def _layer_list(v: object, source: str) -> tuple[int, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise CkptkitError(f"{source}: 'mlp_only_layers' must be a list of layer numbers, got {shown(v)}")
    return tuple(v)


def rope_heads(cfg: HFConfig, rope: str, where: str) -> int:
    """The heads a rotary output's rows are grouped in (``rope`` is the rule's head-count field)."""
    if rope == "n_kv_heads":
        n = cfg.need("n_heads", f"the rotary permutation of {where}")
        return cfg.n_kv_heads or n
    return cfg.need("n_heads", f"the rotary permutation of {where}")


def split_qkv(w: torch.Tensor, cfg: HFConfig, where: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's fused QKV rows ``[ng, (q_per_group + 2) * head_dim, ...]`` -> (q, k, v) in HF's head order."""
    q_rows, kv_rows, hd = qkv_rows(w.shape[0], cfg, where)
    ng = kv_rows // hd
    g = w.reshape(ng, -1, hd, *w.shape[1:])
    qpg = g.shape[1] - 2
    return (g[:, :qpg].reshape(q_rows, *w.shape[1:]), g[:, qpg].reshape(kv_rows, *w.shape[1:]),
            g[:, qpg + 1].reshape(kv_rows, *w.shape[1:]))


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: HFConfig, where: str) -> torch.Tensor:
    """The inverse of :func:`split_qkv`."""
    n = cfg.need("n_heads", f"fusing Megatron's QKV {where}")
    ng = cfg.n_kv_heads or n
    if k.shape != v.shape or k.shape[0] % ng or q.shape[0] * ng != k.shape[0] * n or q.shape[1:] != k.shape[1:]:
        raise CkptkitError(f"{where}: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} are not {n} query "
                           f"and {ng} key/value heads of one size")
    hd = k.shape[0] // ng
    rest = q.shape[1:]
    g = torch.cat([q.reshape(ng, n // ng, hd, *rest), k.reshape(ng, 1, hd, *rest), v.reshape(ng, 1, hd, *rest)], 1)
    return g.reshape(-1, *rest).contiguous()


def rope_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from interleaved rotary pairs to HF's rotate-half layout."""
    rows, cols = w.shape
    _check_heads(rows, heads)
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def rope_from_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`rope_to_hf`."""
    rows, cols = w.shape
    _check_heads(rows, heads)
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def _check_heads(rows: int, heads: int) -> None:
    if heads < 1 or rows % (2 * heads):
        raise CkptkitError(f"a rotary projection with {rows} rows cannot have {heads} heads of even size")
