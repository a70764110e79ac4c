"""Names a format's package offers, loaded from the module that does each job on first use.

A format package's ``__init__`` is imported whenever formats are listed (the registry, ``ckptkit
--help``), and its import and export modules import torch. So the package names its public
functions here and each is imported only when asked for — ``from ckptkit_converters.dcp import
import_dcp`` still works, and listing formats stays cheap.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``name`` -> ``package.<where[name]>.name``, cached."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
