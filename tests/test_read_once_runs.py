"""Read-once planning (pure): runs cover every needed byte exactly once, each with exactly the
ranks that need it, and every shared run gets one reader among them."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.engine.read_once import assign_readers, split_runs, windows


@st.composite
def plans(draw):
    world = draw(st.integers(1, 6))
    out = []
    for _ in range(world):
        ranges = []
        for obj in draw(st.lists(st.sampled_from(["a", "b", "c"]), max_size=3, unique=True)):
            cuts = sorted(draw(st.lists(st.integers(0, 64), min_size=2, max_size=6, unique=True)))
            for lo, hi in zip(cuts, cuts[1:]):  # disjoint, sometimes adjacent, ranges per object (as planned)
                if draw(st.booleans()):
                    ranges.append((obj, lo, hi))
        out.append(ranges)
    return out


@settings(max_examples=300, deadline=None)
@given(plans())
def test_runs_partition_exactly_what_each_rank_needs(ranges_by_rank):
    runs = split_runs(ranges_by_rank)
    seen: dict[tuple[str, int], tuple[int, ...]] = {}
    for run in runs:
        assert run.end > run.start and run.needers == tuple(sorted(set(run.needers)))
        for pos in range(run.start, run.end):
            assert (run.object, pos) not in seen  # every byte once
            seen[(run.object, pos)] = run.needers
    want: dict[tuple[str, int], set[int]] = {}
    for rank, ranges in enumerate(ranges_by_rank):
        for obj, lo, hi in ranges:
            for pos in range(lo, hi):
                want.setdefault((obj, pos), set()).add(rank)
    assert {k: set(v) for k, v in seen.items()} == want
    for run in runs:  # every run lies inside one range of each of its needers
        for rank in run.needers:
            assert any(o == run.object and lo <= run.start and run.end <= hi for o, lo, hi in ranges_by_rank[rank])
    readers = assign_readers(runs)
    assert all(r in run.needers for r, run in zip(readers, runs))
    groups = list(windows(runs, 16))
    assert [i for g in groups for i in g] == list(range(len(runs)))


def test_equal_shares_spread_over_the_needers():
    runs = split_runs([[("o", i * 10, i * 10 + 10) for i in range(8)]] * 4)
    assert len(runs) == 8  # one per range: adjacent ranges are separate requests
    assert sorted(assign_readers(runs)) == [0, 0, 1, 1, 2, 2, 3, 3]
    runs = split_runs([[("o", 0, 10)], [("o", 0, 10)], [("p", 0, 10)], [("p", 0, 10)]])
    readers = assign_readers(runs)
    assert readers[0] in (0, 1) and readers[1] in (2, 3)
    many = split_runs([[(f"o{i}", 0, 10) for i in range(8)] for _ in range(4)])
    counts = [assign_readers(many).count(r) for r in range(4)]
    assert counts == [2, 2, 2, 2]
