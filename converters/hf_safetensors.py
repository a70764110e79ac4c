"""Export a checkpoint's model weights as Hugging Face safetensors (and read them back).

Release engineers hand a trained model to the Hugging Face ecosystem as
``model-0000k-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``.
The weights are read from the checkpoint in model space through
:func:`ckptkit.open` (whatever layout saved them, one tensor at a time), renamed
by a declarative key table per model family, transformed where the two
conventions differ, and written shard by shard, so memory stays at about one
shard (``max_shard_bytes``) however large the model.

The one transform of the llama family is the rotary layout of the query and
key projections: torchtitan (like Meta's reference code) rotates interleaved
pairs of each head's dimensions, Hugging Face rotates the two halves, so the
rows of ``wq``/``wk`` are permuted per head (``n_heads`` for queries,
``n_kv_heads`` for keys). The head counts are not in a checkpoint's tensors;
they come from the caller (or an HF ``config.json``).

Reading back uses ``safetensors`` only (a header of JSON and raw bytes): no
pickle is involved in either direction. Output goes through a byte store, so
``dest`` may be a local directory or an ``s3://`` prefix; config and tokenizer
files are not written (take them from the model's HF repository).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any

import torch

from ckptkit.engine.offline_writer import ConvertResult
from ckptkit.options import Progress
from ckptkit.errors import CkptkitError, MissingKeysError
from ckptkit.storage.url import open_store

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class AttentionHeads:
    """Head counts of the attention layers (needed for the rotary permutation)."""

    n_heads: int
    n_kv_heads: int

    @staticmethod
    def from_hf_config(path: str | os.PathLike[str]) -> AttentionHeads:
        """From a Hugging Face ``config.json`` (``num_attention_heads``, ``num_key_value_heads``)."""
        with open(path) as f:
            doc = json.load(f)
        try:
            n = int(doc["num_attention_heads"])
        except (KeyError, TypeError, ValueError):
            raise CkptkitError(f"{path}: no integer 'num_attention_heads'") from None
        return AttentionHeads(n, int(doc.get("num_key_value_heads") or n))


@dataclass(frozen=True)
class KeyRule:
    """One tensor name in the checkpoint (``ours``) and in HF (``hf``); ``{}`` is the layer number.

    ``rope``: the rows are a rotary projection whose per-head layout differs
    ("n_heads" for queries, "n_kv_heads" for keys), or None.
    """

    ours: str
    hf: str
    rope: str | None = None


LLAMA3: tuple[KeyRule, ...] = (
    KeyRule("tok_embeddings.weight", "model.embed_tokens.weight"),
    KeyRule("layers.{}.attention.qkv_linear.wq.weight", "model.layers.{}.self_attn.q_proj.weight", "n_heads"),
    KeyRule("layers.{}.attention.qkv_linear.wk.weight", "model.layers.{}.self_attn.k_proj.weight", "n_kv_heads"),
    KeyRule("layers.{}.attention.qkv_linear.wv.weight", "model.layers.{}.self_attn.v_proj.weight"),
    KeyRule("layers.{}.attention.wo.weight", "model.layers.{}.self_attn.o_proj.weight"),
    KeyRule("layers.{}.feed_forward.w1.weight", "model.layers.{}.mlp.gate_proj.weight"),
    KeyRule("layers.{}.feed_forward.w3.weight", "model.layers.{}.mlp.up_proj.weight"),
    KeyRule("layers.{}.feed_forward.w2.weight", "model.layers.{}.mlp.down_proj.weight"),
    KeyRule("layers.{}.attention_norm.weight", "model.layers.{}.input_layernorm.weight"),
    KeyRule("layers.{}.ffn_norm.weight", "model.layers.{}.post_attention_layernorm.weight"),
    KeyRule("norm.weight", "model.norm.weight"),
    KeyRule("lm_head.weight", "lm_head.weight"),
    KeyRule("output.weight", "lm_head.weight"),  # torchtitan before 0.3 (read back as lm_head.weight)
)
FAMILIES: dict[str, tuple[KeyRule, ...]] = {"llama3": LLAMA3}
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class HFExportOptions:
    """``prefix``: where the model's parameters sit in the checkpoint's state (torchtitan and the
    examples save them under ``model``). ``dtype``: cast on export (None keeps each tensor's).
    ``tie_word_embeddings``: drop the output projection (HF re-ties it to the embedding)."""

    family: str = "llama3"
    prefix: str = "model/"
    dtype: str | None = None
    max_shard_bytes: int = 5 * 10**9
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r} (known: {', '.join(FAMILIES)})")
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)} or None, got {self.dtype!r}")
        if self.max_shard_bytes < 1:
            raise ValueError("max_shard_bytes must be positive")


@dataclass(frozen=True)
class HFExportResult(ConvertResult):
    """A conversion's figures (``format`` is ``"hf"``) and the safetensors files written."""

    shards: tuple[str, ...] = ()

    @property
    def dest(self) -> str:  # the names this result had before it was a ConvertResult
        return self.destination

    @property
    def bytes(self) -> int:
        return self.nbytes


# ------------------------------------------------------------------ names


def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(pattern).replace(r"\{\}", r"(\d+)") + "$")


