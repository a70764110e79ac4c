"""The optimizer state of a legacy Megatron rank file (``model_optim_rng.pt``'s ``optimizer``), by parameter.

Megatron-LM's legacy save (``--ckpt-format torch``) keeps ``optimizer.state_dict()`` beside each (tp, pp)
rank's module state dicts. For the mixed-precision optimizer (``Float16OptimizerWithFloat16Params``: bf16 or
fp16 training without ``--use-distributed-optimizer``; megatron-core 0.16, which wrote the tested files) that is::

    {"optimizer": torch Adam's state dict, "fp32_from_fp16_params": the main copies, by param group,
     "grad_scaler": fp16's loss scaler (absent for bf16)}

torch's state dict numbers parameters; it does not name them. Group g's j-th parameter is
``param_groups[g]["params"][j]``, and Megatron builds the groups (``_get_param_groups``) from the model
chunks' parameters in module order, split by weight decay: biases and 1-D tensors get ``wd_mult`` 0,
except q/k layernorms under ``--apply-wd-to-qk-layernorm``. So the order is predicted from the rank file's
own module state dicts (their parameter entries are in ``named_parameters`` order) and then checked
against the data, which Megatron's own legacy load does not do:

* each group holds as many parameters as predicted, each index once;
* each moment and main copy is float32 with its parameter's shape;
* each main copy cast to the weight's dtype *is* the weight, bit for bit (Megatron copies main -> model
  after every step).

A prediction the data contradicts is refused, naming the rank file, the group and the parameter: moments
are never handed to another parameter. (Weights of one shape and one value in one group, such as untrained
norms, are told apart by the order alone, as Megatron's own load tells them apart.)

The distributed optimizer's ``distrib_optim.pt`` is read by :mod:`.legacy_distrib`. Not imported, and listed
as skipped by the import: the fp32 optimizer (``FP32Optimizer``: no main copies, so nothing to check the order
against) and a chained optimizer of several (MoE expert groups). Param groups other than Megatron's standard
weight-decay split (``lr_mult``, decoupled learning rates, expert groups) are refused: pass
``weights_only=True`` to import the weights alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ckptkit.errors import ManifestError
from ckptkit_converters.common.safe_unpickle import namespace_fields
from ckptkit_converters.megatron import legacy_distrib
from ckptkit_converters.megatron.legacy_state import (
    RANK_FILE,
    WEIGHTS_ONLY_HINT,
    FoundOptimizer,
    LegacyOptimizer,
    StateRef,
    number,
    parameters,
    same_bits,
)
from ckptkit_converters.megatron.optimizer_record import MAIN

DISTRIBUTED = "distributed"
MIXED = "mixed"


def _no_weight_decay(name: str, t: torch.Tensor, wd_on_qk_norms: bool) -> bool:
    """Megatron's standard weight-decay skip (``get_standard_config_overrides``)."""
    skip = name.endswith(".bias") or t.dim() == 1
    if wd_on_qk_norms and ("q_layernorm." in name or "k_layernorm." in name):
        return False
    return skip


def _form(saved: Any, where: str) -> str:
    """:data:`MIXED` or :data:`DISTRIBUTED` (the forms imported), or why a saved optimizer is not imported,
    the same words for every rank file; refused when it is not an optimizer state dict at all."""
    if isinstance(saved, list):
        return f"optimizer: a chained optimizer of {len(saved)} (MoE expert groups) is not imported; the weights are"
    if not isinstance(saved, Mapping):
        raise ManifestError(f"{where}: 'optimizer' is a {type(saved).__name__}, expected Megatron's optimizer "
                            "state dict")
    if "fp32_from_fp16_params" in saved:
        return MIXED
    inner = saved.get("optimizer")
    if isinstance(inner, Mapping) and "param_groups" in inner and "state" not in inner:
        return DISTRIBUTED
    if "state" in saved and "param_groups" in saved:
        return ("optimizer: the fp32 optimizer's state (no main copies to check which parameter each moment "
                "belongs to) is not imported; the weights are")
    raise ManifestError(f"{where}: 'optimizer' holds {sorted(map(str, saved))[:6]}: not a Megatron optimizer "
                        f"state dict; {WEIGHTS_ONLY_HINT}")


