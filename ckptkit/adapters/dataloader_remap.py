"""Data-loader positions across a change of the data-parallel degree (pure Python, no torch).

torchtitan keeps one data-loader state per DP rank and refuses to resume when
the DP degree changes, because a position only means something together with
the rule that deals samples to ranks. This module knows two such rules, the
two that torchtitan's loaders actually use, and remaps positions between DP
degrees exactly when the samples already consumed can be described at the new
degree — otherwise it refuses, or, if asked, applies a documented
approximation and reports exactly how many samples it repeats or skips.

**Interleaved** (``kind="interleaved_sampler"``): a map-style dataset read
through ``torch.utils.data.DistributedSampler`` (torchdata's
``StatefulDistributedSampler`` included). The sampler orders the epoch once —
``randperm(N)`` seeded by ``seed + epoch``, independent of the world size —
and rank ``r`` of ``W`` takes positions ``r, r + W, r + 2W, ...``. After rank
``r`` yielded ``y_r`` samples the consumed positions are
``{i*W + r : i < y_r}``. When that set is a prefix ``[0, P)`` (every rank
yielded the same count, or the counts differ by one in rank order) the new
ranks continue from ``P`` with the new interleave: new rank ``j`` of ``W'``
skips ``ceil((P - j) / W')`` of its own positions. Nothing is repeated or
skipped, for any ``W`` and ``W'``, and every following global batch of ``b'``
samples per rank is exactly the positions ``[P + s*b'W', P + (s+1)*b'W')`` —
the batch an uninterrupted run with that global batch size would draw.

**Contiguous** (``kind="hf_text_contiguous"``): torchtitan's
``HuggingFaceTextDataset`` over a map-style ``datasets.Dataset``. Its
``split_dataset_by_node`` calls ``Dataset.shard(W, r, contiguous=True)``: rank
``r`` reads one contiguous block (first ``N mod W`` blocks one longer), and its
state holds ``sample_idx`` (documents consumed from its block), ``epoch``, and
the packing buffers (tokens of consumed documents not yet yielded). A new rank
can only resume at a *prefix* of its new block, so the remap is exact only
where the consumed documents inside each new block form a prefix of it: every
block untouched or finished, or — in epoch 0, which torchtitan does not
shuffle — a consumed prefix. Mid-epoch resizes usually are not exact and are
refused. Epochs after the first are shuffled per rank (a permutation of the
rank's own block), so there a partly consumed old block makes its documents'
fate unknown: exact only at block granularity. The packing buffers are always
*carried*, never dropped: old rank ``r``'s buffer goes to new rank
``r mod W'`` (in old-rank order), so no token is lost or yielded twice; each
carried buffer's leading positions are renormalized to start at 0, which is
what torchtitan does to the head of every sequence it yields.

The ``"approximate"`` policy (opt-in) keeps the number of samples consumed in
the epoch: interleaved — resume at ``P = sum(y_r)``; contiguous — every new
rank resumes at the same fraction of its block (``round(f * len)``, with ``f``
the consumed fraction of the epoch; ranks in different epochs are averaged by
progress). The report gives the exact counts of repeated and skipped samples
where they are knowable (interleaved; contiguous in epoch 0) and ``None``
where they are not.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ckptkit.errors import DataLoaderRemapError, OptionsError

Policy = Literal["exact", "approximate"]
INTERLEAVED = "interleaved_sampler"
CONTIGUOUS = "hf_text_contiguous"
OPAQUE = "opaque"
RECORD_FORMAT = 1


@dataclass(frozen=True)
class RemapReport:
    """What a remap did. ``repeated`` / ``skipped``: samples of the current epoch that the new
    ranks will yield a second time / that no rank will yield (None: not knowable)."""

    kind: str
    old_world: int
    new_world: int
    exact: bool
    consumed: int
    repeated: int | None
    skipped: int | None
    carried_tokens: int = 0
    note: str = ""


# --------------------------------------------------------------------- interleaved
def interleaved_prefix(counts: Sequence[int]) -> int | None:
    """``P`` if ranks that yielded ``counts`` (rank order) consumed exactly positions ``[0, P)``."""
    world = len(counts)
    total = sum(counts)
    for r, y in enumerate(counts):
        if y != max(0, -(-(total - r) // world)):
            return None
    return total


def interleaved_counts(prefix: int, world: int) -> list[int]:
    """Samples each of ``world`` interleaved ranks must skip so that positions ``[0, prefix)`` are consumed."""
    return [max(0, -(-(prefix - j) // world)) for j in range(world)]


def interleaved_overlap(counts: Sequence[int], prefix: int) -> int:
    """How many consumed positions ``{i*W + r : i < counts[r]}`` lie at or beyond ``prefix``."""
    world = len(counts)
    needed = interleaved_counts(prefix, world)
    return sum(max(0, y - n) for y, n in zip(counts, needed))


# ---------------------------------------------------------------------- contiguous
def contiguous_bounds(n: int, world: int) -> list[tuple[int, int]]:
    """Block ``[start, end)`` of every rank under ``datasets.Dataset.shard(world, r, contiguous=True)``."""
    div, mod = divmod(n, world)
    out = []
    for r in range(world):
        start = div * r + min(r, mod)
        out.append((start, start + div + (1 if r < mod else 0)))
    return out


def _intersect(intervals: Sequence[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    out = sorted((max(a, lo), min(b, hi)) for a, b in intervals if max(a, lo) < min(b, hi))
    merged: list[tuple[int, int]] = []
    for a, b in out:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


def _measure(intervals: Sequence[tuple[int, int]]) -> int:
    return sum(b - a for a, b in intervals)


def contiguous_exact(positions: Sequence[int], n: int, new_world: int, *, shuffled: bool) -> list[int] | None:
    """New per-rank ``sample_idx`` that continues exactly, or None when no such positions exist.

    ``positions[r]``: documents old rank ``r`` consumed from its block in the
    current epoch. ``shuffled``: the epoch reads each block in a per-rank
    permuted order (torchtitan epochs > 0), so only whole blocks are known.
    """
    old = contiguous_bounds(n, len(positions))
    seen: list[tuple[int, int]] = []
    unknown: list[tuple[int, int]] = []
    for (a, b), k in zip(old, positions):
        if not 0 <= k <= b - a:
            raise DataLoaderRemapError(f"sample_idx {k} is outside the block of {b - a} documents")
        if k == b - a or not shuffled:
            seen.append((a, a + k))
        elif k:
            unknown.append((a, b))
    out = []
    for a, b in contiguous_bounds(n, new_world):
        if _intersect(unknown, a, b):
            return None
        mine = _intersect(seen, a, b)
        if not mine:
            out.append(0)
        elif mine == [(a, b)]:
            out.append(b - a)
        elif not shuffled and len(mine) == 1 and mine[0][0] == a:
            out.append(mine[0][1] - a)
        else:
            return None
    return out


def contiguous_approximate(positions: Sequence[int], n: int, new_world: int) -> list[int]:
    """Every new rank at the consumed fraction of its block (the epoch's sample budget is kept)."""
    return contiguous_at_fraction(sum(positions) / n if n else 0.0, n, new_world)


def contiguous_at_fraction(frac: float, n: int, new_world: int) -> list[int]:
    """Every new rank ``round(frac * len)`` documents into its block."""
    return [round(frac * (b - a)) for a, b in contiguous_bounds(n, new_world)]


def contiguous_difference(old: Sequence[int], new: Sequence[int], n: int) -> tuple[int, int]:
    """(repeated, skipped) documents of an unshuffled epoch when ``old`` positions become ``new``."""
    seen = [(a, a + k) for (a, _), k in zip(contiguous_bounds(n, len(old)), old)]
    after = [(a, a + k) for (a, _), k in zip(contiguous_bounds(n, len(new)), new)]
    both = sum(_measure(_intersect(seen, a, b)) for a, b in after)
    return _measure(seen) - both, _measure(after) - both


# ------------------------------------------------------------------ packing buffers
def normalize_positions(positions: Sequence[int]) -> list[int]:
    """torchtitan's rule for the head of a sequence: the leading run restarts at 0."""
    out = list(positions)
    if out and out[0] > 0:
        offset = out[0]
        for i, p in enumerate(out):
            if p == 0:
                break
            out[i] = p - offset
    return out


BUFFERS = ("inputs_buffer", "labels_buffer", "positions_buffer")


def carry_buffers(buffers: Sequence[Mapping[str, Sequence[int]]], new_world: int) -> list[dict[str, list[int]]]:
    """Old rank ``r``'s packing buffers -> new rank ``r mod new_world``, concatenated in rank order."""
    out: list[dict[str, list[int]]] = [{k: [] for k in BUFFERS} for _ in range(new_world)]
    for r, buf in enumerate(buffers):
        lengths = {k: len(buf.get(k, [])) for k in BUFFERS}
        if len(set(lengths.values())) != 1:
            raise DataLoaderRemapError(f"dp rank {r}: packing buffers of different lengths {lengths}")
        dest = out[r % new_world]
        dest["inputs_buffer"].extend(buf.get("inputs_buffer", []))
        dest["labels_buffer"].extend(buf.get("labels_buffer", []))
        dest["positions_buffer"].extend(normalize_positions(buf.get("positions_buffer", [])))
    return out


# ------------------------------------------------------------------------ records
def _get(mapping: Any, path: Sequence[str], where: str) -> Any:
    node = mapping
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            raise DataLoaderRemapError(f"{where}: the data-loader state has no {'/'.join(path)!r}")
        node = node[part]
    return node


def _check_records(records: Sequence[Mapping[str, Any]]) -> tuple[str, int]:
    if not records:
        raise DataLoaderRemapError("no data-loader records to remap")
    world = records[0].get("dp_world_size")
    kind = records[0].get("kind")
    if not isinstance(world, int) or world < 1:
        raise DataLoaderRemapError(f"data-loader record has no valid dp_world_size: {world!r}")
    ranks = sorted(rec.get("dp_rank") for rec in records)  # type: ignore[type-var]
    if ranks != list(range(world)):
        raise DataLoaderRemapError(f"data-loader records cover dp ranks {ranks}, expected 0..{world - 1}")
    for rec in records:
        if rec.get("format") != RECORD_FORMAT:
            raise DataLoaderRemapError(f"dp rank {rec.get('dp_rank')}: unsupported record format {rec.get('format')!r}")
        if rec.get("kind") != kind or rec.get("dp_world_size") != world:
            raise DataLoaderRemapError(
                f"dp rank {rec.get('dp_rank')}: record kind/world {rec.get('kind')!r}/{rec.get('dp_world_size')} "
                f"differs from dp rank 0's {kind!r}/{world}"
            )
    return str(kind), world


def remap_records(
    records: Sequence[Mapping[str, Any]], new_world: int, *, policy: Policy = "exact"
) -> tuple[list[dict[str, Any]], RemapReport]:
    """Data-loader states for dp ranks ``0..new_world-1`` from the records of every old dp rank.

    Raises :class:`DataLoaderRemapError` when the remap is not exact and
    ``policy`` is ``"exact"``, or when the loader kind cannot be remapped at all.
    """
    if policy not in ("exact", "approximate"):
        raise OptionsError(f"policy must be 'exact' or 'approximate', got {policy!r}")
    if not isinstance(new_world, int) or new_world < 1:
        raise OptionsError(f"new dp world size {new_world!r} must be an integer >= 1")
    kind, world = _check_records(records)
    ordered = sorted(records, key=lambda rec: rec["dp_rank"])
    if new_world == world:  # every rank takes its own state back, whatever the kind
        consumed = 0
        if kind == INTERLEAVED:
            consumed = sum(_sampler_yielded(rec) for rec in ordered)
        elif kind == CONTIGUOUS:
            consumed = sum(int(rec["state"].get("dataset_state", {}).get("sample_idx", 0)) for rec in ordered)
        states = [copy.deepcopy(dict(normalize_sampler_state(rec["state"], f"dp rank {rec['dp_rank']}")))
                  if kind == INTERLEAVED else copy.deepcopy(dict(rec["state"])) for rec in ordered]
        return states, RemapReport(kind, world, world, True, consumed, 0, 0)
    if kind == INTERLEAVED:
        return _remap_interleaved(ordered, new_world, policy)
    if kind == CONTIGUOUS:
        return _remap_contiguous(ordered, new_world, policy)
    raise DataLoaderRemapError(
        f"data-loader kind {kind!r} cannot be remapped from {world} to {new_world} DP ranks: ckptkit remaps a "
        "StatefulDataLoader over a DistributedSampler and torchtitan's HuggingFaceTextDataset over a map-style "
        "dataset; resume at the saved DP degree, or exclude 'dataloader' from loading"
    )


def sampler_position(it: Any, where: str) -> int | None:
    """Samples the batch sampler yielded, from its state ``{'samples_yielded', 'sampler_state': {'yielded'}}``
    (None: no such state). The outer count is the truth: a ``StatefulDistributedSampler`` reports its own
    ``yielded`` from inside its generator, which only runs at the first batch, so right after
    ``load_state_dict`` it still reads 0 next to the loaded count, and right after a new epoch's ``iter()``
    the last epoch's total next to 0. A state saved there and trusted restarted the epoch (or skipped it).
    Any other disagreement has no such explanation and is refused."""
    if not isinstance(it, Mapping):
        return None
    inner = it.get("sampler_state")
    inner = inner.get("yielded") if isinstance(inner, Mapping) else None
    outer = it.get("samples_yielded")
    if outer is None or inner is None:
        return None if outer is None and inner is None else int(outer if inner is None else inner)
    outer, inner = int(outer), int(inner)
    if inner != outer and inner != 0 and outer != 0:
        raise DataLoaderRemapError(
            f"{where}: the batch sampler yielded {outer} samples, its sampler says {inner}; they differ only "
            "before a loaded or new iterator's first batch (one of them 0), so the position is unknown")
    return outer


def normalize_sampler_state(state: Any, where: str) -> Any:
    """``state`` (a StatefulDataLoader state) with the sampler's own count set to the batch sampler's
    (:func:`sampler_position`), so that loading it resumes where the loader was, not at a stale count."""
    it = state.get("_sampler_iter_state") if isinstance(state, Mapping) else None
    inner = it.get("sampler_state") if isinstance(it, Mapping) else None
    if not (isinstance(inner, Mapping) and "yielded" in inner and "samples_yielded" in it):  # type: ignore[operator]
        return state
    position = sampler_position(it, where)
    if position == inner["yielded"]:
        return state
    return {**state, "_sampler_iter_state": {**it, "sampler_state": {**inner, "yielded": position}}}  # type: ignore[dict-item]


def _sampler_yielded(rec: Mapping[str, Any]) -> int:
    where = f"dp rank {rec['dp_rank']}"
    state = rec["state"]
    if state.get("fetcher_state") is not None or state.get("dataset_state") is not None:
        raise DataLoaderRemapError(
            f"{where}: the loader state holds dataset state besides the sampler position; ckptkit cannot "
            "tell how it depends on the DP rank"
        )
    position = sampler_position(_get(state, ("_sampler_iter_state",), where), where)
    if position is None:
        raise DataLoaderRemapError(f"{where}: the data-loader state has no '_sampler_iter_state/samples_yielded'")
    return position


def _remap_interleaved(records: Sequence[Mapping[str, Any]], new_world: int, policy: Policy) -> tuple[list[dict[str, Any]], RemapReport]:
    world = len(records)
    infos = [rec.get("info", {}) for rec in records]
    for key in ("dataset_len", "seed", "shuffle", "drop_last", "epoch"):
        values = {repr(i.get(key)) for i in infos}
        if len(values) > 1:
            raise DataLoaderRemapError(f"dp ranks disagree on the sampler's {key}: {sorted(values)}")
    counts = [_sampler_yielded(rec) for rec in records]
    prefix = interleaved_prefix(counts)
    exact = prefix is not None
    repeated = skipped = 0
    note = ""
    if prefix is None:
        if policy == "exact":
            raise DataLoaderRemapError(
                f"dp ranks yielded {counts} samples: the consumed samples are not a prefix of the epoch's order, "
                f"so no position at {new_world} DP ranks continues exactly (ranks of a DP group step together; "
                "uneven counts mean the state was taken mid-step). Set dataloader_resize='approximate' to resume "
                f"at sample {sum(counts)} anyway"
            )
        prefix = sum(counts)
        repeated = skipped = interleaved_overlap(counts, prefix)
        note = f"resumed at position {prefix}; {repeated} samples repeat and {skipped} are skipped"
    new_counts = interleaved_counts(prefix, new_world)
    out = []
    for j, y in enumerate(new_counts):
        state = copy.deepcopy(dict(records[j % world]["state"]))
        it = state["_sampler_iter_state"] = dict(state["_sampler_iter_state"])
        it["samples_yielded"] = y
        if isinstance(it.get("sampler_state"), Mapping) and "yielded" in it["sampler_state"]:
            it["sampler_state"] = {**it["sampler_state"], "yielded": y}
        out.append(state)
    return out, RemapReport(INTERLEAVED, world, new_world, exact, prefix, repeated, skipped, 0, note)


def _remap_contiguous(records: Sequence[Mapping[str, Any]], new_world: int, policy: Policy) -> tuple[list[dict[str, Any]], RemapReport]:
    world = len(records)
    datasets = []
    for rec in records:
        ds = _get(rec["state"], ("dataset_state",), f"dp rank {rec['dp_rank']}")
        if "sample_idx" not in ds:
            raise DataLoaderRemapError(
                f"dp rank {rec['dp_rank']}: HuggingFaceTextDataset state without 'sample_idx' (an iterable/streaming "
                "dataset) cannot be remapped; resume at the saved DP degree"
            )
        datasets.append(ds)
    lengths = [int(rec.get("info", {}).get("chunk_len", -1)) for rec in records]
    n = sum(lengths)
    if lengths != [b - a for a, b in contiguous_bounds(n, world)]:
        raise DataLoaderRemapError(
            f"per-rank dataset lengths {lengths} are not the contiguous split of {n} documents over {world} ranks"
        )
    epochs = [int(ds.get("epoch", 0)) for ds in datasets]
    positions = [int(ds["sample_idx"]) for ds in datasets]
    new_positions: list[int] | None = None
    if len(set(epochs)) == 1:
        new_positions = contiguous_exact(positions, n, new_world, shuffled=epochs[0] > 0)
    exact = new_positions is not None
    repeated: int | None = 0
    skipped: int | None = 0
    epoch = epochs[0]
    note = ""
    if new_positions is None:
        why = (f"dp ranks are in different epochs {epochs}" if len(set(epochs)) > 1 else
               f"dp ranks consumed {positions} documents of blocks {lengths}; at {new_world} ranks the consumed "
               "documents of some new block are not a prefix of it")
        if policy == "exact":
            raise DataLoaderRemapError(
                f"HuggingFaceTextDataset positions cannot be carried exactly from {world} to {new_world} DP ranks: "
                f"{why}. Resize at an epoch boundary, resume at the saved DP degree, or set "
                "dataloader_resize='approximate' (same consumed fraction of the epoch on every rank)"
            )
        # progress in epochs, averaged over ranks weighted by block length (ranks loop at different steps)
        progress = sum(e * ln + p for e, p, ln in zip(epochs, positions, lengths)) / n if n else float(epochs[0])
        epoch = int(progress)
        new_positions = contiguous_at_fraction(progress - epoch, n, new_world)
        if len(set(epochs)) == 1 and epoch == 0:
            repeated, skipped = contiguous_difference(positions, new_positions, n)
            note = f"{repeated} documents repeat and {skipped} are skipped in epoch 0"
        else:
            repeated = skipped = None
            note = "which documents repeat or are skipped is not knowable (shuffled epoch or ranks in different epochs)"
    carried = carry_buffers(datasets, new_world)
    out = []
    for j, pos in enumerate(new_positions):
        state = copy.deepcopy(dict(records[min(j, world - 1)]["state"]))
        state["dataset_state"] = {**dict(state["dataset_state"]), **carried[j], "sample_idx": pos, "epoch": epoch}
        out.append(state)
    tokens = sum(len(c["inputs_buffer"]) for c in carried)
    return out, RemapReport(CONTIGUOUS, world, new_world, exact, sum(positions), repeated, skipped, tokens, note)
