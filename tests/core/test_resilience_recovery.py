"""What a restart must recover, as pure state: the ladder mid-episode, rollbacks the checkpoint
predates (recovery.py), and the steps a crash lost (progress.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.resilience import DetectorConfig, Flags, Ladder, LowerLR, Rewarm, Rollback, SpikePolicy
from ckptkit.resilience.incidents import Incident
from ckptkit.resilience.progress import Progress, ProgressMarker, steps_lost
from ckptkit.resilience.recovery import missing_rollbacks
from ckptkit.storage import open_store


def policy() -> SpikePolicy:
    return SpikePolicy(loss=DetectorConfig(window=32, warmup=8), grad_norm=None,
                       rollback=Rollback(after_spikes=3, window_steps=20, steps_before=5, skip_before=2, skip_after=4),
                       rewarm=Rewarm(factor=0.1, steps=10),
                       lower_lr=LowerLR(max_rollbacks=1, window_steps=500, factor=0.5, max_drops=2))


def samples(step: int) -> tuple[int, int]:
    return 8 * step, 8 * step + 8


def through_json(lad: Ladder) -> Ladder:
    """What a checkpoint gives a restarted process: the state as JSON, into a fresh ladder."""
    back = Ladder(lad.policy)
    back.load_state_dict(json.loads(json.dumps(lad.state_dict())))
    return back


FLAGS = [Flags(), Flags(), Flags(), Flags(loss_spike=True), Flags(loss_nonfinite=True)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(FLAGS), min_size=1, max_size=120), st.data())
def test_a_ladder_restored_at_any_step_decides_as_the_uninterrupted_one(stream, data):
    """Restart points anywhere, mid-episode included: the same decisions and LR factors after."""
    cut = data.draw(st.integers(0, len(stream)))
    pol = policy()
    ref, lad = Ladder(pol), Ladder(pol)
    for i, flags in enumerate(stream):
        step = i + 1
        if i == cut:
            lad = through_json(lad)
        d_ref, d = ref.decide(step, samples(step), flags), lad.decide(step, samples(step), flags)
        assert d == d_ref, (step, cut)
        if d.kind == "stop":
            break
        if d.kind == "rollback":
            for x in (ref, lad):
                x.rolled_back(step, max(0, d.restore_at_most), d.lower_lr)
        assert lad.lr_factor(step + 1) == ref.lr_factor(step + 1)


def test_two_spikes_then_a_restart_then_the_third_rolls_back():
    lad = Ladder(policy())
    for s in range(1, 11):
        lad.decide(s, samples(s), Flags())
    assert lad.decide(11, samples(11), Flags(loss_spike=True)).kind == "skip_step"
    assert lad.decide(12, samples(12), Flags(loss_nonfinite=True)).kind == "skip_step"
    lad = through_json(lad)  # checkpoint at 12, restart
    d = lad.decide(13, samples(13), Flags(loss_nonfinite=True))
    assert d.kind == "rollback" and d.skip == (8 * 9, 8 * 13 + 8 + 4 * 8)  # skip from 2 steps before the first spike


def rollback_incident(at: int, restored: int, lad: Ladder, seq: int | None = None, t: float = 0.0) -> Incident:
    return Incident("rollback", at, time=t, data={"restored": restored, "seq": seq if seq is not None else lad.rollback_count,
                                                  "state": {"ladder": lad.state_dict(), "skips": []}})


def test_missing_rollbacks_is_the_chain_still_in_the_history():
    lad = Ladder(policy())
    a = rollback_incident(40, 30, lad, seq=1, t=1)
    b = rollback_incident(60, 50, lad, seq=2, t=2)
    c = rollback_incident(55, 45, lad, seq=3, t=3)  # back before b's restore point: b is abandoned
    d = rollback_incident(80, 70, lad, seq=4, t=4)
    other = Incident("skip_step", 12, time=0.5)
    old = Incident("rollback", 20, time=0.7, data={"restored": 10, "skip": [1, 2]})  # logged before states were
    assert [r.seq for r in missing_rollbacks([other, old, a, b, c, d], known=0)] == [1, 3, 4]
    assert [r.seq for r in missing_rollbacks([a, b, c, d], known=2)] == [3, 4]
    assert [r.restored for r in missing_rollbacks([a, b, c, d], known=3)] == [70]
    assert missing_rollbacks([a, b, c, d], known=4) == []
    # the same count twice (a rollback in a replay that had not reached an older one's step): the later wins
    e = rollback_incident(35, 25, lad, seq=1, t=5)
    assert [(r.seq, r.restored) for r in missing_rollbacks([a, e], known=0)] == [(1, 25)]


def test_a_restart_from_before_a_rollback_escalates_as_the_run_would():
    """The run rolls back once; a restart from the checkpoint it restored (saved before it) takes
    the rollback's state from its incident, so a second episode lowers the LR (max_rollbacks=1)
    and the re-warm goes on, exactly as without the restart."""
    pol = policy()
    run = Ladder(pol)
    for s in range(1, 11):
        run.decide(s, samples(s), Flags())
    checkpoint_6 = json.loads(json.dumps(run.state_dict()))  # (a checkpoint at step 6 would say the same)
    for s in (11, 12):
        run.decide(s, samples(s), Flags(loss_spike=True))
    d = run.decide(13, samples(13), Flags(loss_spike=True))
    assert d.kind == "rollback" and d.restore_at_most == 6 and not d.lower_lr
    run.rolled_back(13, 6, d.lower_lr)
    incident = rollback_incident(13, 6, run, t=1)

    restarted = Ladder(pol)
    restarted.load_state_dict(checkpoint_6)
    assert restarted.rollback_count == 0 and restarted.lr_factor(7) == 1.0  # what the restart had before
    for rb in missing_rollbacks([incident], restarted.rollback_count):
        restarted.load_state_dict(json.loads(json.dumps(rb.state["ladder"])))
    decisions = []
    for s in range(7, 23):
        flags = Flags(loss_spike=True) if s in (20, 21, 22) else Flags()
        d_run, d_restarted = run.decide(s, samples(s), flags), restarted.decide(s, samples(s), flags)
        assert d_run == d_restarted
        assert run.lr_factor(s) == restarted.lr_factor(s)
        decisions.append(d_run)
    assert restarted.lr_factor(11) == pytest.approx(0.1 + 0.9 * 5 / 10)  # the re-warm from step 6
    assert decisions[-1].kind == "rollback" and decisions[-1].lower_lr  # second rollback: lower the LR


@pytest.mark.parametrize("marker, restored, want", [
    (Progress(14, None, False), 10, (4, 4, True)),  # the agreement of 14 completed, 15 never began
    (Progress(14, 15, False), 10, (4, 5, False)),  # rank 0 may have been inside step 15's agreement
    (Progress(10, 11, False), 10, (0, 1, False)),
    (Progress(30, None, True), 30, (0, 0, True)),  # a clean end at the checkpoint
    (Progress(7, None, False), 0, (7, 7, True)),  # no checkpoint at all: everything was lost
])
def test_steps_lost_from_the_marker(marker, restored, want):
    lost = steps_lost(marker, restored)
    assert lost is not None and (lost.at_least, lost.at_most, lost.exact) == want


def test_steps_lost_without_a_marker():
    assert steps_lost(None, 10) is None
    assert steps_lost(None, 10, fallback_reached=10) is None
    lost = steps_lost(None, 10, fallback_reached=13)  # the newest logged loss: a lower bound only
    assert lost is not None and (lost.at_least, lost.at_most) == (3, None)
    assert lost.describe() == "at least 3 steps lost"


def test_the_marker_round_trips_through_a_real_store_and_keeps_the_newest(tmp_path):
    store = open_store(str(tmp_path))
    marker = ProgressMarker(store, writer=True)
    for step in range(1, 50):
        marker.note(step - 1, step)
        marker.note(step)
    assert marker.wait(marker.note(49, 50))
    assert ProgressMarker(store, writer=False).read() == Progress(49, 50, False, marker.job)
    marker.write(49, closed=True)
    marker.close()
    assert ProgressMarker(store, writer=False).read() == Progress(49, None, True, marker.job)
    assert not ProgressMarker(store, writer=False).note(1)  # other ranks write nothing
    assert ProgressMarker(open_store(str(tmp_path / "empty")), writer=False).read() is None
