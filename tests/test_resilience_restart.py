"""Restarts after a rollback, inside its LR re-warm window, with the real manager on a real model.

The uninterrupted run (the ``reference`` fixture) spikes on the poisoned range at steps 101-103,
rolls back to step 70, skips the data and re-warms the learning rate over steps 71-90. A job
that "crashes" somewhere in there (it stops at the start of a step without closing: no flush,
no clean-exit marker, as SIGKILL would leave it) and is restarted must train the same steps
with the same learning rate, the same losses and the same final weights. Then: the steps a
crash lost, as the restart incident reports them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.resilience.incidents import Incident, IncidentLog
from ckptkit.resilience.report import crash_spans, figure, load_report
from ckptkit.storage import open_store
from tests import resilience_model as rm

STEPS = 140
SHM = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


_ROOT: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _runs_root():
    """One folder for this module's runs, on tmpfs where there is one (the per-step progress
    marker is an fsync'd write), removed afterwards."""
    _ROOT.append(tempfile.mkdtemp(prefix="ckptkit-restart-", dir=SHM))
    yield
    shutil.rmtree(_ROOT.pop(), ignore_errors=True)


def new_run() -> str:
    return os.path.join(tempfile.mkdtemp(dir=_ROOT[-1]), "run")


class Crash(Exception):
    """The job dies here (raised from a step's callback)."""


def job(run: str, records: list, *, stop=None, crash_after: int | None = None, every: int = 10,
        policy: ckptkit.SpikePolicy | None = None, name: str | None = None,
        keep: ckptkit.RetentionPolicy = ckptkit.RetentionPolicy(keep_last=20)) -> ckptkit.ResilienceController:
    """One job of the run: resume, train to STEPS; ``stop`` / ``crash_after`` end it as a crash does."""
    model, optim, sched = rm.build(seed=len(records) + 7)  # a different init: all must come from the run
    mgr = ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=every), keep=keep)
    ctl = ckptkit.ResilienceController(mgr, policy or rm.spike_policy(), batch_size=rm.BATCH, signals=(), name=name)

    def on_step(*rec):
        records.append((*rec, model.weight.detach().clone()))
        if rec[0] == crash_after:
            raise Crash  # after the step's optimizer step

    try:
        finished = rm.run(ctl, model, optim, sched, steps=STEPS, stop=stop, on_step=on_step)
    except Crash:
        finished = False
    if finished:
        ctl.close()
    else:  # what the dead job left: saves and incident/marker writes already under way land; nothing else
        mgr.close()
        ctl.progress.close()
        ctl.log.wait()
        ctl.progress.writer = ctl.log.writer = False  # dead: its loop (kept in rm.KILLED) writes nothing later
    return ctl


def after_rollback(step: int):
    """Stop at the start of ``step`` once the run has rolled back (the first pass runs it too)."""
    return lambda ctl, s: s == step and len(ctl.ladder.rollbacks) > 0


def incidents(run: str) -> list[Incident]:
    return IncidentLog(open_store(run), writer=False).read()


def restarts(run: str) -> list[Incident]:
    return [i for i in incidents(run) if i.kind in ("restart", "resume")]


def assert_same_run(records: list, reference: list) -> None:
    got, want = rm.final(records), rm.final(reference)
    assert [r[0] for r in got] == [r[0] for r in want] == list(range(1, STEPS + 1))
    assert [(r[0], r[1]) for r in got] == [(r[0], r[1]) for r in want]  # same samples
    assert [(r[0], r[2]) for r in got] == [(r[0], r[2]) for r in want]  # same LR at every step, exactly
    assert [(r[0], r[3]) for r in got] == [(r[0], r[3]) for r in want]  # same losses, exactly
    assert torch.equal(got[-1][4], want[-1][4])  # same final weights


@pytest.fixture(scope="module")
def reference():
    run = new_run()
    records: list = []
    job(run, records)
    rollback = [i for i in incidents(run) if i.kind == "rollback"]
    assert [(i.step, i.data["restored"]) for i in rollback] == [(103, 70)]
    lrs = {r[0]: r[2] for r in rm.final(records)}
    base = {s: lrs[s] / (0.1 + 0.9 * (s - 70) / 20) for s in range(71, 90)}  # the scheduled LR
    assert all(b == pytest.approx(2e-2) for b in base.values())  # steps 71-89 re-warm from 0.1x
    assert lrs[90] == pytest.approx(2e-2)
    return records


