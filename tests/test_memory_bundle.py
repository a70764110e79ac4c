"""The streamed form of a memory snapshot bundle: sent from the sender's mapped files, received into
the receiver's new files, manifest last; hostile headers refused before anything is written."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.errors import CorruptCheckpointError
from ckptkit.memory import digest
from ckptkit.memory import exchange
from ckptkit.memory.bundle import MAGIC, BundleBytes, IncomingBundle, OutgoingBundle
from ckptkit.memory.exchange import messages
from ckptkit.memory.node_folder import NodeFolder
from ckptkit.storage.local import LocalStore
from tests.small_fs import small_tmpfs


def _snapshot(path) -> LocalStore:
    ckptkit.save({"w": torch.arange(5000, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16),
                  "empty": torch.zeros(0), "n": 3}, str(path))
    return LocalStore(str(path))


def blob_of(store: LocalStore) -> bytes:
    """A committed rank folder as the one byte string a bundle is (header, then its files, manifest last)."""
    with OutgoingBundle.open(store) as out:
        bundle = BundleBytes(out.header, out.parts)
        blob = bytearray(bundle.length)
        bundle.read_into(0, memoryview(blob))
        assert bundle.digest() == digest.of(blob)
        return bytes(blob)


def errors_within(calls: list, error: type[BaseException], seconds: float = 10.0) -> list[BaseException]:
    """Each call's ``error`` (a call that returns adds nothing), asserting that all of them finish within
    ``seconds``: a reader that waits on a FIFO for ever fails the test instead of hanging it."""
    import threading

    got: list[BaseException] = []

    def attempt() -> None:
        for call in calls:
            try:
                call()
            except error as exc:
                got.append(exc)

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "a reader waited instead of refusing"
    return got


def _stream(out: OutgoingBundle, folder: NodeFolder, step: int, rank: int, *, commit: bool = True) -> IncomingBundle:
    """What Link.swap_bundles does between two ranks, in one process: the same messages, in order."""
    with folder.incoming(step, rank, out.header) as sink:
        assert sink.sizes == [len(p) for p in out.parts]
        for i, at, n in messages(sink.sizes):
            sink.write(i, at, bytearray(out.parts[i][at:at + n]))  # a copy, as a received message is
        if commit:
            sink.commit()
    return sink


def test_a_streamed_copy_is_the_same_checkpoint_byte_for_byte(tmp_path):
    src = _snapshot(tmp_path / "src")
    folder = NodeFolder(str(tmp_path / "node"))
    with OutgoingBundle.open(src) as out:
        _stream(out, folder, 4, 1)
    copy = folder.rank_store(4, 1)
    assert ckptkit.verify(copy.url).ok
    assert blob_of(copy) == blob_of(src)
    assert folder.ranks_at(4) == [1]


def test_a_copy_cut_short_is_never_committed(tmp_path):
    src = _snapshot(tmp_path / "src")
    folder = NodeFolder(str(tmp_path / "node"))
    with OutgoingBundle.open(src) as out:
        _stream(out, folder, 4, 1, commit=False)
    assert folder.ranks_at(4) == []  # files are there, the manifest is not
    assert not os.path.exists(os.path.join(folder.rank_store(4, 1).root, "manifest.json"))


def test_a_new_copy_replaces_a_damaged_one(tmp_path):
    src = _snapshot(tmp_path / "src")
    folder = NodeFolder(str(tmp_path / "node"))
    with OutgoingBundle.open(src) as out:
        _stream(out, folder, 4, 1)
        root = folder.rank_store(4, 1).root
        victim = max((os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs), key=os.path.getsize)
        with open(victim, "r+b") as f:
            f.seek(100)
            f.write(b"\xff\xfe")
        assert not ckptkit.verify(root).ok
        _stream(out, folder, 4, 1)
    assert ckptkit.verify(folder.rank_store(4, 1).url).ok


def _header(files) -> bytes:
    doc = json.dumps({"files": files}).encode()
    return MAGIC + struct.pack("<Q", len(doc)) + doc


@pytest.mark.parametrize("files, why", [
    ([["../escape", 1], ["manifest.json", 2]], "outside its folder"),
    ([["/abs", 1], ["manifest.json", 2]], "outside its folder"),
    ([["a/../../b", 1], ["manifest.json", 2]], "outside its folder"),
    ([["data", 1]], "no manifest.json"),
    ([["a", 1], ["a", 1], ["manifest.json", 2]], "a file twice"),
    ([["a", 1], ["a/b", 1], ["manifest.json", 2]], "under another of its files"),
    ([["a", -1], ["manifest.json", 2]], "outside its folder"),
])
def test_a_hostile_header_is_refused_before_anything_is_written(tmp_path, files, why):
    folder = NodeFolder(str(tmp_path / "node"))
    with pytest.raises(CorruptCheckpointError, match=why):
        folder.incoming(1, 0, _header(files))
    assert not os.path.exists(tmp_path / "escape") and not os.path.exists(tmp_path / "b")
    assert folder.ranks_at(1) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text(alphabet="ab./", min_size=0, max_size=6), st.integers(-2, 64)), max_size=5),
       st.booleans())
def test_any_header_writes_only_inside_its_rank_folder(tmp_path_factory, files, with_manifest):
    base = tmp_path_factory.mktemp("fuzz")
    folder = NodeFolder(str(base / "node"))
    entries = [list(f) for f in files] + ([["manifest.json", 4]] if with_manifest else [])
    try:
        sink = folder.incoming(1, 0, _header(entries))
    except CorruptCheckpointError:
        assert folder.ranks_at(1) == []
        return
    rank_root = os.path.realpath(folder.rank_store(1, 0).root)
    sink.close()
    for dirpath, _, names in os.walk(base):
        for name in names:
            assert os.path.realpath(os.path.join(dirpath, name)).startswith(rank_root + os.sep)


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_a_fifo_or_link_in_a_snapshot_folder_is_refused_not_waited_on(tmp_path, kind):
    """The manifest's checks see only the files it lists; a bundle sends every file of the folder, so
    each is opened as a regular file or refused (a FIFO's open blocks for ever)."""
    src = _snapshot(tmp_path / "src")
    extra = os.path.join(src.root, "extra")
    if kind == "fifo":
        os.mkfifo(extra)
    else:
        (tmp_path / "outside").write_bytes(b"secret")
        os.symlink(tmp_path / "outside", extra)
    got = errors_within([lambda: OutgoingBundle.open(src).close()], CorruptCheckpointError)
    assert len(got) == 1 and "extra" in str(got[0])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=8), st.integers(1, 9))
