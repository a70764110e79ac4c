"""GPU-only paths: CUDA state saved and loaded, sync and async; pinned staging and device-to-host
snapshots; the process executor and staging in waves from device tensors; FSDP2 DTensors on a
CUDA mesh. Skipped without CUDA (``make gpu-check`` runs this file on a GPU machine).

Every comparison is ``torch.equal`` against a host copy taken before the save: a save moves bytes,
so the same bits must come back."""

from __future__ import annotations

import pytest
import torch

import ckptkit
from ckptkit.engine.async_save import AsyncSaver
from ckptkit.storage import open_store

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytestmark = cuda


def _state(seed: int = 0, scale: int = 1) -> dict[str, torch.Tensor]:
    """Mixed dtypes and shapes on the GPU: a large fp32 matrix, bf16/fp16 weights, int64, bool, a
    0-d scalar, a non-contiguous view (transposed) and an empty tensor."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    base = torch.randn(513, 257, device="cuda", generator=g)
    return {
        "w": torch.randn(1024 * scale, 1024, device="cuda", generator=g),
        "bf16": torch.randn(77, 333, device="cuda", generator=g).to(torch.bfloat16),
        "fp16": torch.randn(4097, device="cuda", generator=g).half(),
        "ids": torch.randint(0, 1 << 40, (999,), device="cuda", generator=g),
        "mask": torch.rand(31, 7, device="cuda", generator=g) > 0.5,
        "scalar": torch.tensor(3.25, device="cuda"),
        "t": base.t(),  # a strided view
        "empty": torch.empty(0, 5, device="cuda"),
    }


def _host(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def _zeros(state: dict[str, torch.Tensor], device: str = "cuda") -> dict[str, torch.Tensor]:
    return {k: torch.zeros(v.shape, dtype=v.dtype, device=device) for k, v in state.items()}


def _assert_equal(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == got.keys()
    for k in expected:
        assert got[k].dtype == expected[k].dtype, k
        assert torch.equal(got[k].cpu(), expected[k].cpu()), k


def _mutate(state: dict[str, torch.Tensor]) -> None:
    """What a training step does to the state: every tensor changed in place (ordered after the
    snapshot's copies on the current stream)."""
    for v in state.values():
        if v.dtype == torch.bool:
            v.logical_not_()
        else:
            v.add_(1)


def test_snapshot_of_device_tensors_uses_pinned_memory_and_is_consistent(tmp_path):
    state = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(77, device="cuda", dtype=torch.bfloat16)}
    expected = {k: v.cpu() for k, v in state.items()}
    saver = AsyncSaver()
    h = saver.save(state, open_store(str(tmp_path / "c")))
    state["w"].add_(1)  # enqueued after the snapshot copies on the same stream
    state["b"].mul_(2)
    h.wait()
    assert saver.pool.kind == "pinned"
    saver.close()
    target = {"w": torch.zeros(1024, 1024, device="cuda"), "b": torch.zeros(77, device="cuda", dtype=torch.bfloat16)}
    ckptkit.load(target, tmp_path / "c")
    assert torch.equal(target["w"].cpu(), expected["w"]) and torch.equal(target["b"].cpu(), expected["b"])


def test_sync_save_and_load_of_device_tensors(tmp_path):
    state = {"w": torch.randn(300, 70, device="cuda")}
    ckptkit.save(state, tmp_path / "c")
    target = {"w": torch.zeros(300, 70, device="cuda")}
    ckptkit.load(target, tmp_path / "c")
    assert torch.equal(target["w"], state["w"])


def test_sync_save_of_mixed_cuda_state_loads_on_gpu_and_on_cpu(tmp_path):
    state = _state()
    expected = _host(state)
    ckptkit.save({"model": state, "train": {"step": 7}}, tmp_path / "c")
    on_gpu = {"model": _zeros(state), "train": {"step": 0}}
    ckptkit.load(on_gpu, tmp_path / "c")
    _assert_equal(expected, on_gpu["model"])
    assert on_gpu["train"]["step"] == 7
    assert all(v.device.type == "cuda" for v in on_gpu["model"].values())
    on_cpu = {"model": _zeros(state, "cpu"), "train": {"step": 0}}
    ckptkit.load(on_cpu, tmp_path / "c")  # a GPU checkpoint is device-agnostic
    _assert_equal(expected, on_cpu["model"])


