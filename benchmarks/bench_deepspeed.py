"""DeepSpeed ZeRO-2 checkpointing: ckptkit's adapter vs ``engine.save_checkpoint``, and DP resizing.

Part 1 (``torchrun`` with 4 ranks, gloo, CPU): a ZeRO-2 engine (fp32, torch
AdamW) over an MLP sized so the checkpointed state (weights, fp32 masters,
two Adam moments) is >= 1 GiB, one optimizer step so the moments exist, then
alternately (one warm-up each, then ``--reps`` timed saves; the slowest rank
between barriers):

  deepspeed save     engine.save_checkpoint(dir, tag)   [baseline]  blocks = until it returns,
                     total = then each rank fsyncs the files it wrote (torch.save does not; without
                     it the bytes may still be in the page cache)
  ckptkit async      ckptkit.adapters.deepspeed.save(engine, path, asynchronous=True)
                     blocks = until it returns (snapshot taken), total = until committed
                     (every data object fsynced, manifest published)

Part 2 (DP 4 -> DP 2): the last checkpoints of part 1 loaded by a 2-rank job:

  deepspeed universal  python -m deepspeed.checkpoint.ds_to_universal (a subprocess, timed
                       from the launcher: the offline step a user runs) + engine.load_checkpoint
                       with "checkpoint": {"load_universal": true}  [baseline]
  ckptkit direct       ckptkit.adapters.deepspeed.load(engine, path): no conversion

Both loaded models' losses on one batch are printed (they must agree).
Run: python benchmarks/bench_deepspeed.py [--quick] [--out DIR] [--reps N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

from common import GiB, median, spread, table, torchrun_command, write_results  # noqa: E402

TAG = "global_step1"


def setup_deepspeed() -> Any:
    """DeepSpeed on CPU/gloo without JIT-compiled ops (the shm comm op is not needed over gloo)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import deepspeed.comm.torch  # loaded before it is patched below

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def mlp(width: int, depth: int) -> Any:
    """``depth`` square linears of ``width`` with GELUs between: the benchmarks' DeepSpeed model (seeded)."""
    import torch

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def build_engine(args: argparse.Namespace, *, universal: bool = False) -> Any:
    import torch

    deepspeed = setup_deepspeed()
    width, depth = (512, 4) if args.quick else (3072, 8)
    model = mlp(width, depth)
    world = torch.distributed.get_world_size()
    cfg: dict[str, Any] = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8 // world,
                           "zero_optimization": {"stage": 2}, "steps_per_print": 10 ** 9}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters(),
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))
    return engine, width


def batch_loss(engine: Any, width: int, train: bool) -> float:
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, width, generator=g)
    per = 8 // dist.get_world_size()
    mine = x[dist.get_rank() * per:(dist.get_rank() + 1) * per]
    if train:
        loss = engine(mine).pow(2).mean()
        engine.backward(loss)
        engine.step()
        return loss.item()
    with torch.no_grad():
        return engine(x).pow(2).mean().item()


def slowest(t: float) -> float:
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, t)
    return max(out)  # type: ignore[type-var]


