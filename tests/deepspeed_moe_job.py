"""Rank-side functions of tests/test_deepspeed_moe.py, run in real gloo worlds (tests/worlds.py).

A small model with two ``deepspeed.moe.layer.MoE`` layers (4 experts each,
top-2, experts are 2-layer MLPs with odd sizes and biases) between dense
layers, trained by a real ``deepspeed.initialize`` engine on CPU with ZeRO 1
or 2, a torch AdamW over DeepSpeed's expert parameter groups
(``split_params_into_different_moe_groups_for_optimizer``), and WarmupLR.

Routing is made a function of the weights alone, so runs at different DP and
EP sizes take the same optimizer steps: no token dropping (``drop_tokens=False``:
capacity is the all-reduced maximum count, padding slots carry zero combine
weight), no random token selection, no sampled second expert; the gate's
auxiliary loss (a mean over each rank's own tokens, so it changes with the DP
size) is not added to the loss. The global batch is 8 samples at every DP size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.deepspeed_job import config as dense_config
from tests.deepspeed_job import import_deepspeed

GLOBAL_BATCH = 8
IN, HIDDEN, FFN, OUT, EXPERTS = 5, 6, 7, 3, 4
MOE_LAYERS = 2


class Expert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(HIDDEN, FFN)
        self.fc2 = torch.nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class MoEModel(torch.nn.Module):
    """in -> gelu -> [MoE + residual] x 2 -> out, and a buffer."""

    def __init__(self, ep: int) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.inp = torch.nn.Linear(IN, HIDDEN)
        self.moe = torch.nn.ModuleList([
            MoE(HIDDEN, Expert(), num_experts=EXPERTS, ep_size=ep, k=2, drop_tokens=False, use_rts=False,
                top2_2nd_expert_sampling=False, min_capacity=0)
            for _ in range(MOE_LAYERS)])
        self.out = torch.nn.Linear(HIDDEN, OUT)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, OUT))
        # DeepSpeed deep-copies one expert into each local slot: give every global expert its own weights,
        # the same at every EP size (expert e of layer l lives on EP rank e // local; EP groups are
        # consecutive ranks, DeepSpeed's groups._create_expert_and_data_parallel)
        local = EXPERTS // ep
        ep_rank = dist.get_rank() % ep
        with torch.no_grad():
            for layer, moe in enumerate(self.moe):
                for j, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
                    g = torch.Generator().manual_seed(100 * layer + ep_rank * local + j)
                    for p in expert.parameters():
                        p.copy_(torch.randn(p.shape, generator=g) * 0.4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.inp(x))
        for moe in self.moe:
            out, _aux, _counts = moe(h)
            h = h + out
        return self.out(h) * self.scale


def config(stage: int, *, gas: int = 1, **extra: Any) -> dict[str, Any]:
    """tests/deepspeed_job.py's engine config (the dtype comes in ``extra``, see :func:`dtype_config`)."""
    return dense_config(stage, "fp32", gas=gas, **extra)


def build(stage: int, ep: int, **extra: Any) -> Any:
    deepspeed = import_deepspeed()
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    torch.manual_seed(0)
    model = MoEModel(ep)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense"})
    opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config(stage, **extra))
    return engine


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)


def _cast(engine: Any, x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16) if engine.bfloat16_enabled() else x


def train_step(engine: Any, step: int) -> float:
    dp, rank, gas = dist.get_world_size(), dist.get_rank(), engine.gradient_accumulation_steps()
    x, y = batch(step)
    x = _cast(engine, x)
    per = GLOBAL_BATCH // dp
    x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    micro = per // gas
    total = torch.zeros(())
    for i in range(gas):
        loss = (engine(x[i * micro:(i + 1) * micro]).float() - y[i * micro:(i + 1) * micro]).pow(2).mean()
        engine.backward(loss)
        engine.step()
        total += loss.detach() / gas
    dist.all_reduce(total)
    return (total / dp).item()


@torch.no_grad()
def eval_loss(engine: Any) -> float:
    """The held-out loss over the global eval batch, computed in DP shards (the MoE all-to-all needs every
    rank of the EP group in the forward) and averaged."""
    dp, rank = dist.get_world_size(), dist.get_rank()
    x, y = batch(-1)
    x = _cast(engine, x)
    per = GLOBAL_BATCH // dp
    loss = (engine(x[rank * per:(rank + 1) * per]).float() - y[rank * per:(rank + 1) * per]).pow(2).mean()
    loss = loss.reshape(1)
    dist.all_reduce(loss)
    return (loss / dp).item()


def dtype_config(dtype: str) -> dict[str, Any]:
    return {"bf16": {"enabled": True}} if dtype == "bf16" else {}


