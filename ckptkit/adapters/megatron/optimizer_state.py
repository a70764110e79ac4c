"""Megatron-core optimizer state <-> ckptkit pieces, without gathering anything.

Each optimizer state tensor is stored in model space next to its parameter
(``optimizer/exp_avg/<key>`` has the shape of ``model/<key>``), whatever
optimizer held it:

* a plain optimizer (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``)
  keeps state shaped like the TP-local parameter: the state tensor gets the
  parameter's own box pieces;
* the ``DistributedOptimizer`` keeps, per parameter, a 1-D shard over the
  range ``[start, end)`` of the TP-local parameter's flattening that this DP
  rank owns (``gbuf_ranges[...]["param_map"][param]["param"]``). Those shards
  are stored as they are — flat pieces of the model-space tensor — so saving
  moves no bytes between ranks, and a load at any other TP/PP/DP reads back
  exactly the elements each new shard owns.

So one checkpoint serves DP changes and TP/PP changes alike; Megatron's own
formats make you choose (``dp_reshardable`` cannot change TP/PP).

Main (fp32) parameters are stored as ``optimizer/main/<key>`` only when they
are separate from the model weights (bf16/fp16 training); with fp32 training
the distributed optimizer's main shard is a view of the weight itself.
Scalar state (Adam's ``step``) and hyper-parameters go to JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ckptkit.adapters.megatron.model_space import ParamSpace, storage_id
from ckptkit.adapters.primed_states import PrimedStates
from ckptkit.engine.state import Sharded, dtype_name
from ckptkit.errors import OptionsError, StateMismatchError

MAIN = "main"


@dataclass(frozen=True)
class ParamState:
    """One parameter's optimizer tensors on this rank: the main copy (or None when it is the weight)
    and the state dict entry of the inner optimizer, with the flat range they cover (None: whole param)."""

    space: ParamSpace
    main: torch.Tensor | None
    state: dict[str, Any]
    flat: tuple[int, int] | None
    inner: Any  # the torch optimizer holding ``state``
    main_param: torch.Tensor  # the tensor that is the key of ``inner.state``


def _optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def guards(optimizer: Any, chunks: list[Any]) -> list[Any]:
    """What guards an overlapped snapshot (``AsyncOptions(snapshot="overlap")``): the torch optimizer
    inside each Megatron optimizer (each of a ``ChainedOptimizer``'s). ``MegatronOptimizer.step``
    first prepares gradients (main grads only), then calls that optimizer's ``step``, and only then
    copies main parameters into the model weights, so its step pre-hook runs before the first change
    of anything saved. Refused: a model-only save (no optimizer: nothing to hook), and routers with
    an expert bias (``moe_router_enable_expert_bias``): Megatron updates that saved buffer in
    ``finalize_model_grads``, after backward and *before* ``optimizer.step()``."""
    biased = [type(m).__name__ for c in chunks for m in c.modules() if getattr(m, "expert_bias", None) is not None]
    if biased:
        raise OptionsError(
            f"snapshot='overlap' is not covered for Megatron routers with an expert bias ({biased[0]}): Megatron "
            "updates the saved expert_bias in finalize_model_grads, after backward and before optimizer.step(), "
            "so it would change before the guarded step; use snapshot='blocking'")
    if optimizer is None:
        raise OptionsError(
            "snapshot='overlap' needs the Megatron optimizer whose step changes the saved weights, to hook it; "
            "a save without one (model only) cannot know when the weights change: use snapshot='blocking'")
    inner = [getattr(opt, "optimizer", None) for opt in _optimizers(optimizer)]
    if not inner or any(not callable(getattr(o, "register_step_pre_hook", None)) for o in inner):
        raise OptionsError(
            f"snapshot='overlap': {type(optimizer).__name__} holds no torch optimizer to hook "
            "(expected .optimizer, or .chained_optimizers[i].optimizer); use snapshot='blocking'")
    return inner


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return storage_id(a) == storage_id(b)


def param_states(optimizer: Any, spaces: list[ParamSpace]) -> list[ParamState]:
    """This rank's optimizer tensors for every parameter the optimizer updates."""
    by_param = {id(s.param): s for s in spaces}
    out: list[ParamState] = []
    for opt in _optimizers(optimizer):
        kind = type(opt).__name__
        if kind == "DistributedOptimizer":
            for model_param, _ in opt.model_param_group_index_map.items():
                space = by_param.get(id(model_param))
                if space is None:
                    raise StateMismatchError("a distributed-optimizer parameter is not declared by the model's "
                                             f"sharded_state_dict (shape {tuple(model_param.shape)})")
                rng = opt._get_model_param_range_map(model_param)["param"]
                group_index, order = opt.model_param_group_index_map[model_param]
                main = opt.optimizer.param_groups[group_index]["params"][order]
                state = opt.optimizer.state.setdefault(main, {})
                own = None if _shares_storage(main, model_param) else main
                out.append(ParamState(space, own, state, (rng.start, rng.end), opt.optimizer, main))
        elif kind in ("FP32Optimizer", "Float16OptimizerWithFloat16Params"):
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
            if kind == "FP32Optimizer":
                pairs = [(p, p) for g in opt.optimizer.param_groups for p in g["params"]]
            else:
                for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                    pairs.extend(zip(model_group, main_group))
                pairs.extend((p, p) for g in opt.fp32_from_fp32_groups for p in g)
            for model_param, main in pairs:
                space = by_param.get(id(model_param))
                if space is None:
                    raise StateMismatchError("an optimizer parameter is not declared by the model's sharded_state_dict "
                                             f"(shape {tuple(model_param.shape)})")
                state = opt.optimizer.state.setdefault(main, {})
                out.append(ParamState(space, None if main is model_param else main, state, None, opt.optimizer, main))
        else:
            raise StateMismatchError(f"Megatron optimizer {kind}: ckptkit reads DistributedOptimizer, FP32Optimizer "
                                     "and Float16OptimizerWithFloat16Params (optionally inside a ChainedOptimizer)")
    return out


def state_pieces(ps: ParamState, name: str, *, for_save: bool) -> Sharded:
    """The Sharded declaration of one optimizer tensor (``name``: a state key, or ``main``)."""
    local = ps.main if name == MAIN else ps.state[name]
    assert local is not None
    prefix = f"optimizer/{name}/"
    if ps.flat is None:
        return Sharded(ps.space.view(local), ps.space.box_pieces(prefix, for_save=for_save))
    start, stop = ps.flat
    if local.numel() != stop - start:
        raise StateMismatchError(f"{ps.space.name}: optimizer {name!r} shard has {local.numel()} elements, its range "
                                 f"[{start}, {stop}) has {stop - start}")
    return Sharded(local, ps.space.flat_pieces(prefix, start, stop, for_save=for_save))


def state_tensors(ps: ParamState, name: str) -> set[str]:
    """The stored tensors a load of optimizer tensor ``name`` reads for ``ps`` (:func:`state_pieces`'s,
    known before the state tensor exists, so a load is refused before the state is replaced)."""
    prefix = f"optimizer/{name}/"
    if ps.flat is None:
        return {p.tensor for p in ps.space.box_pieces(prefix, for_save=False)}
    return {p.tensor for p in ps.space.flat_pieces(prefix, *ps.flat, for_save=False)}


def tensor_state_keys(ps: ParamState) -> list[str]:
    """State entries shaped like the parameter (or its shard): stored as tensors."""
    n = ps.main_param.numel()
    return sorted(k for k, v in ps.state.items() if isinstance(v, torch.Tensor) and v.numel() == n and v.dim() >= 1)


def scalar_state(states: list[ParamState]) -> dict[str, dict[str, Any]]:
    """Scalar state entries (Adam's ``step``), which must agree across parameters."""
    out: dict[str, dict[str, Any]] = {}
    for ps in states:
        tensor_keys = set(tensor_state_keys(ps))
        for k, v in ps.state.items():
            if k in tensor_keys:
                continue
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                rec = {"dtype": dtype_name(v.dtype), "value": v.item()}
            elif isinstance(v, (int, float)):
                rec = {"dtype": None, "value": v}
            else:
                raise StateMismatchError(f"{ps.space.name}: optimizer state {k!r} is neither a tensor shaped like the "
                                         "parameter nor a scalar")
            if k in out and out[k] != rec:
                raise StateMismatchError(f"optimizer state {k!r} differs between parameters ({out[k]} vs {rec}); "
                                         "ckptkit stores one value per state key")
            out[k] = rec
    return out


def prime(primed: PrimedStates, states: list[ParamState], tensor_keys: list[str],
          scalars: dict[str, dict[str, Any]]) -> None:
    """Make each parameter's optimizer state the checkpoint's kinds, for the load to fill
    (:class:`~ckptkit.adapters.primed_states.PrimedStates`: undone if the load fails): ``tensor_keys``
    shaped like the main parameter and the saved scalars (a tensor scalar keeps its device)."""
    for ps in states:
        devices = {k: v.device for k, v in ps.state.items() if isinstance(v, torch.Tensor)}  # a capturable step's
        values = {k: rec["value"] if rec["dtype"] is None else
                  torch.tensor(rec["value"], dtype=getattr(torch, rec["dtype"]), device=devices.get(k))
                  for k, rec in scalars.items()}
        primed.prime(ps.state, ps.main_param, tensor_keys, values)


def hyper_parameters(optimizer: Any) -> list[list[dict[str, Any]]]:
    """The inner optimizers' param-group hyper-parameters (informational: the scheduler sets lr and wd)."""
    out = []
    for opt in _optimizers(optimizer):
        groups = []
        for g in opt.optimizer.param_groups:
            groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
                           if k != "params" and isinstance(v, (int, float, str, bool, tuple, list, type(None)))})
        out.append(groups)
    return out


