"""One rank of baseline (b) of bench_reshard.py: Megatron-core ``dist_checkpointing`` (torch_dist).

Launched by bench_reshard.py as ``world`` processes (RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT in the environment, gloo, CPU only). No model: the
same synthetic Megatron-GPT tensors as the ckptkit benchmark are declared as
``ShardedTensor``s directly, with Megatron's own conventions:

* tensor-parallel shards by ``from_rank_offsets`` on the TP axis, pipeline
  stages by the layer axis (one ShardedTensor per stage holding its stacked
  layers), TP-replicated tensors (layer norms) with ``replica_id = tp_rank``;
* the fused SwiGLU ``linear_fc1`` as Megatron's swiglu factory stores it: two
  ShardedTensors per rank under the same key, the gate and up halves at
  fragments ``tp_rank`` and ``tp + tp_rank`` of ``2 x tp``;
* the embedding on the first stage, output layer and final norm on the last;
  optimizer state (fp32 main, exp_avg, exp_avg_sq) sharded like its parameter.

Rank ``r`` is ``tp_rank = r % tp``, ``dp_rank = r // tp % dp``, ``pp_rank =
r // (tp * dp)`` (Megatron's tp-cp-ep-dp-pp order); dense tensors are
replicated over dp (``replica_id`` ``(0, tp replica, dp_rank)``).

MoE (``experts`` > 0 in the spec): the dense MLP gives way to a router
``(L, E, h)`` and routed experts stacked ``(L, E, ...)`` as Megatron's
SequentialMLP declares them, on the expert rank generator's coordinates
(``etp_rank = r % etp``, ``ep_rank = r // etp % ep``, ``edp_rank = r // (etp
* ep) % edp``): each EP rank's block of experts, the fc1 gate/up halves as
``2 x etp`` fragments, replicated over expert data parallel.

``save SRC``: write random tensors at the layout (the untimed source).
``reshard SRC DST``: build the target layout's ShardedTensors (empty), load
them from SRC (Megatron reshards on load), save them to DST; prints this
rank's seconds from the first barrier to the end of the save.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def install_cpu_shims() -> None:
    """dist_checkpointing calls torch.cuda.current_device()/synchronize() on CPU-only machines
    (the two relevant lines of tests/megatron_cpu_shims.py, copied so this file stands alone)."""
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]


def shapes(hidden: int, ffn: int, layers: int, vocab: int, experts: int = 0,
           moe_ffn: int = 0) -> dict[str, tuple[tuple[int, ...], str]]:
    """Key -> (global shape, kind). Kinds: col (TP on the first non-layer axis), row (TP on the
    last), fc1 (fused gate/up), norm (TP-replicated), vocab_first / vocab_last (TP on the vocab,
    one stage), final_norm (last stage, TP-replicated), expert_fc1 / expert_row (routed experts)."""
    h, L = hidden, layers
    if experts:
        return {
            **{k: v for k, v in shapes(hidden, ffn, layers, vocab).items() if ".mlp.linear_fc" not in k
               or "layer_norm" in k},
            "decoder.layers.mlp.router.weight": ((L, experts, h), "norm"),
            "decoder.layers.mlp.experts.experts.linear_fc1.weight": ((L, experts, 2 * moe_ffn, h), "expert_fc1"),
            "decoder.layers.mlp.experts.experts.linear_fc2.weight": ((L, experts, h, moe_ffn), "expert_row"),
        }
    return {
        "embedding.word_embeddings.weight": ((vocab, h), "vocab_first"),
        "output_layer.weight": ((vocab, h), "vocab_last"),
        "decoder.layers.self_attention.linear_qkv.weight": ((L, 3 * h, h), "col"),
        "decoder.layers.self_attention.linear_proj.weight": ((L, h, h), "row"),
        "decoder.layers.mlp.linear_fc1.weight": ((L, 2 * ffn, h), "fc1"),
        "decoder.layers.mlp.linear_fc2.weight": ((L, h, ffn), "row"),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": ((L, h), "norm"),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": ((L, h), "norm"),
        "decoder.final_layernorm.weight": ((h,), "final_norm"),
    }


def sharded_state_dict(rank: int, lay: dict, model: dict, fill: str, loaded: dict | None = None) -> dict:
    """This rank's ShardedTensors at the layout ``lay`` (tp, pp, dp, ep, etp) (``fill``: 'random' or
    'empty'; ``loaded``: the tensors a load returned, in the same structure, to save again)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    tp, pp, dp, ep, etp = lay["tp"], lay["pp"], lay.get("dp", 1), lay.get("ep", 1), lay.get("etp", lay["tp"])
    tp_rank, dp_rank, pp_rank = rank % tp, rank // tp % dp, rank // (tp * dp)
    etp_rank, ep_rank, edp_rank = rank % etp, rank // etp % ep, rank // (etp * ep) % (tp * dp // (etp * ep))
    first, last = pp_rank == 0, pp_rank == pp - 1
    gen = torch.Generator().manual_seed(rank)
    out: dict = {}

    def add(name: str, key: str, local_shape: tuple[int, ...], dtype: torch.dtype, *offsets, replica_id=None) -> None:
        replica_id = (0, 0, dp_rank) if replica_id is None else replica_id
        if loaded is not None:
            data = loaded[name]
        elif fill == "random":
            data = torch.randn(local_shape, generator=gen, dtype=torch.float32).to(dtype)
        else:
            data = torch.empty(local_shape, dtype=dtype)
        out[name] = ShardedTensor.from_rank_offsets(key, data, *offsets, replica_id=replica_id)

    main = lay.get("main_state", "fp32_param")  # "param": the distributed optimizer's fully_reshardable name
    groups = [("model", "", torch.bfloat16)] + [
        (f"optimizer.{g}", f"optimizer.state.{g}.", torch.float32) for g in (main, "exp_avg", "exp_avg_sq")
    ]
    for key, (shape, kind) in model.items():
        for prefix, key_prefix, dtype in groups:
            name, skey = f"{prefix}/{key}", f"{key_prefix}{key}"
            if kind in ("vocab_first", "vocab_last"):
                if (kind == "vocab_first" and first) or (kind == "vocab_last" and last):
                    add(name, skey, (shape[0] // tp, shape[1]), dtype, (0, tp_rank, tp))
            elif kind == "final_norm":
                if last:
                    add(name, skey, shape, dtype, replica_id=(0, tp_rank, dp_rank))
            else:
                L = shape[0] // pp
                stage = (0, pp_rank, pp)
                if kind == "norm":
                    add(name, skey, (L, *shape[1:]), dtype, stage, replica_id=(0, tp_rank, dp_rank))
                elif kind in ("expert_fc1", "expert_row"):
                    e = shape[1] // ep
                    block = (1, ep_rank, ep)
                    rid = (0, 0, edp_rank)
                    if kind == "expert_row":
                        add(name, skey, (L, e, shape[2], shape[3] // etp), dtype, stage, block, (3, etp_rank, etp),
                            replica_id=rid)
                    else:
                        half = (L, e, shape[2] // 2 // etp, shape[3])
                        add(name + "#w", skey, half, dtype, stage, block, (2, etp_rank, 2 * etp), replica_id=rid)
                        add(name + "#v", skey, half, dtype, stage, block, (2, etp + etp_rank, 2 * etp), replica_id=rid)
                elif kind == "col":
                    add(name, skey, (L, shape[1] // tp, shape[2]), dtype, stage, (1, tp_rank, tp))
                elif kind == "row":
                    add(name, skey, (L, shape[1], shape[2] // tp), dtype, stage, (2, tp_rank, tp))
                elif kind == "fc1":  # Megatron's swiglu factory: gate and up halves as 2*tp fragments
                    half = (L, shape[1] // 2 // tp, shape[2])
                    add(name + "#w", skey, half, dtype, stage, (1, tp_rank, 2 * tp))
                    add(name + "#v", skey, half, dtype, stage, (1, tp + tp_rank, 2 * tp))
    return out


def megatron_lm_common(spec: dict, world: int) -> dict:
    """The non-sharded items Megatron-LM's ``save_checkpoint`` adds (``common.pt``): iteration, args, the
    scheduler, and the distributed optimizer's param groups with Adam's step (``DistributedOptimizer.state_dict``)."""
    import argparse

    args = argparse.Namespace(num_layers=spec["layers"], hidden_size=spec["hidden"], vocab_size=spec["vocab"],
                              padded_vocab_size=spec["vocab"], make_vocab_size_divisible_by=128,
                              tensor_model_parallel_size=spec["tp"], pipeline_model_parallel_size=spec["pp"],
                              world_size=world, untie_embeddings_and_output_weights=True)
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": wd, "step": 1000.0, "wd_mult": wd_mult,
               "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}  # what Megatron matches groups by
              for wd, wd_mult in ((0.1, 1.0), (0.0, 0.0))]
    return {"iteration": 1000, "checkpoint_version": 3.0, "args": args,
            "opt_param_scheduler": {"num_steps": 1000, "lr_decay_style": "cosine", "max_lr": 3e-4},
            "optimizer": {"optimizer": {"param_groups": groups}, "param_state_sharding_type": "fully_reshardable"}}


def main() -> int:
    mode = sys.argv[1]
    spec = json.loads(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    install_cpu_shims()
    from megatron.core import dist_checkpointing

    model = shapes(spec["hidden"], spec["ffn"], spec["layers"], spec["vocab"], spec.get("experts", 0),
                   spec.get("moe_ffn", 0))
    assert spec["tp"] * spec["pp"] * spec.get("dp", 1) == world, (spec, world)
    if mode == "save":
        state = sharded_state_dict(rank, spec, model, "random")
        if spec.get("megatron_lm_common"):
            state.update(megatron_lm_common(spec, world))
        dist_checkpointing.save(state, sys.argv[3])
        dist.barrier()
    else:
        dist.barrier()
        t0 = time.perf_counter()
        loaded = dist_checkpointing.load(sharded_state_dict(rank, spec, model, "empty"), sys.argv[3])
        t_load = time.perf_counter() - t0
        dist_checkpointing.save(sharded_state_dict(rank, spec, model, "", loaded), sys.argv[4])
        dist.barrier()
        print(json.dumps({"rank": rank, "seconds": time.perf_counter() - t0, "load_seconds": t_load}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # the torch_dist save strategy may start helper processes: keep this guard
    sys.exit(main())
