"""Turn a user's path or URL into a byte store.

Paths and URLs are parsed by fsspec (so ``file:///x``, ``/x`` and relative
paths mean what they mean everywhere else in the ecosystem); local ones get
the POSIX backend.
"""

from __future__ import annotations

import os
from typing import Any

from fsspec.core import split_protocol, strip_protocol

from ckptkit.errors import StorageError
from ckptkit.storage.base import ByteStore
from ckptkit.storage.local import LocalStore

LOCAL_PROTOCOLS = (None, "file", "local")


def open_store(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> ByteStore:
    """The byte store at ``url``: a local path, a ``file://`` or an ``s3://bucket/prefix`` URL."""
    text = os.fspath(url)
    protocol, _ = split_protocol(text)
    if protocol in LOCAL_PROTOCOLS:
        return LocalStore(strip_protocol(text) if protocol else text)
    if protocol in ("s3", "s3a"):
        try:
            from ckptkit.storage.s3 import S3Store
        except ImportError as exc:
            raise StorageError(f"{text}: S3 needs the s3fs package (pip install 'ckptkit[s3]'): {exc}") from None
        return S3Store(text, storage_options)
    raise StorageError(
        f"{text}: storage protocol {protocol!r} is not supported "
        "(supported: local paths, file:// and s3:// URLs)"
    )


def join_url(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}"