def train_and_save(stage: int, ep: int, folder: str, *, save_step: int, steps: int,
                   dtype: str = "fp32") -> dict[str, Any]:
    """The uninterrupted reference run: saves with ckptkit (asynchronously) and natively with DeepSpeed
    at ``save_step``, keeps training to ``steps``. Without ZeRO (stage 0, which the adapter does not save) it
    also reports what the engine held for its dense parameters then (:func:`dense_state`)."""
    from ckptkit.adapters import deepspeed as ds_ckpt

    engine = build(stage, ep, **dtype_config(dtype))
    losses, out = {}, {}
    for step in range(1, steps + 1):
        losses[step] = train_step(engine, step)
        if step == save_step:
            handle = None  # without ZeRO (stage 0) only DeepSpeed's own save: the adapter needs ZeRO 1/2
            if stage > 0:
                handle = ds_ckpt.save(engine, f"{folder}/ckptkit", client_state={"epoch": 7}, asynchronous=True)
                handle.staged.result()
            out["eval"] = eval_loss(engine)
            out["lr"] = engine.get_lr()
            engine.save_checkpoint(f"{folder}/native", tag=f"global_step{step}", client_state={"epoch": 7})
            if stage == 0:
                out["dense_state"] = dense_state(engine)
    out["committed"] = handle is None or handle.committed.result() is not None
    out["losses"] = losses
    out["final_eval"] = eval_loss(engine)
    return out


def dense_state(engine: Any) -> dict[str, torch.Tensor]:
    """A stage-0 engine's dense parameters and buffers under the keys of ckptkit's DeepSpeed adapter: the
    weights (without ZeRO they are the fp32 masters) and the torch optimizer's moments. Dense parameters are
    replicated, so any rank's copy is the model's."""
    from ckptkit.adapters.deepspeed import FP32, model_key, optim_key

    opt = engine.optimizer
    out = {}
    for name, p in engine.module.named_parameters():
        if getattr(p, "allreduce", True):  # DeepSpeed marks expert parameters allreduce=False
            out[model_key(name)] = out[optim_key(FP32, name)] = p.detach().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                out[optim_key(key, name)] = opt.state[p][key].clone()
    out.update({model_key(name): b.clone() for name, b in engine.module.named_buffers()})
    return out


def resume(stage: int, ep: int, path: str, *, from_step: int, steps: int, gas: int = 1,
           resave: str | None = None, native: bool = False, dtype: str = "fp32") -> dict[str, Any]:
    """Load ``path`` into a fresh engine at this world's DP size and ``ep`` (with ckptkit, or ``native``: with
    DeepSpeed's own ``load_checkpoint``), optionally save it again at once (``resave``), evaluate, train on."""
    from ckptkit.adapters import deepspeed as ds_ckpt

    engine = build(stage, ep, gradient_accumulation_steps=gas,
                   train_micro_batch_size_per_gpu=GLOBAL_BATCH // (dist.get_world_size() * gas), **dtype_config(dtype))
    if native:
        _, client = engine.load_checkpoint(path)
        client = {"epoch": client.get("epoch")}
    else:
        client = ds_ckpt.load(engine, path)
    if resave is not None:
        ds_ckpt.save(engine, resave, client_state=client)
    out: dict[str, Any] = {"client": client, "eval": eval_loss(engine), "lr": engine.get_lr(),
                           "global_steps": engine.global_steps, "global_samples": engine.global_samples,
                           # DeepSpeed looks expert process groups up by these names: they must stay the engine's
                           "group_names": [pg.get("name") for pg in engine.optimizer.optimizer.param_groups]}
    out["losses"] = {step: train_step(engine, step) for step in range(from_step + 1, steps + 1)}
    out["final_eval"] = eval_loss(engine)
    return out


def consolidated_eval(ep: int, state_dict: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Load a consolidated fp32 state dict into a fresh engine's module at ``ep`` with ``load_state_dict``
    (strict: every key present, no extra), evaluate."""
    engine = build(1, ep)
    from deepspeed.utils import groups

    local = EXPERTS // ep
    ep_rank = groups._get_expert_parallel_rank(f"ep_size_{ep}")
    own = {}  # this EP rank's experts, renamed to local ids as DeepSpeed's own loader does
    for key, value in state_dict.items():
        for layer in range(MOE_LAYERS):
            stem = f"moe.{layer}.deepspeed_moe.experts.deepspeed_experts."
            if key.startswith(stem):
                e, rest = key[len(stem):].split(".", 1)
                if ep_rank * local <= int(e) < (ep_rank + 1) * local:
                    own[f"{stem}{int(e) - ep_rank * local}.{rest}"] = value
                break
        else:
            own[key] = value
    with torch.no_grad():
        engine.module.load_state_dict(own, strict=True)
    return {"eval": eval_loss(engine)}
