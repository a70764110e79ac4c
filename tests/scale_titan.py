"""A torchtitan FSDP2 x TP job of 1,024 ranks, declared on one machine: fake process group, meta tensors.

Why: torchtitan's parallelism is SPMD. Every rank holds the same DTensors
(same mesh, same placements); a rank differs only by its coordinate on the
mesh. So this module builds the job for real on one rank of the world —
torchtitan's own llama3 model (meta device), its ``parallelize_llama`` (TP
through the model's sharding config on the ``tp`` mesh, FSDP2 ``fully_shard``
on the ``fsdp`` mesh), its AdamW ``OptimizersContainer`` — takes the state
the ckptkit torchtitan manager saves (``model`` and ``optimizer`` as FQN-keyed
DTensors), and lets ckptkit classify it (``grid_of``: DTensor placements ->
grid layout). Every other rank's declarations are that rank's coordinate on
the same grids: ckptkit's placement -> piece evaluation
(``GridLayout.local_pieces``) at that coordinate. :func:`check_ranks` builds
chosen other ranks for real and checks they declare exactly that.

What differs from a job: tensors are meta (torchtitan builds its model on
meta first anyway; a job then materialises it), the optimizer's state is
initialised by DCP's own ``_init_optim_state`` on those meta tensors, and
the data loader and LR scheduler are left out (JSON and per-rank values of a
few hundred bytes).
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True)
class TitanJob:
    """torchtitan's llama3 ``flavor`` at FSDP ``dp`` x TP ``tp`` (``layers``: the model object's layer count)."""

    flavor: str = "70B"
    dp: int = 128
    tp: int = 8
    layers: int | None = None

    @property
    def world(self) -> int:
        return self.dp * self.tp

    @property
    def layout(self) -> str:
        return f"fsdp{self.dp}xtp{self.tp}"

    def with_layers(self, layers: int) -> TitanJob:
        return replace(self, layers=layers)

    @property
    def model_layers(self) -> int:
        """The model object's layers: ``layers``, or all of the flavour's."""
        from torchtitan.models.llama3 import model_registry

        return self.layers if self.layers is not None else len(model_registry(self.flavor).model.layers)


def enter_rank(job: TitanJob, rank: int) -> None:
    """A fake process group of ``job.world`` ranks, this process being ``rank``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    warnings.filterwarnings("ignore", category=UserWarning)
    if dist.is_initialized():
        raise RuntimeError("a torchtitan job is built once per process (see check_ranks)")
    hook = sys.excepthook  # each init wraps it to prefix "[rankN]:"
    dist.init_process_group("fake", rank=rank, world_size=job.world, store=FakeStore())
    sys.excepthook = hook


def build(job: TitanJob, rank: int) -> tuple[Any, Any]:
    """This rank's parallelized model (meta) and torchtitan's optimizers container, as the Trainer builds them."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import model_registry

    parallel_dims_module.device_type = "cpu"  # torchtitan picks "cuda" without an accelerator
    enter_rank(job, rank)
    spec = model_registry(job.flavor)
    cfg = spec.model
    if job.layers is not None:
        cfg.layers = cfg.layers[:job.layers]
    dist_utils.set_spmd_backend("partial_dtensor")
    parallelism = ParallelismConfig(data_parallel_shard_degree=job.dp, tensor_parallel_degree=job.tp,
                                    spmd_backend="partial_dtensor")
    training = TrainingConfig(local_batch_size=1, seq_len=8192, steps=1000, mixed_precision_param="bfloat16")

    class _Cfg:  # update_from_config takes any object with these two fields
        pass

    holder = _Cfg()
    holder.parallelism, holder.training = parallelism, training  # type: ignore[attr-defined]
    cfg.update_from_config(config=holder)
    dims = ParallelDims(dp_replicate=1, dp_shard=job.dp, cp=1, tp=job.tp, pp=1, ep=1, world_size=job.world,
                        spmd_backend="partial_dtensor")
    with torch.device("meta"):
        model = cfg.build()
    model = spec.parallelize_fn(model, parallel_dims=dims, training=training, parallelism=parallelism,
                                compile_config=CompileConfig(), ac_config=None, dump_folder="")
    optimizer = default_adamw(lr=1e-4)
    optimizer.implementation = "foreach"
    return model, optimizer.build(model_parts=[model])


def rank_state(job: TitanJob, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s state as :class:`ckptkit.adapters.torchtitan.CkptkitCheckpointManager` saves it
    (``_state_to_save``: ``model`` and ``optimizer`` with routed experts marked; none here)."""
    from torchtitan.components.checkpointer.base import MODEL, OPTIMIZER, ModelWrapper

    from ckptkit.adapters.torchtitan_experts import expert_axes, mark_model, mark_optimizer

    model, optimizers = build(job, rank)
    axes = expert_axes([model])
    return {MODEL: mark_model(ModelWrapper([model]).state_dict(), axes),
            OPTIMIZER: mark_optimizer(optimizers.state_dict(), axes)}


def classified(job: TitanJob, rank: int) -> Any:
    """Rank ``rank`` built for real and classified by ckptkit (as ``ckptkit.save`` does first)."""
    from ckptkit.engine.saver import classify_state
    from ckptkit.engine.state import flatten_state

    return classify_state(flatten_state(rank_state(job, rank)), rank, shapes_only=True)  # meta tensors: planned only


def at_rank(base: Any, rank: int) -> Any:
    """``base`` (one rank's classification) as rank ``rank`` of the same SPMD job declares it: every DTensor
    at ``rank``'s coordinate of its own mesh (its local shape from the grid there), every plain tensor
    on ``rank``'s own one-rank mesh, the values unchanged."""
    from dataclasses import replace as with_

    from ckptkit.layout.grid import GridLayout, Mesh, Replicate

    grid = []
    for d in base.grid:
        coord = d.layout.mesh.coordinate(rank)
        held = d.layout.local_pieces(coord)
        grid.append(with_(d, coord=coord, local_shape=tuple(held[0]) if held else d.local_shape))
    own = Mesh(("rank",), (1,), (rank,))
    plain = [with_(d, layout=GridLayout(own, (Replicate(),), d.layout.shape)) for d in base.plain]
    return with_(base, grid=grid, plain=plain)


def check_ranks(job: TitanJob, base: Any, ranks: list[int]) -> None:
    """Build each of ``ranks`` for real, in a process of its own (a torchtitan job cannot be built twice in one
    process: DTensor's caches keep the first world's meshes), and check it declares exactly what
    :func:`at_rank` derives for it."""
    from tests.scale_layouts_job import _in_own_process

    for rank in ranks:
        spec = {"scenario": "titan-declare", "dp": job.dp, "tp": job.tp, "layers": job.layers, "rank": rank}
        if _in_own_process(spec)["digest"] != declarations_digest(at_rank(base, rank)):
            raise AssertionError(f"rank {rank} declares other tensors, layouts or values than rank 0's at its coordinate")


def declarations_digest(cls: Any) -> str:
    """What a rank declares (every tensor's key, dtype, local shape, layout, coordinate and rule; its values)."""
    import hashlib

    text = repr([[_decl_key(d) for d in getattr(cls, kind)] for kind in ("grid", "plain", "explicit")])
    return hashlib.sha256((text + repr(sorted(cls.values.items()))).encode()).hexdigest()


def _decl_key(d: Any) -> tuple:
    return (d.key, d.dtype, tuple(d.local_shape), d.layout, tuple(d.coord), d.rule)
