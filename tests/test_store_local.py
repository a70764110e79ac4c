from __future__ import annotations

import os

import pytest

from ckptkit.errors import StorageError, UnsafePathError
from ckptkit.storage import LocalStore, open_store
from tests.store_conformance import FsBackdoor, StoreTests, Subject


class TestLocalStore(StoreTests):
    @pytest.fixture
    def subject(self, tmp_path) -> Subject:
        return Subject(LocalStore(str(tmp_path / "root")), FsBackdoor(tmp_path / "root"))


class TestTensorstoreEngineLocal(StoreTests):
    """Data objects through tensorstore's file driver; the backdoor is the filesystem under its base."""

    @pytest.fixture
    def subject(self, tmp_path) -> Subject:
        return Subject(open_store(str(tmp_path / "root"), {"io_engine": "tensorstore"}), FsBackdoor(tmp_path / "root"))


def test_urls_resolve_to_the_local_backend(tmp_path):
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert open_store(f"file://{tmp_path}").url == str(tmp_path)


def test_unknown_protocol_is_a_clear_error():
    with pytest.raises(StorageError, match="protocol 'gopher' is not supported"):
        open_store("gopher://x/y")


def test_os_errors_become_storage_errors(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    store = LocalStore(str(tmp_path / "file" / "ckpt"))
    with pytest.raises(StorageError, match="writing .*data/x"):
        store.write_object("data/x", [b"1"])


def test_unknown_engine_is_a_clear_error(tmp_path):
    with pytest.raises(StorageError, match="unknown io_engine 'fast'"):
        open_store(str(tmp_path), {"io_engine": "fast"})


def test_an_empty_root_directory_is_a_directory(tmp_path):
    """What tells an empty run directory (listed as empty) from a missing one (an error)."""
    (tmp_path / "run").mkdir()
    assert LocalStore(str(tmp_path / "run")).is_dir()
    assert not LocalStore(str(tmp_path / "missing")).is_dir()


@pytest.mark.parametrize("key", ["../outside.bin", "data/../../outside.bin", "/etc/x"])
def test_writes_and_deletes_outside_the_root_are_refused(tmp_path, key):
    store = LocalStore(str(tmp_path / "root"))
    (tmp_path / "outside.bin").write_bytes(b"keep")
    for op in (lambda: store.write_object(key, [b"1"]), lambda: store.put_bytes(key, b"1"),
               lambda: store.put_if_absent(key, b"1"), lambda: store.delete(key)):
        with pytest.raises(UnsafePathError, match="not a relative path inside"):
            op()
    assert (tmp_path / "outside.bin").read_bytes() == b"keep"
    assert not (tmp_path / "root").exists()  # refused before anything was created


def test_every_new_directory_level_is_created(tmp_path):
    store = LocalStore(str(tmp_path / "root"))
    store.put_bytes("a/b/c/d/obj", b"1")
    assert (tmp_path / "root" / "a" / "b" / "c" / "d" / "obj").read_bytes() == b"1"
    store.write_object("a/b/e/obj", [b"2"])  # a sibling level under an existing one
    assert sorted(os.listdir(tmp_path / "root" / "a" / "b")) == ["c", "e"]


def test_the_suite_catches_a_store_that_breaks_the_streaming_promise(tmp_path):
    """The streaming check has teeth: a store that holds chunks (tensorstore's engine joins them
    at the end) but claims to stream stores the scribbled buffer, and the check fails."""
    from ckptkit.storage.tensorstore_kv import TensorstoreStore

    class Liar(TensorstoreStore):
        streams_writes = True

    root = tmp_path / "root"
    with pytest.raises(AssertionError, match="first difference at byte"):
        StoreTests().test_streaming_writes_contract(Liar(LocalStore(str(root))), FsBackdoor(root))
