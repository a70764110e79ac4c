"""States laid out the way pipeline-parallel jobs lay them out: every rank holds its own set of keys.

Stage-specific modules next to buffers every stage has, counters only some ranks keep, values
that agree or differ between ranks, tensors, per-rank values and generators, in random mixes
(hypothesis) on a real 3-process gloo world. Whatever the mix, a save either commits and every
rank loads back exactly what it saved (and any other world size reads every tensor and agreed
value), or fails with a clear error on every rank — nothing is ever dropped.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit
from tests.conftest import trials

WORLD = 3
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}


# ---------------------------------------------------------------- building a rank's state from a spec

def tensor_of(entry: dict) -> torch.Tensor:
    g = torch.Generator().manual_seed(entry["seed"])
    t = torch.randn(entry["shape"], generator=g) * 100
    return t.to(DTYPES[entry["dtype"]])


def value_of(entry: dict, rank: int):
    base = decode(entry["value"])
    return [base, rank] if entry["differs"] else base


def decode(v):
    """Specs travel as JSON-like data; tags make the tuples and bytes values exercise the codec."""
    if isinstance(v, dict) and "tuple" in v:
        return tuple(decode(x) for x in v["tuple"])
    if isinstance(v, dict) and "bytes" in v:
        return bytes(v["bytes"])
    if isinstance(v, dict):
        return {k: decode(x) for k, x in v.items()}
    if isinstance(v, list):
        return [decode(x) for x in v]
    return v


def put(state: dict, key: str, leaf) -> None:
    *parents, last = key.split("/")
    node = state
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = leaf


def build(spec: list[dict], rank: int, blank: bool) -> dict:
    state: dict = {}
    for e in spec:
        if rank not in e["holders"]:
            continue
        kind = e["kind"]
        if kind == "tensor":
            t = tensor_of(e)
            put(state, e["key"], torch.zeros_like(t) if blank else t)
        elif kind == "value":
            put(state, e["key"], "blank" if blank else value_of(e, rank))
        elif kind == "per_rank":
            put(state, e["key"], ckptkit.PerRank(None if blank else {"pos": rank * 1000 + e["seed"]}))
        else:  # generator
            put(state, e["key"], torch.Generator().manual_seed(0 if blank else e["seed"] * 10 + rank))
    return state


def leaves(state: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in state.items():
        key = f"{prefix}/{k}" if prefix else k
        if isinstance(v, dict) and v and not isinstance(v, ckptkit.PerRank):
            out.update(leaves(v, key))
        else:
            out[key] = v
    return out


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, ckptkit.PerRank):
        return a.value == b.value
    if isinstance(a, torch.Generator):
        return torch.equal(a.get_state(), b.get_state())
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


def save_and_reload(path: str, spec: list[dict]) -> str:
    """On every rank: save this rank's state, load it back into a blank one, compare every leaf."""
    rank = dist.get_rank()
    try:
        ckptkit.save(build(spec, rank, blank=False), path)
    except ckptkit.SaveError as exc:
        return f"save failed: {exc}"
    target = build(spec, rank, blank=True)
    ckptkit.load(target, path)
    want, got = leaves(build(spec, rank, blank=False)), leaves(target)
    assert want.keys() == got.keys()
    bad = [k for k in want if not same(want[k], got[k])]
    assert not bad, f"rank {rank}: {bad} differ: {[(want[k], got[k]) for k in bad][:3]}"
    return "ok"


# ---------------------------------------------------------------- specs

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    | st.builds(lambda xs: {"tuple": xs}, st.lists(inner, max_size=3)),
    max_leaves=6,
)


@st.composite
def specs(draw) -> list[dict]:
    n = draw(st.integers(1, 8))
    groups = ["model", "stage0", "stage1", "optim"]
    out = []
    for i in range(n):
        kind = draw(st.sampled_from(["tensor", "tensor", "value", "value", "per_rank", "generator"]))
        holders = sorted(draw(st.sets(st.integers(0, WORLD - 1), min_size=1)))
        entry = {"key": f"{draw(st.sampled_from(groups))}/k{i}", "kind": kind, "holders": holders, "seed": i}
        if kind == "tensor":
            entry["shape"] = draw(st.lists(st.integers(0, 5), max_size=3))
            entry["dtype"] = draw(st.sampled_from(sorted(DTYPES)))
        elif kind == "value":
            value = draw(json_values)
            # a non-empty dict is a container of the state (its items are the leaves), not one value
            entry["value"] = [value] if isinstance(value, dict) and value and "tuple" not in value else value
            entry["differs"] = len(holders) > 1 and draw(st.booleans())
        out.append(entry)
    return out


