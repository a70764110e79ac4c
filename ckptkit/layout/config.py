"""ParallelConfig: the parallel degrees of a Megatron-style run, and its rank mesh.

``ParallelConfig.parse("tp4pp2")`` is the CLI's grammar. The rank order is
Megatron-core's default ``tp-cp-ep-dp-pp`` (tensor parallel fastest), so the
mesh dimensions from slowest to fastest are ``pp, edp, ep, cp, tp`` where
``edp = dp / ep`` is the expert-data-parallel size: dense tensors are
replicated over the whole data-parallel group ``edp x ep``, expert tensors are
split over ``ep`` and replicated over ``edp``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

from ckptkit.errors import LayoutError
from ckptkit.layout.grid import Mesh

_TOKEN = re.compile(r"(vpp|tp|pp|dp|cp|ep)(\d+)")
_NAMES = ("tp", "pp", "dp", "cp", "ep", "vpp")
MESH_DIMS = ("pp", "edp", "ep", "cp", "tp")


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel degrees plus the pipeline stage assignment.

    ``pp_layers``: layer counts per pipeline *chunk* in forward order
    (``pp * vpp`` entries; chunk ``k`` runs on stage ``k % pp`` as virtual
    chunk ``k // pp``), for uneven first/last stages. None means an even split.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1
    pp_layers: tuple[int, ...] | None = field(default=None)

    def __post_init__(self) -> None:
        for name in _NAMES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"parallel degree {name}={value!r} must be a positive integer")
        if self.dp % self.ep:
            raise LayoutError(f"ep={self.ep} must divide dp={self.dp} (experts are split inside the data-parallel group)")
        if self.pp_layers is not None:
            if len(self.pp_layers) != self.pp * self.vpp or any(n < 0 for n in self.pp_layers):
                raise LayoutError(
                    f"pp_layers {list(self.pp_layers)} must give {self.pp * self.vpp} non-negative layer counts "
                    f"(pp={self.pp} x vpp={self.vpp})"
                )

    @staticmethod
    def parse(text: str, *, world_size: int | None = None) -> ParallelConfig:
        """Parse ``tp4pp2``, ``tp2pp2dp4``, ``tp8pp4ep2vpp2`` ... (any order, each name once).

        Without ``dp``, dp is ``world_size / (tp * pp * cp)`` when a world size
        is given, else 1.
        """
        s = text.strip().lower()
        pos = 0
        values: dict[str, int] = {}
        for m in _TOKEN.finditer(s):
            if m.start() != pos:
                break
            name, num = m.group(1), int(m.group(2))
            if name in values:
                raise LayoutError(f"invalid parallel config {text!r}: {name} given twice")
            values[name] = num
            pos = m.end()
        if pos != len(s) or not values:
            raise LayoutError(
                f"invalid parallel config {text!r}: expected degrees like 'tp4pp2', 'tp2pp2dp4' or "
                f"'tp8pp4ep2vpp2' (names {', '.join(_NAMES)}, each followed by a positive integer)"
            )
        if "dp" not in values and world_size is not None:
            model = values.get("tp", 1) * values.get("pp", 1) * values.get("cp", 1)
            if world_size % model:
                raise LayoutError(f"parallel config {text!r}: world size {world_size} is not a multiple of tp*pp*cp={model}")
            values["dp"] = world_size // model
        return ParallelConfig(**values)

    def __str__(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"]
        for name in ("cp", "ep", "vpp"):
            if getattr(self, name) != 1:
                parts.append(f"{name}{getattr(self, name)}")
        return "".join(parts)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def mesh(self) -> Mesh:
        """The rank mesh ``(pp, edp, ep, cp, tp)``, ranks in Megatron's default order."""
        return _mesh(self.pp, self.dp // self.ep, self.ep, self.cp, self.tp)

    def coordinate(self, rank: int) -> dict[str, int]:
        coord = self.mesh().coordinate(rank)
        if coord is None:
            raise LayoutError(f"rank {rank} is outside a world of {self.world_size} ranks ({self})")
        out = dict(zip(MESH_DIMS, coord))
        out["dp"] = out["edp"] * self.ep + out["ep"]
        return out

    def chunk_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layer counts per pipeline chunk (``pp * vpp`` entries)."""
        chunks = self.pp * self.vpp
        if self.pp_layers is not None:
            if sum(self.pp_layers) != num_layers:
                raise LayoutError(f"pp_layers {list(self.pp_layers)} sum to {sum(self.pp_layers)}, model has {num_layers} layers")
            return self.pp_layers
        if num_layers % chunks:
            raise LayoutError(
                f"{num_layers} layers do not split evenly over pp={self.pp} x vpp={self.vpp}; give pp_layers explicitly"
            )
        return (num_layers // chunks,) * chunks

    def layer_owner(self, layer: int, num_layers: int) -> tuple[int, int, int]:
        """``(stage, virtual_chunk, local_index)`` of a global layer."""
        if not (0 <= layer < num_layers):
            raise LayoutError(f"layer {layer} is outside a model of {num_layers} layers")
        start = 0
        for k, n in enumerate(self.chunk_layers(num_layers)):
            if layer < start + n:
                return k % self.pp, k // self.pp, layer - start
            start += n
        raise AssertionError("unreachable")

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Total layers held by each pipeline stage."""
        counts = [0] * self.pp
        for k, n in enumerate(self.chunk_layers(num_layers)):
            counts[k % self.pp] += n
        return tuple(counts)


@lru_cache(maxsize=32)
def _mesh(pp: int, edp: int, ep: int, cp: int, tp: int) -> Mesh:
    # One Mesh object per shape: layouts evaluated from rules share it, so caches keyed
    # by mesh hit by identity instead of comparing 16k-rank tuples.
    return Mesh.arange(MESH_DIMS, (pp, edp, ep, cp, tp))