def grad_scaler_states(optimizer: Any) -> list[dict[str, Any] | None]:
    """Each Megatron optimizer's loss-scaler state, JSON-ready (None: no scaler, as in bf16/fp32 training).
    fp16 training scales the loss by a factor ``DynamicGradScaler`` grows and backs off as gradients
    overflow; a resume without it restarts from the initial scale (2**32 by default) and skips steps
    until the scale comes down again, so the record keeps scale, growth and hysteresis trackers."""
    out: list[dict[str, Any] | None] = []
    for opt in _optimizers(optimizer):
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is None:
            out.append(None)
            continue
        out.append({k: float(v.reshape(-1)[0].item()) if isinstance(v, torch.Tensor) else v
                    for k, v in scaler.state_dict().items()})
    return out


def grad_scaler_plan(optimizer: Any, saved: list[dict[str, Any] | None] | None, where: str) -> list[tuple[Any, dict]]:
    """The loss scalers :func:`grad_scaler_states` recorded, paired with this job's scalers; checked before a
    load writes anything, applied after it (:func:`load_grad_scalers`). None: a checkpoint from before they
    were recorded, or an import without them; ``{}``: a constant scale's (nothing to restore). Either way
    the scalers keep their initial state. A job without scalers (bf16, fp32) ignores them. The scalers are
    matched by position; at another count (a ChainedOptimizer split differently) only one state shared by
    all of them can be applied. A recorded state lacking what a scaler here keeps is refused naming it:
    a constant scale's ``{}`` loaded into a dynamic scaler raised ``KeyError: 'scale'`` after every tensor
    had been loaded (found by a hunt, 2026-12-06)."""
    if not saved:
        return []
    scalers = [getattr(opt, "grad_scaler", None) for opt in _optimizers(optimizer)]
    states = [s for s in saved if s]
    if len(saved) != len(scalers):
        if any(s != states[0] for s in states):
            raise StateMismatchError(f"{where}: {len(saved)} saved loss scalers with different states for "
                                     f"{len(scalers)} optimizers here")
        saved = [states[0] if states else None] * len(scalers)
    plan = []
    for i, (scaler, state) in enumerate(zip(scalers, saved)):
        if scaler is None or not state:
            continue
        lacking = sorted(set(scaler.state_dict()) - set(state))
        if lacking:
            raise StateMismatchError(f"{where}: the loss scaler recorded for optimizer {i} ({sorted(state)}) lacks "
                                     f"{lacking}, which this job's {type(scaler).__name__} keeps")
        plan.append((scaler, state))
    return plan


