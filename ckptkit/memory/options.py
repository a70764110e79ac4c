"""``MemoryTier``: the options of the in-memory snapshot tier (a small frozen dataclass)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ckptkit.errors import OptionsError


@dataclass(frozen=True)
class MemoryTier:
    """Snapshot every ``every_steps`` steps into node memory, protected against a lost node.

    ``replicas``: how many other nodes also hold each rank's snapshot (default 1; 0 keeps only the
    node's own copy, which survives a crashed process but not a lost node). ``parity=g`` instead
    protects groups of ``g`` ranks on ``g`` different nodes with XOR parity: ``1 / (g - 1)`` of a
    snapshot per rank instead of a whole replica, any one lost node per group rebuilt exactly.

    ``root``: this node's memory folder. Shared memory (``/dev/shm``) outlives the worker
    processes, so a crash followed by a ``torchrun`` restart finds it; the default is
    ``/dev/shm/ckptkit-<run>``, derived from the manager's root (made ``0700``; refused if a link or
    another user's directory stands there), and each process may pass its own.
    ``ranks_per_node``: node ``k`` holds ranks ``k * ranks_per_node ...``; default the launcher's
    ``LOCAL_WORLD_SIZE`` (1 without a launcher).

    ``max_host_bytes``: the most host memory this node's snapshots may hold (every rank of the node
    together, two steps: the newest complete one and the one being written). Checked at the first
    snapshot, when the state's size is known, with an error that gives the figure. None: the free
    space of the memory folder's file system is the budget.
    ``timeout_seconds``: how long a copy or restore waits for a peer before failing (a lost peer
    never hangs the job).
    ``reuse_files``: write each snapshot over the data files of the step the previous snapshot
    retired, instead of new files (default): on tmpfs a new file's pages cost their allocation and zeroing
    every time, about half the CPU of writing them. The node folder then holds two steps between
    snapshots as well as during one, within the budget above; False unlinks a retired step at once.
    """

    every_steps: int
    replicas: int | None = None
    parity: int | None = None
    root: str | None = None
    ranks_per_node: int | None = None
    max_host_bytes: int | None = None
    timeout_seconds: float = 300.0
    reuse_files: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.every_steps, int) or self.every_steps < 1:
            raise OptionsError(f"MemoryTier.every_steps must be a positive integer, got {self.every_steps!r}")
        if self.parity is not None and self.replicas:
            raise OptionsError("MemoryTier takes replicas= or parity=, not both (parity replaces the replicas)")
        if self.replicas is not None and self.replicas < 0:
            raise OptionsError(f"MemoryTier.replicas must be >= 0, got {self.replicas}")
        if self.parity is not None and self.parity < 2:
            raise OptionsError(f"MemoryTier.parity must be >= 2 ranks per group, got {self.parity}")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise OptionsError(f"MemoryTier.ranks_per_node must be >= 1, got {self.ranks_per_node}")
        if self.max_host_bytes is not None and self.max_host_bytes < 0:
            raise OptionsError("MemoryTier.max_host_bytes must be >= 0")
        if not isinstance(self.reuse_files, bool):
            raise OptionsError(f"MemoryTier.reuse_files must be True or False, got {self.reuse_files!r}")
        if not self.timeout_seconds > 0:
            raise OptionsError(f"MemoryTier.timeout_seconds must be > 0, got {self.timeout_seconds}")

    @property
    def copies(self) -> int:
        """Replicas in effect: 1 by default, none with parity."""
        if self.parity is not None:
            return 0
        return 1 if self.replicas is None else self.replicas

    def node_size(self) -> int:
        if self.ranks_per_node is not None:
            return self.ranks_per_node
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    def host_factor(self) -> float:
        """Host memory per byte of a rank's state, per step kept: its own copy plus the protection."""
        return 1.0 + (self.copies if self.parity is None else 1.0 / (self.parity - 1))
