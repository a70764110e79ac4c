"""DeepSpeed ZeRO engines on ckptkit: save straight from the flat partitions, load at any DP size and stage.

    from ckptkit.adapters import deepspeed as ds_ckpt

    handle = ds_ckpt.save(engine, "runs/exp1/step-0000100", client_state={"epoch": 3}, asynchronous=True)
    ...
    client_state = ds_ckpt.load(engine, "runs/exp1/step-0000100")   # any DP size, ZeRO 1/2/3

What a checkpoint holds, in model space (one logical tensor per parameter):

* ``optimizer/fp32/<name>``: the fp32 master weights, saved as flat pieces of
  each rank's flat partition (ZeRO-1/2 ``single_partition_of_fp32_groups``,
  ZeRO-3 ``fp32_partitioned_groups_flat``): no gather at save time, padding
  is not stored;
* ``optimizer/<state>/<name>``: every base-optimizer state tensor shaped like
  the flat partition (Adam's ``exp_avg``, ``exp_avg_sq``, amsgrad's
  ``max_exp_avg_sq``), the same way; scalar states (Adam's ``step``) and the
  param groups' hyper-parameters go to JSON;
* ``model/<name>``: the module's parameters in their training dtype, from the
  bit16 flat partitions (ZeRO-1/2) or each parameter's ``ds_tensor``
  (ZeRO-3), and module buffers (written once across DP replicas);
* the JSON value ``deepspeed``: engine counters (``global_steps``,
  ``global_samples``, ``skipped_steps``, ``micro_steps``), the LR scheduler's
  ``state_dict``, the client state, the saving layout and per-parameter shapes.

Loading fills the target engine's own partitions in place (ckptkit reads the
overlapping stored bytes of each fragment), then lets DeepSpeed re-derive the
training-dtype weights from the fp32 masters exactly as its own loader does
(ZeRO-1/2 ``update_lp_params``; ZeRO-3 copies each sub-group's fp32 partition
into the parameters' ``ds_tensor`` and re-gathers persistent parameters), so
a checkpoint moves between DP sizes and between ZeRO 1/2 and 3, and between
bf16 and fp32 training, directly.

Where the partition facts come from: :mod:`ckptkit.layout.zero_partition`.
Every live engine's layout is checked against it before anything is saved or
loaded. Supported: data parallelism over the whole world (no tensor/pipeline
parallelism), with or without DeepSpeed-MoE expert parallelism at ZeRO 1/2,
no CPU/NVMe offload, bf16 or fp32 (fp16's loss scaler state is not carried:
refused). DeepSpeed is imported only here and in :mod:`ckptkit.adapters.deepspeed_layout`
(what the engine holds, in model space).

DeepSpeed-MoE (``deepspeed.moe.layer.MoE``): each EP rank holds its local
experts as ``<moe>.deepspeed_moe.experts.deepspeed_experts.{local}.<param>``,
and ZeRO partitions their param group over the expert-data-parallel group.
In model space they follow ckptkit's expert convention (docs/moe.md): one
tensor per weight kind, ``<moe>.deepspeed_moe.experts.deepspeed_experts.<param>``
of shape ``[num_experts, *param]``, the experts stacked along axis 0 by
*global* id (``ep_rank * local + j``, as DeepSpeed's per-expert files number
them) with rule ``PartitionRule(expert_axis=0)``. Each rank saves the flat
fragments of its expert-DP partition as flat pieces of its experts' boxes, so
a checkpoint saved at one EP / DP size loads at any other.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch

import ckptkit
from ckptkit.adapters.deepspeed_record import (  # FORMAT, META: the record's names, kept importable here
    CLIENT_KEY, CLIENT_STATE, FORMAT, META, RECORD_KEY, Counters, FrameworkState, RecordSources, SavedLayout, build_record,
    client_state_record, parse_record, scalar_value, split_client_state,
)
from ckptkit.adapters.load_checks import (DROPPED, NOT_LOADED, dropped, dropped_user_value, record_text,
                                          refuse_unexpected, user_value)
from ckptkit.adapters.primed_states import PrimedStates
from ckptkit.engine.collective import agreed_state, resolve_comm
from ckptkit.engine.metadata_io import read_manifest
from ckptkit.engine.state import Sharded
from ckptkit.errors import MissingKeysError, OptionsError, StateMismatchError
from ckptkit.layout.values import decode_value
from ckptkit.options import AsyncOptions, LoadOptions
from ckptkit.storage.url import open_store

# What the engine holds, in model space (ckptkit/adapters/deepspeed_layout.py); the names the converters and
# users import from here stay importable here.
from ckptkit.adapters.deepspeed_layout import (  # noqa: F401 - re-exported
    EXPERT_RULE, EXPERTS, FP32, EngineLayout, FlatGroup, Space, engine_layout, frozen_and_buffers, group_entries,
    group_pieces, model_key, optim_key, shared_parameters,
)


def engine_state(engine: Any, client_state: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ckptkit state of a live engine (see the module docstring); tensors are the engine's own."""
    layout = engine_layout(engine)
    if engine.micro_steps % engine.gradient_accumulation_steps():
        raise StateMismatchError(
            f"DeepSpeed engine: micro step {engine.micro_steps} is inside a gradient-accumulation window of "
            f"{engine.gradient_accumulation_steps()}; save after engine.step() completes a global step")
    state, scalars = group_entries(layout, engine.optimizer.optimizer.state)
    for key, (local, pieces) in frozen_and_buffers(engine, layout).items():
        state[key] = Sharded(local, pieces)
    state_keys = sorted({k for e in state.values() if isinstance(e, dict) for k in e
                         if not k.startswith("lp") and k != FP32})
    record = _engine_record(engine, layout, scalars, state_keys, client_state or {})
    state[CLIENT_STATE] = split_client_state(record)  # may differ per rank; the record may not
    state[META] = json.dumps(record)
    return {"deepspeed_engine": state}


