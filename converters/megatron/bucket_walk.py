"""Where each weight's optimizer state lies in Megatron's ``dp_reshardable`` buckets, read off the data.

:mod:`.optimizer_buckets` describes the format: per data-parallel group, flat buckets in which every
parameter's slice (and every alignment gap) on every DP rank is a DCP chunk of its own, and no record of
which parameter is where. The main copy in a bucket *is* the weight the checkpoint stores in model space
(Megatron copies ``main.to(model dtype)`` into the model after every step), so a bucket is walked from its
start: at each chunk start the candidates are the model-space weight chunks whose values equal the main
copy there, cast to the weight's dtype (the first element, then a digest of all of them). The chunk
structure constrains the walk: a parameter starts at a chunk start and ends at a chunk end, and a chunk
boundary inside a parameter can only be a data-parallel rank's (the writer rank changes there). A
parameter saved as several model-space chunks (a fused GLU ``linear_fc1``: its gate and up rows) continues
with its up half, the chunk half the fused axis further on. A chunk no weight matches is an alignment gap,
and gaps are shorter than the 64-element alignment: a longer one is refused, never skipped.

Equal weights (untrained norms; in bf16, norms for many steps) cannot be told apart by value: the walk
places one of them in each of their slots, and :mod:`.bucket_ties` settles which, with the replicas of
parameters that tensor parallelism repeats in every TP rank's group. Cost: the main copies and the weights
are read once here (and once more when written); the walk holds the main copy of the parameter it is
placing and one digest per weight chunk.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ckptkit.errors import ManifestError
from ckptkit.storage.base import ByteStore
from ckptkit.engine.tensor_bytes import as_bytes
from ckptkit_converters.dcp.files import Chunk, DcpTensor, read_chunk

MAX_GAP = 64
"""Megatron pads every parameter's start in a distributed-optimizer buffer to a multiple of 64 elements
(``_pad_start_of_param_if_needed``): a saved gap chunk is shorter."""

FIX = ("resave the checkpoint from Megatron with --dist-ckpt-optim-fully-reshardable (its model-space form, "
       "which ckptkit imports as it is)")


@dataclass(frozen=True)
class Atom:
    """One saved DCP chunk of a bucket: elements ``[start, end)``, written by rank ``rank``."""

    start: int
    end: int
    rank: int


@dataclass(frozen=True)
class Bucket:
    """One bucket of one data-parallel group: its state tensors, sharing one chunk structure."""

    name: str
    group: tuple[int, int]
    """(chained optimizer index, dp_group_idx): the order the lowest group is taken in."""
    buffer: str
    """The grad buffer it is a part of (its name up to ``bucket_idx_``): a buffer's buckets follow each other."""
    index: int
    states: Mapping[str, DcpTensor]
    atoms: tuple[Atom, ...]

    @property
    def numel(self) -> int:
        return self.states["param"].shape[0]


@dataclass(frozen=True)
class WeightChunk:
    """A model-space chunk of a weight, as the walk compares it: its element count, the bytes of its
    first element and a digest of all of them."""

    key: str
    shape: tuple[int, ...]
    """The whole tensor's."""
    chunk: Chunk
    dtype: torch.dtype
    first: bytes
    digest: bytes

    @property
    def numel(self) -> int:
        return self.chunk.box.numel


@dataclass(frozen=True)
class Placed:
    """A weight chunk found in a bucket at elements ``[start, start + chunk numel)``."""

    weight: WeightChunk
    bucket: Bucket
    start: int


def digest(t: torch.Tensor) -> bytes:
    """What the walk compares values by: equal digests, equal bytes (blake2b, 160 bits)."""
    return hashlib.blake2b(as_bytes(t.contiguous()), digest_size=20).digest()


