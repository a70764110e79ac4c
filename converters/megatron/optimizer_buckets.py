"""Megatron's default distributed-optimizer checkpoint form, ``dp_reshardable``, read into model space.

Megatron-LM saves the distributed optimizer this way unless a run passes
``--dist-ckpt-optim-fully-reshardable`` (megatron-core 0.14-0.16, ``DistributedOptimizer.
sharded_param_state_dp_reshardable``): per data-parallel group and per grad buffer bucket, one flat
1-D tensor per state (``param`` for the fp32 main copies, ``exp_avg``, ``exp_avg_sq``) named
``[chained_<i>.]optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.dtype_<dtypes>.bucket_idx_<k>.<state>``,
and per group the optimizer's non-tensor state (``...dp_group_idx_<g>.optimizer``: param groups with the
step; fp16: ``grad_scaler``) as sharded objects. Which parameter sits where in a bucket is not saved:
Megatron's load recomputes it from the live model, its module order and bucketing flags. Rebuilding that
here would tie the import to one release's module order and to flags a checkpoint does not record, and a
wrong guess would hand back the moments of another parameter; :mod:`.bucket_walk` reads it off the data,
and :mod:`.bucket_ties` settles equal weights by the key order the checkpoint records, once checked.

Each weight's state becomes ``optimizer/{main,exp_avg,exp_avg_sq}/<key>`` in model space, chunked as the
weight is (vocabulary padding rows kept apart by the importer as for the weights), so the import resumes
through the adapter at any layout. Refused, naming the bucket or tensor and the fix (resave with
``--dist-ckpt-optim-fully-reshardable``): buckets that are not Megatron's, a weight with some chunks
placed and others not, a parameter with no state (other than Megatron's known buffers), and equal weights
the recorded order cannot tell apart.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ckptkit.errors import ManifestError
from ckptkit.storage.base import ByteStore
from ckptkit_converters.dcp.convert import DcpPieces
from ckptkit_converters.dcp.files import Blob, Chunk, DcpCheckpoint, DcpTensor, load_blob, read_blob, read_chunk
from ckptkit_converters.megatron import names
from ckptkit_converters.megatron.bucket_ties import place
from ckptkit_converters.megatron.bucket_walk import FIX, Atom, Bucket, Placed, spans, weight_chunks
from ckptkit_converters.megatron.optimizer_record import MAIN

STATES = {"param": MAIN, "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
"""The bucket states Megatron's ``_get_main_param_and_optimizer_states`` saves -> the adapter's names."""

_BUCKET = re.compile(r"^(?P<group>(?:chained_(?P<chain>[0-9]+)\.)?optimizer\.distributed\.dp_group_idx_(?P<idx>[0-9]+))"
                     r"\.gbuf_idx_(?P<gbuf>[0-9]+)\.dtype_(?P<dtype>.+)\.bucket_idx_(?P<bucket>[0-9]+)"
                     r"\.(?P<state>[A-Za-z0-9_]+)$")
_GROUP_ITEM = re.compile(r"^(?:chained_(?P<chain>[0-9]+)\.)?optimizer\.distributed\.dp_group_idx_(?P<idx>[0-9]+)"
                         r"\.(?P<name>[A-Za-z0-9_]+)$")
_REDUNDANT_ITEMS = ("per_bucket_numel", "per_bucket_numel_unpadded")  # the bucket tensors' shapes say it
_RECORD_ITEMS = ("optimizer", "grad_scaler")  # param groups (the step), the fp16 loss scaler


@dataclass(frozen=True)
class BucketSlice(Chunk):
    """A model-space chunk of one optimizer state, cut from a bucket: a DCP chunk to the importer's placing
    and writing (``box`` in model space; ``blob.file``: the file the slice starts in, whose writer rank writes
    the piece), read by :class:`BucketPieces` from ``parts``: (chunk of the bucket state ``state``, first,
    end element within it), in order."""

    state: DcpTensor
    parts: tuple[tuple[Chunk, int, int], ...]


@dataclass(frozen=True)
class BucketState:
    """What the buckets become: ``optimizer/<state>/<key>`` -> (model key, a :class:`DcpTensor` of
    :class:`BucketSlice` chunks, shaped as the weight); the DCP
    keys read (bucket tensors, the groups' items) so the import does not list them as skipped; and the
    groups' non-tensor optimizer state, shaped as :mod:`.optimizer_record` reads it."""

    tensors: dict[str, tuple[str, DcpTensor]]
    consumed: frozenset[str]
    optimizer: dict[int, dict[str, Any]]


class BucketPieces(DcpPieces):
    """The import's piece source for one writer rank: DCP chunks as :class:`DcpPieces` reads them, and
    :class:`BucketSlice` pieces cut from the bucket chunks they lie in."""

    def _load(self, ref: int) -> torch.Tensor:
        """A DCP chunk as :class:`DcpPieces` reads it, or a :class:`BucketSlice` from its bucket chunks."""
        tensor, chunk = self._refs[ref]
        if not isinstance(chunk, BucketSlice):
            return super()._load(ref)
        parts = []
        for part, lo, hi in chunk.parts:
            parts.append(read_chunk(self._src, chunk.state, part)[lo:hi])
            with self._lock:
                self.bytes_read += part.blob.length
        return torch.cat(parts).reshape(chunk.box.sizes)


# ---------------------------------------------------------------- the buckets


def buckets_of(ckpt: DcpCheckpoint, ranks: Mapping[str, int], where: str) -> list[Bucket]:
    """Every ``dp_reshardable`` bucket of the checkpoint, its states checked to be Megatron's: 1-D, one
    chunk structure for all of them, the chunks tiling the bucket."""
    found: dict[str, dict[str, DcpTensor]] = {}
    places: dict[str, tuple[tuple[int, int], str, int]] = {}
    for fqn, t in ckpt.tensors.items():
        m = _BUCKET.match(fqn)
        if m is None:
            continue
        name = fqn[: -len(m["state"]) - 1]
        found.setdefault(name, {})[m["state"]] = t
        places[name] = ((int(m["chain"] or 0), int(m["idx"])), name[: m.start("bucket")], int(m["bucket"]))
    return [_bucket(name, places[name], states, ranks, where) for name, states in sorted(found.items())]


def _bucket(name: str, place: tuple[tuple[int, int], str, int], states: dict[str, DcpTensor],
            ranks: Mapping[str, int], where: str) -> Bucket:
    """One bucket's states, checked (:func:`buckets_of`)."""
    unknown = sorted(set(states) - set(STATES))
    if unknown or "param" not in states:
        raise ManifestError(f"{where}: bucket {name!r} holds states {sorted(states)}; Megatron's distributed "
                            f"optimizer saves {sorted(STATES)} (its main copies, 'param', place the others)")
    structure = None
    for state, t in sorted(states.items()):
        if len(t.shape) != 1 or t.dtype != "float32":
            raise ManifestError(f"{where}: {t.fqn!r} is {t.dtype} {list(t.shape)}; the distributed optimizer's bucket "
                                "states are 1-D float32 (other precisions, as --use-precision-aware-optimizer keeps "
                                f"them, are not imported); {FIX}")
        spans = sorted((c.box.offsets[0], c.box.sizes[0]) for c in t.chunks)
        if structure is not None and (spans, t.shape) != structure:
            raise ManifestError(f"{where}: the states of bucket {name!r} are chunked differently ({state!r} and "
                                "'param'): Megatron saves each parameter's slice of every state alike")
        structure = (spans, t.shape)
    param = states["param"]
    atoms = tuple(Atom(c.box.offsets[0], c.box.offsets[0] + c.box.sizes[0], ranks[c.blob.file])
                  for c in sorted(param.chunks, key=lambda c: c.box.offsets[0]))
    end = 0
    for a in atoms:
        if a.start != end or a.end <= a.start:
            raise ManifestError(f"{where}: the chunks of {param.fqn!r} do not tile it: a chunk at element {a.start} "
                                f"where the previous one ends at {end}")
        end = a.end
    if end != param.shape[0]:
        raise ManifestError(f"{where}: the chunks of {param.fqn!r} end at element {end} of {param.shape[0]}")
    return Bucket(name, *place, states, atoms)


# ---------------------------------------------------------------- what the import writes


def _check_coverage(model: Mapping[str, DcpTensor], chosen: Mapping[tuple[str, tuple[int, ...]], Placed],
                    where: str) -> list[str]:
    """The keys with state: every chunk of a weight placed, or none of a known buffer's."""
    out = []
    for key, t in sorted(model.items()):
        if not t.dtype.startswith(("float", "bfloat")):
            continue
        chunks = [c for c in t.chunks if c.box.numel]
        placed = [c for c in chunks if (key, c.box.offsets) in chosen]
        if placed and len(placed) == len(chunks):
            out.append(key)
        elif placed:
            missing = next(c for c in chunks if (key, c.box.offsets) not in chosen)
            raise ManifestError(f"{where}: the distributed optimizer's buckets hold state for part of {key!r} "
                                f"but not its chunk at {list(missing.box.offsets)}: not a whole optimizer; {FIX}")
        elif not key.endswith(names.BUFFERS):
            raise ManifestError(f"{where}: no main copy in the distributed optimizer's buckets matches {key!r} (a "
                                f"frozen parameter, or buckets this import cannot read); {FIX}")
    return out


def _slice(p: Placed, state: str) -> BucketSlice:
    """The placed weight chunk's slice of one bucket state, as the chunks of that state it crosses."""
    tensor = p.bucket.states[state]
    chunks = sorted(tensor.chunks, key=lambda c: c.box.offsets[0])
    parts = tuple((chunks[i], lo, hi) for i, lo, hi in
                  spans(chunks, [a.start for a in p.bucket.atoms], p.start, p.start + p.weight.numel))
    return BucketSlice(p.weight.chunk.box, Blob(parts[0][0].blob.file, 0, 0), tensor, parts)


def _state_tensors(model: Mapping[str, DcpTensor], keys: Sequence[str],
                   chosen: Mapping[tuple[str, tuple[int, ...]], Placed]) -> dict[str, tuple[str, DcpTensor]]:
    """``optimizer/<state>/<key>`` of every key with state: its chunks cut from where the walk placed them."""
    out: dict[str, tuple[str, DcpTensor]] = {}
    for key in keys:
        t = model[key]
        placed = [chosen[(key, c.box.offsets)] for c in t.chunks if c.box.numel]
        for state, name in STATES.items():
            slices = tuple(_slice(p, state) for p in placed)
            out[f"optimizer/{name}/{key}"] = (key, DcpTensor(slices[0].state.fqn, slices[0].state.dtype, t.shape,
                                                             slices))
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal all the way down, tensors by value (a loss scale is a tensor)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _records(src: ByteStore, ckpt: DcpCheckpoint, where: str) -> tuple[dict[int, dict[str, Any]], set[str]]:
    """The optimizer's non-tensor state (param groups with the step; fp16: the loss scaler), one per chained
    optimizer as :mod:`.optimizer_record` reads it, and the items read. Megatron saves it once per data-parallel
    group, the same in each: checked, and the lowest group's kept."""
    by_group: dict[tuple[int, int], dict[str, Any]] = {}
    consumed = set()
    for fqn, item in sorted(ckpt.items.items()):
        m = _GROUP_ITEM.match(fqn.split("/")[0])
        if m is None or m["name"] not in _REDUNDANT_ITEMS + _RECORD_ITEMS:
            continue
        consumed.add(fqn.split("/")[0])
        if m["name"] in _RECORD_ITEMS:
            at = f"{src.url}/{item.blob.file} (item {fqn!r})"
            value = load_blob(read_blob(src, item.blob), at)
            if not isinstance(value, list) or len(value) != 1:  # Megatron saves [data] per sharded object
                raise ManifestError(f"{at}: expected Megatron's one-element list of a sharded object, "
                                    f"got {type(value).__name__}")
            by_group.setdefault((int(m["chain"] or 0), int(m["idx"])), {})[m["name"]] = value[0]
    kept: dict[int, tuple[int, dict[str, Any]]] = {}
    for (chain, idx), record in sorted(by_group.items()):
        if chain not in kept:
            kept[chain] = (idx, record)
        elif not _same(kept[chain][1], record):
            raise ManifestError(f"{where}: the distributed optimizer's data-parallel groups {kept[chain][0]} and {idx} "
                                "saved different param groups or loss scalers; Megatron keeps one for all")
    return {i: kept[chain][1] for i, chain in enumerate(sorted(kept))}, consumed


def read_buckets(ckpt: DcpCheckpoint, model: Mapping[str, DcpTensor], src: ByteStore, ranks: Mapping[str, int],
                 pool: ThreadPoolExecutor, where: str) -> BucketState | None:
    """The ``dp_reshardable`` optimizer state of the checkpoint in model space; None when it has none."""
    buckets = buckets_of(ckpt, ranks, where)
    if not buckets:
        return None
    if len({frozenset(b.states) for b in buckets}) > 1:
        raise ManifestError(f"{where}: the distributed optimizer's buckets hold different states "
                            f"({sorted({tuple(sorted(b.states)) for b in buckets})})")
    chosen = place(src, buckets, weight_chunks(src, model, pool), list(model), pool, where)
    keys = _check_coverage(model, chosen, where)
    records, consumed = _records(src, ckpt, where)
    consumed |= {t.fqn for b in buckets for t in b.states.values()}
    return BucketState(_state_tensors(model, keys, chosen), frozenset(consumed), records)
