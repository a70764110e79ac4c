"""A DeepSpeed or Megatron load refused before any byte lands leaves the job exactly as it was.

Both adapters make each parameter's optimizer state the checkpoint's kinds before the core load
fills it (a rollback to a checkpoint saved before the first step must not keep later moments). The
core checks digests, coverage and sizes only then, so a damaged index or a missing object refused
the load *after* the live moments had been replaced: ``restore_latest`` returned None ("the state is
as passed in") over zeroed moments and the refused checkpoint's step counts, and the next steps
differed from a fresh start (found by a hunt, 2026-12-06; both adapters). Also found then: DeepSpeed's
own optimizer-state API (``safe_get/safe_set_full_optimizer_state``) kept pointing at the pre-load
moments after a load at ZeRO-1/2 (the adapter put fresh tensors in place of the live ones), and a
Megatron checkpoint saved with a constant loss scale crashed a dynamic-scaler job's load with a bare
``KeyError`` after every tensor had been loaded.

The class test damages a committed checkpoint in every way found before a byte lands and tries each
through the adapter's ``load`` and its checkpointer's ``restore_latest``: the whole live state
(weights, masters, every optimizer state entry, counters) must be bit-equal afterwards.
"""

from __future__ import annotations

import glob
import os
import random
import shutil

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("megatron.core")

import torch
import torch.distributed as dist

import ckptkit
from tests.damage import flip_byte

pytestmark = pytest.mark.usefixtures("retire_megatron_world")

DAMAGES = ("index flipped", "index missing", "data missing")


def _damage(src: str, dst: str, kind: str, seed: int) -> None:
    """A copy of checkpoint ``src`` at ``dst`` with the damage named, found before any byte is placed."""
    shutil.copytree(src, dst)
    rnd = random.Random(seed)
    if kind == "index flipped":
        flip_byte(rnd.choice(sorted(glob.glob(f"{dst}/index/*.json"))), where=rnd.random())
    elif kind == "index missing":
        os.remove(rnd.choice(sorted(glob.glob(f"{dst}/index/*.json"))))
    else:
        os.remove(rnd.choice(sorted(p for p in glob.glob(f"{dst}/**/*", recursive=True)
                                    if os.path.isfile(p) and "/data/" in p)))


def _damaged_copies(good: str, folder: str, seed: int) -> list[str]:
    """Every damage of :data:`DAMAGES` as a loose checkpoint, and as the one step of a run folder."""
    if dist.get_rank() == 0:
        for i, kind in enumerate(DAMAGES):
            _damage(good, f"{folder}/{kind}", kind, seed + i)
            _damage(good, f"{folder}/run {kind}/step-0000009", kind, seed + i)
    dist.barrier()
    return list(DAMAGES)


def _snapshot(tensors: dict) -> dict:
    return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in tensors.items()}


def _differences(a: dict, b: dict) -> list[str]:
    out = [k for k in sorted(set(a) | set(b)) if k not in a or k not in b]
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        same = (x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)) if isinstance(x, torch.Tensor) else x == y
        if not same:
            out.append(k)
    return out


def _attempt(work) -> tuple[str, bool]:
    """``work()``'s outcome ("None", "returned", or the error's type) and whether its error says the
    state was partly overwritten (a damage found after some bytes had landed: then, and only then, the
    live state may have changed)."""
    from ckptkit.engine.loader import overwrote_state

    try:
        return ("None" if work() is None else "returned"), False
    except ckptkit.CkptkitError as exc:
        return type(exc).__name__, overwrote_state(exc) or "partly overwritten" in str(exc)


def _refusals(load, restore, snapshot, damages: list[str]) -> dict:
    """Each damaged copy through ``load`` and ``restore``: the outcome, whether it says the state was
    partly overwritten, and the live state entries that changed."""
    out = {}
    for kind in damages:
        for what, work in (("load", load), ("restore", restore)):
            before = snapshot()
            outcome, overwritten = _attempt(lambda: work(kind))
            out[f"{what} {kind}"] = (outcome, overwritten, _differences(before, snapshot()))
    return out


