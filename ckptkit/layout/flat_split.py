"""A tensor stored as equal consecutive runs of its flattening: ZeRO-3's partition, in a few bytes.

Pure. DeepSpeed ZeRO-3 partitions every parameter on its own: rank ``r`` of
``dp`` holds elements ``[r * P, (r + 1) * P)`` of its flattening,
``P = ceil(numel / dp)`` (:mod:`ckptkit.layout.zero_partition`). Listed piece
by piece, a 70B model's parameters and Adam state at dp 1,024 are three
million pieces: a manifest of over 100 MB that every loading rank parses
before planning anything (measured at dp 128 already: 15 MB and a loading
rank's metadata work in tens of seconds; docs/benchmarks.md). Any set of
pieces that cuts the whole tensor's flattening into consecutive runs of one
length ``part`` (the last shorter) is recorded instead as that length and the
run writers: :func:`find_split` recognises it when a save is merged,
:class:`FlatSplit` gives the pieces back exactly (the regions each writer's
index names) and answers overlap queries by arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from math import prod
from typing import Any

from ckptkit.errors import ManifestError
from ckptkit.layout.box import Box, Region
from ckptkit.layout.strict_json import MAX_LAYOUT_INT, as_dict, as_int, as_ints


@dataclass(frozen=True)
class FlatSplit:
    """Run ``i`` of ``shape``'s row-major flattening, elements ``[i * part, min((i + 1) * part, numel))``,
    is written by ``writers[i]``; there are ``ceil(numel / part)`` runs."""

    shape: tuple[int, ...]
    part: int
    writers: tuple[int, ...]
    box: Box = field(init=False, repr=False, compare=False)
    numel: int = field(init=False, repr=False, compare=False)
    _all: list = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "box", Box.full(self.shape))
        object.__setattr__(self, "numel", prod(self.shape))

    def run(self, i: int) -> tuple[Region, int]:
        """Run ``i`` as ``(region, writer)``: the region its writer's index names."""
        return Region(self.box, (i * self.part, min(self.numel, (i + 1) * self.part))), self.writers[i]

    def pieces(self) -> tuple[tuple[Region, int], ...]:
        """Every run, in order (built once)."""
        if not self._all:
            self._all.append(tuple(self.run(i) for i in range(len(self.writers))))
        return self._all[0]

    def overlapping(self, box: Box) -> list[tuple[Region, int]]:
        """The runs sharing an element with ``box``: only those between its first and last element's runs
        are looked at (a loading rank asks about a few; a tensor may have a run per rank of thousands)."""
        if box.is_empty() or not self.writers:
            return []
        run = box.run_in(self.box)
        if run is not None:  # one run of the flattening: every run of ours between its ends overlaps it
            return [self.run(i) for i in range(run[0] // self.part, (run[1] - 1) // self.part + 1)]
        first = self.box.position(box.offsets)
        last = self.box.position(tuple(e - 1 for e in box.ends))
        out = []
        for i in range(first // self.part, last // self.part + 1):
            region, writer = self.run(i)
            if any(b.intersect(box) is not None for b in region.boxes()):
                out.append((region, writer))
        return out

    def to_json(self) -> dict[str, Any]:
        w = self.writers
        step = w[1] - w[0] if len(w) > 1 else 1
        if w and step > 0 and all(w[i] == w[0] + i * step for i in range(len(w))):
            writers: Any = {"start": w[0], "step": step}
        else:
            writers = list(w)
        return {"part": self.part, "writers": writers}

    @staticmethod
    def from_json(raw: Any, shape: tuple[int, ...], world: int, where: str) -> FlatSplit:
        """Parse and check: a positive run length, one distinct writer of the world per run."""
        doc = as_dict(raw, f"{where}: split")
        part = as_int(doc.get("part"), f"{where}: split part", minimum=1)
        count = -(-prod(shape) // part)
        writers_v = doc.get("writers")
        if count > world:  # each run has its own writer: bounds what a hostile manifest can make us build
            raise ManifestError(f"{where}: a split into runs of {part} has {count} runs, more than the {world} ranks")
        if isinstance(writers_v, dict):
            start = as_int(writers_v.get("start"), f"{where}: split writers start", minimum=0)
            step = as_int(writers_v.get("step"), f"{where}: split writers step", minimum=1)
            writers = tuple(start + i * step for i in range(count))
        else:
            writers = as_ints(writers_v, f"{where}: split writers", minimum=0, max_len=count)
        if len(writers) != count:
            raise ManifestError(f"{where}: a split into runs of {part} has {count} runs, {len(writers)} writers given")
        if (writers and max(writers) >= world) or len(set(writers)) != len(writers):
            raise ManifestError(f"{where}: split writers must be distinct ranks of the world of {world}")
        return FlatSplit(tuple(shape), part, writers)


def find_split(shape: tuple[int, ...], pieces: Sequence[tuple[Region, int]]) -> FlatSplit | None:
    """``pieces`` as a FlatSplit when they are exactly one (every region a flat range of the whole tensor,
    the ranges consecutive from 0, all of one length but the last, each from its own writer); else None."""
    n = prod(shape)
    if not pieces or n == 0 or n > MAX_LAYOUT_INT:
        return None
    zeros = (0,) * len(shape)
    # plain tuple comparisons: a merge at dp 1,024 asks this of three million pieces
    if any(r.flat is None or r.box.sizes != shape or r.box.offsets != zeros for r, _ in pieces):
        return None
    if len({w for _, w in pieces}) != len(pieces):
        return None
    ordered = sorted(pieces, key=lambda p: p[0].flat)
    first = ordered[0][0].flat
    part = first[1] - first[0]  # type: ignore[index]
    if not part or len(ordered) != -(-n // part):
        return None
    start = 0
    for r, _ in ordered:
        a, b = r.flat  # type: ignore[misc]
        if a != start or b != min(n, start + part):
            return None
        start = b
    return FlatSplit(tuple(shape), part, tuple(w for _, w in ordered))
