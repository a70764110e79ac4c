"""A node-local tier in front of an object store.

Writes go to node-local disk first (durable on the node quickly), then to
the object store; the object store's commit decides, so a checkpoint exists
only once it is complete in the bucket. Reads prefer the local copy of an
object when it is there and long enough, and fall back to the bucket; every
byte is still verified against the checksums in the (bucket's) index, and a
range that fails them is read again from :attr:`TieredStore.fallback` (the
bucket), so a stale or damaged local copy can never pass for the checkpoint.

Which keys are *authoritative* — live only in the bucket, read only from it,
created by its ``put_if_absent`` — is the caller's to say (``remote_only``,
the manifest for checkpoints): this module knows nothing of the layout.

On a multi-node job each node's local tier holds only what that node's ranks
wrote, so a same-layout restart on the same nodes reads mostly from local
disk and a resharded or moved restart reads from the bucket.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Iterator

from ckptkit.errors import CheckpointNotFoundError, CkptkitError, UnsafePathError
from ckptkit.storage.base import ByteStore

log = logging.getLogger("ckptkit")
_COPY_CHUNK = 64 << 20

def run_cache_name(remote_url: str) -> str:
    """The folder under ``local_dir`` holding one run's local copies: named by the run's URL, so runs (and
    whatever else lives in ``local_dir``: an older run saved there directly) never share step folders.
    Until 2026-12-06 step folders sat directly under ``local_dir``, and one run's housekeeping deleted
    another's committed checkpoints and its saves in flight (found by a hunt)."""
    return f".ckptkit-tier-{hashlib.sha256(remote_url.encode()).hexdigest()[:16]}"


class TieredStore(ByteStore):
    """``local`` (node disk) in front of ``remote`` (the bucket); ``remote`` is the truth.

    ``remote_only``: the authoritative keys, relative to this store's root and to every
    :meth:`child`'s (it is passed on): never written to or read from ``local``, nor listed from it.
    An entry ending in ``/`` names a prefix: every key under it (the run's incident log and
    progress marker, read leases: objects that change and that no checksum covers, which a local
    copy left by another run at the same path, or by this run on another node, would have passed
    off as the truth; 2026-12-06).
    """

    def __init__(self, local: ByteStore, remote: ByteStore, remote_only: Iterable[str]) -> None:
        self.local = local
        self.remote = remote
        self.remote_only = frozenset(remote_only)
        self._prefixes = tuple(k for k in self.remote_only if k.endswith("/"))
        self.url = remote.url
        # the caller's chunks go to the local store only (the bucket gets them read back from disk)
        self.streams_writes = local.streams_writes

    def child(self, name: str) -> TieredStore:
        return TieredStore(self.local.child(name), self.remote.child(name), self.remote_only)

    @property
    def fallback(self) -> ByteStore:
        """The bucket: a range whose local copy failed its checksums is read from there."""
        return self.remote

    def _authoritative(self, key: str) -> bool:
        return key in self.remote_only or key.startswith(self._prefixes)

    # ------------------------------------------------------------- writing
    def write_object(self, key: str, chunks: Iterable[memoryview | bytes]) -> int:
        if self._authoritative(key):
            # straight to the bucket; copied first if the bucket holds chunks, so this store keeps
            # the streaming promise it made on the local store's behalf
            return self.remote.write_object(key, chunks if self.remote.streams_writes else (bytes(c) for c in chunks))
        n = self.local.write_object(key, chunks)
        self.remote.write_object(key, self._local_chunks(key, n))
        return n

    def _local_chunks(self, key: str, size: int) -> Iterator[memoryview]:
        pos = 0
        while pos < size:
            buf = bytearray(min(_COPY_CHUNK, size - pos))
            self.local.read_into(key, pos, memoryview(buf))
            pos += len(buf)
            yield memoryview(buf)

    def put_bytes(self, key: str, data: bytes) -> None:
        if not self._authoritative(key):
            self.local.put_bytes(key, data)
        self.remote.put_bytes(key, data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if not self.remote.put_if_absent(key, data):  # the bucket decides the commit
            return False
        if self._authoritative(key):
            return True
        try:
            self.local.put_bytes(key, data)
        except (CkptkitError, OSError) as exc:
            log.warning("could not keep a local copy of %s: %s", key, exc)
        return True

    # ------------------------------------------------------------- reading
    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        self.read_into_vectored(key, offset, [out])

    def read_into_vectored(self, key: str, offset: int, buffers: list[memoryview]) -> None:
        if not self._authoritative(key):
            total = sum(len(memoryview(b).cast("B")) for b in buffers)
            try:  # a local copy that is short, missing or refused (not a regular file, a link out) is skipped
                size = self.local.size(key)
                if size is not None and size >= offset + total:
                    self.local.read_into_vectored(key, offset, buffers)
                    return
            except (CkptkitError, OSError) as exc:
                log.warning("local copy of %s unreadable (%s); reading it from %s", key, exc, self.remote.url)
        self.remote.read_into_vectored(key, offset, buffers)

    def read_bytes(self, key: str, limit: int | None = None) -> bytes:
        if self._authoritative(key):
            return self.remote.read_bytes(key, limit)
        try:
            return self.local.read_bytes(key, limit)
        except CheckpointNotFoundError:
            pass
        except (CkptkitError, OSError) as exc:  # a damaged, refused or oversized local copy: the bucket's
            log.warning("local copy of %s unreadable (%s); reading it from %s", key, exc, self.remote.url)
        return self.remote.read_bytes(key, limit)

    def size(self, key: str) -> int | None:
        return self.remote.size(key)

    # ------------------------------------------------------ listing, deletion
    def list_keys(self, prefix: str = "") -> list[str]:
        remote = set(self.remote.list_keys(prefix))
        if self._authoritative(prefix.rstrip("/") + "/"):
            return sorted(remote)
        return sorted(remote | {k for k in self.local.list_keys(prefix) if not self._authoritative(k)})

    def list_children(self) -> list[str]:
        local = {c for c in self.local.list_children() if not self._authoritative(c + "/") and c not in self.remote_only}
        return sorted(set(self.remote.list_children()) | local)

    def delete(self, key: str) -> None:
        self.remote.delete(key)
        if self._authoritative(key):  # never written locally: a local one is not this tier's
            return
        try:
            self.local.delete(key)
        except UnsafePathError as exc:  # a local folder linked elsewhere: the cache's copy stays, the bucket's went
            log.warning("not deleting the local copy of %s: %s", key, exc)

    def delete_all(self) -> None:
        self.remote.delete_all()
        self.local.delete_all()

    def prune_empty(self) -> None:
        self.remote.prune_empty()
        self.local.prune_empty()

    def is_dir(self) -> bool:
        return self.remote.is_dir() or self.local.is_dir()
