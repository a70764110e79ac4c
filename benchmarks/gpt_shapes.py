"""The tensor shapes of a GPT-style model, shared by the throughput benchmarks (no torch here).

Every benchmark that times bytes moving uses the same mix: bf16 weights of a
pre-norm GPT with fused QKV and a SwiGLU MLP, plus two fp32 Adam moments each.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    hidden: int
    ffn: int  # SwiGLU: fc1 is [2*ffn, hidden]
    layers: int
    vocab: int


def param_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    h, f = cfg.hidden, cfg.ffn
    out: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (cfg.vocab, h))]
    for i in range(cfg.layers):
        p = f"layers.{i}."
        out += [
            (p + "attn_norm.weight", (h,)),
            (p + "attn.qkv.weight", (3 * h, h)),
            (p + "attn.proj.weight", (h, h)),
            (p + "mlp_norm.weight", (h,)),
            (p + "mlp.fc1.weight", (2 * f, h)),
            (p + "mlp.fc2.weight", (h, f)),
        ]
    out.append(("final_norm.weight", (h,)))
    return out