def spans(chunks: Sequence[Chunk], starts: Sequence[int], start: int, end: int) -> list[tuple[int, int, int]]:
    """Where elements ``[start, end)`` of a bucket lie: (index of the chunk, first, end element within it) for
    each of ``chunks`` (sorted, tiling the bucket; ``starts``: their first elements) they cross, in order."""
    out = []
    i = bisect.bisect_right(starts, start) - 1
    while start < end:
        lo = starts[i]
        hi = min(end, lo + chunks[i].box.sizes[0])
        out.append((i, start - lo, hi - lo))
        start, i = hi, i + 1
    return out


def weight_chunks(src: ByteStore, model: Mapping[str, DcpTensor], pool: ThreadPoolExecutor) -> list[WeightChunk]:
    """Every floating-point model-space chunk with the facts the walk compares: read once, not kept."""
    refs = [(t, c) for t in model.values() if t.dtype.startswith(("float", "bfloat")) for c in t.chunks]

    def one(ref: tuple[DcpTensor, Chunk]) -> WeightChunk:
        t, c = ref
        values = read_chunk(src, t, c).reshape(-1)
        return WeightChunk(t.fqn, t.shape, c, values.dtype, bytes(as_bytes(values[:1])), digest(values))

    return [w for w in pool.map(one, refs) if w.numel]


