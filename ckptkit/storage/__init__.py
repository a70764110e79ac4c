"""Byte stores: where checkpoint objects live. Tensor-agnostic; the contract is ckptkit/storage/base.py."""

from ckptkit.storage.base import ByteStore
from ckptkit.storage.local import LocalStore
from ckptkit.storage.tiered import TieredStore
from ckptkit.storage.url import open_store

__all__ = ["ByteStore", "LocalStore", "TieredStore", "open_store"]
