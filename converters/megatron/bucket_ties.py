"""Every group's walk put together: replicated parameters, and equal weights told apart by the saved order.

:mod:`.bucket_walk` places weight chunks in one data-parallel group's buckets by value. Two things are
settled here, over all groups:

* A parameter that tensor parallelism replicates (a norm) is in every TP rank's group: the lowest group's
  state is taken.
* Equal weights. Untrained norms, and in bf16 norms for many steps (1.0 plus updates below bf16's
  resolution), hold the same values, so the walk cannot tell their slots apart. Where every slot holding
  such a value holds the same state too, any placement hands each weight its own. Where the states differ,
  the order the checkpoint itself records decides, once checked: Megatron lays a buffer out in the reverse
  of the model's parameter registration order (``param_and_grad_buffer``: ``params[::-1]``), and the DCP
  metadata lists the model's keys in the order its sharded state dict was built, which is that registration
  order (layer by layer: a stacked key's position within a layer). Each unambiguous parameter's position is
  checked against it, in every bucket: where they all agree, a tied slot takes the one tied weight whose
  position lies between its neighbours' and whose layer is one the group's unambiguous parameters belong to
  (a pipeline stage holds its own layers; the tensors outside the layers count as one band before them and
  one after). Where the order does not hold, or leaves a choice, the import is refused naming the weights
  and the fix, never guessed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from ckptkit.errors import ManifestError
from ckptkit_converters.megatron import names
from ckptkit_converters.megatron.bucket_walk import FIX, Bucket, Placed, WeightChunk, MainCopy, Walk, digest
from ckptkit.storage.base import ByteStore

Key = tuple[str, tuple[int, ...]]
"""A weight chunk: (model key, chunk offsets)."""
Values = tuple[bytes, ...]
"""A parameter's weight digests, chunk by chunk: equal values, equal tuples."""


def _state_digests(src: ByteStore, chain: Sequence[Placed],
                   cache: dict[tuple[str, str], MainCopy]) -> tuple[bytes, ...]:
    """A digest of each saved state over the slot ``chain`` holds."""
    bucket, start = chain[0].bucket, chain[0].start
    end = chain[-1].start + chain[-1].weight.numel
    out = []
    for state in sorted(bucket.states):
        copy = cache.setdefault((bucket.name, state), MainCopy(src, bucket, state))
        out.append(digest(copy.values(start, end)))
    return tuple(out)


def _values(chain: Sequence[Placed]) -> Values:
    return tuple(p.weight.digest for p in chain)


def _tie_error(keys: set[str], why: str, where: str) -> ManifestError:
    listed = sorted(keys)
    return ManifestError(
        f"{where}: {', '.join(listed[:6])}{' ...' if len(listed) > 6 else ''} hold equal weights (as the model stores "
        f"them) but different optimizer states, and {why} (in bf16, norms stay equal for many steps); {FIX}")


class _Order:
    """A weight chunk's place in the model's parameter registration order, from the checkpoint's key order:
    (layer, key index) for a layer's tensors; tensors outside the layers before them (the embedding) or after
    them (the final norm, the output layer), by where their keys come."""

    def __init__(self, key_order: Sequence[str]) -> None:
        self._index = {k: i for i, k in enumerate(key_order)}
        layer_keys = [i for k, i in self._index.items() if k.startswith(names.LAYER_PREFIX)]
        self._first_layer_key = min(layer_keys, default=0)

    def __call__(self, w: WeightChunk) -> tuple[float, int]:
        layer = names.layer_of(w.key, w.chunk.box.offsets)
        if layer is None:
            index = self._index[w.key]
            return (float("-inf") if index < self._first_layer_key else float("inf"), index)
        return (float(layer), self._index[w.key])


def _break_ties(params: list[list[Placed]], open_values: set[Values], alike: Mapping[Values, Sequence[WeightChunk]],
                order: _Order, where: str) -> list[list[Placed]]:
    """One group's parameters (bucket by bucket, in bucket order) with each tied slot given the weight the
    registration order puts there; refused where the order does not hold or leaves a choice."""
    tied = [i for i, chain in enumerate(params) if _values(chain) in open_values]
    if not tied:
        return params  # nothing to tell apart here: the order is neither needed nor checked
    tied_set = set(tied)
    every = {w.key for v in open_values for w in alike[v]}
    if any(len(v) != 1 for v in open_values):
        raise _tie_error(every, "a fused parameter's halves cannot be ordered", where)
    out = list(params)
    buffer, last = None, None
    for i, chain in enumerate(params):  # the unambiguous parameters must follow the reversed order, buffer by buffer
        if chain[0].bucket.buffer != buffer:
            buffer, last = chain[0].bucket.buffer, None
        if i in tied_set:
            continue
        pos = order(chain[0].weight)
        if last is not None and pos > last:
            raise _tie_error(every, f"{chain[0].bucket.name!r} does not follow the checkpoint's key order, which "
                                    "would tell them apart", where)
        last = pos
    layers = {order(chain[0].weight)[0] for i, chain in enumerate(params) if i not in tied_set}  # this stage's
    for run in _runs(params, tied):
        above, below = _neighbours(params, run, order)
        classes = {_values(params[i]) for i in run}
        fits = sorted({(w.key, w.chunk.box.offsets): w for v in classes for w in alike[v]
                       if above > order(w) > below and order(w)[0] in layers}.values(), key=order, reverse=True)
        if len(fits) != len(run) or len({order(w) for w in fits}) != len(fits) or any(
                (w.digest,) != _values(params[i]) for w, i in zip(fits, run)):
            raise _tie_error({w.key for v in classes for w in alike[v]},
                             f"the checkpoint's key order leaves {len(fits)} of them for {len(run)} slot(s) of "
                             f"{params[run[0]][0].bucket.name!r}", where)
        for w, i in zip(fits, run):
            out[i] = [Placed(w, params[i][0].bucket, params[i][0].start)]
    return out


