"""DeepSpeed's native ZeRO checkpoint files: names, safe reading, and what each file holds.

A native checkpoint is ``<dir>/latest`` (the newest tag, e.g. ``global_step200``)
and ``<dir>/<tag>/``:

* ZeRO 1/2: ``mp_rank_00_model_states.pt`` (the whole module in its training
  dtype, ``param_shapes`` per param group, ``buffer_names``, counters, the LR
  scheduler, ``ds_config``, and the client state merged into the same dict) and
  per DP rank ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` holding
  ``optimizer_state_dict`` with the rank's fp32 flat partition per group
  (``single_partition_of_fp32_groups``, stored without the trailing padding),
  the base optimizer's state dict (partition-shaped ``exp_avg`` ...),
  ``group_paddings``, ``param_slice_mappings``, ``zero_stage``.
* ZeRO 3: per DP rank ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` (the
  module with empty parameter tensors, buffers, the same metadata) and
  ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` with
  ``fp32_flat_groups`` (one flat fp32 partition per sub-group) and the base
  optimizer's state dict under ``optimizer_state_dict``.

(Read from ``deepspeed/runtime/engine.py``: ``_save_checkpoint``,
``_save_zero_checkpoint``, ``_get_rank_zero_ckpt_name``; and the optimizers'
``state_dict`` methods in ``deepspeed/runtime/zero/stage_1_and_2.py`` and
``stage3.py``. How partitions are cut: :mod:`ckptkit.layout.zero_partition`.)

What is trusted when reading: every file goes through
:func:`converters.safe_unpickle.load_pt` — ``torch.load`` with ckptkit's own allow-list
unpickler: what ``weights_only=True`` admits by default (tensors, containers, numbers,
strings, ``torch.Size``, ``OrderedDict``) plus exactly the stand-ins below, for this call
only (a class another library registered with ``add_safe_globals`` is not trusted here, and
torch's process-wide set is never touched). Which folder and files are read: the tag is one
plain name (``latest`` or the ``tag`` option, :mod:`converters.source_paths`), and every file
a regular file inside the checkpoint folder, checked before it is opened. Optimizer files name
three DeepSpeed globals; each is mapped to an inert stand-in defined here, so
no DeepSpeed code runs and DeepSpeed need not be installed to import:

* ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` -> :class:`LossScalerRecord`
  (an empty class; the unpickler only sets its ``__dict__``; its content is ignored);
* ``deepspeed.utils.tensor_fragment.fragment_address`` -> :class:`FragmentAddressRecord`
  (same; ``numel`` and ``start`` are read as ints);
* ``deepspeed.runtime.zero.config.ZeroStageEnum`` -> :class:`ZeroStage` (an
  ``int`` enum of the values 0-3).

Any other global makes ``torch.load`` refuse the file, reported as
:class:`converters.safe_unpickle.UnsafeCheckpointError` naming it and the file.
"""

from __future__ import annotations

import enum
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptkit.adapters.deepspeed_record import scalar_record
from ckptkit.errors import CheckpointNotFoundError, CkptkitError, ManifestError
from ckptkit.layout.strict_json import MAX_LAYOUT_INT
from ckptkit_converters.common import safe_unpickle as safe_unpickle
from ckptkit_converters.common.optimizer_steps import is_step_count
from ckptkit_converters.common.safe_unpickle import UnsafeCheckpointError  # noqa: F401 - what load_file raises
from ckptkit_converters.common.source_paths import inside, plain_name, read_pointer, regular_file

LATEST = "latest"
MODEL_STATES_12 = "mp_rank_00_model_states.pt"
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_([0-9]+)_mp_rank_([0-9]+)_optim_states\.pt$")
_MODEL3 = re.compile(r"^zero_pp_rank_([0-9]+)_mp_rank_([0-9]+)_model_states\.pt$")
EXPP_OPTIM = re.compile(r"^expp_rank_([0-9]+)_mp_rank_([0-9]+)_optim_states\.pt$")  # DeepSpeed-MoE without ZeRO

DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version", "checkpoint_parallel_dimensions", "ds_zero_partition_groups",
    "num_experts", "ds_autoep_layers",  # DeepSpeed-MoE (engine._save_moe_checkpoint)
})
"""Keys DeepSpeed writes into a model-states file itself; every other key is the client state."""


