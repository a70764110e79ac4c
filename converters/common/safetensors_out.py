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

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def safetensors_header(tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """The header of a file holding ``(name, dtype, shape)`` tensors back to back in this order: the
    8-byte little-endian length, then the JSON (``__metadata__`` ``format: pt``) padded to 8 bytes."""
    doc: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in tensors:
        end = offset + math.prod(shape) * dtype.itemsize
        doc[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    body = json.dumps(doc, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body
