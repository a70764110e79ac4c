"""Node memory outlives runs: a restore must never hand back a snapshot of another run, or of a
history that was deleted since (the class of "a foreign or abandoned state restored as the newest").

Node memory (``/dev/shm``) survives the job, and its folder is derived from the run's URL (or given
by the user, the same for every run). So a new run at the same URL, a second run sharing the memory
folder, or a run rewound by deleting its newest persistent checkpoints, each meets snapshots that
are complete and verify, and are not this run's to resume from.

The model-based test below runs random sequences of training, restarts, new runs at the same URL,
switches between two runs sharing one memory folder, and rewinds by hand, against an exact model of
which step each restore must return and with which bytes. Every value trained is unique to its run
and trajectory, so a state from anywhere else cannot pass for the expected one.
"""

from __future__ import annotations

import itertools
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.manager import step_dir
from ckptkit.run_identity import RUN_FILE
from tests.s3_server import s3_env, s3_server  # noqa: F401 - fixtures
from tests.test_memory_restore_checks import _state, _tier

MEM_EVERY, PERSIST_EVERY = 2, 4

_ops = st.lists(st.one_of(
    st.tuples(st.just("train"), st.integers(1, 7)),
    st.tuples(st.just("restart"), st.just(0)),
    st.tuples(st.just("new_run"), st.just(0)),
    st.tuples(st.just("switch"), st.just(0)),
    st.tuples(st.just("rewind"), st.integers(0, 3)),
    st.tuples(st.just("rollback"), st.integers(0, 6)),
    st.tuples(st.just("away"), st.just(0)),
    st.tuples(st.just("save_now"), st.just(0)),
    st.tuples(st.just("back"), st.just(0)),
), min_size=1, max_size=10)


