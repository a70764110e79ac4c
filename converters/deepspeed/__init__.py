"""DeepSpeed ZeRO checkpoints (stages 1-3, dense and MoE), and the fp32 consolidation."""

from __future__ import annotations

import importlib
from typing import Any

# What the flat module ``ckptkit_converters.deepspeed`` offered, re-exported lazily: importing this
# package (the registry does, to list formats) imports no torch.
_WHERE = {
    "import_deepspeed": "convert",
    "export_deepspeed": "convert",
    "consolidated_fp32_state_dict": "convert",
    "export_fp32": "convert",
    "flat_layouts": "convert",
    "FlatLayout": "convert",
    "read_meta": "convert",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
