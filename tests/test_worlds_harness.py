"""The test harness's own promise: a world call that hangs fails in bounded time and says where every rank was
(a hang seen once under load, and never again, is otherwise a timeout with nothing to go on)."""

from __future__ import annotations

import time

import pytest

from tests.worlds import World, WorldError


def _stuck_in_a_named_place(seconds: float) -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(seconds)
    return dist.get_rank()


def test_a_call_that_times_out_reports_every_ranks_stack():
    world = World(2)
    try:
        assert world.run(_stuck_in_a_named_place, 0.0) == [0, 1]
        t0 = time.monotonic()
        with pytest.raises(WorldError, match="rank 1 did not finish _stuck_in_a_named_place in time") as info:
            world.run(_stuck_in_a_named_place, 120.0, timeout=3.0)
        assert time.monotonic() - t0 < 60  # not the 120 s the rank sleeps
        text = str(info.value)
        rank1 = text.split("--- rank 1 stacks ---", 1)[1]
        assert "_stuck_in_a_named_place" in rank1 and "test_worlds_harness.py" in rank1, text
        assert "--- rank 0 stacks ---" in text  # the rank that finished answers too (idle in the harness loop)
    finally:
        world.close()
    assert world.broken