def check_from_one_process(path: str, spec: list[dict]) -> None:
    """Another world size (one process, the test's) reads every tensor and agreed value, exactly,
    and finds values the ranks disagreed about stored per rank."""
    view = ckptkit.open(path)
    for e in spec:
        if e["kind"] == "tensor":
            assert same(view[e["key"]][...], tensor_of(e)), e["key"]
        elif e["kind"] == "value" and not e["differs"]:
            assert same(view.values[e["key"]], value_of(e, 0)), e["key"]
        elif e["kind"] == "value":
            groups = view.manifest.rank_values[e["key"]]
            assert sorted(r for _, ranks in groups for r in ranks) == e["holders"]
    state = {}
    for e in spec:
        if e["kind"] == "tensor":
            put(state, e["key"], torch.zeros_like(tensor_of(e)))
        elif e["kind"] == "value" and not e["differs"]:
            put(state, e["key"], "blank")
    ckptkit.load(state, path, strict=False)
    got = leaves(state)
    for e in spec:
        if e["key"] in got:
            want = tensor_of(e) if e["kind"] == "tensor" else value_of(e, 0)
            assert same(got[e["key"]], want), e["key"]


# ---------------------------------------------------------------- the reported cases

def test_values_held_only_by_other_ranks_are_saved(worlds, tmp_path):
    spec = [{"key": f"rank{r}/w", "kind": "tensor", "holders": [r], "seed": r, "shape": [4], "dtype": "float32"}
            for r in range(WORLD)]
    spec += [{"key": f"rank{r}/step", "kind": "value", "holders": [r], "seed": 0, "value": 3, "differs": False}
             for r in range(WORLD)]
    assert worlds.run(WORLD, save_and_reload, str(tmp_path / "c"), spec) == ["ok"] * WORLD
    check_from_one_process(str(tmp_path / "c"), spec)


def test_a_tensor_every_rank_holds_next_to_rank_specific_ones(worlds, tmp_path):
    spec = [{"key": "shared", "kind": "tensor", "holders": list(range(WORLD)), "seed": 9, "shape": [3, 2],
             "dtype": "float32"}]
    spec += [{"key": f"rank{r}/w", "kind": "tensor", "holders": [r], "seed": r, "shape": [4], "dtype": "bfloat16"}
             for r in range(WORLD)]
    assert worlds.run(WORLD, save_and_reload, str(tmp_path / "c"), spec) == ["ok"] * WORLD
    view = ckptkit.open(tmp_path / "c")
    shared = view.manifest.tensors["shared"]
    assert len(shared.stored_pieces()) == 1  # written once, by one of its replicas
    check_from_one_process(str(tmp_path / "c"), spec)


def test_values_that_differ_between_ranks_are_kept_per_rank(worlds, tmp_path):
    spec = [{"key": "train/loss", "kind": "value", "holders": list(range(WORLD)), "seed": 0, "value": 1.5,
             "differs": True},
            {"key": "train/step", "kind": "value", "holders": list(range(WORLD)), "seed": 0, "value": 7,
             "differs": False}]
    assert worlds.run(WORLD, save_and_reload, str(tmp_path / "c"), spec) == ["ok"] * WORLD
    view = ckptkit.open(tmp_path / "c")
    assert view.values == {"train/step": 7}
    assert view.manifest.rank_values["train/loss"] == tuple(([1.5, r], (r,)) for r in range(WORLD))
    # another world size cannot tell whose loss to take: refused by default, kept on request
    state = {"train": {"loss": None, "step": 0}}
    with pytest.raises(ckptkit.StateMismatchError, match="train/loss"):
        ckptkit.load(state, tmp_path / "c")
    ckptkit.load(state, tmp_path / "c", options=ckptkit.LoadOptions(per_rank_on_resize="skip"))
    assert state == {"train": {"loss": None, "step": 7}}


