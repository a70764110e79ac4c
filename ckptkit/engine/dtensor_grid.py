"""DTensor -> grid layout: placements over a device mesh become a ckptkit rule.

A DTensor already states its layout (mesh + placements), so it maps exactly
onto :class:`~ckptkit.layout.grid.GridLayout`: ``Shard(d)`` -> ``Shard(d)``,
``_StridedShard(d, split_factor=k)`` (FSDP2 over a TP-sharded dim) ->
``Shard(d, split_factor=k)``, ``Replicate`` -> ``Replicate``. ``Partial``
holds pending reductions, not values, and is refused.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from ckptkit.errors import LayoutError
from ckptkit.layout.grid import GridLayout, Mesh
from ckptkit.layout.grid import Replicate as GridReplicate
from ckptkit.layout.grid import Shard as GridShard

_mesh_cache: dict[int, tuple[Any, Mesh]] = {}


def is_dtensor(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor)


def mesh_of(device_mesh: Any) -> Mesh:
    cached = _mesh_cache.get(id(device_mesh))
    if cached is not None and cached[0] is device_mesh:
        return cached[1]
    ranks = tuple(int(r) for r in device_mesh.mesh.flatten().tolist())
    names = device_mesh.mesh_dim_names or tuple(f"d{i}" for i in range(device_mesh.ndim))
    mesh = Mesh(tuple(names), tuple(device_mesh.mesh.shape), ranks)
    _mesh_cache[id(device_mesh)] = (device_mesh, mesh)
    return mesh


#: id(DTensor) -> (a weak reference to it, its placements, mesh and shape when described, the
#: layout, the coordinate): a training loop snapshots the same parameter and optimizer DTensors
#: every few steps, and describing one again costs more than the check that it has not changed.
#: An entry goes with its DTensor (the reference's callback), before its id can be another's.
_grid_cache: dict[int, tuple[Any, Any, Any, Any, GridLayout, tuple[int, ...]]] = {}


def grid_of(dt: DTensor, key: str) -> tuple[GridLayout, tuple[int, ...]]:
    """The grid layout of ``dt`` and this rank's coordinate in its mesh."""
    placements, device_mesh, shape = dt.placements, dt.device_mesh, dt.shape
    hit = _grid_cache.get(id(dt))
    if hit is not None and hit[0]() is dt and hit[1] == placements and hit[2] is device_mesh and hit[3] == shape:
        return hit[4], hit[5]
    layout, coord = _describe(dt, key)
    ident = id(dt)
    _grid_cache[ident] = (weakref.ref(dt, lambda _ref: _grid_cache.pop(ident, None)), placements, device_mesh,
                          shape, layout, coord)
    return layout, coord


def _describe(dt: DTensor, key: str) -> tuple[GridLayout, tuple[int, ...]]:
    placements = []
    for p in dt.placements:
        if isinstance(p, _StridedShard):
            placements.append(GridShard(p.dim, split_factor=int(p.split_factor)))
        elif isinstance(p, Shard):
            placements.append(GridShard(p.dim))
        elif isinstance(p, Replicate):
            placements.append(GridReplicate())
        elif isinstance(p, Partial):
            raise LayoutError(
                f"tensor {key!r}: Partial placement holds unreduced values; redistribute it to "
                "Shard or Replicate before checkpointing"
            )
        else:
            raise LayoutError(f"tensor {key!r}: unsupported placement {p!r}")
    mesh = mesh_of(dt.device_mesh)
    coord = dt.device_mesh.get_coordinate()
    if coord is None:
        raise LayoutError(f"tensor {key!r}: this rank is not part of the tensor's device mesh")
    layout = GridLayout(mesh, tuple(placements), tuple(dt.shape))
    return layout, tuple(int(c) for c in coord)


def local_of(dt: DTensor) -> torch.Tensor:
    return dt._local_tensor
