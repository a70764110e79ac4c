"""Writing safetensors files: the dtype names and the header, for every exporter that writes one.

A header is computed from names, dtypes and shapes alone (no data), so an exporter can write it
first and then stream the tensors' bytes in the same order (the HF export per shard, the DeepSpeed
fp32 consolidation in bounded memory).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

import torch

from ckptkit.errors import CkptkitError

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.complex64: "C64",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16",
}
"""torch dtypes and the safetensors codes the ``safetensors`` package (0.8) maps them to and from."""


def safetensors_header(tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """The header of a file holding ``(name, dtype, shape)`` tensors back to back in this order: the
    8-byte little-endian length, then the JSON (``__metadata__`` ``format: pt``) padded to 8 bytes."""
    doc: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in tensors:
        end = offset + math.prod(shape) * dtype.itemsize
        if dtype not in SAFETENSORS_DTYPES:
            raise CkptkitError(f"safetensors cannot store {str(dtype).removeprefix('torch.')} (tensor {name!r})")
        doc[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    body = json.dumps(doc, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body
