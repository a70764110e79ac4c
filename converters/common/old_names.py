"""The flat module names of ckptkit 0.x's converters, kept importable for one release.

Until the converters' house (docs/architecture.md) every format lived in one flat folder
(``ckptkit_converters.hf_safetensors``, ``ckptkit_converters.megatron_names``, ...). Users' scripts
import some of those names, and the public API is a promise: each old name still imports, as the
module it became, with a :class:`DeprecationWarning` naming the new one. Remove after one release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

PACKAGE = "ckptkit_converters"

MOVED: dict[str, str] = {
    "source_paths": "common.source_paths",
    "safe_unpickle": "common.safe_unpickle",
    "megatron_format": "megatron.files",
    "megatron_names": "megatron.names",
    "megatron_export": "megatron.exporter",
    "deepspeed_format": "deepspeed.files",
    "deepspeed_moe": "deepspeed.moe",
    "deepspeed_expp": "deepspeed.expp",
    "dcp_format": "dcp.files",
    "dcp_keys": "dcp.keys",
    "hf_families": "hf.families",
    "hf_mapping": "hf.mapping",
    "hf_files": "hf.files",
    "hf_expect": "hf.expect",
    "hf_import": "hf.importer",
    "hf_safetensors": "hf.exporter",
    "zarr_layout": "zarr.layout",
    "zarr_io": "zarr.convert",
}
"""Old flat module -> its module in the format's package. (``megatron``, ``deepspeed`` and ``dcp``
kept their names: they are the packages now, and re-export what the old modules offered.)"""


class _Loader(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        return None


class OldNameFinder(importlib.abc.MetaPathFinder):
    """Resolves ``ckptkit_converters.<old>`` to the module it moved to, warning once per import."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        pkg, _, leaf = fullname.rpartition(".")
        if pkg != PACKAGE or leaf not in MOVED:
            return None
        new = f"{PACKAGE}.{MOVED[leaf]}"
        warnings.warn(f"{fullname} moved to {new}; the old name is removed in the next release",
                      DeprecationWarning, stacklevel=2)
        return importlib.util.spec_from_loader(fullname, _Loader(new))


def install() -> None:
    if not any(isinstance(f, OldNameFinder) for f in sys.meta_path):
        sys.meta_path.append(OldNameFinder())