class LossScalerRecord:
    """Inert stand-in for DeepSpeed's ``LossScaler`` while unpickling (never used)."""


class FragmentAddressRecord:
    """Inert stand-in for DeepSpeed's ``fragment_address`` dataclass: ``numel`` and ``start``."""

    numel: int
    start: int


class ZeroStage(int, enum.Enum):
    """Stand-in for DeepSpeed's ``ZeroStageEnum`` (same values)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


_STAND_INS = [
    (LossScalerRecord, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (FragmentAddressRecord, "deepspeed.utils.tensor_fragment.fragment_address"),
    (ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]


def load_file(path: str) -> dict[str, Any]:
    """One DeepSpeed ``.pt`` file through :func:`converters.safe_unpickle.load_pt` with exactly the
    stand-ins above (the same rule as every ``.pt`` ckptkit opens: nothing else trusted)."""
    data = safe_unpickle.load_pt(path, _STAND_INS, what="DeepSpeed")
    if not isinstance(data, dict):
        raise ManifestError(f"{path}: expected a dict, got {type(data).__name__}")
    return data


@dataclass(frozen=True)
class NativeFiles:
    """The files of one native checkpoint tag, saved at ZeRO stage ``zero_stage`` by ``dp`` ranks."""

    folder: str
    tag: str
    zero_stage: int
    dp: int
    optim: tuple[str, ...]
    """Optimizer-state file of each DP rank."""
    model: tuple[str, ...]
    """Model-states files: one (ZeRO 1/2) or one per DP rank (ZeRO 3)."""

    @property
    def stage(self) -> int:
        """Deprecated name of :attr:`zero_stage` (one more release)."""
        warnings.warn("NativeFiles.stage is deprecated and will be removed in the next release: use "
                      "NativeFiles.zero_stage", DeprecationWarning, stacklevel=2)
        return self.zero_stage


def read_tag(folder: str, tag: str | None) -> str:
    """The tag to import: ``tag`` when given (the ``tag`` option, CLI ``--tag``), else what ``folder/latest``
    names. Either way it must be one plain folder name (:func:`converters.source_paths.plain_name`),
    checked before any file of the tag is opened: ``latest`` naming ``../elsewhere/global_step1`` is an
    error naming ``latest``, never a read outside ``folder``."""
    if tag is not None:
        return plain_name(tag, f"{folder}: the tag option (CLI --tag)")
    latest = os.path.join(folder, LATEST)
    text = read_pointer(folder, LATEST)
    if text is None:
        raise CheckpointNotFoundError(f"{folder}: no '{LATEST}' file and no tag given (is this a DeepSpeed "
                                      "checkpoint directory, the one passed to engine.save_checkpoint?)")
    return plain_name(text, latest)


def tag_dir(folder: str, tag: str) -> str:
    """``folder/tag``, refused (naming it) when it is a link that leaves ``folder``."""
    return inside(folder, os.path.join(folder, tag), "tag folder")


def is_deepspeed_checkpoint(folder: str) -> bool:
    """True if ``folder`` is a local native DeepSpeed checkpoint folder (``latest`` naming a ZeRO tag, or
    a DeepSpeed-MoE tag saved without ZeRO: ``expp_rank_*`` optimizer files) — and also when its ``latest``
    file names something that is not a plain tag, or cannot be read safely: detected, the import then fails
    with an error naming ``latest`` instead of the folder looking like no checkpoint at all."""
    try:
        tag = read_tag(folder, None)
        where = tag_dir(folder, tag)
    except CheckpointNotFoundError:
        return False
    except CkptkitError:
        return True
    except OSError:
        return False
    return os.path.isdir(where) and any(_OPTIM.match(n) or EXPP_OPTIM.match(n) for n in os.listdir(where))


def resolve_tag(folder: str, tag: str | None) -> tuple[str, str]:
    """The tag to import and its folder, which must exist: a ``latest`` truncated or left behind by a
    crash names a folder that is not there, and the error says that ``latest`` (or the tag option)
    named it, since the file is what the user must look at, not the folder that never existed."""
    given = tag is not None
    tag = read_tag(folder, tag)
    where = tag_dir(folder, tag)
    if not os.path.isdir(where):
        source = "the tag option (CLI --tag)" if given else os.path.join(folder, LATEST)
        raise CheckpointNotFoundError(f"{source} names tag {tag!r}, which is not a folder of {folder} "
                                      f"(no {where}{os.sep}); expected the tag folder engine.save_checkpoint wrote")
    return tag, where


def optim_file_name(rank: int, prefix: str = "") -> str:
    """The optimizer file of DP rank ``rank`` as DeepSpeed names it (``prefix``: ``bf16_`` or none)."""
    return f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def model3_file_name(rank: int) -> str:
    """The ZeRO-3 model-states file of DP rank ``rank`` as DeepSpeed names it."""
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def missing_rank_files(where: str, present: dict[int, str], name: Callable[[int], str], upto: int) -> list[str]:
    """The files of ranks ``0..upto-1`` absent from ``present`` (rank -> path), by the name DeepSpeed
    gives them (``name(rank)``), so an error points at what was deleted rather than at what is left."""
    return [os.path.join(where, name(r)) for r in range(upto) if r not in present]


def _check_ranks(where: str, files: dict[int, str], what: str, name: Callable[[int], str]) -> None:
    """Refuse rank files that are not numbered ``0..N-1``, naming the missing ones."""
    top = max(files) + 1
    if sorted(files) != list(range(top)):
        missing = missing_rank_files(where, files, name, top)
        raise ManifestError(f"{where}: {what} for DP ranks {sorted(files)}, expected 0..{top - 1}: "
                            f"missing {', '.join(missing)}")


def _prefix(optim: dict[int, str]) -> str:
    """The ``bf16_`` prefix the optimizer files carry, if they all do (for naming a missing one)."""
    return "bf16_" if all(os.path.basename(p).startswith("bf16_") for p in optim.values()) else ""


def find_files(folder: str, tag: str | None = None) -> NativeFiles:
    """Which files make up the checkpoint ``folder``/``tag`` (default: the ``latest`` tag). Every file is
    checked to be a regular file inside ``folder`` before anything is read."""
    tag, where = resolve_tag(folder, tag)
    optim: dict[int, str] = {}
    model3: dict[int, str] = {}
    for name in sorted(os.listdir(where)):
        m = _OPTIM.match(name) or _MODEL3.match(name)
        if m is None:
            continue
        mp = int(m.groups()[-1])
        if mp != 0:
            raise ManifestError(f"{where}/{name}: model-parallel rank {mp}; only pure data parallelism "
                                "(mp_rank_00) is supported")
        rank = int(m.groups()[-2])
        target = optim if name.endswith("_optim_states.pt") else model3
        if rank in target:
            raise ManifestError(f"{where}: two optimizer files for DP rank {rank} (bf16_ and plain)")
        target[rank] = regular_file(folder, os.path.join(where, name))
    if not optim:
        raise CheckpointNotFoundError(f"{where}: no *zero_pp_rank_*_optim_states.pt files (not a ZeRO checkpoint)")
    prefix = _prefix(optim)
    _check_ranks(where, optim, "optimizer files", lambda r: optim_file_name(r, prefix))
    dp = len(optim)
    if model3:
        _check_ranks(where, model3, "ZeRO-3 model-states files", model3_file_name)
        if len(model3) != dp:
            missing = missing_rank_files(where, model3, model3_file_name, dp) + missing_rank_files(
                where, optim, lambda r: optim_file_name(r, prefix), len(model3))
            raise ManifestError(f"{where}: {dp} optimizer files but {len(model3)} ZeRO-3 model-states files: "
                                f"missing {', '.join(missing)}")
        return NativeFiles(folder, tag, 3, dp, tuple(optim[r] for r in range(dp)),
                           tuple(model3[r] for r in range(dp)))
    model = os.path.join(where, MODEL_STATES_12)
    if not os.path.lexists(model):
        raise CheckpointNotFoundError(f"{model}: missing: a ZeRO-1/2 checkpoint keeps its module there (and a "
                                      f"ZeRO-3 one has {model3_file_name(0)} per rank, also absent)")
    regular_file(folder, model)
    # stage 1 and 2 write the same files; the optimizer file records which
    zero_stage = optimizer_record(load_file(optim[0]), optim[0]).get("zero_stage")
    if type(zero_stage) not in (int, ZeroStage) or zero_stage not in (1, 2):
        raise ManifestError(f"{optim[0]}: zero_stage {zero_stage!r}; expected 1 or 2 (there are no per-rank "
                            "ZeRO-3 model-states files)")
    return NativeFiles(folder, tag, int(zero_stage), dp, tuple(optim[r] for r in range(dp)), (model,))


def optimizer_record(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    rec = data.get("optimizer_state_dict")
    if not isinstance(rec, dict):
        raise ManifestError(f"{where}: no 'optimizer_state_dict' dict")
    return rec


def base_optimizer_state(rec: Mapping[str, Any], zero_stage: int, where: str) -> dict[str, Any]:
    """The base (torch) optimizer's state dict inside a ZeRO optimizer record."""
    key = "base_optimizer_state" if zero_stage < 3 else "optimizer_state_dict"
    sd = rec.get(key)
    if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict) or not isinstance(sd.get("param_groups"), list) \
            or not all(isinstance(pg, dict) for pg in sd["param_groups"]):
        raise ManifestError(f"{where}: '{key}' is not an optimizer state dict (a rigid ZeRO checkpoint); "
                            "elastic or universal checkpoints are not supported here")
    return sd


