"""Where each rank's memory snapshot lives, and how a lost one is recovered (pure Python).

Ranks are laid out on nodes the way launchers do it: node ``k`` holds ranks
``k * ranks_per_node ... (k + 1) * ranks_per_node - 1``. A node is the unit of
failure (a host crash takes its shared memory with it), so every protected copy
of a rank's snapshot sits on *another* node:

* **replicas** ``R``: rank ``r``'s snapshot is also held by ranks
  ``r + j * ranks_per_node`` (mod the world), ``j = 1..R`` — the same local
  slot on the next ``R`` nodes. Any ``R`` lost nodes leave a copy of everything.
* **parity** ``g``: nodes are grouped in blocks of ``g``; the ranks of one local
  slot across a block form a group of ``g`` ranks on ``g`` different nodes.
  Each member's snapshot is split into ``g - 1`` chunks, one held (XORed with
  the other members' chunks) by each *other* member (distributed parity, as
  RAID 5 places it). Any one lost node per block is rebuilt exactly.

Why ``g - 1`` and not ``g``: the parity must survive the loss of any one of the
group's nodes, and that node takes its own share of the parity with it. The
survivors hold ``(g - 1)`` snapshots plus ``(g - 1) * p`` bytes of parity and must
determine ``g`` snapshots, so ``p >= 1 / (g - 1)`` of a snapshot per member.

:func:`plan_sources` decides, from what every rank reported holding, where each
rank's snapshot of one step comes from — or that the step cannot be restored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ckptkit.errors import OptionsError

SourceKind = Literal["memory", "peer", "parity"]


@dataclass(frozen=True)
class Topology:
    """The job's ranks on nodes and the protection chosen (``replicas`` or ``parity``, not both)."""

    world_size: int
    ranks_per_node: int
    replicas: int = 1
    parity: int | None = None

    def __post_init__(self) -> None:
        w, n = self.world_size, self.ranks_per_node
        if w < 1 or n < 1:
            raise OptionsError(f"world size {w} and ranks per node {n} must be >= 1")
        if w % n:
            raise OptionsError(f"the world's {w} ranks do not fill whole nodes of {n} ranks (ranks_per_node)")
        if self.replicas < 0:
            raise OptionsError(f"replicas must be >= 0, got {self.replicas}")
        if self.parity is not None:
            if self.replicas:
                raise OptionsError("the memory tier takes replicas or parity, not both (parity=g replaces replicas)")
            if self.parity < 2:
                raise OptionsError(f"parity groups need at least 2 ranks, got parity={self.parity}")
            if self.nodes % self.parity:
                raise OptionsError(
                    f"parity={self.parity} groups ranks on {self.parity} different nodes, but the job has "
                    f"{self.nodes} nodes of {n} ranks, not a multiple of {self.parity}"
                )
        elif self.replicas >= self.nodes and self.replicas:
            raise OptionsError(
                f"replicas={self.replicas} needs at least {self.replicas + 1} nodes to put every copy on another "
                f"node; the job has {self.nodes} node(s) of {n} ranks (replicas=0 keeps only each node's own "
                "copy: it survives crashed processes, not a lost node)"
            )

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def replica_holders(self, rank: int) -> tuple[int, ...]:
        """The ranks holding copies of ``rank``'s snapshot, nearest node first."""
        return tuple((rank + j * self.ranks_per_node) % self.world_size for j in range(1, self.replicas + 1))

    def replica_sources(self, rank: int) -> tuple[int, ...]:
        """The ranks whose snapshots ``rank`` holds a copy of (the inverse of :meth:`replica_holders`)."""
        return tuple((rank - j * self.ranks_per_node) % self.world_size for j in range(1, self.replicas + 1))

    def parity_group(self, rank: int) -> tuple[int, ...]:
        """The members of ``rank``'s parity group, in member order (one per node of its block)."""
        if self.parity is None:
            raise OptionsError("this memory tier uses replicas, not parity")
        g, n = self.parity, self.ranks_per_node
        block = self.node_of(rank) // g
        slot = rank % n
        return tuple((block * g + i) * n + slot for i in range(g))

    def member_index(self, rank: int) -> int:
        return self.parity_group(rank).index(rank)

    def overhead(self) -> float:
        """Host memory held per byte of a rank's own snapshot, beyond the snapshot itself."""
        return float(self.replicas) if self.parity is None else 1.0 / (self.parity - 1)


@dataclass(frozen=True)
class Source:
    """Where one rank's snapshot of a step comes from: its own node's memory, one peer's copy
    (``holder``), or a parity rebuild from the rest of its group."""

    kind: SourceKind
    holder: int | None = None


@dataclass(frozen=True)
class ParityShare:
    """A verified parity share of one step, as its holder reported it: the group's members (ranks,
    in member order) and the member index whose share it is."""

    members: tuple[int, ...]
    index: int


def plan_sources(
    world_size: int,
    copies: Sequence[frozenset[int]],
    local_to: Sequence[int],
    parity: Sequence[ParityShare | None] = (),
) -> dict[int, Source] | None:
    """Each rank's source for one step, or None when some rank's snapshot cannot be recovered.

    ``copies[h]``: the ranks whose verified snapshot rank ``h`` can read. ``local_to[h]``: an id of
    the memory rank ``h`` reads (ranks with equal ids share a node's memory folder).
    ``parity[h]``: the verified parity share rank ``h`` holds, if any. Preference: memory the
    rank can read itself (no transfer), then the lowest-numbered peer holding a copy, then a
    parity rebuild — which needs a copy of every other member and the share of every other
    member index.
    """
    direct: dict[int, Source] = {}
    for r in range(world_size):
        local = [h for h in range(len(copies)) if r in copies[h] and local_to[h] == local_to[r]]
        if local:
            direct[r] = Source("memory", local[0])
            continue
        peers = [h for h in range(len(copies)) if r in copies[h]]
        if peers:
            direct[r] = Source("peer", peers[0])
    out = dict(direct)
    for r in range(world_size):
        if r in out:
            continue
        if not _rebuildable(r, direct, parity):
            return None
        out[r] = Source("parity")
    return out


def _rebuildable(rank: int, direct: Mapping[int, Source], parity: Sequence[ParityShare | None]) -> bool:
    shares = [s for s in parity if s is not None and rank in s.members]
    if not shares:
        return False
    members = shares[0].members
    held = {s.index for s in shares if s.members == members}
    others = [i for i, m in enumerate(members) if m != rank]
    return all(members[i] in direct for i in others) and all(i in held for i in others)
