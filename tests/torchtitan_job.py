"""Rank-side functions of tests/test_torchtitan.py, run in real gloo worlds (tests/worlds.py).

The model is torchtitan's llama3 debug model (dim 256, 16 heads, vocab 2048),
cut to 2 layers for CPU speed, built by torchtitan's own ``model_registry``
and parallelized by torchtitan's own ``parallelize_llama`` (FSDP2
``fully_shard`` over the ``fsdp`` mesh, tensor parallelism through the model's
sharding config on the ``tp`` mesh), with torchtitan's ``OptimizersContainer``
(AdamW), ``LRSchedulersContainer`` (warm-up + linear decay), its vocab-parallel
``cross_entropy_loss`` and ``clip_grad_norm_``. The training step mirrors
``Trainer.train_step`` for the non-pipelined path: sum loss divided by the
global token count, FSDP's own gradient division disabled (torchtitan's
choice). The data loader is torchtitan's ``ParallelAwareDataloader`` over a
deterministic map-style dataset with torchdata's ``StatefulDistributedSampler``
(no downloads; every sample carries its id so the test can check exactly which
samples each step consumed).

CPU shims, test-only (torchtitan 0.3.0 assumes an accelerator; see docs/torchtitan.md):

1. ``torchtitan.distributed.parallel_dims.device_type = "cpu"``: torchtitan picks
   ``"cuda"`` when no accelerator is present and ``init_device_mesh`` then
   calls ``torch.cuda.set_device``.
2. Inner attention ``ScaledDotProductAttention`` (causal) instead of
   FlexAttention: FlexAttention has no backward on CPU in torch 2.13. Every
   sample here is one document, so causal SDPA is the attention
   block-causal flex would compute.
3. ``FSDPModule.set_force_sum_reduction_for_comms(True)``: with torchtitan's
   gradient-divide factor 1.0, FSDP2 reduce-scatters with
   ``ReduceOp.PREMUL_SUM(1.0)``, which gloo lacks; a plain SUM is the same
   reduction.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torchtitan.distributed.parallel_dims as _parallel_dims
import torchtitan.distributed.utils as dist_utils
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FSDPModule
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtitan.components.checkpointer.base import ModelWrapper
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry

from ckptkit.adapters.torchtitan import CkptkitCheckpointManager
from tests.token_samples import TokenSamples
from ckptkit.errors import SaveError

_parallel_dims.device_type = "cpu"  # shim 1

LAYOUTS = {"fsdp4": (4, 1), "fsdp2_tp2": (2, 2), "fsdp2": (2, 1), "tp2": (1, 2), "single": (1, 1), "hsdp2x2": (2, 1)}
"""layout name -> (dp_shard, tp); a layout in :data:`REPLICATE` also replicates that many times (HSDP)."""
REPLICATE = {"hsdp2x2": 2}
"""HSDP layouts -> dp_replicate: torchtitan's ``fully_shard`` over the (``dp_replicate``, ``fsdp``) mesh, each
replica group a full FSDP copy; the DP degree (the ``batch`` mesh, the data loader's) is replicate x shard."""


def world_size(layout: str) -> int:
    dp, tp = LAYOUTS[layout]
    return REPLICATE.get(layout, 1) * dp * tp
N_LAYERS = 2
SEQ = 32
GLOBAL_BATCH = 8
N_SAMPLES = 96
VOCAB = 2048
STEPS = 6


class TrainState(Stateful):
    """What torchtitan's Trainer checkpoints as ``train_state``."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


class Job:
    """Model, optimizer, scheduler, data loader and the ckptkit checkpointer, as torchtitan's Trainer wires them."""

    def __init__(self, layout: str, checkpoint: CkptkitCheckpointManager.Config, *, seed: int = 0,
                 frozen: tuple[str, ...] = ()) -> None:
        self.frozen = frozen
        dp, tp = LAYOUTS[layout]
        spec = model_registry("debugmodel")
        cfg = spec.model
        cfg.layers = cfg.layers[:N_LAYERS]
        for layer in cfg.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()  # shim 2
        self.build(cfg, spec.parallelize_fn, checkpoint, dp=dp, tp=tp, ep=1, seed=seed,
                   replicate=REPLICATE.get(layout, 1))

    def build(self, cfg: Any, parallelize: Any, checkpoint: CkptkitCheckpointManager.Config, *, dp: int, tp: int,
              ep: int, seed: int, replicate: int = 1) -> None:
        """Parallelize ``cfg``'s model with torchtitan's ``parallelize`` function at FSDP ``dp`` x TP ``tp``
        (expert parallel ``ep`` carved out of them; ``replicate`` > 1: HSDP, that many FSDP replicas), then
        optimizer, LR schedule, data loader, train state and the checkpointer, in the order torchtitan's
        Trainer builds them. ``self.dp`` is the DP degree (replicate x shard)."""
        self.dp, self.tp, self.ep = replicate * dp, tp, ep
        world = dist.get_world_size()
        dist_utils.set_spmd_backend("partial_dtensor")
        parallelism = ParallelismConfig(data_parallel_replicate_degree=replicate, data_parallel_shard_degree=dp,
                                        tensor_parallel_degree=tp, expert_parallel_degree=ep,
                                        spmd_backend="partial_dtensor")
        training = TrainingConfig(local_batch_size=GLOBAL_BATCH // self.dp, seq_len=SEQ, steps=STEPS,
                                  mixed_precision_param="float32")

        class _Cfg:  # update_from_config takes any object with these two fields
            pass

        holder = _Cfg()
        holder.parallelism, holder.training = parallelism, training  # type: ignore[attr-defined]
        cfg.update_from_config(config=holder)
        self.parallel_dims = ParallelDims(dp_replicate=replicate, dp_shard=dp, cp=1, tp=tp, pp=1, ep=ep,
                                          world_size=world, spmd_backend="partial_dtensor")
        with torch.device("meta"):
            model = cfg.build()
        model = parallelize(model, parallel_dims=self.parallel_dims, training=training, parallelism=parallelism,
                            compile_config=CompileConfig(), ac_config=None, dump_folder="")
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)  # shim 3
        if replicate > 1:  # HSDP indeed: parameters replicated over the first mesh dimension, sharded over the second
            p = next(model.parameters())
            assert p.device_mesh.ndim >= 2 and p.placements[0].is_replicate() and p.placements[1].is_shard(), \
                (p.device_mesh, p.placements)
        model.to_empty(device="cpu")
        torch.manual_seed(seed)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        for name, param in model.named_parameters():  # frozen (fine-tuning): no gradient, no optimizer state
            if name in getattr(self, "frozen", ()):
                param.requires_grad_(False)
        self.model = model
        optimizer = default_adamw(lr=1e-3)
        optimizer.implementation = "foreach"  # "fused" is the CUDA default
        self.optimizers = optimizer.build(model_parts=[model])
        self.after_optimizers()
        self.lr_schedulers = LRSchedulersContainer.Config(
            warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0,
        ).build(optimizers=self.optimizers, training_steps=STEPS)
        if self.parallel_dims.dp_enabled:
            batch = self.parallel_dims.get_mesh("batch")
            dp_rank = batch.get_local_rank()
        else:
            dp_rank = 0
        data = TokenSamples(N_SAMPLES, SEQ, VOCAB)
        sampler = StatefulDistributedSampler(data, num_replicas=self.dp, rank=dp_rank, shuffle=True, seed=7)
        self.dataloader = ParallelAwareDataloader(data, dp_rank=dp_rank, dp_world_size=self.dp, sampler=sampler,
                                                  batch_size=GLOBAL_BATCH // self.dp)
        self.train_state = TrainState()
        self.checkpointer = checkpoint.build(
            dataloader=self.dataloader, model_parts=[self.model], optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers, states={"train_state": self.train_state}, sd_adapter=None,
            base_folder="",
        )
        self.iterator: Any = None
        self.replay: list[Any] | None = None
        """Batches to train on instead of the data loader's (the reference run replays the resumed run's)."""
        self.consumed: list[Any] = []
        """This rank's batches, in the order the steps took them."""

    def after_optimizers(self) -> None:
        """What a model family's ``post_optimizer_build_fn`` does (nothing for llama3)."""

    # --------------------------------------------------------------- training
    def train_step(self) -> tuple[float, list[int]]:
        if self.replay is not None:
            inputs, labels = self.replay.pop(0)
        else:
            if self.iterator is None:
                self.iterator = iter(self.dataloader)
            inputs, labels = next(self.iterator)
        self.consumed.append((dict(inputs), labels))
        self.optimizers.zero_grad()
        inputs = dict(inputs)
        samples = inputs.pop("sample")
        global_tokens = labels.numel() * self.dp
        pred = self.model(inputs["input"])
        loss = self.loss_sum(pred, labels) / global_tokens
        loss.backward()
        dist_utils.clip_grad_norm_([p for p in self.model.parameters()], 1.0, foreach=True,
                                   ep_enabled=self.parallel_dims.ep_enabled)
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        self.train_state.ntokens_seen += labels.numel()
        total = loss.detach().clone()
        dist.all_reduce(total)  # every TP rank of a DP group holds the same local loss
        return total.item() / self.tp, self.global_samples(samples)

    def loss_sum(self, pred: Any, labels: torch.Tensor) -> torch.Tensor:
        """The summed token loss (torchtitan's cross-entropy, reduction sum)."""
        return cross_entropy_loss(pred, labels)

    def global_samples(self, samples: torch.Tensor) -> list[int]:
        out = [torch.zeros_like(samples) for _ in range(dist.get_world_size())]
        dist.all_gather(out, samples.contiguous())
        ids = sorted({int(i) for t in out for i in t.tolist()})
        assert len(ids) == GLOBAL_BATCH, ids
        return ids

    def run(self, until: int) -> dict[str, Any]:
        """torchtitan's ``Trainer.train`` loop: step, then ``checkpointer.save``."""
        losses, samples = {}, {}
        while self.train_state.step < until:
            self.train_state.step += 1
            step = self.train_state.step
            losses[step], samples[step] = self.train_step()
            self.checkpointer.save(step, last_step=step == STEPS)
        return {"losses": losses, "samples": samples}

    @torch.no_grad()
    def eval_loss(self) -> float:
        """Mean loss of four fixed held-out samples, the same full batch on every rank."""
        rows = [torch.randint(0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(9000 + i)) for i in range(4)]
        tokens = torch.stack(rows)
        loss = self.loss_sum(self.model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
        return float(loss.item())

    def digests(self) -> dict[str, str]:
        """SHA-1 of every model and optimizer tensor in full (model space), and the optimizer's other values."""
        out = {}
        items = [("model/" + k, v) for k, v in self.model.state_dict().items()]
        items += [("optimizer/" + k, v) for k, v in self.optimizers.state_dict().items()]
        for key, value in items:
            if isinstance(value, torch.Tensor):
                full = value.full_tensor() if hasattr(value, "full_tensor") else value
                out[key] = hashlib.sha1(full.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            else:
                out[key] = repr(value)
        return out

    def state_record(self) -> dict[str, Any]:
        """What a test compares after a save or a load: held-out loss, digests, train state, LR position."""
        return {"eval": self.eval_loss(), "digests": self.digests(), "train_state": self.train_state.state_dict(),
                "last_epoch": self.lr_schedulers.state_dict()["last_epoch"]}

    def dcp_state(self) -> dict[str, Any]:
        """The state as torchtitan's own checkpointer hands it to ``torch.distributed.checkpoint``: the
        reference run's route, independent of ckptkit."""
        return {"model": ModelWrapper([self.model]), "optimizer": self.optimizers,
                "lr_scheduler": self.lr_schedulers, "train_state": self.train_state}

    def close(self) -> None:
        self.checkpointer.close()


def _config(folder: str, **kw: Any) -> CkptkitCheckpointManager.Config:
    options: dict[str, Any] = dict(interval=2, keep_latest_k=2, last_save_model_only=False, initial_load_model_only=False)
    return CkptkitCheckpointManager.Config(enable=True, folder=folder, **{**options, **kw})


def train(layout: str, folder: str, *, resume_step: int, reference: str | None = None, frozen: tuple[str, ...] = (),
          **kw: Any) -> dict[str, Any]:
    """The uninterrupted run (STEPS steps) that also checkpoints every 2 steps: per-step losses and samples,
    and the state at ``resume_step`` and at the end. ``frozen``: parameters trained with requires_grad off."""
    return train_job(Job(layout, _config(folder, **kw), frozen=frozen), resume_step=resume_step, reference=reference)


def train_job(job: Job, *, resume_step: int, reference: str | None) -> dict[str, Any]:
    """Run ``job`` to ``resume_step``, record its state (and, given ``reference``, save it there with
    torch's own DCP), then on to STEPS."""
    assert job.checkpointer.load(step=-1) is False  # fresh start
    out = job.run(resume_step)
    saved = job.state_record()
    if reference is not None:
        dcp.save(job.dcp_state(), checkpoint_id=reference)
    rest = job.run(STEPS)
    final = {k: v for k, v in job.digests().items() if k.startswith("model/")}
    job.close()
    committed = [r.name for r in job.checkpointer.manager.records() if r.committed]
    return {"losses": {**out["losses"], **rest["losses"]}, "samples": {**out["samples"], **rest["samples"]},
            "saved": saved, "final_model": final, "committed": committed}


def resume(layout: str, folder: str, *, load_step: int, reference: str | None = None, control: str | None = None,
           frozen: tuple[str, ...] = (), **kw: Any) -> dict[str, Any]:
    """Load ``load_step`` at ``layout`` (load_only: this run never saves), then train to STEPS."""
    return resume_job(lambda config, seed: Job(layout, config, seed=seed, frozen=frozen), folder, load_step=load_step,
                      reference=reference, control=control, **kw)


CONTROLS = ("perturb", "fresh_optimizer")
"""Resumes that lose state on purpose, to show the reference comparison sees it: the final norm's weight
scaled by 1.001 after the load, or the optimizer's state not loaded."""


def resume_job(make: Any, folder: str, *, load_step: int, reference: str | None, control: str | None,
               **kw: Any) -> dict[str, Any]:
    """``make(config, seed)`` builds the job. Load ``load_step`` through ckptkit, train to STEPS; given
    ``reference`` (torch's own DCP save of the same step), also run the reference: a job at this same
    layout that loads the step through ``dcp.load`` and trains on the very batches this run took. The
    two runs do the same arithmetic, so the test can demand equal bits on any machine."""
    assert control in (None, *CONTROLS), control
    if control == "fresh_optimizer":
        kw = {**kw, "exclude_from_loading": [*kw.get("exclude_from_loading", []), "optimizer"]}
    job = make(_config(folder, load_step=load_step, load_only=True, **kw), 123)
    assert job.checkpointer.load(step=load_step) is True
    if control == "perturb":
        with torch.no_grad():
            weight = dict(job.model.named_parameters())["norm.weight"]
            (weight.to_local() if hasattr(weight, "to_local") else weight).mul_(1.001)
    loaded = job.state_record()
    report = job.checkpointer.last_remap
    out = job.run(STEPS)
    job.close()
    result = {**out, "loaded": loaded, "remap": None if report is None else report.__dict__}
    if reference is not None:
        result["reference"] = reference_run(make, reference, job.consumed)
    return result


def reference_run(make: Any, reference: str, batches: list[Any]) -> dict[str, Any]:
    """A job whose checkpointer is off, loaded from ``reference`` by ``dcp.load`` (torch's resharding),
    trained on ``batches``: its held-out loss and digests after the load, and its losses."""
    job = make(CkptkitCheckpointManager.Config(enable=False), 321)
    dcp.load(job.dcp_state(), checkpoint_id=reference)
    loaded = job.state_record()
    job.replay = list(batches)
    out = job.run(STEPS)
    assert not job.replay
    return {**loaded, "losses": out["losses"]}


def load_model(layout: str, folder: str, **kw: Any) -> dict[str, Any]:
    """A fresh job at ``layout`` whose load brings back the model only: from the newest checkpoint when that
    is a final model-only one, or from ``initial_load_path`` with ``initial_load_model_only``."""
    job = Job(layout, _config(folder, **kw), seed=123)
    before = {k: v for k, v in job.digests().items() if k.startswith("optimizer/")}
    assert job.checkpointer.load(step=-1) is True
    digests = job.digests()
    job.close()
    return {"model": {k: v for k, v in digests.items() if k.startswith("model/")},
            "optimizer_untouched": before == {k: v for k, v in digests.items() if k.startswith("optimizer/")},
            "train_state": job.train_state.state_dict()}


def mixed_namings(layout: str, folder: str) -> dict[str, Any]:
    """A folder holding torchtitan-named ``step-4`` and ckptkit's earlier ``step-0000006`` (a run that
    switched naming). Resuming from 4 and training on must not save step 6 a second time; a plain
    resume takes the newest step of either naming (6), training on saves ``step-8``, and
    ``keep_latest_k=2`` counts both namings (step-4 goes); a fresh job then resumes from 8."""
    out: dict[str, Any] = {}
    job = Job(layout, _config(folder, load_step=4), seed=123)
    assert job.checkpointer.load(step=4) is True
    try:
        job.run(STEPS)
        out["clash"] = None
    except SaveError as exc:
        out["clash"] = str(exc)
    job.close()
    job = Job(layout, _config(folder), seed=123)
    assert job.checkpointer.load(step=-1) is True
    out["resumed"] = job.train_state.step
    out["resumed_model"] = {k: v for k, v in job.digests().items() if k.startswith("model/")}
    job.run(STEPS + 2)
    job.close()
    out["committed"] = [r.name for r in job.checkpointer.manager.records() if r.committed]
    job = Job(layout, _config(folder, load_only=True), seed=123)
    assert job.checkpointer.load(step=-1) is True
    out["resumed_again"] = job.train_state.step
    job.close()
    return out


def load_outcome(layout: str, folder: str, **kw: Any) -> dict[str, Any]:
    """A fresh job at ``layout`` resuming from ``folder`` (``load(step=-1)``, as torchtitan's trainer starts):
    whether it loaded, the step, its digests; or the error it raised."""
    job = Job(layout, _config(folder, **kw), seed=123)
    try:
        loaded = job.checkpointer.load(step=-1)
        return {"loaded": loaded, "step": job.train_state.step, "digests": job.digests(), "error": None}
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        job.close()
