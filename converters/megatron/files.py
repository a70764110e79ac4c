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

Trust: every ``.pt`` is read by :func:`ckptkit_converters.common.safe_unpickle.load_pt` —
``torch.load`` with ckptkit's call-local allow-list unpickler: ``weights_only``'s default
globals and exactly the inert stand-ins of :data:`FOREIGN_GLOBALS` (``args`` becomes a
:class:`~ckptkit_converters.common.safe_unpickle.NamespaceRecord` holding its attributes; :class:`SavedArgs` reads the few it needs); ``.metadata`` with the
allow-list unpickler of the same module (DCP's classes plus
:data:`MEGATRON_METADATA_EXTRA`). Anything else a file names is refused before
it runs (docs/megatron.md, "Importing Megatron checkpoints"). The tracker names an
iteration (ASCII digits) or ``release`` and nothing else; every file and folder read is
checked to lie inside the source folder (:mod:`ckptkit_converters.common.source_paths`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptkit.engine.offline_writer import ConvertResult
from ckptkit.errors import (
    CheckpointNotFoundError,
    CkptkitError,
    CorruptCheckpointError,
    ManifestError,
    UnsafePathError,
)
from ckptkit.layout.strict_json import load_json
from ckptkit.storage.local import LocalStore
from ckptkit_converters.common import safe_unpickle as safe_unpickle
from ckptkit_converters.common.safe_unpickle import (  # noqa: F401 - re-exported: UnsafeCheckpointError
    ForeignRecord,
    NamespaceRecord,
    UnsafeCheckpointError,
    load_dcp_metadata,
    namespace_fields,
)
from ckptkit_converters.common.source_paths import inside, plain_name, read_pointer, regular_file

META_KEY = "megatron/meta"
MODEL = "model/"


@dataclass(frozen=True)
class MegatronConvertResult(ConvertResult):
    """A conversion's figures, the ``megatron/meta`` written or read, and what was left out."""

    meta: dict[str, Any] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()

CONFIG_NAME = "metadata.json"
COMMON_NAME = "common.pt"
DCP_METADATA = ".metadata"  # DCP's own index: with *.distcp, the DCP part of a torch_dist folder
LEGACY_FILE = "model_optim_rng.pt"
TRACKER = "latest_checkpointed_iteration.txt"
MAX_CONFIG_BYTES = 1 << 20  # metadata.json: a few fields
_RANK_DIR = re.compile(r"^mp_rank_([0-9]{2})(?:_([0-9]{3}))?(?:_([0-9]{3}))?$")


def _reconstruct(*args: Any) -> ForeignRecord:
    """Stands in for numpy's array reconstructor: an inert record, never an array."""
    return ForeignRecord(*args)


FOREIGN_GLOBALS: tuple[tuple[Any, str], ...] = (
    (NamespaceRecord, "argparse.Namespace"),  # args
    (NamespaceRecord, "types.SimpleNamespace"),
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
``torch`` dtypes, ``OrderedDict``, ``_codecs.encode``), each mapped to an inert stand-in of
:mod:`ckptkit_converters.common.safe_unpickle`. The list mirrors megatron-core 0.16's own
``megatron/core/safe_globals.py`` (what Megatron registers with ``add_safe_globals`` for its
own loads), with stand-ins instead of the classes."""


def load_pt(path: str, *, mmap: bool = False) -> Any:
    """One Megatron ``.pt`` through :func:`ckptkit_converters.common.safe_unpickle.load_pt` with exactly
    :data:`FOREIGN_GLOBALS` (``mmap``: tensors stay in the file until read; a first pass over
    a legacy checkpoint reads only names and shapes)."""
    return safe_unpickle.load_pt(path, FOREIGN_GLOBALS, what="Megatron", mmap=mmap)


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


def _config_doc(folder: str) -> dict[str, Any] | None:
    """``metadata.json`` of ``folder`` through the store (regular file, inside, bounded) and the strict JSON
    loader; None when there is none."""
    if not os.path.lexists(os.path.join(folder, CONFIG_NAME)):
        return None
    try:
        data = LocalStore(folder).read_bytes(CONFIG_NAME, limit=MAX_CONFIG_BYTES)
    except CheckpointNotFoundError:
        return None
    return load_json(data, os.path.join(folder, CONFIG_NAME))


def _has_common(folder: str) -> bool:
    """Whether ``common.pt`` is there (anything by that name: what it is, the import checks)."""
    return os.path.lexists(os.path.join(folder, COMMON_NAME))


def _has_dcp_part(folder: str) -> bool:
    """Whether DCP's ``.metadata`` or a ``*.distcp`` file is there: one ``lexists``, and only without
    it one listing of the folder (detection stays cheap: nothing is opened)."""
    if os.path.lexists(os.path.join(folder, DCP_METADATA)):
        return True
    try:
        with os.scandir(folder) as entries:
            return any(e.name.endswith(".distcp") for e in entries)
    except OSError:
        return False


def is_torch_dist(folder: str | os.PathLike[str]) -> bool:
    """True for a local Megatron torch_dist directory: ``metadata.json`` naming torch_dist.

    Also True, so that the import fails naming ``metadata.json`` rather than reporting no legacy
    checkpoint, when that file cannot be read safely (a link out of the folder, a FIFO or device,
    too large) or, next to Megatron's ``common.pt``, is unparsable or names another backend, or is
    missing while ``common.pt`` and the DCP files are there. A plain DCP folder (no
    ``metadata.json``, no ``common.pt``) and a folder with an unrelated ``metadata.json`` and no
    ``common.pt`` are not Megatron's."""
    path = os.fspath(folder)
    try:
        config = _config_doc(path)
    except (UnsafePathError, CorruptCheckpointError):
        return True
    except (CkptkitError, OSError):
        return _has_common(path)
    if config is None:
        return _has_common(path) and _has_dcp_part(path)
    return config.get("sharded_backend") == "torch_dist" or _has_common(path)


def read_config(folder: str) -> dict[str, Any]:
    """``metadata.json`` of a torch_dist directory, refused (naming it) when missing, unreadable or
    naming a backend other than torch_dist: the import is then told what is wrong with that file
    rather than treating the folder as some other checkpoint."""
    path = os.path.join(folder, CONFIG_NAME)
    try:
        config = _config_doc(folder)
    except ManifestError as exc:
        raise ManifestError(f"{exc} (unreadable: a torch_dist folder's {CONFIG_NAME} is a JSON object "
                            "naming its sharded_backend, 'torch_dist')") from None
    if config is None:
        if _has_common(folder) and _has_dcp_part(folder):
            raise CheckpointNotFoundError(
                f"{path}: missing: the torch_dist folder lacks its {CONFIG_NAME} ({COMMON_NAME} and the DCP "
                "files are there; the save did not finish or the file was removed)")
        raise CheckpointNotFoundError(f"{path}: missing (not a Megatron dist_checkpointing directory)")
    if config.get("sharded_backend") != "torch_dist":
        raise ManifestError(f"{path}: sharded_backend is {config.get('sharded_backend')!r}, "
                            "only 'torch_dist' is supported (zarr and other Megatron backends are not)")
    return config


@dataclass(frozen=True)
class SavedArgs:
    """What the Megatron-LM ``args`` namespace a checkpoint carries says about the run (None: not
    recorded). Megatron-LM's ``generate_state_dict`` stores ``state_dict['args'] = args`` (the
    ``argparse.Namespace`` of the training run): in ``common.pt`` for torch_dist (every
    non-sharded item of the saved dict goes there), in every ``model_optim_rng.pt`` for legacy.
    ``vocab_size`` is Megatron-LM's ``--vocab-size`` (set for a ``NullTokenizer`` run or when
    given; otherwise ``None``: the tokenizer's size is not kept, only ``padded_vocab_size``)."""

    num_layers: int | None = None
    tp: int | None = None
    pp: int | None = None
    vpp: int | None = None
    divisible_by: int | None = None
    padded_vocab_size: int | None = None
    vocab_size: int | None = None
    world_size: int | None = None
    untied: bool | None = None
    recorded: bool = False
    """Whether the checkpoint had an ``args`` namespace at all."""

    @staticmethod
    def of(args: Any) -> SavedArgs:
        fields = namespace_fields(args)

        def num(name: str) -> int | None:
            v = fields.get(name)
            return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

        untied = fields.get("untie_embeddings_and_output_weights")
        return SavedArgs(num("num_layers"), num("tensor_model_parallel_size"), num("pipeline_model_parallel_size"),
                         num("virtual_pipeline_model_parallel_size"), num("make_vocab_size_divisible_by"),
                         num("padded_vocab_size"), num("vocab_size"), num("world_size"),
                         untied if isinstance(untied, bool) else None, bool(fields))


def iteration_of(state: Mapping[str, Any]) -> int:
    it = state.get("iteration", 0)
    return it if isinstance(it, int) and not isinstance(it, bool) else 0


@dataclass(frozen=True)
class LegacyFile:
    tp: int
    pp: int
    path: str


def legacy_files(iter_dir: str, root: str | None = None) -> list[LegacyFile]:
    """Every ``mp_rank_*/model_optim_rng.pt`` of a legacy iteration directory, checked complete, each a
    regular file inside ``root`` (the source folder the user gave; default ``iter_dir``)."""
    root = iter_dir if root is None else root
    if not os.path.isdir(iter_dir):
        raise CheckpointNotFoundError(f"{iter_dir}: no such directory (expected a Megatron iter_XXXXXXX folder)")
    inside(root, iter_dir, "iteration folder")
    found: dict[tuple[int, int], str] = {}
    for name in sorted(os.listdir(iter_dir)):
        m = _RANK_DIR.match(name)
        if m is None:
            continue
        if m.group(3) is not None:
            raise ManifestError(f"{iter_dir}/{name}: expert-parallel legacy checkpoints are not supported")
        path = os.path.join(iter_dir, name, LEGACY_FILE)
        if not os.path.lexists(path):
            raise CheckpointNotFoundError(f"{path}: missing ({name} has no {LEGACY_FILE})")
        found[(int(m.group(1)), int(m.group(2) or 0))] = regular_file(root, path)
    if not found:
        raise CheckpointNotFoundError(f"{iter_dir}: no mp_rank_*/{LEGACY_FILE} (not a legacy Megatron checkpoint)")
    tp = max(t for t, _ in found) + 1
    pp = max(p for _, p in found) + 1
    missing = [f"mp_rank_{t:02d}_{p:03d}" for t in range(tp) for p in range(pp) if (t, p) not in found]
    if missing:
        raise CheckpointNotFoundError(f"{iter_dir}: rank folders {missing} are missing (tp={tp}, pp={pp})")
    return [LegacyFile(t, p, found[(t, p)]) for p in range(pp) for t in range(tp)]


_ITERATION = re.compile(r"[0-9]{1,18}")
"""What Megatron-LM writes into its tracker: ``str(iteration)`` (ASCII digits), or ``release``."""


def tracker_iteration(path: str) -> str | None:
    """The folder a legacy save root's tracker names (``iter_XXXXXXX`` or ``release``); None without a tracker.

    Megatron-LM's ``read_metadata`` takes ``int(text)`` or the word ``release``; here the text must be
    ASCII digits (at most 18: not ``+5``, ``5.0``, ``0x10``, ``٣`` or ``1_000``, which ``int`` would
    take) or exactly ``release``, and the folder it gives one plain name
    (:func:`ckptkit_converters.common.source_paths.plain_name`) — checked before anything is opened."""
    tracker = os.path.join(path, TRACKER)
    text = read_pointer(path, TRACKER)
    if text is None:
        return None
    if text == "release":
        sub = "release"
    elif _ITERATION.fullmatch(text):
        sub = f"iter_{int(text):07d}"
    else:
        raise ManifestError(f"{tracker}: {text[:80]!a} is neither an iteration number (ASCII digits, at most 18) "
                            "nor 'release'")
    return plain_name(sub, tracker, "iteration folder")


def resolve_legacy_dir(path: str) -> str:
    """A legacy save root (with the tracker file) resolves to its latest ``iter_XXXXXXX``, refused (naming
    the tracker) when that folder is a link out of the save root."""
    sub = tracker_iteration(path)
    if sub is None:
        return path
    return inside(path, os.path.join(path, sub), f"iteration folder named by {TRACKER}")


def is_legacy(path: str) -> bool:
    """True for a local legacy Megatron save root or iteration directory. A save root is recognised by its
    tracker file alone — also when the tracker names an iteration that is not there, or something that is
    not an iteration, or cannot be read safely: detected, so that the import fails naming the tracker or
    the missing folder rather than the folder looking like no checkpoint at all."""
    try:
        if tracker_iteration(path) is not None:
            return True
    except CkptkitError:
        return True
    except (OSError, ValueError):
        return False
    try:
        return os.path.isdir(path) and any(_RANK_DIR.match(n) for n in os.listdir(path))
    except OSError:
        return False
