"""torchtitan's checkpointing, on ckptkit: a drop-in ``BaseCheckpointManager``.

    from ckptkit.adapters.torchtitan import CkptkitCheckpointManager

    config.checkpoint = CkptkitCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=500, keep_latest_k=3, async_mode="async")

torchtitan's Trainer builds its checkpointer with ``config.checkpoint.build(...)``,
so a config of this class is all a job changes. The manager keeps torchtitan's
conventions — one folder per step under ``dump_folder/folder``, named as
torchtitan names it (``step-100``; folders of ckptkit's ``step-0000100`` are
read too, see docs/torchtitan.md), ``keep_latest_k``, ``interval``,
``load_step``, ``exclude_from_loading``, ``last_save_model_only`` (with
``export_dtype``), ``initial_load_path``/``initial_load_model_only``,
``load_only``, fsspec folders such as ``s3://`` — and saves the same entries:
``model`` (FQN -> DTensor), ``optimizer`` (torchtitan's flattened, FQN-keyed
dict), ``lr_scheduler``, ``dataloader`` and ``train_state`` (every extra
Stateful the trainer passes in ``states``).

What differs from torchtitan's DCP manager, and why:

* Nothing is pickled. Tensors are stored as raw bytes, everything else as
  JSON. The data loader's state is taken from ``StatefulDataLoader.state_dict``
  (the un-pickled dict torchtitan's wrapper would ``pickle.dumps``) and must be
  JSON-representable; anything else is refused with its key named.
* Resuming at another DP degree works, data loader included: every rank stores
  its loader state with its DP rank (a :class:`ckptkit.PerRank` value), and a
  job with another DP degree reads the old DP ranks' states and remaps the
  positions (:mod:`ckptkit.adapters.dataloader_remap` says exactly when that
  is exact). Model and optimizer reshard as every ckptkit checkpoint does.
* ``async_mode``: ``"async"`` persists on a background thread,
  ``"async_process"`` (alias ``"async_with_pinned_mem"``) in a writer process
  reading shared memory; both block only for the snapshot, so
  ``maybe_wait_for_staging`` has nothing to wait for. With ``snapshot="overlap"``
  a save returns before the copy, and ``maybe_wait_for_staging`` (which the
  trainer calls right before ``optimizers.step()``) and the optimizers' own step
  hook wait for it.
* A committed checkpoint is never overwritten (ckptkit's rule): resuming from
  an older ``load_step`` and training past newer step folders fails at the
  first colliding save.

torchtitan is imported here only: ``import ckptkit`` never imports it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import filesystem

import ckptkit
from ckptkit.adapters import dataloader_remap as remap
from ckptkit.adapters.torchtitan_checks import check_keys, take_rank0_values
from ckptkit.adapters.torchtitan_experts import expert_axes, mark_model, mark_optimizer
from ckptkit.engine.collective import Comm, agreed_preparation, first_rank_does, resolve_comm
from ckptkit.engine.metadata_io import read_indexes, read_manifest
from ckptkit.engine.state import PerRank
from ckptkit.errors import (CheckpointNotFoundError, CheckpointUnreadableError, MissingKeysError, OptionsError, SaveError,
                            StateMismatchError)
from ckptkit.layout.values import decode_value
from ckptkit.options import AsyncOptions, LoadOptions
from ckptkit.retention import RetentionPolicy
from ckptkit.adapters.foreign_steps import DCP, ResumePoint, refuse_fallback_past, resume_point, warn_uncommitted
from ckptkit.run_folder import StepNaming
from ckptkit.storage.url import open_store

log = logging.getLogger("ckptkit")

META = "ckptkit_torchtitan"
"""State key of a JSON string describing the checkpoint (model-only or not, who holds which DP rank's loader)."""

_EXECUTORS = {"async": "thread", "async_process": "process"}

NAMING = StepNaming(width=0)
"""torchtitan's step folder names (``step-500``), what this manager writes; ckptkit's ``step-0000500``
(what it wrote before) is read too, and the newest step of either naming is the one resumed."""


# ----------------------------------------------------------------- data loaders
def _dp_of(loader: Any) -> tuple[int | None, int | None]:
    rank, world = getattr(loader, "dp_rank", None), getattr(loader, "dp_world_size", None)
    sampler = getattr(loader, "sampler", None)
    if rank is None and isinstance(sampler, DistributedSampler):
        rank, world = sampler.rank, sampler.num_replicas
    return rank, world


def describe_loader(loader: Any) -> tuple[str, dict[str, Any]]:
    """Which sample-to-DP-rank rule ``loader`` follows (see dataloader_remap), with the facts it needs."""
    if not isinstance(loader, StatefulDataLoader) or loader.num_workers != 0:
        return remap.OPAQUE, {}
    dp_rank, dp_world = _dp_of(loader)
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        if (sampler.rank, sampler.num_replicas) != (dp_rank, dp_world):
            raise StateMismatchError(
                f"data loader: DistributedSampler(rank={sampler.rank}, num_replicas={sampler.num_replicas}) "
                f"does not match the loader's dp_rank={dp_rank}, dp_world_size={dp_world}"
            )
        return remap.INTERLEAVED, {
            "dataset_len": len(sampler.dataset),  # type: ignore[arg-type]
            "seed": int(sampler.seed), "shuffle": bool(sampler.shuffle),
            "drop_last": bool(sampler.drop_last), "epoch": int(sampler.epoch),
        }
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    dataset = loader.dataset
    if isinstance(dataset, HuggingFaceTextDataset):
        from datasets import Dataset

        if isinstance(dataset._original_data, Dataset):
            return remap.CONTIGUOUS, {"chunk_len": len(dataset._original_data)}
    return remap.OPAQUE, {}


def check_json(value: Any, key: str) -> None:
    """Refuse anything in a data-loader state that JSON cannot carry, naming its key."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_json(v, f"{key}/{i}")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int, bool)) and k is not None:
                raise StateMismatchError(f"data-loader state key {key}/{k!r}: dict key of type {type(k).__name__}")
            check_json(v, f"{key}/{k}")
        return
    hint = " (bytes are usually a pickle; ckptkit keeps loader state as JSON)" if isinstance(value, (bytes, bytearray)) else ""
    raise StateMismatchError(
        f"data-loader state key {key!r} holds a {type(value).__module__}.{type(value).__qualname__}, which is not "
        f"JSON-representable{hint}; ckptkit stores data-loader state as JSON only. Return plain ints, floats, "
        "strings, lists and dicts from the dataset/sampler state_dict, or exclude 'dataloader' from checkpoints"
    )


def loader_record(loader: Any) -> dict[str, Any]:
    """This rank's data-loader state as a JSON record: its DP rank, its kind and its (un-pickled) state."""
    kind, info = describe_loader(loader)
    state = StatefulDataLoader.state_dict(loader) if isinstance(loader, StatefulDataLoader) else loader.state_dict()
    check_json(state, DATALOADER)
    if kind == remap.INTERLEAVED:  # a loader saved before its first batch after a load: the sampler's count is stale
        state = remap.normalize_sampler_state(state, DATALOADER)
    dp_rank, dp_world = _dp_of(loader)
    return {"format": remap.RECORD_FORMAT, "kind": kind, "dp_rank": dp_rank, "dp_world_size": dp_world,
            "info": info, "state": state}


def apply_loader_state(loader: Any, state: dict[str, Any], info: Mapping[str, Any]) -> None:
    """Load ``state`` (a plain StatefulDataLoader state) into ``loader``, bypassing torchtitan's pickle wrapper."""
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, DistributedSampler) and "epoch" in info:
        sampler.set_epoch(int(info["epoch"]))  # the epoch picks the permutation; it is not in torchdata's state
    state = remap.normalize_sampler_state(state, DATALOADER)  # a record saved before normalize_sampler_state
    if isinstance(loader, StatefulDataLoader):
        StatefulDataLoader.load_state_dict(loader, state)
    else:
        loader.load_state_dict(state)


