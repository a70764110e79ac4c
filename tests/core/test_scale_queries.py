"""The planners' queries that the 1,024-rank simulations (tests/test_scale_layouts.py) found slow.

* PieceIndex, the explicit layout's overlap query, agrees with a scan of every stored piece. It
  replaced that scan, which cost pieces x questions: a loading rank's source matching was the largest
  part of its metadata work at 128 ranks already, and grows with the job.
* A mesh answers "which coordinate has rank r" from a table built once per mesh.
* ZeRO-3's per-parameter runs are recorded as a FlatSplit (run length and writers), not piece by
  piece: at dp 128 the 70B model's manifest was 15 MB and a loading rank spent its time parsing it.
* Metadata is parsed with the cyclic garbage collector paused.
"""

from __future__ import annotations

from math import prod

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.layout.box import Box, Region
from ckptkit.layout.manifest import ExplicitLayout
from ckptkit.layout.piece_index import PieceIndex

from .strategies import shapes_st


def scan(pieces, box):
    return [(r, w) for r, w in pieces if any(b.intersect(box) is not None for b in r.boxes())]


@st.composite
def box_in(draw, shape):
    offs = tuple(draw(st.integers(0, n - 1)) for n in shape)
    return Box(offs, tuple(draw(st.integers(0, n - o)) for o, n in zip(offs, shape)))


@st.composite
def pieces_and_query(draw):
    """Whole boxes and flat fragments of boxes (ZeRO, distributed optimizer), overlapping or not."""
    shape = draw(shapes_st)
    pieces = []
    for writer in range(draw(st.integers(0, 12))):
        box = draw(box_in(shape)) if shape else Box((), ())
        if draw(st.booleans()) and box.numel:
            a = draw(st.integers(0, box.numel - 1))
            flat = (a, draw(st.integers(a, box.numel)))
        else:
            flat = None
        pieces.append((Region(box, flat), writer))
    query = draw(box_in(shape)) if shape else Box((), ())
    return pieces, query


@settings(max_examples=400, deadline=None)
@given(pieces_and_query())
def test_index_matches_a_scan(case):
    pieces, query = case
    assert PieceIndex(pieces).overlapping(query) == scan(pieces, query)


def test_stacked_layers_and_flat_fragments_at_scale():
    """A distributed-optimizer-like tensor: 80 layers, each cut into flat fragments over 32 ranks; a query for
    one layer's rows finds exactly that layer's fragments, without looking at the others."""
    shape = (80, 1024, 64)
    per_layer = prod(shape[1:])
    pieces = []
    for layer in range(80):
        box = Box((layer, 0, 0), (1, 1024, 64))
        cuts = [per_layer * k // 32 for k in range(33)]
        pieces += [(Region(box, (a, b)), k) for k, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    layout = ExplicitLayout(tuple(pieces))
    query = Box((41, 100, 0), (1, 200, 64))
    found = layout.overlapping(query)
    assert found == scan(pieces, query)
    assert {w for _, w in found} == set(range(3, 10)) and all(r.box.offsets[0] == 41 for r, _ in found)


def test_mesh_coordinates_are_tabled_once_per_mesh(monkeypatch):
    """A planner asks a mesh for its writers' coordinates once per writer; each answer used to hash the
    mesh's whole rank tuple (a 1,024-rank reshard plan spent a third of its time there)."""
    from ckptkit.layout import grid

    calls = []
    real = grid._coordinates
    monkeypatch.setattr(grid, "_coordinates", lambda shape, ranks: calls.append(1) or real(shape, ranks))
    mesh = grid.Mesh(("dp", "tp"), (256, 4), tuple(range(1024))[::-1])
    assert [mesh.coordinate(r) for r in (1023, 0, 5)] == [(0, 0), (255, 3), (254, 2)]
    assert all(mesh.coordinate(r) is not None for r in range(1024)) and mesh.coordinate(1024) is None
    assert len(calls) == 1


# ---------------------------------------------------------------- ZeRO-3's runs as a FlatSplit

def zero3_pieces(shape, dp, writers=None):
    """Rank r's ZeRO-3 fragment of a parameter (tests/scale_zero3.py, ckptkit/layout/zero_partition.py)."""
    from ckptkit.layout.zero_partition import Zero3SubGroup

    group = Zero3SubGroup((prod(shape),), dp)
    out = []
    for r in range(dp):
        f = group.param_fragment(0, r)
        if f is not None:
            out.append((Region(Box.full(shape), (f.start, f.stop)), (writers or list(range(dp)))[r]))
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=3), st.integers(1, 40), st.data())
def test_zero3_partitions_are_recognised_and_queried_exactly(dims, dp, data):
    from ckptkit.layout.flat_split import find_split

    shape = tuple(dims)
    pieces = zero3_pieces(shape, dp)
    split = find_split(shape, pieces)
    assert split is not None and split.pieces() == tuple(pieces)
    query = data.draw(box_in(shape))
    assert split.overlapping(query) == scan(pieces, query)


