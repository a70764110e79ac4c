"""CheckpointManager in one process: policies, retention, restore of the newest valid, gc, leases."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from click.testing import CliRunner

import ckptkit
from ckptkit import offline as catalog
from ckptkit.cli.main import cli
from tests.ckpt_files import data_object


def state_at(step: int) -> dict:
    return {"w": torch.full((64, 8), float(step)), "b": torch.arange(8, dtype=torch.bfloat16) + step, "step": step}


def empty_state() -> dict:
    return {"w": torch.zeros(64, 8), "b": torch.zeros(8, dtype=torch.bfloat16), "step": -1}


def committed(run) -> list[str]:
    return sorted(p.name for p in run.iterdir() if (p / "manifest.json").exists())


def test_every_steps_and_retention(tmp_path):
    with ckptkit.CheckpointManager(str(tmp_path), save=ckptkit.SavePolicy(every_steps=10), keep=ckptkit.RetentionPolicy(keep_last=2, keep_every=50, keep_best=ckptkit.BestK("loss", 1))) as mgr:
        for step in range(1, 101):
            mgr.maybe_save(step, state_at(step), metrics={"loss": abs(step - 33)})
    assert committed(tmp_path) == ["step-0000030", "step-0000050", "step-0000090", "step-0000100"]
    infos = {i.name: i for i in catalog.list_checkpoints(str(tmp_path))}
    assert infos["step-0000030"].keep == ("best",) and infos["step-0000030"].metrics == {"loss": 3}
    assert infos["step-0000050"].keep == ("milestone",)
    assert infos["step-0000100"].keep == ("latest", "last", "milestone")
    out = CliRunner().invoke(cli, ["ls", str(tmp_path), "--json"])
    rows = {r["name"]: r for r in json.loads(out.stdout)["checkpoints"]}
    assert rows["step-0000090"]["keep"] == ["last"] and rows["step-0000090"]["metrics"] == {"loss": 57}


def test_restore_latest_skips_uncommitted_and_corrupt(tmp_path, caplog):
    with ckptkit.CheckpointManager(str(tmp_path), save=ckptkit.SavePolicy(every_steps=1)) as mgr:
        for step in (1, 2, 3):
            mgr.maybe_save(step, state_at(step))
    # newest: a crashed save (no manifest); next: one flipped byte in its data
    (tmp_path / "step-0000003" / "manifest.json").unlink()
    data = data_object(tmp_path / "step-0000002")
    raw = bytearray(data.read_bytes())
    raw[17] ^= 1
    data.write_bytes(bytes(raw))
    target = empty_state()
    with caplog.at_level(logging.WARNING, logger="ckptkit"), ckptkit.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.restore_latest(target) == 1
    assert torch.equal(target["w"], state_at(1)["w"]) and target["step"] == 1
    assert any("skipping step-0000002" in r.message and "checksum mismatch" in r.message for r in caplog.records)


def test_restore_latest_on_an_empty_run_returns_none(tmp_path):
    with ckptkit.CheckpointManager(str(tmp_path / "fresh")) as mgr:
        assert mgr.restore_latest(empty_state()) is None


def test_restore_latest_raises_when_the_state_does_not_match(tmp_path):
    with ckptkit.CheckpointManager(str(tmp_path), save=ckptkit.SavePolicy(every_steps=1)) as mgr:
        mgr.maybe_save(1, state_at(1))
        mgr.maybe_save(2, state_at(2))
        wrong = empty_state()
        wrong["w"] = torch.zeros(64, 9)
        with pytest.raises(ckptkit.ShapeMismatchError):  # a user error is not "try an older checkpoint"
            mgr.restore_latest(wrong)


def test_gc_removes_uncommitted_leftovers_only(tmp_path):
    with ckptkit.CheckpointManager(str(tmp_path), save=ckptkit.SavePolicy(every_steps=1)) as mgr:
        mgr.maybe_save(1, state_at(1))
        mgr.maybe_save(2, state_at(2))
        mgr.wait()
        shutil.copytree(tmp_path / "step-0000002", tmp_path / "step-0000003")
        (tmp_path / "step-0000003" / "manifest.json").unlink()
        (tmp_path / "step-0000004").mkdir()
        (tmp_path / "step-0000004" / "notes.txt").write_text("not ours")
        assert mgr.gc() == ["step-0000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000001", "step-0000002", "step-0000004"]


def test_a_checkpoint_being_read_is_not_deleted(tmp_path):
    with ckptkit.CheckpointManager(str(tmp_path), save=ckptkit.SavePolicy(every_steps=1), keep=ckptkit.RetentionPolicy(keep_last=1)) as mgr:
        mgr.maybe_save(1, state_at(1))
        mgr.wait()
        lease = mgr.folder.acquire_lease("step-0000001", 0)  # a restore on some rank is reading step 1
        mgr.maybe_save(2, state_at(2))
        mgr.wait()
        assert committed(tmp_path) == ["step-0000001", "step-0000002"]
        mgr.folder.release_lease(lease)
        mgr.maybe_save(3, state_at(3))
        mgr.wait()
    assert committed(tmp_path) == ["step-0000003"]


def test_requested_and_timed_saves(tmp_path):
    with ckptkit.CheckpointManager(str(tmp_path), save=ckptkit.SavePolicy(every_steps=100)) as mgr:
        assert mgr.maybe_save(1, state_at(1)) is None
        mgr.request_save()  # e.g. from a SIGTERM handler
        assert mgr.maybe_save(2, state_at(2)) is not None
        assert mgr.maybe_save(3, state_at(3)) is None
    with ckptkit.CheckpointManager(str(tmp_path / "timed"), save=ckptkit.SavePolicy(every_seconds=0.0)) as mgr:
        assert mgr.maybe_save(1, state_at(1)) is not None


def test_synchronous_manager(tmp_path):
    """Without the background saver, a save is done when maybe_save returns: committed, loadable
    and retention applied, on the caller's thread."""
    with ckptkit.CheckpointManager(str(tmp_path), save=ckptkit.SavePolicy(every_steps=2), keep=ckptkit.RetentionPolicy(keep_last=1), asynchronous=None) as mgr:
        for step in range(1, 7):
            h = mgr.maybe_save(step, state_at(step))
            if step % 2:
                assert h is None and committed(tmp_path) == ([f"step-{step - 1:07d}"] if step > 1 else [])
                continue
            assert h is not None and h.step == step and h.staged.done() and h.done()
            assert h.wait(timeout=0).total_bytes > 0
            assert committed(tmp_path) == [f"step-{step:07d}"]  # the previous one already deleted
            target = empty_state()
            ckptkit.load(target, tmp_path / f"step-{step:07d}")
            assert torch.equal(target["w"], state_at(step)["w"]) and target["step"] == step
    assert committed(tmp_path) == ["step-0000006"]


