"""A preemption while a save still persists: the emergency save waits for it, never skips.

With ``AsyncOptions(on_busy="skip")`` a save requested while the previous one persists is skipped
(training never waits). The resilience controller's emergency save on SIGTERM was skipped the same
way: the job trained on through its grace period, step after step, saving nothing, and was killed
with nothing newer than the save in flight (reproduced: preempted at step 3 of a run whose step-1
save took 2 s, it was still training at step 7). A save with a deadline now waits for the one in
flight, then saves and stops.

The in-flight save is made slow by wrapping the thread executor's write with a sleep: storage
that takes its time, the real writer underneath.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import ckptkit
import ckptkit.engine.async_save as async_save


@pytest.fixture
def slow_storage(monkeypatch):
    write = async_save.write_staged

    def slow(*args, **kwargs):
        time.sleep(1.5)
        return write(*args, **kwargs)

    monkeypatch.setattr(async_save, "write_staged", slow)


@pytest.mark.parametrize("on_busy", ["skip", "wait"])
def test_an_emergency_save_waits_for_the_save_in_flight_then_stops(tmp_path, slow_storage, on_busy):
    run = str(tmp_path / "run")
    mgr = ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=1),
                                    asynchronous=ckptkit.AsyncOptions(on_busy=on_busy))
    ctl = ckptkit.ResilienceController(mgr, batch_size=4, signals=(), grace_seconds=60, watchdog_seconds=None)
    state = {"w": torch.zeros(8)}
    start = ctl.resume(state)
    trained = []
    for step, _ in ctl.batches(lambda p: p, start):
        if step == 3:
            ctl.preempt()  # SIGTERM while step 2's save (or step 1's) persists; agreed at this observe
        ctl.observe(step, loss=1.0)
        state["w"] += 1
        trained.append(step)
        ctl.maybe_save(step, state)
        if ctl.should_stop or step >= 10:
            break
    ctl.close()
    assert trained == [1, 2, 3]  # stopped at the preempted step, not trained on through the grace period
    steps = sorted(r.step for r in mgr.records() if r.committed)
    assert steps[-1] == 3, steps
    target = {"w": torch.zeros(8)}
    ckptkit.load(target, os.path.join(run, "step-0000003"), strict=False)  # and the controller's state
    assert torch.equal(target["w"], torch.full((8,), 3.0))


def test_without_a_deadline_a_busy_save_is_still_skipped(tmp_path, slow_storage):
    mgr = ckptkit.CheckpointManager(str(tmp_path / "run"), asynchronous=ckptkit.AsyncOptions(on_busy="skip"))
    state = {"w": torch.zeros(8)}
    assert mgr.save(1, state) is not None
    assert mgr.save(2, state) is None  # training never waits for storage
    assert mgr.save(3, state, deadline=time.monotonic() + 60) is not None  # but a deadline's save does
    mgr.close()
    assert sorted(r.step for r in mgr.records() if r.committed) == [1, 3]


def test_an_emergency_save_past_the_grace_period_is_abandoned_once_and_close_ends_cleanly(tmp_path, monkeypatch):
    """The emergency save cannot commit within the grace period (0.5 s; its write takes 7 s): the
    controller stops waiting 5 s after it, records the save as abandoned, and ``close`` ends the job
    cleanly. ``close`` used to raise the abandoned save's failure once it came (the controller had
    acknowledged only finished saves), and skipped the rest of the shutdown: the progress marker
    stayed open, so the next start reported a crash."""
    from ckptkit.resilience.progress import ProgressMarker
    from ckptkit.storage import open_store

    write = async_save.write_staged

    def slower(*args, **kwargs):
        time.sleep(7)
        return write(*args, **kwargs)

    monkeypatch.setattr(async_save, "write_staged", slower)
    run = str(tmp_path / "run")
    mgr = ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=100))
    ctl = ckptkit.ResilienceController(mgr, batch_size=4, signals=(), grace_seconds=0.5, watchdog_seconds=None)
    state = {"w": torch.zeros(8)}
    for step, _ in ctl.batches(lambda p: p, ctl.resume(state)):
        if step == 3:
            ctl.preempt()
        ctl.observe(step, loss=1.0)
        ctl.maybe_save(step, state)
        if ctl.should_stop:
            break
    ctl.close()  # no raise: the abandoned save was dealt with
    incidents = [(i.kind, i.step, i.detail) for i in ctl.log.read()]
    assert [(k, s) for k, s, _ in incidents] == [("preempt", 3), ("save_abandoned", 3)]
    assert "not committed within the grace period" in incidents[1][2]
    assert ProgressMarker(open_store(run), writer=False).read().closed
    assert not any(r.committed for r in mgr.records())  # abandoned at its commit: nothing half-made


def test_close_gives_the_signals_back(tmp_path):
    """The controller's SIGTERM handler only notes the time; after ``close`` (evaluation, export) a
    SIGTERM must end the job again: the handlers it replaced are put back."""
    import signal

    def mine(signum, frame):
        pass

    before = signal.signal(signal.SIGUSR1, mine)
    try:
        default_term = signal.getsignal(signal.SIGTERM)
        mgr = ckptkit.CheckpointManager(str(tmp_path / "run"), asynchronous=None)
        ctl = ckptkit.ResilienceController(mgr, batch_size=4, watchdog_seconds=None)  # SIGTERM and SIGUSR1
        assert signal.getsignal(signal.SIGTERM) == ctl._on_signal
        ctl.close()
        assert signal.getsignal(signal.SIGTERM) == default_term and signal.getsignal(signal.SIGUSR1) is mine
    finally:
        signal.signal(signal.SIGUSR1, before)


def _preempted_run(run: str, asynchronous, grace: float, at: int = 3, fail_saves=(), monkeypatch=None):
    """Train until the controller stops after a preemption at step ``at`` (saves every 2 steps); the
    error ``maybe_save`` raised (None is right), ``should_stop``, the incidents and the committed steps.
    ``fail_saves``: steps whose background write fails (a disk that filled up, then has room again)."""
    write = async_save.write_staged

    def failing(*args, **kwargs):
        if failing.step in fail_saves:
            raise OSError(28, "No space left on device")
        return write(*args, **kwargs)

    failing.step = -1
    if monkeypatch is not None:
        monkeypatch.setattr(async_save, "write_staged", failing)
    mgr = ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=2), asynchronous=asynchronous)
    ctl = ckptkit.ResilienceController(mgr, batch_size=4, signals=(), grace_seconds=grace, watchdog_seconds=None)
    state = {"w": torch.zeros(8)}
    error = None
    for step, _ in ctl.batches(lambda p: p, ctl.resume(state)):
        if step == at:
            ctl.preempt()
        ctl.observe(step, loss=1.0)
        state["w"] += 1
        failing.step = step
        try:
            ctl.maybe_save(step, state)
            if step in fail_saves:
                mgr.wait_snapshot()
                time.sleep(0.3)  # the background write fails before the next step
        except Exception as exc:  # noqa: BLE001 - what the training loop would see
            error = exc
            break
        if ctl.should_stop or step >= 8:
            break
    ctl.close()
    kinds = [(i.kind, i.step) for i in ctl.log.read()]
    return error, ctl.should_stop, kinds, sorted(r.step for r in mgr.records() if r.committed)


@pytest.mark.parametrize("asynchronous", [ckptkit.AsyncOptions(), None], ids=["async", "sync"])
def test_an_emergency_save_past_its_deadline_is_abandoned_whatever_the_saver(tmp_path, asynchronous):
    """A grace period too short for the save: abandoned, the previous checkpoint stands, the job stops.
    A synchronous manager's save raised its deadline out of ``maybe_save`` instead (found by a hunt,
    2026-12-06): a traceback, no incident, ``should_stop`` False."""
    error, stopped, kinds, committed = _preempted_run(str(tmp_path / "run"), asynchronous, grace=0.0)
    assert error is None and stopped
    assert kinds == [("preempt", 3), ("save_abandoned", 3)] and committed == [2]


def test_an_emergency_save_after_a_failed_periodic_save_is_still_made(tmp_path, monkeypatch):
    """The periodic save of step 2 failed in the background; the preemption at step 3 raised that old
    failure instead of saving (found by a hunt, 2026-12-06). It is reported, and step 3 saved."""
    error, stopped, kinds, committed = _preempted_run(str(tmp_path / "run"), ckptkit.AsyncOptions(), grace=30.0,
                                                      fail_saves=(2,), monkeypatch=monkeypatch)
    assert error is None and stopped
    assert kinds == [("preempt", 3), ("emergency_save", 3)] and committed == [3]
