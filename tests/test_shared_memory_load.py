"""Loading into a state whose keys share memory: tied weights, views of one buffer, several Sharded
declarations over one local tensor (the Megatron adapter's way with a flat optimizer shard).

The class of defect: reads for different keys went straight into the same memory. Overlapping reads
raced and a checksum was taken over bytes another key wrote, so a good checkpoint was reported
corrupt (and a resuming job would fall back to an older one). Keys the checkpoint gave different
values left whichever landed last, without a word. And a staged destination (a GPU tensor, a strided
view) was copied back whole, writing its stale elements over what another key had just loaded: half
of a Megatron flat shard restored to its values from before the load, silently.

Here hypothesis draws states of views, strided and transposed views (staged), tied tensors and
Sharded declarations (box and flat pieces) over one random buffer, and checks the load against an
oracle computed from the elements each key holds: a checkpoint saved from the same sharing loads
bit-exact with every other element untouched; one saved from separate tensors loads where no two
keys meet, and fails naming two keys, with no race and no false corruption, where they do.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit import Sharded
from ckptkit.layout.box import Box
from ckptkit.layout.pieces import box_piece, flat_piece
from tests.conftest import trials

N = 64  # elements of the shared buffer


@dataclass(frozen=True)
class Key:
    """How key ``name`` sees the buffer: ``kind`` view/strided/transposed/tied/box/flat."""

    kind: str
    start: int
    rows: int
    cols: int
    step: int = 1
    of: int = -1  # tied: the key it repeats; box/flat: the local tensor's key (a view) it declares over
    offsets: tuple[int, ...] = ()  # box/part: local offsets; flat: (local start,)
    sizes: tuple[int, ...] = ()
    flip: bool = False  # part: the local tensor is a transposed view (staged)


@st.composite
def layouts(draw: st.DrawFn) -> list[Key]:
    keys: list[Key] = []
    for _ in range(draw(st.integers(2, 5))):
        views = [i for i, k in enumerate(keys) if k.kind in ("view", "transposed")]
        kind = draw(st.sampled_from(("view", "strided", "transposed", "part") + (("tied", "box", "flat") if views else ())))
        if kind == "part":  # a declaration over a view no key loads whole: its other elements are not loaded
            rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 4))
            start = draw(st.integers(0, N - rows * cols))
            flip = draw(st.booleans())
            shape = (cols, rows) if flip else (rows, cols)
            r0, c0 = draw(st.integers(0, shape[0] - 1)), draw(st.integers(0, shape[1] - 1))
            sizes = (draw(st.integers(1, shape[0] - r0)), draw(st.integers(1, shape[1] - c0)))
            keys.append(Key(kind, start, rows, cols, offsets=(r0, c0), sizes=sizes, flip=flip))
        elif kind in ("view", "transposed", "strided"):
            step = draw(st.integers(2, 3)) if kind == "strided" else 1
            rows = draw(st.integers(1, 4))
            cols = draw(st.integers(1, 4))
            start = draw(st.integers(0, N - 1 - (rows * cols - 1) * step))
            keys.append(Key(kind, start, rows, cols, step))
        elif kind == "tied":
            keys.append(Key(kind, 0, 0, 0, of=draw(st.sampled_from(views))))
        else:
            of = draw(st.sampled_from(views))
            shape = local_shape(keys[of])
            if kind == "box":
                r0 = draw(st.integers(0, shape[0] - 1))
                c0 = draw(st.integers(0, shape[1] - 1))
                sizes = (draw(st.integers(1, shape[0] - r0)), draw(st.integers(1, shape[1] - c0)))
                keys.append(Key(kind, 0, 0, 0, of=of, offsets=(r0, c0), sizes=sizes))
            else:
                total = shape[0] * shape[1]
                s0 = draw(st.integers(0, total - 1))
                keys.append(Key(kind, 0, 0, 0, of=of, offsets=(s0,), sizes=(draw(st.integers(1, total - s0)),)))
    return keys


def local_shape(k: Key) -> tuple[int, int]:
    return (k.cols, k.rows) if k.kind == "transposed" else (k.rows, k.cols)


def view_of(base: torch.Tensor, k: Key) -> torch.Tensor:
    if k.kind == "strided":
        return base[k.start:k.start + (k.rows * k.cols - 1) * k.step + 1:k.step].view(k.rows, k.cols)
    v = base[k.start:k.start + k.rows * k.cols].view(k.rows, k.cols)
    return v.t() if k.kind == "transposed" else v


def build(keys: list[Key], base_for) -> dict:
    """The state over ``base_for(i)`` (one buffer for every key: shared memory; one per key: separate)."""
    state: dict = {}
    locals_: dict[int, torch.Tensor] = {}
    for i, k in enumerate(keys):
        name = f"k{i}"
        if k.kind in ("view", "strided", "transposed"):
            locals_[i] = view_of(base_for(i), k)
            state[name] = locals_[i]
        elif k.kind == "part":
            local = view_of(base_for(i), Key("transposed" if k.flip else "view", k.start, k.rows, k.cols))
            state[name] = Sharded(local, [box_piece(name, k.sizes, (0, 0), k.sizes, local_offsets=k.offsets)])
        elif k.kind == "tied":
            src = keys[k.of]
            state[name] = locals_[k.of] if base_for(i) is base_for(k.of) else view_of(base_for(i), src)
        else:
            src = keys[k.of]
            local = locals_[k.of] if base_for(i) is base_for(k.of) else view_of(base_for(i), src)
            if k.kind == "box":
                piece = box_piece(name, k.sizes, (0, 0), k.sizes, local_offsets=k.offsets)
            else:
                piece = flat_piece(name, k.sizes, Box.full(k.sizes), 0, k.sizes[0], local_start=k.offsets[0])
            state[name] = Sharded(local, [piece])
    return state


def held_values(keys: list[Key], base_for) -> list[dict[int, float]]:
    """For each key, the value it would load into each buffer element it holds."""
    index = torch.arange(N, dtype=torch.float64)
    where = build(keys, lambda i: index)
    values = build(keys, base_for)
    out = []
    for i, k in enumerate(keys):
        w, v = where[f"k{i}"], values[f"k{i}"]
        if isinstance(w, Sharded):
            w, v = piece_view(w, k), piece_view(v, k)
        out.append(dict(zip((int(x) for x in w.reshape(-1).tolist()), v.reshape(-1).tolist())))
    return out


def piece_view(s: Sharded, k: Key) -> torch.Tensor:
    if k.kind in ("box", "part"):
        r0, c0 = k.offsets
        return s.local[r0:r0 + k.sizes[0], c0:c0 + k.sizes[1]]
    return s.local.reshape(-1)[k.offsets[0]:k.offsets[0] + k.sizes[0]]


def separate_values(i: int) -> torch.Tensor:
    return torch.arange(N, dtype=torch.float64) + 1000 * (i + 1)  # no two keys agree anywhere


@settings(max_examples=trials(40, 300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keys=layouts(), shared=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_keys_sharing_memory_load_exactly_or_fail_naming_two_keys(tmp_path_factory, keys, shared, seed):
    folder = tmp_path_factory.mktemp("shared")
    source = torch.randn(N, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    # shared: saved from the same sharing, every key agrees with every other where they meet; else saved
    # from separate tensors, each key with values of its own (a tie with its key's: the same tensor)
    bases = {i: source if shared else separate_values(keys[i].of if keys[i].kind == "tied" else i)
             for i in range(len(keys))}
    ckptkit.save(build(keys, lambda i: bases[i]), folder / "c")
    expected = held_values(keys, lambda i: bases[i])
    clash = any(a[e] != b[e] for x, a in enumerate(expected) for b in expected[x + 1:] for e in a.keys() & b.keys())
    base = torch.zeros(N, dtype=torch.float64)
    event(f"clash={clash} shared={shared}")
    event("kinds: " + " ".join(sorted({k.kind for k in keys})))
    if clash:
        with pytest.raises(ckptkit.StateMismatchError, match=r"tensors 'k\d+' and 'k\d+' share memory in the state"):
            ckptkit.load(build(keys, lambda i: base), folder / "c")
        return
    ckptkit.load(build(keys, lambda i: base), folder / "c")
    want = torch.zeros(N, dtype=torch.float64)
    for held in expected:
        for e, value in held.items():
            want[e] = value
    assert torch.equal(base, want)  # every key's values, and every element no key holds untouched


def test_megatron_style_declarations_over_one_staged_local_restore_every_tensor(tmp_path):
    """Several Sharded declarations over one local tensor that is staged (here transposed; on a GPU
    every tensor is): each used to be copied back whole, so the last one wrote its stale elements over
    every other tensor's freshly loaded values."""

    def state(local: torch.Tensor) -> dict:
        return {"a": Sharded(local, [box_piece("A", (4, 3), (0, 0), (4, 3), local_offsets=(0, 0))]),
                "b": Sharded(local, [box_piece("B", (4, 3), (0, 0), (4, 3), local_offsets=(0, 3))])}

    source = torch.arange(24.0).reshape(4, 6)
    ckptkit.save(state(source), tmp_path / "c")
    for dest in (torch.zeros(4, 6), torch.zeros(6, 4).t()):
        ckptkit.load(state(dest), tmp_path / "c")
        assert torch.equal(dest, source)