class _Run:
    """The model of one run folder: its persistent steps and the trajectory training is on."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.persistent: dict[int, tuple[float, int]] = {}
        self.run_token = 0   # changes when the folder (and so the run's id) is deleted
        self.base = -1       # the newest persistent step committed on the current trajectory
        self.started = -1    # the newest persistent save the current trajectory started
        self.step = 0
        self.value: tuple[float, int] = (0.0, 0)


class _Model:
    def __init__(self, root: str) -> None:
        self.mem_root = os.path.join(root, "mem")
        self.runs = [_Run(os.path.join(root, "run-a")), _Run(os.path.join(root, "run-b"))]
        self.current = 0
        #: what node memory holds: step -> (value, (run index, run token), base, started)
        self.memory: dict[int, tuple[tuple[float, int], tuple[int, int], int, int]] = {}
        #: a memory folder away (its node out of the job) while the job restarted without it
        self.away: dict[int, tuple[tuple[float, int], tuple[int, int], int, int]] | None = None
        self.tokens = itertools.count(1)
        self.mgr: ckptkit.CheckpointManager | None = None

    @property
    def run(self) -> _Run:
        return self.runs[self.current]

    def open(self) -> ckptkit.CheckpointManager:
        tier = ckptkit.MemoryTier(every_steps=MEM_EVERY, replicas=0, root=self.mem_root)
        self.mgr = ckptkit.CheckpointManager(self.run.path, save=ckptkit.SavePolicy(every_steps=PERSIST_EVERY),
                                             memory=tier)
        return self.mgr

    def close(self) -> None:
        if self.mgr is not None:
            self.mgr.wait()
            self.mgr.close()
            self.mgr = None

    # ------------------------------------------------------------ operations
    def train(self, steps: int) -> None:
        run, token = self.run, float(next(self.tokens))
        state = {"w": torch.tensor([0.0, 0.0], dtype=torch.float64)}
        for s in range(run.step + 1, run.step + steps + 1):
            state["w"] = torch.tensor([token, float(s)], dtype=torch.float64)
            handle = self.mgr.maybe_save(s, state)
            if s % MEM_EVERY == 0:  # a snapshot: newer steps dropped, older ones retired
                started = s if s % PERSIST_EVERY == 0 else run.started
                self.memory = {s: ((token, s), (self.current, run.run_token), run.base, max(run.base, started))}
            if handle is not None:
                self.mgr.wait()  # committed before the next step: the next snapshot's base is exact
                run.persistent[s] = (token, s)
                run.base = run.started = s
            run.step, run.value = s, (token, s)

    def restore(self, at_most: int | None = None, reopen: bool = True) -> int | None:
        """A restart (or, not ``reopen``, a rollback in the running job to a step <= ``at_most``):
        what ``restore_latest`` must return, and the bytes it must put back."""
        if reopen:
            self.close()
            self.open()
        mgr = self.mgr
        run = self.run
        bound = 2**62 if at_most is None else at_most
        present = max(run.persistent, default=-1)
        newest = max((s for s in run.persistent if s <= bound), default=-1)
        # this run's, not after a persistent step deleted since, not a branch the run left (a
        # persistent step saved after its trajectory's last save and up to it), in range
        usable = [s for s, (_, owner, base, started) in self.memory.items()
                  if owner == (self.current, run.run_token) and base <= present
                  and not any(started < p <= s for p in run.persistent) and newest <= s <= bound]
        want = max(usable, default=None)
        source = "memory"
        if want is None and newest >= 0:
            want, source = newest, "persistent"
        state = {"w": torch.tensor([-1.0, -1.0], dtype=torch.float64)}
        got = mgr.restore_latest(state, at_most=at_most)
        assert got == want, (got, want, self.memory, run.persistent)
        if want is None:
            assert state["w"].tolist() == [-1.0, -1.0]  # untouched: a fresh start
            run.step, run.base, run.started = 0, -1, -1
            return None
        value = self.memory[want][0] if source == "memory" else run.persistent[want]
        assert mgr.last_restore.source == source
        assert tuple(state["w"].tolist()) == value, (state["w"], value)
        run.step, run.value, run.base, run.started = want, value, newest, newest
        self.memory = {s: m for s, m in self.memory.items() if s <= want}  # discarded after the restored step
        return want

    def rollback(self, back: int) -> None:
        """What the resilience controller does in the running job: restore the newest step at most
        ``back`` steps behind, then discard everything newer (persistent and memory)."""
        run = self.run
        got = self.restore(at_most=max(0, run.step - back), reopen=False)
        keep = -1 if got is None else got  # nothing that old: a start from scratch, everything discarded
        self.mgr.discard_after(keep)
        run.persistent = {s: v for s, v in run.persistent.items() if s <= keep}
        self.memory = {s: m for s, m in self.memory.items() if s <= keep}

    def save_now(self) -> None:
        """A save on demand at the current step (a preemption's, ``request_save``): off the grid."""
        run = self.run
        if run.step == 0 or run.step in run.persistent:
            return
        self.mgr.save(run.step, {"w": torch.tensor(list(run.value), dtype=torch.float64)})
        self.mgr.wait()
        run.persistent[run.step] = run.value
        run.base = run.started = run.step

    def go_away(self) -> None:
        """The node's memory folder leaves the job (a node drained, its ``/dev/shm`` kept); the job
        restarts without it, from storage."""
        if self.away is not None:
            return
        self.close()
        os.rename(self.mem_root, self.mem_root + ".away")
        self.away, self.memory = self.memory, {}
        self.restore()

    def come_back(self) -> None:
        """The node returns with the snapshots it had; the job restarts with it."""
        if self.away is None:
            return
        self.close()
        for name in os.listdir(self.mem_root + ".away"):
            if name.startswith("step-") and not os.path.exists(os.path.join(self.mem_root, name)):
                os.rename(os.path.join(self.mem_root + ".away", name), os.path.join(self.mem_root, name))
        shutil.rmtree(self.mem_root + ".away")
        self.memory = {**{s: m for s, m in self.away.items() if s not in self.memory}, **self.memory}
        self.away = None
        self.restore()

    def new_run(self) -> None:
        """The run's folder deleted and a new run started at the same URL, on the same nodes."""
        self.close()
        shutil.rmtree(self.run.path, ignore_errors=True)
        run = self.run
        run.persistent, run.run_token = {}, next(self.tokens)
        self.restore()

    def switch(self) -> None:
        """The other run, sharing the memory folder (one ``root=`` for both)."""
        self.close()
        self.current = 1 - self.current
        self.restore()

    def rewind(self, keep: int) -> None:
        """The newest persistent checkpoints deleted by hand, ``keep`` of them left."""
        self.close()
        run = self.run
        for s in sorted(run.persistent)[keep:]:
            shutil.rmtree(os.path.join(run.path, step_dir(s)))
            del run.persistent[s]
        self.restore()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_ops)
