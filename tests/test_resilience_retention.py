"""Retention never takes from the resilience controller the checkpoint a spike rollback goes back to.

A rollback restores the newest checkpoint at least ``steps_before`` steps before its episode's
first spike. Retention used to run as if rollbacks did not exist: with ``keep_last=1`` (or any
``keep_last`` covering fewer than ``steps_before`` steps of saves) it deleted every checkpoint old
enough, and the first spike episode stopped the run for a human ("no checkpoint at or before step
71") although the checkpoint it wanted had been committed. The controller now tells the manager
what a rollback may still restore (``CheckpointManager.hold_for_rollback``).

The oracle: the same run with nothing ever deleted. Whatever the retention rules, the save interval
and the rollback policy, a run with the controller must take exactly the decisions (rollbacks, to
which step, stops) and end in exactly the state of that run, bit for bit.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.errors import TrainingStopped
from ckptkit.resilience import DetectorConfig, LowerLR, Rollback
from tests.conftest import trials

BATCH = 4
STEPS = 60


def run(root: str, *, keep: ckptkit.RetentionPolicy, every: int, policy: ckptkit.SpikePolicy,
        bad: frozenset[int], asynchronous: bool = False) -> tuple[list[tuple], list[int], bytes]:
    """Train a one-number model on samples 0, 1, 2, ...; a batch holding a ``bad`` sample has a
    loss of 1e6 (a spike), every other one 1.0. Returns the controller's decisions, the steps
    committed at the end, and the final state's bytes."""
    mgr = ckptkit.CheckpointManager(root, save=ckptkit.SavePolicy(every_steps=every), keep=keep,
                                    asynchronous=ckptkit.AsyncOptions() if asynchronous else None)
    ctl = ckptkit.ResilienceController(mgr, policy, batch_size=BATCH, signals=(), watchdog_seconds=None)
    state = {"w": torch.zeros(1, dtype=torch.float64)}
    events: list[tuple] = []
    try:
        start = ctl.resume(state)
        for step, first in ctl.batches(lambda p: p, start):
            if step > STEPS:
                break
            samples = range(first, first + BATCH)
            action = ctl.observe(step, loss=1e6 if bad.intersection(samples) else 1.0)
            if action.rollback:
                action.restore(state)
                events.append(("rollback", step, ctl.step))
                continue
            if not action.skip_step:
                state["w"] += float(sum(samples))  # exact in float64: any other trajectory differs
            if ctl.maybe_save(step, state) is not None:
                events.append(("saved", step))
    except TrainingStopped as exc:
        events.append(("stopped", ctl.step, str(exc)))
    finally:
        ctl.close()
        mgr.close()
    steps = sorted(r.step for r in mgr.records() if r.committed)
    return events, steps, state["w"].numpy().tobytes()


policies = st.builds(
    lambda after, before, skip_before, skip_after, lower, retain: ckptkit.SpikePolicy(
        loss=DetectorConfig(window=8, warmup=2), grad_norm=None,
        rollback=Rollback(after_spikes=after, window_steps=20, steps_before=before,
                          skip_before=skip_before, skip_after=skip_after, retain=retain),
        rewarm=None, lower_lr=LowerLR(max_rollbacks=lower, max_drops=1)),
    st.integers(1, 3), st.integers(0, 30), st.integers(0, 4), st.integers(0, 4), st.integers(1, 3), st.integers(1, 3),
)


def provided_for(events: list[tuple], retain: int) -> int:
    """How many of ``events`` the hold provides for: up to the first rollback that is the ``retain + 1``-th
    in a row (all of them when there is none). A rollback is in a row with the one before when it restores
    an older step than that one did: it reaches into history the first rollback's retention already let go
    of (the hold keeps ``depth`` such levels, :class:`ckptkit.retention.RollbackHold`). A save between does
    not end the row: a save on the new trajectory below the first rollback's step cannot bring back the
    older checkpoints retention deleted before it (hypothesis found rollback 5 -> 2, save 3, rollback
    4 -> 1 with ``retain=1``, which the earlier reading, "nothing saved between", counted as provided)."""
    in_a_row, last = 0, None
    for i, event in enumerate(events):
        if event[0] != "rollback":
            continue
        in_a_row = in_a_row + 1 if last is not None and event[2] < last else 1
        last = event[2]
        if in_a_row > retain:
            return i
    return len(events)
