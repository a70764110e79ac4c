"""Steps and the names made of them: a save commits only a step a restore will return, and a name is
read as the number it was written from, nothing else.

The class of defect, each reproduced before its fix:
* ``CheckpointManager.save`` committed steps a restore never looks at (negative ones, past 2**62), so
  a resume went back to an older step, or started from scratch, without a word; it took ``True`` for
  step 1 and failed on floats, strings and numpy integers with Python's words.
* A folder named with non-ASCII digits (``step-١٢``: Python's ``\\d`` and ``int`` take them) was
  restored as step 12; a checkpoint copied under a newer step's name was restored as that step,
  with the state of the step it was saved at.
* Names with a fixed width stopped at it: a rank from 100,000 up wrote ``data/rank-100000-...``,
  which the save's own cleanup took for a foreign file (a failed save's folder then refused every
  retry), and a memory-tier node folder lost ranks past 99,999 and steps past 10**10.
* ``isdigit`` is true of ``'²'``, which ``int`` refuses: foreign names with such characters crashed
  the importers instead of being refused.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.engine.checkpoint_dir import attempt_of, foreign_keys
from ckptkit.memory import node_folder
from ckptkit.plan.save_plan import data_object_key as data_key, index_object_key as index_key
from ckptkit.storage import open_store
from tests.conftest import trials

STEPS = st.one_of(
    st.integers(-5, 10**6), st.integers(2**62 - 3, 2**62 + 3), st.integers(-2**70, 2**70), st.booleans(),
    st.floats(allow_nan=True), st.text(max_size=3), st.none(),
    st.integers(0, 10**9).map(lambda n: __import__("numpy").int64(n)),
)


@settings(max_examples=trials(30, 300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(step=STEPS, asynchronous=st.booleans())
def test_a_save_commits_only_a_step_the_restore_returns(tmp_path_factory, step, asynchronous):
    assume(step != 3 or isinstance(step, (bool, float)))  # a second save of step 3 is refused as such
    root = tmp_path_factory.mktemp("steps")
    mgr = ckptkit.CheckpointManager(root, save=ckptkit.SavePolicy(every_steps=1),
                                    asynchronous=ckptkit.AsyncOptions() if asynchronous else None)
    try:
        mgr.save(3, {"w": torch.full((1,), 3.0)})
        mgr.wait()
        before = sorted(os.listdir(root))
        try:
            mgr.save(step, {"w": torch.full((1,), 7.0)})
            mgr.wait()
        except ckptkit.OptionsError as exc:
            assert repr(step) in str(exc), exc
            assert sorted(os.listdir(root)) == before  # nothing written
            return
        state = {"w": torch.zeros(1)}
        got = mgr.restore_latest(state)
        expected = max(3, int(step))
        assert got == expected and type(got) is int
        assert state["w"].item() == (7.0 if int(step) >= 3 else 3.0)
    finally:
        mgr.close()


def test_folder_names_are_read_as_written(tmp_path):
    mgr = ckptkit.CheckpointManager(tmp_path, save=ckptkit.SavePolicy(every_steps=1), asynchronous=None)
    try:
        mgr.save(5, {"w": torch.full((1,), 5.0)})
        mgr.save(8, {"w": torch.full((1,), 8.0)})
        src = tmp_path / "step-0000005"
        shutil.copytree(src, tmp_path / "step-\u0661\u0662")  # Arabic-Indic "12": not a step name
        shutil.copytree(src, tmp_path / "step-\uff19\uff19")  # fullwidth "99"
        shutil.copytree(src, tmp_path / "step-0000012")  # step 5's checkpoint under a newer name
        state = {"w": torch.zeros(1)}
        assert mgr.restore_latest(state) == 8 and state["w"].item() == 8.0
        damaged = {r.name: r.reason for r in mgr.records() if r.status == "damaged"}
        assert list(damaged) == ["step-0000012"] and "its manifest records step 5, not 12" in damaged["step-0000012"]
        assert {r.step for r in mgr.records()} == {5, 8, 12}
    finally:
        mgr.close()


@pytest.mark.parametrize("rank", [0, 99_999, 100_000, 123_456, 2**20 - 1])
def test_names_past_their_width_are_still_ckptkits_own(tmp_path, rank):
    """A rank of a world of up to 2**20 ranks, a memory-tier step up to 2**62: each name made for them
    is read back as that number, and no other spelling of the number is."""
    for key in (data_key(rank, "0123456789ab"), index_key(rank, "0123456789ab")):
        assert attempt_of(key) == "0123456789ab", key
    store = open_store(str(tmp_path / "c"))
    store.put_bytes(data_key(rank, "0123456789ab"), b"x")
    assert foreign_keys(store) == []
    store.put_bytes(f"data/rank-0{rank:05d}-0123456789ab.bin", b"x")  # not a name ckptkit writes
    assert foreign_keys(store) == [f"data/rank-0{rank:05d}-0123456789ab.bin"]
    name = node_folder.rank_name(rank)
    assert int(node_folder.RANK_RE.match(name).group(1)) == rank
    assert node_folder.RANK_RE.match("rank-0" + name[5:]) is None
    assert node_folder.RANK_RE.match("rank-\u0661\u0662\u0663\u0664\u0665") is None
    for step in (0, 10**10 - 1, 10**10, 2**62):
        m = node_folder.STEP_RE.match(node_folder.step_name(step))
        assert m is not None and int(m.group(1)) == step


def test_memory_tier_ranks_past_99999_are_found(tmp_path):
    folder = node_folder.NodeFolder(str(tmp_path))
    for rank in (7, 100_000):
        ckptkit.save({"w": torch.full((1,), float(rank))}, folder.rank_store(10**10, rank).url)
    assert folder.steps() == [10**10]
    assert folder.ranks_at(10**10) == [7, 100_000]


def test_digits_other_than_ascii_are_refused_not_crashed_on():
    from ckptkit_converters.hf.importer import _layer_of

    assert _layer_of("layers.3.mlp") == 3
    assert _layer_of("layers.\u00b2.mlp") is None  # '²'.isdigit() is True and int('²') raises
    assert _layer_of("layers.\u0663.mlp") is None
    with pytest.raises(ckptkit.LayoutError, match="invalid parallel config"):
        ckptkit.ParallelConfig.parse("tp\u0664")


def test_ls_shows_a_renamed_copy_as_the_restore_sees_it(tmp_path):
    from ckptkit.offline.listing import list_checkpoints

    mgr = ckptkit.CheckpointManager(tmp_path, save=ckptkit.SavePolicy(every_steps=1), asynchronous=None)
    mgr.save(5, {"w": torch.ones(1)})
    mgr.close()
    shutil.copytree(tmp_path / "step-0000005", tmp_path / "step-0000012")
    infos = {i.name: i for i in list_checkpoints(tmp_path)}
    assert infos["step-0000005"].committed
    assert not infos["step-0000012"].committed and "manifest records step 5, not 12" in infos["step-0000012"].reason


def test_step_bounds_are_integers(tmp_path):
    """``at_most=True`` restored nothing newer than step 1, without a word; a string failed with Python's words."""
    mgr = ckptkit.CheckpointManager(tmp_path, save=ckptkit.SavePolicy(every_steps=1), asynchronous=None)
    try:
        mgr.save(5, {"w": torch.ones(1)})
        for bad in (True, "5", 5.5, [5]):
            with pytest.raises(ckptkit.OptionsError, match="is not a step"):
                mgr.restore_latest({"w": torch.zeros(1)}, at_most=bad)
            with pytest.raises(ckptkit.OptionsError, match="is not a step"):
                mgr.latest_common_step(at_most=bad)
            with pytest.raises(ckptkit.OptionsError, match="is not a step"):
                mgr.discard_after(bad)
        assert [r.step for r in mgr.records()] == [5]  # nothing discarded
        numpy = pytest.importorskip("numpy")
        assert mgr.restore_latest({"w": torch.zeros(1)}, at_most=numpy.int64(5)) == 5
        assert mgr.restore_latest({"w": torch.zeros(1)}, at_most=-1) is None
    finally:
        mgr.close()


