"""torchtitan checkpointing on ckptkit, and a resume at another parallel layout — runnable on CPU.

    python examples/torchtitan_ckptkit.py             # both phases below, each under torchrun (about 1 minute)

    torchrun --nproc_per_node=4 examples/torchtitan_ckptkit.py --layout fsdp4 --stop 6   # FSDP2, 4 ranks
    torchrun --nproc_per_node=2 examples/torchtitan_ckptkit.py --layout tp2              # resumes at TP 2

The wiring, in a torchtitan job, is the checkpoint config (torchtitan's
Trainer builds whatever ``config.checkpoint`` names)::

    from ckptkit.adapters.torchtitan import CkptkitCheckpointManager
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    def llama3_debugmodel_ckptkit():                 # in your module; run with
        config = llama3_debugmodel()                 #   torchrun ... -m torchtitan.train \\
        config.checkpoint = CkptkitCheckpointManager.Config(   #   --module mymodule --config llama3_debugmodel_ckptkit
            enable=True, folder="checkpoint", interval=500, keep_latest_k=3,
            async_mode="async", last_save_model_only=False)
        return config

torchtitan's Trainer does not run on CPU without patches (docs/torchtitan.md),
so this script builds what the Trainer builds — torchtitan's llama3 debug
model (2 layers) parallelized by torchtitan's ``parallelize_llama``, its
optimizer and LR-scheduler containers, its ``ParallelAwareDataloader`` — and
then the checkpointer exactly as ``Trainer.__init__`` does
(``config.checkpoint.build(dataloader=..., model_parts=..., ...)``), and runs
``Trainer.train``'s loop: ``load``, step, ``save``. The second phase finds the
newest checkpoint, reshards the model and optimizer from FSDP2 x 4 to TP x 2,
and remaps the data loader from 4 DP ranks to 1: it continues with the very
samples the 4-rank job would have drawn next.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from typing import Any

LAYOUTS = {"fsdp4": (4, 1), "fsdp2_tp2": (2, 2), "tp2": (1, 2), "single": (1, 1)}
SEQ, GLOBAL_BATCH, VOCAB, N_SAMPLES = 32, 8, 2048, 256


def cpu_shims() -> None:
    """CPU only: torchtitan 0.3.0 assumes an accelerator (the same shims as tests/torchtitan_job.py)."""
    from torchtitan.distributed import parallel_dims

    parallel_dims.device_type = "cpu"  # else init_device_mesh calls torch.cuda.set_device


def build(layout: str, folder: str, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torchtitan.distributed.utils as dist_utils
    from torch.distributed.fsdp import FSDPModule
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    from ckptkit.adapters.torchtitan import CkptkitCheckpointManager

    dp, tp = LAYOUTS[layout]
    dist_utils.set_spmd_backend("partial_dtensor")
    spec = model_registry("debugmodel")
    cfg = spec.model
    cfg.layers = cfg.layers[:2]
    for layer in cfg.layers:  # CPU: FlexAttention has no backward on CPU; each sample is one document
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    parallelism = ParallelismConfig(data_parallel_shard_degree=dp, tensor_parallel_degree=tp, spmd_backend="partial_dtensor")
    training = TrainingConfig(local_batch_size=GLOBAL_BATCH // dp, seq_len=SEQ, steps=steps, mixed_precision_param="float32")
    holder = argparse.Namespace(parallelism=parallelism, training=training)
    cfg.update_from_config(config=holder)
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1,
                                 world_size=dist.get_world_size(), spmd_backend="partial_dtensor")
    with torch.device("meta"):
        model = cfg.build()
    model = spec.parallelize_fn(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                                compile_config=CompileConfig(), ac_config=None, dump_folder="")
    for m in model.modules():  # gloo has no PREMUL_SUM; torchtitan's divide factor 1.0 makes it a plain SUM
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    optimizer_config = default_adamw(lr=1e-3)
    optimizer_config.implementation = "foreach"
    optimizers = optimizer_config.build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=steps)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return N_SAMPLES

        def __getitem__(self, i: int):
            t = torch.randint(0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(i))
            return {"input": t[:-1], "sample": i}, t[1:]

    dp_rank = parallel_dims.get_mesh("batch").get_local_rank() if parallel_dims.dp_enabled else 0
    data = Tokens()
    dataloader = ParallelAwareDataloader(
        data, dp_rank=dp_rank, dp_world_size=dp, batch_size=GLOBAL_BATCH // dp,
        sampler=StatefulDistributedSampler(data, num_replicas=dp, rank=dp_rank, shuffle=True, seed=0))

    class TrainState:  # what the Trainer passes as states={"train_state": self}
        step = 0

        def state_dict(self) -> dict[str, Any]:
            return {"step": self.step}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.step = sd["step"]

    # --- the ckptkit part: a config, built the way torchtitan's Trainer builds config.checkpoint ---
    checkpoint = CkptkitCheckpointManager.Config(enable=True, folder=folder, interval=2, keep_latest_k=2,
                                                 async_mode="async", last_save_model_only=False)
    train_state = TrainState()
    checkpointer = checkpoint.build(dataloader=dataloader, model_parts=[model], optimizers=optimizers,
                                    lr_schedulers=lr_schedulers, states={"train_state": train_state},
                                    sd_adapter=None, base_folder="")
    return dict(model=model, optimizers=optimizers, lr_schedulers=lr_schedulers, dataloader=dataloader,
                train_state=train_state, checkpointer=checkpointer, dp=dp, tp=tp)


def train(layout: str, folder: str, steps: int, stop: int) -> None:
    import torch
    import torch.distributed as dist
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.components.loss import cross_entropy_loss

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cpu_shims()
    if dist.get_rank() == 0:  # ckptkit says what it loaded and how it remapped the data loader
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[ckptkit] %(message)s"))
        logging.getLogger("ckptkit").addHandler(handler)
        logging.getLogger("ckptkit").setLevel(logging.INFO)
    job = build(layout, folder, steps)
    rank = dist.get_rank()
    checkpointer, state = job["checkpointer"], job["train_state"]
    checkpointer.load(step=-1)  # Trainer.train(): newest checkpoint, resharded to this layout
    if rank == 0:
        print(f"[{layout}] starting after step {state.step}", flush=True)
    batches = iter(job["dataloader"])
    while state.step < min(steps, stop):
        state.step += 1
        job["optimizers"].zero_grad()
        inputs, labels = next(batches)
        samples = inputs.pop("sample")
        loss = cross_entropy_loss(job["model"](inputs["input"]), labels) / (labels.numel() * job["dp"])
        loss.backward()
        dist_utils.clip_grad_norm_(list(job["model"].parameters()), 1.0, foreach=True)
        checkpointer.maybe_wait_for_staging()
        job["optimizers"].step()
        job["lr_schedulers"].step()
        total, ids = loss.detach().clone(), [torch.zeros_like(samples) for _ in range(dist.get_world_size())]
        dist.all_reduce(total)
        dist.all_gather(ids, samples)
        checkpointer.save(state.step, last_step=state.step == steps)  # async: blocks only for the snapshot
        if rank == 0:
            seen = sorted({int(i) for t in ids for i in t.tolist()})
            print(f"[{layout}] step {state.step}: loss {total.item() / job['tp']:.5f}  samples {seen}", flush=True)
    checkpointer.close()
    dist.destroy_process_group()


def demo(folder: str) -> None:
    """Both phases, each under torchrun: save at FSDP2 x 4, resume at TP x 2."""
    here = os.path.abspath(__file__)
    for layout, procs, stop in (("fsdp4", 4, 6), ("tp2", 2, 10)):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", here,
               "--layout", layout, "--stop", str(stop), "--folder", folder]
        print("$", " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True)
    names = sorted((n for n in os.listdir(folder) if n.startswith("step-")), key=lambda n: int(n[5:]) if n[5:].isdigit() else -1)
    print(f"checkpoints: {names} under {folder}")  # torchtitan's names: step-8, step-10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS))
    parser.add_argument("--steps", type=int, default=10, help="training steps of the whole run")
    parser.add_argument("--stop", type=int, default=10**9, help="stop after this step (to resume later)")
    parser.add_argument("--folder", default="runs/torchtitan_ckptkit/checkpoint")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        if os.path.exists(args.folder) and os.listdir(args.folder):
            sys.exit(f"{args.folder} is not empty: remove it or pass --folder (ckptkit never overwrites a checkpoint)")
        demo(args.folder)
    elif args.layout is None:
        parser.error("--layout is required under torchrun")
    else:
        train(args.layout, args.folder, args.steps, args.stop)


if __name__ == "__main__":
    main()
