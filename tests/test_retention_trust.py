"""Retention never costs the run its last checkpoint that loads (ckptkit/retention.py, run_folder.py).

A manifest says a checkpoint is committed; only a load says its data is whole. A restore that went
past a damaged step knows it; retention used to count that step anyway: a damaged newest step stayed
"latest" and ``keep_last`` deleted every checkpoint the resumed run saved, the one just committed
included, and the next restart found nothing that loads (found by a hunt, 2026-12-06). The same
deletion of the save just committed happened after a rewind (``restore_latest(at_most=)``) without
``discard_after``. Here the whole class: random histories of saves, damaged steps, restores and
saves after them, each checked against what a fresh restart restores.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.retention import BestK, Record, RetentionPolicy, decide
from tests.damage import flip_byte


def state(step: int) -> dict:
    return {"w": torch.full((16,), float(step)), "meta": {"step": step}}


def fresh_restore(root: str) -> int | None:
    got = {"w": torch.zeros(16), "meta": {"step": -1}}
    step = ckptkit.CheckpointManager(root).restore_latest(got)
    if step is not None:
        assert got["meta"]["step"] == step and torch.equal(got["w"], state(step)["w"])
    return step


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=st.sets(st.integers(1, 30), min_size=1, max_size=5), keep=st.integers(1, 3), data=st.data())
def test_saves_after_a_restore_past_damage_are_never_deleted_for_it(tmp_path_factory, before, keep, data):
    """Steps saved, some damaged; a restart with ``keep_last`` restores past the damage and saves on
    (sometimes a damaged step's own number again, sometimes below a damaged newer one). After every
    save: the step just saved is there, and a fresh restart restores it, bit-exact."""
    root = str(tmp_path_factory.mktemp("run"))
    first = ckptkit.CheckpointManager(root, asynchronous=None)
    for step in sorted(before):
        first.save(step, state(step))
    first.close()
    damaged = data.draw(st.sets(st.sampled_from(sorted(before))), label="damaged")
    for step in damaged:
        folder = os.path.join(root, f"step-{step:07d}", "data")
        flip_byte(os.path.join(folder, os.listdir(folder)[0]), where=0.0)
    mgr = ckptkit.CheckpointManager(root, keep=RetentionPolicy(keep_last=keep), asynchronous=None)
    good = sorted(before - damaged)
    try:
        restored = mgr.restore_latest({"w": torch.zeros(16), "meta": {"step": -1}})
    except ckptkit.CorruptCheckpointError:  # every step damaged after part of the state was loaded
        assert not good
        restored = None
    assert restored == (good[-1] if good else None)
    start = -1 if restored is None else restored
    later = data.draw(st.lists(st.integers(start + 1, 40), min_size=1, max_size=4, unique=True), label="later")
    for step in sorted(later):
        mgr.save(step, state(step))
        assert os.path.isdir(os.path.join(root, f"step-{step:07d}")), (step, sorted(os.listdir(root)))
        assert fresh_restore(root) == step
    mgr.close()


def test_a_save_after_a_rewind_without_discard_is_kept(tmp_path):
    """``restore_latest(at_most=)`` without ``discard_after``, then a save below the newer steps: kept
    (it was deleted as it committed; retention took the newer step for the newest)."""
    root = str(tmp_path / "run")
    first = ckptkit.CheckpointManager(root, asynchronous=None)
    for step in (200, 300):
        first.save(step, state(step))
    first.close()
    mgr = ckptkit.CheckpointManager(root, keep=RetentionPolicy(keep_last=1), asynchronous=None)
    assert mgr.restore_latest({"w": torch.zeros(16), "meta": {"step": -1}}, at_most=250) == 200
    mgr.save(210, state(210))
    assert {"step-0000210", "step-0000300"} <= set(os.listdir(root))
    mgr.close()


records_st = st.lists(st.builds(lambda step, committed: Record(f"step-{step:07d}", step, committed),
                                st.integers(0, 500), st.booleans()), max_size=20, unique_by=lambda r: r.step)


@settings(max_examples=300, deadline=None)
@given(records=records_st, keep=st.integers(1, 4), data=st.data())
def test_distrusted_checkpoints_are_neither_counted_nor_deleted(records, keep, data):
    committed = [r.name for r in records if r.committed]
    distrusted = frozenset(data.draw(st.sets(st.sampled_from(committed))) if committed else ())
    d = decide(records, RetentionPolicy(keep_last=keep), distrusted=distrusted)
    trusted = sorted((r for r in records if r.committed and r.name not in distrusted), key=lambda r: r.step)
    assert not distrusted & (set(d.keep) | set(d.delete))
    assert {r.name for r in trusted[-keep:]} <= set(d.keep)
    assert set(d.delete) == {r.name for r in trusted[:-keep]}


@pytest.mark.parametrize("k", [2.0, True, "2", 0, -1, None])
def test_best_k_takes_a_positive_integer(k):
    """``BestK(k=2.0)`` passed, then retention failed with a TypeError on rank 0 alone, after the commit,
    the other ranks left waiting in their next collective."""
    with pytest.raises(ckptkit.OptionsError, match="keep_best k"):
        BestK("loss", k)


def test_retention_never_raises_whatever_fails(tmp_path, monkeypatch, caplog):
    """Retention runs on rank 0 alone after a commit: any exception there is logged, never raised (one
    raised would leave the other ranks waiting for rank 0 in their next collective)."""
    import ckptkit.run_folder as run_folder

    def broken(*args, **kwargs):
        raise TypeError("a policy this code has not seen")

    root = str(tmp_path / "run")
    mgr = ckptkit.CheckpointManager(root, keep=RetentionPolicy(keep_last=1), asynchronous=None)
    mgr.save(1, state(1))
    monkeypatch.setattr(run_folder, "decide", broken)
    with caplog.at_level(logging.WARNING, logger="ckptkit"):
        mgr.save(2, state(2))
    assert "retention after step-0000002 failed: TypeError" in caplog.text
    assert fresh_restore(root) == 2
    mgr.close()
