"""A real Megatron-core GPT at tp1 on one GPU, saved with ckptkit and resumed bit-exact. Needs CUDA.

No CPU shims (tests/megatron_cpu_shims.py is for the CPU suite): the model is initialised on the GPU,
trained through Megatron's own DDP wrapper, distributed optimizer and ``get_forward_backward_func``
in a one-rank NCCL world (gloo beside it for ckptkit's and Megatron's CPU groups), with its CUDA RNG
tracker. The run saves asynchronously after step 3 (``ckptkit.adapters.megatron.save``) and trains on to
step 5 while the checkpoint persists; a fresh job with other initial weights loads it and trains the
same steps 4-5. Rule 1 of docs/testing.md: same layout, same code, same inputs -> equal bits. So:

* the resumed job's re-save holds every tensor (model and optimizer, model space) bit-equal to the
  checkpoint, and the iteration, LR and RNG state come back;
* the resumed losses and the final weights equal the uninterrupted run's (deterministic cuBLAS
  workspace and ``torch.use_deterministic_algorithms``).

fp32 weights, and bf16 weights with fp32 main copies (``Float16Module``). Skipped where CUDA or
megatron-core is missing, with the reason.
"""

from __future__ import annotations

import hashlib
import os
from functools import partial
from typing import Any

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

VOCAB, SEQ, MICRO, NUM_MICRO, HIDDEN, LAYERS = 1000, 64, 4, 2, 256, 4
PADDED = 1024  # Megatron pads the vocabulary to a multiple of 128 (x tp): the padding rows are a tensor of their own
SAVE_STEP, STEPS = 3, 5


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    try:
        import megatron.core  # noqa: F401
        from megatron.core import parallel_state  # noqa: F401
        from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: F401
    except Exception as exc:  # ImportError, or a torch this megatron-core does not run on
        pytest.skip(f"megatron-core cannot be imported here: {type(exc).__name__}: {exc}")
    from tests.one_gpu_rank import one_rank_group

    with one_rank_group(tmp_path_factory.mktemp("store")):
        yield


def _setup(bf16: bool, seed: int) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.transformer_config import TransformerConfig

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=4 * HIDDEN,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=False,
        add_bias_linear=False, normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype,
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=PADDED,
                     max_sequence_length=SEQ, pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope")
    model.cuda(torch.cuda.current_device())
    if bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                        grad_reduce_in_fp32=True), model)
    opt_config = OptimizerConfig(optimizer="adam", lr=3e-3, min_lr=3e-4, weight_decay=0.01, use_distributed_optimizer=True,
                                 clip_grad=1.0, bf16=bf16, fp16=False)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=2,
                                        lr_decay_steps=20, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                        wd_incr_steps=20, wd_incr_style="constant")
    return {"model": [ddp], "optimizer": optimizer, "scheduler": scheduler, "iteration": 0}


def _batch(step: int, micro: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + micro)
    tokens = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g).cuda()
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def _forward_step(step: int, data_iterator: Any, model: Any) -> Any:
    b = _batch(step, next(data_iterator))
    positions = torch.arange(SEQ, device="cuda").unsqueeze(0).expand_as(b["tokens"])
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device="cuda").tril().logical_not()
    out = model(b["tokens"], positions, mask, labels=b["labels"])

    def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = per_token.float().mean()
        return loss, {"loss": loss.detach()}

    return out, loss_func


def _train_step(t: dict[str, Any]) -> float:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    step = t["iteration"] + 1
    for chunk in t["model"]:
        chunk.zero_grad_buffer()
    t["optimizer"].zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, step), data_iterator=iter(range(NUM_MICRO)), model=t["model"][0],
        num_microbatches=NUM_MICRO, seq_length=SEQ, micro_batch_size=MICRO, forward_only=False)
    ok, _, _ = t["optimizer"].step()
    assert ok, "optimizer step skipped"
    t["scheduler"].step(increment=1)
    t["iteration"] = step
    return sum(float(x["loss"]) for x in losses)


def _weights(t: dict[str, Any]) -> dict[str, str]:
    from ckptkit.adapters.megatron.model_space import unwrap

    out = {}
    for name, p in unwrap(t["model"][0]).named_parameters():
        out[name] = hashlib.sha1(p.detach().float().cpu().numpy().tobytes()).hexdigest()
    return out


def _all_tensors(folder: str) -> dict[str, torch.Tensor]:
    import ckptkit

    view = ckptkit.open(folder)
    return {k: view[k].read() for k in view.keys()}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_megatron_gpt_on_gpu_saved_and_resumed_bit_exact(megatron, tmp_path, bf16):
    import ckptkit
    from ckptkit.adapters import megatron as mckpt
    from megatron.core import parallel_state as ps

    # the embedding and the output layer each hold two tensors in one CUDA local (the vocabulary and its padding):
    # each used to be copied back whole from its own stand-in, the second's stale rows over the first's loaded ones
    options = mckpt.MegatronOptions(vocab_size=VOCAB, make_vocab_size_divisible_by=128)
    folder = str(tmp_path / "ckpt")
    t = _setup(bf16, seed=1234)
    assert next(t["model"][0].parameters()).is_cuda
    losses = {}
    while t["iteration"] < SAVE_STEP:
        step = t["iteration"] + 1
        losses[step] = _train_step(t)
    lr = t["optimizer"].param_groups[0]["lr"]
    handle = mckpt.save(t["model"], folder, optimizer=t["optimizer"], scheduler=t["scheduler"],
                        iteration=t["iteration"], extra={"consumed": 7}, options=options, asynchronous=True)
    while t["iteration"] < STEPS:  # training goes on while the checkpoint persists
        step = t["iteration"] + 1
        losses[step] = _train_step(t)
    handle.wait()
    ckptkit.close_async()
    final = _weights(t)
    ps.destroy_model_parallel()

    r = _setup(bf16, seed=999)  # other initial weights: everything must come from the checkpoint
    assert _weights(r) != final
    info = mckpt.load(r["model"], folder, optimizer=r["optimizer"], scheduler=r["scheduler"])
    assert info.iteration == SAVE_STEP and info.extra == {"consumed": 7} and info.rng_restored
    r["iteration"] = info.iteration
    assert r["optimizer"].param_groups[0]["lr"] == lr
    resaved = str(tmp_path / "resaved")
    mckpt.save(r["model"], resaved, optimizer=r["optimizer"], scheduler=r["scheduler"], iteration=r["iteration"],
               extra=info.extra, options=options)
    saved, again = _all_tensors(folder), _all_tensors(resaved)
    assert saved.keys() == again.keys() and any("exp_avg" in k for k in saved), sorted(saved)[:10]
    for k in saved:
        assert saved[k].dtype == again[k].dtype and torch.equal(saved[k], again[k]), k
    resumed = {}
    while r["iteration"] < STEPS:
        step = r["iteration"] + 1
        resumed[step] = _train_step(r)
    ps.destroy_model_parallel()
    assert resumed == {s: losses[s] for s in range(SAVE_STEP + 1, STEPS + 1)}
    assert _weights(r) == final