def fsync_own_files(folder: str, rank: int) -> None:
    """fsync the files this rank wrote in a native checkpoint (its optimizer file; rank 0 the rest)."""
    for name in os.listdir(folder):
        if f"zero_pp_rank_{rank}_" in name or (rank == 0 and "zero_pp_rank_" not in name):
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def save_phase(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from ckptkit.adapters import deepspeed as ds_ckpt

    warnings.filterwarnings("ignore")
    engine, width = build_engine(args)
    batch_loss(engine, width, train=True)
    n = sum(p.numel() for p in engine.module.parameters())
    state_bytes = n * 4 * 4  # fp32 module weights + fp32 masters + exp_avg + exp_avg_sq
    rank = dist.get_rank()
    res: dict[str, Any] = {"deepspeed save": {"blocks": [], "total": []}, "ckptkit async": {"blocks": [], "total": []}}
    for i in range(args.reps + 1):
        for kind in res:
            folder = os.path.join(args.scratch, "native" if kind == "deepspeed save" else f"ckptkit-{i}")
            if kind == "deepspeed save" and rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
            dist.barrier()
            t0 = time.perf_counter()
            if kind == "deepspeed save":
                engine.save_checkpoint(folder, tag=TAG)
                blocks = time.perf_counter() - t0
                fsync_own_files(os.path.join(folder, TAG), rank)  # torch.save does not fsync; ckptkit does
                total = time.perf_counter() - t0
            else:
                handle = ds_ckpt.save(engine, folder, asynchronous=True)
                blocks = time.perf_counter() - t0
                handle.committed.result()
                total = time.perf_counter() - t0
            blocks, total = slowest(blocks), slowest(total)
            if i:
                res[kind]["blocks"].append(blocks)
                res[kind]["total"].append(total)
        if i and i < args.reps and rank == 0:  # keep the last ckptkit checkpoint for the resize phase
            shutil.rmtree(os.path.join(args.scratch, f"ckptkit-{i}"), ignore_errors=True)
    from ckptkit.api import close_async

    close_async()
    if rank == 0:
        shutil.rmtree(os.path.join(args.scratch, "ckptkit-0"), ignore_errors=True)
        with open(os.path.join(args.scratch, "save.json"), "w") as f:
            json.dump({"params": n, "state_bytes": state_bytes, "world": dist.get_world_size(), "results": res,
                       "ckptkit_path": os.path.join(args.scratch, f"ckptkit-{args.reps}"),
                       "eval": batch_loss(engine, width, train=False)}, f)
    else:
        batch_loss(engine, width, train=False)  # the eval forward is collective for ZeRO-3; keep ranks together


def resize_phase(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from ckptkit.adapters import deepspeed as ds_ckpt

    warnings.filterwarnings("ignore")
    with open(os.path.join(args.scratch, "save.json")) as f:
        saved = json.load(f)
    out: dict[str, Any] = {}
    engine, width = build_engine(args)
    dist.barrier()
    t0 = time.perf_counter()
    ds_ckpt.load(engine, saved["ckptkit_path"])
    out["ckptkit direct"] = {"load": slowest(time.perf_counter() - t0), "eval": batch_loss(engine, width, False)}
    del engine
    engine, width = build_engine(args, universal=True)
    dist.barrier()
    t0 = time.perf_counter()
    engine.load_checkpoint(os.path.join(args.scratch, "native"), tag=f"{TAG}_universal")
    out["deepspeed universal"] = {"load": slowest(time.perf_counter() - t0), "eval": batch_loss(engine, width, False)}
    if dist.get_rank() == 0:
        with open(os.path.join(args.scratch, "resize.json"), "w") as f:
            json.dump({"world": dist.get_world_size(), "results": out}, f)


def launcher(args: argparse.Namespace, argv: list[str]) -> int:
    scratch = tempfile.mkdtemp(prefix="bench_deepspeed-scratch-", dir=args.out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    me = os.path.abspath(__file__)
    try:
        rc = subprocess.call([*torchrun_command(), "--standalone", f"--nproc_per_node={args.nproc}", me, *argv,
                              "--phase", "save", "--scratch", scratch], env=env)
        if rc:
            return rc
        native = os.path.join(scratch, "native")
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                              "--input_folder", os.path.join(native, TAG),
                              "--output_folder", os.path.join(native, f"{TAG}_universal"),
                              "--inject_missing_state"], env=env, stdout=subprocess.DEVNULL)
        convert = time.perf_counter() - t0
        if rc:
            print(f"bench_deepspeed: ds_to_universal failed with exit status {rc}")
            return rc
        rc = subprocess.call([*torchrun_command(), "--standalone", f"--nproc_per_node={args.nproc // 2}", me, *argv,
                              "--phase", "resize", "--scratch", scratch], env=env)
        if rc:
            return rc
        with open(os.path.join(scratch, "save.json")) as f:
            saved = json.load(f)
        with open(os.path.join(scratch, "resize.json")) as f:
            resized = json.load(f)
        report(args, saved, resized, convert)
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []:
            if name.startswith("deepspeed_allreduce_buffer_"):  # left behind by DeepSpeed's shm comm
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                except OSError:
                    pass


def report(args: argparse.Namespace, saved: dict[str, Any], resized: dict[str, Any], convert: float) -> None:
    res = saved["results"]
    base = median(res["deepspeed save"]["blocks"])
    base_total = median(res["deepspeed save"]["total"])
    rows = []
    for kind, r in res.items():
        b, t = median(r["blocks"]), median(r["total"])
        rows.append([kind, f"{b:.3f}", f"{100 * spread(r['blocks']):.0f}%", f"{t:.3f}", f"{b / base:.2f}x",
                     f"{t / base_total:.2f}x"])
    print(f"bench_deepspeed: ZeRO-2 fp32, {saved['params'] / 1e6:.1f}M params, {saved['state_bytes'] / GiB:.2f} GiB "
          f"(weights + fp32 masters + 2 Adam moments), DP {saved['world']}, median of {args.reps} saves after a warm-up")
    print(table(["save", "blocks s", "spread", "total s", "blocks vs ds save", "total vs ds save+fsync"], rows))
    rz = resized["results"]
    ds_total = convert + rz["deepspeed universal"]["load"]
    ck = rz["ckptkit direct"]["load"]
    print(f"\nresize DP {saved['world']} -> DP {resized['world']} (loss after loading: saved {saved['eval']:.9g}, "
          f"ckptkit {rz['ckptkit direct']['eval']:.9g}, universal {rz['deepspeed universal']['eval']:.9g})")
    print(table(["path", "convert s", "load s", "total s", "vs deepspeed"], [
        ["deepspeed: ds_to_universal + universal load [baseline]", f"{convert:.3f}",
         f"{rz['deepspeed universal']['load']:.3f}", f"{ds_total:.3f}", "1.00x"],
        ["ckptkit: direct load at the new DP size", "-", f"{ck:.3f}", f"{ck:.3f}", f"{ck / ds_total:.2f}x"],
    ]))
    if args.out:
        write_results(args.out, "bench_deepspeed", {"reps": args.reps, "quick": args.quick, "save": saved,
                                                     "resize": resized, "ds_to_universal_s": convert})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small model (smoke test)")
    ap.add_argument("--out", default=None, help="results JSON (and scratch) directory")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=4, help="saving DP size (the resize loads at half of it)")
    ap.add_argument("--phase", choices=("save", "resize"), help=argparse.SUPPRESS)
    ap.add_argument("--scratch", help=argparse.SUPPRESS)
    argv = list(argv if argv is not None else sys.argv[1:])
    args = ap.parse_args(argv)
    if args.out:
        args.out = os.path.abspath(args.out)
        os.makedirs(args.out, exist_ok=True)
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        print("bench_deepspeed: deepspeed is not installed (pip install 'ckptkit[deepspeed]'); skipped")
        return 0
    if args.phase == "save":
        save_phase(args)
        return 0
    if args.phase == "resize":
        resize_phase(args)
        return 0
    return launcher(args, argv)


if __name__ == "__main__":
    sys.exit(main())