# ---------------------------------------------------------------- DeepSpeed
def _ds_state(engine) -> dict:
    out = {f"model/{n}": p for n, p in engine.module.named_parameters()}
    base = engine.optimizer.optimizer
    for gi, g in enumerate(base.param_groups):
        for pi, p in enumerate(g["params"]):
            out[f"g{gi}.{pi}/fp32"] = p
            for k, v in base.state.get(p, {}).items():
                out[f"g{gi}.{pi}/{k}"] = v
    out["counters"] = (engine.global_steps, engine.global_samples, engine.skipped_steps, engine.micro_steps)
    return _snapshot(out)


def _ds_step(engine, step: int) -> None:
    from tests import deepspeed_job as job

    rank, dp = dist.get_rank(), dist.get_world_size()
    x, y = job.batch(step, engine)
    per = job.GLOBAL_BATCH // dp
    engine.backward(job.loss_of(engine, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]))
    engine.step()


def _ds_moments(engine) -> dict:
    from deepspeed.utils import safe_get_full_optimizer_state

    return {n: safe_get_full_optimizer_state(p, "exp_avg").clone() for n, p in engine.module.named_parameters()}


def ds_refused_loads(folder: str, stage: int, seed: int) -> dict:
    from ckptkit.adapters import deepspeed as ds_ckpt
    from tests import deepspeed_job as job

    engine = job.build(stage, "bf16")
    for step in range(1, 4):
        _ds_step(engine, step)
    ds_ckpt.save(engine, f"{folder}/good")
    saved = _ds_moments(engine) if stage < 3 else {}
    damages = _damaged_copies(f"{folder}/good", folder, seed)
    _ds_step(engine, 4)  # the live engine's own moments and counters, newer than the checkpoint's
    out = _refusals(lambda kind: ds_ckpt.load(engine, f"{folder}/{kind}"),
                    lambda kind: ds_ckpt.DeepSpeedCheckpointer(engine, f"{folder}/run {kind}",
                                                               asynchronous=False).restore_latest(),
                    lambda: _ds_state(engine), damages)
    ds_ckpt.load(engine, f"{folder}/good")
    if stage < 3:  # DeepSpeed's own API sees, and writes, the moments the optimizer steps with
        from deepspeed.utils import safe_set_full_optimizer_state

        seen = _ds_moments(engine)
        out["api sees the loaded moments"] = all(torch.equal(seen[n], saved[n]) for n in saved)
        live = [engine.optimizer.optimizer.state[g["params"][0]]["exp_avg"].clone()
                for g in engine.optimizer.optimizer.param_groups]
        for name, param in engine.module.named_parameters():  # each rank's partition holds some of them
            safe_set_full_optimizer_state(param, torch.zeros_like(seen[name]), "exp_avg")
        after = [engine.optimizer.optimizer.state[g["params"][0]]["exp_avg"] for g in engine.optimizer.optimizer.param_groups]
        out["api writes reach the optimizer"] = any(not torch.equal(a, b) for a, b in zip(live, after))
    return out


# ---------------------------------------------------------------- Megatron
def _mg_state(t) -> dict:
    out = {f"model/{n}": p for i, chunk in enumerate(t.model) for n, p in chunk.named_parameters()}
    for oi, opt in enumerate(getattr(t.optimizer, "chained_optimizers", None) or [t.optimizer]):
        for gi, g in enumerate(opt.optimizer.param_groups):
            for pi, p in enumerate(g["params"]):
                out[f"o{oi}.g{gi}.{pi}/main"] = p
                for k, v in opt.optimizer.state.get(p, {}).items():
                    out[f"o{oi}.g{gi}.{pi}/{k}"] = v
    out["scheduler"] = t.scheduler.num_steps
    return _snapshot(out)


