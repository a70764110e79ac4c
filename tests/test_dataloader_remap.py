"""The pure data-loader remap (no torch): property tests against brute-force oracles.

Interleaved (DistributedSampler): for any world sizes and any consumed prefix,
the samples consumed before the resize plus the samples the new ranks yield
afterwards are the epoch, each exactly once, and every following global batch
is the next contiguous run of the epoch's order. Contiguous (torchtitan's
HF-datasets text loader): the remap claims exactness exactly when the consumed
documents of every new block form a prefix of it, and then nothing repeats or
goes missing. Approximations report the true numbers of repeated and skipped
samples.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ckptkit.adapters import dataloader_remap as remap

world_sizes = st.integers(1, 9)


def sampler_records(counts: list[int], n: int = 1000) -> list[dict]:
    """Records as the torchtitan adapter writes them for a StatefulDataLoader over StatefulDistributedSampler."""
    out = []
    for r, y in enumerate(counts):
        state = {"_index_sampler_state": None,
                 "_sampler_iter_state": {"samples_yielded": y, "sampler_state": {"yielded": y}},
                 "_sampler_iter_yielded": y, "_num_yielded": y, "_IterableDataset_len_called": None,
                 "_shared_seed": None, "fetcher_state": None, "dataset_state": None, "_iterator_finished": False}
        out.append({"format": 1, "kind": remap.INTERLEAVED, "dp_rank": r, "dp_world_size": len(counts),
                    "info": {"dataset_len": n, "seed": 7, "shuffle": True, "drop_last": False, "epoch": 0},
                    "state": state})
    return out


def hf_records(positions: list[int], n: int, epoch: int = 0, buffers: list[list[int]] | None = None) -> list[dict]:
    """Records of torchtitan's HuggingFaceTextDataset over a map-style dataset of ``n`` documents."""
    bounds = remap.contiguous_bounds(n, len(positions))
    out = []
    for r, (k, (a, b)) in enumerate(zip(positions, bounds)):
        buf = (buffers or [[]] * len(positions))[r]
        ds = {"inputs_buffer": list(buf), "labels_buffer": [t + 1 for t in buf],
              "positions_buffer": list(range(3, 3 + len(buf))), "sample_idx": k, "epoch": epoch}
        state = {"_sampler_iter_state": {"samples_yielded": 0}, "fetcher_state": {"dataset_iter_state": None,
                 "fetcher_ended": False}, "dataset_state": ds, "_iterator_finished": False}
        out.append({"format": 1, "kind": remap.CONTIGUOUS, "dp_rank": r, "dp_world_size": len(positions),
                    "info": {"chunk_len": b - a}, "state": state})
    return out


def yielded(state: dict) -> int:
    return state["_sampler_iter_state"]["sampler_state"]["yielded"]


# ------------------------------------------------------------------ interleaved
@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 120), old=world_sizes, new=world_sizes, data=st.data())
def test_interleaved_resume_yields_the_rest_of_the_epoch_once(n, old, new, data):
    prefix = data.draw(st.integers(0, n))
    counts = remap.interleaved_counts(prefix, old)  # equal counts, or off by one in rank order
    states, report = remap.remap_records(sampler_records(counts, n), new)
    assert report.exact and report.consumed == prefix and report.repeated == report.skipped == 0
    seen = [i * old + r for r, y in enumerate(counts) for i in range(y)]
    after = [p for j, s in enumerate(states) for p in range(j + yielded(s) * new, n, new)]
    assert sorted(seen + after) == list(range(n))  # every sample once: none repeated, none skipped
    batch = data.draw(st.integers(1, 5))  # the next global batch is the next run of the epoch's order
    nxt = [p for j, s in enumerate(states) for p in range(j + yielded(s) * new, n, new)[:batch]]
    if prefix + batch * new <= n:
        assert sorted(nxt) == list(range(prefix, prefix + batch * new))


