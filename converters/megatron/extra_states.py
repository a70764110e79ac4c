"""Transformer Engine ``_extra_state`` items of a ``torch_dist`` directory, in and out.

Megatron's torch_dist writes each ``_extra_state`` ShardedObject as a DCP bytes item,
``torch.save([payload])`` under the object's unique key
(``decoder.layers.self_attention.linear_qkv._extra_state/shard_<layer>_<L>``). Transformer
Engine 2.x's payload is a 1-D uint8 tensor (its FP8 state, pickled by TE); modules without FP8
state save an empty one, Megatron's local linears None. The live adapter stores a payload as the
uint8 tensor ``extra/<unique key>`` (:mod:`ckptkit.adapters.megatron.extra_state`), so:

* the import decodes each item with ``torch.load(weights_only=True)`` (a list holding a uint8
  tensor passes; TE 1.x's ``io.BytesIO`` form does not and stays in the import's ``skipped``),
  vets the payload (:func:`ckptkit.adapters.megatron.te_payload.check`: a payload naming
  anything TE's do not refuses the import, naming the file and item) and stores it, written by
  the virtual rank whose file held it; empty and None payloads are not stored;
* the export writes ``[payload]`` for every item Megatron's load asks for that the checkpoint
  holds, ``[None]`` for the rest (what ``set_extra_state`` ignores).
"""

from __future__ import annotations

import functools
import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptkit.adapters.megatron import te_payload
from ckptkit.adapters.megatron.extra_state import MAX_PAYLOAD_BYTES, PREFIX, SUFFIX, check_size

__all__ = ["PREFIX", "ImportedPayloads", "WithPayloads", "export_blob", "read_payloads"]
from ckptkit.engine.offline_writer import StoredTensor
from ckptkit.errors import ManifestError, UnsafeCheckpointError
from ckptkit.layout.box import Box, Region
from ckptkit_converters.dcp.files import DcpCheckpoint, load_blob, read_blob


@dataclass
class ImportedPayloads:
    """The payloads an import stores, per writer rank (``name``, tensor) in write order, and the DCP
    items they (or an empty payload) account for."""

    by_rank: dict[int, list[tuple[str, torch.Tensor]]] = field(default_factory=dict)
    consumed: set[str] = field(default_factory=set)

    def specs(self) -> dict[str, StoredTensor]:
        return {name: StoredTensor("uint8", (t.numel(),)) for items in self.by_rank.values() for name, t in items}

    def pieces(self, rank: int) -> list[tuple[str, Region]]:
        return [(name, Region(Box((0,), (t.numel(),)))) for name, t in self.by_rank.get(rank, [])]


def read_payloads(src: Any, ckpt: DcpCheckpoint, ranks: Mapping[str, int]) -> ImportedPayloads:
    """Every ``_extra_state`` item of the checkpoint, decoded and vetted (see the module docstring)."""
    out = ImportedPayloads()
    for fqn, item in sorted(ckpt.items.items()):
        if not fqn.split("/")[0].endswith(SUFFIX):
            continue
        where = f"{src.url}/{item.blob.file} (item {fqn!r})"
        if item.blob.length > MAX_PAYLOAD_BYTES + (1 << 20):  # torch.save's archive around the payload: ~1 KiB
            raise UnsafeCheckpointError(f"{where}: {item.blob.length} bytes; an _extra_state item holds a payload of "
                                        f"at most {MAX_PAYLOAD_BYTES} bytes")
        try:
            value = load_blob(read_blob(src, item.blob), where)
        except UnsafeCheckpointError:
            continue  # TE 1.x's io.BytesIO form (or another object): not carried, listed in skipped
        data = value[0] if isinstance(value, list) and len(value) == 1 else value
        if data is None or (isinstance(data, torch.Tensor) and data.dtype == torch.uint8 and data.numel() == 0):
            out.consumed.add(fqn)
            continue
        if not (isinstance(data, torch.Tensor) and data.dtype == torch.uint8 and data.dim() == 1):
            raise ManifestError(f"{where}: an _extra_state item holds {type(data).__name__}, expected "
                                "[uint8 tensor] (Transformer Engine 2.x's payload) or [None]")
        payload = data.contiguous()
        te_payload.check(payload.numpy().tobytes(), where)
        out.by_rank.setdefault(ranks[item.blob.file], []).append((PREFIX + fqn, payload))
        out.consumed.add(fqn)
    return out


class WithPayloads:
    """A rank's piece source followed by that rank's payloads (asked for after its chunks, in order)."""

    def __init__(self, inner: Any, payloads: list[tuple[str, torch.Tensor]]) -> None:
        self._inner = inner
        self._payloads = [t for _, t in payloads]
        self._n = len(inner)

    @property
    def bytes_read(self) -> int:
        return self._inner.bytes_read

    def __len__(self) -> int:
        return self._n + len(self._payloads)

    def __getitem__(self, ref: int) -> torch.Tensor:
        return self._inner[ref] if ref < self._n else self._payloads[ref - self._n]

    def release(self, ref: int) -> None:
        """Told once piece ``ref`` is written: the inner source's own pieces go to it (if it reuses buffers)."""
        release = getattr(self._inner, "release", None)
        if ref < self._n and release is not None:
            release(ref)

    def close(self) -> None:
        close = getattr(self._inner, "close", None)
        if close is not None:
            close()


def export_blob(view: Any, item_key: str) -> bytes:
    """What an export writes for item ``item_key``: ``torch.save([payload])`` where the checkpoint holds
    the payload, else ``torch.save([None])``."""
    name = PREFIX + item_key
    meta = view.manifest.tensors.get(name)
    if meta is None:
        return _none_list()
    where = f"{view.url}: tensor {name!r}"
    if meta.dtype != "uint8":
        raise ManifestError(f"{where} is {meta.dtype}; a payload is uint8")
    check_size(name, meta.shape, view.url)
    payload = view[name].read()
    te_payload.check(payload.numpy().tobytes(), where)  # Megatron's load hands it to TE, which unpickles it
    buf = io.BytesIO()
    torch.save([payload], buf)
    return buf.getvalue()


@functools.cache
def _none_list() -> bytes:
    """``torch.save([None])``: what Megatron saves as a linear module's ``_extra_state`` without FP8 state."""
    buf = io.BytesIO()
    torch.save([None], buf)
    return buf.getvalue()
