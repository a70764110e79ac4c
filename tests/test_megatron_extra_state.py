"""Transformer Engine's FP8 ``_extra_state`` through ckptkit, against Megatron's own handling of it.

Transformer Engine cannot be installed on these machines (it needs CUDA), so every linear module
of the tiny Megatron GPT (tests/megatron_model.py) is given TE's ``get_extra_state`` /
``set_extra_state`` behaviour with payloads of exactly TE 2.x's serialised shape
(tests/te_payloads.py): a uint8 tensor holding ``pickle.dumps`` of a delayed-scaling recipe, scales
and amax histories. Each module's payload differs (by layer, module, expert and TP rank), so a
module handed the wrong one is seen. The yardstick is Megatron itself: its
``dist_checkpointing`` save of the same modules, loaded by Megatron at the same target layout,
hands each module some payload; ckptkit must hand it the same one, bit for bit.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from tests import megatron_extra_state_job as job
from tests import megatron_model as mm

A = mm.Layout(tp=2, pp=2)  # dp 1 in a world of 4
TARGETS = [A, mm.Layout(tp=1, pp=4), mm.Layout(tp=4, pp=1), mm.Layout(tp=2, pp=1)]

pytestmark = pytest.mark.usefixtures("retire_megatron_world")


@pytest.fixture(scope="module")
def saved(worlds, tmp_path_factory):
    """ckptkit's and Megatron's saves of layout A's modules (each with its own FP8 payload)."""
    folder = str(tmp_path_factory.mktemp("te_ckptkit") / "ckpt")
    mfolder = str(tmp_path_factory.mktemp("te_megatron"))
    sent = worlds.run(4, job.save, A, folder, mfolder)
    return folder, mfolder, sent


@pytest.mark.parametrize("target", TARGETS, ids=lambda lay: f"tp{lay.tp}pp{lay.pp}")
def test_each_module_gets_what_megatron_would_hand_it(worlds, saved, target):
    folder, mfolder, _ = saved
    ours = worlds.run(4, job.received, target, folder, how="ckptkit")
    megatron = worlds.run(4, job.received, target, mfolder, how="megatron")
    for rank, (o, m) in enumerate(zip(ours, megatron)):
        assert o["received"] == m["received"], f"rank {rank}"
        assert set(o["received"]) == set(o["own"]), f"rank {rank}: every module is handed a payload"
        assert not set(o["received"].values()) & set(o["own"].values()), f"rank {rank}: not its own fresh one"


def test_at_the_saving_layout_tp_rank_0s_payload_reaches_the_group(worlds, saved):
    """Megatron's rule, checked directly: the main replica (TP rank 0) writes; every TP rank reads it."""
    folder, _, sent = saved
    got = worlds.run(4, job.received, A, folder, how="ckptkit")
    tp0 = {rank: s["sent"] for rank, s in enumerate(sent) if s["tp"] == 0}
    for rank, (s, g) in enumerate(zip(sent, got)):
        source = rank - s["tp"]  # the TP group's rank 0 (tp is the fastest-varying rank dimension)
        assert g["received"] == tp0[source], f"rank {rank}"
        if s["tp"]:
            assert g["received"] != s["sent"], "TP ranks' own payloads differ here, so the rule is visible"


TP1PP4 = TARGETS[1]


def _megatron_view(worlds, mfolder: str, layout: mm.Layout) -> list[dict]:
    return [r["received"] for r in worlds.run(4, job.received, layout, mfolder, how="megatron")]


def test_megatrons_own_save_imports_with_its_payloads(worlds, saved, tmp_path):
    """A team's torch_dist checkpoint with FP8 state: `ckptkit convert`, then ckptkit's load at the saving layout
    and at another hands every module what Megatron's load of the original hands it."""
    from click.testing import CliRunner

    from ckptkit.cli.main import cli
    from ckptkit.engine.metadata_io import read_manifest
    from ckptkit.storage.url import open_store

    folder, mfolder, _ = saved
    out = str(tmp_path / "imported")
    result = CliRunner().invoke(cli, ["convert", mfolder, out, "--opt", f"vocab_size={mm.VOCAB}",
                                      "--opt", f"make_vocab_size_divisible_by={A.divisible_by}"])
    assert result.exit_code == 0, result.output
    ours = read_manifest(open_store(folder)).tensors
    imported = read_manifest(open_store(out)).tensors
    extras = sorted(k for k in ours if k.startswith("extra/"))
    assert extras and extras == sorted(k for k in imported if k.startswith("extra/"))
    assert all(imported[k].rule == ours[k].rule for k in extras)
    for layout in (A, TP1PP4):
        got = [r["received"] for r in worlds.run(4, job.received, layout, out, how="ckptkit")]
        assert got == _megatron_view(worlds, mfolder, layout), layout