retention = st.builds(ckptkit.RetentionPolicy, st.integers(1, 3),
                      st.one_of(st.none(), st.sampled_from([7, 20])))
# up to three poisoned ranges of samples (each a few batches): one spike episode each
poison = st.lists(st.tuples(st.integers(0, STEPS * BATCH - 1), st.integers(1, 3 * BATCH)), max_size=3).map(
    lambda ranges: frozenset(i for a, n in ranges for i in range(a, a + n)))


@pytest.fixture
def shm_dir():
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    path = tempfile.mkdtemp(prefix="ckptkit-rr-", dir=base)  # tmpfs: the progress marker fsyncs per step
    yield path
    shutil.rmtree(path, ignore_errors=True)


@settings(max_examples=trials(12, 150), deadline=None)
@given(keep=retention, every=st.integers(1, 12), policy=policies, bad=poison, asynchronous=st.booleans())
@example(keep=ckptkit.RetentionPolicy(keep_last=1), every=1,  # a second rollback reaching further back, one kept
         policy=ckptkit.SpikePolicy(loss=DetectorConfig(window=8, warmup=2), grad_norm=None,
                                    rollback=Rollback(after_spikes=1, window_steps=20, steps_before=3, skip_before=1,
                                                      skip_after=0, retain=1),
                                    rewarm=None, lower_lr=LowerLR(max_rollbacks=1, max_drops=1)),
         bad=frozenset(range(16, 21)), asynchronous=False)
@example(keep=ckptkit.RetentionPolicy(keep_last=1), every=10,  # the reproduced case: it stopped at step 43
         policy=ckptkit.SpikePolicy(loss=DetectorConfig(window=8, warmup=2), grad_norm=None,
                                    rollback=Rollback(after_spikes=3, steps_before=30, skip_before=2, skip_after=4),
                                    rewarm=None),
         bad=frozenset(range(160, 172)), asynchronous=True)
def test_retention_never_changes_what_a_rollback_restores(keep, every, policy, bad, asynchronous):
    base = tempfile.mkdtemp(prefix="ckptkit-rr-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    try:
        # retention runs as each save commits: in the background when saves are asynchronous
        kept = run(os.path.join(base, "kept"), keep=keep, every=every, policy=policy, bad=bad, asynchronous=asynchronous)
        everything = run(os.path.join(base, "all"), keep=ckptkit.RetentionPolicy(), every=every, policy=policy, bad=bad)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    n = provided_for(everything[0], policy.rollback.retain)
    assert kept[0][:n] == everything[0][:n]  # the same saves, rollbacks to the same steps, and stops
    if n == len(everything[0]):
        assert kept[0] == everything[0]
        assert kept[2] == everything[2]  # the same state, bit for bit
        assert set(kept[1]) <= set(everything[1])


def test_keep_last_one_with_a_rollback_of_thirty_steps(shm_dir):
    """The reported run: saves every 10 steps, ``keep_last=1``, a rollback to 30 steps before the
    first spike at step 41. It used to stop: every checkpoint but step 40's had been deleted."""
    policy = ckptkit.SpikePolicy(loss=DetectorConfig(window=8, warmup=2), grad_norm=None,
                                 rollback=Rollback(after_spikes=3, steps_before=30, skip_before=2, skip_after=4),
                                 rewarm=None)
    events, steps, _ = run(os.path.join(shm_dir, "run"), keep=ckptkit.RetentionPolicy(keep_last=1), every=10,
                           policy=policy, bad=frozenset(range(160, 172)))
    assert [e for e in events if e[0] != "saved"] == [("rollback", 43, 10)], events
    # at the end (step 60, no open episode): step 60, what a rollback from step 61 on may restore (the
    # newest at or before 31, and every later one), and what one right after a rollback to step 30
    # may restore (any at or before a bound from 1 on): with saves 10 steps apart, all of them
    assert steps == [10, 20, 30, 40, 50, 60]
    listed = {i.step: i.keep for i in ckptkit.list_checkpoints(os.path.join(shm_dir, "run"))}
    assert all("rollback" in listed[s] for s in steps) and listed[60][:2] == ("latest", "last")
