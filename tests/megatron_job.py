"""Rank functions for the Megatron tests: train the tiny GPT (tests/megatron_model.py), save, resume.

Each function runs on every rank of a gloo world (tests/worlds.py), sets up
Megatron's parallel state for its layout in that world and tears it down, so
one 4-process world serves every layout of a test module.
"""

from __future__ import annotations

from typing import Any

import torch

from tests import megatron_model as mm

def _options(divisible_by: int) -> Any:
    from ckptkit.adapters import megatron as mckpt

    return mckpt.MegatronOptions(vocab_size=mm.VOCAB, make_vocab_size_divisible_by=divisible_by)


def train_and_save(layout: mm.Layout, folder: str, *, save_step: int, steps: int, asynchronous: bool = True,
                   megatron_folder: str | None = None, megatron_model_folder: str | None = None) -> dict[str, Any]:
    """The uninterrupted reference run: train to ``steps``, saving with ckptkit after ``save_step`` (and, if
    asked, with Megatron's own dist_checkpointing: the whole training state, see :func:`megatron_save`, in the
    distributed optimizer's ``fully_reshardable`` form at ``megatron_folder`` and, for the distributed
    optimizer, in Megatron-LM's default ``dp_reshardable`` form at :func:`dp_reshardable_folder` of it; and
    the model weights alone: what ckptkit's torch_dist import takes for a ChainedOptimizer's MoE job)."""
    from ckptkit.adapters import megatron as mckpt

    t = mm.setup(layout)
    out: dict[str, Any] = {"losses": {}}
    try:
        for _ in range(save_step):
            step = t.iteration + 1
            out["losses"][step] = mm.train_step(t)
        out["eval"] = mm.eval_loss(t)
        out["lr"] = t.optimizer.param_groups[0]["lr"]
        handle = mckpt.save(t.model, folder, optimizer=t.optimizer, scheduler=t.scheduler, iteration=t.iteration,
                            extra={"consumed_samples": 8 * t.iteration}, options=_options(layout.divisible_by),
                            asynchronous=asynchronous)
        if megatron_folder is not None:
            megatron_save(t, megatron_folder)
            if layout.dist_opt:
                megatron_save(t, dp_reshardable_folder(megatron_folder), sharding="dp_reshardable")
        if megatron_model_folder is not None:
            from megatron.core import dist_checkpointing

            dist_checkpointing.save(_model_sd(t), megatron_model_folder)
        for _ in range(save_step, steps):  # training goes on while the checkpoint persists
            step = t.iteration + 1
            out["losses"][step] = mm.train_step(t)
        if asynchronous:
            handle.wait()
            import ckptkit

            ckptkit.close_async()
        out["final_eval"] = mm.eval_loss(t)
        out["grad_norms"] = t.grad_norms
        out["loss_scale"] = loss_scale(t)
        return out
    finally:
        mm.teardown()


