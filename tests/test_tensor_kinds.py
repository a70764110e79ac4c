"""Every kind of tensor a state can hold: saved and loaded back bit-exact, or refused by name before
anything is written — on every save path, never a committed checkpoint that a load then refuses.

The class of defect: a save used to commit tensors of dtypes the checkpoint format does not name
(``uint16``, the float8 variants AMD's fp8 training uses) and every later load refused the whole
checkpoint as damaged ("unknown dtype"); a synchronous save of a conjugate view (``x.conj()``)
failed with torch's words and none of ours; sparse, quantized, nested and meta tensors failed deep
in the background (or, quantized, committed integers without their scales). Here every dtype torch
has is tried on every path, with random shapes and the views a training script hands over
(transposes, strides, conjugate and negative views, channels-last, zero-size, 0-d), and loads into
such views too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.layout.manifest import DTYPES
from tests.conftest import trials

ALL_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
PATHS = ("sync", "thread", "process", "overlap", "waves")
WAVE_BYTES = 8192  # the smallest waves budget: every state below holds more (BALLAST alone is 16 KiB)
BALLAST = 4096  # float32 elements beside the tensors under test, so the waves path stages in several waves


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (every bit pattern: NaNs, subnormals, fp8's specials)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 2 if dtype == torch.bool else 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)  # a bool is a byte 0 or 1: any other byte is no bool torch makes


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of zero bytes (``torch.zeros`` has no fill kernel for an empty float4 tensor)."""
    t = torch.empty(tuple(shape), dtype=dtype)
    if t.numel():
        t.reshape(-1).view(torch.uint8).zero_()
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as raw bytes (a conjugate or negative view materialised first): equality of these is
    bit-exactness, NaN payloads included."""
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def save(path_kind: str, state: dict, dest: Path, guard: torch.optim.Optimizer | None = None) -> None:
    if path_kind == "sync":
        ckptkit.save(state, dest)
        return
    options = {"thread": dict(), "process": dict(executor="process"), "overlap": dict(snapshot="overlap"),
               "waves": dict(max_staging_bytes=WAVE_BYTES)}[path_kind]
    ckptkit.save_async(state, dest, options=ckptkit.AsyncOptions(**options),
                       guard=guard if path_kind == "overlap" else None).wait()


@pytest.fixture(scope="module", autouse=True)
def _close_savers():
    yield
    ckptkit.close_async()


def _guard() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


# ---------------------------------------------------------------- every dtype torch has


@pytest.mark.parametrize("path_kind", PATHS)
def test_every_dtype_round_trips_or_is_refused_before_anything_is_written(tmp_path, path_kind):
    guard, round_tripped = _guard(), set()
    for i, dtype in enumerate(ALL_DTYPES):
        state = {"x": random_tensor(dtype, (3, 5), seed=i), "plain": torch.arange(float(BALLAST))}
        dest = tmp_path / f"c{i}"
        try:
            save(path_kind, state, dest, guard)
        except ckptkit.SaveError as exc:
            assert name(dtype) not in DTYPES, f"{name(dtype)}: refused although the format names it: {exc}"
            assert "tensor 'x' cannot be saved" in str(exc) and name(dtype) in str(exc), str(exc)
            assert not (dest / "manifest.json").exists() and not any(dest.rglob("*.bin")), name(dtype)
            continue
        assert name(dtype) in DTYPES, f"{name(dtype)}: committed although the format does not name it"
        got = {"x": torch.zeros(3, 5, dtype=dtype), "plain": torch.zeros(BALLAST)}
        ckptkit.load(got, dest)
        assert torch.equal(bits(got["x"]), bits(state["x"])), name(dtype)
        assert ckptkit.verify(dest).ok
        round_tripped.add(name(dtype))
    assert round_tripped == set(DTYPES)  # every dtype the format names, and nothing else


def test_a_refused_tensor_leaves_the_managers_last_checkpoint_and_later_saves_alone(tmp_path):
    state = {"w": torch.randn(4, 4), "step": 0}
    with ckptkit.CheckpointManager(tmp_path / "run", save=ckptkit.SavePolicy(every_steps=1)) as mgr:
        mgr.save(1, state)
        for bad in (torch.randn(3, 3).to_sparse(), torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8),
                    torch.empty(2, device="meta"), torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
                    torch.randn(3, 3).to_sparse_csr(), torch.zeros(4, dtype=torch.uint8).view(torch.bits8)):
            with pytest.raises(ckptkit.SaveError, match="tensor 'extra' cannot be saved"):
                mgr.save(2, {**state, "extra": bad})
            mgr.wait()
        assert ckptkit.verify(mgr.step_url(1)).ok and mgr.latest_common_step() == 1  # nothing of step 2
        mgr.save(3, {**state, "step": 3})
        mgr.wait()
    with ckptkit.CheckpointManager(tmp_path / "run") as mgr:
        got = {"w": torch.zeros(4, 4), "step": -1}
        assert mgr.restore_latest(got) == 3
    assert torch.equal(got["w"], state["w"]) and got["step"] == 3


# ---------------------------------------------------------------- views, shapes and dtypes at random

VIEWS = ("plain", "transpose", "stride", "offset", "conj", "neg", "expand", "channels_last", "param")


@st.composite
def leaves(draw) -> tuple[str, str, tuple[int, ...], int]:
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    view = draw(st.sampled_from(VIEWS))
    ndim = 4 if view == "channels_last" else draw(st.integers(0 if view in ("plain", "param") else 2, 3))
    shape = tuple(draw(st.lists(st.integers(0 if view == "plain" else 1, 4), min_size=ndim, max_size=ndim)))
    return dtype, view, shape, draw(st.integers(0, 2**16))


def make_leaf(dtype: str, view: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    dt = getattr(torch, dtype)
    if view == "conj" and not dt.is_complex:
        view = "plain"
    if view == "neg" and (not dt.is_floating_point or dt.itemsize == 1 or dtype == "bfloat16"):
        view = "plain"  # torch makes negative views of float and complex tensors only
    if view == "param" and not (dt.is_floating_point or dt.is_complex):
        view = "plain"
    if view == "transpose":
        return random_tensor(dt, tuple(reversed(shape)), seed).transpose(0, -1)
    if view == "stride":
        return random_tensor(dt, (shape[0] * 2, *shape[1:]), seed)[::2]
    if view == "offset":
        return random_tensor(dt, (shape[0] + 3, *shape[1:]), seed)[3:]
    if view == "expand":
        return random_tensor(dt, (1, *shape[1:]), seed).expand(shape)
    if view == "channels_last":
        return random_tensor(dt, shape, seed).contiguous(memory_format=torch.channels_last)
    t = random_tensor(dt, shape, seed)
    if view == "conj":
        return t.conj()
    if view == "neg":
        return torch._neg_view(t)
    if view == "param":
        return torch.nn.Parameter(t)
    return t


@settings(max_examples=trials(25, 250), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(leaves(), min_size=1, max_size=6), path_kind=st.sampled_from(PATHS))
@example(specs=[("float4_e2m1fn_x2", "plain", (0,), 0)], path_kind="sync")  # a fresh-clone draw: an empty float4
def test_random_views_of_every_named_dtype_round_trip_bit_exact(tmp_path_factory, specs, path_kind):
    state = {f"t{i}": make_leaf(*spec) for i, spec in enumerate(specs)}
    state["ballast"] = torch.randn(BALLAST)
    dest = tmp_path_factory.mktemp("kinds") / "c"
    save(path_kind, state, dest, _guard())
    got = {k: zeros(v.shape, v.dtype) for k, v in state.items()}
    ckptkit.load(got, dest)
    for k, v in state.items():
        assert torch.equal(bits(got[k]), bits(v)), (k, specs[int(k[1:])], path_kind)


@settings(max_examples=trials(20, 200), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(leaves(), min_size=1, max_size=5))
def test_loads_into_views_put_the_values_where_the_view_shows_them(tmp_path_factory, specs):
    """The state a load fills may hold the same kinds of views: a conjugate view reads back the saved
    values (its memory holds their conjugates), a transposed or strided one gets every element."""
    state = {f"t{i}": make_leaf(*spec) for i, spec in enumerate(specs)}
    dest = tmp_path_factory.mktemp("into") / "c"
    ckptkit.save(state, dest)
    targets = {}
    for i, (k, v) in enumerate(state.items()):
        dtype, view, shape, _ = specs[i]
        if view == "expand":
            continue  # refused: test_loading_into_a_tensor_that_cannot_hold_the_values_is_refused
        fresh = make_leaf(dtype, view, shape, seed=12345)
        targets[k] = fresh.detach() if isinstance(fresh, torch.nn.Parameter) else fresh
    ckptkit.load(targets, dest, strict=False)
    for k, t in targets.items():
        assert torch.equal(bits(t), bits(state[k])), (k, specs[int(k[1:])])


def test_a_zero_size_tensor_with_stride_0_is_no_expanded_view(tmp_path):
    """torch makes some zero-size tensors with stride 0 (``torch.randn(2, 0, 1) * 100``: strides (0, 1, 0)); they
    share no element, so they load (found by tests/test_heterogeneous_states.py: the expanded-view refusal took them)."""
    empty = torch.empty_strided((2, 0, 1), (0, 1, 0))
    ckptkit.save({"e": empty, "w": torch.ones(2)}, tmp_path / "c")
    got = {"e": torch.zeros_like(empty), "w": torch.zeros(2)}
    ckptkit.load(got, tmp_path / "c")
    assert got["e"].shape == (2, 0, 1) and torch.equal(got["w"], torch.ones(2))


@pytest.mark.parametrize("bad", ["expand", "meta", "sparse", "nested", "quantized"])
def test_loading_into_a_tensor_that_cannot_hold_the_values_is_refused_naming_it(tmp_path, bad):
    ckptkit.save({"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, 3)}, tmp_path / "c")
    target = {"expand": lambda: torch.zeros(1, 3).expand(2, 3), "meta": lambda: torch.empty(2, 3, device="meta"),
              "sparse": lambda: torch.zeros(2, 3).to_sparse(),
              "nested": lambda: torch.nested.nested_tensor([torch.zeros(3), torch.zeros(3)]),
              "quantized": lambda: torch.quantize_per_tensor(torch.zeros(2, 3), 0.1, 0, torch.qint8)}[bad]()
    b = torch.zeros(2, 3)
    with pytest.raises(ckptkit.StateMismatchError, match=r"tensor 'b' of the state cannot be loaded into"):
        ckptkit.load({"a": torch.zeros(2, 3), "b": target} if bad != "expand" else {"b": target, "a": b}, tmp_path / "c")
    assert torch.equal(b, torch.zeros(2, 3))  # refused before anything was read


def test_the_memory_tier_keeps_every_named_dtype(tmp_path):
    state = {name_: random_tensor(getattr(torch, name_), (2, 3), seed=i) for i, name_ in enumerate(sorted(DTYPES))}
    state["z"] = torch.randn(4, dtype=torch.complex64).conj()
    tier = ckptkit.MemoryTier(every_steps=1, replicas=0, root=str(tmp_path / "mem"))
    with ckptkit.CheckpointManager(str(tmp_path / "run"), save=ckptkit.SavePolicy(), memory=tier) as mgr:
        mgr.maybe_save(1, state)
        mgr.wait()
    got = {k: zeros(v.shape, v.dtype) for k, v in state.items()}
    tier = ckptkit.MemoryTier(every_steps=1, replicas=0, root=str(tmp_path / "mem"))
    with ckptkit.CheckpointManager(str(tmp_path / "run"), save=ckptkit.SavePolicy(), memory=tier) as mgr:
        assert mgr.restore_latest(got) == 1 and mgr.last_restore.source == "memory"
    for k, v in state.items():
        assert torch.equal(bits(got[k]), bits(v)), k


# ---------------------------------------------------------------- a gloo world: one rank's bad tensor


def _save_with_one_bad_rank(path: str) -> str:
    import torch.distributed as dist

    rank = dist.get_rank()
    state = {"w": torch.arange(4.0), f"r{rank}": torch.arange(3 + rank).to(torch.uint16)}  # "w": a replica
    if rank == 1:
        state["bad"] = torch.randn(2, 2).to_sparse()
    try:
        ckptkit.save(state, path + "-sync")
        return "committed"
    except ckptkit.SaveError as exc:
        first = str(exc)
    try:
        ckptkit.save_async(state, path + "-async").wait()
        return "committed"
    except ckptkit.SaveError as exc:
        second = str(exc)
    finally:
        ckptkit.close_async()
    state.pop("bad", None)
    ckptkit.save(state, path + "-good")
    got = {"w": torch.zeros(4), f"r{rank}": torch.zeros(3 + rank, dtype=torch.uint16)}
    ckptkit.load(got, path + "-good")
    ok = torch.equal(got["w"], state["w"]) and torch.equal(got[f"r{rank}"], state[f"r{rank}"])
    return f"{first} | {second} | reloaded={ok}"


def _save_with_colliding_keys_on_one_rank(path: str) -> list[str]:
    import torch.distributed as dist

    state = {"w": torch.arange(4.0), "opt": {0: {"step": 1}}}
    if dist.get_rank() == 2:
        state["opt"]["0"] = {"step": 2}  # the optimizer's param id 0 and a string "0": one key in a checkpoint
    out = []
    for save_fn in (lambda: ckptkit.save(state, path + "-sync"), lambda: ckptkit.save_async(state, path + "-async").wait()):
        try:
            save_fn()
            out.append("committed")
        except ckptkit.SaveError as exc:
            out.append(str(exc))
    ckptkit.close_async()
    return out


def _load_into_an_expanded_view_on_one_rank(path: str) -> str:
    import torch.distributed as dist

    ckptkit.save({"w": torch.arange(6.0).reshape(2, 3)}, path)
    target = torch.zeros(1, 3).expand(2, 3) if dist.get_rank() == 1 else torch.zeros(2, 3)
    try:
        ckptkit.load({"w": target}, path)
        return "loaded"
    except ckptkit.CkptkitError as exc:
        return f"{type(exc).__name__}: {exc}"


def test_a_bad_tensor_on_one_rank_fails_every_rank_naming_it(worlds, tmp_path):
    out = worlds.run(3, _load_into_an_expanded_view_on_one_rank, str(tmp_path / "l"))
    assert out[1].startswith("StateMismatchError") and "tensor 'w' of the state cannot be loaded into" in out[1], out
    for o in (out[0], out[2]):
        assert o.startswith("PeerFailureError") and "rank 1: StateMismatchError" in o and "tensor 'w'" in o, out
    out = worlds.run(3, _save_with_one_bad_rank, str(tmp_path / "c"))
    for o in out:
        sync_msg, async_msg, reloaded = o.split(" | ")
        for msg in (sync_msg, async_msg):
            assert "rank 1: tensor 'bad' cannot be saved: it is a sparse_coo tensor" in msg, o
        assert reloaded == "reloaded=True", o
    out = worlds.run(3, _save_with_colliding_keys_on_one_rank, str(tmp_path / "k"))
    for per_rank in out:
        for msg in per_rank:
            assert "rank 2: the dict at 'opt' has the keys 0 and '0'" in msg, per_rank
    for name_ in ("c-sync", "c-async", "k-sync", "k-async"):
        assert not os.path.exists(str(tmp_path / name_ / "manifest.json"))


@pytest.mark.parametrize("path_kind", PATHS)
def test_each_view_kind_on_each_path(tmp_path, path_kind):
    """Every view kind at once, on one path (the random test above draws them; this one never misses one)."""
    state = {f"{dtype}-{view}": make_leaf(dtype, view, (2, 3, 4, 5) if view == "channels_last" else (3, 4), seed=i)
             for i, (dtype, view) in enumerate((d, v) for d in ("float32", "complex64", "bfloat16") for v in VIEWS)}
    state["ballast"] = torch.randn(BALLAST)
    save(path_kind, state, tmp_path / "c", _guard())
    got = {k: zeros(v.shape, v.dtype) for k, v in state.items()}
    ckptkit.load(got, tmp_path / "c")
    for k, v in state.items():
        assert torch.equal(bits(got[k]), bits(v)), k


# ---------------------------------------------------------------- the converters' dtypes


def test_safetensors_files_agree_with_the_package_for_every_dtype(tmp_path):
    """What ckptkit writes (the HF export, the fp32 consolidation) the ``safetensors`` package reads as
    the same dtype and bytes; what the package writes, the HF import reads the same, or refuses by name."""
    from safetensors.torch import _TYPES, load_file, save_file

    from ckptkit_converters.common.safetensors_out import SAFETENSORS_DTYPES, safetensors_header
    from ckptkit_converters.hf.files import SafetensorsFile

    store = ckptkit.storage.local.LocalStore(str(tmp_path))
    for i, dtype in enumerate(ALL_DTYPES):
        t = random_tensor(dtype, (2, 3), seed=i)
        ours = tmp_path / f"ours-{name(dtype)}.safetensors"
        if dtype not in SAFETENSORS_DTYPES:
            with pytest.raises(ckptkit.CkptkitError, match=f"safetensors cannot store {name(dtype)}"):
                safetensors_header([("t", dtype, (2, 3))])
        else:
            ours.write_bytes(safetensors_header([("t", dtype, (2, 3))]) + bytes(bits(t).numpy()))
            back = load_file(str(ours))["t"]
            assert back.dtype == dtype and torch.equal(bits(back), bits(t)), name(dtype)
        if dtype not in _TYPES.values():
            continue  # the package cannot write it either
        theirs = f"theirs-{name(dtype)}.safetensors"
        save_file({"t": t}, str(tmp_path / theirs))
        f = SafetensorsFile(store, theirs)
        assert f.entries["t"].dtype == dtype and torch.equal(bits(f.read("t")), bits(t)), name(dtype)


def test_zarr_exports_keep_every_dtype_zarr_names_and_refuse_the_rest_before_writing(tmp_path):
    from ckptkit_converters.zarr.convert import export_zarr, import_zarr
    from ckptkit_converters.zarr.options import ZarrExportOptions

    storable = {n: random_tensor(getattr(torch, n), (3, 4), seed=i)
                for i, n in enumerate(sorted(DTYPES)) if n not in ("complex32", "float4_e2m1fn_x2")}
    ckptkit.save(storable, tmp_path / "c")
    for portable in (False, True):
        export_zarr(tmp_path / "c", tmp_path / f"z{portable}", options=ZarrExportOptions(portable=portable))
        import_zarr(tmp_path / f"z{portable}", tmp_path / f"back{portable}")
        got = {k: zeros(v.shape, v.dtype) for k, v in storable.items()}
        ckptkit.load(got, tmp_path / f"back{portable}")
        for k, v in storable.items():
            if portable and k.startswith("float8"):  # portable widens float8 by value: NaN payloads are not kept
                same = torch.equal(got[k].float().nan_to_num(7.0), v.float().nan_to_num(7.0))
            else:
                same = torch.equal(bits(got[k]), bits(v))
            assert same, (k, portable)
    for odd in ("complex32", "float4_e2m1fn_x2"):
        ckptkit.save({"x": random_tensor(getattr(torch, odd), (2, 2), seed=1)}, tmp_path / f"c-{odd}")
        with pytest.raises(ckptkit.CkptkitError, match=f"zarr has no data type for {odd}"):
            export_zarr(tmp_path / f"c-{odd}", tmp_path / f"z-{odd}")
        assert not (tmp_path / f"z-{odd}").exists() or not any((tmp_path / f"z-{odd}").iterdir())


# ---------------------------------------------------------------- one tensor under two keys (tied weights)


def test_tied_weights_load_when_the_checkpoint_agrees_and_are_refused_when_it_does_not(tmp_path):
    """A model with tied embeddings holds one Parameter under two keys. Loading a checkpoint whose two
    entries differ (saved from an untied model) used to leave whichever was read last, without a word."""
    emb = torch.randn(4, 3)
    ckptkit.save({"emb": emb, "head": emb.clone(), "n": torch.ones(2)}, tmp_path / "tied")
    ckptkit.save({"emb": emb, "head": emb + 1, "n": torch.ones(2)}, tmp_path / "untied")
    w = torch.nn.Parameter(torch.zeros(4, 3))
    state = {"emb": w, "head": w, "n": torch.zeros(2)}
    ckptkit.load(state, tmp_path / "tied")
    assert torch.equal(w.detach(), emb) and torch.equal(state["n"], torch.ones(2))
    for order in (("emb", "head"), ("head", "emb")):
        w2 = torch.nn.Parameter(torch.zeros(4, 3))
        state = {order[0]: w2, order[1]: w2, "n": torch.zeros(2)}
        with pytest.raises(ckptkit.StateMismatchError,
                           match=f"tensors '{min(order)}' and '{max(order)}' share memory in the state"):
            ckptkit.load(state, tmp_path / "untied")
    w3 = torch.nn.Parameter(torch.zeros(4, 3))
    ckptkit.load({"emb": w3, "n": torch.zeros(2)}, tmp_path / "untied", strict=False)  # the way the error names
    assert torch.equal(w3.detach(), emb)
    # views of one buffer at different offsets are different tensors: never taken for tied ones
    flat = torch.zeros(24)
    ckptkit.load({"emb": flat[:12].view(4, 3), "head": flat[12:].view(4, 3), "n": torch.zeros(2)},
                 tmp_path / "untied")
    assert torch.equal(flat[:12].view(4, 3), emb) and torch.equal(flat[12:].view(4, 3), emb + 1)
