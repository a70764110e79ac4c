"""Megatron-core training on ckptkit: save at one TP/PP/DP/VPP layout, resume at any other.

    from ckptkit.adapters import megatron as mckpt

    opts = mckpt.MegatronOptions(vocab_size=50257, make_vocab_size_divisible_by=128)
    handle = mckpt.save(model, "runs/gpt/iter-0001000", optimizer=optimizer, scheduler=scheduler,
                        iteration=1000, extra={"consumed_samples": n}, options=opts, asynchronous=True)
    ...
    info = mckpt.load(model, "runs/gpt/iter-0001000", optimizer=optimizer, scheduler=scheduler)
    iteration, consumed = info.iteration, info.extra["consumed_samples"]

``model`` is the list of model chunks (one per virtual pipeline stage; DDP
or Float16Module wrappers are fine). A checkpoint holds, in model space:

* ``model/<key>``: every ShardedTensor of ``model.sharded_state_dict()``
  under Megatron's own key and global shape (stacked layers with their
  layer axis; SwiGLU ``linear_fc1`` as ``[gate; up]``), vocabulary padding
  moved to ``<key>.vocab_padding`` when ``vocab_size`` is given;
* ``optimizer/<state>/<key>`` (``exp_avg``, ``exp_avg_sq``, ``main`` when
  main copies are separate): stored from each rank's own optimizer shard,
  see :mod:`.optimizer_state`;
* the JSON value ``megatron/meta``: iteration, ``extra``, the scheduler's
  ``state_dict``, scalar optimizer state, the saving layout;
* per-rank RNG states (Python, NumPy, torch CPU/CUDA, Megatron's tracker),
  restored only when the loading layout is the saving one (another layout
  has other ranks; Megatron then re-seeds, and so does this adapter: the
  states are left as the job set them).

Every tensor carries a partition rule (:mod:`.model_space`), so ``ckptkit
reshard --to tp4pp2`` can rewrite the checkpoint for a target layout offline.
Mixture-of-experts models (routed ``SequentialMLP`` experts, the router and
its expert bias, shared experts) are saved in the same model space at any
``ep`` / ``etp``: see docs/moe.md for the expert convention and what is
tested. Transformer Engine's FP8 ``_extra_state`` payloads are carried as
Megatron declares them, and vetted before a module unpickles one
(:mod:`.extra_state`, :mod:`.te_payload`). Megatron is imported only inside
this package. Not covered (refused with a clear error): ``GroupedMLP`` /
``TEGroupedMLP`` expert weights, non-Adam-like optimizer wrappers, TE 1.x's
``io.BytesIO`` extra state.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import ckptkit
from ckptkit.adapters.load_checks import (DROPPED, NOT_LOADED, dropped, dropped_user_value, record_text,
                                          refuse_unexpected, user_value)
from ckptkit.adapters.megatron import extra_state
from ckptkit.adapters.megatron import optimizer_state as opt_state
from ckptkit.adapters.primed_states import PrimedStates
from ckptkit.adapters.megatron.model_space import (
    DataParallelSizes,
    PADDING_SUFFIX,
    ModelSpaceOptions,
    ParamSpace,
    chunk_params,
    padding_plan,
    unwrap,
)
from ckptkit.engine.collective import agreed_state, resolve_comm
from ckptkit.engine.metadata_io import read_manifest
from ckptkit.engine.state import PerRank, Sharded
from ckptkit.errors import MissingKeysError, StateMismatchError
from ckptkit.layout.values import decode_value, json_ready
from ckptkit.options import AsyncOptions, LoadOptions
from ckptkit.storage.url import open_store

FORMAT = 1
ROOT = "megatron"
META_KEY = f"{ROOT}/meta"
_EXTRA = "extra"
USER_EXTRA = "user_extra"
"""State key of the caller's ``extra`` (its JSON text), apart from the record: ``extra`` may differ between
ranks (each rank's data-loader position), the record must not, or the saver's merge stores it per rank and
no load finds it. A record that still holds ``extra`` (saved before the split, an import) is read as before.
(Not ``extra``: that entry holds Transformer Engine's extra states.)"""
USER_EXTRA_KEY = f"{ROOT}/{USER_EXTRA}"


@dataclass(frozen=True)
class MegatronOptions:
    """``vocab_size``: the tokenizer's true vocabulary (None: the padded vocabulary is stored as
    Megatron holds it, and only layouts with the same padding can load it);
    ``make_vocab_size_divisible_by``: Megatron's argument of that name;
    ``save_optimizer``: store optimizer state (False: weights, scheduler and counters only)."""

    vocab_size: int | None = None
    make_vocab_size_divisible_by: int = 128
    save_optimizer: bool = True


@dataclass(frozen=True)
class MegatronLoadInfo:
    """What a load restored besides tensors."""

    iteration: int
    extra: dict[str, Any]
    saved_layout: dict[str, int]
    rng_restored: bool


def layout() -> dict[str, int]:
    """This job's parallel degrees, from Megatron's parallel_state."""
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
    }


def _chunks(model: Any) -> list[Any]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _declared(model: Any, vocab: ModelSpaceOptions, *, saving: bool = False) -> tuple[
        list[ParamSpace], list[extra_state.ExtraState]]:
    """The model chunks' parameters in model space, and their modules' extra states (with their payloads
    when ``saving``)."""
    from megatron.core import parallel_state as ps

    sizes = DataParallelSizes(ps.get_data_parallel_world_size(with_context_parallel=True),
                              ps.get_expert_data_parallel_world_size())
    spaces, objects = chunk_params(_chunks(model), vocab, sizes)
    return spaces, extra_state.declared([unwrap(c) for c in _chunks(model)], objects, saving=saving)


def _spaces(model: Any, vocab: ModelSpaceOptions) -> list[ParamSpace]:
    return _declared(model, vocab)[0]


def same_layout(saved: Mapping[str, int], current: Mapping[str, int]) -> bool:
    """Whether two recorded layouts are one (records written before ``etp`` was recorded had Megatron's
    default, ``etp = tp``)."""
    def norm(lay: Mapping[str, int]) -> dict[str, int]:
        return {"etp": lay.get("tp", 1), **lay}
    return norm(saved) == norm(current)


def _num_layers(model: Any) -> int:
    config = getattr(_chunks(model)[0], "config", None)
    return int(getattr(config, "num_layers", 0) or 0)


# ------------------------------------------------------------------ RNG
def _rng_state() -> dict[str, Any]:
    import numpy as np
    from megatron.core import tensor_parallel

    np_state = np.random.get_state()
    tracker = tensor_parallel.random.get_cuda_rng_tracker().get_states()
    return {
        "layout": layout(),
        "python": [list(x) if isinstance(x, tuple) else x for x in random.getstate()],
        "numpy": [np_state[0], np_state[1].tobytes(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().numpy().tobytes(),
        "cuda": torch.cuda.get_rng_state().numpy().tobytes() if torch.cuda.is_available() else None,
        "tracker": {k: v.cpu().numpy().tobytes() for k, v in tracker.items()},
    }


def _set_rng_state(state: Mapping[str, Any]) -> None:
    import numpy as np
    from megatron.core import tensor_parallel

    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.frombuffer(keys, dtype=np.uint32).copy(), pos, has_gauss, cached))
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8))
    tensor_parallel.random.get_cuda_rng_tracker().set_states(
        {k: torch.frombuffer(bytearray(v), dtype=torch.uint8) for k, v in state["tracker"].items()})