def test_a_restore_returns_this_runs_newest_step_never_another_runs_or_a_deleted_historys(tmp_path_factory, ops):
    model = _Model(str(tmp_path_factory.mktemp("lineage")))
    model.restore()
    try:
        actions = {"train": model.train, "rollback": model.rollback, "rewind": model.rewind,
                   "restart": lambda _: model.restore(), "new_run": lambda _: model.new_run(),
                   "switch": lambda _: model.switch(), "save_now": lambda _: model.save_now(),
                   "away": lambda _: model.go_away(), "back": lambda _: model.come_back()}
        for op, arg in ops:
            actions[op](arg)
        model.restore()
    finally:
        model.close()


def _train(path: str, mem: str, steps: range, start: float = 0.0) -> None:
    tier = ckptkit.MemoryTier(every_steps=1, replicas=0, root=mem)
    with ckptkit.CheckpointManager(path, save=ckptkit.SavePolicy(every_steps=100), memory=tier) as mgr:
        for s in steps:
            mgr.maybe_save(s, {"w": torch.full((3,), start + s)})


def test_a_node_back_from_away_never_takes_the_run_back_to_the_branch_it_left(tmp_path, caplog):
    """A node leaves with its snapshots (drained, ``/dev/shm`` kept); the job restarts from storage
    and goes on, saving again; the node comes back. Its snapshot is newer by step number than
    anything the job has, yet the run left that branch: the job's own newest step is restored."""
    run, mem = str(tmp_path / "run"), str(tmp_path / "mem")

    def manager(every: int) -> ckptkit.CheckpointManager:
        tier = ckptkit.MemoryTier(every_steps=1, replicas=0, root=mem)
        return ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=every), memory=tier)

    with manager(4) as mgr:  # branch 1: persistent 4, snapshots to 7
        for s in range(1, 8):
            if mgr.maybe_save(s, {"w": torch.full((3,), 100.0 + s)}):
                mgr.wait()
    os.rename(mem, mem + ".away")
    with manager(3) as mgr:  # branch 2, without the node: from persistent 4, saving at 6
        state = {"w": torch.zeros(3)}
        assert mgr.restore_latest(state) == 4 and mgr.last_restore.source == "persistent"
        for s in range(5, 7):
            if mgr.maybe_save(s, {"w": torch.full((3,), 200.0 + s)}):
                mgr.wait()
    shutil.move(os.path.join(mem + ".away", "step-0000000007"), mem)  # the node is back with step 7
    with manager(3) as mgr:
        state = {"w": torch.zeros(3)}
        assert mgr.restore_latest(state) == 6 and mgr.last_restore.source == "memory"
    assert torch.equal(state["w"], torch.full((3,), 206.0))
    assert "saved by another trajectory" in caplog.text


def test_a_new_run_at_the_same_url_starts_fresh_and_says_why(tmp_path, caplog):
    run, mem = str(tmp_path / "run"), str(tmp_path / "mem")
    _train(run, mem, range(1, 4))
    shutil.rmtree(run)
    tier = ckptkit.MemoryTier(every_steps=1, replicas=0, root=mem)
    with ckptkit.CheckpointManager(run, memory=tier) as mgr:
        state = {"w": torch.zeros(3)}
        assert mgr.restore_latest(state) is None
    assert torch.equal(state["w"], torch.zeros(3))
    assert "taken by another run" in caplog.text