def test_a_view_of_another_key_is_no_false_corruption(tmp_path):
    """A buffer and a view of it, from a checkpoint whose two entries differ: the reads used to race
    and the load said the checkpoint was corrupt. It now names the two keys, and a checkpoint whose
    entries agree loads."""
    ckptkit.save({"flat": torch.arange(10.0), "head": torch.full((4,), -1.0)}, tmp_path / "differ")
    ckptkit.save({"flat": torch.arange(10.0), "head": torch.arange(4.0)}, tmp_path / "agree")
    for order in (("flat", "head"), ("head", "flat")):
        buf = torch.zeros(10)
        views = {"flat": buf, "head": buf[:4]}
        with pytest.raises(ckptkit.StateMismatchError, match="tensors 'flat' and 'head' share memory"):
            ckptkit.load({k: views[k] for k in order}, tmp_path / "differ")
        buf = torch.zeros(10)
        views = {"flat": buf, "head": buf[:4]}
        ckptkit.load({k: views[k] for k in order}, tmp_path / "agree")
        assert torch.equal(buf, torch.arange(10.0))


def test_interleaved_views_of_one_buffer_load_without_a_false_alarm(tmp_path):
    """Even and odd elements of one buffer: their memory spans meet, their elements never do."""
    ckptkit.save({"even": torch.arange(5.0), "odd": -torch.arange(5.0)}, tmp_path / "c")
    for buf in (torch.zeros(10), torch.zeros(10, dtype=torch.float32)):
        ckptkit.load({"even": buf[0::2], "odd": buf[1::2]}, tmp_path / "c")
        assert torch.equal(buf[0::2], torch.arange(5.0)) and torch.equal(buf[1::2], -torch.arange(5.0))