def _engine_record(engine: Any, layout: EngineLayout, scalars: list[dict[str, Any]], state_keys: list[str],
                   client_state: Mapping[str, Any]) -> dict[str, Any]:
    """The ``deepspeed`` record of a live engine, through the builder the importer calls too
    (:func:`ckptkit.adapters.deepspeed_record.build_record`): one set of keys and rules for both."""
    where = "DeepSpeed engine"
    kept, refused = client_state_record(client_state, where)
    if refused:  # the caller can fix its client state; an import of a native folder lists them instead
        raise next(iter(refused.values()))
    optimized = {id(q) for g in layout.groups for q in g.lp_params}
    saved = SavedLayout(
        zero_stage=layout.stage, dp=layout.dp, lp_dtype=layout.lp_dtype,
        flat_groups=[{"group": g.group, "names": list(dict.fromkeys(g.names)), "moe": g.moe} for g in layout.groups],
        param_shapes={n: list(sh) for g in layout.groups for n, sh in zip(g.names, g.shapes)},
        optimizer_scalars=scalars, optimizer_state_keys=state_keys,
        buffers=[n for n, _ in engine.module.named_buffers()],
        frozen=[n for n, p in engine.module.named_parameters() if id(p) not in optimized],
        shared=shared_parameters(engine), experts=dict(layout.expert_meta or {}))
    counters = Counters(engine.global_steps, engine.global_samples, engine.skipped_steps, engine.micro_steps,
                        engine.gradient_accumulation_steps())
    sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    return build_record(saved, counters, FrameworkState(engine.optimizer.optimizer.param_groups, sched, engine.config,
                                                        kept, RecordSources(where, where)))


def save(engine: Any, path: str | os.PathLike[str], *, client_state: Mapping[str, Any] | None = None,
         asynchronous: bool = False, options: AsyncOptions = AsyncOptions(),
         storage_options: dict[str, Any] | None = None) -> Any:
    """Save ``engine`` to ``path`` (collective). Synchronous: returns the SaveResult. Asynchronous:
    returns a :class:`ckptkit.SaveHandle` once the snapshot is taken; training may continue at once.
    With ``options=AsyncOptions(snapshot="overlap")`` it returns before the copy, and the engine's
    next optimizer step waits for it (:func:`guards`)."""
    # agreed: a client state one rank alone cannot save raised there while the others waited in the save
    state = agreed_state(resolve_comm(None), lambda: engine_state(engine, client_state),
                         f"checkpoint {os.fspath(path)}")
    if asynchronous:
        guard = guards(engine) if options.snapshot == "overlap" else None
        return ckptkit.save_async(state, path, options=options, storage_options=storage_options, guard=guard)
    return ckptkit.save(state, path, storage_options=storage_options)