def test_metrics_come_back_as_numbers(tmp_path):
    """A loss passed as a tensor or a numpy scalar failed the save ("cannot store a value of type
    Tensor" about 'metadata'); a NaN metric came back from records() as its JSON tag."""
    numpy = pytest.importorskip("numpy")
    mgr = ckptkit.CheckpointManager(tmp_path, save=ckptkit.SavePolicy(every_steps=1), asynchronous=None)
    try:
        given = [{"loss": torch.tensor(1.5)}, {"loss": numpy.float32(2.5)}, {"loss": float("nan"), "tag": "x"},
                 {"loss": numpy.int64(3), "hist": [1, 2]}]
        for step, metrics in enumerate(given):
            mgr.save(step, {"w": torch.ones(1)}, metrics=metrics)
        got = [r.metrics for r in mgr.records()]
        assert got[0] == {"loss": 1.5} and got[1] == {"loss": 2.5} and got[3] == {"loss": 3, "hist": [1, 2]}
        assert got[2]["tag"] == "x" and got[2]["loss"] != got[2]["loss"]  # NaN, a float again
        with pytest.raises(ckptkit.OptionsError, match="metric 'loss' is a tensor of shape \\[2\\]"):
            mgr.save(9, {"w": torch.ones(1)}, metrics={"loss": torch.ones(2)})
    finally:
        mgr.close()
