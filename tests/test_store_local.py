from __future__ import annotations

import pytest

from ckptkit.errors import StorageError
from ckptkit.storage import LocalStore, open_store
from tests.store_conformance import StoreTests


class TestLocalStore(StoreTests):
    def make_store(self, tmp_path):
        return LocalStore(str(tmp_path / "root"))


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


class TestTensorstoreEngineLocal(StoreTests):
    def make_store(self, tmp_path):
        return open_store(str(tmp_path / "root"), {"io_engine": "tensorstore"})


def test_unknown_engine_is_a_clear_error(tmp_path):
    with pytest.raises(StorageError, match="unknown io_engine 'fast'"):
        open_store(str(tmp_path), {"io_engine": "fast"})