@given(steps=st.integers(0, 20), batch=st.integers(1, 4), old=world_sizes, new=world_sizes)
def test_interleaved_equal_consumption_is_always_exact(steps, batch, old, new):
    """torchtitan's DP ranks step together: every rank yields steps * local_batch samples."""
    states, report = remap.remap_records(sampler_records([steps * batch] * old), new)
    assert report.exact and sum(yielded(s) for s in states) == steps * batch * old


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(0, 12), min_size=2, max_size=6), new=world_sizes)
def test_interleaved_uneven_counts_are_refused_or_reported_truthfully(counts, new):
    assume(remap.interleaved_prefix(counts) is None and new != len(counts))
    with pytest.raises(remap.DataLoaderRemapError, match="not a prefix"):
        remap.remap_records(sampler_records(counts), new)
    states, report = remap.remap_records(sampler_records(counts), new, policy="approximate")
    seen = {i * len(counts) + r for r, y in enumerate(counts) for i in range(y)}
    skipped_now = {p for j, s in enumerate(states) for p in range(j, yielded(s) * new, new)}
    assert not report.exact and report.consumed == len(seen) == len(skipped_now)
    assert report.repeated == len(seen - skipped_now) and report.skipped == len(skipped_now - seen)


# ------------------------------------------------------------------- contiguous
def blocks(n: int, world: int) -> list[range]:
    """Oracle for datasets' Dataset.shard(world, r, contiguous=True): the first n % world blocks are one longer."""
    out, start = [], 0
    for r in range(world):
        size = n // world + (1 if r < n % world else 0)
        out.append(range(start, start + size))
        start += size
    return out


@given(n=st.integers(0, 200), world=world_sizes)
def test_contiguous_bounds_are_datasets_shards(n, world):
    assert [range(a, b) for a, b in remap.contiguous_bounds(n, world)] == blocks(n, world)


def exact_oracle(positions: list[int], n: int, new: int, shuffled: bool) -> list[int] | None:
    """Brute force: which documents are consumed (None: unknown), and is each new block's share a resumable prefix."""
    state: dict[int, bool | None] = {}
    for blk, k in zip(blocks(n, len(positions)), positions):
        for i, doc in enumerate(blk):
            state[doc] = (i < k) if (not shuffled or k in (0, len(blk))) else None
    out = []
    for blk in blocks(n, new):
        marks = [state[d] for d in blk]
        if None in marks:
            return None
        k = sum(marks)
        if marks != [True] * k + [False] * (len(blk) - k):
            return None
        if shuffled and k not in (0, len(blk)):
            return None
        out.append(k)
    return out


@settings(max_examples=400, deadline=None)
@given(n=st.integers(1, 60), old=world_sizes, new=world_sizes, shuffled=st.booleans(), data=st.data())
def test_contiguous_is_exact_exactly_when_every_new_block_resumes_at_a_prefix(n, old, new, shuffled, data):
    sizes = [len(b) for b in blocks(n, old)]
    # bias towards untouched / finished blocks, where exact remaps exist
    positions = [data.draw(st.sampled_from([0, s]) | st.integers(0, s)) for s in sizes]
    assume(new != old)
    expected = exact_oracle(positions, n, new, shuffled)
    records = hf_records(positions, n, epoch=1 if shuffled else 0)
    if expected is None:
        with pytest.raises(remap.DataLoaderRemapError):
            remap.remap_records(records, new)
        return
    states, report = remap.remap_records(records, new)
    assert report.exact and [s["dataset_state"]["sample_idx"] for s in states] == expected
    if not shuffled:  # epoch 0 reads blocks in order: old consumption + new reads = the epoch, once each
        seen = [d for blk, k in zip(blocks(n, old), positions) for d in blk[:k]]
        after = [d for blk, k in zip(blocks(n, new), expected) for d in blk[k:]]
        assert sorted(seen + after) == list(range(n))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 60), old=world_sizes, new=world_sizes, data=st.data())
