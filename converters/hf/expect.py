"""An HF folder checked against its config before anything is written: every tensor the model needs is
there, once, of the shape and dtype the config implies, and nothing else is.

``transformers`` answers a folder that disagrees with its config with "missing keys" or "size
mismatch" when the model is built; an import has no model to build, so it derives the same
expectations itself, from the key table of the family (:mod:`ckptkit_converters.hf.families`: which
HF names the family has) and :data:`TABLE` here (what each name's shape is, in the config's terms):

* **presence**: every layer ``0 .. num_hidden_layers - 1`` holds its tensors, every routed-expert
  layer all ``num_experts`` experts (the family's field: ``num_local_experts``, ``n_routed_experts``);
  which layers route to experts follows the config as ``transformers`` reads it
  (``first_k_dense_replace``, ``decoder_sparse_step`` / ``mlp_only_layers``; Mixtral: every layer),
  or, where the config does not say, the kind each layer's tensors show (complete for that kind);
* **nothing else**: a tensor for a layer or an expert past the config's counts, a dense MLP in an
  expert layer, attention biases the config rules out (``attention_bias``) is refused. Optional
  tensors are listed, not guessed: ``lm_head.weight`` where the embeddings are tied or the config
  does not say, attention biases on every layer or none where the config does not say, DeepSeek's
  two query forms (``q_proj``, or ``q_a_proj``/``q_b_proj`` when ``q_lora_rank`` is set);
* **shape**: each dimension is an expression of config sizes (``num_key_value_heads*head_dim``).
  A size the config lacks (library callers may give only head counts) is taken from the tensors,
  the value most of them agree on, and then holds for every other tensor;
* **dtype**: a floating dtype, the config's ``torch_dtype``/``dtype`` where it names one, else the
  one most weights have (DeepSeek-V3 keeps its router in float32, as ``transformers`` does).

Layer and expert counts are compared with the files before anything is enumerated, so a config
saying ``num_hidden_layers: 10**9`` is refused at once, naming the field.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ckptkit_converters.hf.families import Family
from ckptkit_converters.hf.files import SafetensorsFile, shown
from ckptkit_converters.hf.mapping import HFConfig, match_hf

from ckptkit.errors import DTypeMismatchError, MissingKeysError, ShapeMismatchError, UnexpectedKeysError

HF_ONLY = (".rotary_emb.inv_freq",)
"""HF tensors that are not model state (older Llama exports store the RoPE frequencies): skipped on import,
as torchtitan's adapters skip them."""

_L = "model.layers.{l}."
_A = _L + "self_attn."
_M = _L + "mlp."
_B = _L + "block_sparse_moe."
_HEADS_HD = "num_attention_heads*head_dim"
_KV_HD = "num_key_value_heads*head_dim"