def test_keys_sharing_cuda_memory_load_every_tensor(tmp_path):
    """Sharded declarations over one CUDA local (the Megatron adapter's flat optimizer shard), tied CUDA
    weights and a CUDA view of another key: every CUDA destination is staged through host memory, and
    each declaration used to be copied back whole, its stale elements over the others' loaded values."""
    from ckptkit import Sharded
    from ckptkit.layout.box import Box
    from ckptkit.layout.pieces import flat_piece

    sizes = (1000, 4096, 17, 300000)

    def state(flat: torch.Tensor, emb: torch.Tensor) -> dict:
        decls, at = {}, 0
        for i, n in enumerate(sizes):
            decls[f"p{i}"] = Sharded(flat, [flat_piece(f"P{i}", (n,), Box.full((n,)), 0, n, local_start=at)])
            at += n
        return {"shard": decls, "emb": emb, "head": emb, "emb_rows": emb[:3]}

    flat = torch.randn(sum(sizes), device="cuda")
    emb = torch.randn(50, 64, device="cuda")
    ckptkit.save(state(flat, emb), tmp_path / "c")
    got_flat, got_emb = torch.zeros_like(flat), torch.zeros_like(emb)
    ckptkit.load(state(got_flat, got_emb), tmp_path / "c")
    assert torch.equal(got_flat, flat) and torch.equal(got_emb, emb)


def test_a_cuda_generator_is_restored(tmp_path):
    """A CUDA generator's state (16 bytes) used to be checked on a CPU generator (5,056 bytes) and
    called corrupt at every load; a CPU generator's state loaded into a CUDA one is a mismatch."""
    g = torch.Generator(device="cuda").manual_seed(5)
    torch.rand(3, device="cuda", generator=g)
    ckptkit.save({"g": g, "cpu": torch.Generator().manual_seed(6)}, tmp_path / "c")
    expected = torch.rand(4, device="cuda", generator=g)
    fresh = torch.Generator(device="cuda").manual_seed(0)
    ckptkit.load({"g": fresh, "cpu": torch.Generator()}, tmp_path / "c")
    assert torch.equal(torch.rand(4, device="cuda", generator=fresh), expected)
    with pytest.raises(ckptkit.StateMismatchError, match="is a cpu generator's state; the state holds a cuda"):
        ckptkit.load({"g": torch.Generator(device="cuda"), "cpu": torch.Generator(device="cuda")}, tmp_path / "c")


def test_a_cpu_checkpoint_loads_into_cuda_tensors(tmp_path):
    expected = _host(_state(seed=3))
    ckptkit.save(expected, tmp_path / "c")
    target = _zeros(expected)
    ckptkit.load(target, tmp_path / "c")
    _assert_equal(expected, target)


def test_async_saves_back_to_back_while_the_state_changes(tmp_path):
    """save_async returns; the state is changed at once on the current stream; the next save is issued
    before the first has committed. Each checkpoint holds exactly the state of its own call."""
    state = _state(seed=1, scale=8)  # 32 MiB in the largest tensor: the copies take a while
    snapshots = []
    handles = []
    for i in range(4):
        snapshots.append(_host(state))
        torch.cuda.synchronize()
        handles.append(ckptkit.save_async(state, tmp_path / f"c{i}", metadata={"i": i}))
        _mutate(state)
    for h in handles:
        h.wait()
    ckptkit.close_async()
    for i, expected in enumerate(snapshots):
        target = _zeros(state)
        ckptkit.load(target, tmp_path / f"c{i}")
        _assert_equal(expected, target)