def _load_shared_in_a_world(path: str) -> list[str]:
    """Two ranks hold the same (replicated) tensors, so the load reads each piece once and sends it on
    (read_once): private buffers travel that way too. Rank 1 then asks for two keys over one buffer
    that the checkpoint gives different values: both ranks fail, naming rank 1 and the keys."""
    import torch.distributed as dist

    rank = dist.get_rank()

    def state(local: torch.Tensor, w: torch.Tensor) -> dict:
        return {"a": Sharded(local, [box_piece("A", (4, 3), (0, 0), (4, 3), local_offsets=(0, 0), replica=(rank, 2))]),
                "b": Sharded(local, [box_piece("B", (4, 3), (0, 0), (4, 3), local_offsets=(0, 3), replica=(rank, 2))]),
                "w": w, "w_tied": w}

    source = torch.arange(24.0).reshape(4, 6)
    ckptkit.save({**state(source, torch.ones(5)), "head": torch.full((2,), 7.0)}, path)
    out = []
    for dest in (torch.zeros(4, 6), torch.zeros(6, 4).t()):
        w = torch.zeros(5)
        ckptkit.load(state(dest, w), path, strict=False)
        out.append(f"{torch.equal(dest, source)} {torch.equal(w, torch.ones(5))}")
    w = torch.zeros(5)
    clashing = {**state(torch.zeros(4, 6), w), "head": w[:2] if rank == 1 else torch.zeros(2)}
    try:
        ckptkit.load(clashing, path)
        out.append("loaded")
    except ckptkit.CkptkitError as exc:
        out.append(f"{type(exc).__name__}: {exc}")
    return out


def test_shared_memory_in_a_gloo_world_reads_once_and_fails_every_rank_together(worlds, tmp_path):
    out = worlds.run(2, _load_shared_in_a_world, str(tmp_path / "c"))
    for rank, said in enumerate(out):
        assert said[:2] == ["True True", "True True"], out
    assert out[1][2].startswith("StateMismatchError") and "tensors 'head' and 'w' share memory" in out[1][2], out
    assert out[0][2].startswith("PeerFailureError") and "rank 1: StateMismatchError" in out[0][2], out


def test_disjoint_views_of_one_buffer_cost_nothing_extra():
    """FSDP2's parameters are disjoint views of one flat buffer: no private buffer, and a staged one is
    still copied back whole (one copy, not one per piece); only views that may meet are handled."""
    from ckptkit.engine.loader import _dest
    from ckptkit.engine.shared_targets import share_targets
    from ckptkit.layout.box import Region
    from ckptkit.layout.pieces import LocalBox
    from ckptkit.plan.load_plan import Target

    flat = torch.zeros(40)
    views = [flat[:12].view(3, 4).t(), flat[12:20].view(2, 4).t(), flat[20:40].view(4, 5)]  # two staged
    users = views + [flat[18:22]]  # the last meets the second and the third
    for k in (3, 4):
        dests = [_dest(u) for u in users[:k]]
        targets = [Target(i, f"t{i}", Region(Box.full(tuple(d.user.shape))), tuple(d.user.shape),
                          LocalBox(tuple(0 for _ in d.user.shape))) for i, d in enumerate(dests)]
        shared = share_targets([d.user for d in dests], [d.work for d in dests], targets)
        if k == 3:
            assert shared.private == [] and shared.piecewise == set()
        else:
            assert sorted(t.tensor for t, _, _, _ in shared.private) == ["t1", "t2", "t3"]
            assert shared.piecewise == {1}  # the staged one that meets another; the third is not staged