def test_a_damaged_run_file_gives_a_new_id_and_falls_back_to_persistent(tmp_path, caplog):
    run, mem = str(tmp_path / "run"), str(tmp_path / "mem")
    tier = ckptkit.MemoryTier(every_steps=1, replicas=0, root=mem)
    with ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=2), memory=tier) as mgr:
        for s in range(1, 4):
            mgr.maybe_save(s, {"w": torch.full((3,), float(s))})
    for damage in (b"{not json", b'{"format": "ckptkit-run", "version": 1, "run_id": "../x"}', b"x" * 10000,
                   b"[" * 2000 + b"]" * 2000, b'["ckptkit-run"]', b"\xff\xfe"):
        with open(os.path.join(run, RUN_FILE), "wb") as f:
            f.write(damage)
        with ckptkit.CheckpointManager(run, memory=tier) as mgr:
            state = {"w": torch.zeros(3)}
            assert mgr.restore_latest(state) == 2 and mgr.last_restore.source == "persistent"
        assert torch.equal(state["w"], torch.full((3,), 2.0))
        assert "not a ckptkit run file" in caplog.text or "unreadable" in caplog.text


def test_a_hostile_run_file_is_replaced_never_followed_or_waited_on(tmp_path):
    run, mem = str(tmp_path / "run"), str(tmp_path / "mem")
    outside = tmp_path / "outside.json"
    outside.write_bytes(b"precious")
    _train(run, mem, range(1, 3))
    path = os.path.join(run, RUN_FILE)
    for plant in (lambda: os.mkfifo(path), lambda: os.symlink(outside, path)):
        os.unlink(path)
        plant()
        tier = ckptkit.MemoryTier(every_steps=1, replicas=0, root=mem)
        with ckptkit.CheckpointManager(run, memory=tier) as mgr:  # a FIFO would block a plain open
            state = {"w": torch.zeros(3)}
            assert mgr.restore_latest(state) is None  # the old snapshots' id is gone with the file
        assert os.path.isfile(path) and not os.path.islink(path)
        assert outside.read_bytes() == b"precious"


def test_the_run_file_is_made_once_and_kept(tmp_path):
    run, mem = str(tmp_path / "run"), str(tmp_path / "mem")
    _train(run, mem, range(1, 3))
    with open(os.path.join(run, RUN_FILE), "rb") as f:
        first = f.read()
    _train(run, mem, range(3, 5))
    with open(os.path.join(run, RUN_FILE), "rb") as f:
        assert f.read() == first
    tier = ckptkit.MemoryTier(every_steps=1, replicas=0, root=mem)
    with ckptkit.CheckpointManager(run, memory=tier) as mgr:
        state = {"w": torch.zeros(3)}
        assert mgr.restore_latest(state) == 4 and torch.equal(state["w"], torch.full((3,), 4.0))


# --------------------------------------------------------------- 4 gloo ranks, 2 or 4 nodes

def _rank_state(seed: float) -> dict:
    return _state(int(seed * 1000) + dist.get_rank(), 2000)


def _rank_tier(base: str, kind: str) -> ckptkit.MemoryTier:
    return _tier(base, kind, every_steps=2)


def _rank_train(run: str, base: str, kind: str, seed: float, steps: list[int], persist: list[int]) -> dict:
    """Train through ``steps`` (a snapshot at every even one), a persistent save (committed before
    the next step) at each of ``persist``; every step's state is ``seed + step``'s."""
    saved = {}
    with ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(), memory=_rank_tier(base, kind)) as mgr:
        for s in steps:
            saved[s] = _rank_state(seed + s)
            mgr.maybe_save(s, saved[s])
            if s in persist:
                mgr.save(s, saved[s])
            mgr.wait()
    return saved


def _rank_restore(run: str, base: str, kind: str) -> dict:
    state = _rank_state(-1.0)
    initial = {k: v.clone() for k, v in state.items()}
    with ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(), memory=_rank_tier(base, kind)) as mgr:
        got = mgr.restore_latest(state)
        sources = mgr.last_restore.sources if got is not None else None
    return {"got": got, "sources": sources, "state": state, "initial": initial}


