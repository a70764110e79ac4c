"""What the DeepSpeed and Megatron adapters hand back must be what was saved, or a clear refusal.

Three classes of defect, each once silent or fatal:

* **Per-rank user data.** ``client_state`` / ``extra`` commonly differ between ranks (each rank's
  data-loader position). They used to sit inside the adapter's one JSON record, so a difference split
  the record per rank and the checkpoint, committed, could never be loaded ("not a checkpoint of the
  adapter"). Now the record is the same on every rank by construction and the user's value is stored
  apart: here random per-rank values (different, equal, nested) come back to each rank at the saving
  world size; at another world size a differing value is refused naming its key, or with
  ``per_rank_on_resize="skip"`` gives ``{}`` and a warning naming it. Checkpoints in the old layout
  (the value inside the record) still load, and a record that really differed is named as such.
* **A changed model.** The adapters load with ``ckptkit.load(strict=False)``, and used to drop stored
  tensors the model lacks (with their Adam moments) without a word: every kind (a parameter, a buffer,
  a frozen parameter, a bias) must be refused unless ``strict=False``.
* **Rollback to a step-0 checkpoint.** Priming only *added* missing optimizer states, so a rollback to
  a checkpoint saved before the first step kept the later moments and step count: replaying the steps
  after such a load must give the original weights bit for bit (ZeRO-1/2/3; Megatron with and without
  the distributed optimizer).
"""

from __future__ import annotations

import json
import logging
import random

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("megatron.core")

import torch

import ckptkit
from ckptkit.errors import StateMismatchError
from tests.test_deepspeed import assert_same_state

pytestmark = pytest.mark.usefixtures("retire_megatron_world")

CLIENT_KEY = "deepspeed_engine/client_state"
EXTRA_KEY = "megatron/user_extra"


def _per_rank_values(seed: int) -> dict[str, list[dict]]:
    """Two ranks' user values for each case: random scalars that differ, equal ones, nested ones that differ."""
    rnd = random.Random(seed)
    same = {"epoch": rnd.randrange(100), "tokens": rnd.random()}
    return {
        "differ": [{"data_pos": rnd.randrange(10**6), "seed": r} for r in range(2)],
        "equal": [dict(same), dict(same)],
        "nested": [{"loader": {"pos": [rnd.randrange(99), r], "name": f"shard{r}"}, "ok": True} for r in range(2)],
    }


class _Records(logging.Handler):
    """The ckptkit log records of a rank (the warning a skipped per-rank value gives)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _load_reporting(load) -> object:
    """``load()``'s result and the ckptkit warnings it logged, or its error as text."""
    handler = _Records()
    logging.getLogger("ckptkit").addHandler(handler)
    try:
        return load(), handler.messages
    except Exception as exc:  # noqa: BLE001 - the test reads the refusal
        return f"{type(exc).__name__}: {exc}"
    finally:
        logging.getLogger("ckptkit").removeHandler(handler)


# ---------------------------------------------------------------- rank functions: DeepSpeed
def ds_user_values(folder: str, seed: int) -> dict:
    """Save each case's per-rank client state, load it back at the same world; then an old-layout save."""
    from ckptkit.adapters import deepspeed as ds_ckpt
    from tests import deepspeed_job as job

    rank = torch.distributed.get_rank()
    engine = job.build(2, "fp32")
    job.train_step(engine, 1)
    out = {}
    for case, values in _per_rank_values(seed).items():
        ds_ckpt.save(engine, f"{folder}/{case}", client_state=values[rank])
        out[case] = ds_ckpt.load(engine, f"{folder}/{case}")
    state = ds_ckpt.engine_state(engine, {"epoch": 3, "pos": [1, 2]})  # the layout before the split
    inner = state["deepspeed_engine"]
    record = json.loads(inner["deepspeed"])
    record["client_state"] = json.loads(inner.pop("client_state"))
    inner["deepspeed"] = json.dumps(record)
    ckptkit.save(state, f"{folder}/old")
    out["old"] = ds_ckpt.load(engine, f"{folder}/old")
    return out


