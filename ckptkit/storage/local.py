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
import logging
import os
import shutil
import stat
import uuid
from collections.abc import Iterable

from ckptkit.errors import (
    CheckpointNotFoundError,
    CkptkitError,
    CorruptCheckpointError,
    StorageError,
    TooLargeError,
    UnsafePathError,
)
from ckptkit.storage.base import ByteStore, too_large

log = logging.getLogger("ckptkit")


_WRITEBACK_EVERY = 64 << 20
_sync_file_range = getattr(os, "sync_file_range", None)
_SYNC_FILE_RANGE_WRITE = getattr(os, "SYNC_FILE_RANGE_WRITE", 2)
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024
# reads never block on a FIFO's open, never follow a link put in place of the resolved path
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_READ_CHUNK = 16 << 20
_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISLNK, "a symlink that does not resolve (a loop)"),
)


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

    def __init__(self, root: str, *, anchor: str | None = None) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root
        # the folder the store was opened at (its children keep it): nothing outside it is ever deleted
        self._anchor = anchor if anchor is not None else self.root

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/")) if key else self.root

    def child(self, name: str) -> LocalStore:
        return LocalStore(self._path(name), anchor=self._anchor)

    def _deletable(self, path: str) -> bool:
        """Whether ``path`` resolves inside the folder this store was opened at. A child folder that is a
        link elsewhere (a step folder replaced by a link to an archive) must never have its target's
        files deleted: retention and gc did, manifest included (found by a hunt, 2026-12-06)."""
        anchor = os.path.realpath(self._anchor)
        real = os.path.realpath(path)
        return real == anchor or real.startswith(anchor.rstrip(os.sep) + os.sep)

    def _write_path(self, key: str) -> str:
        """The path to write or delete ``key`` at; UnsafePathError for a key that would leave the root.

        Lexical, before anything is created: a writer's keys are its own (the engine names its
        objects), so a ``..`` or absolute part is a bug to refuse, never a path to follow.
        """
        parts = key.split("/")
        if key.startswith("/") or ".." in parts:
            raise UnsafePathError(f"key {key!r} is not a relative path inside the store's root {self.root}")
        return os.path.join(self.root, *parts) if key else self.root

    def _make_parent(self, path: str) -> None:
        """Create the missing directories above ``path``, each made durable in its own parent.

        A new object is only as durable as every directory entry that leads to it: each level
        created here is fsynced into the level above (not only the deepest one).
        """
        parent = os.path.dirname(path)
        if os.path.isdir(parent):
            return
        missing = []
        while parent and not os.path.isdir(parent):
            missing.append(parent)
            up = os.path.dirname(parent)
            if up == parent:
                break
            parent = up
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                if not os.path.isdir(d):
                    raise
            _fsync_dir(os.path.dirname(d))

    def _open_new(self, path: str) -> tuple[int, bool]:
        """The file descriptor to write a new object at ``path`` through, and whether it must be cut
        to the written length afterwards (a file reused rather than made empty: the memory tier's
        :class:`~ckptkit.memory.spares.RecyclingStore`)."""
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), False

    def write_object(self, key: str, chunks: Iterable[memoryview | bytes]) -> int:
        path = self._write_path(key)
        try:
            self._make_parent(path)
            fd, cut = self._open_new(path)
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
                if cut:
                    os.ftruncate(fd, total)
                os.fsync(fd)
            finally:
                os.close(fd)
            _fsync_dir(os.path.dirname(path))
            return total
        except OSError as exc:
            raise _storage_error(exc, f"writing {path}") from exc

    def put_bytes(self, key: str, data: bytes) -> None:
        path = self._write_path(key)
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
        path = self._write_path(key)
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

    # ----------------------------------------------------------------- reading
    # Every read path resolves the key, refuses what lies outside the root, and opens only
    # regular files: the folder may be damaged or hostile (docs/trust.md), and a FIFO, a device
    # or a symlink to /dev/zero where an object should be must fail clearly, never hang or
    # stream forever.

    def _resolve(self, key: str) -> str:
        """The real path of ``key``; UnsafePathError if it resolves outside the store's root.

        Symlinks are followed only while they stay inside ``realpath(root)`` (the root itself may
        be a link): a checkpoint may link its own objects, but a ``manifest.json`` that points at
        ``/etc/passwd`` must not be read. The check runs before anything is opened, because
        opening some devices has side effects.
        """
        path = self._path(key)
        real = os.path.realpath(path)
        root = os.path.realpath(self.root)
        if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
            raise UnsafePathError(
                f"{path} (key {key!r}) points to {real}, outside the store's root {root}: refusing to read it"
            )
        return real

    def _lstat(self, key: str) -> tuple[str, str, os.stat_result | None]:
        """``(path, real path, lstat of the real path)``; the stat is None if nothing is there."""
        path = self._path(key)
        real = self._resolve(key)
        try:
            return path, real, os.lstat(real)
        except (FileNotFoundError, NotADirectoryError):
            return path, real, None
        except OSError as exc:
            raise _storage_error(exc, f"inspecting {path}") from exc

    def _open_regular(self, key: str, absent: type[CkptkitError]) -> tuple[int, int, str]:
        """Open ``key`` for reading: ``(fd, size, path)``, the caller closes ``fd``.

        ``absent`` is the error for nothing (or a directory) at ``key``. Anything but a regular
        file is refused before it is opened, and again after (``fstat`` of the descriptor, in case
        it was swapped meanwhile); ``O_NONBLOCK`` makes even that open of a FIFO return at once,
        and ``O_NOFOLLOW`` refuses a symlink put in place of the resolved path.
        """
        path, real, st = self._lstat(key)
        _check_regular(path, st, absent)
        try:
            fd = os.open(real, _READ_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            raise absent(_absent_message(path, absent)) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePathError(f"{path} (key {key!r}) was replaced by a symlink while being opened") from None
            raise _storage_error(exc, f"reading {path}") from exc
        try:
            st = os.fstat(fd)
            _check_regular(path, st, absent)
        except BaseException:
            os.close(fd)
            raise
        return fd, st.st_size, path

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        self.read_into_vectored(key, offset, [out])

    def read_into_vectored(self, key: str, offset: int, buffers: list[memoryview]) -> None:
        views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
        total = sum(len(v) for v in views)
        if not total:
            return  # zero bytes asked: nothing to read, nothing checked (the contract, every backend)
        fd, _, path = self._open_regular(key, CorruptCheckpointError)
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

    def read_bytes(self, key: str, limit: int | None = None) -> bytes:
        fd, size, path = self._open_regular(key, CheckpointNotFoundError)
        try:
            if limit is None:
                with open(fd, "rb", buffering=0, closefd=False) as f:
                    return f.readall()
            if size > limit:  # fstat, before a byte is read
                raise too_large(path, size, limit)
            return _read_capped(fd, path, size, limit)
        except OSError as exc:
            raise _storage_error(exc, f"reading {path}") from exc
        finally:
            os.close(fd)

    def size(self, key: str) -> int | None:
        """The size of a regular file at ``key``; None if nothing or a directory is there.

        A FIFO, socket or device raises CorruptCheckpointError and a symlink out of the root
        UnsafePathError, rather than reporting the size of whatever it is. A link out of the root
        to a directory is None like any directory (nothing of it is read): a run directory whose
        checkpoints are links to another disk still lists, and its checkpoints open as stores
        rooted there.
        """
        try:
            path, _, st = self._lstat(key)
        except UnsafePathError:
            if os.path.isdir(self._path(key)):
                return None
            raise
        if st is None or stat.S_ISDIR(st.st_mode):
            return None
        _check_regular(path, st, CorruptCheckpointError)
        return st.st_size

    def checked_size(self, key: str) -> int:
        """The size of the regular file at ``key``, for readers that open it by other means.

        A data object read through another engine (tensorstore's file driver) gets the same
        checks as one read here: CorruptCheckpointError if missing or not a regular file,
        UnsafePathError if it resolves outside the root.
        """
        path, _, st = self._lstat(key)
        _check_regular(path, st, CorruptCheckpointError)
        assert st is not None
        return st.st_size

    def list_keys(self, prefix: str = "") -> list[str]:
        """Every non-directory entry under ``prefix``; symlinked directories are not descended.

        (``os.walk`` does not follow links below its top; a ``prefix`` that is itself a link out
        of the root lists nothing, as a listing of the whole root would not reach it either.)
        """
        base = self._path(prefix)
        out = []
        if prefix:
            try:
                self._resolve(prefix)
            except UnsafePathError:
                return []
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
        """Remove one object; nothing if there is none. Any other failure (a read-only file system,
        no permission, an I/O error) is a StorageError naming it: until 2026-12-06 every error was
        swallowed, so deleting a manifest on a read-only mount "succeeded", and ``discard_after``
        reported a rolled-back trajectory's checkpoint discarded that a restart then resumed from."""
        path = self._write_path(key)
        folder = os.path.dirname(path)  # a link itself is removed (its target never is), so its folder counts
        if not self._deletable(folder):
            raise UnsafePathError(f"refusing to delete {path}: its folder resolves to {os.path.realpath(folder)}, "
                                  f"outside {self._anchor} (a folder reached through a link)")
        try:
            os.remove(path)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return  # no object by that name (a folder, a prefix of others, a path through a file)
        except OSError as exc:
            raise _storage_error(exc, f"deleting {path}") from exc

    def prune_empty(self) -> None:
        if not self._deletable(self.root):
            return
        for dirpath, _, _ in sorted(os.walk(self.root), key=lambda w: -w[0].count(os.sep)):
            try:
                os.rmdir(dirpath)  # only ever succeeds on an empty directory
            except OSError:
                pass

    def delete_all(self) -> None:
        if os.path.islink(self.root) or not self._deletable(self.root):  # never through a link
            log.warning("not deleting %s: it is a link, or leads outside %s", self.root, self._anchor)
            return
        shutil.rmtree(self.root, ignore_errors=True)

    def is_dir(self) -> bool:
        """Whether the root directory exists (an empty one too)."""
        return os.path.isdir(self.root)


def _check_regular(path: str, st: os.stat_result | None, absent: type[CkptkitError]) -> None:
    """Raise unless ``st`` is a regular file: ``absent`` for nothing or a directory there."""
    if st is None or stat.S_ISDIR(st.st_mode):
        raise absent(_absent_message(path, absent, directory=st is not None))
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), f"not a regular file (mode {st.st_mode:o})")
        raise CorruptCheckpointError(f"object {path} is {kind}, not a regular file: a checkpoint object must be one")


def _absent_message(path: str, absent: type[CkptkitError], directory: bool = False) -> str:
    """read_bytes says a whole file is not there; ranged reads say an object the index lists is gone."""
    whole = absent is CheckpointNotFoundError
    if directory:
        return f"{path} is a directory, not a file" if whole else f"object {path} is a directory, not a file"
    return f"{path} does not exist" if whole else f"object {path} is missing"


def _read_capped(fd: int, path: str, size: int, limit: int) -> bytes:
    """At most ``limit`` bytes from ``fd``; TooLargeError if the file holds more.

    ``size`` (from fstat) is only a hint: a file growing while it is read must not slip past the
    limit, so this reads up to ``limit + 1`` bytes and fails if the extra byte came.
    """
    chunks: list[bytes] = []
    got = 0
    while got <= limit:
        # one past the expected end (a file that grew shows at once), never a large buffer for a
        # small file: os.read allocates what it is asked for
        expected = min(size, limit)
        want = min(expected - got + 1, _READ_CHUNK) if got <= expected else _READ_CHUNK
        chunk = os.read(fd, min(want, limit + 1 - got))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    if got > limit:
        raise TooLargeError(f"{path} grew past the {limit}-byte limit while being read (it was {size} bytes)")
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


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
