"""What an imported Megatron optimizer needs beside its tensors: the live adapter's optimizer record.

The adapter (:mod:`ckptkit.adapters.megatron`) resumes an optimizer only from a checkpoint whose
``megatron/meta`` holds an ``optimizer`` record: which per-parameter states are stored
(``optimizer/<state>/<key>``), whether fp32 main copies are, and the scalar state. Without the scalar
state a resumed Adam would restart its bias correction at step 1 — its next updates several times too
large — so an import that found the moments but not the step would hand back something other than
what was saved. This module builds that record from what Megatron saved, and refuses when the
tensors it found do not make a whole optimizer.

Where Megatron keeps the step (megatron-core 0.14-0.16, read from ``megatron/core/optimizer``), in the
non-sharded part of the optimizer's state dict (``common.pt``):

* the distributed optimizer: in every param group, ``param_groups[i]["step"]``
  (``DistributedOptimizer.state_dict``: "Native PyTorch param group requires step");
* the plain optimizers: ``state["common_step"]`` (``_extract_common_per_param_step``: one step
  shared by all parameters), under ``optimizer`` for the fp16/bf16 wrapper;
* a ``ChainedOptimizer`` of several: one such dict per optimizer, keyed by position.

Each place found must agree: Megatron itself supports only one step for all parameters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from ckptkit.adapters.megatron.optimizer_state import MAIN  # the adapter's name for the main copies
from ckptkit.errors import ManifestError
from ckptkit_converters.common.optimizer_steps import is_step_count
from ckptkit.layout.values import json_ready


STATE_NAMES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "fp32_param": MAIN, "param": MAIN}
"""Megatron's model-space optimizer state names -> the adapter's. ``fp32_param``: the plain optimizers'
main copies (``optimizer.state.fp32_param.<key>``); ``param``: the distributed optimizer's in its
``fully_reshardable`` form (``optimizer.state.param.<key>``, the unflattened main-parameter buffer)."""


def number(value: Any, where: str) -> float:
    """A step or loss scale as Megatron saves it (a plain number, or torch's one-element tensor) as a float;
    refused naming ``where`` when it is anything else."""
    plain = value
    if isinstance(value, torch.Tensor):  # torch Adam keeps its step as a 0-dim tensor
        plain = value.item() if value.numel() == 1 else value
    if isinstance(plain, bool) or not isinstance(plain, (int, float)):
        raise ManifestError(f"{where}: an optimizer step or loss scale of type {type(value).__name__}, expected a number")
    return float(plain)


MAX_NESTING = 8
"""How deep the optimizer dicts Megatron saves go (a chained optimizer's entry, its ``optimizer``, the torch
optimizer's): a ``common.pt`` nesting deeper is not Megatron's, and walking it must not exhaust the stack."""


def _optimizer_dicts(optimizer: Any, where: str) -> Iterator[Mapping[Any, Any]]:
    """Every optimizer dict of the saved state, outermost first: the dict itself, a wrapper's torch optimizer
    (``optimizer``) and a chained optimizer's entries (keyed by position), depth first in their order. The one
    walk the step, param groups and loss scalers are read from; refused past :data:`MAX_NESTING` levels."""
    stack = [(optimizer, 0)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, Mapping):
            continue
        if depth > MAX_NESTING:
            raise ManifestError(f"{where}: the saved optimizer dict nests deeper than {MAX_NESTING} levels "
                                "(Megatron's goes 3 deep)")
        yield node
        inner = [v for k, v in node.items()
                 if k == "optimizer" or isinstance(k, int) or (isinstance(k, str) and (k.isascii() and k.isdigit()))]
        stack.extend((v, depth + 1) for v in reversed(inner))


def _steps(optimizer: Any, where: str) -> Iterator[float]:
    """Every step value the optimizer's saved (non-sharded) state dict holds, wherever Megatron put it."""
    for node in _optimizer_dicts(optimizer, where):
        for group in node.get("param_groups") or ():
            if isinstance(group, Mapping) and group.get("step") is not None:
                yield number(group["step"], where)
        state = node.get("state")
        if isinstance(state, Mapping) and state.get("common_step") is not None:
            yield number(state["common_step"], where)


def _grad_scalers(optimizer: Any, where: str) -> Iterator[dict[str, Any]]:
    """The loss scalers' states (fp16: ``DynamicGradScaler.state_dict``, under ``grad_scaler`` of each
    Megatron optimizer's state dict), as the adapter records them: the scale as a number."""
    for node in _optimizer_dicts(optimizer, where):
        scaler = node.get("grad_scaler")
        if not isinstance(scaler, Mapping) or not scaler:
            continue
        out = {}
        for k, v in scaler.items():
            if k not in ("scale", "growth_tracker", "hysteresis_tracker"):
                raise ManifestError(f"{where}: a loss scaler field {k!r}; Megatron's DynamicGradScaler has scale, "
                                    "growth_tracker and hysteresis_tracker")
            out[k] = number(v, where) if k == "scale" else int(number(v, where))
        if "scale" in out and not (math.isfinite(out["scale"]) and out["scale"] > 0):
            raise ManifestError(f"{where}: a loss scale of {out['scale']}; Megatron's DynamicGradScaler keeps a "
                                "finite positive scale")
        yield out


def _hyper_parameters(optimizer: Any, where: str) -> list[list[dict[str, Any]]]:
    """The param groups' hyper-parameters as the adapter records them (informational: the scheduler
    sets lr and weight decay on resume)."""
    out = []
    for node in _optimizer_dicts(optimizer, where):
        groups = node.get("param_groups")
        if isinstance(groups, list):
            out.append([{k: v for k, v in g.items() if k not in ("params", "step")
                         and isinstance(v, (int, float, str, bool, tuple, list, type(None)))}
                        for g in groups if isinstance(g, Mapping)])
    return json_ready(out, "the optimizer's param groups")


def optimizer_record(keys: Iterable[str], optimizer: Any, where: str) -> dict[str, Any] | None:
    """The adapter's ``optimizer`` record for the imported tensors' ckptkit ``keys`` (those under
    ``optimizer/<state>/`` count), with the step read from ``optimizer``, the saved state dict's
    non-sharded part. None when no optimizer tensor was imported.

    Refused, naming ``where``: a state that some parameters have and others lack (a partial optimizer
    would resume some parameters with fresh moments), and moments without any saved step."""
    by_state: dict[str, set[str]] = {}
    for key in keys:
        if key.startswith("optimizer/"):
            _, name, param = key.split("/", 2)
            by_state.setdefault(name, set()).add(param)
    if not by_state:
        return None
    every = set().union(*by_state.values())
    for name, params in sorted(by_state.items()):
        if params != every:
            lacking = sorted(every - params)
            raise ManifestError(f"{where}: optimizer state {name!r} is missing for {len(lacking)} parameter(s) the "
                                f"others have, e.g. {lacking[0]!r}: not a whole optimizer")
    steps = sorted(set(_steps(optimizer, where)))
    bad = [s for s in steps if not is_step_count(s)]
    if bad:  # Adam's step counts updates: another value would resume its bias correction wrong (NaN: every step)
        raise ManifestError(f"{where}: the saved optimizer's step {bad[0]} is not a count of steps (a finite "
                            "whole number >= 0): a damaged optimizer state")
    if len(steps) > 1:
        raise ManifestError(f"{where}: the saved optimizer holds different steps {steps[:4]}; Megatron keeps one "
                            "step for all parameters")
    tensor_states = sorted(n for n in by_state if n != MAIN)
    if tensor_states and not steps:
        raise ManifestError(f"{where}: optimizer moments {tensor_states} but no step (looked in the optimizer's "
                            "param_groups and its state's common_step): Adam cannot resume without it")
    scalars = {"step": {"dtype": "float32", "value": steps[0]}} if steps else {}
    return {"tensor_states": tensor_states, "main": MAIN in by_state, "scalars": scalars,
            "hyper_parameters": _hyper_parameters(optimizer, where), "grad_scalers": list(_grad_scalers(optimizer, where))}


def scheduler_record(common: Mapping[str, Any], where: str) -> dict[str, Any] | None:
    """Megatron-LM's ``opt_param_scheduler`` state (plain numbers and strings), as the adapter records
    its scheduler's ``state_dict``; None when the checkpoint has none."""
    state = common.get("opt_param_scheduler")
    return None if state is None else json_ready(state, f"{where}: opt_param_scheduler")
