"""The optimizer in a torch_dist export: what Megatron's own load resumes Adam from.

A Megatron-LM job loads the distributed optimizer (``--use-distributed-optimizer``, what Megatron
runs are trained with) from a torch_dist directory in one of its sharding types. The export writes
``fully_reshardable``, the one Megatron loads at *any* tp/pp/dp (megatron-core 0.14-0.16,
``DistributedOptimizer.sharded_param_state_fully_reshardable`` and its load counterpart):

* per model tensor ``<key>``, the tensors ``optimizer.state.param.<key>`` (the fp32 main copy) and
  ``optimizer.state.<state>.<key>`` for each Adam state (``exp_avg``, ``exp_avg_sq``), each shaped and
  split over the ranks exactly as the model tensor, vocabulary padding rows included (Megatron
  flattens and slices them per rank on load);
* in ``common.pt`` under ``optimizer``: ``{"optimizer": {"param_groups": [...]},
  "param_state_sharding_type": "fully_reshardable"}`` (and ``grad_scaler`` in fp16), one such dict
  per optimizer keyed by position for a ``ChainedOptimizer`` of several (an MoE job's dense and
  expert optimizers). The param groups carry the hyper-parameters Megatron matches its own groups
  by (``wd_mult``, ``lr_mult``, ``is_expert_parallel``, ``is_decoupled_lr``) and the Adam step,
  which the distributed optimizer keeps in its param groups;
* ``content_metadata`` naming that sharding type (what Megatron-LM's ``save_checkpoint`` records and
  its ``load_checkpoint`` reads to build the state dict it loads).

``optimizer="plain"`` writes what Megatron's plain (non-distributed) optimizers save instead, for a job
run without ``--use-distributed-optimizer``: the same ``optimizer.state.<state>.<key>`` moments, the
main copies as ``optimizer.state.fp32_param.<key>``, and in ``common.pt`` the param groups with the
shared step as ``state.common_step`` (``MegatronOptimizer._extract_common_per_param_step``), wrapped
as the fp16/bf16 optimizer's ``{"optimizer": ..., "grad_scaler": ...}`` when the checkpoint holds
main copies and as the fp32 optimizer's bare torch dict when it does not. A chained optimizer (an MoE
job's dense and expert parts) gets one such entry per optimizer, keyed by position.

Everything comes from the adapter's ``optimizer`` record in ``megatron/meta`` (or an import's, which
builds the same record) and the checkpoint's ``optimizer/<state>/<key>`` tensors. A record that
cannot make a whole optimizer (no step, no param groups, a scalar state Megatron has no place for, a
state some tensors lack) is refused, naming the checkpoint and what is missing, rather than written
as an optimizer that would resume wrong; ``weights_only`` exports the model alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ckptkit.adapters.megatron.optimizer_state import MAIN, scaler_state_dict
from ckptkit.errors import LayoutError, ManifestError

SHARDING_TYPE = "fully_reshardable"
IDENTIFIER_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
"""What Megatron's ``DistributedOptimizer.load_state_dict`` matches a saved param group to its own by
(``param_group_identifier_keys``; NeMo's ``pre_`` names accepted as Megatron accepts them)."""

CONTENT_METADATA = {"distrib_optim_sharding_type": SHARDING_TYPE, "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True}
"""Megatron-LM's ``_build_sharded_state_dict_metadata`` for this export: the sharding type written, and the
key scheme (no ``chained_<i>.`` prefix on the tensors of a chained optimizer's parts)."""

_STATE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def checked(record: Any, where: str) -> Mapping[str, Any]:
    """The ``optimizer`` record of ``megatron/meta``, refused unless its shape is what the adapter and the
    importer write: an object whose ``tensor_states`` are state names (``exp_avg``...: they become parts of
    Megatron's keys, so no dots, slashes or Megatron's own ``param`` / ``step``) and whose ``main`` is a bool."""
    if not isinstance(record, Mapping):
        raise ManifestError(f"{where}: the optimizer record is {type(record).__name__}, expected an object")
    states = record.get("tensor_states")
    if not isinstance(states, list) or not all(isinstance(n, str) and _STATE_NAME.match(n) and n not in
                                                ("param", "step", MAIN) for n in states) or len(set(states)) != len(states):
        raise ManifestError(f"{where}: the optimizer record's tensor_states are {states!r}, expected distinct "
                            "state names such as 'exp_avg'")
    if not isinstance(record.get("main"), bool):
        raise ManifestError(f"{where}: the optimizer record's main is {record.get('main')!r}, expected true or false")
    return record


def state_sources(record: Mapping[str, Any], model_keys: Mapping[str, str], tensors: Mapping[str, Any],
                  where: str, form: str = "distributed") -> dict[str, str]:
    """Megatron's optimizer tensor key -> the ckptkit tensor it is read from, for every model tensor the
    optimizer holds state for.

    The main copy is ``optimizer/main/<key>``, written as ``param`` (distributed) or ``fp32_param``
    (``form="plain"``); a checkpoint without main copies (fp32 training, where
    Megatron's main copies are the weights themselves) gives the weights, cast to fp32 when written.
    A model tensor with no optimizer tensor at all is not a trained parameter (a buffer such as the
    router's ``expert_bias``, which Megatron's optimizer does not hold either): skipped. One with some
    of the record's states and not others is refused: Megatron would resume it with fresh moments."""
    out = {}
    states = list(checked(record, where)["tensor_states"])
    names = states + ([MAIN] if record["main"] else [])
    main_name = "fp32_param" if form == "plain" else "param"
    for mkey, ckey in sorted(model_keys.items()):
        held = [name for name in names if f"optimizer/{name}/{mkey}" in tensors]
        if not held:
            continue
        if held != names:
            lacking = [name for name in names if name not in held]
            raise ManifestError(f"{where}: {mkey!r} has optimizer state {held} but not {lacking} "
                                f"('optimizer/{lacking[0]}/{mkey}' is not in the checkpoint): not a whole optimizer")
        for name in states:
            out[f"optimizer.state.{name}.{mkey}"] = f"optimizer/{name}/{mkey}"
        out[f"optimizer.state.{main_name}.{mkey}"] = f"optimizer/{MAIN}/{mkey}" if record["main"] else ckey
    if not out:
        raise ManifestError(f"{where}: the optimizer record lists {names} but the checkpoint holds no optimizer "
                            "tensor for any model tensor (export with weights_only=True for the model alone)")
    return out


def _number(value: Any, what: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value in (float("inf"), float("-inf")):
        raise ManifestError(f"{where}: the optimizer record's {what} is {value!r}, expected a finite number")
    return float(value)


def _group(group: Any, step: float, where: str) -> dict[str, Any]:
    if not isinstance(group, Mapping) or not all(isinstance(k, str) for k in group):
        raise ManifestError(f"{where}: a saved param group is {type(group).__name__}, expected an object of "
                            "hyper-parameters")
    for key in IDENTIFIER_KEYS:
        if key not in group and f"pre_{key}" not in group:
            raise ManifestError(f"{where}: a saved param group lacks {key!r}, which Megatron matches its own "
                                f"groups by ({', '.join(IDENTIFIER_KEYS)}); the group has {sorted(group)}")
    for k, v in group.items():
        if not isinstance(v, (int, float, str, bool, type(None))) and not (
                isinstance(v, list) and all(isinstance(x, (int, float, bool)) for x in v)):
            raise ManifestError(f"{where}: param group hyper-parameter {k!r} is {v!r}, expected a number, string, "
                                "bool, null or a list of numbers")
    # JSON keeps tuples (Adam's betas) as lists; torch's param groups hold tuples.
    out = {k: tuple(v) if isinstance(v, list) else v for k, v in group.items() if k not in ("params", "step")}
    out["step"] = step
    return out


def _grad_scaler(state: Any, where: str) -> dict[str, Any]:
    """The recorded loss scaler as Megatron's ``DynamicGradScaler.state_dict`` (the adapter's own
    conversion, :func:`~ckptkit.adapters.megatron.optimizer_state.scaler_state_dict`), once every field is
    checked."""
    if not isinstance(state, Mapping) or "scale" not in state:
        raise ManifestError(f"{where}: a loss scaler record {state!r}, expected scale, growth_tracker and "
                            "hysteresis_tracker")
    trackers = {k: int(_number(state.get(k, 0), f"loss scaler {k}", where)) for k in ("growth_tracker", "hysteresis_tracker")}
    return scaler_state_dict({"scale": _number(state["scale"], "loss scale", where), **trackers})


def check_optimizer_count(record: Mapping[str, Any], experts: bool, ep: int, where: str) -> None:
    """Refuse, before anything is written, an export whose target builds another number of Megatron
    optimizers than the saving job did: an MoE job at ep > 1 keeps its expert parameters in a second
    optimizer (a ``ChainedOptimizer`` of two), at ep 1 they join the dense one. ``common.pt`` holds one
    param-group entry per optimizer, and Megatron's load refused the other count with ``KeyError:
    'optimizer'`` or "Expected 2 entries" after the export had reported success (a hunt, 2026-12-06)."""
    saved = record.get("hyper_parameters") if isinstance(record, Mapping) else None
    if not experts or not isinstance(saved, list):
        return  # a dense model's optimizers do not depend on ep; optimizer_common names a bad record
    want = 2 if ep > 1 else 1
    if len(saved) != want:
        raise LayoutError(
            f"{where}: the optimizer state was saved by {len(saved)} Megatron optimizer(s) (an MoE job at "
            f"{'ep > 1' if len(saved) > 1 else 'ep 1'}), and a Megatron job at ep {ep} builds {want}: its param "
            "groups cannot be written for that job. Export with weights_only=True, or at an ep on the same side "
            "of 1 as the saving job's")


def optimizer_common(record: Mapping[str, Any], where: str, form: str = "distributed") -> dict[Any, Any]:
    """``common.pt``'s ``optimizer`` entry: each Megatron optimizer's param groups with the step, the
    sharding type, and the loss scaler's state where the job had one (fp16); for ``form="plain"``,
    :func:`_plain_common`. Every field is checked (types included): the record is JSON from a
    checkpoint folder, which may be hostile."""
    scalars = checked(record, where).get("scalars")
    if not isinstance(scalars, Mapping):
        raise ManifestError(f"{where}: the optimizer record's scalars are {scalars!r}, expected an object")
    scalars = dict(scalars)
    step = scalars.pop("step", None)
    if not isinstance(step, Mapping) or "value" not in step:
        raise ManifestError(f"{where}: the optimizer record holds no step; Megatron's Adam cannot resume without "
                            "it (export with weights_only=True for the model alone)")
    if scalars:
        raise ManifestError(f"{where}: optimizer scalar state {sorted(scalars)} besides the step; Megatron's "
                            "distributed optimizer keeps only the step (export with weights_only=True)")
    value = _number(step["value"], "step", where)
    optimizers = record.get("hyper_parameters")
    if not isinstance(optimizers, list) or not optimizers or \
            not all(isinstance(groups, list) and groups for groups in optimizers):
        raise ManifestError(f"{where}: the optimizer record holds no param groups (a checkpoint from before "
                            "ckptkit recorded them); Megatron's load matches its groups against them (export "
                            "with weights_only=True for the model alone)")
    scalers = record.get("grad_scalers") or []
    if not isinstance(scalers, list):
        raise ManifestError(f"{where}: the optimizer record's loss scalers are {scalers!r}, expected a list")
    if form == "plain":
        return _plain_common(record, optimizers, value, scalers, where)
    out = []
    for i, groups in enumerate(optimizers):
        entry: dict[str, Any] = {"optimizer": {"param_groups": [_group(g, value, where) for g in groups]},
                                 "param_state_sharding_type": SHARDING_TYPE}
        scaler = scalers[i] if i < len(scalers) else None
        if scaler:
            entry["grad_scaler"] = _grad_scaler(scaler, where)
        out.append(entry)
    return out[0] if len(out) == 1 else dict(enumerate(out))


def _plain_common(record: Mapping[str, Any], optimizers: list[Any], step: float, scalers: list[Any],
                  where: str) -> Any:
    """The plain optimizers' ``common.pt`` entry: per optimizer, torch's param groups (no ``params``:
    Megatron's load takes its own job's) and the shared step as ``state.common_step``, a tensor as torch's
    Adam keeps it; inside the fp16/bf16 optimizer's wrapper (with its loss scaler) when the checkpoint
    holds main copies, bare (Megatron's fp32 optimizer) when it does not. A ``ChainedOptimizer`` of
    several (an MoE job's dense and expert optimizers) gets one such entry per optimizer, keyed by
    position, as ``ChainedOptimizer.load_state_dict`` reads them."""
    import torch

    common_step = torch.tensor(step)  # float32, as torch's Adam keeps its step
    if not bool(torch.isfinite(common_step)):
        raise ManifestError(f"{where}: the optimizer step {step!r} does not fit the float32 step tensor Megatron's "
                            "plain optimizers keep")
    entries = []
    for i, optimizer_groups in enumerate(optimizers):
        groups = []
        for group in optimizer_groups:
            entry = _group(group, step, where)
            del entry["step"]  # the plain optimizers keep it in state.common_step
            groups.append(entry)
        inner = {"param_groups": groups, "state": {"common_step": common_step.clone()}}
        scaler = _grad_scaler(scalers[i], where) if i < len(scalers) and scalers[i] else None
        if not record["main"]:
            if scaler is not None:  # only the mixed-precision wrapper has a place for it
                raise ManifestError(f"{where}: the optimizer record holds a loss scaler but no main copies; "
                                    "Megatron's plain fp32 optimizer keeps no loss scaler and its fp16 one keeps "
                                    "main copies")
            entries.append(inner)
        else:
            entries.append({"optimizer": inner, **({"grad_scaler": scaler} if scaler is not None else {})})
    return entries[0] if len(entries) == 1 else dict(enumerate(entries))