def reference_split(shape, pieces):
    """find_split by its definition: every piece a flat range of the whole tensor from its own writer, the
    ranges (in order of their start) consecutive from 0 to the end, all of one length but the last."""
    from ckptkit.layout.flat_split import FlatSplit

    n = prod(shape)
    if not pieces or any(r.flat is None or r.box != Box.full(shape) for r, _ in pieces):
        return None
    ordered = sorted(pieces, key=lambda p: p[0].flat)
    part = ordered[0][0].flat[1] - ordered[0][0].flat[0]
    want = [(a, min(a + part, n)) for a in range(0, n, part)] if part else None
    if want != [r.flat for r, _ in ordered] or len({w for _, w in pieces}) != len(pieces):
        return None
    return FlatSplit(tuple(shape), part, tuple(w for _, w in ordered))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=3), st.integers(1, 12), st.data())
def test_find_split_agrees_with_its_definition_on_shuffled_and_damaged_runs(dims, dp, data):
    """ZeRO-3's runs in any order (a merge sees them in rank order; find_split skips its sort then), and with
    one run dropped, moved, resized, given a box, or its writer repeated: recognised exactly when the
    definition says so, with the same runs and writers."""
    from ckptkit.layout.flat_split import find_split

    shape = tuple(dims)
    n = prod(shape)
    pieces = zero3_pieces(shape, dp, data.draw(st.permutations(range(dp))))
    pieces = data.draw(st.sampled_from([pieces, list(reversed(pieces)), data.draw(st.permutations(pieces))]))
    damage = data.draw(st.sampled_from(["none", "drop", "shift", "box", "writer", "grow"]))
    i = data.draw(st.integers(0, len(pieces) - 1))
    region, writer = pieces[i]
    a, b = region.flat
    if damage == "drop":
        pieces = pieces[:i] + pieces[i + 1:]
    elif damage == "shift":
        pieces[i] = (Region(region.box, (max(0, a - 1), max(0, a - 1) + (b - a))), writer)
    elif damage == "grow":
        pieces[i] = (Region(region.box, (a, min(n, b + 1))), writer)
    elif damage == "box":
        pieces[i] = (Region(region.box), writer)
    elif damage == "writer":
        pieces[i] = (region, pieces[(i + 1) % len(pieces)][1])
    assert find_split(shape, pieces) == reference_split(shape, pieces)


def test_other_piece_sets_are_not_a_split():
    from ckptkit.layout.flat_split import find_split

    shape = (6, 4)
    full = Box.full(shape)
    runs = [(Region(full, (0, 8)), 0), (Region(full, (8, 16)), 1), (Region(full, (16, 24)), 2)]
    assert find_split(shape, runs) is not None
    assert find_split(shape, runs[:2]) is None  # a gap at the end
    assert find_split(shape, [runs[0], (Region(full, (8, 20)), 1), (Region(full, (20, 24)), 2)]) is None  # unequal
    assert find_split(shape, [runs[0], runs[1], (Region(full, (16, 24)), 0)]) is None  # a writer twice
    assert find_split(shape, [(Region(Box((0, 0), (3, 4))), 0), (Region(Box((3, 0), (3, 4))), 1)]) is None  # boxes
    assert find_split(shape, [(Region(full), 0)]) is None  # a whole-box piece names no flat range


