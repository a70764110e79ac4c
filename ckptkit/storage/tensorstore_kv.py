"""tensorstore's kvstore as the bulk I/O engine of a byte store.

Wraps a regular store (local or S3) and moves the large data through
tensorstore (its ``file`` or ``s3`` kvstore driver): whole-object writes and
ranged reads. Everything else — small metadata objects, listing, deletion and
the atomic commit — stays with the wrapped store, whose semantics the commit
protocol relies on.

Selected with ``storage_options={"io_engine": "tensorstore"}``; which engine
is the default per URL scheme is decided by measurement (docs/benchmarks.md).
Note that tensorstore takes a write's value as one ``bytes`` object, so
writing costs one extra copy of each data object.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from ckptkit.errors import CorruptCheckpointError, StorageError
from ckptkit.storage.base import ByteStore
from ckptkit.storage.local import LocalStore

S3_SINGLE_PUT_LIMIT = 5 << 30  # S3's limit for one PUT; larger objects go through the wrapped store


def kvstore_spec(store: ByteStore) -> dict[str, Any]:
    if isinstance(store, LocalStore):
        return {"driver": "file", "path": store.root.rstrip("/") + "/"}
    from ckptkit.storage.s3 import S3Store

    if isinstance(store, S3Store):
        spec: dict[str, Any] = {"driver": "s3", "bucket": store.bucket, "path": (store.prefix + "/") if store.prefix else ""}
        endpoint = (store._storage_options or {}).get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            spec["endpoint"] = endpoint
        spec["aws_region"] = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1"
        return spec
    raise StorageError(f"{store.url}: no tensorstore kvstore driver for this store")


class TensorstoreStore(ByteStore):
    """``base`` for metadata and commits, tensorstore for data objects."""

    streams_writes = False  # every chunk is held (then joined into the one value tensorstore takes)

    def __reduce__(self) -> tuple[Any, tuple[ByteStore]]:
        """Sent to a writer process (``AsyncOptions(executor="process")``) as its wrapped store, and opened
        again there: the tensorstore handles cannot be pickled, and the request carrying them was dropped
        by the queue's feeder thread while the save waited for its answer forever (a hunt, 2026-12-06)."""
        return TensorstoreStore, (self.base,)

    def __init__(self, base: ByteStore) -> None:
        import tensorstore as ts

        self.base = base
        self.url = base.url
        self._ts = ts
        spec = kvstore_spec(base)
        self._kv = ts.KvStore.open(spec).result()
        self._single_put_limit = S3_SINGLE_PUT_LIMIT if spec["driver"] == "s3" else None
        # tensorstore's file driver would follow any symlink and block opening a FIFO: the wrapped
        # store's checks (a regular file inside the root) run before it touches a path
        self._precheck = spec["driver"] == "file"

    def child(self, name: str) -> TensorstoreStore:
        return TensorstoreStore(self.base.child(name))

    def write_object(self, key: str, chunks: Iterable[memoryview | bytes]) -> int:
        views = [memoryview(c).cast("B") for c in chunks]  # no copy yet
        if self._single_put_limit is not None and sum(len(v) for v in views) > self._single_put_limit:
            # tensorstore's s3 driver sends an object as one PUT, which S3 caps at 5 GiB:
            # the wrapped store uploads it in parts instead
            return self.base.write_object(key, views)
        data = b"".join(views)  # the one copy tensorstore's API needs (it takes a bytes value)
        try:
            self._kv.write(key, data).result()
        except Exception as exc:  # tensorstore raises ValueError / OSError-like errors
            raise StorageError(f"writing {self.url}/{key} through tensorstore: {exc}") from exc
        return len(data)

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        self.read_into_vectored(key, offset, [out])

    def read_into_vectored(self, key: str, offset: int, buffers: list[memoryview]) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        total = sum(len(v) for v in views)
        if not total:
            return
        if self._precheck:
            self.base.checked_size(key)
        try:
            result = self._kv.read(key, byte_range=slice(offset, offset + total)).result()
        except Exception as exc:
            if "out_of_range" in str(exc).lower().replace(" ", "_"):
                raise CorruptCheckpointError(f"object {self.url}/{key} is truncated: needed bytes up to {offset + total}") from None
            raise StorageError(f"reading {self.url}/{key} through tensorstore: {exc}") from exc
        if result.state == "missing":
            raise CorruptCheckpointError(f"object {self.url}/{key} is missing")
        data = memoryview(result.value)
        if len(data) != total:
            raise CorruptCheckpointError(f"object {self.url}/{key} is truncated: needed bytes up to {offset + total}")
        pos = 0
        for v in views:
            v[:] = data[pos:pos + len(v)]
            pos += len(v)

    # metadata, listing, deletion and the commit: the wrapped store's
    def put_bytes(self, key: str, data: bytes) -> None:
        self.base.put_bytes(key, data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self.base.put_if_absent(key, data)

    def read_bytes(self, key: str, limit: int | None = None) -> bytes:
        return self.base.read_bytes(key, limit)

    def size(self, key: str) -> int | None:
        return self.base.size(key)

    def list_keys(self, prefix: str = "") -> list[str]:
        return self.base.list_keys(prefix)

    def list_children(self) -> list[str]:
        return self.base.list_children()

    def delete(self, key: str) -> None:
        self.base.delete(key)

    def delete_all(self) -> None:
        self.base.delete_all()

    def prune_empty(self) -> None:
        self.base.prune_empty()

    def checked_size(self, key: str) -> int:
        return self.base.checked_size(key)

    def is_dir(self) -> bool:
        return self.base.is_dir()

    @property
    def fallback(self) -> ByteStore | None:
        return self.base.fallback