def _runs(params: Sequence[list[Placed]], tied: Sequence[int]) -> list[list[int]]:
    """The tied slots, as runs of neighbours in one grad buffer."""
    runs: list[list[int]] = []
    for i in tied:
        if runs and runs[-1][-1] == i - 1 and params[i - 1][0].bucket.buffer == params[i][0].bucket.buffer:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _neighbours(params: Sequence[list[Placed]], run: Sequence[int],
                order: _Order) -> tuple[tuple[float, int], tuple[float, int]]:
    """The registration positions of the untied parameters just before and after a run of tied slots in its
    grad buffer, across its buckets (the buffer's ends: unbounded). A buffer runs in reverse order, so the one
    before is the later one."""
    buffer = params[run[0]][0].bucket.buffer
    bounds = []
    for j, edge in ((run[0] - 1, (float("inf"), 0)), (run[-1] + 1, (float("-inf"), 0))):
        inside = 0 <= j < len(params) and params[j][0].bucket.buffer == buffer
        bounds.append(order(params[j][0].weight) if inside else edge)
    return bounds[0], bounds[1]


def _open_ties(src: ByteStore, params: Sequence[list[Placed]], by_digest: Mapping[bytes, list[WeightChunk]],
               chosen: dict[Key, Placed]) -> tuple[set[Values], dict[Values, list[WeightChunk]]]:
    """The values held by several weights whose slots hold different states (left to the order), and every
    weight of each tied value. Where the states are all equal, the weights the walk left unplaced take them."""
    by_values: dict[Values, list[Sequence[Placed]]] = {}
    for chain in params:
        by_values.setdefault(_values(chain), []).append(chain)
    cache: dict[tuple[str, str], MainCopy] = {}
    open_values, alike = set(), {}
    for values, chains in by_values.items():
        holders = {tuple((p.weight.key, p.weight.chunk.box.offsets) for p in c) for c in chains}
        alike[values] = by_digest[values[0]] if len(values) == 1 else []
        if len(holders) == 1 and len(alike[values]) <= 1:
            continue  # one parameter (in several groups where tensor parallelism replicates it)
        if len({_state_digests(src, c, cache) for c in chains}) > 1:
            open_values.add(values)
            continue
        first = chains[0][0]
        for w in alike[values]:
            if not w.key.endswith(names.BUFFERS):
                chosen.setdefault((w.key, w.chunk.box.offsets), Placed(w, first.bucket, first.start))
    return open_values, alike


def place(src: ByteStore, buckets: Sequence[Bucket], weights: Sequence[WeightChunk], key_order: Sequence[str],
          pool: ThreadPoolExecutor, where: str) -> dict[Key, Placed]:
    """(model key, chunk offsets) -> where its state is, every group walked (the groups side by side on
    ``pool``, each group's buckets in order); a chunk placed in several groups takes the lowest group's."""
    groups: dict[tuple[int, int], list[Bucket]] = {}
    for b in sorted(buckets, key=lambda b: (b.buffer, b.index)):  # a buffer's buckets in order
        groups.setdefault(b.group, []).append(b)

    def walk(group: tuple[int, int]) -> list[list[Placed]]:
        one = Walk(src, weights, where)
        return [chain for b in groups[group] for chain in one.bucket(b)]

    walked = list(pool.map(walk, sorted(groups)))
    by_digest: dict[bytes, list[WeightChunk]] = {}
    for w in sorted(weights, key=lambda w: (w.key, w.chunk.box.offsets)):
        by_digest.setdefault(w.digest, []).append(w)
    chosen: dict[Key, Placed] = {}
    open_values, alike = _open_ties(src, [c for found in walked for c in found], by_digest, chosen)
    if open_values:
        order = _Order(key_order)
        walked = [_break_ties(found, open_values, alike, order, where) for found in walked]
    placed: dict[Key, Placed] = {}
    for found in walked:
        for chain in found:
            for p in chain:
                placed.setdefault((p.weight.key, p.weight.chunk.box.offsets), p)
    return {**chosen, **placed}