def test_contiguous_approximation_reports_the_true_difference(n, old, new, data):
    positions = [data.draw(st.integers(0, len(b))) for b in blocks(n, old)]
    assume(new != old and exact_oracle(positions, n, new, False) is None)
    states, report = remap.remap_records(hf_records(positions, n), new, policy="approximate")
    after = [s["dataset_state"]["sample_idx"] for s in states]
    assert abs(sum(after) - sum(positions)) <= new  # the epoch's sample budget, to rounding per rank
    seen = {d for blk, k in zip(blocks(n, old), positions) for d in blk[:k]}
    now = {d for blk, k in zip(blocks(n, new), after) for d in blk[:k]}
    assert (report.repeated, report.skipped) == (len(seen - now), len(now - seen))


def test_contiguous_ranks_in_different_epochs_need_the_approximation():
    records = hf_records([3, 2], 10)
    records[1]["state"]["dataset_state"]["epoch"] = 1
    with pytest.raises(remap.DataLoaderRemapError, match="different epochs"):
        remap.remap_records(records, 1)
    states, report = remap.remap_records(records, 1, policy="approximate")
    # (0 * 5 + 3 + 1 * 5 + 2) / 10 = 1.0 epochs of progress: the single rank starts epoch 1
    assert (states[0]["dataset_state"]["epoch"], states[0]["dataset_state"]["sample_idx"]) == (1, 0)
    assert report.repeated is None and report.skipped is None
    records[0]["state"]["dataset_state"]["sample_idx"] = 1  # (1 + 5 + 2) / 10 = 0.8 epochs: 8 documents into epoch 0
    states, _ = remap.remap_records(records, 1, policy="approximate")
    assert (states[0]["dataset_state"]["epoch"], states[0]["dataset_state"]["sample_idx"]) == (0, 8)


# -------------------------------------------------------------- packing buffers
@given(buffers=st.lists(st.lists(st.integers(0, 99), max_size=7), min_size=1, max_size=6), new=world_sizes)
def test_packing_buffers_are_carried_whole(buffers, new):
    n = 7 * len(buffers)
    records = hf_records([0] * len(buffers), n, buffers=buffers)
    states, report = remap.remap_records(records, new) if new != len(buffers) else (None, None)
    if states is None:
        return
    assert report.carried_tokens == sum(map(len, buffers))
    for j, s in enumerate(states):
        ds = s["dataset_state"]
        mine = [b for r, b in enumerate(buffers) if r % new == j]
        assert ds["inputs_buffer"] == [t for b in mine for t in b]  # old buffers back to back, in rank order
        assert ds["labels_buffer"] == [t + 1 for b in mine for t in b]
        assert ds["positions_buffer"] == [p for b in mine for p in range(len(b))]  # each restarts at 0


def test_normalize_positions_is_torchtitans_rule():
    assert remap.normalize_positions([5, 6, 7, 0, 1]) == [0, 1, 2, 0, 1]
    assert remap.normalize_positions([0, 1, 0]) == [0, 1, 0] and remap.normalize_positions([]) == []


# ---------------------------------------------------------------------- refusals
def test_records_must_cover_every_dp_rank_with_one_kind():
    with pytest.raises(remap.DataLoaderRemapError, match="cover dp ranks"):
        remap.remap_records(sampler_records([2, 2, 2])[:2], 1)
    mixed = sampler_records([2, 2]) + []
    mixed[1] = {**hf_records([0, 0], 10)[1]}
    with pytest.raises(remap.DataLoaderRemapError, match="differs from dp rank 0"):
        remap.remap_records(mixed, 1)
    opaque = [{**r, "kind": remap.OPAQUE} for r in sampler_records([2, 2])]
    with pytest.raises(remap.DataLoaderRemapError, match="resume at the saved DP degree"):
        remap.remap_records(opaque, 1)
    states, report = remap.remap_records(opaque, 2)  # same degree: each rank's own state, whatever the kind
    assert report.exact and states[1] == opaque[1]["state"]


def test_streaming_dataset_state_is_refused():
    records = hf_records([1, 1], 10)
    for r in records:
        del r["state"]["dataset_state"]["sample_idx"]
        r["state"]["dataset_state"]["data"] = {"shard_idx": 0}
    with pytest.raises(remap.DataLoaderRemapError, match="iterable/streaming"):
        remap.remap_records(records, 1)
