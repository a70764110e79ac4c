"""Meshes that replicate each other, found from one small all-gather.

A DTensor knows its own mesh, not who else holds the same data. With FSDP2 x
TP, a LayerNorm weight is sharded over a 1-D data-parallel sub-mesh, and every
TP rank has its own such sub-mesh holding identical values; a plain tensor
(an optimizer step count) is a one-rank "mesh" on every rank that has it.
Left alone, each copy would be written and reported separately.

Plain tensors (and meshes of one rank) are matched per key instead, by
:func:`plain_replica_groups`: a pipeline-parallel state holds stage-specific
tensors next to buffers every stage has, so whole key sets do not match while
single keys do.

Each rank reports, per mesh it holds tensors on, ``(mesh fingerprint, key
hash, mesh shape, its coordinate)``. Meshes of equal shape holding exactly the
same tensors (equal key hash) are stacked along a new leading ``replica``
dimension: one combined mesh, on which the tensors are ``Replicate`` along the
new dimension. Then exactly one copy is written, writers are balanced across
all copies, and a loader may read any of them. Rank 0's work here is
O(ranks x meshes per rank), never O(ranks x tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ckptkit.errors import LayoutError
from ckptkit.layout.grid import Mesh


@dataclass(frozen=True)
class MeshReport:
    """One rank's membership in one mesh it holds grid tensors on."""

    mesh_fp: str
    key_hash: str
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    coord: tuple[int, ...]


def combine_replica_meshes(reports: list[list[MeshReport]]) -> dict[str, tuple[Mesh, int]]:
    """``mesh fingerprint -> (combined mesh, index along its replica dim)`` for meshes that have replicas.

    ``reports[r]`` are rank ``r``'s reports. Meshes with no replica are absent.
    """
    members: dict[str, dict[tuple[int, ...], int]] = {}
    info: dict[str, MeshReport] = {}
    for rank, rank_reports in enumerate(reports):
        for rep in rank_reports:
            members.setdefault(rep.mesh_fp, {})[rep.coord] = rank
            prev = info.setdefault(rep.mesh_fp, rep)
            if prev.key_hash != rep.key_hash:
                raise LayoutError(
                    f"ranks {members[rep.mesh_fp][prev.coord]} and {rank} share a device mesh but hold "
                    "different DTensors on it; every rank of a mesh must hold the same tensors"
                )
    by_content: dict[tuple, list[str]] = {}
    for fp, rep in info.items():
        by_content.setdefault((rep.key_hash, rep.dims, rep.shape), []).append(fp)
    out: dict[str, tuple[Mesh, int]] = {}
    for (_, dims, shape), fps in by_content.items():
        if len(fps) < 2:
            continue
        ordered = []
        for fp in fps:
            coords = members[fp]
            size = prod(shape)
            if len(coords) != size:
                raise LayoutError(f"a mesh of shape {list(shape)} was reported by {len(coords)} ranks, expected {size}")
            ranks = tuple(coords[c] for c in sorted(coords))
            ordered.append((min(ranks), fp, ranks))
        ordered.sort()
        all_ranks = tuple(r for _, _, ranks in ordered for r in ranks)
        if len(set(all_ranks)) != len(all_ranks):
            raise LayoutError(
                "two overlapping device meshes hold the same tensors; ckptkit cannot tell which copy is which"
            )
        combined = Mesh(("replica", *dims), (len(ordered), *shape), all_ranks)
        for i, (_, fp, _) in enumerate(ordered):
            out[fp] = (combined, i)
    return out


PlainDesc = tuple[str, str, tuple[int, ...]]  # (key, dtype, shape) of a plain tensor


def plain_replica_groups(descs: list[tuple[tuple[PlainDesc, ...], tuple[int, ...]]]) -> dict[str, tuple[int, ...]]:
    """``key -> ranks holding it`` for plain tensors held by two or more ranks. Pure.

    ``descs`` are the distinct plain-tensor sets of the world with the ranks holding each. Ranks
    that hold a key under the same key are its replicas (written once, by one of them); ranks
    that disagree about its dtype or shape are an error naming the key and the ranks.
    """
    holders: dict[str, list[int]] = {}
    kind: dict[str, tuple[str, tuple[int, ...], int]] = {}
    for tensors, ranks in descs:
        for key, dtype, shape in tensors:
            first = kind.setdefault(key, (dtype, tuple(shape), ranks[0]))
            if first[:2] != (dtype, tuple(shape)):
                raise LayoutError(
                    f"tensor {key!r} is {dtype}{list(shape)} on rank {ranks[0]} but {first[0]}{list(first[1])} on "
                    f"rank {first[2]}; ranks holding a plain tensor under one key must hold the same tensor"
                )
            holders.setdefault(key, []).extend(ranks)
    return {k: tuple(sorted(r)) for k, r in holders.items() if len(r) > 1}


def plain_group_mesh(ranks: tuple[int, ...]) -> Mesh:
    """The mesh of a plain tensor's replicas: one ``replica`` coordinate per holding rank."""
    return Mesh(("replica", "rank"), (len(ranks), 1), ranks)