def test_a_key_that_is_a_tensor_on_one_rank_and_a_value_on_another_is_refused(worlds, tmp_path):
    spec = [{"key": "x/y", "kind": "tensor", "holders": [0], "seed": 1, "shape": [2], "dtype": "float32"},
            {"key": "x/y", "kind": "value", "holders": [1, 2], "seed": 1, "value": 3, "differs": False}]
    out = worlds.run(WORLD, save_and_reload, str(tmp_path / "c"), spec)
    assert all(o.startswith("save failed") and "'x/y' is a tensor on some ranks and a value on others" in o
               for o in out), out
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_ranks_disagreeing_about_a_plain_tensor_is_refused_naming_it(worlds, tmp_path):
    spec = [{"key": "buf", "kind": "tensor", "holders": [0, 1], "seed": 1, "shape": [2], "dtype": "float32"},
            {"key": "buf", "kind": "tensor", "holders": [2], "seed": 1, "shape": [3], "dtype": "float32"}]
    out = worlds.run(WORLD, save_and_reload, str(tmp_path / "c"), spec)
    pattern = r"tensor 'buf' is float32\[(2\] on rank [01] but float32\[3\] on rank 2|3\] on rank 2 but float32\[2\])"
    assert all(o.startswith("save failed") and re.search(pattern, o) for o in out), out


def ask_for_per_rank_values_of_others(path: str, holders: list[int]) -> dict:
    """Only ``holders`` save a data-loader position and a generator; then every rank loads asking for
    both: strict, then non-strict. What each rank got back."""
    rank = dist.get_rank()
    state: dict = {"w": torch.full((2,), float(rank))}
    if rank in holders:
        state["loader"] = ckptkit.PerRank({"pos": 100 + rank})
        state["rng"] = torch.Generator().manual_seed(1000 + rank)
    ckptkit.save(state, path)
    out: dict = {}
    for strict in (True, False):
        gen = torch.Generator().manual_seed(7)
        want = {"w": torch.zeros(2), "loader": ckptkit.PerRank({"pos": -1}), "rng": gen}
        try:
            res = ckptkit.load(want, path, strict=strict)
            out[strict] = {"pos": want["loader"].value["pos"], "missing": sorted(res.missing),
                           "rng": torch.equal(gen.get_state(), torch.Generator().manual_seed(1000 + rank).get_state())}
        except ckptkit.CkptkitError as exc:
            out[strict] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.parametrize("holders", [[1], [0, 2]])
def test_a_per_rank_value_another_rank_saved_is_missing_not_kept(worlds, tmp_path, holders):
    """A rank that asks for a per-rank value or generator it did not save (another rank did) kept its own
    without a word, even under strict=True, until 2026-12-06. Strict: every rank fails, naming the keys
    and the rank; non-strict: listed in ``missing``, this rank's own kept; a rank that saved them gets them."""
    outs = worlds.run(WORLD, ask_for_per_rank_values_of_others, str(tmp_path / "c"), holders)
    for rank, out in enumerate(outs):
        assert isinstance(out[True], str), (rank, out)
        lacking = [r for r in range(WORLD) if r not in holders]
        assert f"not by rank {lacking[0]}" in out[True] or f"not by rank {rank}" in out[True], (rank, out)
        if rank in holders:
            assert out[False] == {"pos": 100 + rank, "missing": [], "rng": True}, (rank, out)
        else:
            assert out[False] == {"pos": -1, "missing": ["loader", "rng"], "rng": False}, (rank, out)


# ---------------------------------------------------------------- the class: random per-rank states

@settings(max_examples=trials(30, 300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(spec=specs())
def test_random_per_rank_states_round_trip(worlds, tmp_path_factory, spec):
    path = str(tmp_path_factory.mktemp("hetero") / "c")
    out = worlds.run(WORLD, save_and_reload, path, spec)
    assert out == ["ok"] * WORLD, out
    check_from_one_process(path, spec)
