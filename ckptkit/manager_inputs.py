"""What :class:`ckptkit.CheckpointManager` accepts as a step, a step bound and a metric, checked before
anything is written: a wrong type there is a mistake in the calling code that used to commit a
checkpoint no restore would return, or restore the wrong step, without a word."""

from __future__ import annotations

import operator
from typing import Any

import torch

from ckptkit.errors import OptionsError
from ckptkit.run_folder import MAX_STEP


def step_bound(value: Any, what: str, where: str) -> int:
    """A step or a step bound (``at_most``, ``discard_after``) as a plain int: a bool or a string there
    is a mistake in the calling code (``at_most=True`` restored nothing newer than step 1, without a word)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise OptionsError(f"{where}: {what}={value!r} ({type(value).__name__}) is not a step: pass an integer")


def checked_step(step: Any, where: str) -> int:
    """``step`` as a plain int, or OptionsError naming it: a restore looks only at steps in
    [0, 2**62] (the bound of every integer in a checkpoint), so a save of any other step used to
    commit a checkpoint that no restore would ever return, and resume from an older one, or from
    scratch, without a word. numpy integers are steps; bools, floats and strings are not."""
    value = step_bound(step, "step", where)
    if not 0 <= value <= MAX_STEP:
        raise OptionsError(f"{where}: step {step!r} ({type(step).__name__}) is not a step: a step is an "
                           f"integer from 0 to 2**62")
    return value


def metric_values(metrics: dict[str, Any] | None, where: str) -> dict[str, Any]:
    """``metrics`` with a one-element tensor (a loss) or a numpy scalar taken as its Python number:
    they failed the save as values its metadata cannot hold. A tensor of more elements is refused
    naming the metric, before the save starts; other values are kept as given (JSON-like ones)."""
    out: dict[str, Any] = {}
    for name, value in dict(metrics or {}).items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1 or value.is_complex():
                raise OptionsError(f"{where}: metric {name!r} is a tensor of shape {list(value.shape)}; "
                                   "a metric is one number (a one-element tensor is taken as its number)")
            value = value.detach().item()
        elif type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
            value = value.item()
        out[name] = value
    return out