def ds_resized(folder: str, case: str, mode: str) -> object:
    """Load a case's checkpoint (saved by two ranks) at a world of one."""
    from ckptkit.adapters import deepspeed as ds_ckpt
    from ckptkit.options import LoadOptions
    from tests import deepspeed_job as job

    engine = job.build(2, "fp32")
    return _load_reporting(lambda: ds_ckpt.load(engine, f"{folder}/{case}", options=LoadOptions(per_rank_on_resize=mode)))


class _Wider(torch.nn.Module):
    """The test MLP with one more tensor of the kind named, or (``nobias``) without fc2's bias."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        from tests import deepspeed_job as job

        base = job.MLP()
        self.fc1, self.out = base.fc1, base.out
        self.fc2 = torch.nn.Linear(job.HIDDEN, job.HIDDEN, bias=kind != "nobias")
        self.register_buffer("scale", base.scale)
        if kind == "param":
            self.fc3 = torch.nn.Linear(job.HIDDEN, job.HIDDEN)
        if kind == "buffer":
            self.register_buffer("extra_buf", torch.ones(3))
        if kind == "frozen":
            self.gate = torch.nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc2(torch.nn.functional.gelu(self.fc1(x))))
        return self.out(self.fc3(h) if hasattr(self, "fc3") else h) * self.scale


def ds_changed_model(folder: str, stage: int) -> dict:
    """For each kind of extra stored tensor: the strict load's error, whether strict=False loads, and whether
    a weights-only load of a checkpoint of the same model passes (its optimizer tensors are not extra)."""
    from ckptkit.adapters import deepspeed as ds_ckpt
    from tests import deepspeed_job as job

    out = {}
    for saved, loading in (("param", "mlp"), ("buffer", "mlp"), ("frozen", "mlp"), ("mlp", "nobias")):
        for name in (saved, loading):
            job.MODELS.setdefault(name, lambda kind=name: _Wider(kind))
        engine = job.build(stage, "fp32", model=saved)
        job.train_step(engine, 1)
        ds_ckpt.save(engine, f"{folder}/{saved}-{stage}")
        engine = job.build(stage, "fp32", model=loading)
        got = _load_reporting(lambda: ds_ckpt.load(engine, f"{folder}/{saved}-{stage}"))
        lenient = _load_reporting(lambda: ds_ckpt.load(engine, f"{folder}/{saved}-{stage}", strict=False))
        out[f"{saved}->{loading}"] = (got, isinstance(lenient, tuple) and lenient[0] == {})
    engine = job.build(stage, "fp32")
    out["weights_only"] = _load_reporting(lambda: ds_ckpt.load(engine, f"{folder}/mlp-{stage}",
                                                               load_optimizer_states=False))
    return out


def ds_rollback(folder: str, stage: int) -> bool:
    """Save before the first step, train 3 steps, roll back to it and replay 2, saving the original run's
    state after 2 steps and the replay's (compared in model space: ZeRO's partition padding is not state).
    Whether the load left the optimizer with the checkpoint's state kinds only (none, before a step)."""
    from ckptkit.adapters import deepspeed as ds_ckpt
    from ckptkit.adapters.deepspeed_layout import engine_layout
    from tests import deepspeed_job as job

    engine = job.build(stage, "fp32")
    ds_ckpt.save(engine, f"{folder}/z{stage}")
    for step in (1, 2):
        job.train_step(engine, step)
    ds_ckpt.save(engine, f"{folder}/want-z{stage}")
    job.train_step(engine, 3)
    ds_ckpt.load(engine, f"{folder}/z{stage}")
    emptied = all(not engine.optimizer.optimizer.state.get(g.fp32) for g in engine_layout(engine).groups)
    for step in (1, 2):
        job.train_step(engine, step)
    ds_ckpt.save(engine, f"{folder}/got-z{stage}")
    return emptied