def test_a_split_manifest_round_trips_as_version_3_and_others_stay_version_2():
    from ckptkit.layout.manifest import IndexRef, Manifest
    from ckptkit.plan.merge import RankReport, merge_reports
    from ckptkit.plan.save_plan import ExplicitReport

    shape, dp = (1000, 24), 64
    by_rank = {w: [ExplicitReport("optimizer/exp_avg/w", "float32", shape, r)] for r, w in zero3_pieces(shape, dp)}
    by_rank[3].append(ExplicitReport("model/b", "float32", (8,), Region(Box((0,), (8,)))))  # listed, not a split
    reports = [RankReport(r, IndexRef(r, f"index/rank-{r:05d}.json", 1, "0" * 64), (), tuple(by_rank.get(r, ())))
               for r in range(dp)]
    manifest = merge_reports(reports, world_size=dp, values={}, meta={}, parallel=None, where="t")
    blob = manifest.to_json_bytes()
    assert b'"split":{"part":375,"writers":{"start":0,"step":1}}' in blob and b'"version":3' in blob
    back = Manifest.from_json_bytes(blob, "t")
    assert back.tensors["optimizer/exp_avg/w"].stored_pieces() == zero3_pieces(shape, dp)
    assert back.tensors["model/b"].layout.split is None
    del manifest.tensors["optimizer/exp_avg/w"]
    assert b'"version":2' in manifest.to_json_bytes()
    few = [RankReport(w, IndexRef(w, f"index/rank-{w:05d}.json", 1, "0" * 64), (),
                      (ExplicitReport("w", "float32", shape, r),)) for r, w in zero3_pieces(shape, 4)]
    small = merge_reports(few, world_size=4, values={}, meta={}, parallel=None, where="t")
    assert small.tensors["w"].layout.split is None and b'"version":2' in small.to_json_bytes()  # 4 runs: listed


def test_a_hostile_split_is_refused():
    import pytest

    from ckptkit.errors import ManifestError
    from ckptkit.layout.flat_split import FlatSplit

    shape = (1 << 40,)
    for raw, what in [({"part": 0, "writers": []}, "below 1"),
                      ({"part": 1, "writers": {"start": 0, "step": 1}}, "more than the 8 ranks"),
                      ({"part": 1 << 38, "writers": [0, 1, 2, 8]}, "distinct ranks"),
                      ({"part": 1 << 38, "writers": [0, 1, 1, 2]}, "distinct ranks"),
                      ({"part": 1 << 38, "writers": [0, 1]}, "4 runs, 2 writers")]:
        with pytest.raises(ManifestError, match=what):
            FlatSplit.from_json(raw, shape, 8, "t")


def test_metadata_parses_with_the_collector_paused_and_restores_it():
    """Manifests and indexes are parsed with the cyclic GC paused (most of an index's parse went to the
    collector in a process holding a large heap); its state before is restored, nested or not, threads too."""
    import gc
    import threading

    from ckptkit.layout.strict_json import gc_paused

    seen = []
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            with gc_paused():
                seen.append(gc.isenabled())
                with gc_paused():
                    seen.append(gc.isenabled())
            assert gc.isenabled() is enabled
        finally:
            gc.enable()
    assert seen == [False, False, False, False]

    def parse_in_thread() -> None:
        with gc_paused():
            barrier.wait()
            barrier.wait()

    barrier = threading.Barrier(3)
    workers = [threading.Thread(target=parse_in_thread) for _ in range(2)]
    for w in workers:
        w.start()
    barrier.wait()  # both inside: paused
    assert not gc.isenabled()
    barrier.wait()
    for w in workers:
        w.join()
    assert gc.isenabled()