def test_async_save_then_optimizer_steps_at_once(tmp_path):
    """A model on the GPU: save_async of model and Adam state, then optimizer steps right away,
    repeatedly. The checkpoint holds the state at the call, bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randn(64, 512, device="cuda")

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        opt.step()

    step()
    saver = AsyncSaver()
    try:
        for rep in range(5):
            state = {"model": model.state_dict(), "optim": {str(k): v for k, v in opt.state_dict()["state"].items()}}
            expected = {"model": _host(state["model"]),
                        "optim": {k: _host({n: t for n, t in v.items()}) for k, v in state["optim"].items()}}
            h = saver.save(state, open_store(str(tmp_path / f"c{rep}")))
            for _ in range(3):
                step()  # changes every parameter and moment in place
            h.wait()
            target = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()},
                      "optim": {k: {n: torch.zeros_like(t) for n, t in v.items()} for k, v in expected["optim"].items()}}
            ckptkit.load(target, tmp_path / f"c{rep}")
            _assert_equal(expected["model"], target["model"])
            for k in expected["optim"]:
                _assert_equal(expected["optim"][k], target["optim"][k])
    finally:
        saver.close()


def test_process_executor_saves_device_tensors(tmp_path):
    """The process executor stages device tensors into shared (not pinned) memory for its writer process."""
    state = _state(seed=2)
    expected = _host(state)
    saver = AsyncSaver(options=ckptkit.AsyncOptions(executor="process"))
    try:
        h = saver.save(state, open_store(str(tmp_path / "c")))
        h.staged.result(timeout=120)
        _mutate(state)
        h.wait(timeout=120)
        assert saver.pool.kind == "shared"
    finally:
        saver.close()
    target = _zeros(state)
    ckptkit.load(target, tmp_path / "c")
    _assert_equal(expected, target)


def test_waves_from_device_tensors_equal_a_one_shot_save(tmp_path):
    """A budget smaller than the state: staged in waves through pinned slots; same bytes as a one-shot save."""
    state = _state(seed=4, scale=2)
    expected = _host(state)
    one = AsyncSaver()
    try:
        one.save(state, open_store(str(tmp_path / "one"))).wait()
    finally:
        one.close()
    waves = AsyncSaver(options=ckptkit.AsyncOptions(max_staging_bytes=1 << 20))
    try:
        h = waves.save(state, open_store(str(tmp_path / "waves")))
        assert h.staged.done()
        _mutate(state)
        h.wait()
        assert waves.pool.nbytes <= 1 << 20
    finally:
        waves.close()
    for name in ("one", "waves"):
        target = _zeros(state)
        ckptkit.load(target, tmp_path / name)
        _assert_equal(expected, target)


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    """A one-rank process group over NCCL (CUDA) and gloo (CPU), for DTensors on a CUDA mesh."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "s"), 1)
    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp2_model_and_optimizer_on_a_cuda_mesh_round_trip(world1, tmp_path):
    """FSDP2 ``fully_shard`` on a 1-rank CUDA mesh: DTensor model and optimizer state dicts, saved
    asynchronously while training goes on, loaded into a fresh model, bit-exact."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (1,))

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).cuda()
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = build(0)
    x = torch.randn(32, 256, device="cuda")
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    digest = {k: v.full_tensor().cpu().clone() for k, v in state["model"].items()}
    moments = {(k, n): t.full_tensor().cpu().clone() for k, s in state["optim"]["state"].items() for n, t in s.items()
               if hasattr(t, "full_tensor")}
    assert moments  # exp_avg and exp_avg_sq of every parameter
    h = ckptkit.save_async(state, tmp_path / "c")
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    h.wait()
    ckptkit.close_async()
    fresh, fresh_opt = build(1)
    fresh_opt.zero_grad()
    fresh(x).square().mean().backward()
    fresh_opt.step()  # creates the moments the load fills
    target = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    ckptkit.load(target, tmp_path / "c")
    set_model_state_dict(fresh, target["model"])
    set_optimizer_state_dict(fresh, fresh_opt, target["optim"])
    for k, v in get_model_state_dict(fresh).items():
        assert torch.equal(v.full_tensor().cpu(), digest[k]), k
    loaded = get_optimizer_state_dict(fresh, fresh_opt)["state"]
    for (k, n), t in moments.items():
        assert torch.equal(loaded[k][n].full_tensor().cpu(), t), (k, n)