def _check_compatible(saved: Mapping[str, Any], kind: str, info: Mapping[str, Any], dp_rank: int, dp_world: int) -> None:
    where = f"data loader (dp rank {dp_rank} of {dp_world})"
    if saved["kind"] != kind:
        raise remap.DataLoaderRemapError(
            f"{where}: the checkpoint's loader is {saved['kind']!r}, this job's is {kind!r}; the DP degree "
            f"changed from {saved['dp_world_size']}, so positions can only be remapped between loaders of one kind"
        )
    if kind == remap.INTERLEAVED:
        for k in ("dataset_len", "seed", "shuffle", "drop_last"):
            if saved["info"].get(k) != info.get(k):
                raise remap.DataLoaderRemapError(
                    f"{where}: DistributedSampler {k} is {info.get(k)!r}, the checkpoint's was {saved['info'].get(k)!r}"
                )


def optimizer_guards(optimizers: Any) -> list[Any]:
    """What guards an overlapped snapshot: torchtitan's optimizers container (a torch Optimizer whose
    ``step`` steps every model part's optimizer) and each optimizer inside it. The inner ones matter
    when the container's own ``step`` is not what updates the weights (optimizers in backward step
    per parameter from gradient hooks). The gate runs before any other step pre-hook, so the MoE
    load-balancing hook's ``expert_bias`` update comes after the copy."""
    return [optimizers, *getattr(optimizers, "optimizers", [])]


