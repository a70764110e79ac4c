"""TieredStore: the conformance suite over local disk in front of S3 (the moto server) and in front
of another local directory, plus what only a tiered store promises — every object lands in both
tiers, the authoritative keys in the remote tier only, and a damaged local copy never hides the
remote's bytes."""

from __future__ import annotations

import os

import pytest

from ckptkit.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckptkit.storage import LocalStore, open_store
from ckptkit.storage.tiered import TieredStore
from tests.s3_server import s3_env, s3_server  # noqa: F401 - fixtures
from tests.store_conformance import (
    FsBackdoor,
    PagedListingTests,
    S3Backdoor,
    StoreTests,
    Subject,
    TieredBackdoor,
    payload,
    reusing,
    split,
)

pytestmark = pytest.mark.timeout(120)

REMOTE_ONLY = frozenset({"manifest.json"})


def _local_over_local(tmp_path) -> Subject:
    local, remote = tmp_path / "nvme", tmp_path / "bucket"
    store = TieredStore(LocalStore(str(local)), LocalStore(str(remote)), remote_only=REMOTE_ONLY)
    return Subject(store, TieredBackdoor(FsBackdoor(local), FsBackdoor(remote), REMOTE_ONLY))


class TestTieredLocalOverS3(PagedListingTests, StoreTests):
    has_fallback = True
    range_examples = 25

    @pytest.fixture
    def subject(self, tmp_path, s3_env, s3_server):  # noqa: F811
        store = TieredStore(LocalStore(str(tmp_path / "nvme")), open_store(f"s3://{s3_env}/run"), remote_only=REMOTE_ONLY)
        raw = TieredBackdoor(FsBackdoor(tmp_path / "nvme"), S3Backdoor(s3_server.client(), s3_env, "run"), REMOTE_ONLY)
        return Subject(store, raw)


class TestTieredLocalOverLocal(StoreTests):
    has_fallback = True

    @pytest.fixture
    def subject(self, tmp_path) -> Subject:
        return _local_over_local(tmp_path)


# ------------------------------------------------------------------ what only a tiered store promises


@pytest.fixture
def tiered(tmp_path) -> Subject:
    return _local_over_local(tmp_path)


def test_objects_land_in_both_tiers_and_authoritative_keys_in_the_remote_only(tiered):
    store, raw = tiered.store, tiered.raw
    local, remote = raw.tiers()
    store.write_object("data/rank-0.bin", [b"data"])
    store.put_bytes("index/rank-0.json", b"index")
    assert store.put_if_absent("lease.json", b"lease")
    for key, value in (("data/rank-0.bin", b"data"), ("index/rank-0.json", b"index"), ("lease.json", b"lease")):
        assert local.get(key) == remote.get(key) == value, key
    assert store.put_if_absent("manifest.json", b"commit")
    assert remote.get("manifest.json") == b"commit" and local.get("manifest.json") is None
    store.put_bytes("manifest.json", b"replaced")  # every write of it: the remote tier only
    store.write_object("manifest.json", [b"streamed"])
    assert remote.get("manifest.json") == b"streamed" and local.get("manifest.json") is None


def test_children_keep_the_authoritative_keys(tiered):
    step = tiered.store.child("step-0000003")
    assert step.remote_only == REMOTE_ONLY
    assert step.put_if_absent("manifest.json", b"commit")
    step.put_bytes("index/rank-0.json", b"index")
    local, remote = tiered.raw.tiers()
    assert remote.get("step-0000003/manifest.json") == b"commit"
    assert local.keys() == ["step-0000003/index/rank-0.json"]


def test_a_local_copy_of_an_authoritative_key_is_never_read(tiered):
    """A manifest left in the local tier (an older version, a crashed save) is not a commit."""
    store, (local, _) = tiered.store, tiered.raw.tiers()
    local.set("manifest.json", b"stale")
    with pytest.raises(CheckpointNotFoundError):
        store.read_bytes("manifest.json")
    with pytest.raises(CorruptCheckpointError, match="missing"):
        store.read_into("manifest.json", 0, memoryview(bytearray(3)))
    assert store.size("manifest.json") is None
    assert store.put_if_absent("manifest.json", b"commit")  # the remote tier decides
    assert store.read_bytes("manifest.json") == b"commit"
    out = bytearray(3)
    store.read_into("manifest.json", 1, memoryview(out))
    assert bytes(out) == b"omm"


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_ranged_reads_go_to_the_remote_when_the_local_copy_is_missing_or_short(tiered, damage):
    store, (local, _) = tiered.store, tiered.raw.tiers()
    data = payload(10_000)
    store.write_object("data/rank-0.bin", [data])
    if damage == "missing":
        local.remove("data/rank-0.bin")
    else:
        local.set("data/rank-0.bin", data[:5000])
    out = bytearray(3000)
    store.read_into("data/rank-0.bin", 4000, memoryview(out))
    assert bytes(out) == data[4000:7000]
    bufs = [bytearray(10), bytearray(0), bytearray(990)]
    store.read_into_vectored("data/rank-0.bin", 9000, [memoryview(b) for b in bufs])
    assert b"".join(bufs) == data[9000:]
    if damage == "missing":
        assert store.read_bytes("data/rank-0.bin") == data  # whole reads too


