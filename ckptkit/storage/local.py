"""The local-filesystem byte store.

Large objects are written with plain ``write`` calls straight from the
caller's buffers and fsynced; reads use ``preadv`` into the caller's buffers,
so a same-layout load lands bytes in the destination tensors without an
intermediate copy. The commit uses ``link(2)`` of a fully written, fsynced
temporary file: it fails if the target exists, so it is an atomic
put-if-absent, and readers never observe a partial manifest.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import uuid
from collections.abc import Iterable

from ckptkit.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from ckptkit.storage.base import ByteStore


_WRITEBACK_EVERY = 64 << 20
_sync_file_range = getattr(os, "sync_file_range", None)
_SYNC_FILE_RANGE_WRITE = getattr(os, "SYNC_FILE_RANGE_WRITE", 2)
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024


def _storage_error(exc: OSError, what: str) -> StorageError:
    reason = {
        errno.ENOSPC: "no space left on device",
        errno.EACCES: "permission denied",
        errno.EROFS: "read-only file system",
        errno.EDQUOT: "disk quota exceeded",
    }.get(exc.errno or 0, exc.strerror or str(exc))
    return StorageError(f"{what}: {reason}")


class LocalStore(ByteStore):
    streams_writes = True  # plain write(2) of each chunk, in order

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/")) if key else self.root

    def child(self, name: str) -> LocalStore:
        return LocalStore(self._path(name))

    def _make_parent(self, path: str) -> None:
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            os.makedirs(parent, exist_ok=True)
            _fsync_dir(os.path.dirname(parent))

    def write_object(self, key: str, chunks: Iterable[memoryview | bytes]) -> int:
        path = self._path(key)
        try:
            self._make_parent(path)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                total = 0
                flushed = 0
                for chunk in chunks:
                    view = memoryview(chunk).cast("B")
                    while view:
                        n = os.write(fd, view)
                        total += n
                        view = view[n:]
                    if total - flushed >= _WRITEBACK_EVERY and _sync_file_range is not None:
                        # start writeback of what is written so far, so the final fsync
                        # has little left to flush (the disk works while we produce more)
                        _sync_file_range(fd, flushed, total - flushed, _SYNC_FILE_RANGE_WRITE)
                        flushed = total
                os.fsync(fd)
            finally:
                os.close(fd)
            _fsync_dir(os.path.dirname(path))
            return total
        except OSError as exc:
            raise _storage_error(exc, f"writing {path}") from exc

    def put_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = _temp_name(path)
        try:
            self._make_parent(path)
            _write_durable(tmp, data)
            os.replace(tmp, path)
            _fsync_dir(os.path.dirname(path))
        except OSError as exc:
            _remove_quietly(tmp)
            raise _storage_error(exc, f"writing {path}") from exc

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        tmp = _temp_name(path)
        try:
            self._make_parent(path)
            _write_durable(tmp, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                _remove_quietly(tmp)
            _fsync_dir(os.path.dirname(path))
            return True
        except OSError as exc:
            _remove_quietly(tmp)
            raise _storage_error(exc, f"committing {path}") from exc

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        self.read_into_vectored(key, offset, [out])

    def read_into_vectored(self, key: str, offset: int, buffers: list[memoryview]) -> None:
        path = self._path(key)
        views = [memoryview(b).cast("B") for b in buffers if len(b)]
        total = sum(len(v) for v in views)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"object {path} is missing") from None
        except OSError as exc:
            raise _storage_error(exc, f"reading {path}") from exc
        try:
            pos = offset
            while views:
                n = os.preadv(fd, views[:_IOV_MAX], pos)
                if n == 0:
                    raise CorruptCheckpointError(
                        f"object {path} is truncated: needed bytes up to {offset + total}, file ends at {pos}"
                    )
                pos += n
                while views and n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                if n:
                    views[0] = views[0][n:]
        except OSError as exc:
            raise _storage_error(exc, f"reading {path}") from exc
        finally:
            os.close(fd)

    def read_bytes(self, key: str) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointNotFoundError(f"{path} does not exist") from None
        except IsADirectoryError:
            raise CheckpointNotFoundError(f"{path} is a directory, not a file") from None
        except OSError as exc:
            raise _storage_error(exc, f"reading {path}") from exc

    def size(self, key: str) -> int | None:
        path = self._path(key)
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise _storage_error(exc, f"inspecting {path}") from exc
        return None if stat.S_ISDIR(st.st_mode) else st.st_size

    def list_keys(self, prefix: str = "") -> list[str]:
        base = self._path(prefix)
        out = []
        if os.path.isfile(base):
            return [prefix]
        for dirpath, _, files in os.walk(base):
            rel = os.path.relpath(dirpath, self.root)
            for f in files:
                out.append(f if rel == "." else f"{rel.replace(os.sep, '/')}/{f}")
        return sorted(out)

    def list_children(self) -> list[str]:
        try:
            return sorted(os.listdir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise _storage_error(exc, f"listing {self.root}") from exc

    def delete(self, key: str) -> None:
        _remove_quietly(self._path(key))

    def delete_all(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def is_dir(self) -> bool:
        return os.path.isdir(self.root)


def _temp_name(path: str) -> str:
    # unique per writer (process, thread, call): concurrent commits must not share a temporary
    return f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _write_durable(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
