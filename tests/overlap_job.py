"""Rank-side functions of tests/test_overlap_adapters.py: a real DeepSpeed engine saving with
``AsyncOptions(snapshot="overlap")`` while it trains on at once (tests/deepspeed_job.py's engine)."""

from __future__ import annotations

from typing import Any

import torch

from tests import deepspeed_job as ds_job


def deepspeed_overlap(stage: int, dtype: str, folder: str, *, snapshot: str, save_step: int, steps: int,
                      bypass: bool = False) -> dict[str, Any]:
    """Train to ``steps``, saving at ``save_step`` with ``snapshot``: the next step starts the moment
    ``save`` returns (no wait for ``staged``). ``bypass``: scale an fp32 master in place right after the
    save, before the next step (a change no guard sees): the save must fail and commit nothing."""
    import ckptkit
    from ckptkit.adapters import deepspeed as ds_ckpt

    engine = ds_job.build(stage, dtype)
    out: dict[str, Any] = {}
    handle = None
    for step in range(1, steps + 1):
        ds_job.train_step(engine, step)
        if step == save_step:
            handle = ds_ckpt.save(engine, f"{folder}/ckptkit", client_state={"epoch": 1}, asynchronous=True,
                                  options=ckptkit.AsyncOptions(snapshot=snapshot))  # type: ignore[arg-type]
            if bypass:  # ZeRO 1/2: the fp32 master partition, changed outside the optimizer's step
                with torch.no_grad():
                    engine.optimizer.single_partition_of_fp32_groups[0].mul_(1.001)
    assert handle is not None
    try:
        handle.wait()
        out["error"] = None
    except ckptkit.SaveError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    try:
        ckptkit.close_async()
    except ckptkit.SaveError:
        assert out["error"] is not None  # the failure already reported above, raised once more by close
    return out


def megatron_overlap(layout: Any, folder: str, *, snapshot: str, save_step: int, steps: int) -> dict[str, Any]:
    """The tiny Megatron GPT (tests/megatron_model.py) trained to ``steps``, saved after ``save_step`` with
    ``snapshot``; the moment ``save`` returns, ``optimizer.step()`` runs once more on the last gradients
    (an optimizer that starts the next update at once: the tiny model's copy would otherwise be done long
    before the next iteration's forward and backward are), then training goes on. A refused configuration
    is returned as ``error`` (raised on every rank alike, before anything is written)."""
    import ckptkit
    from ckptkit.adapters import megatron as mckpt
    from tests import megatron_model as mm

    t = mm.setup(layout)
    out: dict[str, Any] = {"error": None}
    try:
        for _ in range(save_step):
            mm.train_step(t)
        try:
            handle = mckpt.save(t.model, folder, optimizer=t.optimizer, scheduler=t.scheduler, iteration=t.iteration,
                                options=mckpt.MegatronOptions(vocab_size=mm.VOCAB,
                                                              make_vocab_size_divisible_by=layout.divisible_by),
                                asynchronous=True,
                                async_options=ckptkit.AsyncOptions(snapshot=snapshot))  # type: ignore[arg-type]
        except ckptkit.OptionsError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
            return out
        t.optimizer.step()
        for _ in range(save_step, steps):  # training goes on
            mm.train_step(t)
        try:
            handle.wait()
        except ckptkit.SaveError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        try:
            ckptkit.close_async()
        except ckptkit.SaveError:
            assert out["error"] is not None
        return out
    finally:
        mm.teardown()


def torchtitan_overlap(folder: str, *, snapshot: str) -> dict[str, Any]:
    """torchtitan's llama3 debug model under FSDP2 (tests/torchtitan_job.py's Job, torchtitan's own
    optimizers container and trainer order), checkpointing every 2 steps through
    ``CkptkitCheckpointManager(async_mode="async", snapshot=...)``. Right after the save of step 2 the
    optimizers step once more on the last gradients, straight away (no ``maybe_wait_for_staging``
    first: the container's own hook must hold it), then training goes on to step 4."""
    from tests import torchtitan_job as tj

    j = tj.Job("fsdp2", tj._config(folder, async_mode="async", snapshot=snapshot))
    assert j.checkpointer.load(step=-1) is False
    j.run(2)
    j.optimizers.step()
    j.run(4)
    j.close()
    return {"committed": [r.name for r in j.checkpointer.manager.records() if r.committed], "digests": j.digests()}