def _model_sd(t: mm.Trainer) -> dict[str, Any]:
    """Megatron's sharded state dict of every model chunk, one sub-dict per chunk (as Megatron's trainer nests it)."""
    from ckptkit.adapters.megatron.model_space import unwrap

    return {f"model{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(t.model)}


def resume(layout: mm.Layout, folder: str, *, steps: int, load_optimizer: bool = True,
           save_again: str | None = None, perturb: bool = False) -> dict[str, Any]:
    """A fresh job at ``layout`` loads the checkpoint, reports its eval loss, and trains on to ``steps``.

    ``perturb`` (negative control): scale the final norm's weight by 1.001 right after the load."""
    from ckptkit.adapters import megatron as mckpt

    t = mm.setup(layout, seed=999)  # other initial weights: everything must come from the checkpoint
    try:
        info = mckpt.load(t.model, folder, optimizer=t.optimizer if load_optimizer else None, scheduler=t.scheduler)
        t.iteration = info.iteration
        if perturb:
            _scale_final_norm(t, 1.001)
        out: dict[str, Any] = {"extra": info.extra, "rng_restored": info.rng_restored}
        if save_again is not None:
            mckpt.save(t.model, save_again, optimizer=t.optimizer, scheduler=t.scheduler, iteration=t.iteration,
                       extra=info.extra, options=_options(layout.divisible_by))
        return _train_on(t, out, steps)
    finally:
        mm.teardown()


def resume_then_megatron_save(layout: mm.Layout, folder: str, megatron_folder: str, *, sharding: str) -> None:
    """A fresh job at ``layout`` loads the checkpoint with ckptkit and saves the loaded training state with
    Megatron's own dist_checkpointing (:func:`megatron_save`) at once: the same state, in Megatron's form for
    ``layout``'s groups (an MoE job's expert optimizer per expert-data-parallel group of that layout)."""
    from ckptkit.adapters import megatron as mckpt

    t = mm.setup(layout, seed=999)
    try:
        info = mckpt.load(t.model, folder, optimizer=t.optimizer, scheduler=t.scheduler)
        t.iteration = info.iteration
        megatron_save(t, megatron_folder, sharding=sharding)
    finally:
        mm.teardown()


def controls(layout: mm.Layout, folder: str, *, steps: int) -> dict[str, Any]:
    """The negative controls of the reference comparison, in one call: a resume with the final norm's weight
    scaled by 1.001 after the load, and one that does not load the optimizer (a fresh Adam)."""
    return {"perturbed": resume(layout, folder, steps=steps, perturb=True),
            "fresh_optimizer": resume(layout, folder, steps=steps, load_optimizer=False)}


def _scale_final_norm(t: mm.Trainer, factor: float) -> None:
    from ckptkit.adapters.megatron.model_space import unwrap

    for chunk in t.model:  # the last pipeline stage holds it; with fp32 weights the optimizer's copy is a view
        for name, p in unwrap(chunk).named_parameters():
            if name == "decoder.final_layernorm.weight":
                with torch.no_grad():
                    p.mul_(factor)


def _train_on(t: mm.Trainer, out: dict[str, Any], steps: int) -> dict[str, Any]:
    """Report what a resumed job is compared on (eval, LR, iteration), then train to ``steps``."""
    out.update({"eval": mm.eval_loss(t), "iteration": t.iteration, "lr": t.optimizer.param_groups[0]["lr"],
                "losses": {}, "loss_scale_at_start": loss_scale(t)})
    while t.iteration < steps:
        step = t.iteration + 1
        out["losses"][step] = mm.train_step(t)
    out["final_eval"] = mm.eval_loss(t)
    out["loss_scale"] = loss_scale(t)
    out["grad_norms"] = t.grad_norms
    return out


def loss_scale(t: mm.Trainer) -> float | None:
    """fp16's current loss scale (Megatron's DynamicGradScaler), None in bf16/fp32 training."""
    return float(t.optimizer.get_loss_scale().reshape(-1)[0]) if t.layout.fp16 else None


# ---- Megatron's own checkpointing: the independent route a cross-layout resume is compared with
#
# A resume at another layout reduces in another order, so its losses are not the saving run's to the last bit.
# What it must equal is a run at the *same* layout that starts from the same state by a route that shares no
# code with ckptkit: Megatron's dist_checkpointing save of the whole training state at the saving layout, and
# its load at the new one. Both runs then do the same arithmetic: eval, losses and final eval are == on any
# machine. Megatron-core 0.16 on CPU (torch's Adam, no Apex/TE) needs three fixes on its load path, marked below.

_MEGATRON_OPTIM = {"distrib_optim_sharding_type": "fully_reshardable"}


def _train_state_sd(t: mm.Trainer, *, loading: bool, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """Megatron's sharded state dict of the training state, as Megatron-LM's trainer builds it: every model chunk
    and the optimizer in model space (the distributed optimizer's ``fully_reshardable`` form). ``metadata``: the
    loaded checkpoint's ``content_metadata``, which Megatron-LM's ``load_checkpoint`` builds the state dict it
    loads from when the checkpoint records one (an export by ckptkit does: no ``chained_<i>.`` key prefix)."""
    model = _model_sd(t)
    if loading:
        _create_adam_states(t.optimizer)
    return {**model, "optimizer": t.optimizer.sharded_state_dict(model, is_loading=loading,
                                                                 metadata=metadata or _MEGATRON_OPTIM)}


def dp_reshardable_folder(megatron_folder: str) -> str:
    """Where :func:`train_and_save` puts Megatron's save of the same state in the ``dp_reshardable`` form."""
    return megatron_folder.rstrip("/") + "-dp_reshardable"


def megatron_save(t: mm.Trainer, megatron_folder: str, *, sharding: str = "fully_reshardable") -> None:
    """Megatron's own save of the whole training state, under the keys Megatron-LM's ``save_checkpoint`` uses
    (``generate_state_dict``): model chunks, optimizer, ``opt_param_scheduler``, ``iteration``, ``args``,
    ``checkpoint_version``. So it is also what a user brings to ckptkit's torch_dist import. ``sharding``: the
    distributed optimizer's form; ``dp_reshardable`` (Megatron-LM's default, its per-DP-rank bucket buffers) is
    saved with the ``content_metadata`` Megatron-LM records, which its load builds the state dict from."""
    from megatron.core import dist_checkpointing

    from tests.megatron_convert_job import mlm_args

    if torch.distributed.get_rank() == 0:
        import os

        os.makedirs(megatron_folder, exist_ok=True)
    torch.distributed.barrier()
    metadata = {"distrib_optim_sharding_type": sharding}
    dist_checkpointing.save({**_train_state_sd(t, loading=False, metadata=metadata),
                             "opt_param_scheduler": t.scheduler.state_dict(), "iteration": t.iteration,
                             "args": mlm_args(t.layout), "checkpoint_version": 3.0},
                            megatron_folder, content_metadata=None if sharding == "fully_reshardable" else metadata)


def megatron_reference(layout: mm.Layout, megatron_folder: str, *, steps: int,
                       weights_only: bool = False) -> dict[str, Any]:
    """The reference run at ``layout``: Megatron's own load of :func:`megatron_save`'s checkpoint, then the
    resumed job's steps. ``weights_only``: load the model alone (where Megatron cannot load the optimizer
    at ``layout``): only its first forward is a reference then."""
    from megatron.core import dist_checkpointing

    from ckptkit.adapters.megatron.model_space import unwrap

    t = mm.setup(layout, seed=999)
    try:
        if weights_only:
            loaded = dist_checkpointing.load(_model_sd(t), megatron_folder)
            for i, chunk in enumerate(t.model):
                unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=False)
        else:
            with _step_kept_on_load():
                metadata = dist_checkpointing.load_content_metadata(megatron_folder)
                loaded = dist_checkpointing.load(_train_state_sd(t, loading=True, metadata=metadata), megatron_folder)
                for i, chunk in enumerate(t.model):
                    unwrap(chunk).load_state_dict(loaded[f"model{i}"])
                t.optimizer.load_state_dict(loaded["optimizer"])
            _unshare_adam_steps(t.optimizer)
        common = dist_checkpointing.load_common_state_dict(megatron_folder)
        t.scheduler.load_state_dict(common["opt_param_scheduler"])
        t.iteration = common["iteration"]
        return _train_on(t, {}, steps)
    finally:
        mm.teardown()


def megatron_load_error(layout: mm.Layout, folder: str) -> str | None:
    """What Megatron's own load of model and optimizer from ``folder`` at ``layout`` raises (None: it loaded)."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        megatron_reference(layout, folder, steps=0)
        return None
    except (Exception, CheckpointException) as exc:  # whatever Megatron's load raises: a KeyError, DCP's failure
        return f"{type(exc).__name__}: {exc}"


def _sub_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _create_adam_states(optimizer: Any) -> None:
    """Fix 1: DistributedOptimizer.state_dict() asserts one Adam 'step' over the per-parameter states, which a
    fresh optimizer has not created yet, so ``sharded_state_dict(is_loading=True)`` fails before loading; create
    them as a first step would (the load overwrites every value)."""
    for o in _sub_optimizers(optimizer):
        o.init_state_fn(o.optimizer, o.config)
        for st in o.optimizer.state.values():
            st.setdefault("step", torch.tensor(0.0))


class _step_kept_on_load:
    """Fix 2: DistributedOptimizer.load_state_dict() puts the param groups' 'step' into every per-parameter state,
    then copies the loaded parameter state over every key of it; the loaded parameter state has no 'step' (it
    travels in the param groups), a KeyError. While loading, keep the step the first half restored."""

    def __enter__(self) -> None:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        self.cls, self.orig = DistributedOptimizer, DistributedOptimizer._set_main_param_and_optimizer_states
        orig = self.orig

        def keep_step(opt: Any, model_param: Any, tensors: dict[str, torch.Tensor]) -> None:
            g, o = opt.model_param_group_index_map[model_param]
            state = opt.optimizer.state[opt.optimizer.param_groups[g]["params"][o]]
            step = state.pop("step", None)
            try:
                orig(opt, model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        DistributedOptimizer._set_main_param_and_optimizer_states = keep_step

    def __exit__(self, *exc: Any) -> None:
        self.cls._set_main_param_and_optimizer_states = self.orig


def _unshare_adam_steps(optimizer: Any) -> None:
    """Fix 3: that restored 'step' is one tensor object shared by every parameter's state, and torch's Adam
    increments it in place once per parameter: give each state its own copy, as a trained optimizer has."""
    for o in _sub_optimizers(optimizer):
        for st in o.optimizer.state.values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].clone()


def megatron_reference_eval(layout: mm.Layout, megatron_folder: str) -> float:
    """Megatron's own load of the model alone (e.g. a torch_dist export, which has no optimizer) at ``layout``."""
    from megatron.core import dist_checkpointing

    from ckptkit.adapters.megatron.model_space import unwrap

    t = mm.setup(layout, seed=999)
    try:
        loaded = dist_checkpointing.load(_model_sd(t), megatron_folder)
        for i, chunk in enumerate(t.model):
            unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=False)
        return mm.eval_loss(t)
    finally:
        mm.teardown()