# ---------------------------------------------------------------- rank functions: Megatron
def _megatron(**layout) -> tuple:
    from ckptkit.adapters import megatron as mckpt
    from tests import megatron_model as mm

    opts = mckpt.MegatronOptions(vocab_size=mm.VOCAB, make_vocab_size_divisible_by=16)
    return mckpt, mm, mm.setup(mm.Layout(**layout)), opts


def mg_user_values(folder: str, seed: int) -> dict:
    """Save each case's per-rank ``extra`` (distributed optimizer, dp 2), load it back; then an old-layout save."""
    mckpt, mm, t, opts = _megatron()
    rank = torch.distributed.get_rank()
    try:
        mm.train_step(t)
        out = {}
        for case, values in _per_rank_values(seed).items():
            mckpt.save(t.model, f"{folder}/{case}", optimizer=t.optimizer, scheduler=t.scheduler, iteration=1,
                       extra=values[rank], options=opts)
            out[case] = mckpt.load(t.model, f"{folder}/{case}", optimizer=t.optimizer, scheduler=t.scheduler).extra
        state = mckpt.megatron_state(t.model, optimizer=t.optimizer, scheduler=t.scheduler, iteration=1,
                                     extra={"consumed_samples": 8}, options=opts)
        inner = state["megatron"]  # the layout before the split: extra inside the record
        meta = json.loads(inner["meta"])
        meta["extra"] = json.loads(inner.pop("user_extra"))
        inner["meta"] = json.dumps(meta)
        ckptkit.save(state, f"{folder}/old")
        out["old"] = mckpt.load(t.model, f"{folder}/old", optimizer=t.optimizer, scheduler=t.scheduler).extra
        return out
    finally:
        mm.teardown()


def mg_resized(folder: str, case: str, mode: str) -> object:
    """Load a case's checkpoint (saved by two ranks) at a world of one."""
    from ckptkit.options import LoadOptions

    mckpt, mm, t, _ = _megatron()
    try:
        return _load_reporting(lambda: mckpt.load(t.model, f"{folder}/{case}", optimizer=t.optimizer,
                                                  options=LoadOptions(per_rank_on_resize=mode)).extra)
    finally:
        mm.teardown()


def mg_changed_model(folder: str) -> dict:
    """A checkpoint with linear biases into the model without them: strict, strict=False, weights only."""
    mckpt, mm, t, opts = _megatron(bias=True)
    try:
        mm.train_step(t)
        mckpt.save(t.model, folder, optimizer=t.optimizer, scheduler=t.scheduler, iteration=1, options=opts)
    finally:
        mm.teardown()
    mckpt, mm, t, opts = _megatron()
    try:
        return {"strict": _load_reporting(lambda: mckpt.load(t.model, folder, optimizer=t.optimizer)),
                "weights_only": _load_reporting(lambda: mckpt.load(t.model, folder, load_optimizer=False)),
                "lenient": _load_reporting(lambda: mckpt.load(t.model, folder, optimizer=t.optimizer,
                                                              strict=False).iteration)}
    finally:
        mm.teardown()


def mg_rollback(folder: str, dist_opt: bool) -> bool:
    """Save at iteration 0, train 3 steps, roll back and replay 2 (the first has LR 0 in warmup, so the
    second is the one that uses the first's moments): the weights must equal the original run's."""
    mckpt, mm, t, opts = _megatron(dist_opt=dist_opt)
    try:
        mckpt.save(t.model, folder, optimizer=t.optimizer, scheduler=t.scheduler, iteration=0, options=opts)
        mm.train_step(t)
        mm.train_step(t)
        want = [p.detach().clone() for p in t.model[0].parameters()]
        mm.train_step(t)
        t.iteration = mckpt.load(t.model, folder, optimizer=t.optimizer, scheduler=t.scheduler).iteration
        emptied = all(not st for st in t.optimizer.optimizer.state.values())
        mm.train_step(t)
        mm.train_step(t)
        return emptied and all(torch.equal(a, b) for a, b in zip(want, t.model[0].parameters()))
    finally:
        mm.teardown()


