"""Megatron's checkpoint files: names, what each holds, and how they are opened safely.

Two on-disk formats (read from megatron-core 0.16 ``dist_checkpointing`` and
Megatron-LM ``megatron/training/checkpointing.py``):

* **torch_dist** (``--ckpt-format torch_dist``): one directory, usually
  ``<save>/iter_XXXXXXX/``, with ``metadata.json`` (``{"sharded_backend":
  "torch_dist", ...}``), ``common.pt`` (``torch.save`` of every non-sharded
  item of the saved state dict: ``iteration``, ``checkpoint_version``, ``args``
  ...) and a DCP checkpoint (``.metadata`` + ``__{rank}_{i}.distcp``) keyed by
  Megatron's *sharded* keys (``decoder.layers.self_attention.linear_qkv.weight``
  with the global layer axis prepended). Megatron's ``.metadata`` carries, beyond
  plain DCP's, every rank's ``SavePlan`` (``Metadata.all_local_plans``, its
  save-plan cache), so its allow-list adds DCP's four planner dataclasses.
* **legacy** (``--ckpt-format torch``): ``<save>/latest_checkpointed_iteration.txt``
  and ``<save>/iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` per
  (tp, pp[, ep]) rank (``_PPP`` only when pp > 1), written by DP rank 0: a dict with
  ``args`` (an ``argparse.Namespace``), ``checkpoint_version``, ``iteration``,
  ``model`` (``state_dict_for_save_checkpoint()`` of the module: local layer
  numbers, TP-local tensors) or ``model0``, ``model1`` ... per virtual pipeline
  chunk, ``optimizer``, ``opt_param_scheduler``, ``rng_state`` (Python, numpy,
  torch and CUDA RNG states), ``num_floating_point_operations_so_far``.

Trust: every ``.pt`` is read with ``torch.load(weights_only=True)`` and the
inert stand-ins of :data:`FOREIGN_GLOBALS`; ``.metadata`` with the allow-list
unpickler of :mod:`converters.safe_unpickle` (DCP's classes plus
:data:`MEGATRON_METADATA_EXTRA`). Anything else a file names is refused before
it runs (docs/megatron.md, "Importing Megatron checkpoints").
"""

from __future__ import annotations

import json
import os
import pickle
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptkit.engine.offline_writer import ConvertResult
from ckptkit.errors import CheckpointNotFoundError, ManifestError
from ckptkit_converters.safe_unpickle import UnsafeCheckpointError, load_dcp_metadata

META_KEY = "megatron/meta"
MODEL = "model/"


@dataclass(frozen=True)
class MegatronConvertResult(ConvertResult):
    """A conversion's figures, the ``megatron/meta`` written or read, and what was left out."""

    meta: dict[str, Any] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()

CONFIG_NAME = "metadata.json"
COMMON_NAME = "common.pt"
LEGACY_FILE = "model_optim_rng.pt"
TRACKER = "latest_checkpointed_iteration.txt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


class ForeignRecord:
    """Inert stand-in for a foreign class or function while unpickling.

    Built with any arguments (kept in ``args``) and given any state (kept in
    ``state``, or merged into ``__dict__`` when it is a dict, which is how an
    ``argparse.Namespace`` arrives): it runs no foreign code and is only read
    as data afterwards.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state


def _reconstruct(*args: Any) -> ForeignRecord:
    """Stands in for numpy's array reconstructor: an inert record, never an array."""
    return ForeignRecord(*args)