def guards(engine: Any) -> list[Any]:
    """What guards an overlapped snapshot of ``engine``: the base torch optimizer inside its ZeRO
    optimizer. ``engine.step()`` changes the saved state (fp32 masters, moments, then the bit16
    partitions copied from the masters) only inside or after the base optimizer's ``step``, which
    ZeRO calls once per parameter group; backward and gradient accumulation touch gradients only."""
    inner = getattr(getattr(engine, "optimizer", None), "optimizer", None)
    if inner is None or not callable(getattr(inner, "register_step_pre_hook", None)):
        raise OptionsError(
            "snapshot='overlap' needs the DeepSpeed engine's base torch optimizer (engine.optimizer.optimizer) "
            f"to hook its step, and this engine has {type(inner).__name__ if inner is not None else 'none'}; "
            "use snapshot='blocking'")
    return [inner]


# -------------------------------------------------------------------- load
def read_meta(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``deepspeed`` JSON record of a checkpoint (read from its manifest; no tensor is touched).
    Its ``client_state``: the one in the record (an import, a checkpoint saved before it moved out),
    else the agreed value at :data:`CLIENT_KEY`, else None when the saving ranks' client states
    differed (:func:`load` restores each rank's own), else :data:`~ckptkit.adapters.load_checks.DROPPED`
    (``ckptkit reshard`` dropped it)."""
    store = open_store(path, storage_options)
    manifest = read_manifest(store)
    meta = parse_record(record_text(manifest, RECORD_KEY, store.url, "DeepSpeed"), store.url)
    meta["_tensors"] = set(manifest.tensors)
    if CLIENT_STATE not in meta:
        text = manifest.values.get(CLIENT_KEY)
        if text is None and CLIENT_KEY not in manifest.rank_values:
            if not dropped(manifest, CLIENT_KEY):
                raise MissingKeysError(f"{store.url}: the DeepSpeed record holds no client state and there is no "
                                       f"{CLIENT_KEY!r} value")
            meta[CLIENT_STATE] = DROPPED
            return meta
        meta[CLIENT_STATE] = None if text is None else user_value(
            decode_value(text, f"{store.url}: {CLIENT_KEY}"), CLIENT_KEY, store.url)
    return meta


_GROUP_IDENTITY = ("name", "moe")
"""Param-group keys that say which group it is, not how it trains: DeepSpeed-MoE names an expert group
after its EP size (``ep_size_2``) and looks its process groups up by that name, so a resume at another
EP size keeps its own."""


def _prime_state(primed: PrimedStates, base: Any, g: FlatGroup, keys: list[str], scalars: Mapping[str, Any]) -> dict[
        str, Any]:
    """The base optimizer's state for ``g``, made exactly the checkpoint's kinds (:class:`PrimedStates`):
    ``keys`` shaped like the fp32 partition for the load to fill, and the saved scalars (a tensor scalar
    keeps its device: a capturable step's)."""
    st = base.state.setdefault(g.fp32, {})
    devices = {k: v.device for k, v in st.items() if isinstance(v, torch.Tensor)}
    values = {}
    for key, rec in scalars.items():
        value = scalar_value(rec)
        values[key] = value.to(devices[key]) if isinstance(value, torch.Tensor) and key in devices else value
    return primed.prime(st, g.fp32, keys, values)


def load(engine: Any, path: str | os.PathLike[str], *, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True, strict: bool = True, options: LoadOptions = LoadOptions(),
         storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load a checkpoint of this adapter into ``engine`` (collective), at this engine's DP size, ZeRO
    stage and MoE expert-parallel size, whatever the saving job's were. Returns the client state (this
    rank's own where the saving ranks' differed; see docs/deepspeed.md for another world size).

    ``strict``: refuse (UnexpectedKeysError) a checkpoint holding tensors of parameters or buffers this
    engine's model does not have, as DeepSpeed's ``load_module_strict`` does; False loads the rest.
    Loading optimizer states makes each partition's state exactly the checkpoint's."""
    meta = read_meta(path, storage_options)
    if meta[CLIENT_STATE] is DROPPED:  # before anything of the engine is touched
        meta[CLIENT_STATE] = dropped_user_value(CLIENT_KEY, str(path), options.per_rank_on_resize)
    layout = engine_layout(engine)
    base = engine.optimizer.optimizer
    where = str(path)
    need = [optim_key(FP32, n) for g in layout.groups for n in dict.fromkeys(g.names)]
    keys = list(meta["optimizer_state_keys"]) if load_optimizer_states else []
    need += [optim_key(k, n) for k in keys for g in layout.groups for n in dict.fromkeys(g.names)]
    frozen = frozen_and_buffers(engine, layout)
    need += list(frozen)
    missing = sorted(k for k in need if k not in meta["_tensors"])
    if missing:
        raise MissingKeysError(f"{where}: {len(missing)} tensor(s) this engine needs are not in the checkpoint: "
                               f"{', '.join(repr(k) for k in missing[:8])}")
    if strict:
        names = {n for g in layout.groups for n in g.names} | {k.removeprefix("model/") for k in frozen}
        refuse_unexpected(meta["_tensors"], names, where, "engine's model")
    if load_optimizer_states and len(meta["param_groups"]) != len(base.param_groups):
        raise StateMismatchError(f"{where}: {len(meta['param_groups'])} optimizer param group(s) saved, the engine has "
                                 f"{len(base.param_groups)}")
    saved_scalars = {n: meta["optimizer_scalars"][i] for i, fg in enumerate(meta["flat_groups"]) for n in fg["names"]}
    primed = PrimedStates()
    if engine.zero_optimization_stage() == 3:
        engine.optimizer.checkpoint_event_prologue()
    try:
        _load_into(engine, layout, path, primed, keys if load_optimizer_states else None, saved_scalars, frozen, meta,
                   options, storage_options)
    except BaseException:
        primed.undo()  # refused before a byte landed: the job as it was (else the error says partly overwritten)
        if engine.zero_optimization_stage() == 3:
            engine.optimizer.checkpoint_event_epilogue()
        raise
    _restore_training_dtype(engine, layout)
    _relink_fragments(engine)
    if load_optimizer_states:
        for pg, saved in zip(base.param_groups, meta["param_groups"]):
            for k, v in saved.items():
                if k in _GROUP_IDENTITY:
                    continue
                pg[k] = tuple(v) if isinstance(pg.get(k), tuple) else v
    if load_lr_scheduler_states and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    engine.global_steps = meta["global_steps"]
    engine.global_samples = meta["global_samples"]
    engine.skipped_steps = meta["skipped_steps"]
    engine.micro_steps = meta["global_steps"] * engine.gradient_accumulation_steps()
    return meta["client_state"]


def _load_into(engine: Any, layout: EngineLayout, path: Any, primed: PrimedStates, keys: list[str] | None,
               saved_scalars: Mapping[str, Any], frozen: Mapping[str, Any], meta: dict[str, Any], options: LoadOptions,
               storage_options: dict[str, Any] | None) -> None:
    """The checkpoint's tensors into the engine's fp32 partitions, optimizer states (``keys``; None: not
    loaded), frozen parameters and buffers; the client state into ``meta``."""
    base = engine.optimizer.optimizer
    where = str(path)
    state: dict[str, Any] = {}
    for i, g in enumerate(layout.groups):
        entry: dict[str, Any] = {FP32: Sharded(g.fp32, group_pieces(g, lambda n: optim_key(FP32, n)), g.rule)}
        if keys is not None:
            scalars = {}
            for n in g.names:  # every member of a flat group shares its scalars; check the checkpoint agrees
                if scalars and saved_scalars[n] != scalars:
                    raise StateMismatchError(f"{where}: optimizer scalars of {n!r} ({saved_scalars[n]}) differ from "
                                             f"those of its new flat group ({scalars}); cannot merge them")
                scalars = saved_scalars[n]
            st = _prime_state(primed, base, g, keys, scalars)
            for key in keys:
                entry[key] = Sharded(st[key], group_pieces(g, lambda n, k=key: optim_key(k, n)), g.rule)
        state[f"g{i}"] = entry
    for key, (local, pieces) in frozen.items():
        state[key] = Sharded(local, pieces)
    per_rank = meta[CLIENT_STATE] is None
    if per_rank:  # each rank's own at the saving world size; per_rank_on_resize at another
        state[CLIENT_STATE] = NOT_LOADED
    ckptkit.load({"deepspeed_engine": state}, path, strict=False, options=options, storage_options=storage_options)
    if per_rank:
        meta[CLIENT_STATE] = user_value(state[CLIENT_STATE], CLIENT_KEY, where)


def _relink_fragments(engine: Any) -> None:
    """Point DeepSpeed's per-parameter fragment mappings (``safe_get_full_optimizer_state``) at the state
    the optimizer now holds, where they were linked already (ZeRO-1/2 and bf16 link once, lazily, after
    the first step; a state tensor the load had to make anew would otherwise not be seen there)."""
    opt = engine.optimizer
    if getattr(opt, "_hp_optimizer_states_linked", False) and hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


@torch.no_grad()
def _restore_training_dtype(engine: Any, layout: EngineLayout) -> None:
    """Re-derive the training-dtype weights from the loaded fp32 masters, as DeepSpeed's own loader does."""
    opt = engine.optimizer
    if layout.stage < 3:
        opt.update_lp_params()  # copy this rank's fp32 partition into its bit16 slice, then all-gather
        return
    for g in layout.groups:
        at = 0
        for p in g.lp_params:  # (fp32 training: ds_tensor may be this very slice; the copy is then a no-op)
            n = p.ds_tensor.ds_numel
            p.ds_tensor.data.copy_(g.fp32.narrow(0, at, n))
            at += n
    opt.checkpoint_event_epilogue()  # re-gathers persistent parameters from their partitions


# --------------------------------------------------------------- manager
class DeepSpeedCheckpointer:
    """Periodic checkpoints of one engine through :class:`ckptkit.CheckpointManager`.

    Step folders (``step-0000100``) named by ``engine.global_steps``, retention
    (``keep_last``) and asynchronous saves come from the manager; this class
    supplies the engine's state and restores it at whatever DP size and ZeRO
    stage the resuming job has::

        ckpt = DeepSpeedCheckpointer(engine, "runs/exp1", every_steps=500, keep_last=3)
        client_state = ckpt.restore_latest() or {}
        for batch in loader:
            ...; engine.step()
            ckpt.maybe_save(client_state={"epoch": epoch})
        ckpt.close()
    """

    def __init__(self, engine: Any, root: str, *, every_steps: int | None = None, keep_last: int | None = None,
                 asynchronous: bool = True, options: AsyncOptions = AsyncOptions(),
                 storage_options: dict[str, Any] | None = None) -> None:
        self.engine = engine
        self.storage_options = storage_options
        self._comm = resolve_comm(None)  # the manager's ranks: the default group
        self.manager = ckptkit.CheckpointManager(
            root, save=ckptkit.SavePolicy(every_steps=every_steps), keep=ckptkit.RetentionPolicy(keep_last=keep_last),
            asynchronous=options if asynchronous else None, storage_options=storage_options,
            guard=guards(engine) if asynchronous and options.snapshot == "overlap" else None)

    def maybe_save(self, *, client_state: Mapping[str, Any] | None = None) -> Any:
        """Save if ``every_steps`` says so at ``engine.global_steps``; the handle, or None."""
        if not self.manager.should_save(self.engine.global_steps):
            return None
        return self.save(client_state=client_state)

    def save(self, *, client_state: Mapping[str, Any] | None = None) -> Any:
        """Save now (blocks only for the snapshot when asynchronous)."""
        step = self.engine.global_steps
        return self.manager.save(step, agreed_state(self._comm, lambda: engine_state(self.engine, client_state),
                                                    f"checkpoint of step {step}"))

    def restore_latest(self) -> dict[str, Any] | None:
        """Load the newest step every rank sees committed and that loads; its client state, or None if
        there is none. A damaged step (checksums, missing objects) is skipped with a warning and the
        next older one loaded (``self.manager.skipped`` names them), as
        :meth:`ckptkit.CheckpointManager.restore_latest` does. A native DeepSpeed checkpoint
        (``global_stepN``) newer than the newest ckptkit step in the same folder is refused
        (:func:`ckptkit.adapters.foreign_steps.resume_point`): resuming without it would go back in time; and so
        is a fallback past damaged steps to one older than such a native checkpoint."""
        from ckptkit.adapters.foreign_steps import DEEPSPEED, restore_newest

        got = restore_newest(self.manager, DEEPSPEED, lambda url: load(self.engine, url,
                                                                       storage_options=self.storage_options))
        return None if got is None else got[1]

    def wait(self) -> None:
        self.manager.wait()

    def close(self) -> None:
        """Wait for the last save; raise a background failure."""
        self.manager.close()
