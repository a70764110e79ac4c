"""``restore_latest`` never reports an untouched state it has written into.

A damaged step can fail *after* part of it was loaded into the caller's tensors (a checksum
mismatch is found as the bytes are read). The manager then falls back to an older step. Before
2026-12-05, when no older step loaded it returned None, which a training script reads as "nothing
to restore, start from scratch", with tensors that held part of the damaged step; with
``strict=False``, tensors the older step lacks kept the damaged step's bytes. The invariant tested
here, over random damage to random checkpoints (single process and 2 gloo ranks):

* None  => the state is exactly as passed in;
* step s => every tensor the checkpoint of ``s`` holds equals it, and every other one is as passed in;
* otherwise a :class:`~ckptkit.CkptkitError` (for a state left partly overwritten, one that says so).
"""

from __future__ import annotations

import glob
import os
import random
import tempfile

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit
from tests.damage import flip_byte

DAMAGE = ("flip_data", "flip_data_late", "truncate_data", "flip_index", "flip_manifest", "delete_data", "none")


def _state(seed: int, keys=("a", "b", "c"), n: int = 20000) -> dict:
    g = torch.Generator().manual_seed(seed)
    dtypes = {"a": torch.float32, "b": torch.float64, "c": torch.bfloat16}
    sizes = {"a": n, "b": n + 97, "c": n + 194}
    return {k: torch.randn(sizes[k], generator=g).to(dtypes[k]) for k in keys}


def _clone(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


def _files(step_dir: str, part: str) -> list[str]:
    return sorted(p for p in glob.glob(os.path.join(step_dir, "**", "*"), recursive=True)
                  if os.path.isfile(p) and (part in os.path.relpath(p, step_dir).split(os.sep)[0] or
                                            os.path.basename(p) == part))


def damage(step_dir: str, kind: str, rng: random.Random) -> None:
    """Damage one committed step folder the way ``kind`` says (a real file changed on disk)."""
    data = _files(step_dir, "data")
    if kind == "flip_data":
        flip_byte(rng.choice(data), rng.random())
    elif kind == "flip_data_late":  # the last bytes: the load has written the earlier tensors by then
        flip_byte(rng.choice(data), 0.999)
    elif kind == "truncate_data":
        path = rng.choice(data)
        os.truncate(path, rng.randrange(os.path.getsize(path)))
    elif kind == "flip_index":
        flip_byte(rng.choice(_files(step_dir, "index")), rng.random())
    elif kind == "flip_manifest":
        flip_byte(os.path.join(step_dir, "manifest.json"), rng.random())
    elif kind == "delete_data":
        os.unlink(rng.choice(data))


def restore_into(root: str, initial: dict, strict: bool) -> tuple:
    """``restore_latest`` into a copy of ``initial``: (step or None, the exception or None, the copy)."""
    dest = _clone(initial)
    got, raised = None, None
    with ckptkit.CheckpointManager(root) as mgr:
        try:
            got = mgr.restore_latest(dest, strict=strict)
        except Exception as exc:  # noqa: BLE001 - the invariant says which are allowed
            raised = exc
    return got, raised, dest


def check_invariant(got, raised, dest: dict, initial: dict, saved: dict[int, dict]) -> None:
    if raised is not None:  # (from another process: its text, its class checked there)
        assert isinstance(raised, (str, ckptkit.CkptkitError)), raised
        return
    if got is None:
        for k in dest:
            assert torch.equal(dest[k], initial[k]), f"{k}: restore_latest returned None but changed the state"
        return
    for k in dest:
        want = saved[got][k] if k in saved[got] else initial[k]
        assert torch.equal(dest[k], want), f"{k}: restored step {got} but the tensor is not its bytes (nor the initial ones)"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(DAMAGE), older=st.sampled_from(("none", "full", "partial")), strict=st.booleans(),
       seed=st.integers(0, 2**16))
def test_a_restore_never_hands_back_a_touched_state_as_untouched(kind, older, strict, seed):
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as root:
        saved: dict[int, dict] = {}
        with ckptkit.CheckpointManager(root, save=ckptkit.SavePolicy(every_steps=1)) as mgr:
            if older != "none":  # step 1: every tensor, or one of them missing (strict=False loads it)
                saved[1] = _state(seed + 1, keys=("a", "b", "c") if older == "full" else ("a", "c"))
                mgr.save(1, saved[1])
                mgr.wait()
            saved[2] = _state(seed + 2)
            mgr.save(2, saved[2])
            mgr.wait()
        damage(os.path.join(root, "step-0000002"), kind, rng)
        initial = _state(seed + 3)
        got, raised, dest = restore_into(root, initial, strict)
        check_invariant(got, raised, dest, initial, saved)
        if kind == "none":
            assert raised is None and got == 2
        if kind == "flip_data_late" and older == "none":  # the one step failed mid-load: said, never None
            assert raised is not None and "partly overwritten" in str(raised), (got, raised)