def _groups(inner: Any, mains: Any, where: str) -> list[Mapping[str, Any]]:
    if not isinstance(inner, Mapping) or not isinstance(inner.get("param_groups"), list) \
            or not isinstance(inner.get("state"), Mapping):
        raise ManifestError(f"{where}: optimizer.optimizer is not torch's optimizer state dict "
                            "(state, param_groups)")
    groups = inner["param_groups"]
    if not isinstance(mains, list) or len(mains) != len(groups):
        raise ManifestError(f"{where}: optimizer.fp32_from_fp16_params holds "
                            f"{len(mains) if isinstance(mains, list) else type(mains).__name__} group(s), "
                            f"the optimizer {len(groups)}")
    for g, group in enumerate(groups):
        if not isinstance(group, Mapping) or not isinstance(group.get("params"), list) \
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in group["params"]):
            raise ManifestError(f"{where}: optimizer param group {g} has no list of parameter indices")
        odd = {k: group.get(k) for k in ("lr_mult", "is_decoupled_lr", "is_expert_parallel")
               if group.get(k) not in (None, 1.0, False)}
        if odd or group.get("wd_mult") not in (0.0, 1.0):
            raise ManifestError(f"{where}: optimizer param group {g} ({odd or {'wd_mult': group.get('wd_mult')}}) "
                                "is not one of Megatron's standard weight-decay groups; " + WEIGHTS_ONLY_HINT)
        if not isinstance(mains[g], list) or len(mains[g]) != len(group["params"]):
            raise ManifestError(f"{where}: optimizer param group {g} has {len(group['params'])} parameter(s), "
                                "its main copies do not match")
    wd = [g.get("wd_mult") for g in groups]
    if len(set(wd)) != len(wd):  # two groups of one kind: which parameter is in which is not Megatron's split
        raise ManifestError(f"{where}: optimizer param groups with wd_mult {wd}: not Megatron's standard "
                            "weight-decay groups; " + WEIGHTS_ONLY_HINT)
    return groups


