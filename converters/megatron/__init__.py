"""Megatron-core checkpoints: torch_dist directories and legacy ``model_optim_rng.pt`` folders."""

from __future__ import annotations

import importlib
from typing import Any

# What the flat module ``ckptkit_converters.megatron`` offered, re-exported lazily: importing this
# package (the registry does, to list formats) imports no torch.
_WHERE = {
    "import_torch_dist": "importer",
    "import_legacy": "importer",
    "resolve_vocab": "importer",
    "read_torch_dist": "importer",
    "export_torch_dist": "exporter",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
