"""torchtitan checkpointing: ckptkit's drop-in manager vs torchtitan's own, in one run.

Every rank builds torchtitan's llama3 model (the debug model's recipe scaled
to >= 1 GiB of training state: fp32 weights plus two AdamW moments), shards
it with FSDP2 over all ranks (``fully_shard`` per block and at the root, gloo,
CPU), takes one optimizer step so the moments exist, and then saves through
each checkpoint manager exactly as torchtitan's Trainer drives it:

    manager.save(step)                 # the trainer's step is blocked for this long
    manager.maybe_wait_for_staging()   # (torchtitan calls this before the next step)
    ...                                # -> "blocks": until training may go on
    manager.maybe_wait_for_saving()    # -> "total": until the checkpoint is durable

Managers (each with ``keep_latest_k=2``, one warm-up save, then ``--reps``
timed saves; the time of the slowest rank between barriers):

  titan sync        torchtitan CheckpointManager, async_mode="disabled" (DCP save)
  titan async       async_mode="async" (DCP async_save, thread)
  titan pinned      async_mode="async_with_pinned_mem" (DCP async_save with a pinned-memory
                    stager, process); needs CUDA pinned memory: reported as not run on CPU
  ckptkit async     ckptkit.adapters.torchtitan.CkptkitCheckpointManager, async_mode="async"
                    (thread executor)
  ckptkit process   the same with async_mode="async_process" (persistent writer process)

Run: python benchmarks/bench_torchtitan.py [--quick] [--out DIR] [--reps N]
(re-launches itself under torchrun with --nproc 4 ranks).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

from common import GiB, median, spread, table, torchrun_command, write_results  # noqa: E402

MANAGERS = ("titan sync", "titan async", "titan pinned", "ckptkit async", "ckptkit process")


def build_model(dim: int, layers: int, vocab: int) -> Any:
    """torchtitan's llama3 recipe (its own layer builder) at the given size."""
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.llama3 import _build_llama3_layers, compute_ffn_hidden_dim, model_registry

    cfg = model_registry("debugmodel").model
    n_heads = 16
    cfg.dim = dim
    cfg.vocab_size = vocab
    cfg.tok_embeddings.num_embeddings, cfg.tok_embeddings.embedding_dim = vocab, dim
    cfg.norm.normalized_shape = dim
    cfg.lm_head.in_features, cfg.lm_head.out_features = dim, vocab
    cfg.layers = _build_llama3_layers(
        n_layers=layers, dim=dim, n_heads=n_heads, n_kv_heads=n_heads // 2,
        hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=256),
        rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=4096, theta=500000, scaling="llama"),
        attn_backend="flex")
    return cfg.build()


def make_manager(kind: str, folder: str, model: Any, optimizers: Any, schedulers: Any) -> Any:
    from torchtitan.components.checkpoint import CheckpointManager

    kwargs = dict(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
                  states={}, sd_adapter=None, base_folder=folder)
    if kind.startswith("titan"):
        mode = {"titan sync": "disabled", "titan async": "async", "titan pinned": "async_with_pinned_mem"}[kind]
        cfg = CheckpointManager.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=2, async_mode=mode,
                                       last_save_model_only=False)
        return cfg.build(**kwargs)
    from ckptkit.adapters.torchtitan import CkptkitCheckpointManager

    mode = {"ckptkit async": "async", "ckptkit process": "async_process"}[kind]
    cfg = CkptkitCheckpointManager.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=2, async_mode=mode,
                                          last_save_model_only=False)
    return cfg.build(**kwargs)


