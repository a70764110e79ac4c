"""What a legacy Megatron rank file's optimizer becomes: its state tensors by parameter, and the rest.

Shared by the two forms the import reads: the mixed-precision optimizer's state inside
``model_optim_rng.pt`` (:mod:`.legacy_optimizer`) and the distributed optimizer's ``distrib_optim.pt``
beside it (:mod:`.legacy_distrib`). Both number or lay out parameters rather than name them, so both
need the rank file's parameters in Megatron's order, and both check what they place against the weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptkit.errors import ManifestError
from ckptkit_converters.megatron import names, optimizer_record

KeyPath = tuple[Any, ...]
"""Where a tensor lies in a loaded ``.pt`` dict: the keys (and list positions) to follow from the top."""

WEIGHTS_ONLY_HINT = "pass weights_only=True (CLI: --opt weights_only=true) to import the weights alone"

RANK_FILE = "model_optim_rng.pt"
DISTRIB_FILE = "distrib_optim.pt"


@dataclass(frozen=True)
class StateRef:
    """Where one parameter's state tensor lies: in the rank folder's ``file`` at ``path``; with ``start``,
    the elements ``[start, start + numel)`` of that flat tensor, shaped as the parameter."""

    file: str
    path: KeyPath
    start: int | None = None


@dataclass(frozen=True)
class LegacyOptimizer:
    """One rank file's optimizer, placed: every state tensor by its parameter, and the non-tensor state."""

    tensors: Mapping[tuple[int, str], Mapping[str, StateRef]]
    """(virtual chunk, module state-dict name) -> the adapter's state name (``exp_avg``, ``exp_avg_sq``,
    ``main``) -> where that state tensor lies."""
    saved: Mapping[str, Any]
    """The non-tensor state as :func:`~.optimizer_record.optimizer_record` reads it: the param groups'
    hyper-parameters, the one step and fp16's ``grad_scaler``."""
    step: float


@dataclass(frozen=True)
class FoundOptimizer:
    """What a rank file says of its optimizer: placed, not saved (both None), or saved in a form that is
    not imported (``skipped``: why, the same words for every rank file, for the import's skipped list)."""

    optimizer: LegacyOptimizer | None = None
    skipped: str | None = None


def parameters(chunks: Mapping[int, Mapping[str, Any]]) -> list[tuple[int, str, torch.Tensor]]:
    """The model chunks' parameters in Megatron's order: chunk by chunk, each in module order (buffers,
    ``_extra_state`` and non-tensors left out)."""
    out = []
    for v in sorted(chunks):
        for name, t in chunks[v].items():
            if (isinstance(t, torch.Tensor) and names.legacy_key(name) is not None
                    and not name.endswith(names.BUFFERS)):
                out.append((v, name, t))
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def number(v: Any) -> float | None:
    """A step as :func:`~.optimizer_record.number` reads it (torch's Adam keeps its step as a 0-dim tensor);
    None if it is not a number."""
    try:
        return optimizer_record.number(v, "")
    except ManifestError:
        return None
