"""torch.distributed.checkpoint directories (torchtitan, plain ``dcp.save``)."""

from __future__ import annotations

import importlib
from typing import Any

# What the flat module ``ckptkit_converters.dcp`` offered, re-exported lazily: importing this
# package (the registry does, to list formats) imports no torch.
_WHERE = {
    "import_dcp": "convert",
    "export_dcp": "convert",
    "DcpImportOptions": "convert",
    "DcpExportOptions": "convert",
    "DcpConvertResult": "convert",
    "is_dcp_checkpoint": "convert",
    "read_dcp_metadata": "convert",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