def test_small_replicated_tensors_share_one_writer_in_large_groups():
    """Per-parameter scalars replicated over every rank (torchtitan's Adam ``step``) went to a writer each,
    so a loading rank read hundreds of indexes for them; from 64 replicas on they share one writer, while
    large tensors still spread over the replicas. Small groups are planned as before."""
    from ckptkit.layout.grid import GridLayout, Mesh, Replicate
    from ckptkit.plan.save_plan import GridDecl, grid_rotations

    def decls(replicas):
        mesh = Mesh(("replica", "rank"), (replicas, 1), tuple(range(replicas)))
        tiny = [GridDecl(i, f"step.{i}", "float32", 4, (), GridLayout(mesh, (Replicate(), Replicate()), ()), (0, 0))
                for i in range(300)]
        big = [GridDecl(300 + i, f"w.{i}", "float32", 4, (512, 512), GridLayout(mesh, (Replicate(), Replicate()),
                                                                                 (512, 512)), (0, 0))
               for i in range(5)]
        return tiny + big

    rot = grid_rotations(decls(128))
    assert len({rot[f"step.{i}"] for i in range(300)}) == 1
    assert len({rot[f"w.{i}"] for i in range(5)}) == 5
    few = grid_rotations(decls(8))
    assert len({few[f"step.{i}"] for i in range(300)}) > 1  # spread over the least loaded, as before


def _positions(box: Box, outer: Box) -> list[int]:
    """Row-major positions in ``outer`` of every element of ``box``, by enumeration (the oracle)."""
    import itertools

    return sorted(outer.position(idx) for idx in itertools.product(*(range(o, o + s) for o, s in zip(box.offsets, box.sizes))))


@st.composite
def run_box_in(draw, shape):
    """A box that is one consecutive run of ``shape``'s flattening: single indices, one cut axis, full axes."""
    cut = draw(st.integers(0, len(shape) - 1))
    offs, sizes = [], []
    for d, n in enumerate(shape):
        if d < cut:
            offs.append(draw(st.integers(0, n - 1)))
            sizes.append(1)
        elif d == cut:
            o = draw(st.integers(0, n - 1))
            offs.append(o)
            sizes.append(draw(st.integers(1, n - o)))
        else:
            offs.append(0)
            sizes.append(n)
    return Box(tuple(offs), tuple(sizes))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.data())
def test_run_in_is_the_positions_a_box_covers_when_they_are_consecutive(dims, data):
    shape = tuple(dims)
    outer = Box.full(shape)
    box = data.draw(st.one_of(box_in(shape), run_box_in(shape)))
    got = box.run_in(outer)
    pos = _positions(box, outer)
    consecutive = bool(pos) and pos == list(range(pos[0], pos[0] + len(pos)))
    assert (got is not None) == consecutive
    if got is not None:
        assert got == (pos[0], pos[-1] + 1)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=0, max_size=4), st.data())
def test_elements_in_counts_a_regions_elements_inside_a_box(dims, data):
    shape = tuple(dims)
    outer = Box.full(shape)
    n = prod(shape)
    a = data.draw(st.integers(0, n))
    region = Region(outer, (a, data.draw(st.integers(a, n)))) if data.draw(st.booleans()) else Region(
        data.draw(box_in(shape)) if shape else outer)
    box = data.draw(st.one_of(box_in(shape), run_box_in(shape))) if shape else outer
    stored = set(_positions(region.box, outer)) if region.flat is None else set(
        _positions(region.box, outer)[region.flat[0]:region.flat[1]])
    assert region.elements_in(box) == len(stored & set(_positions(box, outer)))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=3), st.integers(1, 40), st.data())
def test_zero3_runs_overlapping_a_run_of_the_tensor_are_found_by_arithmetic(dims, dp, data):
    from ckptkit.layout.flat_split import find_split

    shape = tuple(dims)
    pieces = zero3_pieces(shape, dp)
    split = find_split(shape, pieces)
    assert split is not None
    query = data.draw(run_box_in(shape))
    assert split.overlapping(query) == scan(pieces, query)
