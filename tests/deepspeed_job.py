"""Rank-side functions of tests/test_deepspeed*.py, run in real gloo worlds (tests/worlds.py).

A small MLP with odd sizes (so ZeRO's alignment padding and fragments that
straddle rank boundaries are exercised) and a buffer, trained by a real
``deepspeed.initialize`` engine on CPU: ZeRO 1, 2 or 3, fp32 or bf16, torch
AdamW passed in by the caller or DeepSpeed's config Adam with
``torch_adam: true`` (no JIT-compiled optimizer), DeepSpeed's WarmupLR
scheduler. The global batch is 8 samples at every DP size (micro batch
8 / dp), so runs at different DP sizes take the same optimizer steps.
Reported losses are global means (all-reduced), comparable across DP sizes.

ZeRO-3 runs with ``memory_efficient_linear`` off, so every stage computes
``torch.nn.functional.linear`` itself (ZeRO-3's own linear autograd function
rounds differently): engines at different stages then do the same arithmetic
on the same DP size, which is what lets tests/test_deepspeed.py compare a
resume at another stage with a reference bit for bit.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

GLOBAL_BATCH = 8
IN, HIDDEN, OUT = 7, 13, 5


def import_deepspeed() -> Any:
    """DeepSpeed on CPU without JIT compilation (the shm comm op is not needed over gloo)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import deepspeed.comm.torch  # loaded before it is patched below

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, OUT)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.nn.functional.gelu(self.fc2(torch.nn.functional.gelu(self.fc1(x))))) * self.scale


class Block(torch.nn.Module):
    """A pre-norm causal self-attention + MLP block from plain Linear layers (ZeRO-3 gathers each
    module's parameters in its own forward, so no functional reuse of another module's weights)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.up, self.down = torch.nn.Linear(dim, 3 * dim - 1), torch.nn.Linear(3 * dim - 1, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm2(h))))


class TinyLM(torch.nn.Module):
    """Two blocks, vocab 37, width 18, with the output head tied to the embedding (a shared parameter); the GPU
    check (tests/test_gpu_deepspeed.py) builds it larger."""

    VOCAB, DIM, SEQ = 37, 18, 6

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, heads: int = 3) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList([Block(dim, heads) for _ in range(2)])
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


MODELS = {"mlp": MLP, "lm": TinyLM}

FROZEN = ("fc1.weight", "fc2.bias")
"""The MLP's parameters ``frozen_seed`` freezes: odd sizes (91 and 13 elements), so ZeRO-3's partitions
of them are padded, at DP 4 and at DP 2 alike."""


def frozen_values(seed: int) -> dict[str, torch.Tensor]:
    """The values ``frozen_seed=seed`` gives the frozen parameters (fp32; a bf16 engine holds them rounded)."""
    g = torch.Generator().manual_seed(seed)
    return {"fc1.weight": torch.randn(HIDDEN, IN, generator=g), "fc2.bias": torch.randn(HIDDEN, generator=g)}


def freeze(model: torch.nn.Module, seed: int) -> None:
    """Set :data:`FROZEN` to :func:`frozen_values` and take them out of training (``requires_grad=False``, so
    no ZeRO optimizer group holds them). A resume built with another seed holds other values until its load:
    a load that skipped frozen parameters would show in its first loss."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in frozen_values(seed).items():
            params[name].copy_(value)
            params[name].requires_grad_(False)


def config(stage: int, dtype: str, *, config_optimizer: bool = False, gas: int = 1, **extra: Any) -> dict[str, Any]:
    dp = dist.get_world_size()
    cfg: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // (dp * gas),
        "gradient_accumulation_steps": gas, "zero_optimization": {"stage": stage},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 4}},
        "steps_per_print": 10 ** 9,
    }
    if config_optimizer:
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True, "weight_decay": 0.01}}
    if stage == 3:
        cfg["zero_optimization"]["memory_efficient_linear"] = False  # see the module docstring
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    cfg.update(extra)
    return cfg


def build(stage: int, dtype: str, *, config_optimizer: bool = False, model: str = "mlp",
          frozen_seed: int | None = None, **extra: Any) -> Any:
    deepspeed = import_deepspeed()
    # A ZeRO-3 engine replaces torch.nn.functional.linear process-wide (memory_efficient_linear; DeepSpeed
    # says it "will persist unless manually reset"). These worlds run many engines in one process, so
    # reset it: every engine starts as it would in a fresh process.
    from deepspeed.runtime.zero.partition_parameters import (
        InsertPostInitMethodToModuleSubClasses as _Init,
    )

    if hasattr(_Init, "linear_bk"):
        torch.nn.functional.linear = _Init.linear_bk
    torch.manual_seed(0)
    model = MODELS[model]()
    if frozen_seed is not None:
        freeze(model, frozen_seed)
    cfg = config(stage, dtype, config_optimizer=config_optimizer, **extra)
    kwargs: dict[str, Any] = {"model": model, "config": cfg, "model_parameters": model.parameters()}
    if not config_optimizer:
        kwargs["optimizer"] = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    engine, *_ = deepspeed.initialize(**kwargs)
    return engine


