"""The runs a streamed fp32 export reads and writes (converters/deepspeed/fp32.py): contiguous, in storage
order, covering the tensor exactly once, each within the memory budget."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit_converters.deepspeed.fp32 import _chunks


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=0, max_size=4), st.sampled_from([1, 2, 4, 6, 8, 12]),
       st.integers(1, 400))
def test_chunks_are_contiguous_runs_in_order_within_the_budget(shape: list[int], item: int, extra: int):
    budget = item + extra  # at least one element fits
    numbers = torch.arange(math.prod(shape)).reshape(shape)
    parts = [numbers[index] if index else numbers for index in _chunks(tuple(shape), item, budget)]
    assert all(p.numel() * item <= budget for p in parts)
    stream = torch.cat([p.reshape(-1) for p in parts]) if parts else torch.empty(0, dtype=torch.int64)
    assert torch.equal(stream, torch.arange(math.prod(shape)))  # row-major order, every element once
