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
# "native": ckptkit's own POSIX / s3fs paths; "tensorstore": tensorstore's kvstore moves
# the data objects (see storage/tensorstore_kv.py). Native is the default for local files and S3:
# measured by benchmarks/bench_s3.py, see docs/benchmarks.md ("Which engine, per scheme").
ENGINES = ("native", "tensorstore")
DEFAULT_ENGINE = "native"


def open_store(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> ByteStore:
    """The byte store at ``url``: a local path, a ``file://`` or an ``s3://bucket/prefix`` URL."""
    text = os.fspath(url)
    options = dict(storage_options or {})
    engine = options.pop("io_engine", DEFAULT_ENGINE)
    if engine not in ENGINES:
        raise StorageError(f"{text}: unknown io_engine {engine!r} (choose from {', '.join(ENGINES)})")
    store = _base_store(text, options)
    if engine == "tensorstore":
        from ckptkit.storage.tensorstore_kv import TensorstoreStore

        return TensorstoreStore(store)
    return store


def _base_store(text: str, options: dict[str, Any]) -> ByteStore:
    protocol, _ = split_protocol(text)
    if protocol in LOCAL_PROTOCOLS:
        return LocalStore(strip_protocol(text) if protocol else text)
    if protocol in ("s3", "s3a"):
        try:
            from ckptkit.storage.s3 import S3Store
        except ImportError as exc:
            raise StorageError(f"{text}: S3 needs the s3fs package (pip install 'ckptkit[s3]'): {exc}") from None
        return S3Store(text, options)
    raise StorageError(
        f"{text}: storage protocol {protocol!r} is not supported "
        "(supported: local paths, file:// and s3:// URLs)"
    )


def join_url(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}"


def overlaps(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether ``a`` and ``b`` are one folder or one holds the other: what a command writing ``b``
    from ``a`` must refuse (it writes into its own source, and removes what it wrote on failure).
    Local paths are compared once every link is resolved (a link to the source, or a relative path
    with ``..``, named the same folder by another spelling and passed a plain string comparison);
    object-store URLs by their text."""
    def canonical(url: str | os.PathLike[str]) -> str:
        text = os.fspath(url)
        protocol, _ = split_protocol(text)
        if protocol in LOCAL_PROTOCOLS:
            return os.path.realpath(strip_protocol(text) if protocol else text).rstrip("/") or "/"
        # by text: fsspec's strip_protocol imports the protocol's filesystem, and one not installed (gs://
        # without gcsfs) raised ImportError here, before the command could say the protocol is not supported
        return f"{protocol}://{text.split('://', 1)[-1].rstrip('/')}"

    x, y = canonical(a), canonical(b)
    return x == y or y.startswith(x.rstrip("/") + "/") or x.startswith(y.rstrip("/") + "/")