def mg_refused_loads(folder: str, dist_opt: bool, seed: int) -> dict:
    from ckptkit.adapters import megatron as mckpt
    from tests import megatron_model as mm

    t = mm.setup(mm.Layout(dist_opt=dist_opt))
    opts = mckpt.MegatronOptions(vocab_size=mm.VOCAB, make_vocab_size_divisible_by=16)
    try:
        for _ in range(2):
            mm.train_step(t)
        mckpt.save(t.model, f"{folder}/good", optimizer=t.optimizer, scheduler=t.scheduler, iteration=2, options=opts)
        damages = _damaged_copies(f"{folder}/good", folder, seed)
        mm.train_step(t)
        return _refusals(
            lambda kind: mckpt.load(t.model, f"{folder}/{kind}", optimizer=t.optimizer, scheduler=t.scheduler),
            lambda kind: mckpt.MegatronCheckpointer(t.model, t.optimizer, t.scheduler, f"{folder}/run {kind}",
                                                    asynchronous=False, options=opts).restore_latest(),
            lambda: _mg_state(t), damages)
    finally:
        mm.teardown()


# ---------------------------------------------------------------- tests
def _check(got: list[dict]) -> None:
    for rank, cases in enumerate(got):
        for case, said in cases.items():
            if case.startswith("api "):
                assert said is True, (rank, case)
                continue
            outcome, overwritten, changed = said
            # a load raises; a restore gives None (nothing restored) or raises that the state is partly overwritten
            assert outcome != "returned" and (outcome != "None" or case.startswith("restore ")), (rank, case, said)
            assert overwritten or changed == [], (rank, case, changed[:6])


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_loads_refused_before_a_byte_lands_leave_the_engine_as_it_was(worlds, tmp_path, stage):
    _check(worlds.run(2, ds_refused_loads, str(tmp_path), stage, random.randrange(10**6), timeout=300))


def test_megatron_loads_refused_before_a_byte_lands_leave_the_job_as_it_was(worlds, tmp_path):
    _check(worlds.run(2, mg_refused_loads, str(tmp_path), True, random.randrange(10**6), timeout=300))


def scalers_across_kinds() -> bool:
    """Megatron's own scaler classes (in a rank process: they live on the CUDA device, shimmed to the CPU)."""
    from types import SimpleNamespace

    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    from ckptkit.adapters.megatron import optimizer_state as opt_state
    from tests import megatron_cpu_shims

    megatron_cpu_shims.install()

    def dynamic() -> DynamicGradScaler:
        return DynamicGradScaler(initial_scale=2.0**16, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                                 growth_interval=100, hysteresis=2)

    job = SimpleNamespace(grad_scaler=dynamic())
    assert opt_state.grad_scaler_plan(job, opt_state.grad_scaler_states(
        SimpleNamespace(grad_scaler=ConstantGradScaler(1024.0))), "ck") == []
    saved = dynamic()
    saved.update(found_inf=True)
    record = opt_state.grad_scaler_states(SimpleNamespace(grad_scaler=saved))
    opt_state.load_grad_scalers(opt_state.grad_scaler_plan(job, record, "ck"))
    assert float(job.grad_scaler.scale) == float(saved.scale) and job.grad_scaler.state_dict()["hysteresis_tracker"] == 1
    constant = SimpleNamespace(grad_scaler=ConstantGradScaler(1024.0))
    opt_state.load_grad_scalers(opt_state.grad_scaler_plan(constant, record, "ck"))
    assert float(constant.grad_scaler.scale) == 1024.0
    lacking = [{k: v for k, v in record[0].items() if k != "hysteresis_tracker"}]
    with pytest.raises(ckptkit.StateMismatchError, match="ck: .*hysteresis_tracker"):
        opt_state.grad_scaler_plan(job, lacking, "ck")
    return True


def test_loss_scalers_recorded_and_loaded_across_scaling_kinds(worlds):
    """A constant scale's record (``{}``) leaves a dynamic scaler at its initial state (as the torch_dist
    export does); a dynamic record loads into a constant scaler (which keeps its scale); a record lacking
    a tracker is refused naming it, before the load writes anything."""
    assert worlds.run(1, scalers_across_kinds, timeout=120) == [True]