def to_hf_name(name: str, family: str = "llama3") -> tuple[str, str | None] | None:
    """(HF name, rope heads) of a checkpoint tensor name, or None if the family has no rule for it."""
    for rule in FAMILIES[family]:
        m = _compile(rule.ours).match(name)
        if m:
            return rule.hf.format(*m.groups()), rule.rope
    return None


def from_hf_name(name: str, family: str = "llama3") -> tuple[str, str | None] | None:
    """The inverse of :func:`to_hf_name` (the first rule wins where two map to one HF name)."""
    for rule in FAMILIES[family]:
        m = _compile(rule.hf).match(name)
        if m:
            return rule.ours.format(*m.groups()), rule.rope
    return None


# ------------------------------------------------------------- transforms


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


def _heads_of(rope: str | None, heads: AttentionHeads) -> int | None:
    return None if rope is None else getattr(heads, rope)


# ----------------------------------------------------------------- export


def export_hf(
    source: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    heads: AttentionHeads,
    *,
    options: HFExportOptions = HFExportOptions(),
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> HFExportResult:
    """Write the model weights of the checkpoint at ``source`` as HF safetensors shards at ``dest``.

    Every tensor under ``options.prefix`` must have a rule in the family's
    key table (an unknown name is an error naming it, not a silent drop).
    """
    from safetensors.torch import save as safetensors_bytes

    import ckptkit

    t0 = time.perf_counter()
    view = ckptkit.open(source, storage_options=storage_options)
    read0 = view.bytes_read
    plan = _plan(view, options)
    out = open_store(dest, storage_options)
    if out.exists(INDEX_NAME):
        raise CkptkitError(f"{out.url} already holds an HF export ({INDEX_NAME}); choose an empty destination")
    names = _shard_names(len(plan))
    total = sum(size for shard in plan for *_, size in shard)
    done, weight_map = 0, {}
    for shard, file_name in zip(plan, names):
        tensors = {}
        for key, hf_name, rope, _ in shard:
            t = view[key][...]
            if options.dtype is not None:
                t = t.to(DTYPE_NAMES[options.dtype])
            n = _heads_of(rope, heads)
            tensors[hf_name] = rope_to_hf(t, n) if n is not None else t.contiguous()
            weight_map[hf_name] = file_name
        out.put_bytes(file_name, safetensors_bytes(tensors, metadata={"format": "pt"}))
        done += sum(size for *_, size in shard)
        if progress is not None:
            progress(done, total)
    index = {"metadata": {"total_size": total, "ckptkit_source": view.url}, "weight_map": dict(sorted(weight_map.items()))}
    out.put_bytes(INDEX_NAME, json.dumps(index, indent=2).encode())  # written last: the export is complete
    return HFExportResult(view.url, out.url, "hf", len(weight_map), total, view.bytes_read - read0,
                          time.perf_counter() - t0, tuple(names))


def _plan(view: Any, options: HFExportOptions) -> list[list[tuple[str, str, str | None, int]]]:
    """Shards of (checkpoint key, HF name, rope heads, bytes), in checkpoint order, each under the limit."""
    entries = [t for t in view.tensors() if t.key.startswith(options.prefix)]
    if not entries:
        raise MissingKeysError(f"{view.url}: no tensors under {options.prefix!r} (set HFExportOptions.prefix)")
    unknown, rows = [], []
    for t in entries:
        name = t.key[len(options.prefix):]
        mapped = to_hf_name(name, options.family)
        if mapped is None:
            unknown.append(name)
            continue
        hf_name, rope = mapped
        if options.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        nbytes = t.numel * torch.empty((), dtype=DTYPE_NAMES[options.dtype]).element_size() if options.dtype else t.nbytes
        rows.append((t.key, hf_name, rope, nbytes))
    if unknown:
        raise MissingKeysError(f"{view.url}: no {options.family} HF name for {len(unknown)} tensor(s): "
                               f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
    shards: list[list[tuple[str, str, str | None, int]]] = [[]]
    size = 0
    for row in rows:
        if shards[-1] and size + row[3] > options.max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(row)
        size += row[3]
    return shards


def _shard_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


# ------------------------------------------------------------------- read


def read_hf(
    source: str | os.PathLike[str],
    heads: AttentionHeads,
    *,
    family: str = "llama3",
    storage_options: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """An HF safetensors export as ``{checkpoint name: tensor}`` (the inverse renaming and permutation).

    Reads ``model.safetensors.index.json`` (or a single ``model.safetensors``)
    with ``safetensors`` only. Loads everything into memory: meant for models
    that fit (tests, initial loads of small models).
    """
    from safetensors.torch import load as safetensors_load

    store = open_store(source, storage_options)
    if store.exists(INDEX_NAME):
        files = sorted(set(json.loads(store.read_bytes(INDEX_NAME))["weight_map"].values()))
    elif store.exists("model.safetensors"):
        files = ["model.safetensors"]
    else:
        raise CkptkitError(f"{store.url}: neither {INDEX_NAME} nor model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        for hf_name, t in safetensors_load(store.read_bytes(f)).items():
            mapped = from_hf_name(hf_name, family)
            if mapped is None:
                raise MissingKeysError(f"{store.url}/{f}: no checkpoint name for HF tensor {hf_name!r} ({family})")
            name, rope = mapped
            n = _heads_of(rope, heads)
            out[name] = rope_from_hf(t, n) if n is not None else t
    return out
