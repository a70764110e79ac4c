"""A job killed inside a rollback: the restart finishes the rollback, and never does one twice.

A rollback restores a checkpoint, deletes the abandoned trajectory's newer ones, then records its
outcome (skip range, re-warm, the ladder's memory). A job killed before that record (the restore of
a large checkpoint takes minutes) used to restart with none of it: from the newest checkpoint (the
abandoned trajectory's, when the kill came before the discard), with no skip range and no
re-warm, so it trained on the data the controller had decided to skip, at the full learning rate.
Reproduced with a transient fault (non-finite losses at steps 41 and 42 of the first pass only, as
a flaky device gives): killed after the discard, the restart resumed at step 11 and trained steps
36-45 on samples 280-352, inside the range the rollback skips. The rollback is now recorded as
decided before its restore, and a restart whose newest checkpoint predates its outcome finishes it.

Each case kills the job at one point of the rollback and restarts it; the run must be the
uninterrupted one: the same samples, learning rates and losses at every step, the same weights.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import ckptkit
from ckptkit.resilience.incidents import IncidentLog
from ckptkit.resilience.report import load_report
from ckptkit.storage import open_store
from tests import resilience_model as rm

STEPS = 70
FAULTY = (41, 42)  # non-finite losses there, the first time each step runs in the run


class Crash(BaseException):
    """The job dies here: nothing in ckptkit may handle it (as nothing runs after SIGKILL)."""


def policy() -> ckptkit.SpikePolicy:
    base = rm.spike_policy()
    return replace(base, rollback=replace(base.rollback, after_nonfinite=2))


def job(run: str, records: list, fired: set, kill=None, drop_outcome: bool = False, stop_at: int | None = None) -> None:
    """One job of the run. ``kill(mgr, ctl)`` arms a crash inside the rollback; ``drop_outcome``: the
    rollback's outcome record never reaches the store; ``stop_at``: the job dies at that step's start."""
    model, optim, sched = rm.build(seed=len(records) + 7)
    mgr = ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=10),
                                    keep=ckptkit.RetentionPolicy(keep_last=20), asynchronous=None)
    ctl = ckptkit.ResilienceController(mgr, policy(), batch_size=rm.BATCH, signals=(), watchdog_seconds=None)
    observe = ctl.observe

    def faulty_observe(step, *, loss=None, grad_norm=None, samples=None):
        if step in FAULTY and step not in fired:
            fired.add(step)
            loss = float("nan")
        return observe(step, loss=loss, grad_norm=grad_norm, samples=samples)

    ctl.observe = faulty_observe
    if kill is not None:
        kill(mgr, ctl)
    if drop_outcome:
        record = ctl.log.record
        ctl.log.record = lambda incident: None if incident.kind == "rollback" else record(incident)
    try:
        rm.run(ctl, model, optim, sched, steps=STEPS, on_step=lambda *rec: records.append((*rec, model.weight.detach().clone())),
               stop=(lambda c, s: s == stop_at and c.ladder.rollback_count > 0) if stop_at else None)
        finished = stop_at is None
    except Crash:
        finished = False
    if finished:
        ctl.close()
    else:
        mgr.close()
        ctl.progress.close()
        ctl.log.wait()
        ctl.progress.writer = ctl.log.writer = False


def wrap(obj, name: str, *, before: bool, when=lambda *a, **k: True):
    """Make ``obj.name`` raise Crash before or after doing its work, the first time ``when`` holds."""
    real = getattr(obj, name)
    armed = [True]

    def crashing(*args, **kwargs):
        hit = armed[0] and when(*args, **kwargs)
        if hit and before:
            armed[0] = False
            raise Crash
        out = real(*args, **kwargs)
        if hit:
            armed[0] = False
            raise Crash
        return out
    setattr(obj, name, crashing)


def in_rollback(*args, at_most=None, **kwargs) -> bool:
    return at_most is not None


KILLS = {
    "before the restore": lambda mgr, ctl: wrap(mgr, "restore_latest", before=True, when=in_rollback),
    "after the restore": lambda mgr, ctl: wrap(mgr, "restore_latest", before=False, when=in_rollback),
    "after one deletion of the discard": lambda mgr, ctl: wrap(mgr.folder, "delete", before=False),
    "after the discard": lambda mgr, ctl: wrap(mgr, "discard_after", before=False),
    "before the outcome is recorded": lambda mgr, ctl: wrap(
        ctl.log, "record", before=True, when=lambda incident: incident.kind == "rollback"),
}


def kinds(run: str) -> list[tuple[str, int]]:
    return [(i.kind, i.step) for i in IncidentLog(open_store(run), writer=False).read()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = str(tmp_path_factory.mktemp("reference") / "run")
    records: list = []
    job(run, records, set())
    rollbacks = [i for i in IncidentLog(open_store(run), writer=False).read() if i.kind == "rollback"]
    assert [(i.step, i.data["restored"], i.data["skip"]) for i in rollbacks][:1] == [(42, 10, [280, 656])]
    out = Reference(records)
    out.steps_lost = load_report(run).steps_lost
    return out


class Reference(list):
    """The uninterrupted run's records, and the steps its report says were lost."""

    steps_lost: int


