"""Rank functions for tests/test_megatron_legacy_optimizer.py: Megatron-LM's legacy save with its optimizer.

``megatron.training`` is not installed, so its legacy save (``--ckpt-format torch``, ``save_checkpoint`` ->
``generate_state_dict``) is reproduced (tests/megatron_convert_job.py ``legacy_save``, the suite's one legacy
writer): data-parallel rank 0 of every (tp, pp) writes
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

from tests import megatron_convert_job as cjob
from tests import megatron_job as mjob
from tests import megatron_model as mm

STEPS = 2


def train_and_save(layout: mm.Layout, folder: str, *, steps: int) -> dict[str, Any]:
    """Train ``STEPS`` steps, save with Megatron-LM's legacy layout (``folder/legacy``) and with ckptkit's
    adapter (``folder/adapter``), then train on to ``steps``: the uninterrupted run's losses."""
    from ckptkit.adapters import megatron as mckpt

    t = mm.setup(layout)
    try:
        for _ in range(STEPS):
            mm.train_step(t)
        cjob.legacy_save(t, layout, os.path.join(folder, "legacy"))
        mckpt.save(t.model, os.path.join(folder, "adapter"), optimizer=t.optimizer, scheduler=t.scheduler,
                   iteration=t.iteration, options=mjob._options(layout.divisible_by), asynchronous=False)
        losses = {}
        while t.iteration < steps:
            step = t.iteration + 1
            losses[step] = mm.train_step(t)
        return {"losses": losses, "loss_scale": mjob.loss_scale(t)}
    finally:
        mm.teardown()