FOREIGN_GLOBALS: tuple[tuple[Any, str], ...] = (
    (ForeignRecord, "argparse.Namespace"),  # args
    (ForeignRecord, "types.SimpleNamespace"),
    (ForeignRecord, "pathlib.PosixPath"),
    (ForeignRecord, "_io.BytesIO"),  # Transformer Engine's _extra_state
    (ForeignRecord, "signal.Signals"),  # args.exit_signal
    (_reconstruct, "numpy._core.multiarray._reconstruct"),  # rng_state['np_rng_state'] (numpy 2)
    (_reconstruct, "numpy.core.multiarray._reconstruct"),  # (numpy 1)
    (ForeignRecord, "numpy.ndarray"),
    (ForeignRecord, "numpy.dtype"),
    (ForeignRecord, "numpy.dtypes.UInt32DType"),
    (ForeignRecord, "megatron.core.transformer.enums.AttnBackend"),  # args.attention_backend
    (ForeignRecord, "megatron.core.transformer.enums.CudaGraphScope"),
    (ForeignRecord, "megatron.core.enums.ModelType"),
    (ForeignRecord, "megatron.core.optimizer.optimizer_config.OptimizerConfig"),
    (ForeignRecord, "megatron.core.rerun_state_machine.RerunDiagnostic"),
    (ForeignRecord, "megatron.core.rerun_state_machine.RerunMode"),
    (ForeignRecord, "megatron.core.rerun_state_machine.RerunState"),
)
"""Globals a Megatron ``.pt`` may name beyond ``weights_only``'s own (tensors, containers,
``torch`` dtypes, ``OrderedDict``, ``_codecs.encode``), each mapped to an inert stand-in.
The list mirrors megatron-core 0.16's own ``megatron/core/safe_globals.py`` (what Megatron
registers with ``add_safe_globals`` for its own loads), with stand-ins instead of the classes."""

_LOAD_LOCK = threading.Lock()


@contextmanager
def _only_stand_ins() -> Iterator[None]:
    """Exactly :data:`FOREIGN_GLOBALS` on top of torch's own allow-list, for one load.

    torch keeps user-allowed globals in one process-wide set: importing
    ``megatron.core`` registers the *real* classes under the same names
    (``megatron/core/safe_globals.py``), and which of two entries for a name
    wins would depend on set order. So the set is swapped for the stand-ins
    while the lock is held and restored afterwards (torch's ``safe_globals``
    context manager would also remove entries another thread still needs).
    """
    with _LOAD_LOCK:
        saved = torch.serialization.get_safe_globals()
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(list(FOREIGN_GLOBALS))
        try:
            yield
        finally:
            torch.serialization.clear_safe_globals()
            torch.serialization.add_safe_globals(saved)


