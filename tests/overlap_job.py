"""Rank-side functions of tests/test_overlap_adapters.py: a real DeepSpeed engine saving with
``AsyncOptions(snapshot="overlap")`` while it trains on at once (tests/deepspeed_job.py's engine)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from tests import deepspeed_job as ds_job

HOLD_SECONDS = 0.5


@contextlib.contextmanager
def copy_held_back(seconds: float = HOLD_SECONDS) -> Iterator[list[float]]:
    """Hold the first overlapped snapshot's background copy back ``seconds`` before its first piece, so
    what training does right after ``save`` returns (the next step's forward, backward, pre-hooks and
    update) certainly happens while the copy is in flight. Without it a tiny test state is usually copied
    before the next update starts, and the race a test means to lose is not there. Yields a list that
    gets one entry when the hold happened (a blocking snapshot never reaches it)."""
    import ckptkit.engine.overlap as overlap

    real, held = overlap.piece_pair, []

    def held_back(*args: Any, **kwargs: Any) -> Any:
        if not held:
            held.append(time.monotonic())
            time.sleep(seconds)
        return real(*args, **kwargs)

    overlap.piece_pair = held_back
    try:
        yield held
    finally:
        overlap.piece_pair = real


def deepspeed_overlap(stage: int, dtype: str, folder: str, *, snapshot: str, save_step: int, steps: int,
                      bypass: bool = False, moe_ep: int | None = None) -> dict[str, Any]:
    """Train to ``steps``, saving at ``save_step`` with ``snapshot``: the next step starts the moment
    ``save`` returns (no wait for ``staged``), while the overlapped copy is held back (:func:`copy_held_back`).
    ``bypass``: scale an fp32 master in place right after the save, before the next step (a change no guard
    sees): the save must fail and commit nothing. ``moe_ep``: tests/deepspeed_moe_job.py's DeepSpeed-MoE
    engine at that expert-parallel size (fp32) instead of the dense one."""
    import ckptkit
    from ckptkit.adapters import deepspeed as ds_ckpt
    from tests import deepspeed_moe_job as moe_job

    engine = ds_job.build(stage, dtype) if moe_ep is None else moe_job.build(stage, moe_ep)
    train_step = ds_job.train_step if moe_ep is None else moe_job.train_step
    out: dict[str, Any] = {}
    handle = None
    with copy_held_back() as held:
        for step in range(1, steps + 1):
            train_step(engine, step)
            if step == save_step:
                handle = ds_ckpt.save(engine, f"{folder}/ckptkit", client_state={"epoch": 1}, asynchronous=True,
                                      options=ckptkit.AsyncOptions(snapshot=snapshot))  # type: ignore[arg-type]
                if bypass:  # ZeRO 1/2: the fp32 master partition, changed outside the optimizer's step
                    with torch.no_grad():
                        engine.optimizer.single_partition_of_fp32_groups[0].mul_(1.001)
    out["copy_held"] = bool(held)
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
    hold = copy_held_back()
    held = hold.__enter__()
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
        hold.__exit__(None, None, None)
        out["copy_held"] = bool(held)
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
        hold.__exit__(None, None, None)
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
    with copy_held_back() as held:
        j.run(2)
        j.optimizers.step()
        j.run(3)
    j.run(4)
    j.close()
    return {"committed": [r.name for r in j.checkpointer.manager.records() if r.committed], "digests": j.digests(),
            "copy_held": bool(held)}


def torchtitan_moe_overlap(folder: str, *, snapshot: str, gate_first: bool = True) -> dict[str, Any]:
    """torchtitan's qwen3 MoE at FSDP 2 x EP 2 (tests/torchtitan_moe_job.py), checkpointing every 2 steps
    through ``CkptkitCheckpointManager(async_mode="async", snapshot=...)``. The step right after the save of
    step 2 runs at once, without ``maybe_wait_for_staging``: its forward counts the tokens per expert and the
    optimizers' step pre-hooks update ``expert_bias_E`` (torchtitan's load balancing) before the update.
    Only the gate, which runs before every other pre-hook, holds those writes until the copy is done.
    ``gate_first=False`` (a control): the load-balancing hook is moved in front of the gate.

    The background copy of the step-2 save is held back (:func:`copy_held_back`), so the next step's
    forward, backward and pre-hooks certainly run while it is in flight."""
    from tests import torchtitan_job as tj
    from tests import torchtitan_moe_job as mj

    j = mj.MoEJob("qwen3", "fsdp2_ep2", tj._config(folder, async_mode="async", snapshot=snapshot))
    if not gate_first:
        _load_balancing_first(j.optimizers)
    assert j.checkpointer.load(step=-1) is False
    j.run(1)
    with copy_held_back() as held:  # until step 3 is done: the persist thread may reach the copy late
        j.run(2)
        waits = j.checkpointer.maybe_wait_for_staging
        j.checkpointer.maybe_wait_for_staging = lambda: None  # the trainer's own wait, skipped for this step
        biases = {k: v.clone() for k, v in j.model.state_dict().items() if k.endswith("expert_bias_E")}  # replicated
        assert biases and not any(hasattr(v, "full_tensor") for v in biases.values())
        j.run(3)
        j.checkpointer.maybe_wait_for_staging = waits
    changed = any(not torch.equal(v, biases[k]) for k, v in j.model.state_dict().items() if k in biases)
    error = None
    try:
        j.run(4)
        j.close()
    except Exception as exc:  # noqa: BLE001 - the control's failed save is the result
        error = f"{type(exc).__name__}: {exc}"
        j.checkpointer.manager.close()
    return {"committed": [r.name for r in j.checkpointer.manager.records() if r.committed], "digests": j.digests(),
            "bias_changed_at_step_3": changed, "copy_held": bool(held), "error": error}


def _load_balancing_first(optimizer: Any) -> None:
    """Put torchtitan's load-balancing pre-hook (and any other non-ckptkit one) before ckptkit's gate: the
    optimizer's own ckptkit hook moved last, and ckptkit's global step pre-hook (which runs before every
    optimizer's own hooks, and would hold the load balancing at the gate all the same) taken out."""
    hooks = optimizer._optimizer_step_pre_hooks
    ours = [k for k, h in hooks.items() if "ckptkit" in getattr(h, "__module__", "")]
    for k in ours:
        hooks.move_to_end(k)
    from torch.optim import optimizer as torch_optimizer

    everyone = torch_optimizer._global_optimizer_pre_hooks
    for k in [k for k, h in everyone.items() if "ckptkit" in getattr(h, "__module__", "")]:
        del everyone[k]
