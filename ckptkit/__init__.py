"""ckptkit: sharded, resharding, pickle-free checkpoints for large-model training.

    import ckptkit
    ckptkit.save(state, "runs/exp1/step-100")   # every rank writes only its own pieces
    ckptkit.load(state, "runs/exp1/step-100")   # in place, at this job's layout

The torch-facing names (save, load, Sharded, ...) are imported on first use,
so the layout core, the catalog and the CLI's metadata commands start without
importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import ckptkit.gloo_exit  # noqa: F401 - registers the at-exit wait for gloo's threads (its docstring)

from ckptkit.errors import (
    CheckpointNotFoundError,
    CheckpointUnreadableError,
    CommitOutcomeUnknownError,
    CkptkitError,
    CorruptCheckpointError,
    CoverageError,
    DTypeMismatchError,
    ForeignCheckpointError,
    LayoutError,
    LoadStalledError,
    ManifestError,
    MissingKeysError,
    OptionsError,
    PeerFailureError,
    RestoreFloorError,
    SaveError,
    PreviousSaveFailedError,
    ShapeMismatchError,
    SnapshotRaceError,
    StateMismatchError,
    StorageError,
    TooLargeError,
    UncommittedCheckpointError,
    UnexpectedKeysError,
    UnsafePathError,
    UnsupportedVersionError,
)
from ckptkit.memory.options import MemoryTier
from ckptkit.layout import Box, ParallelConfig, PartitionRule, Piece, Region, box_piece, flat_piece
from ckptkit.options import AsyncOptions, LoadOptions, SaveOptions
from ckptkit.retention import BestK, RetentionPolicy
from ckptkit.resilience.policy import SpikePolicy
from ckptkit.version import __version__

if TYPE_CHECKING:
    from ckptkit.api import close_async, load, save, save_async
    from ckptkit.engine.async_save import SaveHandle
    from ckptkit.manager import CheckpointManager, SavePolicy
    from ckptkit.memory.restore import RestoreInfo
    from ckptkit.run_folder import StepNaming
    from ckptkit.resilience.controller import ResilienceController, TrainingStopped
    from ckptkit.resilience.incidents import IncidentLogOptions
    from ckptkit.resilience.lr import ScaledLR
    from ckptkit.engine.load_progress import LoadProgress
    from ckptkit.engine.loader import LoadResult
    from ckptkit.engine.saver import SaveResult
    from ckptkit.engine.state import Experts, PerRank, Sharded
    from ckptkit.offline import (
        CheckpointView,
        ReshardOptions,
        describe,
        diff,
        list_checkpoints,
        open,
        plan_reshard,
        reshard,
        verify,
    )

_LAZY = {
    "save": "ckptkit.api",
    "load": "ckptkit.api",
    "save_async": "ckptkit.api",
    "close_async": "ckptkit.api",
    "SaveHandle": "ckptkit.engine.async_save",
    "CheckpointManager": "ckptkit.manager",
    "SavePolicy": "ckptkit.manager",
    "RestoreInfo": "ckptkit.memory.restore",
    "StepNaming": "ckptkit.run_folder",
    "ResilienceController": "ckptkit.resilience.controller",
    "IncidentLogOptions": "ckptkit.resilience.incidents",
    "TrainingStopped": "ckptkit.resilience.controller",
    "ScaledLR": "ckptkit.resilience.lr",
    "SaveResult": "ckptkit.engine.saver",
    "LoadResult": "ckptkit.engine.loader",
    "LoadProgress": "ckptkit.engine.load_progress",
    "Sharded": "ckptkit.engine.state",
    "PerRank": "ckptkit.engine.state",
    "Experts": "ckptkit.engine.state",
    "open": "ckptkit.offline",  # not in __all__: a star import must not shadow builtins.open
    "CheckpointView": "ckptkit.offline",
    "list_checkpoints": "ckptkit.offline",
    "describe": "ckptkit.offline",
    "verify": "ckptkit.offline",
    "diff": "ckptkit.offline",
    "reshard": "ckptkit.offline",
    "plan_reshard": "ckptkit.offline",
    "ReshardOptions": "ckptkit.offline",
}


_SUBMODULES = {"offline", "resilience", "manager", "run_folder", "storage", "layout", "plan", "engine", "api", "cli", "retention", "memory"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        if name in _SUBMODULES:  # ckptkit.offline, ckptkit.resilience, ... without an explicit import
            return importlib.import_module(f"ckptkit.{name}")
        raise AttributeError(f"module 'ckptkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "save", "load", "save_async", "close_async", "SaveHandle", "AsyncOptions", "SaveResult", "LoadResult", "Sharded", "PerRank", "Experts", "SaveOptions", "LoadOptions",
    "Box", "Region", "Piece", "box_piece", "flat_piece", "ParallelConfig", "PartitionRule",
    "CkptkitError", "CheckpointNotFoundError", "CheckpointUnreadableError", "TooLargeError", "UncommittedCheckpointError", "ManifestError",
    "UnsupportedVersionError", "UnsafePathError", "CorruptCheckpointError", "StateMismatchError",
    "MissingKeysError", "UnexpectedKeysError", "DTypeMismatchError", "ShapeMismatchError",
    "CoverageError", "ForeignCheckpointError", "RestoreFloorError", "LayoutError", "StorageError", "CommitOutcomeUnknownError", "SaveError", "PreviousSaveFailedError", "SnapshotRaceError", "OptionsError", "PeerFailureError", "LoadStalledError", "LoadProgress",
    "CheckpointManager",
    "ResilienceController", "IncidentLogOptions", "TrainingStopped", "ScaledLR", "SpikePolicy", "CheckpointView",
    "SavePolicy", "MemoryTier", "RestoreInfo", "RetentionPolicy", "BestK", "StepNaming",
    "list_checkpoints", "describe", "verify", "diff", "reshard", "plan_reshard", "ReshardOptions",
    "__version__",
]
