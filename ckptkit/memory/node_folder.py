"""One node's memory folder: per step, a ckptkit checkpoint per rank held, and parity shares.

    <root>/step-0000000500/rank-00003/      a whole ckptkit checkpoint of rank 3's own state
                                            (manifest, index, data: ``ckptkit verify`` reads it)
    <root>/step-0000000500/share-00007.bin  rank 7's parity share of the step (raw bytes)
    <root>/step-0000000500/share-00007.json its header (group, chunk size, members' lengths and
                                            digests), written last: the share's commit

A rank's snapshot travels between nodes as a *bundle* (:mod:`ckptkit.memory.bundle`): checked
on arrival and written back as files, manifest last, so a half-written copy is never committed.
Whether a copy is *good* is decided by ckptkit's own checks (:func:`verified`): digests of the
metadata and a CRC32C of every block, the same as for any checkpoint.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import re
import shutil
import stat
from dataclasses import dataclass
from typing import Any

from ckptkit.errors import CkptkitError, CorruptCheckpointError, ManifestError, StorageError
from ckptkit.layout.manifest import MANIFEST_NAME
from ckptkit.layout.strict_json import MAX_WORLD, as_int, as_ints, as_list, as_str, load_json
from ckptkit.memory import digest
from ckptkit.memory.bundle import MAX_HEADER, BundleSink, IncomingBundle, OutgoingBundle
from ckptkit.memory.spares import MIN_SPARE, RecyclingStore, SparePool
from ckptkit.storage.local import LocalStore

log = logging.getLogger("ckptkit")

_RANK = r"([0-9]{5}|[1-9][0-9]{5,6})"  # a rank as {rank:05d} writes it (ASCII; a world may reach 2**20 ranks)
STEP_RE = re.compile(r"^step-([0-9]{10}|[1-9][0-9]{10,18})$")  # step_name's form only: ASCII, 10 digits or more
RANK_RE = re.compile(rf"^rank-{_RANK}$")
SHARE_RE = re.compile(rf"^share-{_RANK}\.json$")
ANY_SHARE_RE = re.compile(rf"^share-{_RANK}\.")  # a share's header, bytes or temporary
POOL_RE = re.compile(rf"^spares-{_RANK}$")


def step_name(step: int) -> str:
    return f"step-{step:010d}"


def rank_name(rank: int) -> str:
    return f"rank-{rank:05d}"


#: share headers written now: version 3 records the run that made the share; version 2's digests
#: are block CRCs (:mod:`ckptkit.memory.digest`), as are 3's; version 1 headers (SHA-256 digests)
#: are still read and checked as such. A share of no run (1, 2) is checked, never restored from.
SHARE_VERSION = 3


@dataclass(frozen=True)
class ShareHeader:
    """What a parity share protects: the group's members (ranks, in member order), whose share
    this is, the chunk size, and each member's bundle length and digest (:mod:`ckptkit.memory.digest`)."""

    step: int
    members: tuple[int, ...]
    index: int
    chunk: int
    lengths: tuple[int, ...]
    digests: tuple[str, ...]
    share_digest: str
    run: str | None = None  # the run that made it (:mod:`ckptkit.run_identity`); None before version 3

    def to_json(self) -> bytes:
        return json.dumps({"version": SHARE_VERSION, "step": self.step, "members": list(self.members),
                           "index": self.index, "chunk": self.chunk, "lengths": list(self.lengths), "digests": list(self.digests),
                           "share_digest": self.share_digest, "run": self.run}).encode()

    @staticmethod
    def from_json(data: bytes, where: str) -> ShareHeader:
        """The header in ``data``, parsed as hostile input (docs/trust.md): strict JSON (no ``NaN`` or
        ``Infinity``, no number that overflows, bounded nesting), every field of its exact type and
        every integer bounded. A header is read by each rank's inventory before the restore's first
        agreement, so anything wrong with it must be a :class:`CorruptCheckpointError` naming the file:
        a ``RecursionError`` or an ``OverflowError`` (``int(inf)``) left one rank's restore alone."""
        try:
            doc = load_json(bytes(data), where)
            version = doc.get("version")
            members = as_ints(doc.get("members"), f"{where}: members", 0, MAX_WORLD - 1, max_len=MAX_WORLD)
            g = len(members)
            header = ShareHeader(as_int(doc.get("step"), f"{where}: step", 0), members,
                                 as_int(doc.get("index"), f"{where}: index", 0, max(g - 1, 0)),
                                 as_int(doc.get("chunk"), f"{where}: chunk", 0),
                                 as_ints(doc.get("lengths"), f"{where}: lengths", 0, max_len=g),
                                 tuple(as_str(d, f"{where}: digests") for d in as_list(doc.get("digests"), where)),
                                 as_str(doc.get("share_digest"), f"{where}: share_digest"),
                                 as_str(doc.get("run"), f"{where}: run") if version == 3 else None)
        except ManifestError as exc:
            raise CorruptCheckpointError(f"not a parity share header: {exc}") from None
        if version not in (1, 2, SHARE_VERSION) or isinstance(version, bool) or g < 2 or len(set(members)) != g \
                or len(header.lengths) != g or len(header.digests) != g \
                or any(n > (g - 1) * header.chunk for n in header.lengths):
            raise CorruptCheckpointError(f"{where}: inconsistent parity share header")
        return header