def _state_tensor(t: Any, weight: torch.Tensor, what: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != tuple(weight.shape):
        got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ManifestError(f"{what} is {got}, expected float32 {list(weight.shape)} (its parameter's shape)")


def _place(groups: Sequence[Mapping[str, Any]], state: Mapping[Any, Any], mains: Sequence[Any],
           params: Sequence[tuple[int, str, torch.Tensor]], wd_on_qk_norms: bool,
           where: str) -> tuple[dict[tuple[int, str], dict[str, StateRef]], set[float]]:
    """Every parameter's state tensors, checked; and the steps found (Adam's per-parameter ``step``, or a
    param group's for fused Adams that keep it there)."""
    out: dict[tuple[int, str], dict[str, StateRef]] = {}
    steps: set[float] = set()
    seen: set[int] = set()
    placed = 0
    for g, group in enumerate(groups):
        no_wd = group.get("wd_mult") == 0.0
        members = [p for p in params if _no_weight_decay(p[1], p[2], wd_on_qk_norms) == no_wd]
        if len(members) != len(group["params"]):
            raise ManifestError(
                f"{where}: optimizer param group {g} (wd_mult {group.get('wd_mult')}) holds {len(group['params'])} "
                f"parameter(s), the rank's modules {len(members)} of that kind (frozen parameters or custom "
                f"param groups?); {WEIGHTS_ONLY_HINT}")
        if number(group.get("step")) is not None:
            steps.add(number(group["step"]))  # type: ignore[arg-type]
        for j, (v, name, weight) in enumerate(members):
            idx = group["params"][j]
            what = f"{where}: optimizer state of {name!r} (param group {g}, index {idx})"
            if idx in seen:
                raise ManifestError(f"{what}: index {idx} is listed twice")
            seen.add(idx)
            st = state.get(idx)
            if not isinstance(st, Mapping):
                raise ManifestError(f"{what}: no state saved for this index")
            for moment in ("exp_avg", "exp_avg_sq"):
                _state_tensor(st.get(moment), weight, f"{what}: {moment}")
            main = mains[g][j]
            _state_tensor(main, weight, f"{what}: its main copy")
            if weight.dtype not in (torch.bfloat16, torch.float16):
                raise ManifestError(f"{what}: the weight is {weight.dtype}; the mixed-precision optimizer keeps "
                                    "main copies of bf16/fp16 weights only")
            if not same_bits(main.to(weight.dtype), weight):
                raise ManifestError(f"{what}: its main copy is not the weight (cast to {weight.dtype}): the "
                                    "optimizer's parameter order is not this module's; " + WEIGHTS_ONLY_HINT)
            if "step" in st:
                if number(st["step"]) is None:
                    raise ManifestError(f"{what}: step is a {type(st['step']).__name__}, expected a number")
                steps.add(number(st["step"]))  # type: ignore[arg-type]
            out[(v, name)] = {m: StateRef(RANK_FILE, ("optimizer", "optimizer", "state", idx, m))
                              for m in ("exp_avg", "exp_avg_sq")}
            out[(v, name)][MAIN] = StateRef(RANK_FILE, ("optimizer", "fp32_from_fp16_params", g, j))
        placed += len(members)
    if placed != len(params):
        left = [p[1] for p in params if (p[0], p[1]) not in out]
        raise ManifestError(f"{where}: {len(left)} parameter(s) in no optimizer param group, e.g. {left[0]!r}; "
                            + WEIGHTS_ONLY_HINT)
    return out, steps


def read_optimizer(state: Mapping[str, Any], chunks: Mapping[int, Mapping[str, Any]], where: str,
                   distrib: str | None) -> FoundOptimizer:
    """The optimizer a legacy rank file holds (``state``: the whole file, ``chunks``: its module state dicts
    by virtual chunk; ``distrib``: the ``distrib_optim.pt`` beside it, None if there is none), placed and
    checked as this module's docstring (or :mod:`.legacy_distrib`'s) says; refused naming ``where``."""
    saved = state.get("optimizer")
    if saved is None:
        return FoundOptimizer()
    form = _form(saved, where)
    if form == DISTRIBUTED:
        if distrib is None:
            raise ManifestError(f"{where}: a distributed optimizer's rank file without the {legacy_distrib.DISTRIB_FILE} "
                                f"beside it, which holds its state; {WEIGHTS_ONLY_HINT}")
        return FoundOptimizer(legacy_distrib.read_distributed(saved, chunks, distrib, where))
    if form != MIXED:
        return FoundOptimizer(skipped=form)
    inner, mains = saved.get("optimizer"), saved["fp32_from_fp16_params"]
    groups = _groups(inner, mains, where)
    wd_on_qk_norms = namespace_fields(state.get("args")).get("apply_wd_to_qk_layernorm") is True
    tensors, steps = _place(groups, inner["state"], mains, parameters(chunks), wd_on_qk_norms, where)
    if len(steps) != 1:
        raise ManifestError(f"{where}: the optimizer holds {'no step' if not steps else f'steps {sorted(steps)[:4]}'}; "
                            "Megatron keeps one step for all parameters")
    step = steps.pop()
    record = {"state": {"common_step": step},
              "param_groups": [{k: v for k, v in g.items() if k not in ("params", "step")} for g in groups]}
    if saved.get("grad_scaler") is not None:
        record["grad_scaler"] = saved["grad_scaler"]
    return FoundOptimizer(LegacyOptimizer(tensors, record, step))