CASES = {
    # killed in the window before any new checkpoint: resumes from step 70, saved before the rollback
    "from the checkpoint the rollback restored": dict(stop=after_rollback(78), restored=70),
    # a checkpoint saved inside the window (step 80) knows the re-warm itself
    "from a checkpoint saved in the window": dict(stop=after_rollback(85), restored=80),
    # between the spikes of the episode: the checkpoint at 102 holds spikes 101 and 102, so the
    # restarted run rolls back at 103 as well, to the same step, skipping the same range
    "between two spikes of an episode": dict(stop=lambda ctl, s: s == 103, restored=102, every=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_restart_continues_the_uninterrupted_run(case, reference):
    c = CASES[case]
    run = new_run()
    records: list = []
    job(run, records, stop=c["stop"], every=c.get("every", 10))
    job(run, records, every=c.get("every", 10))
    assert [i.step for i in restarts(run)] == [c["restored"]]
    assert_same_run(records, reference)


def test_a_restart_after_the_restored_checkpoint_is_lost_replays_to_it(reference):
    """Step 70 is gone (deleted after the rollback restored it): the restart resumes from step 60,
    replays 61-70 as the run did, and takes up the rollback's state when it reaches step 70."""
    run = new_run()
    records: list = []
    job(run, records, stop=after_rollback(78))
    os.remove(os.path.join(run, "step-0000070", "manifest.json"))
    job(run, records)
    assert restarts(run)[0].step == 60
    assert_same_run(records, reference)


def test_a_lowered_learning_rate_survives_a_restart():
    """OPT-style: every rollback lowers the LR for good. A restart from the checkpoint the rollback
    restored keeps it lowered (it came back at full LR before: the drop lived only in memory)."""
    base = rm.spike_policy()
    policy = replace(base, lower_lr=replace(base.lower_lr, on_every_rollback=True))
    ref_run, run = new_run(), new_run()
    reference: list = []
    job(ref_run, reference, policy=policy)
    records: list = []
    job(run, records, stop=after_rollback(78), policy=policy)
    job(run, records, policy=policy)
    lrs = {r[0]: r[2] for r in rm.final(records)}
    assert lrs[STEPS] == pytest.approx(0.5 * 2e-2)
    assert_same_run(records, reference)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(40, 150), min_size=1, max_size=2))
@example([105, 5])  # step 72 after the rollback, then again at step 75: twice from step 70
def test_any_restarts_continue_the_uninterrupted_run(reference, kills):
    """Jobs that die after ``n`` steps each (counting steps run again), wherever that falls."""
    run = new_run()
    records: list = []
    for n in kills:
        ran = len(records)
        job(run, records, stop=lambda ctl, s, ran=ran, n=n: len(records) - ran >= n)
    job(run, records)
    assert_same_run(records, reference)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(40, 150), min_size=1, max_size=2))
@example([95])  # killed at step 96 (checkpoint 90): the rollback at 103 still needs step 70
@example([105, 5])
def test_restarts_with_keep_last_one_continue_the_uninterrupted_run(reference, kills):
    """``keep_last=1``: retention keeps what the rollback at step 103 goes back to (step 70, 30 steps
    before the first spike) across the jobs' restarts; the run is the uninterrupted one, and the
    reference keeps 20."""
    run = new_run()
    records: list = []
    keep = ckptkit.RetentionPolicy(keep_last=1)
    for n in kills:
        ran = len(records)
        job(run, records, stop=lambda ctl, s, ran=ran, n=n: len(records) - ran >= n, keep=keep)
    job(run, records, keep=keep)
    assert_same_run(records, reference)


# ------------------------------------------------------------------------------- steps lost
def test_steps_lost_are_exact_when_the_crash_came_after_the_step():
    """The job dies after step 84's optimizer step (checkpoint 80): exactly 4 steps lost."""
    run = new_run()
    job(run, [], crash_after=84)
    job(run, [], stop=lambda ctl, s: True)  # resumes, then dies before it completes a step
    job(run, [])
    first, second = restarts(run)
    assert (first.kind, first.step, first.data["steps_lost"], first.data["exact"]) == ("restart", 80, 4, True)
    assert "4 steps lost" in first.detail and "at least" not in first.detail
    assert (second.kind, second.step, second.data["steps_lost"]) == ("restart", 80, 0)  # not the 4 again


