from __future__ import annotations

import json
import random
import time

import pytest

from ckptkit.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError, TooLargeError
from ckptkit.storage import open_store
from ckptkit.storage.s3 import SHORT_READ_RETRIES, S3Store
from tests.fault_proxy import FaultProxy, Faults
from tests.s3_server import s3_env, s3_server  # noqa: F401 - fixtures
from tests.store_conformance import PagedListingTests, S3Backdoor, StoreTests, Subject


pytestmark = pytest.mark.timeout(120)  # a hang fails the test instead of stalling the suite


class TestS3Store(PagedListingTests, StoreTests):
    @pytest.fixture
    def subject(self, s3_env, s3_server):  # noqa: F811
        return Subject(open_store(f"s3://{s3_env}/runs/exp1"), S3Backdoor(s3_server.client(), s3_env, "runs/exp1"))


class TestS3StoreMultipart(StoreTests):
    """Tiny parts force multipart uploads with several parts in flight; the streaming check writes
    three parts from one reused buffer."""

    stream_size = (12 << 20) + 12345
    stream_largest_chunk = 3 << 20
    range_examples = 20

    @pytest.fixture
    def subject(self, s3_env, s3_server):  # noqa: F811
        store = S3Store(f"s3://{s3_env}/mp", part_size=5 << 20, max_concurrency=3)
        return Subject(store, S3Backdoor(s3_server.client(), s3_env, "mp"))

    def test_large_object_in_many_parts(self, store, raw, s3_env, s3_server):  # noqa: F811
        payload = bytes(range(256)) * (23 * 4096 + 7)  # ~24 MiB: 5 parts
        chunks = [memoryview(payload)[i:i + 3_000_001] for i in range(0, len(payload), 3_000_001)]
        assert store.write_object("big.bin", chunks) == len(payload)
        assert raw.get("big.bin") == payload
        assert s3_server.client().head_object(Bucket=s3_env, Key="mp/big.bin")["ETag"].strip('"').endswith("-5")
        out = bytearray(10_000_000)
        store.read_into("big.bin", 5_000_000, memoryview(out))
        assert bytes(out) == payload[5_000_000:15_000_000]

    def test_a_failed_source_aborts_the_multipart_upload(self, store, raw, s3_env, s3_server):  # noqa: F811
        def failing():
            yield bytes(6 << 20)  # one whole part is in flight when the source fails
            raise RuntimeError("staging failed")

        with pytest.raises(RuntimeError, match="staging failed"):
            store.write_object("half.bin", failing())
        assert raw.get("half.bin") is None
        assert s3_server.client().list_multipart_uploads(Bucket=s3_env).get("Uploads", []) == []


class TestTensorstoreEngineOnS3(StoreTests):
    range_examples = 25

    @pytest.fixture
    def subject(self, s3_env, s3_server):  # noqa: F811
        return Subject(open_store(f"s3://{s3_env}/ts", {"io_engine": "tensorstore"}),
                       S3Backdoor(s3_server.client(), s3_env, "ts"))

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


# ------------------------------------------------------------------ broken answers, through the fault proxy
# A GET whose body breaks off (or comes short) after botocore accepted its headers is retried by the
# store, and when it keeps breaking is a StorageError: never short data, never "missing" or "truncated"
# (which would make a restore skip a good checkpoint). The objects are put straight into the server;
# only the reads under test go through tests/fault_proxy.py.

MANIFEST = json.dumps({"format": 1, "objects": {f"data/rank-{i:05d}.bin": i * 4096 for i in range(4000)}}).encode()
DATA = random.Random(0).randbytes(3 << 20)
GETS_OF_MANIFEST = {"methods": frozenset({"GET"}), "path": r"manifest\.json"}
RANGED_GETS = {"methods": frozenset({"GET"}), "header": "range"}


@pytest.fixture
def proxy(s3_server):  # noqa: F811
    with FaultProxy(s3_server.endpoint) as p:
        yield p


@pytest.fixture
def stored(s3_env, s3_server, proxy):  # noqa: F811
    """A manifest-sized and a data object in the bucket, and a store that reads them through the proxy
    with botocore's retries lowered (its own backoff would make the persistent cases slow)."""
    client = s3_server.client()
    client.put_object(Bucket=s3_env, Key="c/manifest.json", Body=MANIFEST)
    client.put_object(Bucket=s3_env, Key="c/data/rank-00000.bin", Body=DATA)
    options = {"endpoint_url": proxy.endpoint, "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}}}
    return S3Store(f"s3://{s3_env}/c", options)


def _first(fault: str, **where) -> Faults:
    if fault == "503":
        return Faults(error=1.0, statuses=(503,), limit=1, **where)
    return Faults(**{fault: 1.0}, limit=1, **where)


@pytest.mark.parametrize(("fault", "nth"), [("truncate", 1), ("truncate", 2), ("reset", 1), ("drop_after", 1),
                                          ("drop_after", 2), ("drop_before", 1), ("503", 1)])
def test_read_bytes_returns_the_exact_object_after_a_broken_answer(stored, proxy, fault, nth):
    """The ``nth`` GET of the manifest is broken (cut mid-body, reset, lost, refused): every read
    still returns the exact bytes."""
    proxy.set(_first(fault, skip=nth - 1, **GETS_OF_MANIFEST))
    for _ in range(nth):
        assert stored.read_bytes("manifest.json", limit=1 << 20) == MANIFEST
    assert [e[0] for e in proxy.events] == [fault], proxy.events


@pytest.mark.parametrize("fault", ["truncate", "reset", "short", "drop_after"])
def test_ranged_reads_return_the_exact_bytes_after_a_broken_answer(stored, proxy, fault):
    proxy.set(_first(fault, **RANGED_GETS))
    out = bytearray(1 << 20)
    stored.read_into("data/rank-00000.bin", 12345, memoryview(out))
    assert bytes(out) == DATA[12345:12345 + len(out)]
    proxy.set(_first(fault, **RANGED_GETS))
    bufs = [bytearray(1000), bytearray(0), bytearray(70_000)]
    stored.read_into_vectored("data/rank-00000.bin", 99, [memoryview(b) for b in bufs])
    assert b"".join(bufs) == DATA[99:99 + 71_000]
    assert [e[0] for e in proxy.events] == [fault, fault], proxy.events


# The persistent-fault tests prove a bounded failure, not a speed: the retries here take ~0.4 s of backoff,
# while the failures they guard against take far longer: botocore's default retries (~2 minutes) or a read
# that waits out botocore's 60 s read timeout. 30 s tells those apart on a loaded 2-core machine (10 s did
# not: CI once took 10.04 s, most of it before the first request reached the server).
HANG_S = 30


def _fails_as_a_read_error(read, key: str) -> float:
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=f"{key}.*could not be read") as info:
        read()
    assert not isinstance(info.value, (CorruptCheckpointError, CheckpointNotFoundError)), repr(info.value)
    return time.monotonic() - t0


