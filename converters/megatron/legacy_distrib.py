"""The distributed optimizer's state of a legacy Megatron checkpoint (``distrib_optim.pt``), by parameter.

With ``--use-distributed-optimizer`` Megatron-LM's legacy save keeps only the optimizer's param groups (with
the step) in ``model_optim_rng.pt``; every (tp, pp) rank folder also gets ``distrib_optim.pt``, written by
``DistributedOptimizer.save_parameter_state`` (megatron-core 0.16, ``get_parameter_state_dp_zero``:
data-parallel rank 0 gathers every DP rank's shard)::

    {"buckets_coalesced": True,
     <grad buffer index>: {<(param dtype, grad dtype)>: {"param": fp32[N], "exp_avg": fp32[N],
                                                         "exp_avg_sq": fp32[N], "numel_unpadded": N}}}

One grad buffer per model chunk (a dense model of one dtype). A buffer lays its parameters out in reverse
module order (``_ParamAndGradBuffer``: backward order), each starting at a multiple of 64 elements from its
bucket's start; the saved tensors are the buckets' elements end to end, each bucket's end padding dropped.
Which parameter sits where is not saved, and the bucket boundaries are not either.

So the walk predicts the order, as Megatron's load does, and finds each parameter's start from the data:
the next parameter starts within 64 elements of where the last one ended, the elements between are zero in
all three states (padding), and the main copy there, cast to the weight's dtype, is the weight bit for bit.
The buffer must end where the last parameter does. Anything else is refused, naming the file, the buffer and
the parameter: moments are never handed to another parameter. Weights of one value (untrained norms) are
told apart by the order alone, as Megatron's own load tells them apart.

Refused, with ``weights_only=True`` as the way on: the form written before February 2024 (no ``buckets_coalesced``),
several grad buffers per chunk (mixed parameter dtypes, MoE experts) and param groups without one step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ckptkit.errors import ManifestError
from ckptkit_converters.megatron import files as fmt
from ckptkit_converters.megatron.legacy_state import (
    DISTRIB_FILE,
    WEIGHTS_ONLY_HINT,
    LegacyOptimizer,
    StateRef,
    number,
    parameters,
    same_bits,
)
from ckptkit_converters.megatron.bucket_walk import MAX_GAP
from ckptkit_converters.megatron.optimizer_buckets import STATES

__all__ = ["DISTRIB_FILE", "read_distributed"]

ALIGN = MAX_GAP
"""Megatron pads every parameter's start in a distributed-optimizer buffer to a multiple of 64 elements
(the torch_dist buckets' rule, :data:`.bucket_walk.MAX_GAP`), so the padding before a parameter is shorter.
The flat states are the ones the torch_dist buckets hold (:data:`.optimizer_buckets.STATES`)."""


def _step(saved: Mapping[str, Any], where: str) -> float:
    """The one step of the param groups ``DistributedOptimizer.state_dict`` keeps in the rank file."""
    inner = saved.get("optimizer")
    groups = inner.get("param_groups") if isinstance(inner, Mapping) else None
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        raise ManifestError(f"{where}: optimizer.optimizer.param_groups is not a list of param groups")
    steps = {number(g.get("step")) for g in groups if g.get("step") is not None}
    if len(steps) != 1 or None in steps:
        raise ManifestError(f"{where}: the distributed optimizer's param groups hold "
                            f"{'no step' if not steps else f'steps {sorted(map(str, steps))[:4]}'}; Megatron keeps "
                            "one step for all parameters")
    return steps.pop()  # type: ignore[return-value]


def _buffers(state: Any, chunks: int, path: str) -> dict[int, tuple[Any, dict[str, torch.Tensor]]]:
    """Each model chunk's grad buffer: (its dtype key, its three flat states), checked to be the form the
    module docstring gives."""
    if not isinstance(state, Mapping) or state.get("buckets_coalesced") is not True:
        raise ManifestError(f"{path}: not a coalesced distributed-optimizer state (no buckets_coalesced: the form "
                            "Megatron wrote before February 2024, not imported; Megatron-LM's "
                            "--ckpt-convert-update-legacy-dist-opt-format rewrites it); " + WEIGHTS_ONLY_HINT)
    keys = [k for k in state if k != "buckets_coalesced"]
    if sorted(keys, key=repr) != list(range(chunks)):
        raise ManifestError(f"{path}: grad buffers {sorted(map(repr, keys))[:6]} for {chunks} model chunk(s): one "
                            "buffer per chunk is imported (several dtypes or MoE experts are not); " + WEIGHTS_ONLY_HINT)
    out = {}
    for v in range(chunks):
        by_dtype = state[v]
        if not isinstance(by_dtype, Mapping) or len(by_dtype) != 1:
            raise ManifestError(f"{path}: grad buffer {v} is not one dtype's state")
        dtype_key, flat = next(iter(by_dtype.items()))
        if not isinstance(flat, Mapping):
            raise ManifestError(f"{path}: grad buffer {v} holds a {type(flat).__name__}, expected its states")
        tensors = {k: flat.get(k) for k in STATES}
        n = flat.get("numel_unpadded")
        for k, t in tensors.items():
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1 or t.numel() != n:
                got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ManifestError(f"{path}: grad buffer {v} state {k!r} is {got}, expected float32 "
                                    f"[{n}] (numel_unpadded)")
        out[v] = (dtype_key, tensors)
    return out


def _is_padding(tensors: Mapping[str, torch.Tensor], i: int) -> bool:
    return all(float(t[i]) == 0.0 for t in tensors.values())


def _start_of(weight: torch.Tensor, tensors: Mapping[str, torch.Tensor], pos: int) -> int | None:
    """Where ``weight`` starts at or after ``pos``: past zero padding shorter than :data:`ALIGN`, where the
    main copy is the weight; None if nowhere."""
    main, flat, n = tensors["param"], weight.reshape(-1), weight.numel()
    first = flat[:1]
    for start in range(pos, min(pos + ALIGN, main.numel() - n + 1)):
        if start > pos and not _is_padding(tensors, start - 1):
            return None
        if same_bits(main[start:start + 1].to(weight.dtype), first) and \
                same_bits(main[start:start + n].to(weight.dtype), flat):
            return start
    return None


def _walk(params: Sequence[tuple[int, str, torch.Tensor]], tensors: Mapping[str, torch.Tensor], v: int,
          path: str) -> dict[str, int]:
    """Each parameter of chunk ``v`` -> its first element in the buffer, in Megatron's (reverse module) order."""
    starts, pos = {}, 0
    for _, name, weight in reversed(params):
        if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ManifestError(f"{path}: parameter {name!r} is {weight.dtype}; the distributed optimizer keeps "
                                "main copies of bf16/fp16/fp32 weights")
        start = _start_of(weight, tensors, pos)
        if start is None:
            raise ManifestError(f"{path}: grad buffer {v}: parameter {name!r} is not where Megatron's layout puts "
                                f"it (within {ALIGN} zero elements after element {pos}, its main copy equal to the "
                                f"weight): the state is not this module's (frozen parameters, another module order?); "
                                + WEIGHTS_ONLY_HINT)
        starts[name] = start
        pos = start + weight.numel()
    left = tensors["param"].numel() - pos
    if left:
        raise ManifestError(f"{path}: grad buffer {v} holds {left} element(s) after its last parameter: "
                            "a parameter this module does not have; " + WEIGHTS_ONLY_HINT)
    return starts


def read_distributed(saved: Mapping[str, Any], chunks: Mapping[int, Mapping[str, Any]], path: str,
                     where: str) -> LegacyOptimizer:
    """The distributed optimizer of one rank folder, placed: ``saved`` is the rank file's ``optimizer``
    (param groups and step; fp16's ``grad_scaler``), ``chunks`` its module state dicts by virtual chunk,
    ``path`` the ``distrib_optim.pt`` beside it (``where``: the rank file)."""
    step = _step(saved, where)
    buffers = _buffers(fmt.load_pt(path, mmap=True), len(chunks), path)
    params = parameters(chunks)
    tensors: dict[tuple[int, str], dict[str, StateRef]] = {}
    for i, v in enumerate(sorted(chunks)):  # buffer i: the i-th model chunk's
        dtype_key, flat = buffers[i]
        starts = _walk([p for p in params if p[0] == v], flat, i, path)
        for name, start in starts.items():
            tensors[(v, name)] = {STATES[k]: StateRef(DISTRIB_FILE, (i, dtype_key, k), start) for k in STATES}
    record: dict[str, Any] = {"param_groups": list(saved["optimizer"]["param_groups"])}
    if saved.get("grad_scaler") is not None:
        record["grad_scaler"] = saved["grad_scaler"]
    return LegacyOptimizer(tensors, record, step)