def _damage_data(folder) -> None:
    from tests.damage import flip_byte

    flip_byte(str(data_object(folder)), where=0.0)  # a piece starts at offset 0


def _damage_manifest(folder) -> None:
    (folder / "manifest.json").write_text("{ not json")


@pytest.mark.parametrize("asynchronous", [None, ckptkit.AsyncOptions()], ids=["sync", "async"])
@pytest.mark.parametrize("damage", [_damage_data, _damage_manifest], ids=["data", "manifest"])
@pytest.mark.parametrize("width", [7, 0], ids=["step-0000003", "step-3"])
def test_a_step_found_damaged_at_restore_is_saved_again(tmp_path, asynchronous, damage, width):
    """The newest step fails its checks; the restart resumes the one before and trains on through the
    damaged step's number. Its save used to be refused ("already holds a committed checkpoint"), the job
    died there after every restart, until a human moved the damaged folder aside. Now the damaged
    folder (of either naming) is replaced when its step is saved again, and not before."""
    run = tmp_path / "run"
    naming = ckptkit.StepNaming(width=width)
    mgr = ckptkit.CheckpointManager(str(run), asynchronous=asynchronous, naming=naming)
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.full((64,), float(step))})
    mgr.close()
    damage(run / naming.name(3))
    mgr = ckptkit.CheckpointManager(str(run), asynchronous=asynchronous)  # today's naming, whatever it was
    state = {"w": torch.zeros(64)}
    assert mgr.restore_latest(state) == 2 and state["w"][0] == 2
    assert (run / naming.name(3) / "manifest.json").exists()  # kept for a human until its step is saved again
    mgr.save(3, {"w": torch.full((64,), 30.0)})
    mgr.close()
    assert not (run / naming.name(3)).exists() or naming.name(3) == mgr.folder.naming.name(3)
    again = ckptkit.CheckpointManager(str(run))
    state = {"w": torch.zeros(64)}
    assert again.restore_latest(state) == 3 and state["w"][0] == 30.0 and again.skipped == []


def test_a_good_newer_step_is_never_replaced(tmp_path):
    """Only damaged steps are replaced: a rewind on purpose (at_most=) that saves again is refused as before."""
    run = tmp_path / "run"
    mgr = ckptkit.CheckpointManager(str(run), asynchronous=None)
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.full((4,), float(step))})
    state = {"w": torch.zeros(4)}
    assert mgr.restore_latest(state, at_most=2) == 2
    with pytest.raises(ckptkit.SaveError, match="already holds a committed checkpoint"):
        mgr.save(3, {"w": torch.zeros(4)})
    assert ckptkit.CheckpointManager(str(run)).restore_latest(state) == 3 and state["w"][0] == 3


@pytest.mark.parametrize("asynchronous", [None, ckptkit.AsyncOptions()], ids=["sync", "async"])
def test_a_final_save_of_the_step_just_saved_returns_that_save(tmp_path, asynchronous):
    """``save(N)`` after ``maybe_save(N)`` saved N (the common final save): that save is returned, and
    ``close`` succeeds (it raised "already holds a committed checkpoint" after the training had ended).
    After a restore, or a rollback's discard, the same step number is saved again for real."""
    run = str(tmp_path / "run")
    mgr = ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=5), asynchronous=asynchronous)
    first = mgr.maybe_save(5, {"w": torch.full((4,), 5.0)})
    assert mgr.save(5, {"w": torch.full((4,), 5.0)}) is first
    mgr.maybe_save(6, {"w": torch.full((4,), 6.0)})
    mgr.save(10, {"w": torch.full((4,), 10.0)})
    mgr.discard_after(5)  # a rollback to step 5: step 10 is abandoned, and saved again below
    state = {"w": torch.zeros(4)}
    assert mgr.restore_latest(state) == 5
    again = mgr.save(10, {"w": torch.full((4,), 100.0)})
    mgr.close()
    assert again is not None and again.wait().path.endswith("step-0000010")
    assert ckptkit.CheckpointManager(run).restore_latest(state) == 10 and state["w"][0] == 100.0


def test_enable_save_requests_still_works_and_says_it_is_not_needed(tmp_path):
    mgr = ckptkit.CheckpointManager(str(tmp_path / "run"), asynchronous=None)
    with pytest.warns(DeprecationWarning, match="SavePolicy\\(agree_requests=True\\)"):
        mgr.enable_save_requests()
    mgr.request_save()
    assert mgr.maybe_save(1, {"w": torch.ones(2)}) is not None  # a request, honoured
    mgr.close()