@pytest.mark.parametrize("via", ["export", "reshard"])
def test_a_checkpoint_laid_out_for_tp1pp4_hands_out_the_same_payloads(worlds, saved, tmp_path, via):
    """`ckptkit reshard --to tp1pp4 --format megatron` (Megatron's load of the result) and `ckptkit reshard
    --to tp1pp4` (ckptkit's load of it): every module gets what ckptkit's load of the original gives it."""
    from click.testing import CliRunner

    from ckptkit.cli.main import cli

    folder, _, _ = saved
    out = str(tmp_path / via)
    args = ["reshard", folder, out, "--to", "tp1pp4"] + (["--format", "megatron"] if via == "export" else [])
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    direct = [r["received"] for r in worlds.run(4, job.received, TP1PP4, folder, how="ckptkit")]
    if via == "export":
        assert "extra/" not in result.output, result.output  # no payload listed as left out
    how = "megatron" if via == "export" else "ckptkit"
    assert [r["received"] for r in worlds.run(4, job.received, TP1PP4, out, how=how)] == direct


def _hostile(canary: str) -> bytes:
    """A payload that would run a shell command if anything unpickled it."""
    import os
    import pickle

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {canary}",))

    return pickle.dumps({"recipe": Payload()})


def test_a_code_running_payload_is_refused_before_any_module_gets_one(worlds, tmp_path):
    """A checkpoint one of whose payloads names os.system (saved by a job whose module handed it over): ckptkit's
    load refuses it naming the tensor, before a single module is handed a payload, and nothing runs; the
    torch_dist import of Megatron's own save of it refuses it too, naming the file and item, and writes nothing."""
    from ckptkit.errors import UnsafeCheckpointError
    from ckptkit_converters.megatron.importer import import_torch_dist

    canary = tmp_path / "ran"
    folder, mfolder = str(tmp_path / "ckpt"), str(tmp_path / "torch_dist")
    worlds.run(4, job.save, A, folder, mfolder, hostile=_hostile(str(canary)))
    for got in worlds.run(4, job.load_error, A, folder):
        assert got["error"] is not None and got["error"].startswith("UnsafeCheckpointError"), got["error"]
        assert "extra/decoder.layers." in got["error"] and "names posix.system" in got["error"]
        assert got["received"] == {}
    out = tmp_path / "imported"
    with pytest.raises(UnsafeCheckpointError, match=r"__0_0\.distcp \(item 'decoder\.layers\..*names posix\.system"):
        import_torch_dist(mfolder, str(out), vocab_size=mm.VOCAB, make_vocab_size_divisible_by=A.divisible_by)
    assert not (out / "manifest.json").exists()
    assert not canary.exists()


def test_te1_bytes_io_state_is_refused_at_the_save_and_left_out_by_the_import(worlds, tmp_path):
    """TE 1.x's io.BytesIO form: ckptkit's save refuses it naming the module (it would not carry it); the
    torch_dist import of Megatron's own save of it imports the weights and lists the items as skipped."""
    from ckptkit_converters.megatron.importer import import_torch_dist

    folder, mfolder = str(tmp_path / "ckpt"), str(tmp_path / "torch_dist")
    for got in worlds.run(4, job.save, A, folder, mfolder, bytes_io=True):
        assert got["error"] is not None and got["error"].startswith("StateMismatchError"), got["error"]
        assert "holds a BytesIO as its _extra_state" in got["error"] and "decoder.layers." in got["error"]
    result = import_torch_dist(mfolder, str(tmp_path / "imported"), vocab_size=mm.VOCAB,
                               make_vocab_size_divisible_by=A.divisible_by)
    assert "decoder.layers.self_attention.linear_qkv._extra_state" in result.skipped
    assert not any(k.startswith("extra/") for k in job_tensors(str(tmp_path / "imported")))


def job_tensors(folder: str) -> list[str]:
    from ckptkit.engine.metadata_io import read_manifest
    from ckptkit.storage.url import open_store

    return list(read_manifest(open_store(folder)).tensors)