def load_pt(path: str, *, mmap: bool = False) -> Any:
    """One Megatron ``.pt`` through ``torch.load(weights_only=True)`` and :data:`FOREIGN_GLOBALS`.

    A file naming any other global is refused by torch's restricted unpickler
    before the global is resolved, reported as :class:`UnsafeCheckpointError`
    with the file and the global. ``mmap``: tensors stay in the file until read
    (a first pass over a legacy checkpoint reads only names and shapes).
    """
    try:
        with _only_stand_ins():
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        lines = [ln for ln in str(exc).splitlines() if "GLOBAL" in ln or "Unsupported" in ln] or str(exc).splitlines()[:1]
        raise UnsafeCheckpointError(f"{path}: refused by torch.load(weights_only=True) with ckptkit's Megatron "
                                    f"stand-ins (nothing was executed): {' '.join(lines)[:400]}") from None
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: missing") from None
    except (RuntimeError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise ManifestError(f"{path}: not a readable torch.save file ({type(exc).__name__}: {exc})") from None


def _planner_classes() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import planner

    mod = "torch.distributed.checkpoint.planner"
    return {(mod, n): getattr(planner, n) for n in ("SavePlan", "WriteItem", "TensorWriteData", "WriteItemType")}


MEGATRON_METADATA_EXTRA = ("SavePlan", "WriteItem", "TensorWriteData", "WriteItemType")
"""``torch.distributed.checkpoint.planner`` classes (plain dataclasses and an enum) that
Megatron's ``.metadata`` names on top of plain DCP's (its cached ``all_local_plans``)."""


def load_metadata_pickle(data: bytes, where: str) -> Any:
    """A Megatron torch_dist ``.metadata`` through the DCP allow-list plus the planner classes."""
    return load_dcp_metadata(data, where, extra=_planner_classes())


def is_torch_dist(folder: str | os.PathLike[str]) -> bool:
    """True for a local Megatron torch_dist directory (``metadata.json`` naming torch_dist)."""
    path = os.path.join(folder, CONFIG_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError):
        return False


def read_config(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, CONFIG_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: missing (not a Megatron dist_checkpointing directory)") from None
    except ValueError as exc:
        raise ManifestError(f"{path}: not JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("sharded_backend") != "torch_dist":
        raise ManifestError(f"{path}: sharded_backend is {config.get('sharded_backend') if isinstance(config, dict) else config!r}, "
                            "only 'torch_dist' is supported (zarr and other Megatron backends are not)")
    return config


@dataclass(frozen=True)
class SavedArgs:
    """What a Megatron ``args`` namespace says about the run (None: not recorded)."""

    num_layers: int | None = None
    tp: int | None = None
    pp: int | None = None
    vpp: int | None = None
    divisible_by: int | None = None
    padded_vocab_size: int | None = None
    world_size: int | None = None
    untied: bool | None = None

    @staticmethod
    def of(args: Any) -> SavedArgs:
        fields = getattr(args, "__dict__", None) if args is not None else None
        fields = fields if isinstance(fields, dict) else {}

        def num(name: str) -> int | None:
            v = fields.get(name)
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        untied = fields.get("untie_embeddings_and_output_weights")
        return SavedArgs(num("num_layers"), num("tensor_model_parallel_size"), num("pipeline_model_parallel_size"),
                         num("virtual_pipeline_model_parallel_size"), num("make_vocab_size_divisible_by"),
                         num("padded_vocab_size"), num("world_size"), untied if isinstance(untied, bool) else None)


def iteration_of(state: Mapping[str, Any]) -> int:
    it = state.get("iteration", 0)
    return it if isinstance(it, int) and not isinstance(it, bool) else 0


@dataclass(frozen=True)
class LegacyFile:
    tp: int
    pp: int
    path: str


def legacy_files(iter_dir: str) -> list[LegacyFile]:
    """Every ``mp_rank_*/model_optim_rng.pt`` of a legacy iteration directory, checked complete."""
    if not os.path.isdir(iter_dir):
        raise CheckpointNotFoundError(f"{iter_dir}: no such directory (expected a Megatron iter_XXXXXXX folder)")
    found: dict[tuple[int, int], str] = {}
    for name in sorted(os.listdir(iter_dir)):
        m = _RANK_DIR.match(name)
        if m is None:
            continue
        if m.group(3) is not None:
            raise ManifestError(f"{iter_dir}/{name}: expert-parallel legacy checkpoints are not supported")
        path = os.path.join(iter_dir, name, LEGACY_FILE)
        if not os.path.exists(path):
            raise CheckpointNotFoundError(f"{path}: missing ({name} has no {LEGACY_FILE})")
        found[(int(m.group(1)), int(m.group(2) or 0))] = path
    if not found:
        raise CheckpointNotFoundError(f"{iter_dir}: no mp_rank_*/{LEGACY_FILE} (not a legacy Megatron checkpoint)")
    tp = max(t for t, _ in found) + 1
    pp = max(p for _, p in found) + 1
    missing = [f"mp_rank_{t:02d}_{p:03d}" for t in range(tp) for p in range(pp) if (t, p) not in found]
    if missing:
        raise CheckpointNotFoundError(f"{iter_dir}: rank folders {missing} are missing (tp={tp}, pp={pp})")
    return [LegacyFile(t, p, found[(t, p)]) for p in range(pp) for t in range(tp)]


def resolve_legacy_dir(path: str) -> str:
    """A legacy save root (with the tracker file) resolves to its latest ``iter_XXXXXXX``."""
    tracker = os.path.join(path, TRACKER)
    if os.path.exists(tracker):
        with open(tracker, encoding="utf-8") as f:
            text = f.read().strip()
        sub = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
        if sub is None:
            raise ManifestError(f"{tracker}: {text!r} is neither an iteration number nor 'release'")
        return os.path.join(path, sub)
    return path


def is_legacy(path: str) -> bool:
    """True for a local legacy Megatron save root or iteration directory."""
    try:
        d = resolve_legacy_dir(path)
        return os.path.isdir(d) and any(_RANK_DIR.match(n) for n in os.listdir(d))
    except (OSError, ManifestError, ValueError):
        return False