def assert_same_run(records: list, reference: list) -> None:
    got, want = rm.final(records), rm.final(reference)
    assert [(r[0], r[1]) for r in got] == [(r[0], r[1]) for r in want]  # the same samples at every step
    assert [(r[0], r[2]) for r in got] == [(r[0], r[2]) for r in want]  # the same learning rates, exactly
    assert [(r[0], r[3]) for r in got] == [(r[0], r[3]) for r in want]  # the same losses
    assert torch.equal(got[-1][4], want[-1][4])


@pytest.mark.parametrize("point", list(KILLS))
def test_a_job_killed_inside_a_rollback_restarts_as_if_it_had_not_been(tmp_path, reference, point):
    run = str(tmp_path / "run")
    records: list = []
    fired: set = set()
    job(run, records, fired, kill=KILLS[point])
    assert ("rollback_decided", 42) in kinds(run) and ("rollback", 42) not in kinds(run)  # killed inside it
    assert "1 rollback killed before it finished" in load_report(run).describe()  # what `ckptkit report` says
    job(run, records, fired)
    assert kinds(run).count(("rollback", 42)) == 1, kinds(run)  # finished once, by the restart
    assert "rollback_decided" not in load_report(run).summary()  # finished: the decision is bookkeeping
    # the rollback counts the steps it threw away, once: the restart that finished it lost none more (it
    # counted them again from the killed job's marker until 2026-12-06, found by a hunt)
    assert load_report(run).steps_lost == reference.steps_lost, [
        (i.kind, i.step, i.data.get("steps_lost")) for i in load_report(run).incidents]
    assert_same_run(records, reference)


def test_an_outcome_record_lost_then_a_kill_before_the_next_checkpoint_finishes_the_rollback(tmp_path, reference):
    """The outcome record never reached the store and the job died at step 15 (newest checkpoint:
    step 10, the one the rollback restored): the restart takes the decided state again."""
    run = str(tmp_path / "run")
    records: list = []
    fired: set = set()
    job(run, records, fired, drop_outcome=True, stop_at=15)
    job(run, records, fired)
    assert_same_run(records, reference)


def test_an_outcome_record_lost_is_never_redone_once_a_checkpoint_knows_the_rollback(tmp_path, reference):
    """The outcome record never reached the store and the job died at step 35, after checkpoints 20
    and 30 on the new trajectory: they know the rollback, so the restart resumes from step 30 and
    never rolls back to step 10 again (which would delete them and lose 20 steps)."""
    run = str(tmp_path / "run")
    records: list = []
    fired: set = set()
    job(run, records, fired, drop_outcome=True, stop_at=35)
    job(run, records, fired)
    restarts = [i for i in IncidentLog(open_store(run), writer=False).read() if i.kind == "restart"]
    assert [i.step for i in restarts] == [30]
    assert ("rollback", 42) not in kinds(run)  # nothing finished it again
    assert_same_run(records, reference)


def test_which_decided_rollback_is_unfinished():
    """The newest decided rollback without its outcome (its ``rollback`` record of the same sequence
    number and step, or a ``stop`` at that step); a good record read back from the store is one."""
    import json

    from ckptkit.resilience.incidents import Incident
    from ckptkit.resilience.recovery import INTENT, RollbackIntent, unfinished_rollback

    def decided(step, seq):
        return Incident(INTENT, step, "spikes", data=RollbackIntent(
            seq, step, "spikes", step - 30, (step * 8, step * 8 + 40), False, (step - 1, step), [[step * 8, step * 8 + 40]],
            {"rollbacks": [0] * (seq - 1)}).data())

    def outcome(step, seq):
        return Incident("rollback", step, "spikes", data={"seq": seq, "restored": step - 30})

    assert unfinished_rollback([]) is None
    assert unfinished_rollback([decided(42, 1), outcome(42, 1)]) is None
    assert unfinished_rollback([decided(42, 1), Incident("stop", 42, "no checkpoint")]) is None
    assert unfinished_rollback([decided(42, 1)]).at == 42
    assert unfinished_rollback([decided(42, 1), outcome(42, 2)]).at == 42  # another rollback's outcome
    assert unfinished_rollback([decided(42, 1), outcome(42, 1), decided(90, 2)]).seq == 2
    assert unfinished_rollback([decided(42, 1), Incident("spike", 42, "x")]).at == 42
    again = Incident.from_json(json.loads(json.dumps(decided(42, 1).to_json())))
    assert RollbackIntent.from_incident(again) == RollbackIntent.from_incident(decided(42, 1))
