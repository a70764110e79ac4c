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

    def test_objects_over_the_single_put_limit_go_up_in_parts(self, s3_env, s3_server):  # noqa: F811
        from ckptkit.storage.tensorstore_kv import TensorstoreStore

        store = TensorstoreStore(S3Store(f"s3://{s3_env}/limit", part_size=5 << 20, max_concurrency=2))
        store._single_put_limit = 8 << 20  # S3's is 5 GiB; the same rule at a testable size
        big, small = bytes(range(256)) * (12 * 4096), b"x" * 1000  # 12 MiB, 1 KB
        assert store.write_object("big.bin", [memoryview(big)[: 7 << 20], memoryview(big)[7 << 20:]]) == len(big)
        assert store.write_object("small.bin", [small]) == len(small)
        etag = {k: s3_server.client().head_object(Bucket=s3_env, Key=f"limit/{k}")["ETag"] for k in ("big.bin", "small.bin")}
        assert etag["big.bin"].strip('"').endswith("-3")  # a multipart upload of 3 parts
        assert "-" not in etag["small.bin"]  # one PUT through tensorstore
        out = bytearray(len(big))
        store.read_into("big.bin", 0, memoryview(out))
        assert bytes(out) == big


def test_one_client_per_configuration(s3_env, s3_server, monkeypatch):  # noqa: F811
    a, b = open_store(f"s3://{s3_env}/a"), open_store(f"s3://{s3_env}/b")
    assert a.fs is b.fs  # no new botocore session per save or load
    other = open_store(f"s3://{s3_env}/a", {"endpoint_url": s3_server.endpoint})
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "someone-else")
    changed = open_store(f"s3://{s3_env}/a")
    assert len({id(a.fs), id(other.fs), id(changed.fs)}) == 3
