"""ckptkit's two rank meshes against Megatron-core's own rank generators (pure Python, no process group).

Megatron builds the dense groups with ``RankGenerator(tp, ep=1, dp, pp, cp)``
and the expert groups with ``RankGenerator(etp, ep, edp, pp, cp=1)``, both
in the order ``tp-cp-ep-dp-pp``. A checkpoint's expert pieces are only where
ckptkit's rules say if :meth:`ParallelConfig.expert_mesh` puts every rank at
the coordinate Megatron gives it, for every valid combination.
"""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("megatron.core")

from megatron.core.parallel_state import RankGenerator  # noqa: E402

from ckptkit.errors import LayoutError  # noqa: E402
from ckptkit.layout.config import ParallelConfig  # noqa: E402

ORDER = "tp-cp-ep-dp-pp"


def _groups(mesh, dim: str) -> list[list[int]]:
    """Rank groups along one mesh dimension (all other coordinates fixed), as Megatron lists them."""
    axis = mesh.dims.index(dim)
    out = {}
    for rank in mesh.ranks:
        coord = mesh.coordinate(rank)
        rest = coord[:axis] + coord[axis + 1:]
        out.setdefault(rest, []).append(rank)
    return sorted(sorted(g) for g in out.values())


LAYOUTS = [c for c in itertools.product((1, 2, 4), (1, 2), (1, 2, 4), (1, 2), (1, 2, 4, 8), (1, 2, 4))
           if c[0] * c[1] * c[2] * c[3] <= 64]


def test_meshes_are_megatrons_rank_groups():
    checked = sum(_check(*layout) for layout in LAYOUTS)
    assert checked > 100  # most combinations are valid ones


def _check(tp: int, pp: int, dp: int, cp: int, ep: int, etp: int) -> bool:
    where = f"tp{tp}pp{pp}dp{dp}cp{cp}ep{ep}etp{etp}"
    world = tp * pp * dp * cp
    try:
        cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp)
    except LayoutError:
        assert (tp * cp * dp) % (ep * etp), where  # refused exactly when Megatron's assertion would refuse it
        return False
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=ORDER)
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (pp * ep * etp), pp=pp, cp=1, order=ORDER)
    mesh, emesh = cfg.mesh(), cfg.expert_mesh()
    for dim, token in (("tp", "tp"), ("dp", "dp"), ("pp", "pp"), ("cp", "cp")):
        assert _groups(mesh, dim) == sorted(sorted(g) for g in dense.get_ranks(token)), (where, dim)
    for dim, token in (("etp", "tp"), ("ep", "ep"), ("edp", "dp"), ("pp", "pp")):
        assert _groups(emesh, dim) == sorted(sorted(g) for g in expert.get_ranks(token)), (where, dim)
    assert cfg.expert_dp == world // (pp * ep * etp), where
    return True
