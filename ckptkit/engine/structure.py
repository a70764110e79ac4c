"""A state's structure, and its classification reused while the structure stays the same.

A training loop that checkpoints every few steps (the memory tier: every step to every 5) hands
over the same parameter and optimizer tensors each time. Classifying them again (a layout per
DTensor, a declaration per tensor, and a SHA-256 over the ``repr`` of all of them) cost about a
third of the snapshot call on the training thread. The *signature* here holds everything a
classification depends on besides the tensors' values, as plain tuples, so a save whose
signature equals the last one's reuses its declarations and fingerprint; comparing two
signatures costs a fraction of building them anew.

Everything a declaration is made of is in the signature: each leaf's key, kind (DTensor, plain
tensor, :class:`~ckptkit.engine.state.Sharded`), dtype, global and local shape, and for a DTensor
its grid layout and coordinate (:func:`~ckptkit.engine.dtensor_grid.grid_of`) and expert axis;
for a Sharded leaf its pieces and rule. A tensor whose shape or dtype changed in place
(``param.data = ...``) changes the signature. The tensors and the values are taken fresh on
every save.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ckptkit.engine.dtensor_grid import grid_of, is_dtensor, local_of
from ckptkit.engine.saver import Classified, classify_state, encode_values
from ckptkit.engine.state import FlatState
from ckptkit.layout.strict_json import gc_paused


def structure_signature(flat: FlatState) -> tuple[Any, ...]:
    """Everything the classification of ``flat`` depends on except tensor values (see the module)."""
    sig: list[Any] = []
    for leaf in flat.tensors:
        t = leaf.obj
        if is_dtensor(t):
            layout, coord = grid_of(t, leaf.key)
            sig.append(("d", leaf.key, t.dtype, t.shape, local_of(t).shape, layout, coord, leaf.expert_axis))
        else:
            sig.append(("t", leaf.key, t.dtype, t.shape))
    for leaf in flat.sharded:
        s = leaf.obj
        sig.append(("s", leaf.key, s.local.dtype, s.local.shape, s.pieces, s.rule))
    return tuple(sig)


@dataclass
class ClassifyMemo:
    """The last classification of one saver (one rank), and the signature it was made for."""

    signature: tuple[Any, ...] | None = None
    rank: int | None = None
    last: Classified | None = None

    def classify(self, flat: FlatState, rank: int) -> Classified:
        """:func:`~ckptkit.engine.saver.classify_state` of ``flat``: the last declarations and
        fingerprint again when the structure is the same, with this save's tensors and values. With the
        collector paused: a signature entry per tensor, at every snapshot (:func:`classify_state`)."""
        with gc_paused():
            return self._classify(flat, rank)

    def _classify(self, flat: FlatState, rank: int) -> Classified:
        try:
            sig = structure_signature(flat)
        except RuntimeError:  # a tensor without sizes (a nested one): refused by name, not by torch's words
            classify_state(flat, rank)
            raise
        last = self.last
        if last is not None and self.rank == rank and self.signature == sig:
            tensors = [local_of(leaf.obj) if is_dtensor(leaf.obj) else leaf.obj for leaf in flat.tensors]
            tensors += [leaf.obj.local for leaf in flat.sharded]
            values, per_rank_values, per_rank_keys = encode_values(flat)
            return replace(last, tensors=tensors, values=values, per_rank_values=per_rank_values,
                           per_rank_keys=per_rank_keys, watched=flat.tensor_objects())
        cls = classify_state(flat, rank)
        self.signature, self.rank, self.last = sig, rank, cls
        return cls
