"""Rank functions for tests/test_megatron_convert.py (run on every rank of a gloo world).

Megatron's own code writes and reads every foreign checkpoint here:
``dist_checkpointing.save`` (torch_dist, with a Megatron-LM style common state:
``args``, ``iteration``, ``checkpoint_version``: every non-sharded item of the saved dict goes
to ``common.pt``, which is how Megatron-LM's ``save_checkpoint`` stores its ``args``), the legacy layout of
``megatron/training/checkpointing.py`` (``megatron.training`` is not installed,
so its file naming and dict keys are reproduced: ``iter_XXXXXXX/mp_rank_TT_PPP/
model_optim_rng.pt`` holding ``args``, ``checkpoint_version``, ``iteration``,
``model`` = ``state_dict_for_save_checkpoint()``, ``rng_state``,
``opt_param_scheduler``, ``optimizer`` (the fp32 and distributed optimizers here: not imported, listed as
skipped; the mixed-precision one is imported: tests/test_megatron_legacy_optimizer.py), the distributed
optimizer's ``distrib_optim.pt``), and ``dist_checkpointing.load`` for the references.
"""

from __future__ import annotations

import argparse
import os
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tests import megatron_model as mm

STEPS = 2


def mlm_args(layout: mm.Layout) -> argparse.Namespace:
    """Megatron-LM's ``args`` as its training loop saves them (``generate_state_dict``:
    ``state_dict['args'] = args``): ``vocab_size`` is its ``--vocab-size``, None unless given
    (the tokenizer's size is not kept; ``padded_vocab_size`` is)."""
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(vocab_size=None,
        num_layers=mm.LAYERS, hidden_size=layout.hidden, num_attention_heads=8, tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp, virtual_pipeline_model_parallel_size=layout.vpp,
        make_vocab_size_divisible_by=layout.divisible_by, padded_vocab_size=mm.padded_vocab(layout),
        untie_embeddings_and_output_weights=not layout.tied, world_size=dist.get_world_size(),
        bf16=layout.bf16, params_dtype=torch.bfloat16 if layout.bf16 else torch.float32, attention_backend=AttnBackend.auto, ckpt_format="torch")


def _rng_state() -> dict[str, Any]:
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
            "rng_tracker_states": {}}


