"""The ckptkit demo: train with FSDP2 on 4 ranks, checkpoint, resume with TP on 2 ranks.

    make demo          (or: .venv/bin/python examples/demo.py)

1. torchrun, 4 processes, FSDP2 (every parameter and Adam moment is
   Shard(0) over 4 ranks): train a tiny GPT for 20 steps, save with ckptkit.
2. torchrun, 2 processes, tensor parallelism (column/row-wise Shard(0) /
   Shard(1), replicated norms): load the same checkpoint in place — the
   reshard happens at load time — and continue training.
3. Check: the loss on a fixed evaluation batch right after loading equals the
   loss right before saving.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def torchrun(nproc: int, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
           os.path.join(HERE, "tiny_gpt.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)


def main() -> int:
    run_dir = os.path.join(ROOT, "runs", "demo")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    ckpt = os.path.join(run_dir, "step-0000020")
    before, after = os.path.join(run_dir, "before.json"), os.path.join(run_dir, "after.json")
    print("== 1. train 20 steps with FSDP2 on 4 ranks, save with ckptkit ==", flush=True)
    torchrun(4, "train", "--ckpt", ckpt, "--layout", "fsdp", "--report", before)
    print("\n== 2. resume the same checkpoint with tensor parallelism on 2 ranks ==", flush=True)
    torchrun(2, "resume", "--ckpt", ckpt, "--layout", "tp", "--report", after)
    with open(before) as f:
        loss_before = json.load(f)["eval_loss"]
    with open(after) as f:
        loss_after = json.load(f)["eval_loss"]
    diff = abs(loss_after - loss_before)
    ok = diff <= 1e-5 * max(1.0, abs(loss_before))
    print("\n== 3. check ==")
    print(f"eval loss before save (FSDP2 x4): {loss_before:.6f}")
    print(f"eval loss after load  (TP x2):    {loss_after:.6f}")
    print(f"difference {diff:.2e} (tensor parallelism only changes the reduction order): {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
