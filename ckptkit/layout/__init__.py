"""The layout core: boxes, pieces, grid layouts, parallel configs, rules, manifest schema.

Standard library only (no torch, fsspec or framework imports): everything a
checkpoint's placement in model space needs, testable without a process group.
"""

from ckptkit.layout.box import Box, Region, row_major_strides
from ckptkit.layout.config import ParallelConfig
from ckptkit.layout.grid import Fused, GridLayout, Mesh, On, Replicate, Shard
from ckptkit.layout.index import Index, IndexEntry
from ckptkit.layout.manifest import ExplicitLayout, IndexRef, Manifest, TensorMeta
from ckptkit.layout.pieces import LocalBox, LocalFlat, Piece, box_piece, flat_piece
from ckptkit.layout.rules import PartitionRule

__all__ = [
    "Box", "Region", "row_major_strides", "ParallelConfig", "Fused", "GridLayout", "Mesh", "On",
    "Replicate", "Shard", "ExplicitLayout", "Index", "IndexEntry", "IndexRef", "Manifest", "TensorMeta",
    "LocalBox", "LocalFlat", "Piece", "box_piece", "flat_piece", "PartitionRule",
]