# HF name -> (group, shape). Groups: "model" (once), "lm_head" (once; optional where tied or unsaid),
# "layer" (every layer), "bias" (every layer or none), "dense" (a dense layer's MLP), "moe" (an expert
# layer's), "q_direct" / "q_lora" (DeepSeek's query without / with a low-rank projection).
TABLE: dict[str, tuple[str, tuple[str, ...]]] = {
    "model.embed_tokens.weight": ("model", ("vocab_size", "hidden_size")),
    "model.norm.weight": ("model", ("hidden_size",)),
    "lm_head.weight": ("lm_head", ("vocab_size", "hidden_size")),
    _L + "input_layernorm.weight": ("layer", ("hidden_size",)),
    _L + "post_attention_layernorm.weight": ("layer", ("hidden_size",)),
    _A + "q_proj.weight": ("layer", (_HEADS_HD, "hidden_size")),
    _A + "k_proj.weight": ("layer", (_KV_HD, "hidden_size")),
    _A + "v_proj.weight": ("layer", (_KV_HD, "hidden_size")),
    _A + "o_proj.weight": ("layer", ("hidden_size", _HEADS_HD)),
    _A + "q_proj.bias": ("bias", (_HEADS_HD,)),
    _A + "k_proj.bias": ("bias", (_KV_HD,)),
    _A + "v_proj.bias": ("bias", (_KV_HD,)),
    _A + "q_norm.weight": ("layer", ("head_dim",)),
    _A + "k_norm.weight": ("layer", ("head_dim",)),
    _M + "gate_proj.weight": ("dense", ("intermediate_size", "hidden_size")),
    _M + "up_proj.weight": ("dense", ("intermediate_size", "hidden_size")),
    _M + "down_proj.weight": ("dense", ("hidden_size", "intermediate_size")),
    _M + "gate.weight": ("moe", ("num_experts", "hidden_size")),
    _M + "experts.{e}.gate_proj.weight": ("moe", ("moe_intermediate_size", "hidden_size")),
    _M + "experts.{e}.up_proj.weight": ("moe", ("moe_intermediate_size", "hidden_size")),
    _M + "experts.{e}.down_proj.weight": ("moe", ("hidden_size", "moe_intermediate_size")),
    _M + "shared_expert.gate_proj.weight": ("moe", ("shared_expert_intermediate_size", "hidden_size")),
    _M + "shared_expert.up_proj.weight": ("moe", ("shared_expert_intermediate_size", "hidden_size")),
    _M + "shared_expert.down_proj.weight": ("moe", ("hidden_size", "shared_expert_intermediate_size")),
    _M + "shared_expert_gate.weight": ("moe", ("1", "hidden_size")),
    _M + "shared_experts.gate_proj.weight": ("moe", ("moe_intermediate_size*n_shared_experts", "hidden_size")),
    _M + "shared_experts.up_proj.weight": ("moe", ("moe_intermediate_size*n_shared_experts", "hidden_size")),
    _M + "shared_experts.down_proj.weight": ("moe", ("hidden_size", "moe_intermediate_size*n_shared_experts")),
    _M + "gate.e_score_correction_bias": ("moe", ("num_experts",)),
    _B + "gate.weight": ("moe", ("num_experts", "hidden_size")),  # Mixtral: intermediate_size is the expert's
    _B + "experts.{e}.w1.weight": ("moe", ("intermediate_size", "hidden_size")),
    _B + "experts.{e}.w3.weight": ("moe", ("intermediate_size", "hidden_size")),
    _B + "experts.{e}.w2.weight": ("moe", ("hidden_size", "intermediate_size")),
    _A + "q_a_proj.weight": ("q_lora", ("q_lora_rank", "hidden_size")),
    _A + "q_a_layernorm.weight": ("q_lora", ("q_lora_rank",)),
    _A + "q_b_proj.weight": ("q_lora", ("num_attention_heads*qk_head_dim", "q_lora_rank")),
    _A + "kv_a_proj_with_mqa.weight": ("layer", ("kv_a_rows", "hidden_size")),
    _A + "kv_a_layernorm.weight": ("layer", ("kv_lora_rank",)),
    _A + "kv_b_proj.weight": ("layer", ("num_attention_heads*kv_b_head_dim", "kv_lora_rank")),
}
# where one HF name means another thing in a model type (multi-head latent attention)
OVERRIDES: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {"deepseek_v3": {
    _A + "q_proj.weight": ("q_direct", ("num_attention_heads*qk_head_dim", "hidden_size")),
    _A + "o_proj.weight": ("layer", ("hidden_size", "num_attention_heads*v_head_dim")),
}}
# sizes that are sums of config fields (a symbol of its own when the config lacks a part)
DERIVED = {"qk_head_dim": ("qk_nope_head_dim", "qk_rope_head_dim"), "kv_a_rows": ("kv_lora_rank", "qk_rope_head_dim"),
           "kv_b_head_dim": ("qk_nope_head_dim", "v_head_dim")}