def flat_fp32(rec: Mapping[str, Any], zero_stage: int, where: str) -> list[torch.Tensor]:
    """Each flat group's fp32 partition of a ZeRO optimizer record (its key differs at ZeRO 3)."""
    key = "single_partition_of_fp32_groups" if zero_stage < 3 else "fp32_flat_groups"
    groups = rec.get(key)
    if not isinstance(groups, list) or not all(isinstance(t, torch.Tensor) for t in groups):
        raise ManifestError(f"{where}: '{key}' is not a list of tensors")
    return groups


def param_shapes(model: Mapping[str, Any], where: str) -> list[dict[str, tuple[int, ...]]]:
    groups = model.get("param_shapes")
    if isinstance(groups, dict):
        groups = [groups]
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise ManifestError(f"{where}: 'param_shapes' is not a list of per-group name -> shape maps")
    out = []
    for i, g in enumerate(groups):
        shapes = {}
        for n, s in g.items():
            if not isinstance(n, str) or not isinstance(s, (tuple, list)) or not all(
                    type(d) is int and 0 <= d <= MAX_LAYOUT_INT for d in s):
                raise ManifestError(f"{where}: param_shapes group {i}: {n!r} -> {s!r} is not a parameter name "
                                    "with a shape of non-negative integers")
            shapes[n] = tuple(s)
        out.append(shapes)
    return out


