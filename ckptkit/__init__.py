"""ckptkit: sharded, resharding, pickle-free checkpoints for large-model training.

    import ckptkit
    ckptkit.save(state, "runs/exp1/step-100")   # every rank writes only its own pieces
    ckptkit.load(state, "runs/exp1/step-100")   # in place, at this job's layout
"""

from ckptkit.api import load, save
from ckptkit.engine.loader import LoadResult
from ckptkit.engine.saver import VERSION as __version__
from ckptkit.engine.saver import SaveResult
from ckptkit.engine.state import PerRank, Sharded
from ckptkit.errors import (
    CheckpointNotFoundError,
    CkptkitError,
    CorruptCheckpointError,
    CoverageError,
    DTypeMismatchError,
    LayoutError,
    ManifestError,
    MissingKeysError,
    SaveError,
    ShapeMismatchError,
    StateMismatchError,
    StorageError,
    UncommittedCheckpointError,
    UnexpectedKeysError,
    UnsafePathError,
    UnsupportedVersionError,
)
from ckptkit.layout import Box, ParallelConfig, PartitionRule, Piece, Region, box_piece, flat_piece
from ckptkit.options import LoadOptions, SaveOptions

__all__ = [
    "save", "load", "SaveResult", "LoadResult", "Sharded", "PerRank", "SaveOptions", "LoadOptions",
    "Box", "Region", "Piece", "box_piece", "flat_piece", "ParallelConfig", "PartitionRule",
    "CkptkitError", "CheckpointNotFoundError", "UncommittedCheckpointError", "ManifestError",
    "UnsupportedVersionError", "UnsafePathError", "CorruptCheckpointError", "StateMismatchError",
    "MissingKeysError", "UnexpectedKeysError", "DTypeMismatchError", "ShapeMismatchError",
    "CoverageError", "LayoutError", "StorageError", "SaveError", "__version__",
]