_HASH_BLOCK = 8 << 20


def _reserve(fd: int, size: int, path: str) -> None:
    """Allocate a new share's ``size`` bytes before it is mapped. Stores through a map into pages
    the file system cannot supply (a full ``/dev/shm``) kill the process with SIGBUS; allocated
    first, the shortage is an error the parity rounds report and every rank agrees on."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return  # a file system without fallocate: nothing to reserve with, as before
        raise StorageError(f"{path}: cannot make room for a parity share of {size} bytes: {exc}") from exc


class MappedShare:
    """A parity share's file, memory-mapped: :attr:`view` is its bytes (``with`` unmaps it)."""

    def __init__(self, m: mmap.mmap | None) -> None:
        self._map = m
        self.view = memoryview(m) if m is not None else memoryview(bytearray())

    @staticmethod
    def open(path: str, size: int, *, writable: bool, fd: int | None = None) -> MappedShare:
        """``fd``: a file already open read-write at ``path`` (a spare renamed there), whose former
        bytes the parity rounds' first round writes over."""
        flags = (os.O_RDWR | os.O_CREAT | os.O_TRUNC) if writable else os.O_RDONLY
        try:
            if fd is None:
                fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)  # a FIFO in its place: no wait
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CorruptCheckpointError(f"{path}: a link in place of a parity share, not followed") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpointError(f"{path}: a parity share must be a regular file")
            if writable:
                os.ftruncate(fd, size)
                if size:  # its pages now: a full file system is ENOSPC here, not SIGBUS in the XOR
                    _reserve(fd, size, path)
            elif st.st_size != size:
                raise CorruptCheckpointError(f"{path}: parity share of {st.st_size} bytes, expected {size}")
            m = mmap.mmap(fd, size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)) if size else None
        finally:
            os.close(fd)
        return MappedShare(m)

    def digest(self) -> str:
        return digest.of(self.view)

    def flush(self) -> None:
        if self._map is not None:
            self._map.flush()

    def __enter__(self) -> MappedShare:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.view.release()
        if self._map is not None:
            self._map.close()
            self._map = None


def _regular(path: str) -> bool:
    """A regular file itself, not a link to one."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _real_dir(path: str) -> bool:
    """A directory itself, not a link to one (never followed)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _names(path: str) -> list[str]:
    """The entries of ``path`` when it is a real directory, else none: a file or a link planted
    under a step's or a rank's name is never listed through (nor read or written through)."""
    if not _real_dir(path):
        return []
    try:
        return os.listdir(path)
    except OSError:
        return []


