"""A damaged or hostile checkpoint folder never makes a local read hang, exhaust memory or leave the
checkpoint: only regular files inside the store's root are objects, and metadata reads are capped.

Each case builds the hostile entry for real (a FIFO, a socket, a device node, symlinks out of the
root, a directory) at an object's key and runs every read path on it, through the plain local
store and through the tensorstore engine (whose data reads use tensorstore's own file driver).
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import time
import tracemalloc
from collections.abc import Callable

import pytest

from ckptkit.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    TooLargeError,
    UnsafePathError,
)
from ckptkit.storage import LocalStore, open_store
from ckptkit.storage.base import ByteStore
from ckptkit.storage.local import _read_capped
from ckptkit.storage.tiered import TieredStore

pytestmark = pytest.mark.timeout(20)  # a read that blocks on a FIFO fails the test instead of hanging

# The time bounds tell a refusal from a hang (a FIFO read blocks for ever) or a whole read of an 8 GiB file;
# they are not speed targets, so they leave room for a loaded 2-core machine (the memory bounds are exact).
HANG_S = 10
KEYS = ["manifest.json", "data/rank-00000.bin"]  # metadata (read whole) and a data object (ranged reads)
ENGINES = {
    "local": lambda root: LocalStore(root),
    "tensorstore": lambda root: open_store(root, {"io_engine": "tensorstore"}),
}


@pytest.fixture(params=list(ENGINES))
def make_store(request) -> Callable[[str], ByteStore]:
    return ENGINES[request.param]


def _fifo(path: str, tmp) -> None:
    os.mkfifo(path)


def _socket(path: str, tmp) -> None:
    # bound by a relative name: an AF_UNIX path is limited to ~107 bytes, tmp_path can be longer
    cwd = os.getcwd()
    os.chdir(os.path.dirname(path))
    try:
        s = socket.socket(socket.AF_UNIX)
        s.bind(os.path.basename(path))
        s.close()  # the socket file stays
    finally:
        os.chdir(cwd)


def _device(path: str, tmp) -> None:
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")


SPECIAL = {"fifo": (_fifo, "FIFO"), "socket": (_socket, "socket"), "device": (_device, "character device")}


def _build(root, key: str) -> str:
    path = os.path.join(root, *key.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path


def _all_reads(store: ByteStore, key: str) -> dict[str, Callable[[], object]]:
    return {
        "read_bytes": lambda: store.read_bytes(key),
        "read_bytes_limit": lambda: store.read_bytes(key, limit=1 << 20),
        "read_into": lambda: store.read_into(key, 0, memoryview(bytearray(16))),
        "read_into_vectored": lambda: store.read_into_vectored(key, 4, [memoryview(bytearray(n)) for n in (4, 8)]),
        "size": lambda: store.size(key),
        "exists": lambda: store.exists(key),
    }


# ------------------------------------------------------------------ non-regular files


@pytest.mark.parametrize("kind", list(SPECIAL))
@pytest.mark.parametrize("key", KEYS)
def test_special_files_are_refused_at_once_by_every_read(tmp_path, make_store, kind, key):
    build, word = SPECIAL[kind]
    root = tmp_path / "ckpt"
    path = _build(root, key)
    build(path, tmp_path)
    store = make_store(str(root))
    for name, read in _all_reads(store, key).items():
        t0 = time.monotonic()
        with pytest.raises(CorruptCheckpointError, match=f"{path}.* {word}.*not a regular file") as info:
            read()
        assert time.monotonic() - t0 < HANG_S, f"{name} on a {kind} took {time.monotonic() - t0:.1f}s"
        assert not isinstance(info.value, CheckpointNotFoundError), name  # damaged, not absent


@pytest.mark.parametrize("key", KEYS)
def test_a_directory_in_place_of_an_object(tmp_path, make_store, key):
    root = tmp_path / "ckpt"
    path = _build(root, key)
    os.mkdir(path)
    store = make_store(str(root))
    assert store.size(key) is None and not store.exists(key)  # a prefix, not an object
    with pytest.raises(CheckpointNotFoundError, match=f"{path} is a directory"):
        store.read_bytes(key)
    with pytest.raises(CorruptCheckpointError, match=f"{path} is a directory"):
        store.read_into(key, 0, memoryview(bytearray(4)))


# ------------------------------------------------------------------ symlinks


def _outside_file(tmp_path) -> str:
    secret = tmp_path / "outside" / "secret.bin"
    secret.parent.mkdir(exist_ok=True)
    secret.write_bytes(b"not yours" * 100)
    return str(secret)


ESCAPES = {
    "to-a-file": lambda tmp: _outside_file(tmp),
    "to-dev-zero": lambda tmp: "/dev/zero",
    "to-etc-passwd": lambda tmp: "/etc/passwd",
    "relative-up": lambda tmp: os.path.relpath(_outside_file(tmp), tmp / "ckpt" / "data"),
}


@pytest.mark.parametrize("target", list(ESCAPES))
@pytest.mark.parametrize("key", KEYS)
def test_symlinks_out_of_the_root_are_refused_by_every_read(tmp_path, make_store, target, key):
    root = tmp_path / "ckpt"
    path = _build(root, key)
    points_to = ESCAPES[target](tmp_path)
    os.symlink(points_to, path)
    real = os.path.realpath(path)
    store = make_store(str(root))
    for name, read in _all_reads(store, key).items():
        with pytest.raises(UnsafePathError, match=f"key '{key}'.* points to {real}, outside") as info:
            read()
        assert str(root) in str(info.value), name


@pytest.mark.parametrize("read", ["read_bytes", "read_into", "size"])
def test_a_symlinked_directory_out_of_the_root_is_not_entered(tmp_path, make_store, read):
    root = tmp_path / "ckpt"
    root.mkdir()
    outside = os.path.dirname(_outside_file(tmp_path))
    os.symlink(outside, root / "data")
    (root / "index").mkdir()
    (root / "index" / "rank-0.json").write_text("{}")
    store = make_store(str(root))
    with pytest.raises(UnsafePathError, match="key 'data/secret.bin'"):
        _all_reads(store, "data/secret.bin")[read]()
    assert store.list_keys() == ["index/rank-0.json"]  # the link is not descended
    assert store.list_keys("data") == []
    assert store.size("data") is None  # a directory, wherever it is, is not an object
    with pytest.raises(UnsafePathError, match=r"key '\.\./outside/secret.bin'"):  # nor is a key with ..
        store.read_bytes("../outside/secret.bin")


def test_symlinks_inside_the_root_are_followed(tmp_path, make_store):
    root = tmp_path / "ckpt"
    (root / "objects").mkdir(parents=True)
    payload = bytes(range(256)) * 8
    (root / "objects" / "blob").write_bytes(payload)
    (root / "manifest.json").symlink_to("objects/blob")  # relative
    (root / "data").symlink_to(root / "objects")  # absolute, a directory
    store = make_store(str(root))
    for key in ("manifest.json", "data/blob", "objects/blob"):
        assert store.size(key) == len(payload) and store.exists(key)
        assert store.read_bytes(key, limit=len(payload)) == payload
        out = bytearray(100)
        store.read_into(key, 7, memoryview(out))
        assert bytes(out) == payload[7:107]


def test_a_symlink_loop_is_a_clear_error(tmp_path, make_store):
    root = tmp_path / "ckpt"
    root.mkdir()
    os.symlink("b", root / "a")
    os.symlink("a", root / "b")
    store = make_store(str(root))
    for read in _all_reads(store, "a").values():
        with pytest.raises(CorruptCheckpointError, match=f"{root / 'a'} is a symlink that does not resolve"):
            read()


def test_a_root_that_is_itself_a_symlink_works(tmp_path, make_store):
    real = tmp_path / "disk" / "ckpt"
    (real / "data").mkdir(parents=True)
    (real / "data" / "x").write_bytes(b"0123456789")
    link = tmp_path / "ckpt-link"
    link.symlink_to(real)
    os.symlink(real / "data" / "x", real / "manifest.json")  # inside realpath(root), named through the real path
    store = make_store(str(link))
    assert store.read_bytes("manifest.json") == b"0123456789"
    assert store.size("data/x") == 10
    out = bytearray(4)
    store.read_into("data/x", 3, memoryview(out))
    assert bytes(out) == b"3456"
    assert store.list_keys() == ["data/x", "manifest.json"]


@pytest.mark.parametrize("hostile", ["fifo", "link-out"])
def test_a_tiered_store_reads_the_bucket_when_the_local_copy_is_hostile(tmp_path, hostile):
    payload = bytes(range(256)) * 16
    remote = LocalStore(str(tmp_path / "bucket"))
    remote.write_object("data/x", [payload])
    path = _build(tmp_path / "tier", "data/x")
    if hostile == "fifo":
        os.mkfifo(path)
    else:
        os.symlink(_outside_file(tmp_path), path)
    out = bytearray(1000)
    TieredStore(LocalStore(str(tmp_path / "tier")), remote, remote_only=()).read_into("data/x", 3, memoryview(out))
    assert bytes(out) == payload[3:1003]


# ------------------------------------------------------------------ size limits

LIMITED = {
    **ENGINES,
    "tiered": lambda root: TieredStore(LocalStore(root), LocalStore(root), remote_only={"manifest.json"}),
}


@pytest.mark.parametrize("engine", list(LIMITED))
@pytest.mark.parametrize("key", ["manifest.json", "index/rank-00000.json"])
def test_read_bytes_limit_is_the_largest_size_accepted(tmp_path, engine, key):
    store = LIMITED[engine](str(tmp_path / "ckpt"))
    data = b"{" + b" " * 998 + b"}"
    store.put_bytes(key, data)
    assert store.read_bytes(key, limit=len(data)) == data
    assert store.read_bytes(key, limit=10 * len(data)) == data
    with pytest.raises(TooLargeError, match=f"{key} is 1000 bytes, over the 999-byte limit"):
        store.read_bytes(key, limit=len(data) - 1)
    store.put_bytes("empty", b"")
    assert store.read_bytes("empty", limit=0) == b""


@pytest.mark.parametrize("engine", list(LIMITED))
def test_a_huge_sparse_manifest_is_refused_without_reading_it(tmp_path, engine):
    root = tmp_path / "ckpt"
    root.mkdir()
    subprocess.run(["truncate", "-s", "8G", str(root / "manifest.json")], check=True)
    store = LIMITED[engine](str(root))
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(TooLargeError, match=r"manifest.json is 8589934592 bytes, over the 1048576-byte limit"):
            store.read_bytes("manifest.json", limit=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.monotonic() - t0 < HANG_S
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse it"


def test_a_file_that_grows_while_read_cannot_pass_the_limit(tmp_path):
    """fstat said small, the file then grew: at most limit + 1 bytes are read, then it is refused."""
    path = tmp_path / "manifest.json"
    path.write_bytes(b"x" * 5000)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(TooLargeError, match="grew past the 1000-byte limit while being read"):
            _read_capped(fd, str(path), 10, 1000)  # 10: the size fstat reported before it grew
        assert os.lseek(fd, 0, os.SEEK_CUR) == 1001  # no more than limit + 1 bytes were taken
        os.lseek(fd, 0, os.SEEK_SET)
        assert _read_capped(fd, str(path), 10, 5000) == b"x" * 5000
    finally:
        os.close(fd)
