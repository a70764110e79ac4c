"""Periodic Megatron checkpoints through :class:`ckptkit.CheckpointManager`.

Step folders named by iteration, retention and asynchronous saves come from
the manager; this class supplies the job's state and restores the newest
checkpoint every rank sees committed, at whatever layout the resuming job has::

    ckpt = MegatronCheckpointer(model, optimizer, scheduler, "s3://bucket/gpt", every_steps=500, keep_last=3,
                                options=MegatronOptions(vocab_size=50257))
    info = ckpt.restore_latest()            # None on a fresh start
    iteration = info.iteration if info else 0
    while ...:
        train_step(); iteration += 1
        ckpt.maybe_save(iteration, extra={"consumed_samples": consumed})
    ckpt.close()
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ckptkit
from ckptkit.engine.collective import agreed_state, resolve_comm
from ckptkit.options import AsyncOptions


class MegatronCheckpointer:
    def __init__(self, model: Any, optimizer: Any, scheduler: Any, root: str, *, every_steps: int | None = None,
                 keep_last: int | None = None, asynchronous: bool = True, options: Any = None,
                 async_options: AsyncOptions = AsyncOptions(), storage_options: dict[str, Any] | None = None) -> None:
        from ckptkit.adapters.megatron import MegatronOptions
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.options = options if options is not None else MegatronOptions()
        self.storage_options = storage_options
        self._comm = resolve_comm(None)  # the manager's ranks: the default group
        from ckptkit.adapters.megatron import _chunks
        from ckptkit.adapters.megatron.optimizer_state import guards

        overlap = asynchronous and async_options.snapshot == "overlap"
        self.manager = ckptkit.CheckpointManager(
            root, save=ckptkit.SavePolicy(every_steps=every_steps), keep=ckptkit.RetentionPolicy(keep_last=keep_last),
            asynchronous=async_options if asynchronous else None, storage_options=storage_options,
            guard=guards(optimizer, _chunks(model)) if overlap else None)

    def maybe_save(self, iteration: int, *, extra: Mapping[str, Any] | None = None) -> Any:
        """Save if ``every_steps`` says so at ``iteration``; the handle, or None."""
        if not self.manager.should_save(iteration):
            return None
        return self.save(iteration, extra=extra)

    def save(self, iteration: int, *, extra: Mapping[str, Any] | None = None) -> Any:
        """Save now (blocks only for the snapshot when asynchronous)."""
        from ckptkit.adapters.megatron import megatron_state

        state = agreed_state(self._comm, lambda: megatron_state(
            self.model, optimizer=self.optimizer, scheduler=self.scheduler, iteration=iteration, extra=extra,
            options=self.options), f"checkpoint of step {iteration}")
        return self.manager.save(iteration, state)

    def restore_latest(self) -> Any:
        """Load the newest step every rank sees committed and that loads; its MegatronLoadInfo, or None
        if there is none. A damaged step (checksums, missing objects) is skipped with a warning and
        the next older one loaded (``self.manager.skipped`` names them), as
        :meth:`ckptkit.CheckpointManager.restore_latest` does. A Megatron checkpoint (``iter_NNNNNNN``)
        newer than the newest ckptkit step in the same folder is refused
        (:func:`ckptkit.adapters.foreign_steps.resume_point`): resuming without it would go back in time; and so
        is a fallback past damaged steps to one older than such a Megatron checkpoint."""
        from ckptkit.adapters.foreign_steps import MEGATRON, restore_newest
        from ckptkit.adapters.megatron import load

        got = restore_newest(self.manager, MEGATRON, lambda url: load(
            self.model, url, optimizer=self.optimizer, scheduler=self.scheduler, storage_options=self.storage_options))
        return None if got is None else got[1]

    def wait(self) -> None:
        self.manager.wait()

    def close(self) -> None:
        """Wait for the last save; raise a background failure."""
        self.manager.close()