class NodeFolder:
    """The memory folder of one node (or of one process, when each passes its own).

    Entries are trusted only as what they are: a step or rank folder must be a real directory (a
    link in its place is neither listed nor followed, and is removed before that step is written),
    a manifest or share a regular file. ``private``: the folder is ckptkit's default under a
    world-writable ``/dev/shm``, whose name anyone can predict; it must then be a real directory
    this user owns, made ``0700``, or the tier refuses it (another user's link there would receive
    the snapshots)."""

    def __init__(self, root: str, *, private: bool = False) -> None:
        # a root the user gives may be a link to the folder they mean: resolved once, here
        self.root = os.path.abspath(root) if private else os.path.realpath(root)
        os.makedirs(self.root, mode=0o700 if private else 0o777, exist_ok=True)
        if private:
            st = os.lstat(self.root)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                raise StorageError(f"memory tier: {self.root} is not a directory of this user's (a link, a file or "
                                   "another user's): refusing to keep snapshots there; remove it or pass "
                                   "MemoryTier(root=...)")
        #: this process's spare files (:mod:`ckptkit.memory.spares`), once :meth:`keep_spares` is called
        self.spares: SparePool | None = None

    def keep_spares(self, rank: int, claims: Any) -> None:
        """Keep retired files as spares for the next snapshot (in a pool named for ``rank``, which
        clears itself), after removing the other pools ``claims`` says are this process's (a former
        run's, with ranks placed otherwise)."""
        for name in os.listdir(self.root):
            m = POOL_RE.match(name)
            if m and int(m.group(1)) != rank and claims(int(m.group(1))):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        try:
            self.spares = SparePool(self.root, rank)
        except OSError as exc:  # something that cannot be removed stands in the pool's place
            log.warning("memory tier: no spare files in %s (%s); every snapshot writes new files", self.root, exc)

    def step_path(self, step: int) -> str:
        return os.path.join(self.root, step_name(step))

    def rank_store(self, step: int, rank: int) -> LocalStore:
        root = os.path.join(self.step_path(step), rank_name(rank))
        return LocalStore(root) if self.spares is None else RecyclingStore(root, self.spares)

    def own_step(self, step: int) -> None:
        """Make ``step``'s folder a real directory before writing in it: a file or a link in its
        place is removed (unlinked, never followed), so no write goes through it."""
        path = self.step_path(step)
        try:
            if os.path.lexists(path) and not _real_dir(path):
                try:
                    os.unlink(path)
                except FileNotFoundError:  # a node mate removed it first
                    pass
            os.makedirs(path, exist_ok=True)
        except OSError as exc:  # a full folder, out of inodes: the caller's failure to agree on, by name
            raise StorageError(f"memory tier: cannot make the step folder {path}: {exc}") from exc

    def steps(self) -> list[int]:
        """Steps with a folder here (a real directory), newest first."""
        names = _names(self.root)
        return sorted((int(m.group(1)) for m in map(STEP_RE.match, names)
                       if m and _real_dir(os.path.join(self.root, m.group(0)))), reverse=True)

    def ranks_at(self, step: int) -> list[int]:
        """Ranks with a *committed* snapshot folder at ``step`` (a real directory with a manifest
        that is a regular file; not yet verified)."""
        out = []
        for m in map(RANK_RE.match, _names(self.step_path(step))):
            folder = os.path.join(self.step_path(step), m.group(0)) if m else ""
            if m and _real_dir(folder) and _regular(os.path.join(folder, MANIFEST_NAME)):
                out.append(int(m.group(1)))
        return sorted(out)

    def shares_at(self, step: int) -> list[int]:
        """Holders of committed parity shares at ``step``."""
        return sorted(int(m.group(1)) for m in map(SHARE_RE.match, _names(self.step_path(step))) if m)

    def outgoing(self, step: int, rank: int) -> OutgoingBundle:
        """Rank ``rank``'s committed folder at ``step``, opened to be streamed to a peer."""
        return OutgoingBundle.open(self.rank_store(step, rank))

    def incoming(self, step: int, rank: int, header: bytes | bytearray | memoryview) -> IncomingBundle:
        """Receive rank ``rank``'s folder at ``step`` (replacing whatever is there) as ``header`` lists it."""
        store = self.rank_store(step, rank)
        self.own_step(step)
        self.remove_rank(step, rank)
        return IncomingBundle(store, header, self.spares)

    def rebuilt(self, step: int, rank: int, length: int, digest: str) -> BundleSink:
        """Rank ``rank``'s folder at ``step``, written as a parity rebuild's bytes arrive in order;
        committed only if all ``length`` bytes come and match ``digest``."""
        return BundleSink(lambda header: self.incoming(step, rank, header), length, digest,
                          f"{self.rank_store(step, rank).url} (parity rebuild)")

    def share_header(self, step: int, holder: int) -> ShareHeader:
        """A parity share's header alone (what an inventory lists; its bytes are checked at a restore).
        Read as any checkpoint object is: a regular file inside the folder, at most MAX_HEADER bytes
        (a FIFO, a device or a link out of the folder in its place is refused, never waited on)."""
        where = self._share_path(step, holder, ".json")
        data = LocalStore(self.step_path(step)).read_bytes(f"share-{holder:05d}.json", limit=MAX_HEADER)
        header = ShareHeader.from_json(data, where)
        if header.step != step or header.members[header.index] != holder:
            raise CorruptCheckpointError(f"{where}: the share of rank {header.members[header.index]} at step "
                                         f"{header.step}, moved here from elsewhere")
        return header

    def check_share(self, step: int, holder: int) -> ShareHeader:
        """A parity share's header, once its bytes are checked against the digest it records (read
        in blocks: a share is a third of a snapshot at ``g = 4``)."""
        header = self.share_header(step, holder)
        store, key = LocalStore(self.step_path(step)), f"share-{holder:05d}.bin"
        size = store.checked_size(key)
        if size != header.chunk:
            raise CorruptCheckpointError(f"{self._share_path(step, holder, '.bin')}: parity share of {size} bytes, "
                                         f"its header says {header.chunk}")
        h, block = digest.new(header.share_digest), bytearray(min(_HASH_BLOCK, size))
        for at in range(0, size, len(block) or 1):
            view = memoryview(block)[: min(len(block), size - at)]
            store.read_into(key, at, view)
            h.update(view)
        if h.hexdigest() != header.share_digest:
            raise CorruptCheckpointError(f"{self._share_path(step, holder, '.bin')}: parity share does not match "
                                         "its header's digest")
        return header

    def open_share(self, step: int, holder: int) -> MappedShare:
        """A parity share's bytes, mapped read-only (checked by :meth:`check_share` before a restore)."""
        header = self.share_header(step, holder)
        return MappedShare.open(self._share_path(step, holder, ".bin"), header.chunk, writable=False)

    def new_share(self, step: int, holder: int, chunk: int) -> MappedShare:
        """A new parity share of ``chunk`` bytes, mapped for the parity rounds to write into (a spare
        file when there is one: the first round writes every byte); committed by
        :meth:`commit_share` (its header, written last)."""
        self.own_step(step)
        self.remove_share(step, holder)
        path = self._share_path(step, holder, ".bin")
        fd = self.spares.open_over(path, chunk, readable=True) if self.spares is not None and chunk >= MIN_SPARE else None
        return MappedShare.open(path, chunk, writable=True, fd=fd)

    def commit_share(self, step: int, holder: int, share: MappedShare, header: ShareHeader) -> None:
        share.flush()
        LocalStore(self.step_path(step)).put_bytes(f"share-{holder:05d}.json", header.to_json())

    def _share_path(self, step: int, holder: int, ext: str) -> str:
        return os.path.join(self.step_path(step), f"share-{holder:05d}{ext}")

    def remove_rank(self, step: int, rank: int) -> None:
        """Remove a rank's folder at ``step``; a file or a link in its place is unlinked (not followed).
        A failure is a :class:`StorageError` naming the path (a caller in a walk every rank joins
        reports it as that entry's, never as a raw ``OSError`` that ends the walk)."""
        if not _real_dir(self.step_path(step)):
            return
        path = os.path.join(self.step_path(step), rank_name(rank))
        if os.path.lexists(path) and not _real_dir(path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise StorageError(f"memory tier: cannot remove {path}: {exc}") from exc
        else:
            shutil.rmtree(path, ignore_errors=True)

    def remove_share(self, step: int, holder: int) -> None:
        for ext in (".json", ".bin"):  # header first: a share without it is not committed
            try:
                os.unlink(os.path.join(self.step_path(step), f"share-{holder:05d}{ext}"))
            except FileNotFoundError:
                pass

    def remove_claimed(self, step: int, claims: Any) -> None:
        """Remove the folders and shares ``claims(kind, rank)`` says are this process's to manage;
        the step folder goes when nothing else is left in it (a node mate's entries stay)."""
        for r in self._rank_folders(step):
            if claims(r):
                self.remove_rank(step, r)
        for h in self._share_holders_any(step):
            if claims(h):
                self.remove_share(step, h)
        try:
            os.rmdir(self.step_path(step))
        except OSError:
            pass

    def retire_claimed(self, step: int, claims: Any, room: int) -> int:
        """:meth:`remove_claimed`, keeping up to ``room`` bytes of the rank folders' data files as
        spares (each folder's manifest removed first, so it is no longer a committed snapshot
        when its files move). Returns the bytes kept."""
        kept = 0
        if self.spares is not None:
            for r in self._rank_folders(step):
                if not claims(r):
                    continue
                root = self.rank_store(step, r).root
                if not _real_dir(root):
                    continue  # a link in a rank's place: removed by remove_claimed, never walked through
                try:
                    os.unlink(os.path.join(root, MANIFEST_NAME))
                except FileNotFoundError:
                    pass
                except OSError:
                    continue  # left to remove_claimed, as any folder
                for dirpath, _, names in os.walk(root):
                    for name in names:
                        kept += self.spares.keep(os.path.join(dirpath, name), room - kept)
            for h in self._share_holders_any(step):
                if claims(h):
                    try:  # the header first: a share without one is not committed
                        os.unlink(self._share_path(step, h, ".json"))
                    except FileNotFoundError:
                        pass
                    except OSError:
                        continue
                    kept += self.spares.keep(self._share_path(step, h, ".bin"), room - kept)
        self.remove_claimed(step, claims)
        return kept

    def data_bytes(self, step: int, claims: Any) -> int:
        """The bytes of the files in the rank folders and of the parity shares ``claims`` says are
        this process's at ``step``."""
        total = 0
        for h in self._share_holders_any(step):
            if claims(h):
                try:
                    st = os.lstat(self._share_path(step, h, ".bin"))
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
        for r in self._rank_folders(step):
            if claims(r) and _real_dir(self.rank_store(step, r).root):
                for dirpath, _, names in os.walk(self.rank_store(step, r).root):
                    for name in names:
                        try:
                            st = os.lstat(os.path.join(dirpath, name))
                        except OSError:
                            continue
                        if stat.S_ISREG(st.st_mode):
                            total += st.st_size
        return total

    def _rank_folders(self, step: int) -> list[int]:
        """Ranks with a folder at ``step``, committed or not (:meth:`ranks_at` is the committed ones)."""
        return sorted(int(m.group(1)) for m in map(RANK_RE.match, _names(self.step_path(step))) if m)

    def _share_holders_any(self, step: int) -> list[int]:
        names = _names(self.step_path(step))
        return sorted({int(m.group(1)) for m in map(ANY_SHARE_RE.match, names) if m})


def verified(store: LocalStore) -> str | None:
    """None when the snapshot at ``store`` passes every check ckptkit makes of a checkpoint,
    else the first problem (the copy is then never used)."""
    from ckptkit.offline.verification import verify

    try:
        report = verify(store.url, threads=2)
    except (CkptkitError, OSError) as exc:
        return str(exc)
    if report.ok:
        return None
    first = report.problems[0] if report.problems else None
    return f"{first.kind}: {first.message}" if first is not None else "not found"
