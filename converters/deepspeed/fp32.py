"""The fp32 master weights of a ckptkit DeepSpeed checkpoint as one state dict, equal to ``zero_to_fp32``'s.

DeepSpeed's ``zero_to_fp32`` rebuilds full fp32 weights from a native folder's flat partitions; here
the same dict is read from a ckptkit checkpoint by model-space views (each tensor whole, no process
group, no DeepSpeed): floating buffers cast to fp32, trainable parameters from their fp32 masters,
floating frozen ones cast (integer ones, a quantized frozen weight, as they are), tied aliases sharing one tensor, and DeepSpeed-MoE experts once per global expert.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

import ckptkit
from ckptkit.adapters.deepspeed import FP32, model_key, optim_key
from ckptkit.engine.offline_writer import ConvertResult
from ckptkit.engine.state import torch_dtype
from ckptkit.errors import OptionsError
from ckptkit.layout.box import Box
from ckptkit.options import Progress
from ckptkit.plan.reshard_plan import split_box
from ckptkit_converters.common.safetensors_out import safetensors_header
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
    for n in [*meta["buffers"], *meta.get("frozen", [])]:  # floating ones as fp32; integer ones (a quantized
        t = view[model_key(n)].read()                      # frozen weight) as they are, as export_fp32 writes them
        out[n] = t.float() if t.is_floating_point() else t
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


@dataclass(frozen=True)
class _Entry:
    """One tensor of the consolidated file: its name there, the ckptkit tensor it comes from (``lead``:
    the leading index that picks one expert of a stacked tensor), its shape and dtypes."""

    name: str
    key: str
    lead: tuple[int, ...]
    shape: tuple[int, ...]
    source: torch.dtype
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _entries(view: Any, meta: dict[str, Any]) -> list[_Entry]:
    """The tensors :func:`consolidated_fp32_state_dict` returns, as (name, source, shape), in its order;
    tied aliases are entries of their own (safetensors refuses shared memory, so they are copies)."""
    out: dict[str, _Entry] = {}

    def add(name: str, key: str, lead: tuple[int, ...] = ()) -> None:
        m = view.meta_of(key)
        source = torch_dtype(m.dtype)
        out[name] = _Entry(name, key, lead, tuple(m.shape[len(lead):]), source,
                           torch.float32 if source.is_floating_point else source)

    for b in meta["buffers"]:
        add(b, model_key(b))
    for n in meta.get("frozen", []):
        add(n, model_key(n))
    experts = meta.get("experts") or {}
    for n in meta["param_shapes"]:
        if n in experts:
            info = experts[n]
            for e in range(int(info["num_experts"])):
                add(f"{info['module']}.{e}.{info['param']}", optim_key(FP32, n), (e,))
        else:
            add(n, optim_key(FP32, n))
    for alias, name in meta.get("shared", {}).items():
        if name in out:
            out[alias] = replace(out[name], name=alias)
    return list(out.values())


def _chunks(shape: tuple[int, ...], item: int, budget: int) -> Iterator[tuple[slice, ...]]:
    """Index tuples that split a row-major tensor of ``shape`` into contiguous runs of at most ``budget``
    bytes (``item`` bytes per element, all copies of it held at once), in storage order: the reshard's
    own cut (:func:`ckptkit.plan.reshard_plan.split_box`) as slices."""
    for box in split_box(Box.full(shape), item, budget, "fp32 export"):
        yield tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))


def export_fp32(source: str | os.PathLike[str], out_file: str | os.PathLike[str], *,
                max_memory: int = 1 << 30, storage_options: dict[str, Any] | None = None,
                progress: Progress | None = None) -> ConvertResult:
    """Write :func:`consolidated_fp32_state_dict` as one safetensors file, streaming: the header is
    computed from the manifest, then every tensor is read and written in contiguous runs of at most
    ``max_memory`` bytes (source and fp32 copy together), so memory stays bounded whatever the model's
    size, where DeepSpeed's ``zero_to_fp32`` holds the whole model (and more) at once. The file
    appears only when complete (written beside it, then renamed). Tied aliases are written as copies
    (safetensors refuses tensors that share memory)."""
    if max_memory < 16:
        raise OptionsError(f"max_memory {max_memory} must hold at least one element and its fp32 copy (16 bytes)")
    t0 = time.perf_counter()
    view = ckptkit.open(source, storage_options=storage_options)
    entries = _entries(view, read_meta(view))
    header = safetensors_header((e.name, e.dtype, e.shape) for e in entries)
    total = sum(e.nbytes for e in entries)
    path = os.fspath(out_file)
    partial = f"{path}.partial-{os.getpid()}"
    read0, done = view.bytes_read, 0
    try:
        with open(partial, "wb") as f:
            f.write(header)
            for e in entries:
                item = e.source.itemsize + (e.dtype.itemsize if e.dtype != e.source else 0)
                tensor = view[e.key]
                for index in _chunks(e.shape, item, max_memory):
                    part = tensor[(*e.lead, *index)] if e.lead or index else tensor.read()
                    part = part.to(e.dtype).contiguous()
                    if part.numel():
                        f.write(memoryview(part.reshape(-1).view(torch.uint8).numpy()))
                    done += part.numel() * e.dtype.itemsize
                    del part
                    if progress is not None:
                        progress(done, total)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
    return ConvertResult(str(source), path, "safetensors", len(entries), total, view.bytes_read - read0,
                         time.perf_counter() - t0)
