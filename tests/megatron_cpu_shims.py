"""Test-only shims that let Megatron-core 0.16 train on CPU (gloo).

Megatron-core assumes CUDA in a few places that have nothing to do with
checkpointing: the current device, ``torch.cuda.synchronize``, the CUDA RNG
tracker, ``device="cuda"`` factory calls in the pipeline schedules, and the
distributed optimizer's dispatch on ``param.type()`` being a
``torch.cuda.*Tensor`` name, and ``.cuda()`` on the tied output weight. These shims redirect exactly those to the CPU so
the tests can run a real Megatron model, optimizer and 1F1B schedule on the
CPU-only machines CI has. They live in tests/ on purpose: ckptkit's library
code never patches a framework.

``install("meta")`` sends the same calls to the meta device instead: a model,
its DDP buffers and its distributed optimizer are then built without memory,
for checking the declarations of every rank of a large job on one machine
(tests/scale_megatron.py); such a model does not run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_installed: str | None = None


class _CudaToCpu(TorchFunctionMode):
    """Rewrite ``device="cuda"`` (or ``cuda:N``) arguments of tensor factories to the CPU (or ``device``)."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        dev = kwargs.get("device")
        if dev is not None and ("cuda" in str(dev) or isinstance(dev, int)):
            kwargs["device"] = self.device
        return func(*args, **kwargs)


def _cuda_type_name(orig: Any) -> Any:
    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        if not args and not kwargs and isinstance(out, str) and out.startswith("torch.") and not out.startswith("torch.cuda."):
            return "torch.cuda." + out.removeprefix("torch.").removeprefix("meta.")
        return out

    return type_


def install(device: str = "cpu") -> None:
    """Install the shims in this process (idempotent), redirecting CUDA to ``device`` ("cpu" or "meta")."""
    global _installed
    if _installed is not None:
        if _installed != device:
            raise RuntimeError(f"Megatron shims already installed for {_installed!r}, not {device!r}")
        return
    _installed = device
    torch.cuda.current_device = lambda: device  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda: None  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: None  # type: ignore[assignment]
    torch.Tensor.type = _cuda_type_name(torch.Tensor.type)  # type: ignore[method-assign]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]  # tied embeddings at pp > 1

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # without Transformer Engine the router's fast path is undefined
        moe_utils.te_general_gemm = None
    _CudaToCpu(device).__enter__()  # stays active for the life of the process