# ----------------------------------------------------------------- save
def megatron_state(model: Any, *, optimizer: Any = None, scheduler: Any = None, iteration: int = 0,
                   extra: Mapping[str, Any] | None = None, options: MegatronOptions = MegatronOptions()) -> dict[str, Any]:
    """The ckptkit state of a Megatron job (tensors are the job's own; the saver snapshots them).
    Collective over the data-parallel group where parameter all-gathers overlap (:func:`_synced_params`)."""
    _synced_params(model)
    vocab = ModelSpaceOptions(options.vocab_size, options.make_vocab_size_divisible_by)
    spaces, extras = _declared(model, vocab, saving=True)
    entries: dict[str, Any] = {}
    for i, s in enumerate(spaces):
        for j, sh in enumerate(_by_tensor(s.view(), s.box_pieces("model/", for_save=True), s, "model/")):
            entries[f"p{i}.{j}"] = sh
    entries[_EXTRA] = extra_state.save_entries(extras)
    meta: dict[str, Any] = {
        "format": FORMAT, "iteration": int(iteration), "layout": layout(), "num_layers": _num_layers(model),
        "vocab_size": options.vocab_size, "make_vocab_size_divisible_by": options.make_vocab_size_divisible_by,
        "scheduler": json_ready(scheduler.state_dict(), "the LR scheduler's state_dict") if scheduler is not None else None,
        "optimizer": None,
    }
    if optimizer is not None and options.save_optimizer:
        states = opt_state.param_states(optimizer, spaces)
        keys = sorted({k for ps in states for k in opt_state.tensor_state_keys(ps)})
        has_main = any(ps.main is not None for ps in states)
        for j, ps in enumerate(states):
            for name in keys + ([opt_state.MAIN] if has_main else []):
                sh = opt_state.state_pieces(ps, name, for_save=True)
                for k, part in enumerate(_by_tensor(sh.local, sh.pieces, ps.space, f"optimizer/{name}/")):
                    entries[f"o{j}/{name}.{k}"] = part
        meta["optimizer"] = {"tensor_states": keys, "main": has_main, "scalars": opt_state.scalar_state(states),
                             "hyper_parameters": opt_state.hyper_parameters(optimizer),
                             "grad_scalers": opt_state.grad_scaler_states(optimizer)}
    entries["meta"] = json.dumps(meta)
    entries[USER_EXTRA] = json.dumps(json_ready(dict(extra or {}), "extra"))  # may differ per rank; meta may not
    entries["rng"] = PerRank(_rng_state())
    return {ROOT: entries}


