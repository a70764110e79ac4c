"""A DeepSpeed ZeRO-1/2 engine on one GPU, saved with ckptkit and resumed bit-exact. Needs CUDA.

DeepSpeed's CUDA accelerator (no ``DS_ACCELERATOR=cpu``), installed as pure Python (``DS_BUILD_OPS=0``):
the client's torch ``AdamW`` is passed in, so no op is JIT-compiled. A one-rank world (NCCL for CUDA
tensors, gloo beside it). The model is a small causal LM from tests/deepspeed_job.py's blocks with odd
sizes (ZeRO's alignment padding) and its output head tied to the embedding (a shared parameter). The
run saves asynchronously after step 3 and trains on to step 5 while the checkpoint persists; a fresh
engine with other initial weights loads it and trains the same steps. Rule 1 of docs/testing.md
(same layout, code and inputs -> equal bits): the fresh engine's re-save equals the checkpoint
tensor for tensor (fp32 masters and Adam moments, model space), its counters, LR and client state
come back, and its losses and final masters equal the uninterrupted run's. ZeRO 1 and 2, fp32 and bf16.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GLOBAL_BATCH, SAVE_STEP, STEPS = 8, 3, 5


@pytest.fixture(scope="module")
def deepspeed(tmp_path_factory):
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
    except Exception as exc:
        pytest.skip(f"deepspeed cannot be imported here: {type(exc).__name__}: {exc}")
    if get_accelerator().device_name() != "cuda":
        pytest.skip(f"deepspeed chose the {get_accelerator().device_name()!r} accelerator, not CUDA")
    from tests.one_gpu_rank import one_rank_group

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():  # what a launcher sets
        os.environ.setdefault(key, value)
    with one_rank_group(tmp_path_factory.mktemp("store")):
        deepspeed.init_distributed()
        yield deepspeed


def lm() -> torch.nn.Module:
    """tests/deepspeed_job.py's tied-head LM at GPU sizes: two pre-norm blocks, vocab 517, width 96."""
    from tests.deepspeed_job import TinyLM

    return TinyLM(vocab=517, dim=96, heads=4)


VOCAB, SEQ = 517, 33


def _engine(deepspeed: Any, stage: int, dtype: str, seed: int) -> Any:
    torch.manual_seed(seed)
    model = lm()
    cfg: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH,
        "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        # buckets of 5M elements, not the 500M default (2 GB a step to allocate; the model has 0.2M)
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 4}},
        "steps_per_print": 10 ** 9,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters(), optimizer=optimizer)
    assert next(engine.module.parameters()).is_cuda
    return engine


def _step(engine: Any, step: int) -> float:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g).cuda()
    out = engine(tokens[:, :-1]).float()
    loss = torch.nn.functional.cross_entropy(out.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()
    return loss.item()


def _masters(engine: Any) -> list[torch.Tensor]:
    """The fp32 master partitions (ZeRO 1/2's flat groups), on the host."""
    return [g.detach().cpu().clone() for g in engine.optimizer.single_partition_of_fp32_groups]


def _all_tensors(folder: str) -> dict[str, torch.Tensor]:
    import ckptkit

    view = ckptkit.open(folder)
    return {k: view[k].read() for k in view.keys()}


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero_engine_on_gpu_saved_and_resumed_bit_exact(deepspeed, tmp_path, stage, dtype):
    import ckptkit
    from ckptkit.adapters import deepspeed as ds_ckpt

    folder = str(tmp_path / "ckpt")
    engine = _engine(deepspeed, stage, dtype, seed=0)
    losses = {s: _step(engine, s) for s in range(1, SAVE_STEP + 1)}
    lr = engine.get_lr()
    handle = ds_ckpt.save(engine, folder, client_state={"epoch": 7, "note": "x"}, asynchronous=True)
    handle.staged.result()
    losses.update({s: _step(engine, s) for s in range(SAVE_STEP + 1, STEPS + 1)})  # while it persists
    handle.wait()
    ckptkit.close_async()
    final = _masters(engine)
    del engine

    fresh = _engine(deepspeed, stage, dtype, seed=1)
    assert not all(torch.equal(a, b) for a, b in zip(_masters(fresh), final))
    client = ds_ckpt.load(fresh, folder)
    assert client == {"epoch": 7, "note": "x"}
    assert fresh.global_steps == SAVE_STEP and fresh.get_lr() == lr
    ds_ckpt.save(fresh, str(tmp_path / "resaved"), client_state=client)
    saved, again = _all_tensors(folder), _all_tensors(str(tmp_path / "resaved"))
    assert saved.keys() == again.keys() and any("exp_avg" in k for k in saved), sorted(saved)[:10]
    for k in saved:
        assert saved[k].dtype == again[k].dtype and torch.equal(saved[k], again[k]), k
    resumed = {s: _step(fresh, s) for s in range(SAVE_STEP + 1, STEPS + 1)}
    assert resumed == {s: losses[s] for s in range(SAVE_STEP + 1, STEPS + 1)}
    assert all(torch.equal(a, b) for a, b in zip(_masters(fresh), final))
