"""The memory tier: recent snapshots in node memory, protected by peer replicas or XOR parity.

``ckptkit.MemoryTier`` holds the options; :class:`ckptkit.CheckpointManager` runs the tier
(:mod:`ckptkit.memory.tier`) and restores from it (:mod:`ckptkit.memory.restore`). See
docs/memory_tier.md.
"""

from ckptkit.memory.options import MemoryTier

__all__ = ["MemoryTier"]
