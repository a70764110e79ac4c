"""Rank functions for the Megatron tests: train the tiny GPT (tests/megatron_model.py), save, resume.

Each function runs on every rank of a gloo world (tests/worlds.py), sets up
Megatron's parallel state for its layout in that world and tears it down, so
one 4-process world serves every layout of a test module.
"""

from __future__ import annotations

from typing import Any

import torch

from tests import megatron_model as mm

def _options(divisible_by: int) -> Any:
    from ckptkit.adapters import megatron as mckpt

    return mckpt.MegatronOptions(vocab_size=mm.VOCAB, make_vocab_size_divisible_by=divisible_by)


def train_and_save(layout: mm.Layout, folder: str, *, save_step: int, steps: int, asynchronous: bool = True,
                   megatron_folder: str | None = None) -> dict[str, Any]:
    """The uninterrupted reference run: train to ``steps``, saving with ckptkit after ``save_step``
    (and, if asked, with Megatron's own dist_checkpointing, model weights only)."""
    from ckptkit.adapters import megatron as mckpt

    t = mm.setup(layout)
    out: dict[str, Any] = {"losses": {}}
    try:
        for _ in range(save_step):
            step = t.iteration + 1
            out["losses"][step] = mm.train_step(t)
        out["eval"] = mm.eval_loss(t)
        out["lr"] = t.optimizer.param_groups[0]["lr"]
        handle = mckpt.save(t.model, folder, optimizer=t.optimizer, scheduler=t.scheduler, iteration=t.iteration,
                            extra={"consumed_samples": 8 * t.iteration}, options=_options(layout.divisible_by),
                            asynchronous=asynchronous)
        if megatron_folder is not None:
            from megatron.core import dist_checkpointing

            dist_checkpointing.save(_model_sd(t), megatron_folder)
        for _ in range(save_step, steps):  # training goes on while the checkpoint persists
            step = t.iteration + 1
            out["losses"][step] = mm.train_step(t)
        if asynchronous:
            handle.wait()
            import ckptkit

            ckptkit.close_async()
        out["final_eval"] = mm.eval_loss(t)
        return out
    finally:
        mm.teardown()


def _model_sd(t: mm.Trainer) -> dict[str, Any]:
    """Megatron's sharded state dict of every model chunk, one sub-dict per chunk (as Megatron's trainer nests it)."""
    from ckptkit.adapters.megatron.model_space import unwrap

    return {f"model{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(t.model)}


def resume(layout: mm.Layout, folder: str, *, steps: int, load_optimizer: bool = True,
           save_again: str | None = None) -> dict[str, Any]:
    """A fresh job at ``layout`` loads the checkpoint, reports its eval loss, and trains on to ``steps``."""
    from ckptkit.adapters import megatron as mckpt

    t = mm.setup(layout, seed=999)  # other initial weights: everything must come from the checkpoint
    try:
        info = mckpt.load(t.model, folder, optimizer=t.optimizer if load_optimizer else None, scheduler=t.scheduler)
        t.iteration = info.iteration
        out: dict[str, Any] = {"eval": mm.eval_loss(t), "iteration": info.iteration, "extra": info.extra,
                               "rng_restored": info.rng_restored, "lr": t.optimizer.param_groups[0]["lr"],
                               "losses": {}}
        if save_again is not None:
            mckpt.save(t.model, save_again, optimizer=t.optimizer, scheduler=t.scheduler, iteration=t.iteration,
                       extra=info.extra, options=_options(layout.divisible_by))
        while t.iteration < steps:
            step = t.iteration + 1
            out["losses"][step] = mm.train_step(t)
        out["final_eval"] = mm.eval_loss(t)
        return out
    finally:
        mm.teardown()


def megatron_reference_eval(layout: mm.Layout, megatron_folder: str) -> float:
    """Megatron's own round trip: dist_checkpointing.load of its torch_dist save, at ``layout``."""
    from megatron.core import dist_checkpointing

    from ckptkit.adapters.megatron.model_space import unwrap

    t = mm.setup(layout, seed=999)
    try:
        loaded = dist_checkpointing.load(_model_sd(t), megatron_folder)
        for i, chunk in enumerate(t.model):
            unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=False)
        return mm.eval_loss(t)
    finally:
        mm.teardown()


def all_tensors(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint in model space, read through ckptkit.open."""
    import ckptkit

    view = ckptkit.open(folder)
    return {k: view[k].read() for k in view.keys()}


def embedding_after_load(layout: mm.Layout, folder: str) -> dict[str, Any]:
    """This rank's word-embedding shard right after loading (TP ranks 0..tp-1 report), then two steps."""
    from megatron.core import parallel_state as ps

    from ckptkit.adapters import megatron as mckpt
    from ckptkit.adapters.megatron.model_space import unwrap

    t = mm.setup(layout, seed=999)
    try:
        mckpt.load(t.model, folder, optimizer=t.optimizer, scheduler=t.scheduler)
        rows = unwrap(t.model[0]).embedding.word_embeddings.weight.detach().clone()
        losses = [mm.train_step(t) for _ in range(2)]
        keep = ps.get_data_parallel_rank() == 0 and ps.is_pipeline_first_stage()
        return {"rows": rows if keep else torch.empty(0, rows.shape[1]), "losses": losses}
    finally:
        mm.teardown()


def checkpointer_run(layout: mm.Layout, root: str, *, steps: int) -> dict[str, Any]:
    """Train with MegatronCheckpointer saving every step (async, keep 2), or resume its newest step."""
    from ckptkit.adapters.megatron import MegatronCheckpointer

    t = mm.setup(layout, seed=999)
    try:
        ckpt = MegatronCheckpointer(t.model, t.optimizer, t.scheduler, root, every_steps=1, keep_last=2,
                                    options=_options(layout.divisible_by))
        info = ckpt.restore_latest()
        if info is not None:
            t.iteration = info.iteration
        start = t.iteration
        losses = {}
        while t.iteration < steps:
            step = t.iteration + 1
            losses[step] = mm.train_step(t)
            ckpt.maybe_save(t.iteration, extra={"consumed_samples": 8 * t.iteration})
        ckpt.close()
        return {"start": start, "extra": None if info is None else info.extra, "losses": losses,
                "eval": mm.eval_loss(t)}
    finally:
        mm.teardown()


def load_error(layout: mm.Layout, folder: str) -> str | None:
    """The message of the error a load at ``layout`` raises on this rank (None: it loaded)."""
    from ckptkit.adapters import megatron as mckpt
    from ckptkit.errors import CkptkitError

    t = mm.setup(layout, seed=999)
    try:
        mckpt.load(t.model, folder, optimizer=t.optimizer, scheduler=t.scheduler)
        return None
    except CkptkitError as exc:
        return str(exc)
    finally:
        mm.teardown()