def fail_at(step: int):
    def stop(ctl, s):
        if s == step:
            raise Crash  # e.g. a peer's death, surfacing in the framework's collectives of the forward pass
        return False
    return stop


def test_steps_lost_are_exact_when_the_job_died_of_an_error_inside_a_step():
    """The loop dies inside step 86, before its agreement: exactly 5 steps lost (81-85)."""
    run = new_run()
    job(run, [], stop=fail_at(86))
    job(run, [])
    first = restarts(run)[0]
    assert (first.step, first.data["steps_lost"], first.data["exact"]) == (80, 5, True)


def test_steps_lost_in_a_kill_mid_step_are_bounded_within_one():
    """Killed at the start of step 86 (its "entering" note stored): 5 steps are certain, and the
    sixth cannot be ruled out from the marker alone (rank 0 may have died inside step 86's
    agreement after the other ranks finished it)."""
    run = new_run()
    job(run, [], stop=lambda ctl, s: s == 86)
    job(run, [])
    first = restarts(run)[0]
    assert (first.step, first.data["steps_lost"], first.data["steps_lost_max"]) == (80, 5, 6)
    assert "at least 5 steps lost (at most 6)" in first.detail


def test_steps_lost_before_the_first_checkpoint_and_after_a_rollback():
    run = new_run()
    job(run, [], crash_after=7)  # no checkpoint yet: all seven steps are lost
    job(run, [], stop=lambda ctl, s: len(ctl.ladder.rollbacks) > 0)  # dies right after the rollback
    job(run, [])
    first, second = restarts(run)
    assert (first.step, first.data["steps_lost"], first.data["exact"]) == (0, 7, True)
    assert "from the start" in first.detail
    rollback = next(i for i in incidents(run) if i.kind == "rollback")
    assert rollback.data["steps_lost"] == 33  # counted once, there ...
    assert (second.step, second.data["steps_lost"]) == (70, 0)  # ... and not again by the restart
    assert load_report(run).steps_lost == 7 + 33


def test_the_report_names_the_run_and_shades_the_steps_the_crash_lost():
    run = new_run()
    job(run, [], crash_after=84)  # checkpoint 80: steps 81-84 lost
    assert load_report(run).title == "run"  # nothing recorded: the folder's name
    job(run, [], name="exp-7")
    rep = load_report(run)
    assert rep.title == "exp-7" and rep.to_json()["name"] == "exp-7"
    assert crash_spans(rep) == [(80, 84, 4)]
    ax = figure(rep).axes[0]
    assert ax.get_title(loc="left") == "exp-7" and "4 steps lost" in {t.get_text() for t in ax.texts}
    assert [p.get_gid() for p in ax.patches if p.get_gid()] == ["lost:80-84"]


HOSTILE_MARKERS = {
    "infinity": b'{"step": Infinity, "entering": null}', "overflow": b'{"step": 3, "entering": 1e999}',
    "huge int": b'{"step": 1' + b"0" * 40 + b"}", "negative": b'{"step": -5}', "float step": b'{"step": 3.5}',
    "string step": b'{"step": "12"}', "bool closed": b'{"step": 3, "closed": "yes"}', "a list": b"[1, 2]",
    "deep": b'{"step": 3, "job": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nan": b'{"step": NaN}',
    "duplicate keys": b'{"step": 3, "step": 4}', "not utf-8": b'{"step": 3, "job": "\xff"}',
    "oversized": b'{"step": 3, "job": "' + b"x" * (1 << 17) + b'"}', "garbage": b"\x00garbage",
}


@pytest.mark.parametrize("marker", list(HOSTILE_MARKERS))
def test_a_hostile_progress_marker_is_no_marker(marker):
    """The marker is advisory and read by rank 0 alone before the collective restore: whatever it holds,
    the resume goes on from the newest checkpoint (as without a marker). ``Infinity`` and ``1e999`` raised
    OverflowError there, on rank 0 alone, and the other ranks waited in the restore (hunt, 2026-12-06)."""
    from ckptkit.resilience.progress import PROGRESS

    run = new_run()
    job(run, [], crash_after=24)
    with open(os.path.join(run, PROGRESS), "wb") as f:
        f.write(HOSTILE_MARKERS[marker])
    records: list = []
    job(run, records, stop=lambda ctl, step: step >= 23)
    assert records[0][0] == 21