def _synced_params(model: Any) -> None:
    """Finish the parameter all-gather Megatron defers with ``overlap_param_gather`` (the distributed
    optimizer's step updates only this rank's shard of the weights; the rest arrives at the next forward),
    as Megatron-LM's own save does. Until 2026-12-06 the save took the weights as they were, one step
    stale outside each rank's shard, and without main copies (fp32) nothing newer was stored (a hunt)."""
    for chunk in _chunks(model):
        cfg = getattr(chunk, "ddp_config", None)
        if getattr(cfg, "overlap_param_gather", False) and getattr(cfg, "use_distributed_optimizer", False):
            chunk.start_param_sync(force_sync=True)


def _by_tensor(local: torch.Tensor, pieces: Sequence[Any], space: ParamSpace, prefix: str) -> list[Sharded]:
    """One Sharded per global tensor, each with that tensor's partition rule (a vocabulary's padding
    side tensor has none). No pieces (a replica that does not write): one Sharded without pieces."""
    by: dict[str, list[Any]] = {}
    for p in pieces:
        by.setdefault(p.tensor, []).append(p)
    if not by:
        return [Sharded(local, [])]
    return [Sharded(local, ps, rule=space.rules[t.removeprefix(prefix)]) for t, ps in by.items()]


def save(model: Any, path: str | os.PathLike[str], *, optimizer: Any = None, scheduler: Any = None, iteration: int = 0,
         extra: Mapping[str, Any] | None = None, options: MegatronOptions = MegatronOptions(),
         asynchronous: bool = False, async_options: AsyncOptions = AsyncOptions(),
         storage_options: dict[str, Any] | None = None) -> Any:
    """Save (collective over the world). Synchronous: the SaveResult; asynchronous: a SaveHandle once
    the snapshot is taken, training may go on at once. With ``async_options=AsyncOptions(snapshot=
    "overlap")`` it returns before the copy, and ``optimizer.step()`` waits for it
    (:func:`~ckptkit.adapters.megatron.optimizer_state.guards`)."""
    guard = opt_state.guards(optimizer, _chunks(model)) if asynchronous and async_options.snapshot == "overlap" else None
    state = agreed_state(resolve_comm(None), lambda: megatron_state(
        model, optimizer=optimizer, scheduler=scheduler, iteration=iteration, extra=extra, options=options),
        f"checkpoint {os.fspath(path)}")
    if asynchronous:
        return ckptkit.save_async(state, path, options=async_options, storage_options=storage_options, guard=guard)
    return ckptkit.save(state, path, storage_options=storage_options)