def test_a_damaged_local_copy_is_read_again_from_the_fallback(tiered):
    """Same length, wrong bytes: only the index's checksums can tell, so the store returns them and
    the reader retries the range from ``fallback`` (ckptkit/engine/reader.py), which has the truth."""
    store, (local, _) = tiered.store, tiered.raw.tiers()
    data = payload(8192)
    store.write_object("data/rank-0.bin", [data])
    damaged = bytearray(data)
    damaged[100] ^= 0xFF
    local.set("data/rank-0.bin", bytes(damaged))
    out = bytearray(200)
    store.read_into("data/rank-0.bin", 0, memoryview(out))
    assert bytes(out) == bytes(damaged[:200])
    assert store.fallback is not None
    store.fallback.read_into("data/rank-0.bin", 0, memoryview(out))
    assert bytes(out) == data[:200]


def test_an_unreadable_local_copy_is_read_whole_from_the_remote(tiered, tmp_path):
    store = tiered.store
    store.put_bytes("index/rank-0.json", b"{}")
    path = tmp_path / "nvme" / "index" / "rank-0.json"
    os.remove(path)
    os.mkfifo(path)  # not a regular file: refused at once, then the remote's copy
    assert store.read_bytes("index/rank-0.json", limit=100) == b"{}"


def test_authoritative_writes_to_a_remote_that_holds_chunks_are_copied_first(tmp_path):
    """The tiered store streams on the local store's behalf; an authoritative key goes straight to
    the remote, and a remote that holds chunks (tensorstore's engine) gets copies, so a source
    reusing its buffer still lands whole."""
    remote = open_store(str(tmp_path / "bucket"), {"io_engine": "tensorstore"})
    assert not remote.streams_writes
    store = TieredStore(LocalStore(str(tmp_path / "nvme")), remote, remote_only={"big.bin"})
    assert store.streams_writes
    data = payload(100_000, seed=5)
    done: list[str] = []
    store.write_object("big.bin", reusing(split(data, 9000), done))
    assert FsBackdoor(tmp_path / "bucket").get("big.bin") == data
    assert FsBackdoor(tmp_path / "nvme").keys() == []


def test_is_dir_is_either_tier(tmp_path):
    (tmp_path / "nvme").mkdir()
    store = TieredStore(LocalStore(str(tmp_path / "nvme")), LocalStore(str(tmp_path / "bucket")), remote_only=())
    assert store.is_dir()
    (tmp_path / "nvme").rmdir()
    assert not store.is_dir()


def test_what_changes_and_no_checksum_covers_lives_only_in_the_bucket(tmp_path):
    """Two runs with one node-local folder (two jobs on a node, or a new run at the URL of a deleted one):
    the second must not read the first's incident log (its skip ranges, its rollbacks), progress marker
    or read leases. They were written to and read from the local tier, so a brand-new run resumed with the
    other run's skip ranges and its crash accounting read a stale marker (found by a hunt, 2026-12-06)."""
    import time

    import torch

    import ckptkit
    from ckptkit.resilience.incidents import Incident, IncidentLog
    from ckptkit.resilience.progress import ProgressMarker

    node = str(tmp_path / "node")
    first = ckptkit.CheckpointManager(str(tmp_path / "bucket-a"), local_dir=node, asynchronous=None)
    first.save(1, {"w": torch.ones(4)})
    IncidentLog(first.root, writer=True).record(Incident("rollback", 7, "spike", data={"skip": [760, 1144]}))
    marker = ProgressMarker(first.root, writer=True)
    marker.write(45)
    marker.close()
    lease = first.folder.acquire_lease("step-0000001", 0)
    time.sleep(0.01)
    assert not os.path.exists(os.path.join(node, ".ckptkit")) and not os.path.exists(os.path.join(node, ".leases"))
    second = ckptkit.CheckpointManager(str(tmp_path / "bucket-b"), local_dir=node, asynchronous=None)
    assert IncidentLog(second.root, writer=False).read() == []
    assert ProgressMarker(second.root, writer=False).read() is None
    assert not second.folder.leased("step-0000001")
    assert [i.step for i in IncidentLog(first.root, writer=False).read()] == [7]  # the first run's, from its bucket
    first.folder.release_lease(lease)
    with pytest.raises(ckptkit.OptionsError, match="overlaps"):
        ckptkit.CheckpointManager(str(tmp_path / "bucket-a"), local_dir=str(tmp_path / "bucket-a" / "cache"))


def save_five_keeping_one(bucket: str, nodes: str) -> list[str]:
    """Two ranks as on two nodes, each with its own local_dir; ``keep_last=1``: this node's local step folders."""
    import torch
    import torch.distributed as dist

    import ckptkit

    from ckptkit.storage.tiered import run_cache_name

    local = os.path.join(nodes, f"node{dist.get_rank()}")
    mgr = ckptkit.CheckpointManager(bucket, local_dir=local, keep=ckptkit.RetentionPolicy(keep_last=1),
                                    asynchronous=ckptkit.AsyncOptions())
    for step in range(1, 6):
        mgr.save(step, {"w": torch.full((64,), float(step))})
        mgr.wait()
    mgr.close()
    cache = os.path.join(local, run_cache_name(mgr.root.remote.url))  # this run's folder in local_dir
    return sorted(n for n in os.listdir(cache) if n.startswith("step-"))