FLOATING = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ")
_DTYPE_NAMES = {"float32": "F32", "float": "F32", "bfloat16": "BF16", "float16": "F16", "half": "F16",
                "float64": "F64", "double": "F64"}
# tensors transformers keeps in float32 whatever the model's dtype (_keep_in_fp32_modules_strict)
FP32_OK = {"deepseek_v3": (_M + "gate.weight", _M + "gate.e_score_correction_bias")}

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Counts:
    """What the check settled: the layer and routed-expert counts every grouping uses."""

    layers: int
    experts: int


@dataclass(frozen=True)
class _Found:
    template: str
    layer: int | None
    expert: int | None
    file: str


def spec_of(family: Family, template: str) -> tuple[str, tuple[str, ...]]:
    """(group, shape expressions) of an HF name template in ``family``."""
    return OVERRIDES.get(family.model_type, {}).get(template) or TABLE[template]


def check_folder(files: Mapping[str, SafetensorsFile], family: Family, cfg: HFConfig, where: str,
                 weight_map: Mapping[str, str] | None = None) -> Counts:
    """Refuse an HF folder that is not the model its config describes (see the module docstring); the
    error names the tensor, its file, what the config implies and what was found."""
    entries = {name: (fname, e) for fname, f in files.items() for name, e in f.entries.items()
               if not name.endswith(HF_ONLY)}
    found = _parse_names(entries, family, where)
    counts = _counts(found, family, cfg, where)
    expected = _expected(found, family, cfg, counts)
    _refuse_unexpected(found, expected, family, cfg, where)
    sizes = _Sizes(cfg, family, counts)
    present = [(n, expected[n]) for n in expected if n in entries]
    sizes.unify([(spec_of(family, t)[1], entries[n][1].shape, n) for n, t in present])
    for name, template in expected.items():
        if name not in entries:
            raise MissingKeysError(_missing(name, template, found, family, cfg, counts, sizes, where, weight_map))
    fp32_ok = FP32_OK.get(family.model_type, ())
    ref = _reference_dtype(cfg, [(n, entries[n][1].code) for n, t in present if t not in fp32_ok])
    for name, template in present:
        fname, e = entries[name]
        dims = spec_of(family, template)[1]
        ok, implied = sizes.explain(dims, e.shape)
        if not ok:
            raise ShapeMismatchError(f"{where}/{fname}: HF tensor {shown(name)} is {e.code} {list(e.shape)}; "
                                     f"{cfg.source} implies {implied}")
        allowed = ("F32", ref[0]) if template in fp32_ok else (ref[0],)
        if e.code not in FLOATING or (ref[0] is not None and e.code not in allowed):
            want = f", {ref[0]} ({ref[1]})" if ref[0] else ""
            raise DTypeMismatchError(f"{where}/{fname}: HF tensor {shown(name)} is {e.code} {list(e.shape)}; "
                                     f"{cfg.source} implies a floating dtype{want}")
    return counts


