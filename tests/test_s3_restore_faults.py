"""A flaky object store never makes a restore silently go back in time, and never makes retention
or gc delete a committed checkpoint.

Three committed checkpoints (steps 1-3) in a real S3 server (moto); every request of the manager
under test goes through the fault proxy, which cuts, resets, drops or answers 500/503 to chosen
requests (the Nth GET of one key, every GET of it, a HEAD...). For each scenario the restore
either returns step 3 with its exact bytes or raises a clear error naming step 3 — never step 2,
never None — and no committed checkpoint disappears.
"""

from __future__ import annotations

import pytest
import torch

import ckptkit
from tests.fault_proxy import FaultProxy, Faults
from tests.s3_server import CREDENTIALS, s3_env, s3_server  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(300)
STEPS = (1, 2, 3)
GET = frozenset({"GET"})
HEAD = frozenset({"HEAD"})


def state_at(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(4096, generator=g), "b": torch.randn(7, generator=g), "step": step}


def blank() -> dict:
    return {"w": torch.zeros(4096), "b": torch.zeros(7), "step": -1}


@pytest.fixture
def proxy(s3_server):  # noqa: F811
    with FaultProxy(s3_server.endpoint) as p:
        yield p


def save_steps(bucket: str) -> str:
    """Commit STEPS under ``s3://bucket/run`` (through AWS_ENDPOINT_URL, straight to the server)."""
    root = f"s3://{bucket}/run"
    with ckptkit.CheckpointManager(root, save=ckptkit.SavePolicy(every_steps=1), asynchronous=None) as mgr:
        for step in STEPS:
            mgr.maybe_save(step, state_at(step))
    return root


@pytest.fixture
def run(s3_env, s3_server):  # noqa: F811
    """A bucket of its own, for the tests that write or delete (retention, gc)."""
    return save_steps(s3_env)


@pytest.fixture(scope="module")
def shared_run(s3_server):  # noqa: F811
    """(bucket, root): the checkpoints the restore scenarios read, saved once. A restore writes nothing but its
    read lease (under ``.leases/``, which no fault matches, taken and released), and every scenario checks that
    all of STEPS are still committed afterwards, so one scenario cannot hand the next a changed bucket unseen."""
    bucket = s3_server.new_bucket()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
        for k, v in CREDENTIALS.items():
            mp.setenv(k, v)
        return bucket, save_steps(bucket)


def opts(proxy: FaultProxy) -> dict:
    # few botocore retries: a persistent fault fails fast; transient ones are still retried
    return {"endpoint_url": proxy.endpoint, "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}}}


def committed_steps(s3_server, bucket: str) -> list[int]:  # noqa: F811
    s3 = s3_server.client()
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="run/").get("Contents", [])]
    return sorted(int(k.split("/")[1].split("-")[1]) for k in keys if k.endswith("/manifest.json"))


MANIFEST3 = r"step-0000003/manifest\.json"
INDEX3 = r"step-0000003/index/"
DATA3 = r"step-0000003/data/"

# (name, faults, outcome): "restored" = step 3, exact; "refused" = a clear error naming step 3
SCENARIOS = [
    ("first manifest GET cut mid-body", Faults(truncate=1.0, methods=GET, path=MANIFEST3, limit=1), "restored"),
    ("first manifest GET reset", Faults(reset=1.0, methods=GET, path=MANIFEST3, limit=1), "restored"),
    ("second manifest GET cut", Faults(truncate=1.0, methods=GET, path=MANIFEST3, skip=1, limit=1), "restored"),
    ("manifest GET answered short", Faults(short=1.0, methods=GET, path=MANIFEST3, limit=1), "restored"),
    ("two 503s with a body on the manifest", Faults(error=1.0, statuses=(503,), methods=GET, path=MANIFEST3, limit=2),
     "restored"),
    ("manifest HEAD dropped once", Faults(drop_after=1.0, methods=HEAD, path=MANIFEST3, limit=1), "restored"),
    ("index GET cut once", Faults(truncate=1.0, methods=GET, path=INDEX3, limit=1), "restored"),
    ("data ranged GET cut once", Faults(truncate=1.0, methods=GET, path=DATA3, header="range", limit=1), "restored"),
    ("data ranged GET reset twice", Faults(reset=1.0, methods=GET, path=DATA3, header="range", limit=2), "restored"),
    ("every manifest GET cut", Faults(truncate=1.0, methods=GET, path=MANIFEST3), "refused"),
    ("every manifest GET a 500", Faults(error=1.0, statuses=(500,), methods=GET, path=MANIFEST3), "refused"),
    ("every manifest HEAD a 503", Faults(error=1.0, statuses=(503,), methods=HEAD, path=MANIFEST3), "refused"),
    ("every index GET cut", Faults(truncate=1.0, methods=GET, path=INDEX3), "refused"),
    ("every data GET reset", Faults(reset=1.0, methods=GET, path=DATA3), "refused"),
    ("every request to step 3 dropped", Faults(drop_before=1.0, path=r"step-0000003/"), "refused"),
    # a gateway that streams every GET as Transfer-Encoding: chunked (no Content-Length): a size-limited
    # read (manifest, index, run file, leases) took the first 64-byte chunk for the whole body, so every
    # checkpoint looked damaged and a restore returned None (2026-12-06)
    ("every GET answered chunked", Faults(chunked=1.0, methods=GET), "restored"),
    ("every manifest GET answered chunked", Faults(chunked=1.0, methods=GET, path=MANIFEST3), "restored"),
]


