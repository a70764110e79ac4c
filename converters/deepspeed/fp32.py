"""The fp32 master weights of a ckptkit DeepSpeed checkpoint as one state dict, equal to ``zero_to_fp32``'s.

DeepSpeed's ``zero_to_fp32`` rebuilds full fp32 weights from a native folder's flat partitions; here
the same dict is read from a ckptkit checkpoint by model-space views (each tensor whole, no process
group, no DeepSpeed): floating buffers cast to fp32, trainable parameters from their fp32 masters,
frozen ones cast, tied aliases sharing one tensor, and DeepSpeed-MoE experts once per global expert.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

import ckptkit
from ckptkit.adapters.deepspeed import FP32, model_key, optim_key
from ckptkit.engine.offline_writer import ConvertResult
from ckptkit_converters.deepspeed.record import read_meta


def consolidated_fp32_state_dict(source: str | os.PathLike[str], *,
                                 storage_options: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The full fp32 model from a ckptkit DeepSpeed checkpoint, as DeepSpeed's ``zero_to_fp32`` gives it:
    floating buffers cast to fp32, every trainable parameter from its fp32 master, tied aliases shared.
    DeepSpeed-MoE experts come out once per global expert under the names a model built at ep=1 has
    (``<moe>.deepspeed_moe.experts.deepspeed_experts.{e}.<param>``, DeepSpeed's per-expert-file names), so
    the dict loads into it with ``load_state_dict``; every element of every expert must be stored."""
    view = ckptkit.open(source, storage_options=storage_options)
    meta = read_meta(view)
    out: dict[str, torch.Tensor] = {}
    for b in meta["buffers"]:
        t = view[model_key(b)].read()
        out[b] = t.float() if t.is_floating_point() else t
    for n in meta.get("frozen", []):
        out[n] = view[model_key(n)].read().float()
    experts = meta.get("experts") or {}
    for n in meta["param_shapes"]:
        t = view[optim_key(FP32, n)].read()  # a missing expert piece: CoverageError naming the expert
        if n in experts:  # a stacked routed-expert tensor: one entry per global expert, as an ep=1 model names it
            info = experts[n]
            for e in range(int(info["num_experts"])):
                out[f"{info['module']}.{e}.{info['param']}"] = t[e].clone()
        else:
            out[n] = t
    for alias, name in meta.get("shared", {}).items():
        if name in out:
            out[alias] = out[name]
    return out


def export_fp32(source: str | os.PathLike[str], out_file: str | os.PathLike[str], *,
                storage_options: dict[str, Any] | None = None) -> ConvertResult:
    """Write :func:`consolidated_fp32_state_dict` as a safetensors file (tied aliases as copies:
    safetensors refuses tensors that share memory)."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    sd = consolidated_fp32_state_dict(source, storage_options=storage_options)
    seen: set[int] = set()
    flat = {}
    for k, v in sd.items():
        flat[k] = v.clone() if id(v) in seen else v.contiguous()
        seen.add(id(v))
    save_file(flat, os.fspath(out_file))
    return ConvertResult(str(source), os.fspath(out_file), "safetensors", len(flat),
                         sum(v.numel() * v.element_size() for v in flat.values()), 0, time.perf_counter() - t0)
