"""Which tensors of a torchtitan model are routed experts, so their rules carry the expert axis.

torchtitan 0.3's MoE models (qwen3 MoE, deepseek_v3, gpt_oss, kimi_k2_7) keep routed experts in
``GroupedExperts`` modules whose parameters stack the experts along axis 0 (``w1_EFD``, ``w2_EDF``,
``w3_EFD``: the suffix names the axes, ``E`` first). With expert parallelism on, the DTensor's
``ep`` mesh dimension already says so; at ep = 1 the experts are plain FSDP (and TP) DTensors,
and only the module tells them apart from dense weights. The manager wraps these parameters, and
their optimizer moments, in :class:`ckptkit.Experts` so every save records the expert axis,
whatever the EP degree (docs/moe.md, docs/torchtitan.md).

The router, its ``expert_bias_E`` buffer and shared experts are dense: they are replicated over
EP, as Megatron's are, and are not marked.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from ckptkit.engine.state import Experts

EXPERT_MODULES = frozenset({"GroupedExperts"})


def expert_axes(model_parts: Iterable[nn.Module]) -> dict[str, int]:
    """``{parameter FQN: expert axis}`` of every routed-expert parameter (FQNs as the model's
    ``state_dict`` names them; the class is matched by name, so subclasses and wrappers of
    torchtitan's ``GroupedExperts`` that keep the name are found without importing torchtitan)."""
    out: dict[str, int] = {}
    for part in model_parts:
        for name, module in part.named_modules():
            if not any(cls.__name__ in EXPERT_MODULES for cls in type(module).__mro__):
                continue
            experts = getattr(module, "num_experts", None)
            for pname, param in module.named_parameters(recurse=False):
                if param.dim() >= 2 and (experts is None or param.shape[0] == experts):
                    out[_clean(f"{name}.{pname}" if name else pname)] = 0
    return out


def _clean(fqn: str) -> str:
    """The FQN without wrapper segments that ``state_dict`` drops (torch.compile, activation checkpointing)."""
    return ".".join(p for p in fqn.split(".") if p not in ("_orig_mod", "_checkpoint_wrapped_module"))


def mark_model(state: Mapping[str, Any], axes: Mapping[str, int]) -> dict[str, Any]:
    """The model state dict with expert tensors wrapped (other entries as they are)."""
    return {k: Experts(v, axes[k]) if k in axes and hasattr(v, "dim") and v.dim() > axes[k] else v
            for k, v in state.items()}


def mark_optimizer(state: Mapping[str, Any], axes: Mapping[str, int]) -> dict[str, Any]:
    """torchtitan's flattened optimizer state (``state.<fqn>.<moment>``) with the moments of expert
    parameters wrapped: they have the parameter's shape and layout."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        fqn = _param_of(key)
        axis = axes.get(fqn) if fqn is not None else None
        ok = axis is not None and hasattr(value, "dim") and value.dim() > axis
        out[key] = Experts(value, axis) if ok else value  # type: ignore[arg-type]
    return out


def _param_of(key: str) -> str | None:
    if not key.startswith("state."):
        return None
    head, _, _moment = key[len("state."):].rpartition(".")
    return head or None