def _attempt(save) -> str:
    """``save()``'s outcome as text: "saved", or the error it raised."""
    try:
        save()
        return "saved"
    except Exception as exc:  # noqa: BLE001 - the test reads the refusal
        return f"{type(exc).__name__}: {exc}"


def _failing_rank_cases(rank: int, failing: int, good: dict) -> list[tuple[str, dict]]:
    """The user values one rank alone cannot save (the other rank's are fine), each with a name."""
    bad = {"not json": {"pos": object()}, "set": {"seen": {1, 2}}, "nan key": {float("nan"): 1}}
    return [(name, value if rank == failing else good) for name, value in bad.items()]


def ds_one_rank_fails_preparing(folder: str, failing: int) -> dict:
    """A client state only rank ``failing`` cannot save, through ``save`` and the checkpointer: every rank
    must raise naming that rank (neither waits in the save for the other), and the next save works."""
    from ckptkit.adapters import deepspeed as ds_ckpt
    from tests import deepspeed_job as job

    rank = torch.distributed.get_rank()
    engine = job.build(2, "fp32")
    job.train_step(engine, 1)
    out: dict = {}
    for name, value in _failing_rank_cases(rank, failing, {"pos": rank}):
        out[f"save {name}"] = _attempt(lambda: ds_ckpt.save(engine, f"{folder}/{name}", client_state=value))
    ckpt = ds_ckpt.DeepSpeedCheckpointer(engine, f"{folder}/run", every_steps=1, asynchronous=True)
    out["checkpointer"] = _attempt(lambda: ckpt.save(client_state=_failing_rank_cases(rank, failing, {})[0][1]))
    out["then"] = _attempt(lambda: (ckpt.save(client_state={"pos": rank}), ckpt.wait()))
    ckpt.close()
    return out


def mg_one_rank_fails_preparing(folder: str, failing: int) -> dict:
    """As :func:`ds_one_rank_fails_preparing`, for Megatron's ``extra`` and a scheduler raising on one rank."""
    mckpt, mm, t, opts = _megatron()
    rank = torch.distributed.get_rank()
    try:
        mm.train_step(t)
        out: dict = {}
        for name, value in _failing_rank_cases(rank, failing, {"pos": rank}):
            out[f"save {name}"] = _attempt(lambda: mckpt.save(t.model, f"{folder}/{name}", optimizer=t.optimizer,
                                                              scheduler=t.scheduler, iteration=1, extra=value,
                                                              options=opts))
        ckpt = mckpt.MegatronCheckpointer(t.model, t.optimizer, t.scheduler, f"{folder}/run", every_steps=1,
                                          options=opts)
        if rank == failing:
            def broken() -> dict:
                raise RuntimeError("scheduler state unavailable")
            t.scheduler.state_dict = broken
        out["checkpointer"] = _attempt(lambda: ckpt.save(1, extra={"pos": rank}))
        vars(t.scheduler).pop("state_dict", None)
        out["then"] = _attempt(lambda: (ckpt.save(2, extra={"pos": rank}), ckpt.wait()))
        ckpt.close()
        return out
    finally:
        mm.teardown()


def mg_overlapped_param_gather(folder: str) -> bool:
    """Train with ``overlap_param_gather`` (dp 2), save through the checkpointer right after the step, then
    finish the deferred all-gather (as the next forward would) and load the checkpoint back: the weights
    must be those of after the step, every element."""
    from ckptkit.adapters.megatron.model_space import unwrap

    mckpt, mm, t, opts = _megatron(overlap_param_gather=True)
    try:
        ckpt = mckpt.MegatronCheckpointer(t.model, t.optimizer, t.scheduler, folder, every_steps=1,
                                          asynchronous=False, options=opts)
        for _ in range(2):
            mm.train_step(t)
            ckpt.maybe_save(t.iteration)
        ckpt.close()
        for chunk in t.model:
            chunk.start_param_sync(force_sync=True)
        trained = [p.detach().clone() for c in t.model for p in unwrap(c).parameters()]
        for c in t.model:
            for p in unwrap(c).parameters():
                p.data.zero_()
        mckpt.load(t.model, f"{folder}/step-0000002", optimizer=t.optimizer, scheduler=t.scheduler)
        return all(torch.equal(a, b) for a, b in zip(trained, (p for c in t.model for p in unwrap(c).parameters())))
    finally:
        mm.teardown()