def scalar(value: Any, where: str) -> dict[str, Any]:
    """One non-tensor-shaped entry of a base optimizer's per-parameter state (Adam's ``step``) as the
    adapter records it, by the live adapter's own rule
    (:func:`ckptkit.adapters.deepspeed_record.scalar_record`): a one-element tensor by dtype and value,
    or a plain number; anything else refused, naming ``where``."""
    return scalar_record(value, where)


def check_step(scalars: Mapping[str, Any], where: str) -> None:
    """Refuse a recorded Adam ``step`` (:func:`scalar`'s record) that is not a count of steps: a NaN, infinite,
    negative or fractional one is a damaged optimizer state, and the adapter's resume would run Adam's bias
    correction on it (NaN losses from the first step)."""
    step = scalars.get("step", {}).get("value") if isinstance(scalars.get("step"), Mapping) else None
    if step is not None and not is_step_count(step):
        raise ManifestError(f"{where}: optimizer step {step!r} is not a count of steps (a finite whole number "
                            ">= 0): a damaged optimizer state")


def group_name(param_group: Mapping[str, Any], where: str) -> str:
    """The ``name`` of a DeepSpeed-MoE expert param group (``ep_size_<EP>``), refused when it is not a string."""
    name = param_group.get("name")
    if not isinstance(name, str):
        raise ManifestError(f"{where}: expert param group name {name!r} is not a string (DeepSpeed names it "
                            "ep_size_<EP>)")
    return name