# ----------------------------------------------------------------- load
def read_meta(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict]:
    """The ``megatron/meta`` record and the stored tensors' shapes (from the manifest; no tensor read).
    The record's ``extra``: its own (saved before ``extra`` moved out of it, an import), else the agreed
    value at :data:`USER_EXTRA_KEY`, else None when the saving ranks' differed (:func:`load` restores
    each rank's own), else :data:`~ckptkit.adapters.load_checks.DROPPED` (``ckptkit reshard`` dropped it)."""
    store = open_store(path, storage_options)
    manifest = read_manifest(store)
    meta = json.loads(record_text(manifest, META_KEY, store.url, "Megatron"))
    if meta.get("format") != FORMAT:
        raise StateMismatchError(f"{store.url}: Megatron record format {meta.get('format')!r}, expected {FORMAT}")
    if "extra" not in meta:
        text = manifest.values.get(USER_EXTRA_KEY)
        if text is None:  # per rank; dropped by a reshard (which says so); or never stored (an import)
            meta["extra"] = None if USER_EXTRA_KEY in manifest.rank_values else DROPPED if dropped(
                manifest, USER_EXTRA_KEY) else {}
        else:
            meta["extra"] = user_value(decode_value(text, f"{store.url}: {USER_EXTRA_KEY}"), USER_EXTRA_KEY, store.url)
    return meta, {k: t.shape for k, t in manifest.tensors.items()}


def load_entries(model: Any, meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], *, optimizer: Any = None,
                 load_optimizer: bool = True, where: str = "") -> tuple[dict[str, Any], list[opt_state.ParamState], bool]:
    """What a load fills, as Sharded declarations of this job's own tensors at this job's layout: the
    model chunks (and their modules' stored extra states), and the optimizer's state (primed if it has
    not stepped). ``meta`` and ``shapes`` are :func:`read_meta`'s. Also the optimizer's per-parameter
    states and whether main copies are loaded. Apart so that the load a large layout would do can be
    planned without reading (tests/scale_megatron.py)."""
    plan = _load_plan(model, meta, shapes, optimizer=optimizer, load_optimizer=load_optimizer, where=where,
                      primed=PrimedStates())
    return plan.entries, plan.states, plan.load_main


@dataclass(frozen=True)
class _LoadPlan:
    entries: dict[str, Any]
    states: list[opt_state.ParamState]
    load_main: bool
    extras: list[extra_state.ExtraState]


def _load_plan(model: Any, meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], *, optimizer: Any,
               load_optimizer: bool, where: str, primed: PrimedStates) -> _LoadPlan:
    vocab = ModelSpaceOptions(meta["vocab_size"], meta["make_vocab_size_divisible_by"])
    spaces, extras = _declared(model, vocab)
    spaces = padding_plan(spaces, dict(shapes), "model/")
    entries: dict[str, Any] = {}
    for i, s in enumerate(spaces):
        entries[f"p{i}"] = Sharded(s.view(), s.box_pieces("model/", for_save=False))
    entries[_EXTRA] = extra_state.load_entries(extras, shapes, where)
    saved_opt = meta.get("optimizer")
    states: list[opt_state.ParamState] = []
    load_main = False
    if optimizer is not None and load_optimizer:
        if saved_opt is None:
            raise MissingKeysError(f"{where}: the checkpoint holds no optimizer state record (saved with "
                                   "save_optimizer=False or without an optimizer, or imported from a Megatron "
                                   "checkpoint whose optimizer state was not imported: a legacy checkpoint; "
                                   "docs/megatron.md, Limits); pass "
                                   "load_optimizer=False to load weights only")
        states = opt_state.param_states(optimizer, spaces)
        load_main = saved_opt["main"] and any(ps.main is not None for ps in states)
    kinds = (saved_opt["tensor_states"] + ([opt_state.MAIN] if load_main else [])) if states else []
    needed = {p.tensor for e in entries.values() if isinstance(e, Sharded) for p in e.pieces}
    needed |= {t for ps in states for name in kinds for t in opt_state.state_tensors(ps, name)}
    missing = sorted(needed - set(shapes))
    if missing:  # before the optimizer's state is replaced: a refused load leaves it as it was
        raise MissingKeysError(f"{where}: {len(missing)} tensor(s) this job needs are not in the checkpoint: "
                               f"{', '.join(repr(k) for k in missing[:8])}")
    if states:
        opt_state.prime(primed, states, saved_opt["tensor_states"], saved_opt["scalars"])
        for j, ps in enumerate(states):
            for name in kinds:
                entries[f"o{j}/{name}"] = opt_state.state_pieces(ps, name, for_save=False)
    return _LoadPlan(entries, states, load_main, extras)


