"""Load targets that share memory: tied weights, views of one buffer, declarations over one local tensor.

A state may name one memory more than once: one Parameter under two keys (tied embeddings), a flat
buffer and views into it, several :class:`~ckptkit.Sharded` declarations over one local tensor (the
Megatron adapter declares one per global tensor a parameter holds: a vocabulary and its padding
rows). A tensor subclass with no memory of its own shares memory with itself only. Reading straight into
such memory from several keys goes wrong in three ways, each seen before this module existed:

* two reads of overlapping memory race, and the checksum of one is taken over bytes the other
  wrote: a good checkpoint reported corrupt, so a resuming job would fall back to an older one;
* two keys that the checkpoint gives different values silently leave whichever landed last;
* a staged destination (a GPU tensor, a strided view) copied back whole writes its stale elements
  over what another key just loaded there: a silent restore of the values from before the load.

So the load finds every piece it would write whose memory may overlap another's (exactly within one
tensor, by memory span across views of one storage), reads those pieces into memory of their own,
places them in order, and then checks that every one of them reads back as the checkpoint gave it:
agreeing keys load, disagreeing ones fail naming both. A staged destination whose memory may meet
another destination's is copied back piece by piece, never whole. Memory that is not shared costs
nothing: no private buffer, no extra copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch

from ckptkit.engine.tensor_bytes import as_bytes
from ckptkit.errors import StateMismatchError
from ckptkit.layout.box import Box, Region
from ckptkit.layout.pieces import LocalBox, LocalFlat
from ckptkit.plan.load_plan import Target


Run = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of a box: plain tuples, this runs per piece


def boxes_of(t: torch.Tensor, target: Target) -> list[Run]:
    """The boxes of ``t`` (a destination's memory, laid out as ``target.local_shape``) that ``target``
    fills, in the order of its elements: its box, or the runs of its flat range."""
    if isinstance(target.local, LocalBox):
        return [(target.local.offsets, target.region.box.sizes)]
    start, n = target.local.start, target.region.numel
    if t.dim() == 1:
        return [((start,), (n,))]
    return [(b.offsets, b.sizes) for b in Region(Box.full(tuple(t.shape)), (start, start + n)).boxes()]


def _view(t: torch.Tensor, box: Run) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(*box))]


def put(t: torch.Tensor, target: Target, values: torch.Tensor) -> None:
    """Write ``values`` (the piece's elements, any contiguous shape) where ``target`` lies in ``t``."""
    flat = values.reshape(-1)
    at = 0
    with torch.no_grad():
        for box in boxes_of(t, target):
            n = prod(box[1])
            _view(t, box).copy_(flat[at:at + n].view(box[1]))
            at += n


def reads_back(t: torch.Tensor, target: Target, values: torch.Tensor) -> bool:
    """Whether ``t`` holds, where ``target`` lies, exactly the bytes of ``values`` (the piece's elements,
    contiguous on the CPU), as a conjugate or negative view shows them."""
    want = as_bytes(values)
    at = 0
    for box in boxes_of(t, target):
        got = as_bytes(_view(t, box).detach().resolve_conj().resolve_neg().cpu().contiguous())
        if got != want[at:at + len(got)]:
            return False
        at += len(got)
    return True


def is_wrapper(t: torch.Tensor) -> bool:
    """A tensor subclass with no memory of its own, whose values live in tensors it wraps (torchao's
    float8 weights under FSDP2): read through its own ops, never through a data pointer."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return False
    try:
        t.untyped_storage().data_ptr()
    except RuntimeError:
        return True
    return False


def _storage(t: torch.Tensor) -> tuple[Any, int]:
    """What two views must share to share memory: a wrapper shares it with itself only."""
    if is_wrapper(t):
        return "wrapper", id(t)
    return t.device, t.untyped_storage().data_ptr()


def is_staged(user: torch.Tensor, work: torch.Tensor) -> bool:
    """Whether a destination was read into a stand-in (``work``) that must be copied back into ``user``."""
    return is_wrapper(user) or work.data_ptr() != user.data_ptr()


def _target_span(t: torch.Tensor, boxes: list[Run]) -> tuple[int, int]:
    """Bytes ``[lo, hi)`` of ``t``'s storage that hold ``boxes`` of ``t`` (every element they hold lies
    inside; strides are never negative in torch)."""
    base, strides, size = t.storage_offset(), t.stride(), t.element_size()
    lo = hi = None
    for offsets, sizes in boxes:
        first = base + sum(o * s for o, s in zip(offsets, strides))
        last = first + sum((n - 1) * s for n, s in zip(sizes, strides))
        lo = first if lo is None else min(lo, first)
        hi = last if hi is None else max(hi, last)
    assert lo is not None and hi is not None  # a target is never empty
    return lo * size, (hi + 1) * size


def _apart(a: list[Run], b: list[Run]) -> bool:
    """Whether two pieces of one destination hold no element in common (exact)."""
    return all(any(min(o1 + s1, o2 + s2) <= max(o1, o2) for o1, s1, o2, s2 in zip(x[0], x[1], y[0], y[1]))
               for x in a for y in b)


@dataclass
class SharedTargets:
    """The load's targets with every piece whose memory another piece may also write redirected
    into a private buffer (``buffers``, destination refs from the last destination's on), and how
    to put those back and check them."""

    targets: list[Target]
    original: list[Target]
    buffers: list[torch.Tensor] = field(default_factory=list)
    #: (original target, buffer, a key it meets, placed): a piece read privately; one that repeats another's
    #: very place (a tied weight's second key) is only compared with it, never placed
    private: list[tuple[Target, int, str, bool]] = field(default_factory=list)
    piecewise: set[int] = field(default_factory=set)  # destinations copied back piece by piece

    def place(self, works: Sequence[torch.Tensor]) -> None:
        """Privately read pieces into their destinations' working memory, in the state's order."""
        with torch.no_grad():
            for target, buffer, _, placed in self.private:
                if placed:
                    put(works[target.ref], target, self.buffers[buffer])

    def copy_back(self, ref: int, user: torch.Tensor, work: torch.Tensor) -> None:
        """A staged destination sharing storage with another: only the pieces it loaded go back."""
        with torch.no_grad():
            for target in self.original:
                if target.ref == ref:
                    for box in boxes_of(user, target):
                        _view(user, box).copy_(_view(work, box))

    def check(self, users: Sequence[torch.Tensor], works: Sequence[torch.Tensor], where: str) -> None:
        """Every privately read piece must now read back as the checkpoint gave it; a piece that does
        not was overwritten by another key's different values."""
        for target, buffer, other, _ in self.private:
            ref = target.ref
            memory = users[ref] if ref in self.piecewise else works[ref]
            if not reads_back(memory, target, self.buffers[buffer]):
                first, second = sorted((target.tensor, other))
                raise StateMismatchError(
                    f"{where}: tensors {first!r} and {second!r} share memory in the state (tied weights, or views "
                    f"of one buffer), but the checkpoint holds different values for them where they meet: one "
                    f"would silently replace the other. Load the state with one of the two keys left out "
                    f"(strict=False), or give them memory of their own")


def share_targets(users: Sequence[torch.Tensor], works: Sequence[torch.Tensor], targets: list[Target]) -> SharedTargets:
    """Find the pieces of ``targets`` (into destinations ``users``, read into ``works``) whose memory
    may overlap another piece's, and redirect them. Costs one sort per storage when nothing is shared."""
    by_storage: dict[tuple[Any, int], list[int]] = {}
    storages: dict[int, tuple[Any, int]] = {}
    for i, target in enumerate(targets):
        storage = storages.get(target.ref)
        if storage is None:
            storage = storages[target.ref] = _storage(users[target.ref])
        by_storage.setdefault(storage, []).append(i)
    boxes: dict[int, list[Run]] = {}
    partners: dict[int, set[int]] = {}
    piecewise: set[int] = set()
    for members in by_storage.values():
        if len(members) < 2:  # the usual case: a tensor of its own, one piece
            continue
        spans = []
        for i in members:
            boxes[i] = boxes_of(users[targets[i].ref], targets[i])
            spans.append((*_target_span(users[targets[i].ref], boxes[i]), i))
        refs = sorted({targets[i].ref for i in members})
        if len(refs) > 1:
            piecewise.update(_staged_and_overlapping(users, works, refs))
        spans.sort()
        active: list[tuple[int, int]] = []  # (hi, index) of the spans that may still meet the next one
        for lo, hi, i in spans:
            active = [(h, j) for h, j in active if h > lo]
            for _, j in active:
                a, b = targets[i], targets[j]
                if a.ref == b.ref and _apart(boxes[i], boxes[j]):
                    continue
                partners.setdefault(i, set()).add(j)
                partners.setdefault(j, set()).add(i)
            active.append((hi, i))
    direct, compared = _repeats(targets, boxes, partners)
    shared = SharedTargets(list(targets), list(targets), piecewise=piecewise)
    for i in sorted(set(partners) - direct):
        target = targets[i]
        work = works[target.ref]
        if isinstance(target.local, LocalFlat):
            buffer, place = torch.empty(target.region.numel, dtype=work.dtype), LocalFlat(0)
        else:
            sizes = target.region.box.sizes
            buffer, place = torch.empty(sizes, dtype=work.dtype), LocalBox(tuple(0 for _ in sizes))
        # the key named if this piece does not read back: the one it is compared with (a repeat), else the
        # last one placed over it
        other = targets[min(partners[i]) if i in compared else max(partners[i])].tensor
        shared.private.append((target, len(shared.buffers), other, i not in compared))
        shared.targets[i] = Target(len(users) + len(shared.buffers), target.tensor, target.region,
                                   tuple(buffer.shape), place)
        shared.buffers.append(buffer)
    return shared


def _repeats(targets: list[Target], boxes: dict[int, list[Run]],
             partners: dict[int, set[int]]) -> tuple[set[int], set[int]]:
    """Pieces that repeat one place of one destination and meet nothing else (one tied weight under
    several keys): the first is read in place, the others privately and only compared with it, so a
    tied weight costs one private copy per extra key, not one per key. Returns (the first of each such
    group, the others)."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i in partners:
        groups.setdefault((targets[i].ref, tuple(boxes[i])), []).append(i)
    direct: set[int] = set()
    compared: set[int] = set()
    for members in groups.values():
        group = set(members)
        if len(members) > 1 and all(partners[i] <= group for i in members):
            first = min(members)
            direct.add(first)
            compared.update(group - {first})
    return direct, compared


def _staged_and_overlapping(users: Sequence[torch.Tensor], works: Sequence[torch.Tensor], refs: list[int]) -> set[int]:
    """Destinations, views of one storage, that are staged and whose memory may meet another's: copied
    back whole, their elements no piece was read into would overwrite the other's. (FSDP2's parameters
    are disjoint views of one flat buffer: each is still copied back whole, in one copy.)"""
    spans = sorted((*_target_span(users[r], [(tuple(0 for _ in users[r].shape), tuple(users[r].shape))]), r)
                   for r in refs)
    out: set[int] = set()
    reach, last = -1, -1  # the furthest end seen so far, and whose it is
    for lo, hi, ref in spans:
        if lo < reach:
            out.update((ref, last))
        if hi > reach:
            reach, last = hi, ref
    return {r for r in out if is_staged(users[r], works[r])}