def load_grad_scalers(plan: list[tuple[Any, dict]]) -> None:
    """Restore the loss scalers of a :func:`grad_scaler_plan`."""
    for scaler, state in plan:
        scaler.load_state_dict(scaler_state_dict(state))


def scaler_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """A recorded loss scaler (:func:`grad_scaler_states`) as ``DynamicGradScaler.state_dict`` has it: the
    scale a 1-element float32 tensor, the trackers as recorded. What a load restores and a torch_dist export
    writes into ``common.pt``."""
    return {k: torch.tensor([v], dtype=torch.float32) if k == "scale" else v for k, v in state.items()}


def zero_fresh_rows(states: list[ParamState]) -> None:
    """After a load: zero the optimizer's copies of the rows the checkpoint does not hold.

    A loading layout that pads the vocabulary more than the saving one gets new padding rows, which
    :func:`~ckptkit.adapters.megatron.model_space.padding_plan` zeroes in the weight. The main copy and
    the moments of those rows were not in the checkpoint either: left alone they would keep the live
    job's values (its initialisation, or its own training before a rollback), and the sync from the
    main copies right after the load would write them back into the weights. So they are zeroed too,
    as a fresh optimizer's moments are, and the whole state is the checkpoint's plus defined zeros.
    """
    for ps in states:
        rows = ps.space.fresh_rows
        if not rows:
            continue
        tensors = [t for t in ([ps.main] + [ps.state[k] for k in tensor_state_keys(ps)]) if t is not None]
        width = ps.space.row_numel
        start = 0 if ps.flat is None else ps.flat[0]
        with torch.no_grad():
            for t in tensors:
                flat = t.view(-1)
                for first, stop in rows:  # element range of the rows, clipped to what this tensor covers
                    lo = max(first * width - start, 0)
                    hi = min(stop * width - start, flat.numel())
                    if lo < hi:
                        flat[lo:hi].zero_()


def sync_model_from_main(optimizer: Any, had_main: bool, have_main: bool) -> None:
    """After a load: make model weights and main copies agree.

    Saved and loading both with separate main copies: the main copies were
    loaded; copy them into the training-dtype weights. Loading with separate
    copies from a checkpoint without them (saved in fp32), or loading the
    weights alone (``load_optimizer=False``): derive the main copies from the
    loaded weights, as Megatron-LM's load does (``reload_model_params``, a
    no-op for an optimizer without separate copies), or the next step would
    copy the job's own main copies over the loaded weights. No separate
    copies here: nothing to do.
    """
    if not have_main:
        return
    for opt in _optimizers(optimizer):
        if had_main:
            opt._copy_main_params_to_model_params()
        elif hasattr(opt, "reload_model_params"):  # a weights-only load may pass any optimizer
            opt.reload_model_params()