def test_every_node_prunes_its_local_copies_of_deleted_steps(worlds, tmp_path):
    """Retention deletes in the bucket and on rank 0's node: every other node kept every step's local copy
    for ever (found by a hunt, 2026-12-06). Now each rank drops, after each commit, the local copies of the
    steps the bucket no longer holds: at most the newest and the one retention deletes next remain."""
    bucket, nodes = str(tmp_path / "bucket"), str(tmp_path / "nodes")
    kept = worlds.run(2, save_five_keeping_one, bucket, nodes)
    assert sorted(n for n in os.listdir(bucket) if n.startswith("step-")) == ["step-0000005"]
    for names in kept:
        assert set(names) <= {"step-0000004", "step-0000005"} and "step-0000005" in names, kept


def _restores(run: str, **kwargs) -> int | None:
    import torch

    import ckptkit

    state = {"w": torch.zeros(64)}
    step = ckptkit.CheckpointManager(run, **kwargs).restore_latest(state)
    assert step is None or torch.equal(state["w"], torch.full((64,), float(step)))
    return step


def test_what_else_lives_in_local_dir_is_never_touched(tmp_path):
    """``local_dir`` is a node's disk: an older run saved there directly, another run's local copies. The
    tier's housekeeping (pruning after each commit, gc, retention) took every step folder there for its own:
    a run's first commit deleted the older run's committed checkpoints, gc left them as bare manifests,
    and one run's commit deleted another run's save in flight (found by a hunt, 2026-12-06). Each run now
    keeps its local copies in a folder of its own under ``local_dir``."""
    import torch

    import ckptkit

    nvme = str(tmp_path / "nvme")
    with ckptkit.CheckpointManager(nvme, asynchronous=None) as old:  # a run saved straight to the node's disk
        for step in (1, 2, 3):
            old.save(step, {"w": torch.full((64,), float(step))})
    a, b = (ckptkit.CheckpointManager(str(tmp_path / f"bucket-{x}"), local_dir=nvme, asynchronous=None,
                                      keep=ckptkit.RetentionPolicy(keep_last=1)) for x in "ab")
    for step in (1, 2, 3, 4):
        for mgr in (a, b):  # the two runs share local_dir, and their step names
            mgr.save(step, {"w": torch.full((64,), float(step))})
    a.gc()
    b.gc()
    a.close()
    b.close()
    assert _restores(nvme) == 3 and [r.step for r in ckptkit.CheckpointManager(nvme).records()] == [1, 2, 3]
    for x in "ab":
        assert _restores(str(tmp_path / f"bucket-{x}"), local_dir=nvme) == 4


def test_nothing_outside_local_dir_is_deleted_through_a_link(tmp_path):
    """A local step folder replaced by a link to another place (an archive of that step): retention deleted
    the link's target, manifest included (a hunt, 2026-12-06). Nothing is deleted through a link now."""
    import shutil

    import torch

    import ckptkit
    from ckptkit.storage.tiered import run_cache_name

    nvme, bucket = tmp_path / "nvme", str(tmp_path / "bucket")
    mgr = ckptkit.CheckpointManager(bucket, local_dir=str(nvme), asynchronous=None,
                                    keep=ckptkit.RetentionPolicy(keep_last=1))
    mgr.save(1, {"w": torch.full((64,), 1.0)})
    archive = tmp_path / "archive" / "step-0000001"
    shutil.copytree(tmp_path / "bucket" / "step-0000001", archive)
    local = nvme / run_cache_name(mgr.root.remote.url) / "step-0000001"
    shutil.rmtree(local)
    local.symlink_to(archive, target_is_directory=True)
    before = sorted(p.name for p in archive.rglob("*"))
    mgr.save(2, {"w": torch.full((64,), 2.0)})  # retention deletes step 1; the prune runs after the commit
    mgr.gc()
    mgr.close()
    assert sorted(p.name for p in archive.rglob("*")) == before
    assert _restores(str(archive.parent)) == 1
    assert not (tmp_path / "bucket" / "step-0000001").exists()  # the bucket's step went whole
    # a run folder on local disk whose step folder is a link: the same (no tier involved)
    run = tmp_path / "plain"
    plain = ckptkit.CheckpointManager(str(run), asynchronous=None, keep=ckptkit.RetentionPolicy(keep_last=1))
    plain.save(1, {"w": torch.full((64,), 1.0)})
    shutil.rmtree(run / "step-0000001")
    (run / "step-0000001").symlink_to(archive, target_is_directory=True)
    plain.save(2, {"w": torch.full((64,), 2.0)})
    plain.close()
    assert sorted(p.name for p in archive.rglob("*")) == before