def all_tensors(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint in model space, read through ckptkit.open."""
    import ckptkit

    view = ckptkit.open(folder)
    return {k: view[k].read() for k in view.keys()}


def embedding_after_load(layout: mm.Layout, folder: str) -> dict[str, Any]:
    """This rank's word-embedding shard right after loading (TP ranks 0..tp-1 report), then two steps."""
    from megatron.core import parallel_state as ps

    from ckptkit.adapters import megatron as mckpt
    from ckptkit.adapters.megatron.model_space import unwrap

    t = mm.setup(layout, seed=999)
    try:
        mckpt.load(t.model, folder, optimizer=t.optimizer, scheduler=t.scheduler)
        rows = unwrap(t.model[0]).embedding.word_embeddings.weight.detach().clone()
        losses = [mm.train_step(t) for _ in range(2)]
        keep = ps.get_data_parallel_rank() == 0 and ps.is_pipeline_first_stage()
        return {"rows": rows if keep else torch.empty(0, rows.shape[1]), "losses": losses}
    finally:
        mm.teardown()


def padding_rows_after_load(layout: mm.Layout, folder: str) -> dict[str, Any]:
    """A job that has trained a step (its optimizer holds moments and main copies of its own) loads
    ``folder``: this rank's word-embedding weight, and with the distributed optimizer at DP 1 its main copy
    and Adam moments shaped as the TP-local weight, right after the load (TP ranks of DP rank 0 and the
    first stage report); then two more steps."""
    from megatron.core import parallel_state as ps

    from ckptkit.adapters import megatron as mckpt
    from ckptkit.adapters.megatron.model_space import unwrap

    t = mm.setup(layout, seed=999)
    try:
        mm.train_step(t)
        mckpt.load(t.model, folder, optimizer=t.optimizer, scheduler=t.scheduler)
        weight = unwrap(t.model[0]).embedding.word_embeddings.weight
        out: dict[str, Any] = {"weight": weight.detach().float().clone()}
        if layout.dist_opt and ps.get_data_parallel_world_size() == 1:
            opt = next(o for o in _sub_optimizers(t.optimizer) if weight in o.model_param_group_index_map)
            group, order = opt.model_param_group_index_map[weight]
            main = opt.optimizer.param_groups[group]["params"][order]
            state = opt.optimizer.state[main]
            for name, tensor in (("main", main), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])):
                out[name] = tensor.detach().view(weight.shape).clone()
        out["losses"] = [mm.train_step(t) for _ in range(2)]
        keep = ps.get_data_parallel_rank() == 0 and ps.is_pipeline_first_stage()
        return out if keep else {"losses": out["losses"]}
    finally:
        mm.teardown()


