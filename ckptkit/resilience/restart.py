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
"""

from __future__ import annotations

from ckptkit.engine.collective import init_process_group

__all__ = ["init_process_group"]
