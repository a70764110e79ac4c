"""Spare files: a retired memory snapshot's data files, written over by the next snapshot.

Why: on tmpfs (``/dev/shm``) a new file's every page is allocated, zeroed and put on the LRU
lists as it is written, and an unlinked file's every page is freed again. A file written over
keeps its pages. Measured on 2026-12-05 with 4 processes on 2 cores: writing 8 MiB into a new
file (the old one unlinked) took 1.55 ms of CPU, writing it over an existing file 0.68 ms. A
replica rank writes its own copy and receives a peer's at every snapshot, so this is CPU that
training ranks on the same cores would otherwise lose at every snapshot.

Memory: the spares are the files of the step being retired, and a step is retired only once a
newer one is complete in the whole job. The next snapshot's writes take spares before they make
anything new, and the spares a snapshot did not need are dropped at the next retirement. So a
node folder still holds at most two steps' files, as :class:`~ckptkit.MemoryTier` states and
budgets; between snapshots it holds two instead of one.

Safety: a spare is only ever a file this process moved into its own pool folder (``spares-`` and
its rank), from a rank folder whose manifest it had removed first (the step it came from was no
longer a committed snapshot by then). It must be a regular file with one link when kept, it is
renamed into place (a rename never follows a link) and checked again once open, written over
entirely, then cut to its new length. A spare that fails a check is unlinked and a new file made.
Whether the bytes are right is then checked like any snapshot's, by its digests and CRCs.
"""

from __future__ import annotations

import os
import shutil
import stat
import threading

from ckptkit.errors import StorageError
from ckptkit.storage.local import LocalStore

#: files smaller than this are not kept (their pages are few; a manifest, an index)
MIN_SPARE = 1 << 20
POOL_PREFIX = "spares-"


def pool_name(rank: int) -> str:
    return f"{POOL_PREFIX}{rank:05d}"


class SparePool:
    """This process's spare files, in its own folder under the node folder."""

    def __init__(self, root: str, rank: int) -> None:
        self.dir = os.path.join(root, pool_name(rank))
        self._files: list[tuple[int, str]] = []  # (size, path)
        self._next = 0
        self._lock = threading.Lock()
        # a former process's spares: nothing to trust there. A link in the pool's place is removed,
        # not followed, and the folder made anew must be this process's own (mkdir, not exist_ok)
        if os.path.islink(self.dir):
            os.unlink(self.dir)
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(root, exist_ok=True)
        os.mkdir(self.dir, 0o700)

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)

    def keep(self, path: str, room: int) -> int:
        """Move the file at ``path`` into the pool if it is a regular file with one link, of at
        least :data:`MIN_SPARE` bytes, and fits in ``room`` bytes; returns the bytes kept (0: not
        kept, the caller removes it)."""
        try:
            st = os.lstat(path)
        except OSError:
            return 0
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size < MIN_SPARE or st.st_size > room:
            return 0
        with self._lock:
            spare = os.path.join(self.dir, f"{self._next}.spare")
            self._next += 1
            try:
                os.rename(path, spare)
            except OSError:
                return 0
            self._files.append((st.st_size, spare))
        return st.st_size

    def drop(self) -> None:
        """Unlink every spare (those the last snapshot did not need, or all at the end)."""
        with self._lock:
            files, self._files = self._files, []
        for _, path in files:
            try:
                os.unlink(path)
            except OSError:
                pass

    def close(self) -> None:
        self.drop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def open_over(self, path: str, size: int | None = None, *, readable: bool = False) -> int | None:
        """A file descriptor, open for writing (and reading, if ``readable``: to be mapped), of a
        spare renamed to ``path`` (replacing what is there), not emptied: the caller writes it over
        entirely and cuts it to its length. The spare nearest above ``size`` (None: the largest).
        None when there is no usable spare."""
        while True:
            with self._lock:
                if not self._files:
                    return None
                fits = [f for f in self._files if size is not None and f[0] >= size]
                pick = min(fits) if fits else max(self._files)
                self._files.remove(pick)
            fd = self._claim(pick[1], path, os.O_RDWR if readable else os.O_WRONLY)
            if fd is not None:
                return fd

    @staticmethod
    def _claim(spare: str, path: str, mode: int) -> int | None:
        try:
            os.rename(spare, path)
        except OSError:
            _unlink_quietly(spare)  # out of the list already: not left behind untracked
            return None
        try:
            fd = os.open(path, mode | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError:  # ELOOP: a link in the pool, never written through
            _unlink_quietly(path)
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:  # a hard link shares its pages with another name
            os.close(fd)
            _unlink_quietly(path)
            return None
        return fd


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class RecyclingStore(LocalStore):
    """A rank folder of the memory tier whose new objects are written over spare files when the
    pool has any (:mod:`ckptkit.memory.spares`); reads, commits and everything else are a
    :class:`~ckptkit.storage.local.LocalStore`'s."""

    def __init__(self, root: str, spares: SparePool) -> None:
        super().__init__(root)
        self.spares = spares

    def child(self, name: str) -> LocalStore:
        return RecyclingStore(self._path(name), self.spares)

    def _open_new(self, path: str) -> tuple[int, bool]:
        if not path.startswith(os.path.join(self.root, "data") + os.sep):  # an index, a manifest: small
            return super()._open_new(path)
        fd = self.spares.open_over(path)
        if fd is None:
            return super()._open_new(path)
        return fd, True


def open_new_file(path: str, size: int, spares: SparePool | None) -> int:
    """A file descriptor to write ``size`` bytes of a new file at ``path`` through (at their offsets):
    a spare cut to ``size`` when the pool has one, else a new empty file."""
    fd = spares.open_over(path, size) if spares is not None and size >= MIN_SPARE else None
    if fd is None:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.ftruncate(fd, size)
    except OSError as exc:
        os.close(fd)
        raise StorageError(f"{path}: cannot size a spare file to {size} bytes: {exc}") from exc
    return fd