def load(model: Any, path: str | os.PathLike[str], *, optimizer: Any = None, scheduler: Any = None,
         load_optimizer: bool = True, strict: bool = True, options: LoadOptions = LoadOptions(),
         storage_options: dict[str, Any] | None = None) -> MegatronLoadInfo:
    """Load a checkpoint of this adapter into the model chunks (and optimizer, scheduler) of this job,
    at this job's TP/PP/DP/VPP, whatever the saving job's were (collective).

    ``load_optimizer=False`` loads the weights alone; an ``optimizer`` passed then has its main copies
    refreshed from them (bf16/fp16 training), as Megatron-LM's own load without the optimizer does.
    Loading the optimizer makes its per-parameter state exactly the checkpoint's.
    ``strict``: refuse (UnexpectedKeysError) a checkpoint holding tensors of parameters or buffers the
    model does not have (an extra layer, a bias the config dropped), as Megatron does; False loads the
    rest. ``info.extra`` is this rank's own where the saving ranks' differed (docs/megatron.md)."""
    meta, shapes = read_meta(path, storage_options)
    if meta["extra"] is DROPPED:  # before anything of the job is touched
        meta["extra"] = dropped_user_value(USER_EXTRA_KEY, str(path), options.per_rank_on_resize)
    if strict:
        _refuse_unexpected(model, meta, shapes, str(path))
    scalers = opt_state.grad_scaler_plan(optimizer, (meta.get("optimizer") or {}).get("grad_scalers"), str(path)) if (
        optimizer is not None and load_optimizer) else []
    primed = PrimedStates()
    try:
        plan = _load_plan(model, meta, shapes, optimizer=optimizer, load_optimizer=load_optimizer, where=str(path),
                          primed=primed)
        entries, states, load_main = plan.entries, plan.states, plan.load_main
        same = same_layout(meta["layout"], layout())
        if same:
            entries["rng"] = PerRank(None)
        per_rank = meta["extra"] is None
        if per_rank:  # each rank's own at the saving world size; per_rank_on_resize at another
            entries[USER_EXTRA] = NOT_LOADED
        ckptkit.load({ROOT: entries}, path, strict=False, options=options, storage_options=storage_options)
    except BaseException:
        primed.undo()  # refused before a byte landed: the job as it was (else the error says partly overwritten)
        raise
    if per_rank:
        meta["extra"] = user_value(entries[USER_EXTRA], USER_EXTRA_KEY, str(path))
    if extra_state.stores_any(shapes):  # a checkpoint without FP8 payloads: no vetting exchange
        extra_state.restore(plan.extras, entries[_EXTRA], str(path))
    if states:
        opt_state.zero_fresh_rows(states)
        opt_state.sync_model_from_main(optimizer, had_main=load_main, have_main=any(ps.main is not None for ps in states))
        opt_state.load_grad_scalers(scalers)
    elif optimizer is not None:  # weights only: the main copies are derived from the loaded weights
        opt_state.sync_model_from_main(optimizer, had_main=False, have_main=True)
    if scheduler is not None and meta.get("scheduler") is not None:
        if isinstance(getattr(scheduler, "num_steps", None), int):
            # Megatron's OptimizerParamScheduler.load_state_dict *adds* the saved count to its own (it expects a
            # fresh scheduler): an in-process rollback would otherwise resume at the sum, with another LR
            scheduler.num_steps = 0
        scheduler.load_state_dict(meta["scheduler"])
    rng = entries.get("rng")
    restored = bool(same and rng is not None and rng.value is not None)
    if restored:
        _set_rng_state(rng.value)
    return MegatronLoadInfo(meta["iteration"], meta.get("extra", {}), meta["layout"], restored)


def _refuse_unexpected(model: Any, meta: Mapping[str, Any], shapes: Mapping[str, Any], where: str) -> None:
    """Refuse stored tensors of parameters and buffers no rank's model chunks declare (collective: a
    pipeline stage declares its own layers only). Not reported: a vocabulary's padding side tensor
    (this layout may pad less) and Transformer Engine's extra states (a model without TE has none)."""
    vocab = ModelSpaceOptions(meta["vocab_size"], meta["make_vocab_size_divisible_by"])
    names = {t for s in _spaces(model, vocab) for t in s.rules}
    refuse_unexpected(shapes, names, where, "job's model",
                      ignored=lambda k: k.startswith(extra_state.PREFIX) or k.endswith(PADDING_SUFFIX))


__all__ = [
    "MegatronCheckpointer",
    "MegatronLoadInfo",
    "MegatronOptions",
    "layout",
    "load",
    "load_entries",
    "megatron_state",
    "read_meta",
    "save",
]

from ckptkit.adapters.megatron.checkpointer import MegatronCheckpointer