def _one_damaged_step(root: str, kind: str) -> None:
    with ckptkit.CheckpointManager(root, save=ckptkit.SavePolicy(every_steps=1)) as mgr:
        mgr.save(1, _state(1))
        mgr.wait()
    damage(os.path.join(root, "step-0000001"), kind, random.Random(0))


def test_the_only_step_damaged_mid_load_raises_and_says_so(tmp_path):
    _one_damaged_step(str(tmp_path), "flip_data_late")
    dest = _state(9)
    with ckptkit.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(ckptkit.CorruptCheckpointError) as err:
            mgr.restore_latest(dest)
    said = str(err.value)
    assert "partly overwritten" in said and "step-0000001" in said and "checksum mismatch" in said


def test_damage_found_before_any_byte_is_read_still_means_nothing_restored(tmp_path):
    """An index that fails its digest is found before reading: the state is untouched, so None."""
    _one_damaged_step(str(tmp_path), "flip_index")
    initial = _state(9)
    dest = _clone(initial)
    with ckptkit.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.restore_latest(dest) is None
        assert mgr.skipped and mgr.skipped[0][0] == "step-0000001"
    assert all(torch.equal(dest[k], initial[k]) for k in dest)


def test_strict_false_over_a_touched_state_raises_for_what_the_older_step_lacks(tmp_path):
    with ckptkit.CheckpointManager(str(tmp_path), save=ckptkit.SavePolicy(every_steps=1)) as mgr:
        mgr.save(1, _state(1, keys=("a", "c")))
        mgr.save(2, _state(2))
        mgr.wait()
    damage(str(tmp_path / "step-0000002"), "flip_data_late", random.Random(0))
    with ckptkit.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(ckptkit.CorruptCheckpointError, match="lacks some of the state's tensors"):
            mgr.restore_latest(_state(9), strict=False)
        assert mgr.restore_latest(_state(9, keys=("a", "c")), strict=False) == 1  # nothing left over: fine


# ----------------------------------------------------------------------------- 2 gloo ranks


def _rank_state(seed: int) -> dict:
    """This rank's own tensors (plain tensors under one key on every rank would be one replicated tensor)."""
    return {f"{k}@{dist.get_rank()}": v for k, v in _state(seed).items()}


def save_and_damage(root: str, older: bool, damaged_rank: int | None, seed: int) -> dict:
    rank = dist.get_rank()
    saved = {}
    with ckptkit.CheckpointManager(root, save=ckptkit.SavePolicy(every_steps=1)) as mgr:
        if older:
            saved[1] = _rank_state(100 * rank + seed + 1)
            mgr.save(1, saved[1])
        saved[2] = _rank_state(100 * rank + seed + 2)
        mgr.save(2, saved[2])
        mgr.wait()
    dist.barrier()
    if damaged_rank is not None and rank == 0:  # that rank's data object, near its end
        for path in glob.glob(os.path.join(root, "step-0000002", "data", f"rank-{damaged_rank:05d}-*")):
            flip_byte(path, 0.999)
    dist.barrier()
    return saved


def restore_everywhere(root: str, seed: int, strict: bool) -> dict:
    initial = _rank_state(100 * dist.get_rank() + seed + 3)
    got, raised, dest = restore_into(root, initial, strict)
    return {"got": got, "raised": None if raised is None else f"{type(raised).__name__}: {raised}",
            "is_ckptkit": raised is None or isinstance(raised, ckptkit.CkptkitError), "dest": dest, "initial": initial}


@pytest.mark.parametrize("older,damaged_rank", [(False, 1), (False, 0), (True, 1), (False, None)])
def test_two_ranks_agree_and_never_report_a_touched_state_as_untouched(worlds, tmp_path, older, damaged_rank):
    root = str(tmp_path / "run")
    saved = worlds.run(2, save_and_damage, root, older, damaged_rank, 7)
    res = worlds.run(2, restore_everywhere, root, 7, True)
    assert len({(r["got"], r["raised"] is None) for r in res}) == 1, [(r["got"], r["raised"]) for r in res]  # agreed
    for rank, r in enumerate(res):
        assert r["is_ckptkit"], r["raised"]
        check_invariant(r["got"], r["raised"], r["dest"], r["initial"], saved[rank])
    if damaged_rank is None:
        assert [r["got"] for r in res] == [2, 2]
    elif older:
        assert [r["got"] for r in res] == [1, 1]
    else:  # the undamaged rank's state was loaded in full: it must not be told "nothing restored" either
        assert all("partly overwritten" in r["raised"] for r in res), [r["raised"] for r in res]
