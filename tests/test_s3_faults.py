"""Network faults between ckptkit and a real S3 server: a save commits completely or fails with a
clear ckptkit error, a load returns correct data or fails clearly, and there is never a committed
checkpoint with missing or wrong bytes.

The client talks real HTTP to :class:`tests.fault_proxy.FaultProxy`, which forwards to the moto
server (nothing in s3fs or botocore is mocked). The proxy is reached through
``storage_options={"endpoint_url": ...}``; ``AWS_ENDPOINT_URL`` points at the real server, so
every check of the outcome (a boto3 listing, ``ckptkit.verify``) bypasses the faults.
Retry counts are lowered only through real configuration (``config_kwargs``) to keep botocore's
backoff sleeps short; note that botocore's ``max_attempts`` counts *retries*.

Most saves use the engine's ``save_state`` (what ``ckptkit.save`` runs) with an ``S3Store`` of
5 MiB parts, so a 6 MiB tensor becomes a multipart upload (create, 2 parts, complete).
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

import ckptkit
from ckptkit.engine.collective import LocalComm
from ckptkit.engine.saver import save_state
from ckptkit.errors import CkptkitError, SaveError, StorageError
from ckptkit.layout.index import Index
from ckptkit.layout.manifest import Manifest
from ckptkit.storage.s3 import S3Store
from tests.fault_proxy import FaultProxy, Faults
from tests.s3_server import s3_env, s3_server  # noqa: F401 - fixtures

PART = 5 << 20
BIG = 3 << 19  # float32 elements: 6 MiB, with the rest a 2-part upload
WRITES = frozenset({"PUT", "POST", "DELETE"})
pytestmark = pytest.mark.timeout(120)  # a hang fails the test instead of stalling the suite


@pytest.fixture
def proxy(s3_server):  # noqa: F811
    with FaultProxy(s3_server.endpoint) as p:
        yield p


def opts(proxy: FaultProxy, retries: int | None = None, **config) -> dict:
    """storage_options that send every request through the proxy (``retries``: botocore max_attempts)."""
    if retries is not None:
        config["retries"] = {"max_attempts": retries, "mode": "standard"}
    return {"endpoint_url": proxy.endpoint, **({"config_kwargs": config} if config else {})}


def make_state(seed: int, big: int = BIG) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"big": torch.randn(big, generator=g), "bias": torch.randn(1000, generator=g)},
        "h": torch.randn(5000, generator=g).to(torch.bfloat16),
        "step": seed,
    }


def blank(big: int = BIG) -> dict:
    return {"model": {"big": torch.zeros(big), "bias": torch.zeros(1000)}, "h": torch.zeros(5000, dtype=torch.bfloat16), "step": -1}


def assert_same(got: dict, want: dict) -> None:
    assert got["step"] == want["step"]
    assert torch.equal(got["h"], want["h"])
    for k in want["model"]:
        assert torch.equal(got["model"][k], want["model"][k]), k


def multipart_save(state: dict, url: str, storage_options: dict, concurrency: int = 2):
    """``ckptkit.save`` with 5 MiB parts (``save`` itself would use 64 MiB parts)."""
    store = S3Store(url, storage_options, part_size=PART, max_concurrency=concurrency)
    return save_state(state, store, LocalComm(), block=ckptkit.SaveOptions().block_size)


def committed(s3_server, bucket: str, prefix: str = "") -> list[str]:  # noqa: F811
    """Through the real server: every manifest under ``prefix`` references only existing objects of the
    recorded sizes, and its checkpoint verifies. Returns the committed checkpoint prefixes."""
    s3 = s3_server.client()
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    sizes = {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}
    out = []
    for key in sorted(k for k in sizes if k.endswith("manifest.json")):
        root = key[: -len("manifest.json")]
        manifest = Manifest.from_json_bytes(s3.get_object(Bucket=bucket, Key=key)["Body"].read(), key)
        for ref in manifest.indexes.values():
            assert sizes.get(root + ref.key) == ref.size, f"{key} is committed but {ref.key} is missing or torn"
            index = Index.from_json_bytes(s3.get_object(Bucket=bucket, Key=root + ref.key)["Body"].read(), ref.key)
            for obj, size in index.objects.items():
                assert sizes.get(root + obj, -1) >= size, f"{key} is committed but {obj} is missing or short"
        report = ckptkit.verify(f"s3://{bucket}/{root}")
        assert report.ok, f"{key} is committed but does not verify: {report.problems}"
        out.append(root.rstrip("/"))
    return out


def load_direct(url: str, big: int = BIG) -> dict:
    target = blank(big)
    ckptkit.load(target, url)  # AWS_ENDPOINT_URL: the real server
    return target


# ---------------------------------------------------------------- transient errors

def test_transient_500_503_are_retried_and_data_is_bit_exact(proxy, s3_env, s3_server):  # noqa: F811
    proxy.set(Faults(error=0.25), seed=1)
    url, state = f"s3://{s3_env}/t/mp", make_state(1)
    multipart_save(state, url, opts(proxy))
    target = blank()
    ckptkit.load(target, url, storage_options=opts(proxy))
    assert_same(target, state)
    small = make_state(2, big=1 << 16)  # ckptkit.save itself: single PUTs
    ckptkit.save(small, f"s3://{s3_env}/t/single", storage_options=opts(proxy))
    target = blank(1 << 16)
    ckptkit.load(target, f"s3://{s3_env}/t/single", storage_options=opts(proxy))
    assert_same(target, small)
    print(f"\ntransient errors: {dict(proxy.counts)}")
    assert proxy.counts["500"] + proxy.counts["503"] > 0
    assert proxy.counts["connections"] < proxy.counts["requests"]  # keep-alive connections were reused
    assert committed(s3_server, s3_env, "t/") == ["t/mp", "t/single"]


def test_manager_and_save_async_under_errors_drops_and_latency(proxy, s3_env, s3_server):  # noqa: F811
    proxy.set(Faults(error=0.15, drop_before=0.05, drop_after=0.05, delay=0.005), seed=2)
    states = {s: make_state(s, big=1 << 18) for s in (1, 2, 3)}
    root = f"s3://{s3_env}/run"
    with ckptkit.CheckpointManager(root, save=ckptkit.SavePolicy(every_steps=1), keep=ckptkit.RetentionPolicy(keep_last=2), storage_options=opts(proxy)) as mgr:
        for step, state in states.items():
            mgr.maybe_save(step, state)
    handle = ckptkit.save_async(states[2], f"s3://{s3_env}/async/c", storage_options=opts(proxy))
    handle.wait()
    ckptkit.close_async()
    target = blank(1 << 18)
    with ckptkit.CheckpointManager(root, storage_options=opts(proxy)) as mgr:
        assert mgr.restore_latest(target) == 3
    assert_same(target, states[3])
    print(f"\nmanager/async: {dict(proxy.counts)}")
    assert proxy.injected() > 0
    done = committed(s3_server, s3_env)
    assert {"run/step-0000003", "async/c"} <= set(done)
    assert_same(load_direct(f"s3://{s3_env}/async/c", 1 << 18), states[2])


# ---------------------------------------------------------------- dropped connections, lost answers

def test_dropped_connections_on_writes_commit_completely_or_fail_clearly(proxy, s3_env, s3_server):  # noqa: F811
    """Random drops before and after forwarding on every write (multipart parts and completion, the
    index, the manifest's conditional PUT, cleanup deletes), with few retries so that some saves
    fail. One request at a time, so each seed replays the same faults (these seeds give 2 of each)."""
    outcomes = []
    for seed in (3, 4, 6, 7):
        proxy.set(Faults(drop_before=0.15, drop_after=0.15, methods=WRITES), seed=seed)
        url, state = f"s3://{s3_env}/d{seed}", make_state(seed)
        try:
            multipart_save(state, url, opts(proxy, retries=1), concurrency=1)
            error = None
        except CkptkitError as exc:
            error = exc
            assert isinstance(exc, (SaveError, StorageError)), repr(exc)
            assert url in str(exc)
        done = committed(s3_server, s3_env, f"d{seed}/")
        if error is None:
            assert done == [f"d{seed}"]
            assert_same(load_direct(url), state)
        else:
            assert done == [], f"save raised {error!r}, yet {done} is committed"
        outcomes.append("ok" if error is None else "failed")
    print(f"\ndrops on writes: {outcomes} {dict(proxy.counts)}")
    assert proxy.counts["drop_before"] > 0 and proxy.counts["drop_after"] > 0
    assert "ok" in outcomes and "failed" in outcomes  # both branches were exercised


LOST = {
    "create": Faults(drop_after=1, methods=frozenset({"POST"}), path=r"\?uploads$", limit=1),
    "part": Faults(drop_after=1, methods=frozenset({"PUT"}), path="partNumber=2", limit=1),
    "complete": Faults(drop_after=1, methods=frozenset({"POST"}), path="uploadId=", limit=1),
    "index": Faults(drop_after=1, methods=frozenset({"PUT"}), path="/index/", limit=1),
    "manifest": Faults(drop_after=1, header="if-none-match", limit=1),
    "manifest-late": Faults(delay=1.5, header="if-none-match", limit=1),  # arrives after the client timed out
}


@pytest.mark.parametrize("where", list(LOST))
def test_a_lost_answer_at_each_step_of_a_save_is_recovered(proxy, s3_env, s3_server, where):  # noqa: F811
    """The server did the request, the client never heard back; the retry must not break the save."""
    proxy.set(LOST[where])
    url, state = f"s3://{s3_env}/{where}", make_state(3)
    storage = opts(proxy, read_timeout=1) if where == "manifest-late" else opts(proxy)
    multipart_save(state, url, storage)
    assert proxy.events and all(e[0] in ("drop_after", "delay") for e in proxy.events), proxy.events
    assert committed(s3_server, s3_env, f"{where}/") == [where]
    assert_same(load_direct(url), state)


def test_a_commit_whose_every_answer_is_lost_is_not_reported_as_failed(proxy, s3_env, s3_server, caplog):  # noqa: F811
    """Every answer to the manifest's conditional PUT is lost (the server created it each time it
    could): the save reads the manifest back, finds its own, and returns normally — a committed
    checkpoint is never reported as a failed save."""
    proxy.set(Faults(drop_after=1.0, header="if-none-match"))
    url, state = f"s3://{s3_env}/c", make_state(4, big=1 << 16)
    try:
        with caplog.at_level(logging.WARNING, logger="ckptkit"):
            ckptkit.save(state, url, storage_options=opts(proxy, retries=1))
        error = None
    except CkptkitError as exc:
        error = exc
    lost = [e for e in proxy.events if e[0] == "drop_after"]  # the first PUT and its retries: none answered
    assert len(lost) >= 2 and all(e[1] == "PUT" and e[2].endswith("/c/manifest.json") for e in lost), proxy.events
    assert error is None, f"the manifest is committed (and is ours), yet the save raised {error!r}"
    assert any("answer was lost but the manifest is ours" in r.getMessage() for r in caplog.records)
    assert committed(s3_server, s3_env, "c/") == ["c"]  # complete and verifying, through the real server
    assert_same(load_direct(url, 1 << 16), state)


# ---------------------------------------------------------------- outages

def test_persistent_outage_fails_the_save_in_bounded_time_and_keeps_the_previous(proxy, s3_env, s3_server):  # noqa: F811
    prev = make_state(5, big=1 << 16)
    ckptkit.save(prev, f"s3://{s3_env}/o/prev", storage_options=opts(proxy))
    proxy.set(Faults(error=1.0, statuses=(503,)))
    url = f"s3://{s3_env}/o/new"
    t0 = time.monotonic()
    with pytest.raises(SaveError, match="503|SlowDown") as info:
        ckptkit.save(make_state(6, big=1 << 16), url, storage_options=opts(proxy, retries=2))
    elapsed = time.monotonic() - t0
    assert url in str(info.value) and elapsed < 20, (elapsed, str(info.value))
    with pytest.raises(StorageError, match="503|SlowDown"):  # a load during the outage fails clearly
        ckptkit.load(blank(1 << 16), f"s3://{s3_env}/o/prev", storage_options=opts(proxy, retries=1))
    proxy.set()
    assert committed(s3_server, s3_env, "o/") == ["o/prev"]
    target = blank(1 << 16)
    ckptkit.load(target, f"s3://{s3_env}/o/prev", storage_options=opts(proxy))
    assert_same(target, prev)
    print(f"\noutage: save failed after {elapsed:.1f}s; {dict(proxy.counts)}")


def test_save_async_during_a_write_outage_fails_and_leaves_nothing(proxy, s3_env, s3_server):  # noqa: F811
    proxy.set(Faults(error=1.0, methods=frozenset({"PUT"})))
    handle = ckptkit.save_async(make_state(7, big=1 << 16), f"s3://{s3_env}/a/c", storage_options=opts(proxy, retries=1))
    with pytest.raises(SaveError, match="a/c"):
        handle.wait(timeout=30)
    with pytest.raises(SaveError):  # reported again when the saver is closed
        ckptkit.close_async()
    assert s3_server.client().list_objects_v2(Bucket=s3_env, Prefix="a/").get("KeyCount") == 0


def test_an_outage_after_persist_still_fails_with_save_error(proxy, s3_env, s3_server):  # noqa: F811
    # the target check's HEAD passes; then every PUT of the index and HEAD of the manifest answers 503
    proxy.set(Faults(error=1.0, statuses=(503,), methods=frozenset({"PUT", "HEAD"}),
                     path=r"/index/|/manifest\.json", skip=1))
    url = f"s3://{s3_env}/late"
    with pytest.raises(SaveError, match="index"):
        ckptkit.save(make_state(8, big=1 << 16), url, storage_options=opts(proxy, retries=1))


# ---------------------------------------------------------------- faults during loads

LOAD_FAULTS = [
    Faults(error=0.3),
    Faults(drop_before=0.25, drop_after=0.25, methods=frozenset({"GET", "HEAD"})),
    Faults(truncate=0.4, methods=frozenset({"GET"})),
    Faults(truncate=1.0, header="range"),
]


def test_faults_during_loads_give_correct_data_or_a_clear_error(proxy, s3_env, s3_server, monkeypatch):  # noqa: F811
    url, state = f"s3://{s3_env}/l", make_state(9)
    multipart_save(state, url, opts(proxy))
    results = []
    for seed, faults in enumerate(LOAD_FAULTS):
        proxy.set(faults, seed=seed)
        target = blank()
        try:
            ckptkit.load(target, url, storage_options=opts(proxy, retries=3))
            assert_same(target, state)
            results.append("ok")
        except CkptkitError as exc:
            assert isinstance(exc, StorageError) and url in str(exc), repr(exc)
            results.append(type(exc).__name__)
    assert results[0] == "ok" and results[-1] == "StorageError", results  # retried / never retried mid-body
    # verify through the faulty proxy: a network failure is reported as a read failure, never as corruption
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    report = ckptkit.verify(url)
    assert not report.ok and {p.kind for p in report.problems} == {"read"}, report.problems
    print(f"\nload faults: {results} {dict(proxy.counts)}")
    assert proxy.counts["truncate"] > 0 and proxy.counts["drop_after"] > 0
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    assert committed(s3_server, s3_env, "l/") == ["l"]


RESTORE_FAULTS = {
    "one-truncated-read": Faults(truncate=1.0, header="range", limit=1),
    "ranged-get-outage": Faults(error=1.0, statuses=(503,), header="range"),
}


@pytest.mark.parametrize("fault", list(RESTORE_FAULTS))
def test_restore_latest_does_not_skip_a_good_checkpoint_on_a_network_error(proxy, s3_env, fault):  # noqa: F811
    states = {s: make_state(s, big=1 << 16) for s in (1, 2)}
    root = f"s3://{s3_env}/r"
    with ckptkit.CheckpointManager(root, save=ckptkit.SavePolicy(every_steps=1), asynchronous=None, storage_options=opts(proxy)) as mgr:
        for step, state in states.items():
            mgr.maybe_save(step, state)
    proxy.set(RESTORE_FAULTS[fault])
    with ckptkit.CheckpointManager(root, storage_options=opts(proxy, retries=1)) as mgr:
        try:
            got = mgr.restore_latest(blank(1 << 16))
        except StorageError:
            got = "raised"
    assert got in (2, "raised"), f"restore_latest returned {got!r} after {proxy.events[:2]}"
