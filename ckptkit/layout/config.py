"""ParallelConfig: the parallel degrees of a Megatron-style run, and its rank mesh.

``ParallelConfig.parse("tp4pp2")`` is the CLI's grammar. The rank order is
Megatron-core's default ``tp-cp-ep-dp-pp`` (tensor parallel fastest). One
job has two meshes over the same ranks, as Megatron-core builds two rank
generators:

* the dense mesh ``pp, dp, cp, tp``: attention, dense MLPs, embeddings,
  routers and shared experts;
* the expert mesh ``pp, edp, ep, etp``: routed experts. Inside a pipeline
  stage the ``tp * cp * dp`` ranks are re-cut into expert tensor parallel
  (``etp``, fastest; independent of ``tp``, Megatron's default being
  ``etp = tp``), expert parallel ``ep`` and expert data parallel
  ``edp = tp * cp * dp / (ep * etp)``.

With ``etp = tp`` and ``cp = 1`` this is the familiar picture: EP is carved
out of DP and ``edp = dp / ep``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from math import gcd

from ckptkit.errors import LayoutError
from ckptkit.layout.grid import Mesh
from ckptkit.layout.strict_json import MAX_WORLD

_TOKEN = re.compile(r"(vpp|etp|tp|pp|dp|cp|ep)([0-9]+)")
_NAMES = ("tp", "pp", "dp", "cp", "ep", "etp", "vpp")
MESH_DIMS = ("pp", "dp", "cp", "tp")
EXPERT_MESH_DIMS = ("pp", "edp", "ep", "etp")


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
    etp: int | None = None  # expert tensor parallel; None: Megatron's default, the dense tp
    vpp: int = 1
    pp_layers: tuple[int, ...] | None = field(default=None)

    def __post_init__(self) -> None:
        for name in _NAMES:
            value = getattr(self, name)
            if name == "etp" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"parallel degree {name}={value!r} must be a positive integer")
        for name in _NAMES:  # each degree first: a product of huge ones is slow to form, and means nothing
            value = getattr(self, name)
            if value is not None and value > MAX_WORLD:
                raise LayoutError(f"parallel degree {name}={value} is more than a checkpoint's {MAX_WORLD} ranks")
        if self.tp * self.pp * self.dp * self.cp > MAX_WORLD or self.vpp > MAX_WORLD:
            raise LayoutError(f"{self.tp * self.pp * self.dp * self.cp} ranks (tp x pp x dp x cp) are more than a "
                              f"checkpoint's {MAX_WORLD}: the format's bound on a world")
        if self.etp == self.tp:
            object.__setattr__(self, "etp", None)  # one spelling of the default, so equal layouts compare equal
        stage = self.tp * self.cp * self.dp
        if stage % (self.ep * self.expert_tp):
            raise LayoutError(
                f"ep={self.ep} x etp={self.expert_tp} does not divide the {stage} ranks of a pipeline stage "
                f"(tp={self.tp} x cp={self.cp} x dp={self.dp}): Megatron carves expert parallel and expert tensor "
                f"parallel out of them, so dp must be a multiple of {_min_dp(self.tp, self.cp, self.ep, self.expert_tp)}")
        if self.pp_layers is not None:
            if len(self.pp_layers) != self.pp * self.vpp or any(n < 0 for n in self.pp_layers):
                raise LayoutError(
                    f"pp_layers {list(self.pp_layers)} must give {self.pp * self.vpp} non-negative layer counts "
                    f"(pp={self.pp} x vpp={self.vpp})"
                )

    @staticmethod
    def parse(text: str, *, world_size: int | None = None) -> ParallelConfig:
        """Parse ``tp4pp2``, ``tp2pp2dp4``, ``tp8pp4ep2vpp2``, ``tp2pp2ep4etp1dp2`` ... (any order, each name once).

        Without ``dp``, dp is ``world_size / (tp * pp * cp)`` when a world size
        is given, else the smallest one the expert degrees fit in (1 for a
        dense model; ``tp2ep4`` at Megatron's default ``etp = tp`` needs dp 4).
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
        if "dp" not in values and world_size is None:
            tp, cp = values.get("tp", 1), values.get("cp", 1)
            values["dp"] = _min_dp(tp, cp, values.get("ep", 1), values.get("etp", tp))
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
        if self.expert_tp != self.tp:
            parts.append(f"etp{self.expert_tp}")
        return "".join(parts)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel degree (Megatron's default: the dense ``tp``)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Expert data parallel: the replicas of each expert shard inside a pipeline stage."""
        return self.tp * self.cp * self.dp // (self.ep * self.expert_tp)

    def mesh(self) -> Mesh:
        """The dense rank mesh ``(pp, dp, cp, tp)``, ranks in Megatron's default order."""
        return _mesh(MESH_DIMS, (self.pp, self.dp, self.cp, self.tp))

    def expert_mesh(self) -> Mesh:
        """The routed experts' mesh ``(pp, edp, ep, etp)`` over the same ranks (Megatron's expert rank generator)."""
        return _mesh(EXPERT_MESH_DIMS, (self.pp, self.expert_dp, self.ep, self.expert_tp))

    def coordinate(self, rank: int) -> dict[str, int]:
        """A rank's place in both meshes: ``pp, dp, cp, tp`` and ``edp, ep, etp``."""
        coord = self.mesh().coordinate(rank)
        expert = self.expert_mesh().coordinate(rank)
        if coord is None or expert is None:
            raise LayoutError(f"rank {rank} is outside a world of {self.world_size} ranks ({self})")
        out = dict(zip(MESH_DIMS, coord))
        out.update(zip(EXPERT_MESH_DIMS[1:], expert[1:]))
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


def _min_dp(tp: int, cp: int, ep: int, etp: int) -> int:
    """The smallest dp with ``ep * etp`` dividing ``tp * cp * dp`` (1 for degrees that are not positive:
    the constructor then names the bad one)."""
    if min(tp, cp, ep, etp) < 1:
        return 1
    return ep * etp // gcd(ep * etp, tp * cp)


@lru_cache(maxsize=64)
def _mesh(dims: tuple[str, ...], shape: tuple[int, ...]) -> Mesh:
    # One Mesh object per shape: layouts evaluated from rules share it, so caches keyed
    # by mesh hit by identity instead of comparing 16k-rank tuples.
    return Mesh.arange(dims, shape)