class Wrapped(torch.Tensor):
    """A tensor subclass that holds no memory of its own (as torchao's float8 weights under FSDP2):
    every op runs on the tensor it wraps."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        def unwrap(x):
            return x.inner if isinstance(x, Wrapped) else x

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def test_wrapper_subclasses_save_and_load_through_their_own_ops(tmp_path):
    """A load into one used to crash on its data pointer ("invalid python storage"); it is now read
    into a plain tensor and copied in through its ``copy_``, tied or declared twice like any tensor."""
    src = torch.arange(24.0).reshape(4, 6)

    def state(w: torch.Tensor) -> dict:
        return {"w": w, "tied": w,
                "a": Sharded(w, [box_piece("A", (4, 3), (0, 0), (4, 3), local_offsets=(0, 0))]),
                "b": Sharded(w, [box_piece("B", (4, 3), (0, 0), (4, 3), local_offsets=(0, 3))])}

    ckptkit.save(state(Wrapped(src.clone())), tmp_path / "sync")
    ckptkit.save_async(state(Wrapped(src.clone())), tmp_path / "async").wait()
    ckptkit.close_async()
    for name in ("sync", "async"):
        got = Wrapped(torch.zeros(4, 6))
        ckptkit.load(state(got), tmp_path / name)
        assert torch.equal(got.inner, src), name
    ckptkit.save({"w": src, "tied": src + 1}, tmp_path / "untied")
    with pytest.raises(ckptkit.StateMismatchError, match="tensors 'tied' and 'w' share memory"):
        w = Wrapped(torch.zeros(4, 6))
        ckptkit.load({"w": w, "tied": w}, tmp_path / "untied")


def test_the_memory_tier_holds_a_tensor_under_several_keys_once(tmp_path):
    """Node memory held one copy per key: a Megatron embedding (its vocabulary and its padding rows, two
    declarations over one local) and a tied head took three times their size, past the budget the tier
    states. It is held once; the memory restore and the persistent save of the same step (which persists
    from the snapshot's copy) both give it back whole."""
    local = torch.randn(100, 64)

    def state(t: torch.Tensor) -> dict:
        return {"emb": Sharded(t, [box_piece("E", (90, 64), (0, 0), (90, 64))]),
                "pad": Sharded(t, [box_piece("P", (10, 64), (0, 0), (10, 64), local_offsets=(90, 0))]),
                "head": t, "n": torch.ones(3)}

    mgr = ckptkit.CheckpointManager(tmp_path / "run", save=ckptkit.SavePolicy(every_steps=2),
                                    memory=ckptkit.MemoryTier(every_steps=2, replicas=0, root=tmp_path / "shm"))
    try:
        mgr.maybe_save(2, state(local))
        mgr.wait()
        held = sum(f.stat().st_size for f in (tmp_path / "shm").rglob("*.bin"))
        assert local.numel() * 4 <= held < 2 * local.numel() * 4, held
        dst = torch.zeros(100, 64)
        assert mgr.restore_latest(state(dst)) == 2 and mgr.last_restore.source == "memory"
        assert torch.equal(dst, local)
    finally:
        mgr.close()
    persisted = torch.zeros(100, 64)
    ckptkit.load(state(persisted), tmp_path / "run" / "step-0000002")
    assert torch.equal(persisted, local)


def test_a_tied_weight_costs_one_private_copy_per_extra_key():
    """The first key of a tied weight is read in place and the others are compared with it; only when
    something else also meets that memory are they all read privately and placed in order."""
    from ckptkit.engine.loader import _dest
    from ckptkit.engine.shared_targets import share_targets
    from ckptkit.layout.box import Region
    from ckptkit.layout.pieces import LocalBox
    from ckptkit.plan.load_plan import Target

    w = torch.zeros(4, 3)
    for extra, expect in (((), [("t1", False)]), ((w[1:3],), [("t0", True), ("t1", True), ("t2", True)])):
        dests = [_dest(w)] + [_dest(e) for e in extra]
        refs = [0, 0] + list(range(1, len(dests)))
        targets = [Target(r, f"t{i}", Region(Box.full(tuple(dests[r].user.shape))), tuple(dests[r].user.shape),
                          LocalBox((0, 0))) for i, r in enumerate(refs)]
        shared = share_targets([d.user for d in dests], [d.work for d in dests], targets)
        assert [(t.tensor, placed) for t, _, _, placed in shared.private] == expect