def _parse_names(entries: Mapping[str, tuple[str, object]], family: Family, where: str) -> dict[str, _Found]:
    found, unknown = {}, []
    for name, (fname, _) in entries.items():
        hits = match_hf(family, name)
        if not hits:
            unknown.append(name)
            continue
        _, out, layer, expert = hits[0]
        found[name] = _Found(out.hf, layer, expert, fname)
    if unknown:
        unknown.sort()
        listed = ", ".join(shown(n) for n in unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        raise UnexpectedKeysError(f"{where}: no {family.name} checkpoint name for {len(unknown)} HF tensor(s): "
                                  f"{listed} (the first in {entries[unknown[0]][0]})")
    return found


def _counts(found: Mapping[str, _Found], family: Family, cfg: HFConfig, where: str) -> Counts:
    """The layer and expert counts: the config's, checked against the highest number any tensor has."""
    layers = cfg.num_layers if cfg.num_layers is not None else 1 + max(
        (f.layer for f in found.values() if f.layer is not None), default=-1)
    experts = cfg.num_experts if cfg.num_experts is not None else 1 + max(
        (f.expert for f in found.values() if f.expert is not None), default=-1)
    field = _experts_field(family, cfg)
    for name, f in sorted(found.items(), key=lambda kv: (kv[1].layer or 0, kv[1].expert or 0)):
        if f.layer is not None and f.layer >= layers:
            raise UnexpectedKeysError(f"{where}/{f.file}: HF tensor {shown(name)} is for layer {f.layer}, but "
                                      f"{cfg.source} says num_hidden_layers {layers}")
        if f.expert is not None and f.expert >= experts:
            raise UnexpectedKeysError(f"{where}/{f.file}: HF tensor {shown(name)} is for expert {f.expert}, but "
                                      f"{cfg.source} says {field} {experts}")
    return Counts(layers, experts)


def _kinds(found: Mapping[str, _Found], family: Family, cfg: HFConfig) -> tuple[Callable[[int], bool], str]:
    """Whether layer ``l`` routes to experts, and why (for messages)."""
    groups = {spec_of(family, o.hf)[0] for r in family.rules for o in r.outs}
    mt = family.model_type
    if "moe" not in groups:
        return (lambda l: False), f"a {family.name} model has no routed experts"
    if mt == "mixtral" or "dense" not in groups:
        return (lambda l: True), f"every layer of a {mt} model routes to experts"
    if mt in ("qwen3_moe", "qwen2_moe") and (cfg.decoder_sparse_step is not None or cfg.mlp_only_layers is not None):
        step, only = cfg.decoder_sparse_step or 1, set(cfg.mlp_only_layers or ())
        return ((lambda l: l not in only and (l + 1) % step == 0),
                f"{cfg.source}: decoder_sparse_step {step}, mlp_only_layers {sorted(only)}")
    if mt == "deepseek_v3" and cfg.first_k_dense_replace is not None:
        k = cfg.first_k_dense_replace
        return (lambda l: l >= k), f"{cfg.source}: first_k_dense_replace {k}"
    moe = {f.layer for f in found.values() if spec_of(family, f.template)[0] == "moe"}
    return (lambda l: l in moe), "its tensors show routed experts, and the config does not say which layers have them"


def _expected(found: Mapping[str, _Found], family: Family, cfg: HFConfig, counts: Counts) -> dict[str, str]:
    """Every HF name the model needs (name -> template), in table order, layer by layer.

    Enumerates at most one layer (and one expert) past the highest the files hold: a config whose counts
    run further is refused at that first missing name, however large the count."""
    templates = list(dict.fromkeys(o.hf for r in family.rules for o in r.outs))
    groups = {t: spec_of(family, t)[0] for t in templates}
    present = {spec_of(family, f.template)[0] for f in found.values()}
    q_lora = cfg.q_lora_rank > 0 if cfg.q_lora_rank is not None else "q_lora" in present
    bias = cfg.attention_bias if cfg.attention_bias is not None else "bias" in present
    is_moe, _ = _kinds(found, family, cfg)
    top_layer = max((f.layer for f in found.values() if f.layer is not None), default=-1)
    top_expert = max((f.expert for f in found.values() if f.expert is not None), default=-1)
    experts = range(min(counts.experts, top_expert + 2))
    out: dict[str, str] = {}
    for t in templates:
        if groups[t] == "model" or (groups[t] == "lm_head" and (cfg.tie_word_embeddings is False or t in found)):
            out[t] = t
    for layer in range(min(counts.layers, top_layer + 2)):
        moe = is_moe(layer)
        for t in templates:
            g = groups[t]
            if g in ("layer", "dense" if not moe else "moe") or (g == "bias" and bias) or \
                    (g == "q_lora" and q_lora) or (g == "q_direct" and not q_lora):
                for e in (experts if "{e}" in t else (None,)):
                    out[t.format(l=layer, e=e)] = t
    return out


def _refuse_unexpected(found: Mapping[str, _Found], expected: Mapping[str, str], family: Family, cfg: HFConfig,
                       where: str) -> None:
    for name, f in found.items():
        if name in expected:
            continue
        g = spec_of(family, f.template)[0]
        if g == "lm_head":
            continue  # optional: tied embeddings (HF re-ties it), or a config that does not say
        _, why = _kinds(found, family, cfg)
        reason = {
            "dense": f"layer {f.layer} routes to experts ({why})",
            "moe": f"layer {f.layer} is a dense layer ({why})",
            "bias": f"{cfg.source} says attention_bias false",
            "q_lora": f"{cfg.source} gives no q_lora_rank: the query is q_proj",
            "q_direct": f"{cfg.source} gives q_lora_rank {cfg.q_lora_rank}: the query is q_a_proj, q_b_proj"
                        if cfg.q_lora_rank else "other layers use q_a_proj, q_b_proj",
        }.get(g, "no layer of this model has it")
        raise UnexpectedKeysError(f"{where}/{f.file}: HF tensor {shown(name)} is not part of the model "
                                  f"{cfg.source} describes: {reason}")


def _missing(name: str, template: str, found: Mapping[str, _Found], family: Family, cfg: HFConfig, counts: Counts,
             sizes: _Sizes, where: str, weight_map: Mapping[str, str] | None) -> str:
    hit = match_hf(family, name)[0]
    layer, expert = hit[2], hit[3]
    ctx = [f"layer {layer}" if layer is not None else "", f"expert {expert} (of {counts.experts})" if expert is not None
           else ""]
    top_layer = max((f.layer for f in found.values() if f.layer is not None), default=-1)
    top_expert = max((f.expert for f in found.values() if f.expert is not None), default=-1)
    if layer is not None and layer > top_layer:
        ctx[0] += f" (of {counts.layers}: {cfg.source} says num_hidden_layers {counts.layers}, the files hold " \
                  f"layers up to {top_layer})"
    if expert is not None and expert > top_expert:
        ctx[1] += f" ({cfg.source} says {_experts_field(family, cfg)} {counts.experts}, the files " \
                  f"hold experts up to {top_expert})"
    where_listed = (f"the index lists it in {weight_map[name]}, which does not hold it"
                    if weight_map is not None and name in weight_map else "no file of the folder holds it")
    what = ", ".join(c for c in ctx if c)
    return (f"{where}: {what + ': ' if what else ''}no HF tensor {shown(name)} ({where_listed}; {cfg.source} implies "
            f"a floating {sizes.explain(spec_of(family, template)[1], None)[1]})")


def _experts_field(family: Family, cfg: HFConfig) -> str:
    """The config field the expert count is read from (the family's own where the config gives none)."""
    return cfg.experts_field if cfg.num_experts is not None else (family.experts_field or "num_experts")


def _reference_dtype(cfg: HFConfig, codes: list[tuple[str, str]]) -> tuple[str | None, str]:
    """The dtype every weight must have, and why: the config's where some weight has it, else the one
    most weights have. A folder whose weights all share one floating dtype other than the config's
    (repos saved in bf16 whose config still says float32 exist) imports as stored, with a warning:
    what it stores is consistent, and the config's dtype is only what transformers would cast to."""
    floating = Counter(c for _, c in codes if c in FLOATING)
    if cfg.dtype in _DTYPE_NAMES and (_DTYPE_NAMES[cfg.dtype] in floating or not floating):
        return _DTYPE_NAMES[cfg.dtype], f"{cfg.source}'s dtype {cfg.dtype}"
    if not floating:
        return None, ""
    code, n = floating.most_common(1)[0]
    if cfg.dtype in _DTYPE_NAMES and n == len(codes):
        log.warning("%s: says dtype %s, but all %d weights are %s: importing them as stored",
                    cfg.source, cfg.dtype, n, code)
    return code, f"the dtype of {n} of the {len(codes)} weights"


class _Sizes:
    """The config's sizes by name, completed from the tensors where the config is silent."""

    def __init__(self, cfg: HFConfig, family: Family, counts: Counts) -> None:
        self.values: dict[str, int] = {}
        self.origin: dict[str, str] = {}
        given = {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "num_attention_heads": cfg.n_heads,
                 "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.intermediate_size,
                 "moe_intermediate_size": cfg.moe_intermediate_size, "n_shared_experts": cfg.n_shared_experts,
                 "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
                 "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
                 "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
                 "v_head_dim": cfg.v_head_dim, "num_experts": counts.experts or None, "head_dim": cfg.head_dim}
        if cfg.head_dim is None and cfg.hidden_size and cfg.n_heads and cfg.hidden_size % cfg.n_heads == 0 \
                and family.model_type != "deepseek_v3":
            given["head_dim"] = cfg.hidden_size // cfg.n_heads
        for name, parts in DERIVED.items():
            if all(given.get(p) for p in parts):
                given[name] = sum(given[p] for p in parts)  # type: ignore[misc]
        for k, v in given.items():
            if v is not None:
                self.values[k], self.origin[k] = v, cfg.source
        self.names = {"num_experts": _experts_field(family, cfg),
                      **{k: "+".join(v) for k, v in DERIVED.items()}}

    def unify(self, items: list[tuple[tuple[str, ...], tuple[int, ...], str]]) -> None:
        """Bind each size the config lacks to the value most tensors imply (a dimension with one unknown
        factor implies it), until nothing new binds; the check that follows holds every tensor to them."""
        while True:
            votes: dict[str, Counter[int]] = {}
            first: dict[tuple[str, int], str] = {}
            for dims, shape, name in items:
                if len(dims) != len(shape):
                    continue
                for expr, actual in zip(dims, shape):
                    factors = expr.split("*")
                    unknown = [f for f in factors if not (f.isascii() and f.isdigit()) and f not in self.values]
                    if len(unknown) != 1 or factors.count(unknown[0]) != 1:
                        continue
                    known = math.prod(int(f) if (f.isascii() and f.isdigit()) else self.values.get(f, 1) for f in factors)
                    if actual > 0 and actual % known == 0:
                        votes.setdefault(unknown[0], Counter())[actual // known] += 1
                        first.setdefault((unknown[0], actual // known), name)
            if not votes:
                return
            for sym, c in votes.items():
                value, n = c.most_common(1)[0]
                self.values[sym] = value
                self.origin[sym] = f"{n} tensor(s), e.g. {first[(sym, value)]}"

    def explain(self, dims: tuple[str, ...], shape: tuple[int, ...] | None) -> tuple[bool, str]:
        """(whether ``shape`` matches, the implied shape spelled out with the config's names)."""
        parts, ok = [], shape is not None and len(shape) == len(dims)
        for i, expr in enumerate(dims):
            factors = expr.split("*")
            vals = [int(f) if (f.isascii() and f.isdigit()) else self.values.get(f) for f in factors]
            named = "*".join(self.names.get(f, f) for f in factors if not (f.isascii() and f.isdigit())) or expr
            if any(v is None for v in vals):
                parts.append(f"{named}=?")
                ok = False
                continue
            total = math.prod(vals)  # type: ignore[arg-type]  # no None: checked above
            ok = ok and shape is not None and shape[i] == total
            shown_vals = "*".join(shown(v) for v in vals)
            parts.append(str(total) if (expr.isascii() and expr.isdigit()) else
                         f"{named}={shown_vals}" + (f"={shown(total)}" if len(vals) > 1 else ""))
        inferred = sorted({f for e in dims for f in e.split("*") if "tensor(s)" in self.origin.get(f, "")})
        note = "".join(f"; {self.names.get(f, f)} from {self.origin[f]}" for f in inferred)
        return ok, f"[{', '.join(parts)}]{note}"