def timed_saves(kind: str, mgr: Any, reps: int, first_step: int) -> list[tuple[float, float]]:
    import torch.distributed as dist

    out = []
    for i in range(reps + 1):  # the first is a warm-up
        dist.barrier()
        t0 = time.perf_counter()
        mgr.save(first_step + i)
        mgr.maybe_wait_for_staging()
        t_block = time.perf_counter() - t0
        mgr.maybe_wait_for_saving()
        t_total = time.perf_counter() - t0
        worst = [None] * dist.get_world_size()
        dist.all_gather_object(worst, (t_block, t_total))
        if i:
            out.append((max(w[0] for w in worst), max(w[1] for w in worst)))
    return out


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer import default_adamw

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dim, layers, vocab = (256, 2, 2048) if args.quick else (1024, 8, 32000)
    torch.manual_seed(0)
    model = build_model(dim, layers, vocab)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers.values() if hasattr(model.layers, "values") else model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt_config = default_adamw(lr=1e-4)
    opt_config.implementation = "for-loop"  # "fused" (the default) is a CUDA kernel
    optimizers = opt_config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=100)
    # one optimizer step with synthetic gradients creates the AdamW moments (FlexAttention,
    # the llama3 recipe's attention, has no CPU backward; the checkpoint content is what counts)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizers.step()
    optimizers.zero_grad()
    n_params = sum(p.numel() for p in model.parameters())
    state_bytes = n_params * 4 * 3  # fp32 weights + two fp32 moments
    results: dict[str, Any] = {}
    scratch = tempfile.mkdtemp(prefix="bench_torchtitan-scratch-", dir=args.out) if rank == 0 else None
    box = [scratch]
    dist.broadcast_object_list(box)
    scratch = box[0]
    try:
        for kind in args.managers:
            folder = os.path.join(scratch, kind.replace(" ", "-"))
            try:
                mgr = make_manager(kind, folder, model, optimizers, schedulers)
                times = timed_saves(kind, mgr, args.reps, first_step=10)
                mgr.close()
                results[kind] = {"blocks": [t[0] for t in times], "total": [t[1] for t in times]}
            except Exception as exc:  # noqa: BLE001 - a mode that does not run here is reported, not fatal
                results[kind] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
                if rank == 0 and args.verbose:
                    traceback.print_exc()
            dist.barrier()
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)
    if rank == 0:
        report(args, world, n_params, state_bytes, results)
    dist.destroy_process_group()
    return 0


def report(args: argparse.Namespace, world: int, n_params: int, state_bytes: int, results: dict[str, Any]) -> None:
    base = results.get("titan async", {})
    base_block = median(base["blocks"]) if "blocks" in base else None
    rows = []
    for kind, r in results.items():
        if "error" in r:
            rows.append([kind, "-", "-", "-", "-", f"did not run: {r['error']}"])
            continue
        b, t = median(r["blocks"]), median(r["total"])
        rows.append([kind, f"{b:.3f}", f"{100 * spread(r['blocks']):.0f}%", f"{t:.3f}",
                     f"{b / base_block:.2f}x" if base_block else "-", ""])
    print(f"bench_torchtitan: llama3 recipe, {n_params / 1e6:.1f}M params, {state_bytes / GiB:.2f} GiB of fp32 "
          f"weights + AdamW moments, FSDP2 over {world} ranks, median of {args.reps} saves after a warm-up")
    print(table(["manager", "blocks s", "spread", "total s", "blocks vs titan async", "note"], rows))
    if args.out:
        write_results(args.out, "bench_torchtitan", {"world": world, "params": n_params, "state_bytes": state_bytes,
                                                      "reps": args.reps, "quick": args.quick, "results": results})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small model (smoke test)")
    ap.add_argument("--out", default=None, help="results JSON (and scratch) directory")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--managers", nargs="+", default=list(MANAGERS), choices=MANAGERS)
    ap.add_argument("--verbose", action="store_true", help="print the traceback of a manager that fails")
    args = ap.parse_args(argv)
    if args.out:
        args.out = os.path.abspath(args.out)
        os.makedirs(args.out, exist_ok=True)
    if "RANK" not in os.environ:  # launch ourselves under torchrun
        cmd = [*torchrun_command(), "--standalone", f"--nproc_per_node={args.nproc}", os.path.abspath(__file__),
               *(argv if argv is not None else sys.argv[1:])]
        return subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