def save_split_records(folder: str) -> None:
    """Records that differ between the two ranks (as the old adapters wrote them with per-rank user data)."""
    rank = torch.distributed.get_rank()
    ds = {"format": 1, "global_steps": 4, "client_state": {"pos": rank}}
    ckptkit.save({"deepspeed_engine": {"deepspeed": json.dumps(ds)}}, f"{folder}/ds")
    mg = {"format": 1, "iteration": 4, "extra": {"pos": rank}}
    ckptkit.save({"megatron": {"meta": json.dumps(mg)}}, f"{folder}/mg")


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("framework", ["deepspeed", "megatron"])
def test_per_rank_user_values_come_back_to_each_rank_and_resizes_follow_the_option(worlds, tmp_path, framework):
    seed = random.randrange(10**6)
    values = _per_rank_values(seed)
    save, resized, key = (ds_user_values, ds_resized, CLIENT_KEY) if framework == "deepspeed" else (
        mg_user_values, mg_resized, EXTRA_KEY)
    got = worlds.run(2, save, str(tmp_path), seed, timeout=300)
    for rank in range(2):
        assert {case: got[rank][case] for case in values} == {case: v[rank] for case, v in values.items()}, seed
        assert got[rank]["old"] == ({"epoch": 3, "pos": [1, 2]} if framework == "deepspeed" else {"consumed_samples": 8})
    view = ckptkit.open(tmp_path / "equal")
    assert json.loads(view.values[key]) == values["equal"][0]  # agreed: one value, loads at any world size
    assert key not in ckptkit.open(tmp_path / "differ").values
    assert resized_value(worlds, resized, tmp_path, "equal", "error") == values["equal"][0]
    refused = worlds.run(1, resized, str(tmp_path), "differ", "error", timeout=300)[0]
    assert refused.startswith("StateMismatchError") and key in refused, refused
    skipped, warned = worlds.run(1, resized, str(tmp_path), "nested", "skip", timeout=300)[0]
    assert skipped == {} and any(key in m and "per_rank_on_resize='skip'" in m for m in warned), warned
    # `ckptkit reshard` drops per-rank values: the adapter refuses the checkpoint naming the key (Megatron
    # returned {} without a word, the fields the ranks agreed on lost too), or gives {} and a warning
    from ckptkit.layout.config import ParallelConfig

    ckptkit.reshard(tmp_path / "differ", tmp_path / "once", ParallelConfig.parse("tp1pp1"))
    ckptkit.reshard(tmp_path / "once", tmp_path / "resharded", ParallelConfig.parse("tp1pp1"))  # and again
    refused = worlds.run(1, resized, str(tmp_path), "resharded", "error", timeout=300)[0]
    assert refused.startswith("MissingKeysError") and key in refused and "reshard" in refused, refused
    skipped, warned = worlds.run(1, resized, str(tmp_path), "resharded", "skip", timeout=300)[0]
    assert skipped == {} and any(key in m and "reshard" in m for m in warned), warned


def resized_value(worlds, resized, tmp_path, case: str, mode: str) -> object:
    got = worlds.run(1, resized, str(tmp_path), case, mode, timeout=300)[0]
    assert isinstance(got, tuple), got
    return got[0]


