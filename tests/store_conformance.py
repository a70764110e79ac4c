"""One conformance suite every byte-store backend passes (subclass and provide ``make_store``)."""

from __future__ import annotations

import threading

import pytest

from ckptkit.errors import CheckpointNotFoundError, CorruptCheckpointError, TooLargeError
from ckptkit.storage.base import ByteStore


class StoreTests:
    def make_store(self, tmp_path) -> ByteStore:  # pragma: no cover - overridden
        raise NotImplementedError

    @pytest.fixture
    def store(self, tmp_path):
        return self.make_store(tmp_path)

    def test_streamed_object_round_trip(self, store):
        chunks = [b"abc", memoryview(bytearray(b"defgh")), b"", bytes(range(256)) * 64]
        n = store.write_object("data/rank-00000.bin", chunks)
        expected = b"".join(bytes(c) for c in chunks)
        assert n == len(expected)
        assert store.size("data/rank-00000.bin") == len(expected)
        assert store.read_bytes("data/rank-00000.bin") == expected
        out = bytearray(100)
        store.read_into("data/rank-00000.bin", 5, memoryview(out))
        assert bytes(out) == expected[5:105]

    def test_vectored_read_scatters_consecutive_bytes(self, store):
        payload = bytes(range(256)) * 40
        store.write_object("o", [payload])
        bufs = [bytearray(3), bytearray(0), bytearray(5000), bytearray(7)]
        store.read_into_vectored("o", 11, [memoryview(b) for b in bufs])
        assert b"".join(bufs) == payload[11:11 + 5010]
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            store.read_into_vectored("o", len(payload) - 4, [memoryview(bytearray(2)), memoryview(bytearray(4))])

    def test_short_read_is_corruption(self, store):
        store.write_object("o", [b"12345"])
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            store.read_into("o", 3, memoryview(bytearray(5)))
        with pytest.raises(CorruptCheckpointError, match="missing"):
            store.read_into("nope", 0, memoryview(bytearray(1)))

    def test_missing_objects(self, store):
        assert store.size("a/b") is None
        assert not store.exists("a/b")
        with pytest.raises(CheckpointNotFoundError):
            store.read_bytes("a/b")

    def test_read_bytes_limit(self, store):
        """``limit`` is the largest size accepted; over it, TooLargeError naming the object and both sizes."""
        data = bytes(range(256)) * 4
        store.put_bytes("index/rank-00000.json", data)
        assert store.read_bytes("index/rank-00000.json", limit=len(data)) == data
        assert store.read_bytes("index/rank-00000.json", limit=None) == data
        with pytest.raises(TooLargeError, match=r"index/rank-00000\.json is 1024 bytes, over the 1023-byte limit"):
            store.read_bytes("index/rank-00000.json", limit=len(data) - 1)
        store.put_bytes("empty", b"")
        assert store.read_bytes("empty", limit=0) == b""
        with pytest.raises(CheckpointNotFoundError):
            store.read_bytes("nope", limit=10)

    def test_put_bytes_replaces(self, store):
        store.put_bytes("index/x.json", b"one")
        store.put_bytes("index/x.json", b"two")
        assert store.read_bytes("index/x.json") == b"two"

    def test_put_if_absent_has_one_winner(self, store):
        results = []

        def attempt(i: int) -> None:
            results.append((i, store.put_if_absent("manifest.json", f"writer {i}".encode())))

        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [i for i, ok in results if ok]
        assert len(winners) == 1
        assert store.read_bytes("manifest.json") == f"writer {winners[0]}".encode()
        assert store.put_if_absent("manifest.json", b"late") is False
        assert store.read_bytes("manifest.json") == f"writer {winners[0]}".encode()
        assert [k for k in store.list_keys() if "tmp" in k] == []  # no temporaries left behind

    def test_listing_and_deletion(self, store):
        for key in ("b/2", "a/1", "a/sub/3", "top"):
            store.put_bytes(key, b"x")
        assert store.list_keys() == ["a/1", "a/sub/3", "b/2", "top"]
        assert store.list_keys("a") == ["a/1", "a/sub/3"]
        assert store.list_children() == ["a", "b", "top"]
        child = store.child("a")
        assert child.list_keys() == ["1", "sub/3"]
        assert child.read_bytes("sub/3") == b"x"
        store.delete("top")
        store.delete("top")  # idempotent
        assert not store.exists("top")
        child.delete_all()
        assert store.list_keys() == ["b/2"]
