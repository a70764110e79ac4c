from __future__ import annotations

import pytest

from ckptkit.storage import open_store
from ckptkit.storage.s3 import S3Store
from tests.s3_server import s3_env, s3_server  # noqa: F401 - fixtures
from tests.store_conformance import StoreTests


class TestS3Store(StoreTests):
    @pytest.fixture
    def store(self, s3_env):  # noqa: F811
        return open_store(f"s3://{s3_env}/runs/exp1")


class TestS3StoreMultipart(StoreTests):
    """Tiny parts force multipart uploads with several parts in flight."""

    @pytest.fixture
    def store(self, s3_env):  # noqa: F811
        return S3Store(f"s3://{s3_env}/mp", part_size=5 << 20, max_concurrency=3)

    def test_large_object_in_many_parts(self, store):
        payload = bytes(range(256)) * (23 * 4096 + 7)  # ~24 MiB: 5 parts
        chunks = [memoryview(payload)[i:i + 3_000_001] for i in range(0, len(payload), 3_000_001)]
        assert store.write_object("big.bin", chunks) == len(payload)
        assert store.size("big.bin") == len(payload)
        out = bytearray(10_000_000)
        store.read_into("big.bin", 5_000_000, memoryview(out))
        assert bytes(out) == payload[5_000_000:15_000_000]


class TestTensorstoreEngineOnS3(StoreTests):
    @pytest.fixture
    def store(self, s3_env):  # noqa: F811
        return open_store(f"s3://{s3_env}/ts", {"io_engine": "tensorstore"})
