"""The byte-store contract (ckptkit/storage/base.py), checked the same way for every backend.

In the style of zarr-python's ``StoreTests``: a backend's test class subclasses :class:`StoreTests`
and supplies one fixture, ``subject``, returning the store under test together with a **raw
backdoor** to the same place — the filesystem through ``os``, the bucket through boto3 (and the
moto server's own storage for bulk seeding), or both of those for a tiered store. Every check looks
at what really landed through the backdoor, and seeds what a read should find through it: a store
that only agrees with itself (writes and reads the same wrong key, holds a chunk it was told it
could not keep, lists a sibling) fails here.

Class attributes tune the suite per backend (sizes, how many property examples); keep them small:
the suite runs for every backend on two CPUs. A store that lists in pages (S3's 1000 keys) also
mixes in :class:`PagedListingTests`, which crosses them.
"""

from __future__ import annotations

import array
import os
import random
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptkit.errors import CheckpointNotFoundError, CorruptCheckpointError, TooLargeError
from ckptkit.storage.base import ByteStore
from ckptkit.storage.url import join_url


# ------------------------------------------------------------------ backdoors


class Backdoor(Protocol):
    """What really is at a store's location, read and written without the store under test."""

    def get(self, key: str) -> bytes | None:
        """The object's bytes, None if there is none."""

    def set(self, key: str, data: bytes) -> None:
        """Put an object there (for reads under test to find)."""

    def seed_many(self, items: dict[str, bytes]) -> None:
        """Put many objects there, as fast as the backend allows."""

    def keys(self) -> list[str]:
        """Every object under the root, temporaries included, relative to it, sorted."""

    def remove(self, key: str) -> None:
        """Remove an object if it is there."""

    def dirs(self) -> list[str]:
        """Directories at and under the root (``""`` is the root), sorted; [] where there are none."""

    def tiers(self) -> list[Backdoor]:
        """The plain backdoors behind this one (itself, or a tiered store's two)."""


