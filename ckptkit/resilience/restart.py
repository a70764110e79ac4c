"""Process-group setup that survives torchrun restarts.

Under ``torchrun --max-restarts`` the elastic agent keeps one key-value store
for the whole job, and a restarted attempt's ``init_process_group`` can read
the previous attempt's peer addresses from it before the new peers have
overwritten them; with gloo this showed up here (torch 2.13) as
``connectFullMesh ... Connection refused`` and a job that never came back.
:func:`init_process_group` namespaces the store by attempt
(``TORCHELASTIC_RESTART_COUNT``), so no key can be stale. Outside torchrun it
is plain ``torch.distributed.init_process_group``.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def init_process_group(backend: str = "gloo", timeout: timedelta | None = None, **kwargs: Any) -> None:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "store" in kwargs or "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, timeout=timeout, **kwargs)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                         timeout=timeout or timedelta(minutes=10))
    store = dist.PrefixStore(f"/ckptkit/attempt-{attempt}", base)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
