"""Process-group setup that survives torchrun restarts.

Under ``torchrun --max-restarts`` the elastic agent keeps one key-value store
for the whole job, and a restarted attempt's ``init_process_group`` can read
the previous attempt's peer addresses from it before the new peers have
overwritten them; with gloo this showed up here (torch 2.13) as
``connectFullMesh ... Connection refused`` and a job that never came back.
:func:`init_process_group` namespaces the store by attempt
(``TORCHELASTIC_RESTART_COUNT``), so no key can be stale. Outside torchrun it
is plain ``torch.distributed.init_process_group``. It lives in the engine
(:mod:`ckptkit.engine.collective`), where the offline tools' torchrun runs use it too.

:func:`destroy_process_group` is its pair at the end of a job: the world destroyed, then a moment
for gloo's worker threads to let go of their last tensors while the interpreter still runs (without
it a job can abort at exit after finishing its work; see its docstring).
"""

from __future__ import annotations

from ckptkit.engine.collective import destroy_process_group, init_process_group

__all__ = ["destroy_process_group", "init_process_group"]