def test_a_record_the_saving_ranks_disagreed_about_is_named(worlds, tmp_path):
    from ckptkit.adapters import deepspeed as ds_ckpt
    from ckptkit.adapters import megatron as mckpt

    worlds.run(2, save_split_records, str(tmp_path), timeout=120)
    for read, key in ((ds_ckpt.read_meta, "deepspeed_engine/deepspeed"), (mckpt.read_meta, "megatron/meta")):
        with pytest.raises(StateMismatchError, match="differed between the saving ranks") as err:
            read(tmp_path / ("ds" if "deepspeed" in key else "mg"))
        assert key in str(err.value) and ("client_state" in str(err.value) or "extra" in str(err.value))


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_refuses_every_kind_of_stored_tensor_the_model_lacks(worlds, tmp_path, stage):
    got = worlds.run(2, ds_changed_model, str(tmp_path), stage, timeout=300)
    for rank_got in got:
        for case, named in (("param->mlp", "model/fc3.weight"), ("buffer->mlp", "model/extra_buf"),
                            ("frozen->mlp", "model/gate"), ("mlp->nobias", "model/fc2.bias")):
            error, lenient = rank_got[case]
            assert isinstance(error, str) and error.startswith("UnexpectedKeysError") and named in error, (case, error)
            assert lenient, case
        assert "optimizer/exp_avg/fc3.weight" in rank_got["param->mlp"][0]
        assert isinstance(rank_got["weights_only"], tuple), rank_got["weights_only"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_rollback_to_a_step0_checkpoint_replays_bit_exact(worlds, tmp_path, stage):
    assert worlds.run(2, ds_rollback, str(tmp_path), stage, timeout=300) == [True, True]
    assert_same_state(str(tmp_path / f"want-z{stage}"), str(tmp_path / f"got-z{stage}"))


def test_megatron_refuses_a_stored_bias_the_model_lacks(worlds, tmp_path):
    got = worlds.run(1, mg_changed_model, str(tmp_path / "ck"), timeout=300)[0]
    for how in ("strict", "weights_only"):
        assert isinstance(got[how], str) and got[how].startswith("UnexpectedKeysError"), got[how]
        assert "model/decoder.layers.mlp.linear_fc1.bias" in got[how] and "tensor(s)" in got[how]
    assert got["lenient"][0] == 1


@pytest.mark.parametrize("dist_opt", [True, False], ids=["distributed", "plain"])
def test_megatron_rollback_to_a_step0_checkpoint_replays_bit_exact(worlds, tmp_path, dist_opt):
    assert worlds.run(2, mg_rollback, str(tmp_path / "it0"), dist_opt, timeout=300) == [True, True]


@pytest.mark.parametrize("framework", ["deepspeed", "megatron"])
def test_a_save_one_rank_cannot_prepare_fails_on_every_rank_naming_it(worlds, tmp_path, framework):
    """Building the state to save runs on each rank before the save's first collective; a failure there
    (a client state or ``extra`` one rank alone cannot store, a scheduler raising) used to raise on that
    rank alone while the other waited in the save until the job died."""
    failing = random.randrange(2)
    rank_fn = ds_one_rank_fails_preparing if framework == "deepspeed" else mg_one_rank_fails_preparing
    got = worlds.run(2, rank_fn, str(tmp_path), failing, timeout=240)
    for rank in range(2):
        for case, said in got[rank].items():
            if case == "then":
                assert said == "saved", (rank, said)
                continue
            assert said.startswith("SaveError") and f"rank {failing}:" in said, (rank, case, said)
            assert f"rank {1 - failing}:" not in said, (rank, case, said)
    for case in got[0]:
        if case.startswith("save "):
            with pytest.raises((ckptkit.CheckpointNotFoundError, ckptkit.UncommittedCheckpointError)):
                ckptkit.open(tmp_path / case[len("save "):])


def test_megatron_saves_the_weights_of_after_the_step_with_overlapped_param_gathers(worlds, tmp_path):
    """With ``overlap_param_gather`` the distributed optimizer's step updates each rank's shard of the
    weights only; the rest arrives at the next forward. The save took them as they were: one step stale
    outside each rank's shard, silently (found by a hunt, 2026-12-06). It now finishes the all-gather first,
    as Megatron-LM's own save does."""
    assert worlds.run(2, mg_overlapped_param_gather, str(tmp_path / "run"), timeout=300) == [True, True]