def weights_only_losses(layout: mm.Layout, folder: str, *, megatron_reload: bool) -> list[float]:
    """Load the weights alone (``load_optimizer=False``) into a fresh job with its optimizer, then train three
    steps. ``megatron_reload``: also call ``optimizer.reload_model_params()`` after the load, as Megatron-LM's
    ``load_checkpoint`` does when it loads no optimizer (``--no-load-optim``), the reference."""
    from ckptkit.adapters import megatron as mckpt

    t = mm.setup(layout, seed=999)
    try:
        mckpt.load(t.model, folder, optimizer=t.optimizer, scheduler=t.scheduler, load_optimizer=False)
        if megatron_reload:
            t.optimizer.reload_model_params()
        return [mm.train_step(t) for _ in range(3)]
    finally:
        mm.teardown()


def checkpointer_run(layout: mm.Layout, root: str, *, steps: int, save_again: str | None = None) -> dict[str, Any]:
    """Train with MegatronCheckpointer saving every step (async, keep 2), or resume its newest step
    (``save_again``: save what was restored with the adapter right away, for a bit-exact comparison)."""
    from ckptkit.adapters import megatron as mckpt
    from ckptkit.adapters.megatron import MegatronCheckpointer

    t = mm.setup(layout, seed=999)
    try:
        ckpt = MegatronCheckpointer(t.model, t.optimizer, t.scheduler, root, every_steps=1, keep_last=2,
                                    options=_options(layout.divisible_by))
        info = ckpt.restore_latest()
        if info is not None:
            t.iteration = info.iteration
            if save_again is not None:
                mckpt.save(t.model, save_again, optimizer=t.optimizer, scheduler=t.scheduler, iteration=t.iteration,
                           extra=info.extra, options=_options(layout.divisible_by))
        start = t.iteration
        losses = {}
        while t.iteration < steps:
            step = t.iteration + 1
            losses[step] = mm.train_step(t)
            ckpt.maybe_save(t.iteration, extra={"consumed_samples": 8 * t.iteration})
        ckpt.close()
        return {"start": start, "extra": None if info is None else info.extra, "losses": losses,
                "eval": mm.eval_loss(t), "skipped": [name for name, _ in ckpt.manager.skipped],
                "skipped_why": [why for _, why in ckpt.manager.skipped]}
    finally:
        mm.teardown()


def load_error(layout: mm.Layout, folder: str) -> str | None:
    """The message of the error a load at ``layout`` raises on this rank (None: it loaded)."""
    from ckptkit.adapters import megatron as mckpt
    from ckptkit.errors import CkptkitError

    t = mm.setup(layout, seed=999)
    try:
        mckpt.load(t.model, folder, optimizer=t.optimizer, scheduler=t.scheduler)
        return None
    except CkptkitError as exc:
        return str(exc)
    finally:
        mm.teardown()


def checkpointer_restore_error(layout: mm.Layout, root: str) -> str | None:
    """``MegatronCheckpointer(...).restore_latest()`` in a fresh job on ``root``: the error it raised on this
    rank, or None when it did not raise."""
    from ckptkit.adapters.megatron import MegatronCheckpointer

    t = mm.setup(layout, seed=999)
    try:
        ckpt = MegatronCheckpointer(t.model, t.optimizer, t.scheduler, root, every_steps=1,
                                    options=_options(layout.divisible_by))
        try:
            ckpt.restore_latest()
            return None
        except Exception as exc:  # noqa: BLE001 - the error is the result
            return f"{type(exc).__name__}: {exc}"
        finally:
            ckpt.close()
    finally:
        mm.teardown()