class FsBackdoor:
    """The filesystem under ``root``, through os only."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.fspath(root)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        if not os.path.isfile(path):
            return None
        with open(path, "rb") as f:
            return f.read()

    def set(self, key: str, data: bytes) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    def seed_many(self, items: dict[str, bytes]) -> None:
        for key, data in items.items():
            self.set(key, data)

    def keys(self) -> list[str]:
        out = []
        for dirpath, _, files in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            out += [f if rel == "." else f"{rel.replace(os.sep, '/')}/{f}" for f in files]
        return sorted(out)

    def remove(self, key: str) -> None:
        try:
            os.remove(self._path(key))
        except FileNotFoundError:
            pass

    def dirs(self) -> list[str]:
        out = []
        for dirpath, _, _ in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            out.append("" if rel == "." else rel.replace(os.sep, "/"))
        return sorted(out)

    def tiers(self) -> list[Backdoor]:
        return [self]


class S3Backdoor:
    """Objects under ``bucket/prefix/``, through boto3 against the moto server (no ckptkit code)."""

    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client, self.bucket, self.prefix = client, bucket, prefix.strip("/")

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def get(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def set(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def seed_many(self, items: dict[str, bytes]) -> None:
        """Straight into the in-process moto server's storage: a thousand PUTs would cost seconds,
        and only the reads and listings under test need to go over HTTP."""
        try:
            from moto.core import DEFAULT_ACCOUNT_ID
            from moto.s3.models import s3_backends

            backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
        except (ImportError, KeyError):  # pragma: no cover - another moto layout: the slow way
            for key, data in items.items():
                self.set(key, data)
            return
        for key, data in items.items():
            backend.put_object(self.bucket, self._key(key), data)

    def keys(self) -> list[str]:
        root = f"{self.prefix}/" if self.prefix else ""
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=root)
        return sorted(o["Key"][len(root):] for page in pages for o in page.get("Contents", []))

    def remove(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def dirs(self) -> list[str]:
        return []

    def tiers(self) -> list[Backdoor]:
        return [self]


class TieredBackdoor:
    """A tiered store's two locations. ``get`` and ``keys`` also check the tiers agree: every
    object in both, the authoritative (``remote_only``) ones in the remote tier only."""

    def __init__(self, local: Backdoor, remote: Backdoor, remote_only: Iterable[str]) -> None:
        self.local, self.remote, self.remote_only = local, remote, frozenset(remote_only)

    def _only_remote(self, key: str) -> bool:
        return key in self.remote_only  # exact keys, as the store matches them

    def get(self, key: str) -> bytes | None:
        remote, local = self.remote.get(key), self.local.get(key)
        if self._only_remote(key):
            assert local is None, f"authoritative {key!r} landed in the local tier"
        else:
            assert local == remote, f"{key!r}: local tier {_show(local)}, remote tier {_show(remote)}"
        return remote

    def set(self, key: str, data: bytes) -> None:
        self.remote.set(key, data)
        if not self._only_remote(key):
            self.local.set(key, data)

    def seed_many(self, items: dict[str, bytes]) -> None:
        self.remote.seed_many(items)
        self.local.seed_many({k: v for k, v in items.items() if not self._only_remote(k)})

    def keys(self) -> list[str]:
        remote, local = self.remote.keys(), self.local.keys()
        assert set(local) == {k for k in remote if not self._only_remote(k)}, (local, remote)
        return remote

    def remove(self, key: str) -> None:
        self.remote.remove(key)
        self.local.remove(key)

    def dirs(self) -> list[str]:
        return sorted(set(self.local.dirs()) | set(self.remote.dirs()))

    def tiers(self) -> list[Backdoor]:
        return [self.local, self.remote]


def _show(data: bytes | None) -> str:
    return "nothing" if data is None else f"{len(data)} bytes {data[:16]!r}..."


@dataclass(frozen=True)
class Subject:
    """A store under test and the backdoor to the place it stores in."""

    store: ByteStore
    raw: Backdoor


# ------------------------------------------------------------------ chunk sources


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def split(data: bytes, largest: int, seed: int = 1) -> list[bytes]:
    """``data`` in pieces of random sizes (empty ones included) up to ``largest``."""
    rng, parts, pos = random.Random(seed), [], 0
    while pos < len(data):
        n = rng.choice([0, 1, rng.randint(1, largest), largest])
        parts.append(data[pos:pos + n])
        pos += n
    return parts


def reusing(parts: list[bytes], done: list[str]) -> Iterator[memoryview]:
    """Every part from one buffer: once the store asks for the next chunk (the streaming promise
    says it is done with this one) the buffer is scribbled over, then refilled. A store that kept
    a reference to an earlier chunk stores the scribble."""
    buf = bytearray(max(map(len, parts), default=0))
    scribble = b"\xa5" * len(buf)
    for part in parts:
        view = memoryview(buf)[: len(part)]
        view[:] = part
        yield view
        buf[:] = scribble
    done.append("exhausted")


def fresh(parts: list[bytes], done: list[str]) -> Iterator[memoryview]:
    """Every part in its own buffer, never touched again: what a store that holds chunks needs."""
    for part in parts:
        yield memoryview(bytearray(part))
    done.append("exhausted")


class SourceFailed(Exception):
    """Raised by a chunk iterator: ``write_object`` must let it through unchanged."""


# ------------------------------------------------------------------ the suite


class StoreTests:
    """The contract; subclasses provide the ``subject`` fixture."""

    object_size = 48 << 10  # ranged-read property test
    stream_size = 256 << 10  # streaming-writes test
    stream_largest_chunk = 40 << 10
    range_examples = 40
    has_fallback = False

    @pytest.fixture
    def subject(self, tmp_path) -> Subject:  # pragma: no cover - overridden
        raise NotImplementedError

    @pytest.fixture
    def store(self, subject) -> ByteStore:
        return subject.store

    @pytest.fixture
    def raw(self, subject) -> Backdoor:
        return subject.raw

    # -------------------------------------------------------------- writes
    def test_write_object_lands_whole_under_its_key(self, store, raw):
        doubles = array.array("d", [1.5, -2.25, 3e300])  # not a byte-format buffer
        chunks = [b"abc", memoryview(bytearray(b"defgh")), b"", memoryview(doubles), bytes(range(256)) * 64]
        expected = b"".join(memoryview(c).cast("B").tobytes() for c in chunks)
        assert store.write_object("data/x/rank-00000.bin", chunks) == len(expected)
        assert raw.get("data/x/rank-00000.bin") == expected
        assert raw.keys() == ["data/x/rank-00000.bin"]  # nothing else: no temporaries, no stray key
        assert store.size("data/x/rank-00000.bin") == len(expected)
        assert store.write_object("data/x/rank-00000.bin", [b"shorter"]) == 7  # replaced, not overlaid
        assert raw.get("data/x/rank-00000.bin") == b"shorter"
        assert store.write_object("empty.bin", iter([])) == 0
        assert raw.get("empty.bin") == b"" and store.read_bytes("empty.bin") == b""

    def test_streaming_writes_contract(self, store, raw):
        """streams_writes True: done with each chunk before taking the next, so a source that
        reuses one buffer still stores the intended bytes. False: it may hold every chunk, so it
        gets fresh buffers — and must store them exactly."""
        data = payload(self.stream_size, seed=3)
        parts = split(data, self.stream_largest_chunk)
        done: list[str] = []
        source = reusing(parts, done) if store.streams_writes else fresh(parts, done)
        assert store.write_object("data/streamed.bin", source) == len(data)
        assert done == ["exhausted"]
        got = raw.get("data/streamed.bin")
        assert got is not None and len(got) == len(data)
        assert got == data, f"first difference at byte {next(i for i, (a, b) in enumerate(zip(got, data)) if a != b)}"

    def test_an_error_from_the_chunk_source_propagates_unchanged(self, store, raw):
        def failing() -> Iterator[bytes]:
            yield b"x" * 1000
            raise SourceFailed("the tensor could not be staged")

        with pytest.raises(SourceFailed, match="could not be staged"):
            store.write_object("data/failed.bin", failing())
        assert store.write_object("data/next.bin", [b"ok"]) == 2  # the store is still usable
        assert raw.get("data/next.bin") == b"ok"

    def test_put_bytes_replaces_atomically(self, store, raw):
        """A reader of the real location sees one whole version at any moment, never a mix."""
        versions = [bytes([i]) * (64 << 10) for i in range(8)]
        store.put_bytes("index/x.json", versions[0])
        seen: list[bytes | None] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                seen.extend(t.get("index/x.json") for t in raw.tiers())

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            for v in versions[1:]:
                store.put_bytes("index/x.json", v)
        finally:
            stop.set()
            watcher.join()
        assert all(s in versions for s in seen), {len(s) if s else s for s in seen if s not in versions}
        assert raw.get("index/x.json") == versions[-1]
        assert raw.keys() == ["index/x.json"]  # the temporaries are gone

    def test_put_if_absent_never_overwrites(self, store, raw):
        for key in ("manifest.json", "index/lease.json"):
            raw.set(key, b"theirs")
            assert store.put_if_absent(key, b"mine") is False
            assert raw.get(key) == b"theirs"
        assert store.put_if_absent("a/new.json", b"first") is True
        assert raw.get("a/new.json") == b"first"
        assert store.put_if_absent("a/new.json", b"second") is False
        assert raw.get("a/new.json") == b"first"

    def test_racing_put_if_absent_has_exactly_one_winner(self, store, raw):
        n = 8
        start = threading.Barrier(n)
        results: dict[int, bool] = {}

        def attempt(i: int) -> None:
            start.wait()
            results[i] = store.put_if_absent("manifest.json", f"writer {i}".encode())

        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [i for i, ok in results.items() if ok]
        assert len(results) == n and len(winners) == 1, results
        assert raw.get("manifest.json") == f"writer {winners[0]}".encode()
        assert raw.keys() == ["manifest.json"]  # no temporaries left behind

    # -------------------------------------------------------------- reads
    def test_ranged_reads_of_arbitrary_spans(self, store, raw):
        """read_into / read_into_vectored of any span: exactly those bytes, nothing else of the
        buffers touched; past the end, CorruptCheckpointError 'truncated'; zero bytes, a no-op."""
        data = payload(self.object_size, seed=7)
        size = len(data)
        raw.set("data/obj.bin", data)  # seeded behind the store's back: reads must find it

        @settings(max_examples=self.range_examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(offset=st.integers(0, size + 64), lengths=st.lists(st.integers(0, size // 3), min_size=1, max_size=5),
               vectored=st.booleans(), pad=st.integers(0, 7))
        def check(offset: int, lengths: list[int], vectored: bool, pad: int) -> None:
            if not vectored:
                lengths = lengths[:1]
            total = sum(lengths)
            # each buffer a window into a larger, sentinel-filled one: bytes outside must not change
            backing = [bytearray(b"\xee" * (n + 2 * pad)) for n in lengths]
            views = [memoryview(b)[pad:pad + n] for b, n in zip(backing, lengths)]
            read = (lambda: store.read_into_vectored("data/obj.bin", offset, views)) if vectored else (
                lambda: store.read_into("data/obj.bin", offset, views[0]))
            if total and offset + total > size:
                with pytest.raises(CorruptCheckpointError, match="truncated") as info:
                    read()
                assert not isinstance(info.value, CheckpointNotFoundError)
                return
            read()
            assert b"".join(v.tobytes() for v in views) == (data[offset:offset + total] if total else b"")
            assert all(b[:pad] == b[len(b) - pad:] == b"\xee" * pad for b in backing)

        check()

    def test_short_and_missing_objects_give_the_declared_errors(self, store, raw):
        raw.set("o", b"12345")
        raw.set("dir/inside", b"x")
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            store.read_into("o", 3, memoryview(bytearray(5)))
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            store.read_into_vectored("o", 2, [memoryview(bytearray(2)), memoryview(bytearray(2))])
        for key in ("nope", "dir"):  # nothing there; a prefix, which is not an object
            assert store.size(key) is None and not store.exists(key)
            with pytest.raises(CheckpointNotFoundError):
                store.read_bytes(key)
            with pytest.raises(CheckpointNotFoundError):
                store.read_bytes(key, limit=10)
            for read in (lambda k=key: store.read_into(k, 0, memoryview(bytearray(1))),
                         lambda k=key: store.read_into_vectored(k, 0, [memoryview(bytearray(1))]),
                         lambda k=key: store.checked_size(k)):
                with pytest.raises(CorruptCheckpointError) as info:  # an object the index lists is gone
                    read()
                assert not isinstance(info.value, CheckpointNotFoundError), repr(info.value)
        assert store.checked_size("o") == 5 and store.size("o") == 5
        store.read_into("nope", 0, memoryview(bytearray(0)))  # zero bytes: nothing asked, nothing checked

    def test_read_bytes_limit(self, store, raw):
        """``limit`` is the largest size accepted; over it, TooLargeError naming the object and both sizes."""
        data = bytes(range(256)) * 4
        raw.set("index/rank-00000.json", data)
        assert store.read_bytes("index/rank-00000.json", limit=len(data)) == data
        assert store.read_bytes("index/rank-00000.json", limit=None) == data
        assert store.read_bytes("index/rank-00000.json") == data
        with pytest.raises(TooLargeError, match=r"index/rank-00000\.json is 1024 bytes, over the 1023-byte limit") as info:
            store.read_bytes("index/rank-00000.json", limit=len(data) - 1)
        assert isinstance(info.value, CorruptCheckpointError)
        raw.set("empty", b"")
        assert store.read_bytes("empty", limit=0) == b""

    # -------------------------------------------------------------- listing, deletion
    SEEDED = ("a/1", "a/sub/3", "a/sub/deeper/4", "ab/2", "a-b", "b/2", "top")

    def test_listing_on_key_boundaries(self, store, raw):
        assert store.list_keys() == [] and store.list_children() == []
        for key in self.SEEDED:
            raw.set(key, key.encode())
        assert store.list_keys() == sorted(self.SEEDED)
        assert store.list_keys("a") == store.list_keys("a/") == ["a/1", "a/sub/3", "a/sub/deeper/4"]
        assert store.list_keys("a/sub") == ["a/sub/3", "a/sub/deeper/4"]
        assert store.list_keys("top") == ["top"]  # an object is its own listing
        assert store.list_keys("to") == [] and store.list_keys("nope") == []  # no partial names
        assert store.list_children() == ["a", "a-b", "ab", "b", "top"]
        child = store.child("a")
        assert child.url == join_url(store.url, "a")
        assert child.list_keys() == ["1", "sub/3", "sub/deeper/4"]  # not ab/2 nor a-b: siblings
        assert child.list_children() == ["1", "sub"]
        assert child.child("sub").read_bytes("deeper/4") == b"a/sub/deeper/4"
        assert store.child("a/sub").list_keys() == ["3", "deeper/4"]

    def test_children_write_under_their_own_root(self, store, raw):
        store.child("a").child("b").put_bytes("k", b"1")
        store.child("a").write_object("b/data", [b"2"])
        assert raw.keys() == ["a/b/data", "a/b/k"]
        assert store.read_bytes("a/b/k") == b"1"

    def test_deletion(self, store, raw):
        for key in self.SEEDED:
            raw.set(key, b"x")
        store.delete("top")
        store.delete("top")  # idempotent
        store.delete("a")  # a prefix is not an object: nothing goes
        assert raw.get("top") is None and not store.exists("top")
        assert raw.keys() == sorted(set(self.SEEDED) - {"top"})
        store.child("a").delete_all()
        assert raw.keys() == ["a-b", "ab/2", "b/2"]  # siblings sharing leading characters stay
        store.delete_all()
        assert raw.keys() == [] and store.list_children() == [] and not store.is_dir()

    def test_prune_empty_removes_directories_and_never_objects(self, store, raw):
        assert not store.is_dir()  # nothing there yet
        raw.set("keep/x", b"1")
        raw.set("gone/deep/y", b"2")
        assert store.is_dir()
        store.delete("gone/deep/y")
        store.prune_empty()
        assert raw.keys() == ["keep/x"]
        assert all(not d.startswith("gone") for d in raw.dirs()), raw.dirs()
        assert store.read_bytes("keep/x") == b"1"
        store.delete("keep/x")
        store.prune_empty()
        assert raw.dirs() == [] and not store.is_dir()

    # -------------------------------------------------------------- capabilities
    def test_declared_capabilities(self, store):
        assert isinstance(store.streams_writes, bool)
        assert (store.fallback is not None) == self.has_fallback
        if store.fallback is not None:
            assert isinstance(store.fallback, ByteStore)


class PagedListingTests:
    """Listings and deletions that cross an object store's pages (S3: 1000 keys a listing page and a
    batch delete). Mixed in beside :class:`StoreTests` by the classes whose store lists in pages, so a
    local directory, which has none, never collects this case (instead of collecting it to skip it)."""

    many_keys = 1001  # two listing pages, two batch deletes

    def test_many_keys_cross_listing_and_deletion_pages(self, store: ByteStore, raw: Backdoor) -> None:
        names = [f"k-{i:05d}" for i in range(self.many_keys)]
        raw.seed_many({f"many/{n}": b"" for n in names} | {"other": b"o"})
        assert store.list_keys("many") == [f"many/{n}" for n in names]
        assert store.child("many").list_children() == names
        assert store.list_children() == ["many", "other"]
        store.child("many").delete_all()
        assert raw.keys() == ["other"]
