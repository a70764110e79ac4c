"""S3 commits are exactly one, not at most one: ``409 ConditionalRequestConflict`` decides nothing.

S3 answers 409 to a conditional PUT that races another conditional write of the same key. The
writer used to read the manifest back once and, finding none, report that another writer had
committed — so two writers that both met 409 both gave up and the step was never saved. Now the
conditional PUT and the read-back are retried (bounded in attempts and time) until one manifest is
visible; the loser removes only its own objects, as before.

Each writer talks to the real moto server through its own :class:`tests.fault_proxy.FaultProxy`,
which answers 409 itself to that writer's first ``k`` conditional PUTs (``If-None-Match``), so the
conflicts land exactly where S3 would put them. Every outcome is checked through the real server.
"""

from __future__ import annotations

import random
import threading
import time
import traceback

import pytest
import torch

import ckptkit
from ckptkit.engine.checkpoint_dir import attempt_of
from ckptkit.engine.collective import LocalComm
from ckptkit.engine.saver import save_state
from ckptkit.errors import SaveError
from ckptkit.storage.s3 import S3Store
from tests.conftest import trials
from tests.fault_proxy import FaultProxy, Faults
from tests.s3_server import s3_env, s3_server  # noqa: F401 - fixtures
from tests.test_s3_faults import committed

pytestmark = pytest.mark.timeout(300)
FIGURES: dict[str, int] = {"races": 0, "commits": 0, "lost": 0, "409s": 0}


def state_of(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(3000, generator=g)}, "train": {"seed": seed}}


def conflicts(k: int | None, meet: threading.Barrier | None = None) -> Faults:
    """409 on the first ``k`` conditional PUTs through this proxy (None: on every one); with ``meet``, the
    first of them waits until the other writer's proxy has one too (a race on every trial: under load, one
    writer once finished its whole save before the other began, and the loser met no conflict at all)."""
    return Faults(error=1.0, statuses=(409,), methods=frozenset({"PUT"}), header="if-none-match", limit=k, meet=meet)


def save_through(proxy: FaultProxy, url: str, seed: int, **bounds) -> None:
    store = S3Store(url, {"endpoint_url": proxy.endpoint}, **bounds)
    save_state(state_of(seed), store, LocalComm(), block=ckptkit.SaveOptions().block_size)


def objects(s3_server, bucket: str, prefix: str) -> list[str]:  # noqa: F811
    pages = s3_server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"][len(prefix):] for page in pages for o in page.get("Contents", []))