@pytest.mark.parametrize("kind", ["r1", "p4"])
@pytest.mark.parametrize("lose_node", [False, True])
def test_on_4_ranks_a_new_run_never_gets_the_old_runs_copies_replicas_or_shares(worlds, tmp_path, kind, lose_node):
    run, base = str(tmp_path / "run"), str(tmp_path / "mem")
    worlds.run(4, _rank_train, run, base, kind, 0.0, [1, 2, 3, 4], [3])
    shutil.rmtree(run)  # a new run at the same URL, on the same nodes
    if lose_node:
        shutil.rmtree(os.path.join(base, "node1"))
    res = worlds.run(4, _rank_restore, run, base, kind)
    for r in res:
        assert r["got"] is None
        assert all(torch.equal(v, r["initial"][k]) for k, v in r["state"].items())
    # the new run's own snapshots, though, are restored (from peers or parity after a lost node)
    saved = worlds.run(4, _rank_train, run, base, kind, 50.0, [1, 2], [1])
    shutil.rmtree(os.path.join(base, "node1"), ignore_errors=True)
    res = worlds.run(4, _rank_restore, run, base, kind)
    for rank, r in enumerate(res):
        assert r["got"] == 2 and "persistent" not in r["sources"], r["sources"]
        assert all(torch.equal(v, saved[rank][2][k]) for k, v in r["state"].items())


@pytest.mark.parametrize("kind", ["r1", "p4"])
def test_on_4_ranks_a_rewound_run_never_gets_the_snapshots_of_the_deleted_history(worlds, tmp_path, kind):
    run, base = str(tmp_path / "run"), str(tmp_path / "mem")
    saved = worlds.run(4, _rank_train, run, base, kind, 0.0, [1, 2, 3, 4], [1, 3])
    shutil.rmtree(os.path.join(run, step_dir(3)))  # rewound by hand to step 1
    shutil.rmtree(os.path.join(base, "node1"))     # and a node lost on the way
    res = worlds.run(4, _rank_restore, run, base, kind)
    for rank, r in enumerate(res):
        assert r["got"] == 1 and r["sources"] == ("persistent",) * 4
        assert all(torch.equal(v, saved[rank][1][k]) for k, v in r["state"].items())


def test_on_s3_with_a_local_disk_the_run_id_is_the_buckets(tmp_path, s3_env, s3_server):  # noqa: F811
    """A new run in the bucket, on nodes whose local disk (``local_dir``) still holds the old run's
    files: the id is read from the bucket only, so the old snapshots are not restored."""
    url, mem = f"s3://{s3_env}/run", str(tmp_path / "mem")
    tier = ckptkit.MemoryTier(every_steps=1, replicas=0, root=mem)

    def manager() -> ckptkit.CheckpointManager:
        return ckptkit.CheckpointManager(url, save=ckptkit.SavePolicy(every_steps=2), memory=tier,
                                         local_dir=str(tmp_path / "nvme"))

    with manager() as mgr:
        for s in range(1, 4):
            mgr.maybe_save(s, {"w": torch.full((3,), float(s))})
    with manager() as mgr:
        state = {"w": torch.zeros(3)}
        assert mgr.restore_latest(state) == 3 and mgr.last_restore.source == "memory"
    client = s3_server.client()
    for obj in client.list_objects_v2(Bucket=s3_env, Prefix="run/").get("Contents", []):
        client.delete_object(Bucket=s3_env, Key=obj["Key"])  # the run deleted from the bucket only
    from ckptkit.storage.tiered import run_cache_name

    assert os.path.exists(tmp_path / "nvme" / run_cache_name(url) / "step-0000002")
    with manager() as mgr:
        state = {"w": torch.zeros(3)}
        assert mgr.restore_latest(state) is None
    assert torch.equal(state["w"], torch.zeros(3))