def test_messages_cover_every_file_exactly_once_in_order(sizes, cap):
    """Both sides cut the files at the same places from the sizes alone, so one side's messages are
    the other's: every byte of every file in exactly one message, in order, none over the cap."""
    old = exchange.MESSAGE_BYTES
    exchange.MESSAGE_BYTES = cap
    try:
        got = messages(sizes)
    finally:
        exchange.MESSAGE_BYTES = old
    covered = [(i, at) for i, at0, n in got for at in range(at0, at0 + n)]
    assert covered == [(i, at) for i, size in enumerate(sizes) for at in range(size)]
    assert all(0 < n <= cap for _, _, n in got)


def test_a_write_outside_a_listed_file_is_refused(tmp_path):
    src = _snapshot(tmp_path / "src")
    folder = NodeFolder(str(tmp_path / "node"))
    with OutgoingBundle.open(src) as out, folder.incoming(4, 1, out.header) as sink:
        big = max(range(len(sink.sizes)), key=lambda i: sink.sizes[i])
        with pytest.raises(CorruptCheckpointError, match="bundle header lists"):
            sink.write(big, sink.sizes[big] - 2, b"xyz")
        with pytest.raises(CorruptCheckpointError, match="bundle header lists"):
            sink.write(big, -1, b"x")


def test_a_copy_with_a_file_short_is_never_committed(tmp_path):
    """Every message but one arrived: commit refuses, and the folder holds no manifest."""
    src = _snapshot(tmp_path / "src")
    folder = NodeFolder(str(tmp_path / "node"))
    with OutgoingBundle.open(src) as out, folder.incoming(4, 1, out.header) as sink:
        msgs = messages(sink.sizes)
        for k, (i, at, n) in enumerate(msgs):
            if k != len(msgs) // 2:
                sink.write(i, at, out.parts[i][at:at + n])
        with pytest.raises(CorruptCheckpointError, match="arrived"):
            sink.commit()
    assert folder.ranks_at(4) == []


_FULL_FS_CHILD = r"""
import os, sys, torch
import ckptkit
from ckptkit.errors import StorageError
from ckptkit.memory.bundle import OutgoingBundle
from ckptkit.memory.exchange import messages
from ckptkit.memory.node_folder import NodeFolder
from ckptkit.storage.local import LocalStore
src, small = sys.argv[1], sys.argv[2]
ckptkit.save({"w": torch.arange(1 << 20, dtype=torch.float32)}, src)  # 4 MiB, twice the small fs
folder = NodeFolder(os.path.join(small, "node"))
try:
    with OutgoingBundle.open(LocalStore(src)) as out, folder.incoming(1, 0, out.header) as sink:
        for i, at, n in messages(sink.sizes):
            sink.write(i, at, bytes(out.parts[i][at:at + n]))
        sink.commit()
    print("COPIED")
except StorageError as exc:
    print("STORAGE_ERROR", exc)
try:
    folder.new_share(1, 0, 4 << 20).close()
    print("SHARE")
except StorageError as exc:
    print("SHARE_STORAGE_ERROR", exc)
"""


def test_a_full_memory_folder_is_an_error_not_a_killed_rank(tmp_path):
    """A received copy and a new parity share on a file system without room: a StorageError naming
    the folder (which the tier agrees on, keeping the older step), never SIGBUS. Run in a child, so
    the old behaviour (a store through a map of a file tmpfs cannot back) shows as its signal."""
    import subprocess
    import sys

    with small_tmpfs(str(tmp_path / "small"), "2m") as small:
        r = subprocess.run([sys.executable, "-c", _FULL_FS_CHILD, str(tmp_path / "src"), small],
                           capture_output=True, text=True, timeout=120)
        committed = [d for d, _, fs in os.walk(small) if "manifest.json" in fs]
    assert r.returncode == 0, f"the child died (rc {r.returncode}): {r.stderr[-2000:]}"
    assert "STORAGE_ERROR" in r.stdout and "No space left" in r.stdout, r.stdout
    assert "SHARE_STORAGE_ERROR" in r.stdout and "parity share" in r.stdout, r.stdout
    assert committed == [], committed  # the copy cut short by the full folder is not committed