def test_409_on_the_first_k_conditional_puts_of_both_writers_commits_exactly_one(s3_env, s3_server):  # noqa: F811
    rng = random.Random(24)
    for trial in range(trials(6, 30)):
        k = 1 + trial % 3
        url, prefix = f"s3://{s3_env}/race/{trial}", f"race/{trial}/"
        outcome: dict[int, str] = {}
        go, meet = threading.Barrier(2), threading.Barrier(2)
        proxies = [FaultProxy(s3_server.endpoint, conflicts(k, meet)) for _ in range(2)]

        def run(i: int, delay: float) -> None:
            try:
                go.wait()
                time.sleep(delay)
                save_through(proxies[i], url, seed=trial * 10 + i)
                outcome[i] = "committed"
            except SaveError as exc:
                outcome[i] = f"lost: {exc}"
            except BaseException:  # noqa: BLE001 - fails the trial below
                outcome[i] = f"unexpected: {traceback.format_exc()}"

        threads = [threading.Thread(target=run, args=(i, rng.uniform(0, 0.05))) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        for p in proxies:
            p.close()
        FIGURES["races"] += 1
        FIGURES["409s"] += sum(p.counts["409"] for p in proxies)
        assert sorted(outcome) == [0, 1] and not any(o.startswith("unexpected") for o in outcome.values()), outcome
        winners = [i for i, o in outcome.items() if o == "committed"]
        assert len(winners) == 1, f"trial {trial}, k={k}: {outcome}"
        loser = 1 - winners[0]
        # the winner met all k conflicts before it committed; the loser met at least one, then saw the
        # winner's manifest on a read-back (or a 412) and stopped
        assert proxies[winners[0]].counts["409"] == k and 1 <= proxies[loser].counts["409"] <= k, \
            [dict(p.counts) for p in proxies]
        assert "another writer committed this checkpoint first" in outcome[loser], outcome[loser]
        FIGURES["commits"] += 1
        FIGURES["lost"] += 1
        assert committed(s3_server, s3_env, prefix) == [prefix.rstrip("/")]
        target = {"model": {"w": torch.zeros(3000)}, "train": {"seed": -1}}
        ckptkit.load(target, url)
        assert torch.equal(target["model"]["w"], state_of(trial * 10 + winners[0])["model"]["w"])
        assert target["train"] == {"seed": trial * 10 + winners[0]}
        attempts = {attempt_of(key) for key in objects(s3_server, s3_env, prefix)} - {None}
        assert len(attempts) == 1, f"objects of the losing attempt were left: {objects(s3_server, s3_env, prefix)}"
    print(f"\n409 races: {FIGURES['races']} tried, {FIGURES['commits']} committed exactly once, "
          f"{FIGURES['lost']} losers told so, {FIGURES['409s']} conflicts answered, 0 with no commit")


@pytest.mark.parametrize("k", [1, 4])
def test_a_lone_writer_that_meets_409_commits(s3_env, s3_server, k):  # noqa: F811
    """Nobody else committed: 409 is no reason to report a lost race (the old code did)."""
    with FaultProxy(s3_server.endpoint, conflicts(k)) as proxy:
        save_through(proxy, f"s3://{s3_env}/lone", seed=5)
        assert proxy.counts["409"] == k
    assert committed(s3_server, s3_env, "lone/") == ["lone"]


def test_409_forever_fails_clearly_after_the_attempts_and_leaves_nothing(s3_env, s3_server):  # noqa: F811
    with FaultProxy(s3_server.endpoint, conflicts(None)) as proxy:
        with pytest.raises(SaveError, match=r"409 ConditionalRequestConflict.*\b4 attempts.*nothing was committed"):
            save_through(proxy, f"s3://{s3_env}/forever", seed=6, commit_attempts=4, commit_seconds=60)
        assert proxy.counts["409"] == 4
    assert objects(s3_server, s3_env, "forever/") == []  # no manifest, and the attempt's own objects removed


def test_409_forever_fails_within_the_time_bound(s3_env, s3_server):  # noqa: F811
    with FaultProxy(s3_server.endpoint, conflicts(None)) as proxy:
        t0 = time.monotonic()
        with pytest.raises(SaveError, match="409 ConditionalRequestConflict"):
            save_through(proxy, f"s3://{s3_env}/slow", seed=7, commit_attempts=10_000, commit_seconds=1.0)
        elapsed = time.monotonic() - t0
    assert elapsed < 20, elapsed  # the save itself plus the 1 s commit bound (a loaded 2-core machine)
    assert 2 <= proxy.counts["409"] < 100
    assert objects(s3_server, s3_env, "slow/") == []


class _LostCommitAnswer(FaultProxy):
    """The manifest's conditional PUT reaches the store, its answer is lost; then the next ``failing``
    GETs of that manifest answer 503 (the store is briefly unwell)."""

    def __init__(self, upstream: str, failing: int) -> None:
        super().__init__(upstream)
        self.dropped, self.failing = False, failing

    def _decide(self, req):
        with self._lock:
            if "step-0000002/manifest.json" in req.target:
                if req.method == "PUT" and "if-none-match" in req.lookup and not self.dropped:
                    self.dropped = True
                    return "drop_after", 0.0, 0.0
                if req.method == "GET" and self.dropped and self.failing > 0:
                    self.failing -= 1
                    return "503", 0.0, 0.0
        return "forward", 0.0, 0.0


@pytest.mark.parametrize("failing", [2, 10], ids=["the read-back recovers", "the read-back never answers"])
def test_a_commit_whose_answer_is_lost_never_deletes_what_it_may_have_committed(s3_env, s3_server, failing):  # noqa: F811
    """Its manifest was stored; whether the save reports success (the read-back learned it) or an unknown
    outcome (it could not), the committed checkpoint stays whole and restores. A failed save's cleanup used
    to run here and delete the data and index the committed manifest names (found by a hunt, 2026-12-06)."""
    bucket = s3_server.new_bucket()
    root = f"s3://{bucket}/run"
    with _LostCommitAnswer(s3_server.endpoint, failing) as proxy:
        opts = {"endpoint_url": proxy.endpoint, "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}}}
        with ckptkit.CheckpointManager(root, storage_options=opts, asynchronous=None) as mgr:
            mgr.save(1, {"w": torch.full((16,), 1.0)})
            if failing < 4:
                mgr.save(2, {"w": torch.full((16,), 2.0)})
            else:
                with pytest.raises(SaveError, match="could not be read back") as info:
                    mgr.save(2, {"w": torch.full((16,), 2.0)})
                assert "verify" in str(info.value)
    assert ckptkit.verify(f"{root}/step-0000002").ok
    state = {"w": torch.zeros(16)}
    with ckptkit.CheckpointManager(root) as mgr:
        assert mgr.restore_latest(state) == 2 and state["w"][0] == 2.0 and mgr.skipped == []
