"""Rank functions for tests/test_megatron_legacy_optimizer.py: Megatron-LM's legacy save with its optimizer.

``megatron.training`` is not installed, so its legacy save (``--ckpt-format torch``, ``save_checkpoint`` ->
``generate_state_dict``) is reproduced: data-parallel rank 0 of every (tp, pp) writes
``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`` holding ``args``, ``checkpoint_version``, ``iteration``,
``model`` (``model0``, ``model1`` ... with virtual pipeline chunks) = each chunk's
``state_dict_for_save_checkpoint()``, ``optimizer`` = megatron-core's own ``optimizer.state_dict()``,
``opt_param_scheduler``, ``rng_state``; with the distributed optimizer also ``distrib_optim.pt`` beside it
(``save_parameter_state``, megatron-core's own). The same trained state is saved by ckptkit's live adapter: the
reference for what the import must hold.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from tests import megatron_convert_job as cjob
from tests import megatron_job as mjob
from tests import megatron_model as mm

STEPS = 2


def legacy_save(t: mm.Trainer, layout: mm.Layout, folder: str) -> None:
    """Megatron-LM's legacy checkpoint of the trainer's state at ``folder`` (the save root)."""
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_rank() == 0:
        tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        name = f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if layout.pp > 1 else "")
        path = os.path.join(folder, f"iter_{t.iteration:07d}", name, "model_optim_rng.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        state: dict[str, Any] = {"args": cjob.mlm_args(layout), "checkpoint_version": 3.0, "iteration": t.iteration,
                                 "optimizer": t.optimizer.state_dict(),
                                 "opt_param_scheduler": t.scheduler.state_dict(), "rng_state": [cjob._rng_state()],
                                 "num_floating_point_operations_so_far": 0}
        if len(t.model) == 1:
            state["model"] = t.model[0].state_dict_for_save_checkpoint()
        else:
            for i, chunk in enumerate(t.model):
                state[f"model{i}"] = chunk.state_dict_for_save_checkpoint()
        torch.save(state, path)
    if layout.dist_opt:  # Megatron-LM: every rank calls it; DP rank 0 of each (tp, pp) gathers and writes
        tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        name = f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if layout.pp > 1 else "")
        dist.barrier()
        t.optimizer.save_parameter_state(os.path.join(folder, f"iter_{t.iteration:07d}", name, "distrib_optim.pt"))
    if dist.get_rank() == 0:
        with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(t.iteration))
    dist.barrier()


def train_and_save(layout: mm.Layout, folder: str, *, steps: int) -> dict[str, Any]:
    """Train ``STEPS`` steps, save with Megatron-LM's legacy layout (``folder/legacy``) and with ckptkit's
    adapter (``folder/adapter``), then train on to ``steps``: the uninterrupted run's losses."""
    from ckptkit.adapters import megatron as mckpt

    t = mm.setup(layout)
    try:
        for _ in range(STEPS):
            mm.train_step(t)
        legacy_save(t, layout, os.path.join(folder, "legacy"))
        mckpt.save(t.model, os.path.join(folder, "adapter"), optimizer=t.optimizer, scheduler=t.scheduler,
                   iteration=t.iteration, options=mjob._options(layout.divisible_by), asynchronous=False)
        losses = {}
        while t.iteration < steps:
            step = t.iteration + 1
            losses[step] = mm.train_step(t)
        return {"losses": losses, "loss_scale": mjob.loss_scale(t)}
    finally:
        mm.teardown()