class MainCopy:
    """The main copy's values of one bucket, read a chunk at a time as the walk moves forward."""

    def __init__(self, src: ByteStore, bucket: Bucket, state: str = "param") -> None:
        self._src = src
        self._tensor = bucket.states[state]
        self._chunks = sorted(self._tensor.chunks, key=lambda c: c.box.offsets[0])
        self._starts = [a.start for a in bucket.atoms]
        self._loaded: dict[int, torch.Tensor] = {}

    def values(self, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` (within the bucket), loading the chunks they lie in."""
        out = []
        for i, lo, hi in spans(self._chunks, self._starts, start, end):
            if i not in self._loaded:
                self._loaded[i] = read_chunk(self._src, self._tensor, self._chunks[i])
            out.append(self._loaded[i][lo:hi])
        return out[0] if len(out) == 1 else torch.cat(out)

    def forget_before(self, pos: int) -> None:
        """Drop the chunks the walk has passed."""
        for i in [i for i in self._loaded if self._chunks[i].box.offsets[0] + self._chunks[i].box.sizes[0] <= pos]:
            del self._loaded[i]


def _gate_and_up(gate: WeightChunk, up: WeightChunk) -> bool:
    """``up`` continues ``gate``'s local parameter: a fused GLU's two halves as Megatron shards them, the
    up rows exactly half the fused axis after the gate rows, everything else alike. (A layer's or an
    expert's next chunk differs along its own axis by a step of one, so it never passes for one.)"""
    if gate.key != up.key or gate.chunk.box.sizes != up.chunk.box.sizes:
        return False
    axes = [d for d, (x, y) in enumerate(zip(gate.chunk.box.offsets, up.chunk.box.offsets)) if x != y]
    if len(axes) != 1:
        return False
    axis = axes[0]
    return up.chunk.box.offsets[axis] - gate.chunk.box.offsets[axis] == gate.shape[axis] // 2


class Walk:
    """The placement of one data-parallel group's weight chunks in its buckets (module docstring)."""

    def __init__(self, src: ByteStore, weights: Sequence[WeightChunk], where: str) -> None:
        self._src = src
        self._where = where
        self._by_first: dict[tuple[torch.dtype, bytes], list[WeightChunk]] = {}
        for w in sorted(weights, key=lambda w: (w.key, w.chunk.box.offsets)):
            self._by_first.setdefault((w.dtype, w.first), []).append(w)
        self._dtypes = sorted({w.dtype for w in weights}, key=str)
        self.taken: dict[tuple[str, tuple[int, ...]], Placed] = {}

    def bucket(self, bucket: Bucket) -> list[list[Placed]]:
        """Place weight chunks along ``bucket``: the parameters found, each a list of its chunks."""
        main = MainCopy(self._src, bucket)
        ends = {a.end for a in bucket.atoms}
        inner = sorted(a.start for i, a in enumerate(bucket.atoms) if i and bucket.atoms[i - 1].rank == a.rank)
        params, pos = [], 0
        atoms_at = {a.start: a for a in bucket.atoms}
        while pos < bucket.numel:
            chain = self._param_at(bucket, main, pos, ends, inner)
            if chain is None:
                atom = atoms_at[pos]
                if atom.end - atom.start >= MAX_GAP:
                    raise ManifestError(
                        f"{self._where}: elements [{atom.start}, {atom.end}) of {bucket.name!r} match no weight "
                        f"the checkpoint stores (compared as the main copies Megatron casts into them); {FIX}")
                pos = atom.end
            else:
                for p in chain:
                    self.taken[(p.weight.key, p.weight.chunk.box.offsets)] = p
                params.append(chain)
                pos = chain[-1].start + chain[-1].weight.numel
            main.forget_before(pos)
        return params

    def _candidates(self, main: MainCopy, pos: int, limit: int) -> list[WeightChunk]:
        """The weight chunks not yet placed in this group whose first element is the main copy's at ``pos``."""
        first = main.values(pos, pos + 1)
        out = []
        for dtype in self._dtypes:
            for w in self._by_first.get((dtype, bytes(as_bytes(first.to(dtype)))), ()):
                if w.numel <= limit - pos and (w.key, w.chunk.box.offsets) not in self.taken:
                    out.append(w)
        return out

    def _fits(self, main: MainCopy, w: WeightChunk, pos: int, inner: Sequence[int]) -> bool:
        """``w`` lies at ``pos``: no chunk boundary other than a rank's inside it, and its values."""
        end = pos + w.numel
        if bisect.bisect_right(inner, pos) != bisect.bisect_left(inner, end):
            return False
        return digest(main.values(pos, end).to(w.dtype)) == w.digest

    def _param_at(self, bucket: Bucket, main: MainCopy, pos: int, ends: set[int],
                  inner: Sequence[int]) -> list[Placed] | None:
        """The one parameter starting at ``pos`` (its chunks in order), None where none does (a gap). A chunk
        ending inside a saved chunk or at a data-parallel rank's boundary may be continued by its GLU up half;
        one ending where the same rank's next chunk starts ends its parameter."""
        chains = []
        stops = set(inner)
        for w in self._candidates(main, pos, bucket.numel):
            if not self._fits(main, w, pos, inner):
                continue
            chain = [Placed(w, bucket, pos)]
            while (end := chain[-1].start + chain[-1].weight.numel) != bucket.numel and end not in stops:
                nxt = self._continuation(chain, main, end, inner, bucket.numel)
                if nxt is None:
                    break
                chain.append(Placed(nxt, bucket, end))
            if chain[-1].start + chain[-1].weight.numel in ends:
                chains.append(chain)
        if not chains:
            return None
        spans = {(c[-1].start + c[-1].weight.numel, tuple(p.weight.digest for p in c)) for c in chains}
        if len(spans) > 1:
            raise ManifestError(
                f"{self._where}: at element {pos} of {bucket.name!r} the main copy matches weights placed "
                f"differently ({', '.join(sorted({c[0].weight.key for c in chains}))}); {FIX}")
        return chains[0]  # equal values: which of them is which is checked by the states (_check_ties)

    def _continuation(self, chain: list[Placed], main: MainCopy, end: int, inner: Sequence[int],
                      limit: int) -> WeightChunk | None:
        """The up half of the chain's fused GLU parameter, if it lies at ``end``."""
        head = chain[0].weight
        used = {(p.weight.key, p.weight.chunk.box.offsets) for p in chain}
        for w in self._candidates(main, end, limit):
            if (len(chain) == 1 and _gate_and_up(head, w) and (w.key, w.chunk.box.offsets) not in used
                    and self._fits(main, w, end, inner)):
                return w
        return None
