"""The ckptkit demo: a small training run that checkpoints asynchronously, survives a loss spike
and a crash without a human, reshards to another layout, and reports what happened.

    make demo          (or: .venv/bin/python examples/demo.py)

1. torchrun, 4 processes, FSDP2 (parameters and Adam moments Shard(0) over 4
   ranks), ``--max-restarts=1``: a tiny GPT trains for 70 steps with
   asynchronous checkpoints every 10 steps. Samples 320-368 of the data stream
   are poisoned: the loss spikes, the controller skips the optimizer steps,
   rolls back to a checkpoint before the spike, skips that data range and
   re-warms the learning rate. At step 57 rank 1 is killed with SIGKILL:
   torchrun restarts the job, which resumes from the newest valid checkpoint.
2. torchrun, 2 processes, tensor parallelism: the final checkpoint is loaded
   in place at a different layout; the evaluation loss equals the one the
   FSDP2 run ended with.
3. ``ckptkit report``: the incident log, and a PNG of the loss curve titled
   with the run's name, with the spike, the rollback, the restart and the
   steps the crash lost marked.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def torchrun(nproc: int, *args: str, restarts: int = 0) -> None:
    # --standalone: torchrun's store binds a port the system picks at that moment, so no other process can
    # take it first (a port picked here and bound by torchrun a moment later could be).
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--max-restarts={restarts}",
           "--standalone", os.path.join(HERE, "tiny_gpt.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "LOGLEVEL": "ERROR"}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout.splitlines():  # our own lines; torchrun's restart chatter summarised below
        if line.startswith("[") and not line.startswith("[rank") and "torch" not in line:
            print("   " + line)
    if "rank 1 crashes" in proc.stdout:
        print("   [torchrun] rank 1 died (SIGKILL); torchrun restarted the job (attempt 1)")
    if proc.returncode:
        print(proc.stdout[-4000:])
        raise SystemExit(f"torchrun failed with exit code {proc.returncode}")


def main() -> int:
    run = os.path.join(ROOT, "runs", "demo")
    shutil.rmtree(run, ignore_errors=True)
    os.makedirs(run)
    before, after = os.path.join(run, "train.json"), os.path.join(run, "resume.json")
    print("== 1. FSDP2 on 4 ranks: async checkpoints, a poisoned data range, a crash at step 57 ==", flush=True)
    torchrun(4, "train", "--run-dir", run, "--layout", "fsdp", "--steps", "70", "--poison", "320-368",
             "--crash-at", "57", "--report", before, restarts=1)
    print("\n== 2. the same checkpoint, loaded with tensor parallelism on 2 ranks ==", flush=True)
    torchrun(2, "resume", "--run-dir", run, "--layout", "tp", "--report", after)
    print("\n== 3. what happened (ckptkit report) ==", flush=True)
    png = os.path.join(run, "loss.png")
    subprocess.run([sys.executable, "-m", "ckptkit.cli.main", "report", os.path.join(run, "ckpt"), "--plot", png],
                   cwd=ROOT, check=True, env={**os.environ, "COLUMNS": "140"})
    subprocess.run([sys.executable, "-m", "ckptkit.cli.main", "ls", os.path.join(run, "ckpt")], cwd=ROOT, check=True,
                   env={**os.environ, "COLUMNS": "140"})
    with open(before) as f:
        loss_before = json.load(f)["eval_loss"]
    with open(after) as f:
        loss_after = json.load(f)["eval_loss"]
    from ckptkit.resilience.report import crash_spans, load_report

    report = load_report(os.path.join(run, "ckpt"))
    kinds = report.summary()
    lost = crash_spans(report)
    checks = {
        "loss spike detected, optimizer steps skipped": kinds.get("skip_step", 0) > 0,
        "rolled back and skipped the poisoned data": kinds.get("rollback", 0) > 0,
        "crash survived: resumed after a torchrun restart": kinds.get("restart", 0) > 0,
        f"report titled {report.title!r}, the steps the crash lost shaded "
        f"({', '.join(f'{a}-{b}' for a, b, _ in lost) or 'none'})": report.title == "demo" and bool(lost),
        f"resharded FSDP2 x4 -> TP x2 with the same eval loss ({loss_before:.6f} vs {loss_after:.6f})":
            abs(loss_after - loss_before) <= 1e-5 * max(1.0, abs(loss_before)),
    }
    print("\n== checks ==")
    for what, ok in checks.items():
        print(f"{'OK  ' if ok else 'FAIL'} {what}")
    print(f"loss curve: {png}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