# ---------------------------------------------------------------------- manager
class CkptkitCheckpointManager(BaseCheckpointManager):
    """torchtitan checkpoint manager backed by :class:`ckptkit.CheckpointManager` (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        async_mode: Literal["disabled", "async", "async_process", "async_with_pinned_mem"] = "disabled"
        """disabled: save synchronously; async: persist on a background thread; async_process (alias
        async_with_pinned_mem): persist from shared memory in a writer process."""

        storage_options: dict[str, Any] = field(default_factory=dict)
        """Passed to the storage backend (s3fs for s3:// folders: endpoint_url, key, secret, ...)."""

        local_dir: str | None = None
        """Node-local directory written first, then the (object-store) folder; reads prefer verified local copies."""

        on_busy: Literal["wait", "skip"] = "wait"
        """A save requested while the previous one persists: wait for it, or skip this one (on every rank)."""

        max_staging_bytes: int | None = None
        """Per-rank budget for the asynchronous snapshot buffer (None: unbounded)."""

        snapshot: Literal["blocking", "overlap"] = "blocking"
        """blocking: a save returns once the state is copied. overlap: it returns before the copy, which runs in the
        background, and the optimizers' next step waits for it (ckptkit.AsyncOptions(snapshot=...), docs/overlap.md);
        needs an async_mode."""

        dataloader_resize: Literal["exact", "approximate"] = "exact"
        """When the DP degree changed: 'exact' refuses data-loader positions that cannot continue exactly;
        'approximate' keeps the consumed fraction of the epoch and logs how many samples repeat or skip."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            mode = self.async_mode.lower()
            self.async_mode = "async_process" if mode == "async_with_pinned_mem" else mode  # type: ignore[assignment]
            if self.async_mode not in ("disabled", "async", "async_process"):
                raise OptionsError(f"Invalid async_mode: {self.async_mode!r}")
            if self.initial_load_in_hf or self.last_save_in_hf:
                raise OptionsError(
                    "CkptkitCheckpointManager reads and writes ckptkit checkpoints only; for Hugging Face "
                    "safetensors use ckptkit's converters (ckptkit_converters.hf.exporter / `ckptkit convert`)"
                )
            if self.snapshot not in ("blocking", "overlap"):
                raise OptionsError(f"snapshot must be 'blocking' or 'overlap', got {self.snapshot!r}")
            if self.snapshot == "overlap" and self.async_mode == "disabled":
                raise OptionsError("snapshot='overlap' overlaps an asynchronous save's copy with training: it needs "
                                   "async_mode='async' or 'async_process' (a synchronous save blocks until written)")
            if self.dataloader_resize not in ("exact", "approximate"):
                raise OptionsError(f"dataloader_resize must be 'exact' or 'approximate', got {self.dataloader_resize!r}")

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future = None
        self.config = config
        self.folder = filesystem.join(base_folder, config.folder)
        self.interval = config.interval
        self.load_only = config.load_only
        self.exclude_from_loading = list(config.exclude_from_loading)
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.sd_adapter = sd_adapter  # kept for parity; HF formats go through ckptkit's converters
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers, DATALOADER: dataloader,
                            LR_SCHEDULER: lr_schedulers})
        self.expert_axes = expert_axes(model_parts)
        """Routed-expert parameters (FQN -> expert axis): saved with the expert axis in their rules."""
        self.asynchronous = config.async_mode != "disabled"
        options = AsyncOptions(executor=_EXECUTORS.get(config.async_mode, "thread"),  # type: ignore[arg-type]
                               on_busy=config.on_busy, max_staging_bytes=config.max_staging_bytes,
                               snapshot=config.snapshot)
        self.storage_options = dict(config.storage_options) or None
        self.manager = ckptkit.CheckpointManager(
            self.folder, keep=RetentionPolicy(keep_last=config.keep_latest_k or None),
            asynchronous=options if self.asynchronous else None, load=LoadOptions(per_rank_on_resize="skip"),
            naming=NAMING, storage_options=self.storage_options, local_dir=config.local_dir,
            guard=optimizer_guards(optimizers) if self.asynchronous and config.snapshot == "overlap" else None,
        )
        self._comm: Comm = resolve_comm(None)
        self._closed = False
        self.last_remap: remap.RemapReport | None = None
        """What the last load did to the data-loader positions (None: no DP-degree change)."""
        log.info("ckptkit checkpointing active: %s (async_mode=%s)", self.folder, config.async_mode)

    # ---------------------------------------------------------------- hooks
    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self.manager.close()

    def _maybe_wait_for_staging(self) -> None:
        """A blocking snapshot: nothing to wait for (ckptkit's save returns once it is taken). An overlapped
        one: wait for its background copy (torchtitan's trainer calls this right before the optimizers'
        step, whose hook would wait for it too)."""
        self.manager.wait_snapshot()

    def _wait_for_saving(self) -> None:
        self.manager.wait()
        self.save_future = None

    def _should_save(self, step: int, last_step: bool) -> bool:
        if self.load_only:
            return False
        if step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or step % self.interval == 0

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        begin = time.monotonic()
        self._refuse_other_naming(curr_step)
        if last_step:
            # torchtitan writes the final checkpoint synchronously, optionally model-only in export_dtype
            self.manager.wait()
            model_only = self.config.last_save_model_only
            handle = self.manager.save(curr_step, self._state_to_save(model_only=model_only, export=model_only, step=curr_step))
            self.manager.wait()
            self.save_future = None
            log.info("saved the final %scheckpoint of step %d in %.2fs", "model-only " if model_only else "",
                     curr_step, time.monotonic() - begin)
            return handle is not None
        handle = self.manager.save(curr_step, self._state_to_save(model_only=False, step=curr_step))
        if handle is None:
            log.warning("checkpoint of step %d skipped: the previous save is still persisting (on_busy='skip')", curr_step)
            return False
        if self.asynchronous:
            self.save_future = handle.committed
        log.info("%s checkpoint of step %d in %.2fs", "staged" if self.asynchronous else "saved", curr_step,
                 time.monotonic() - begin)
        return True

    def _refuse_other_naming(self, step: int) -> None:
        """A step committed under ckptkit's older name (``step-0000500``) is never saved again as
        ``step-500``: one checkpoint per step, as for a same-name folder (rank 0 looks, all agree)."""
        listed, unlisted = first_rank_does(
            self._comm, lambda: [r.name for r in self.manager.records()
                                 if r.step == step and r.committed and r.name != NAMING.name(step)],
            "listing the checkpoint folder")
        if unlisted is not None:
            raise SaveError(f"{self.folder}: could not list the checkpoints on rank 0 to make sure step {step} is not "
                            f"committed under another name ({unlisted}); nothing was saved")
        if listed:
            raise SaveError(f"{self.folder}/{listed[0]} already holds a committed checkpoint of step {step}; ckptkit "
                            "never overwrites one (resume from the newest step, or delete the newer checkpoints first)")

    def _load(self, step: int = -1) -> bool:
        if step != -1:
            # rank 0 lists, every rank gets its answer: a listing failing on one rank left the others waiting
            committed, unlisted = first_rank_does(
                self._comm, lambda: [r.step for r in self.manager.records() if r.committed], "listing the checkpoints")
            if unlisted is not None:
                raise CheckpointUnreadableError(f"{self.folder}: could not list the checkpoints on rank 0 to find step "
                                                f"{step} ({unlisted})")
            if step not in committed:
                raise FileNotFoundError(f"--checkpoint.load_step={step}: no committed ckptkit checkpoint of step "
                                        f"{step} ({NAMING.name(step)} or {StepNaming().name(step)}) under {self.folder}")
            self._restore(step, explicit=True)
            return True
        point = resume_point(self.manager, DCP)  # raises if a newer one cannot be read, or is DCP's
        if point.latest is not None:
            return self._restore(None, explicit=False, point=point)
        warn_uncommitted(self.manager.root, self.folder)
        path = self.config.initial_load_path
        if not path:
            log.info("no ckptkit checkpoint under %s: a fresh start", self.folder)
            return False
        meta = self._read_meta(path)
        model_only = self.config.initial_load_model_only or meta["model_only"]
        if model_only and not self.config.initial_load_model_only:
            log.warning("%s is a model-only checkpoint: loading the model only", path)
        state = self._state_to_load(model_only=model_only, meta=meta)
        strict = self._check_keys(state, path, model_only, meta["manifest"])
        ckptkit.load(state, path, strict=strict, storage_options=self.storage_options,
                     options=LoadOptions(per_rank_on_resize="skip"))
        self._apply(state, meta, path)
        log.info("loaded the initial checkpoint %s%s", path, " (model only)" if model_only else "")
        return True

    # ------------------------------------------------------------- internals
    def _restore(self, step: int | None, *, explicit: bool, point: ResumePoint | None = None) -> bool:
        """Load ``step`` (explicit), or the newest checkpoint every rank sees that loads and verifies,
        never one older than a DCP checkpoint of the run (``point``: :func:`resume_point`'s)."""
        from ckptkit.errors import RestoreFloorError

        bound = step
        while True:
            if bound is None:
                bound = self.manager.latest_common_step()
                if bound is None:
                    return False
            path = self.manager.step_url(bound)  # the committed folder of that step, of either naming
            meta = self._read_meta(path)
            state = self._state_to_load(model_only=meta["model_only"], meta=meta)
            strict = self._check_keys(state, path, meta["model_only"], meta["manifest"])
            if explicit:
                ckptkit.load(state, path, strict=strict, storage_options=self.storage_options,
                             options=LoadOptions(per_rank_on_resize="skip"))
                got = bound
            else:
                try:
                    got = self.manager.restore_latest(state, strict=strict, at_most=bound,
                                                      at_least=None if point is None else point.at_least)
                except RestoreFloorError as exc:  # damaged down to a DCP step: older would go back in time
                    raise refuse_fallback_past(point, exc) from exc  # type: ignore[arg-type]
                if got is None:
                    return False
            if got == bound:
                self._apply(state, meta, path)
                log.info("loaded %s%s", path, " (model only)" if meta["model_only"] else "")
                return True
            bound = got  # the newest was damaged; what restore_latest loaded may need another state shape

    def _read_meta(self, path: str) -> dict[str, Any]:
        manifest = read_manifest(open_store(path, self.storage_options))
        raw = manifest.values.get(META)
        if raw is None:  # a ckptkit checkpoint not written by this manager (e.g. an initial_load_path)
            return {"model_only": not any(k.startswith(f"{OPTIMIZER}/") for k in manifest.tensors),
                    "dataloader": None, "present": False, "manifest": manifest}
        meta = {**json.loads(decode_value(raw, f"{path}: {META}")), "present": True, "manifest": manifest}
        if meta.get("dataloader") is not None and DATALOADER not in manifest.per_rank_keys:
            meta["loader_dropped"] = path  # saved, then dropped: `ckptkit reshard` drops per-rank values
        return meta

    def _state_to_save(self, *, model_only: bool, export: bool = False, step: int = -1) -> dict[str, Any]:
        """The state to save, once every rank prepared its own (:func:`agreed_preparation`): one rank's
        failure raises on every rank, naming it, before any of the save's collectives."""
        state, dp_ranks = agreed_preparation(self._comm, lambda: self._local_state(model_only, export),
                                             f"checkpoint of step {step}")
        loader_meta = None
        if DATALOADER in state:
            loader_meta = self._loader_meta(dp_ranks)
        state[META] = json.dumps({"format": 1, "model_only": model_only, "dataloader": loader_meta})
        return state

    def _local_state(self, model_only: bool, export: bool) -> tuple[dict[str, Any], Any]:
        """This rank's state and its data loader's ``[dp_rank, dp_world_size]`` (None: no loader saved)."""
        model = self.states[MODEL].state_dict()
        if export:
            model = {k: v.to(self.export_dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                     for k, v in model.items()}
        state: dict[str, Any] = {MODEL: mark_model(model, self.expert_axes)}
        dp = None
        if not model_only:
            for key, obj in self.states.items():
                if key == MODEL or obj is None:
                    continue
                if key == DATALOADER:
                    record = loader_record(obj)
                    state[key] = PerRank(record)
                    dp = [record["dp_rank"], record["dp_world_size"]]
                elif key == OPTIMIZER:
                    state[key] = mark_optimizer(obj.state_dict(), self.expert_axes)
                else:
                    state[key] = obj.state_dict()
        return state, dp

    def _loader_meta(self, dp_ranks: list[Any]) -> dict[str, Any]:
        """Which global rank holds each DP rank's loader state, from every rank's ``[dp_rank, dp_world_size]``
        (gathered with the preparation's agreement, so it costs no collective of its own)."""
        worlds = {d[1] for d in dp_ranks}
        if len(worlds) != 1:
            raise StateMismatchError(f"data loader: the ranks disagree on the DP degree ({sorted(map(str, worlds))})")
        dp_world = worlds.pop()
        holders = None
        if dp_world is not None and all(d[0] is not None for d in dp_ranks):
            ranks = [int(d[0]) for d in dp_ranks]
            holders = []
            for k in range(int(dp_world)):
                mine = [g for g, d in enumerate(ranks) if d == k]
                if not mine:
                    raise StateMismatchError(f"data loader: no rank holds dp rank {k} of {dp_world} (dp ranks {ranks})")
                holders.append(mine[0])
        return {"dp_world_size": dp_world, "holders": holders, "world_size": self._comm.world_size}

    def _state_to_load(self, *, model_only: bool, meta: Mapping[str, Any]) -> dict[str, Any]:
        for key in self.exclude_from_loading:
            if key not in self.states:
                raise OptionsError(f"{key} not found in state_dict.")  # torchtitan's message
        state: dict[str, Any] = {MODEL: self.states[MODEL].state_dict()}
        if meta.get("present", True):
            state[META] = ""
        if model_only:
            return state
        for key, obj in self.states.items():
            if key in (MODEL, *self.exclude_from_loading) or obj is None:
                continue
            if key == DATALOADER:
                if meta.get("loader_dropped"):
                    raise MissingKeysError(
                        f"{meta['loader_dropped']}: the data loader's state is not in this checkpoint: it was saved, and its per-rank "
                        "values were then dropped (`ckptkit reshard` does that; they belong to the source's "
                        "ranks). Set checkpoint.exclude_from_loading=['dataloader'] to resume with a fresh data "
                        "loader, or resume from the original checkpoint, which loads at any layout with its "
                        "data-loader positions remapped")
                if meta.get("dataloader") is None:
                    log.warning("the checkpoint holds no data-loader state; the data loader starts fresh")
                    continue
                state[key] = PerRank(None)
            else:
                state[key] = obj.state_dict()
        return state

    def _check_keys(self, state: dict[str, Any], path: str, model_only: bool, manifest: Any) -> bool:
        """Strict loading unless entries are left out on purpose; then the same two checks here, the
        unexpected one sparing only what was left out (:func:`check_keys`), against ``manifest``
        (:meth:`_read_meta`'s). Collective."""
        if not (model_only or self.exclude_from_loading):
            return True
        check_keys(self._comm, manifest, state, path, excluded=self.exclude_from_loading,
                   only=MODEL if model_only else None)
        return False

    def _apply(self, state: dict[str, Any], meta: Mapping[str, Any], path: str) -> None:
        self.last_remap = None
        take_rank0_values(self._comm, meta["manifest"], state, path)  # a resize: rank 0's values, as documented
        self.states[MODEL].load_state_dict(state[MODEL])
        for key, obj in self.states.items():
            if key in (MODEL, DATALOADER) or key not in state:
                continue
            obj.load_state_dict(state[key])
        if DATALOADER in state:
            self._restore_loader(state[DATALOADER], meta["dataloader"], path)

    def _restore_loader(self, own: PerRank, saved: Mapping[str, Any], path: str) -> None:
        loader = self.states[DATALOADER]
        dp_rank, dp_world = _dp_of(loader)
        record = own.value
        if isinstance(record, dict) and (record.get("dp_rank"), record.get("dp_world_size")) == (dp_rank, dp_world):
            apply_loader_state(loader, record["state"], record.get("info", {}))
            return
        if dp_rank is None or saved.get("holders") is None:
            raise StateMismatchError(
                f"{path}: the data loader has no DP rank (not a torchtitan ParallelAwareDataloader or a "
                "DistributedSampler loader), so its per-rank state cannot be matched after the world size changed"
            )
        holders = list(saved["holders"])
        if saved["dp_world_size"] == dp_world:  # only TP/PP (or the world) changed: this DP rank's own state
            chosen = self._read_records(path, holders, [int(dp_rank)])[0]
            apply_loader_state(loader, chosen["state"], chosen.get("info", {}))
            return
        records = self._read_records(path, holders, range(len(holders)))
        kind, info = describe_loader(loader)
        _check_compatible(records[0], kind, info, dp_rank, dp_world)  # type: ignore[arg-type]
        states, report = remap.remap_records(records, int(dp_world), policy=self.config.dataloader_resize)  # type: ignore[arg-type]
        if kind == remap.CONTIGUOUS:
            n = sum(int(r["info"]["chunk_len"]) for r in records)
            a, b = remap.contiguous_bounds(n, int(dp_world))[dp_rank]  # type: ignore[index]
            if info.get("chunk_len") != b - a:
                raise remap.DataLoaderRemapError(
                    f"data loader dp rank {dp_rank}: its dataset block has {info.get('chunk_len')} documents, the "
                    f"contiguous split of the checkpoint's {n} documents over {dp_world} ranks gives {b - a}")
        apply_loader_state(loader, states[dp_rank], records[0].get("info", {}))  # type: ignore[index]
        if self._comm.rank == 0:
            (log.info if report.exact else log.warning)(
                "data loader remapped from %d to %d DP ranks (%s, %s): %d samples consumed%s",
                report.old_world, report.new_world, report.kind, "exact" if report.exact else "approximate",
                report.consumed, f"; {report.note}" if report.note else "")
        self.last_remap = report

    def _read_records(self, path: str, holders: list[int], dp_ranks: Any) -> list[dict[str, Any]]:
        """The saved loader records of ``dp_ranks``, from the indexes of the ranks that hold them."""
        store = open_store(path, self.storage_options)
        manifest = read_manifest(store)
        wanted = [(k, holders[k]) for k in dp_ranks]
        indexes = read_indexes(store, manifest, {g for _, g in wanted})
        out = []
        for k, g in wanted:
            if DATALOADER not in indexes[g].values:
                raise CheckpointNotFoundError(f"{path}: rank {g}'s index holds no data-loader state for dp rank {k}")
            out.append(decode_value(indexes[g].values[DATALOADER], f"{path}: dataloader of rank {g}"))
        return out