@pytest.mark.parametrize("fault", ["truncate", "reset"])
def test_read_bytes_that_keeps_breaking_is_a_storage_error_in_bounded_time(stored, proxy, fault):
    assert stored.read_bytes("manifest.json") == MANIFEST  # the client starts outside the timed part
    proxy.set(Faults(**{fault: 1.0}, **GETS_OF_MANIFEST))
    elapsed = _fails_as_a_read_error(lambda: stored.read_bytes("manifest.json"), "manifest.json")
    assert elapsed < HANG_S, elapsed
    assert proxy.counts[fault] == SHORT_READ_RETRIES + 1  # each attempt hit the body fault


@pytest.mark.parametrize("fault", ["truncate", "reset", "short"])
def test_a_ranged_read_that_keeps_breaking_is_a_storage_error_in_bounded_time(stored, proxy, fault):
    out = memoryview(bytearray(200_000))
    stored.read_into("data/rank-00000.bin", 5, out)  # the client starts outside the timed part
    proxy.set(Faults(**{fault: 1.0}, **RANGED_GETS))
    elapsed = _fails_as_a_read_error(lambda: stored.read_into("data/rank-00000.bin", 5, out), "data/rank-00000.bin")
    assert elapsed < HANG_S, elapsed
    assert proxy.counts[fault] == SHORT_READ_RETRIES + 1


def test_only_the_servers_answer_makes_a_ranged_read_truncated(stored, proxy):
    proxy.set(Faults(truncate=1.0, limit=1, **RANGED_GETS))  # a cut answer first, then the server's own
    truncated = f"truncated: needed bytes up to {len(DATA) + 10}, it has {len(DATA)}"
    with pytest.raises(CorruptCheckpointError, match=truncated):
        stored.read_into("data/rank-00000.bin", len(DATA) - 10, memoryview(bytearray(20)))
    with pytest.raises(CorruptCheckpointError, match="missing"):
        stored.read_into("data/gone.bin", 0, memoryview(bytearray(20)))


def test_limit_refuses_a_large_object_without_taking_its_body(stored, proxy):
    """The proxy holds each body back for 6 s after the headers: the refusal comes from the
    declared Content-Length, and the client hangs up instead of waiting for the body (the hold is
    long so that a loaded machine cannot blur the two: a 1.5 s hold failed once under load)."""
    proxy.set(Faults(hold=6.0, methods=frozenset({"GET"}), path=r"rank-00000\.bin"))
    t0 = time.monotonic()
    refusal = rf"{stored.url}/data/rank-00000\.bin is {len(DATA)} bytes, over the 1048576-byte limit"
    with pytest.raises(TooLargeError, match=refusal):
        stored.read_bytes("data/rank-00000.bin", limit=1 << 20)
    assert time.monotonic() - t0 < 5.5
    deadline = time.monotonic() + 3  # the proxy notices the hang-up a moment after the client moved on
    while not proxy.counts["abandoned"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proxy.counts["abandoned"] == 1 and proxy.counts["requests"] == 1, dict(proxy.counts)
    assert stored.read_bytes("data/rank-00000.bin", limit=len(DATA)) == DATA  # waits for the held body
    assert proxy.counts["abandoned"] == 1


def test_size_errors_other_than_absence_are_storage_errors(stored, proxy):
    """Only a 404 means absent: a HEAD that fails otherwise must not make a checkpoint look uncommitted."""
    store = S3Store(stored.url, {"endpoint_url": proxy.endpoint,
                                 "config_kwargs": {"retries": {"max_attempts": 0, "mode": "standard"}}})
    proxy.set(Faults(error=1.0, statuses=(503,), methods=frozenset({"HEAD"})))
    with pytest.raises(StorageError, match="inspecting manifest.json.*503"):
        store.size("manifest.json")
    with pytest.raises(StorageError, match="inspecting gone.json"):
        store.exists("gone.json")
    proxy.set()
    assert store.size("manifest.json") == len(MANIFEST) and store.size("gone.json") is None