def batch(step: int, engine: Any) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    if isinstance(engine.module, TinyLM):
        tokens = torch.randint(0, TinyLM.VOCAB, (GLOBAL_BATCH, TinyLM.SEQ + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    x = torch.randn(GLOBAL_BATCH, IN, generator=g).to(_dtype(engine))
    return x, torch.randn(GLOBAL_BATCH, OUT, generator=g)


def loss_of(engine: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = engine(x).float()
    if isinstance(engine.module, TinyLM):
        return torch.nn.functional.cross_entropy(out.reshape(-1, TinyLM.VOCAB), y.reshape(-1))
    return (out - y).pow(2).mean()


def _dtype(engine: Any) -> torch.dtype:
    return torch.bfloat16 if engine.bfloat16_enabled() else torch.float32


def train_step(engine: Any, step: int) -> float:
    """One optimizer step on this rank's share of the global batch (in ``gradient_accumulation_steps``
    micro-batches); the global mean loss."""
    dp, rank, gas = dist.get_world_size(), dist.get_rank(), engine.gradient_accumulation_steps()
    x, y = batch(step, engine)
    per = GLOBAL_BATCH // dp
    x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    micro = per // gas
    total = torch.zeros(())
    for i in range(gas):
        xs, ys = x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro]
        loss = loss_of(engine, xs, ys)
        engine.backward(loss)
        engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
        total += loss.detach() / gas
    dist.all_reduce(total)
    return (total / dp).item()


@torch.no_grad()
def eval_loss(engine: Any) -> float:
    x, y = batch(-1, engine)
    return loss_of(engine, x, y).item()


def train_and_save(stage: int, dtype: str, folder: str, *, save_step: int, steps: int,
                   config_optimizer: bool = False, native: bool = True, model: str = "mlp",
                   universal: bool = False, frozen_seed: int | None = None) -> dict[str, Any]:
    """The uninterrupted reference run: saves asynchronously with ckptkit at ``save_step``
    (and natively with DeepSpeed; ``universal``: that converted by DeepSpeed's ds_to_universal, see
    :func:`resume_universal`), keeps training to ``steps``."""
    from ckptkit.adapters import deepspeed as ds_ckpt

    engine = build(stage, dtype, config_optimizer=config_optimizer, model=model, frozen_seed=frozen_seed)
    losses, out = {}, {}
    for step in range(1, steps + 1):
        losses[step] = train_step(engine, step)
        if step == save_step:
            handle = ds_ckpt.save(engine, f"{folder}/ckptkit", client_state={"epoch": 7, "note": "x"},
                                  asynchronous=True)
            handle.staged.result()
            out["eval"] = eval_loss(engine)
            out["lr"] = engine.get_lr()
            if native:
                engine.save_checkpoint(f"{folder}/native", tag=f"global_step{step}",
                                       client_state={"epoch": 7, "note": "x"})
                if universal:
                    to_universal(f"{folder}/native", f"{folder}/universal", f"global_step{step}")
    # steps 3 and 4 ran while the checkpoint persisted: the snapshot must not see them
    out["committed"] = handle.committed.result() is not None
    out["losses"] = losses
    out["final_eval"] = eval_loss(engine)
    return out


def resume(stage: int, dtype: str, path: str, *, from_step: int, steps: int,
           config_optimizer: bool = False, gas: int = 1, model: str = "mlp",
           resave: str | None = None, load_optimizer_states: bool = True, perturb: bool = False,
           frozen_seed: int | None = None) -> dict[str, Any]:
    """Load ``path`` into a fresh engine (``resave``: then save it again right away, so the test can
    compare the two checkpoints in model space), evaluate, and train on. Negative controls: ``perturb`` scales
    the fp32 master of ``fc2.weight`` by 1.001 after the load; ``load_optimizer_states=False`` keeps a fresh Adam.
    ``frozen_seed``: the fresh engine's frozen parameters (:func:`freeze`); its loss before the load is
    reported as ``eval_before``."""
    from ckptkit.adapters import deepspeed as ds_ckpt

    engine = build(stage, dtype, config_optimizer=config_optimizer, gas=gas, model=model, frozen_seed=frozen_seed)
    before = eval_loss(engine)
    client = ds_ckpt.load(engine, path, load_optimizer_states=load_optimizer_states)
    if perturb:
        _scale_master(engine, "fc2.weight", 1.001)
    if resave is not None:
        ds_ckpt.save(engine, resave, client_state=client)
    return _train_on(engine, {"client": client, "eval_before": before}, from_step, steps)


def _train_on(engine: Any, out: dict[str, Any], from_step: int, steps: int) -> dict[str, Any]:
    """Report what a resumed engine is compared on (eval, LR, counters), then train to ``steps``."""
    out.update({"eval": eval_loss(engine), "lr": engine.get_lr(), "global_steps": engine.global_steps,
                "global_samples": engine.global_samples})
    out["losses"] = {step: train_step(engine, step) for step in range(from_step + 1, steps + 1)}
    out["final_eval"] = eval_loss(engine)
    out["micro_steps"] = engine.micro_steps
    return out


def controls(stage: int, dtype: str, path: str, *, from_step: int, steps: int) -> dict[str, Any]:
    """The negative controls of the reference comparison in one call: one tensor perturbed, a fresh optimizer."""
    return {"perturbed": resume(stage, dtype, path, from_step=from_step, steps=steps, perturb=True),
            "fresh_optimizer": resume(stage, dtype, path, from_step=from_step, steps=steps,
                                      load_optimizer_states=False)}


def _scale_master(engine: Any, name: str, factor: float) -> None:
    """Scale one parameter's fp32 master through DeepSpeed's own fragment API and re-derive the training weights."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    assert engine.zero_optimization_stage() < 3, "the control runs at ZeRO 1/2"
    param = dict(engine.module.named_parameters())[name]
    safe_set_full_fp32_param(param, safe_get_full_fp32_param(param) * factor)
    engine.optimizer.update_lp_params()


# ---- DeepSpeed's own route to another DP size: the reference a resume there is compared with
#
# DeepSpeed's native loader refuses another DP size; its universal checkpoint is its own way there: the native
# save converted by deepspeed.checkpoint.ds_to_universal into one file per parameter and state, loaded with
# "load_universal". An engine resumed that way at a DP size does the arithmetic a ckptkit resume there does,
# so the two must be bit-equal on any machine. (DeepSpeed's converter does not handle DeepSpeed-MoE, whose
# expert files it merges across EP ranks; tests/test_deepspeed_moe.py uses DeepSpeed's native loader instead.)


def to_universal(native: str, out: str, tag: str) -> None:
    """``ds_to_universal`` of ``native``/``tag`` into ``out`` (rank 0; the others wait). The checkpoints here do
    not come from Megatron-DeepSpeed, which records the ``universal_checkpoint_info`` the converter asks for:
    ``inject_missing_state`` supplies DeepSpeed's default for a model without tensor parallelism."""
    if dist.get_rank() == 0:
        import argparse
        import contextlib
        import io

        from deepspeed.checkpoint import ds_to_universal

        args = argparse.Namespace(input_folder=os.path.join(native, tag), output_folder=os.path.join(out, tag),
                                  num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                                  inject_missing_state=True)
        with contextlib.redirect_stdout(io.StringIO()):
            ds_to_universal.main(args)
        with open(os.path.join(out, "latest_universal"), "w") as f:
            f.write(tag)
    dist.barrier()


def resume_universal(stage: int, dtype: str, path: str, *, from_step: int, steps: int,
                     config_optimizer: bool = False, gas: int = 1, model: str = "mlp") -> dict[str, Any]:
    """DeepSpeed's own resume of a universal checkpoint at this world's DP size (the reference run)."""
    engine = build(stage, dtype, config_optimizer=config_optimizer, gas=gas, checkpoint={"load_universal": True},
                   model=model)
    _, client = engine.load_checkpoint(path)
    return _train_on(engine, {"client": {k: client[k] for k in ("epoch", "note", "last") if k in client}},
                     from_step, steps)


def layout_facts(stage: int, dtype: str, zero_extra: dict[str, Any]) -> dict[str, Any]:
    """ckptkit's partition facts next to what the live engine holds (sizes, padding, DeepSpeed's own
    per-parameter fragment addresses), after one step so the optimizer state exists."""
    from ckptkit.layout.zero_partition import (
        Zero3SubGroup,
        Zero12Group,
        param_alignment,
        round_robin_order,
    )

    cfg_zero = {"stage": stage, **zero_extra}
    engine = build(stage, dtype, zero_optimization=cfg_zero)
    train_step(engine, 1)
    opt, dp, rank = engine.optimizer, dist.get_world_size(), dist.get_rank()
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out: dict[str, Any] = {"ours": [], "theirs": []}
    if stage < 3:
        for g, params in enumerate(opt.bit16_groups):
            numels = tuple(p.numel() for p in params)
            order = tuple(round_robin_order(len(numels), dp)) if zero_extra.get("round_robin_gradients") else None
            align = param_alignment(params[0].element_size(), bool(zero_extra.get("parameter_alignment")))
            layout = Zero12Group(numels, dp, order, align)
            ours = {names[id(params[f.param])]: (f.numel, f.local_start) for f in layout.fragments(rank)}
            fp32 = opt.single_partition_of_fp32_groups[g]
            # the bytes: each fragment of the fp32 partition is that slice of the parameter (lp = fp32 rounded)
            data_ok = all(torch.equal(fp32[f.local_start:f.local_start + f.numel].to(params[f.param].dtype),
                                      params[f.param].detach().flatten()[f.start:f.stop])
                          for f in layout.fragments(rank))
            out["ours"].append((layout.partition_numel, layout.padding(rank), True))
            out["theirs"].append((fp32.numel(), opt.groups_padding[g], data_ok))
            if order is None:
                # DeepSpeed's own fragment addresses (param_slice_mappings). With round_robin_gradients they
                # follow the unordered list while the flat buffer is reordered, so there only the bytes count.
                theirs = {n: (a.numel, a.start) for n, a in opt._param_slice_mappings[g].items()}
                out["ours"].append(ours)
                out["theirs"].append(theirs)
    else:
        for j, params in enumerate(opt.fp16_groups):
            layout = Zero3SubGroup(tuple(p.ds_numel for p in params), dp)
            fp32 = opt.fp32_partitioned_groups_flat[j]
            data_ok = all(torch.equal(fp32[f.local_start:f.local_start + f.numel].to(params[f.param].ds_tensor.dtype),
                                      params[f.param].ds_tensor[:f.numel]) for f in layout.fragments(rank))
            out["ours"].append((layout.partition_numel, layout.partition_numels, True))
            out["theirs"].append((fp32.numel(), tuple(p.ds_tensor.ds_numel for p in params), data_ok))
    return out


def resume_native(stage: int, dtype: str, folder: str, *, from_step: int, steps: int,
                  config_optimizer: bool = False, model: str = "mlp", frozen_seed: int | None = None) -> dict[str, Any]:
    """Resume through DeepSpeed's own ``engine.load_checkpoint`` (e.g. of a folder ckptkit exported)."""
    engine = build(stage, dtype, config_optimizer=config_optimizer, model=model, frozen_seed=frozen_seed)
    _, client = engine.load_checkpoint(folder)
    out: dict[str, Any] = {"client": {k: client[k] for k in ("epoch", "note") if k in client},
                           "eval": eval_loss(engine), "lr": engine.get_lr(),
                           "global_steps": engine.global_steps, "global_samples": engine.global_samples}
    out["losses"] = {step: train_step(engine, step) for step in range(from_step + 1, steps + 1)}
    out["final_eval"] = eval_loss(engine)
    return out


def checkpointer_run(stage: int, dtype: str, root: str, *, steps: int, resume: bool,
                     universal: str | None = None) -> dict[str, Any]:
    """Train with DeepSpeedCheckpointer (every 2 steps, keep 2), optionally resuming from ``root`` first
    (``universal``: at the end also save natively and convert that for :func:`resume_universal`)."""
    from ckptkit.adapters.deepspeed import DeepSpeedCheckpointer

    engine = build(stage, dtype)
    ckpt = DeepSpeedCheckpointer(engine, root, every_steps=2, keep_last=2)
    client = ckpt.restore_latest() if resume else None
    start = engine.global_steps
    losses = {}
    for step in range(start + 1, steps + 1):
        losses[step] = train_step(engine, step)
        ckpt.maybe_save(client_state={"last": step})
    ckpt.close()
    if universal is not None:
        engine.save_checkpoint(f"{universal}/native", tag=f"global_step{steps}", client_state={"last": steps})
        to_universal(f"{universal}/native", f"{universal}/universal", f"global_step{steps}")
    return {"client": client, "start": start, "losses": losses, "eval": eval_loss(engine),
            "skipped": [name for name, _ in ckpt.manager.skipped]}


def refused_bf16_optimizer(folder: str) -> str:
    """ZeRO-1 + bf16 + fp32 gradient accumulation: DeepSpeed's BF16_Optimizer, which the adapter refuses."""
    from ckptkit.adapters import deepspeed as ds_ckpt
    from ckptkit.errors import StateMismatchError

    engine = build(1, "bf16", data_types={"grad_accum_dtype": "fp32"})
    try:
        ds_ckpt.save(engine, folder)
    except StateMismatchError as exc:
        return str(exc)
    return "saved"


def checkpointer_restore(stage: int, dtype: str, root: str) -> dict[str, Any]:
    """``DeepSpeedCheckpointer(...).restore_latest()`` in a fresh engine on ``root``: the client state and step
    it resumed, or the error it raised."""
    from ckptkit.adapters.deepspeed import DeepSpeedCheckpointer

    engine = build(stage, dtype)
    ckpt = DeepSpeedCheckpointer(engine, root, every_steps=2)
    try:
        return {"client": ckpt.restore_latest(), "step": engine.global_steps, "error": None}
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        ckpt.close()