def restore_through(proxy: FaultProxy, root: str, faults: Faults) -> tuple[int | None, dict, BaseException | None]:
    proxy.set(faults, seed=0)
    target = blank()
    try:
        with ckptkit.CheckpointManager(root, asynchronous=None, storage_options=opts(proxy)) as mgr:
            return mgr.restore_latest(target), target, None
    except ckptkit.CkptkitError as exc:
        return None, target, exc
    finally:
        proxy.set(Faults())


@pytest.mark.parametrize("name,faults,outcome", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_restore_under_faults(proxy, shared_run, s3_server, name, faults, outcome):  # noqa: F811
    bucket, root = shared_run
    step, target, error = restore_through(proxy, root, faults)
    assert step != 2 and not (step is None and error is None), f"{name}: a silent older restore ({step})"
    if outcome == "restored":
        assert error is None, f"{name}: {error}"
        assert step == 3 and torch.equal(target["w"], state_at(3)["w"]) and target["step"] == 3
        assert proxy.injected() > 0, f"{name}: the fault never fired"
    else:
        assert step is None and isinstance(error, (ckptkit.StorageError, ckptkit.CheckpointUnreadableError)), error
        assert "step-0000003" in str(error) and error.__class__.__name__ != "CorruptCheckpointError"
    assert committed_steps(s3_server, bucket) == list(STEPS)


def test_retention_never_deletes_while_a_newer_manifest_is_unreadable(proxy, run, s3_env, s3_server):  # noqa: F811
    proxy.set(Faults(error=1.0, statuses=(500,), methods=GET, path=MANIFEST3))
    with ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=1), keep=ckptkit.RetentionPolicy(keep_last=1), asynchronous=None, storage_options=opts(proxy)) as mgr:
        mgr.maybe_save(4, state_at(4))
    assert committed_steps(s3_server, s3_env) == [1, 2, 3, 4]  # uncertain: nothing deleted
    proxy.set(Faults())
    with ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=1), keep=ckptkit.RetentionPolicy(keep_last=1), asynchronous=None, storage_options=opts(proxy)) as mgr:
        mgr.maybe_save(5, state_at(5))
    assert committed_steps(s3_server, s3_env) == [5]  # once everything is readable, the policy applies


@pytest.mark.parametrize("faults", [
    Faults(error=1.0, statuses=(500,), methods=GET, path=r"manifest\.json"),
    Faults(error=1.0, statuses=(503,), methods=HEAD, path=r"manifest\.json", limit=2),
    Faults(truncate=1.0, methods=GET, path=r"manifest\.json", limit=2),
    Faults(error=1.0, statuses=(500,), methods=HEAD, path=r"manifest\.json"),
], ids=["manifest GET fails", "two HEAD failures", "two cut GETs", "manifest HEAD fails"])
def test_gc_never_removes_a_committed_checkpoint(proxy, run, s3_env, s3_server, faults):  # noqa: F811
    proxy.set(faults)
    try:
        with ckptkit.CheckpointManager(run, asynchronous=None, storage_options=opts(proxy)) as mgr:
            mgr.gc()
    except ckptkit.StorageError:
        pass  # failing is fine; deleting is not
    proxy.set(Faults())
    assert committed_steps(s3_server, s3_env) == list(STEPS)
    target = blank()
    with ckptkit.CheckpointManager(run, asynchronous=None) as mgr:
        assert mgr.restore_latest(target) == 3
