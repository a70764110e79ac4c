"""Megatron-GPT-shaped checkpoints written at a chosen layout, for the reshard tests.

The source layout is built from the grid primitives directly (rule ->
GridLayout -> every cell's writer at rotation 0), not from the reshard
planner, so a planner bug cannot hide in both the fixture and the result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckptkit.engine.offline_writer import OfflineCheckpoint, write_offline
from ckptkit.engine.state import dtype_name
from ckptkit.layout.box import Box, Region
from ckptkit.layout.config import ParallelConfig
from ckptkit.layout.manifest import ExplicitLayout, TensorMeta
from ckptkit.layout.rules import PartitionRule
from ckptkit.layout.values import encode_value
from ckptkit.storage.url import open_store


@dataclass(frozen=True)
class GPT:
    """Sizes of a small GPT: vocab (unpadded), hidden, layers, ffn (SwiGLU: fc1 holds 2*ffn), qkv rows."""

    vocab: int = 50
    hidden: int = 16
    layers: int = 4
    ffn: int = 32
    qkv: int = 48
    vocab_multiple: int = 8


def gpt_tensors(m: GPT = GPT(), *, moments: bool = True, extra: bool = True) -> dict[str, tuple[torch.Tensor, PartitionRule | None]]:
    """Model-space tensors with the rules the Megatron adapter records (layer axis 0 prepended)."""
    gen = torch.Generator().manual_seed(1234)
    L, h = m.layers, m.hidden

    def rnd(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    model = {
        "embedding.word_embeddings.weight": (rnd(m.vocab, h, dtype=torch.bfloat16),
                                             PartitionRule(tp_axis=0, vocab_multiple=m.vocab_multiple, stage=0)),
        "output_layer.weight": (rnd(m.vocab, h, dtype=torch.bfloat16),
                                PartitionRule(tp_axis=0, vocab_multiple=m.vocab_multiple, stage=-1)),
        "decoder.layers.self_attention.linear_qkv.weight": (rnd(L, m.qkv, h), PartitionRule(tp_axis=1, layer_axis=0)),
        "decoder.layers.self_attention.linear_proj.weight": (rnd(L, h, h), PartitionRule(tp_axis=2, layer_axis=0)),
        "decoder.layers.mlp.linear_fc1.weight": (rnd(L, 2 * m.ffn, h),
                                                 PartitionRule(tp_axis=1, layer_axis=0, fused=(m.ffn, m.ffn))),
        "decoder.layers.mlp.linear_fc2.weight": (rnd(L, h, m.ffn), PartitionRule(tp_axis=2, layer_axis=0)),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (rnd(L, h), PartitionRule(layer_axis=0)),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (rnd(L, h), PartitionRule(layer_axis=0)),
        "decoder.final_layernorm.weight": (rnd(h), PartitionRule(stage=-1)),
    }
    out = {f"model/{k}": v for k, v in model.items()}
    if moments:
        for group in ("exp_avg", "exp_avg_sq", "main"):
            for k, (t, rule) in model.items():
                out[f"optimizer/{group}/{k}"] = (rnd(*t.shape), rule)
    if extra:
        out["extra/token_counts"] = (torch.arange(21, dtype=torch.int64).reshape(7, 3), None)
        out["extra/scalar"] = (torch.tensor(3.5, dtype=torch.float64), None)
    return out


class _Slices:
    """PieceSource over in-memory tensors: each piece is a copy of its box."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], items: Sequence[tuple[str, Region]]) -> None:
        self._tensors = tensors
        self._items = items
        self.bytes_read = 0

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, ref: int) -> torch.Tensor:
        key, region = self._items[ref]
        box = region.box
        t = self._tensors[key][tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))].clone()
        self.bytes_read += t.numel() * t.element_size()
        return t


def write_at(path: Path | str, tensors: Mapping[str, tuple[torch.Tensor, PartitionRule | None]],
             config: ParallelConfig, *, values: Mapping[str, Any] | None = None,
             per_rank: str | None = "rng") -> None:
    """Commit ``tensors`` at ``path`` as ``config`` would have saved them (unruled tensors on rank 0),
    with replicated ``values`` and, when ``per_rank`` names one, a per-rank value on every rank."""
    world = config.world_size
    num_layers = next((t.shape[r.layer_axis] for t, r in tensors.values() if r is not None and r.layer_axis is not None),
                      None)
    pieces: dict[int, list[tuple[str, Region]]] = {}
    metas = {}
    for key, (t, rule) in tensors.items():
        shape, dtype = tuple(t.shape), dtype_name(t.dtype)
        if rule is None:
            if t.numel():
                pieces.setdefault(0, []).append((key, Region(Box.full(shape))))
            metas[key] = TensorMeta(key, dtype, shape, ExplicitLayout(((Region(Box.full(shape)), 0),) if t.numel() else ()))
            continue
        layout = rule.evaluate(shape, config, num_layers)
        for box, cell in layout.all_boxes():
            if box.numel:
                pieces.setdefault(layout.writer_rank(cell, 0), []).append((key, Region(box)))
        metas[key] = TensorMeta(key, dtype, shape, layout, 0, rule)
    data = {k: t for k, (t, _) in tensors.items()}
    checkpoint = OfflineCheckpoint(
        world_size=world,
        tensors={k: _Spec(m.dtype, m.shape) for k, m in metas.items()},
        pieces=pieces,
        values={k: encode_value(v, k) for k, v in (values or {}).items()},
        per_rank_values={r: {per_rank: encode_value({"rank": r}, per_rank)} for r in range(world)} if per_rank else None,
        parallel=str(config), layouts=metas,
    )
    write_offline(open_store(path), checkpoint, lambda rank, items: _Slices(data, items))


@dataclass(frozen=True)
class _Spec:
    dtype: str
    shape: tuple[int, ...]
