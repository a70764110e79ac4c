"""Optimizer states made the checkpoint's kinds before a load fills them, and put back when it fails.

The DeepSpeed and Megatron adapters load moments straight into the optimizer's own state tensors, so
each parameter's state is first made exactly the checkpoint's kinds (a rollback to a checkpoint saved
before the first step must not keep the live moments and step count). Two things follow:

* A load refused before any byte lands (a damaged index, a digest, a dtype) must leave the job as it
  was: ``restore_latest`` then returns None, "the state is as passed in", or falls back to an older
  step. Until 2026-12-06 the primed state stayed: the moments zeroed and the step counts the refused
  checkpoint's, and the next steps differed from a fresh start (found by a hunt, both adapters).
  :meth:`PrimedStates.undo` puts every primed dict back as it was.
* The live tensors are reused where they fit (same shape, dtype, device): DeepSpeed's fragment
  mappings (``safe_get_full_optimizer_state``) and anything else holding them keep seeing the state
  the optimizer steps with; fresh tensors in their place left those reading the pre-load moments.
  Reuse also keeps the load's memory at one copy of the moments.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch


def _fits(tensor: Any, like: torch.Tensor) -> bool:
    return (isinstance(tensor, torch.Tensor) and tensor is not like and tensor.shape == like.shape
            and tensor.dtype == like.dtype and tensor.device == like.device and tensor.layout == like.layout)


class PrimedStates:
    """The optimizer state dicts one load primed, with what each held before."""

    def __init__(self) -> None:
        self._kept: list[tuple[dict[str, Any], dict[str, Any]]] = []

    def prime(self, st: dict[str, Any], like: torch.Tensor, tensor_keys: Iterable[str],
              scalars: Mapping[str, Any]) -> dict[str, Any]:
        """Make ``st`` hold exactly ``tensor_keys`` (each shaped like ``like``: the live tensor where it
        fits, else zeros for the load to fill) and ``scalars``; remember what it held."""
        old = dict(st)
        self._kept.append((st, old))
        st.clear()
        for key in tensor_keys:
            live = old.get(key)
            st[key] = live if _fits(live, like) else torch.zeros_like(like, memory_format=torch.preserve_format)
        st.update(scalars)
        return st

    def undo(self) -> None:
        """Every primed dict as it was (its tensors the same objects: a load refused before any byte landed
        left them untouched; one that failed later raised that the state was partly overwritten)."""
        for st, old in reversed(self._kept):
            st.clear()
            st.update(old)
        self._kept.clear()
