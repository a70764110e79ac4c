"""Byte stores: where checkpoint objects live. Tensor-agnostic."""

from ckptkit.storage.base import ByteStore
from ckptkit.storage.local import LocalStore
from ckptkit.storage.url import open_store

__all__ = ["ByteStore", "LocalStore", "open_store"]