def _global_tensors(modules: list[Any]) -> dict[str, torch.Tensor]:
    """Megatron's global tensors, assembled from ``sharded_state_dict()`` of a tp1 pp1 model."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
    )

    out: dict[str, torch.Tensor] = {}
    for module in modules:
        for v in module.sharded_state_dict().values():
            shards = v.build() if isinstance(v, ShardedTensorFactory) else [v] if isinstance(v, ShardedTensor) else []
            for sh in shards:
                full = out.setdefault(sh.key, torch.zeros(sh.global_shape, dtype=sh.data.dtype))
                data = sh.data.reshape((1,) * sh.prepend_axis_num + tuple(sh.local_shape))
                idx = tuple(slice(o, o + n) for o, n in zip(sh.global_offset, data.shape))
                full[idx] = data.detach()
    return out


def legacy_save(t: mm.Trainer, layout: mm.Layout, folder: str) -> None:
    """Megatron-LM's legacy checkpoint of the trainer's state at ``folder`` (the save root): DP rank 0 of every
    (tp, pp) writes ``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`` with ``optimizer.state_dict()``; with the
    distributed optimizer every rank calls ``save_parameter_state`` (DP rank 0 gathers and writes
    ``distrib_optim.pt`` beside it); rank 0 writes the tracker."""
    from megatron.core import parallel_state as ps

    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    rank_dir = os.path.join(folder, f"iter_{t.iteration:07d}", f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if layout.pp > 1 else ""))
    optimizer = t.optimizer.state_dict()
    if ps.get_data_parallel_rank() == 0:
        os.makedirs(rank_dir, exist_ok=True)
        state: dict[str, Any] = {"args": mlm_args(layout), "checkpoint_version": 3.0, "iteration": t.iteration,
                                 "optimizer": optimizer, "opt_param_scheduler": t.scheduler.state_dict(),
                                 "rng_state": [_rng_state()], "num_floating_point_operations_so_far": 0}
        if len(t.model) == 1:
            state["model"] = t.model[0].state_dict_for_save_checkpoint()
        else:
            for i, chunk in enumerate(t.model):
                state[f"model{i}"] = chunk.state_dict_for_save_checkpoint()
        torch.save(state, os.path.join(rank_dir, "model_optim_rng.pt"))
    if layout.dist_opt:
        dist.barrier()
        t.optimizer.save_parameter_state(os.path.join(rank_dir, "distrib_optim.pt"))
    if dist.get_rank() == 0:
        with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(t.iteration))
    dist.barrier()


def train_and_save(folder: str, tied: bool) -> dict[str, Any]:
    """Train at tp2pp2, save torch_dist and legacy; then load torch_dist at tp1pp1 as the reference. Also
    Megatron's load of torch_dist back at tp2pp2: its eval is the trained model's (the same weights, the same
    arithmetic), which is what makes the tp1pp1 load the trained model."""
    from megatron.core import dist_checkpointing

    # untied: Megatron's plain optimizer (model-space state, imported); tied: the distributed one
    # (flat dp_reshardable buckets, Megatron-LM's default form, placed in model space by the import)
    layout = mm.Layout(tp=2, pp=2, tied=tied, dist_opt=tied)
    trainer = mm.setup(layout)
    for _ in range(STEPS):
        mm.train_step(trainer)
    loss = mm.eval_loss(trainer)
    module = trainer.model[0].module
    it = trainer.iteration
    tdir = os.path.join(folder, "torch_dist")
    if dist.get_rank() == 0:
        os.makedirs(tdir, exist_ok=True)
    dist.barrier()
    sharded = module.sharded_state_dict()
    optim = trainer.optimizer.sharded_state_dict(
        sharded, metadata={"distrib_optim_sharding_type": "dp_reshardable"} if layout.dist_opt else None)
    dist_checkpointing.save({"model": sharded, "optimizer": optim, "iteration": it, "checkpoint_version": 3.0,
                             "args": mlm_args(layout)}, tdir)
    plain = dist_checkpointing.load_plain_tensors(tdir)  # Megatron's own full-tensor read: the optimizer reference
    optimizer = {k: v for k, v in plain.items() if k.startswith("optimizer.state.")}
    # legacy, with the optimizer: the fp32 optimizer's state (untied), the distributed optimizer's (tied)
    legacy_save(trainer, layout, os.path.join(folder, "legacy"))
    reload_loss = load_and_eval(tdir, layout.tp, layout.pp, tied)
    ref_trainer = mm.setup(mm.Layout(tp=1, pp=1, tied=tied))
    ref = ref_trainer.model[0].module
    # load() returns common.pt's items (iteration, args ...) beside the sharded ones: wrap like Megatron-LM
    ref.load_state_dict(dist_checkpointing.load({"model": ref.sharded_state_dict()}, tdir)["model"])
    tensors = _global_tensors([ref])
    mm.teardown()
    first = dist.get_rank() == 0
    return {"loss": loss, "reload_loss": reload_loss, "iteration": it,
            "tensors": tensors if first else None,
            "optimizer": optimizer if first else None}


def load_and_eval(path: str, tp: int, pp: int, tied: bool) -> float:
    """Megatron's own ``dist_checkpointing.load`` of ``path`` into a model built at tp/pp; its eval loss."""
    from megatron.core import dist_checkpointing

    trainer = mm.setup(mm.Layout(tp=tp, pp=pp, tied=tied))
    for chunk in trainer.model:
        module = chunk.module
        module.load_state_dict(dist_checkpointing.load({"model": module.sharded_state_dict()}, path)["model"])
    loss = mm.eval_loss(trainer)
    mm.teardown()
    return loss
