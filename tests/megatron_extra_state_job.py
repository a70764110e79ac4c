"""Jobs of tests/test_megatron_extra_state.py: the tiny Megatron GPT with Transformer Engine-shaped
FP8 ``_extra_state`` payloads on every linear module (tests/te_payloads.py), saved and loaded by
ckptkit and by Megatron's own ``dist_checkpointing``, reporting what each module was handed."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests import megatron_model as mm
from tests import te_payloads as te


def _options(layout: mm.Layout) -> Any:
    from ckptkit.adapters import megatron as mckpt

    return mckpt.MegatronOptions(vocab_size=mm.VOCAB, make_vocab_size_divisible_by=layout.divisible_by)


def _model_sd(t: mm.Trainer) -> dict[str, Any]:
    from ckptkit.adapters.megatron.model_space import unwrap

    return {f"model{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(t.model)}


def save(layout: mm.Layout, folder: str | None, megatron_folder: str | None = None, *, seed: str = "saved",
         hostile: bytes | None = None, bytes_io: bool = False) -> dict[str, Any]:
    """Save the job's model with ckptkit into ``folder`` (None: not) and with Megatron's own
    ``dist_checkpointing`` into ``megatron_folder``. ``hostile``: the payload rank 0's first module
    sends instead of its own; ``bytes_io``: every module sends TE 1.x's ``io.BytesIO`` form. Returns
    the digests of the payloads each module sent, this rank's TP rank, and what ckptkit's save raised."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from ckptkit.adapters import megatron as mckpt

    t = mm.setup(layout)
    try:
        sent = te.install(t.model, seed, {})
        if hostile is not None and torch.distributed.get_rank() == 0:
            _first_module(t).get_extra_state = lambda: torch.frombuffer(bytearray(hostile), dtype=torch.uint8)
        if bytes_io:
            te.as_bytes_io(t.model)
        error = None
        if folder is not None:
            try:
                mckpt.save(t.model, folder, iteration=1, options=_options(layout))
            except Exception as exc:  # noqa: BLE001 - the test names the class it expects
                error = f"{type(exc).__name__}: {exc}"
        if megatron_folder is not None:
            if torch.distributed.get_rank() == 0:
                os.makedirs(megatron_folder, exist_ok=True)
            torch.distributed.barrier()
            dist_checkpointing.save(_model_sd(t), megatron_folder)
        return {"sent": sent, "tp": ps.get_tensor_model_parallel_rank(), "error": error}
    finally:
        mm.teardown()


def _first_module(t: mm.Trainer) -> Any:
    from ckptkit.adapters.megatron.model_space import _expand, unwrap

    model = unwrap(t.model[0])
    path = next(p for p, _ in _expand(model.sharded_state_dict()) if p.endswith("._extra_state"))
    return model.get_submodule(path.removesuffix("._extra_state"))


def received(layout: mm.Layout, folder: str, *, how: str) -> dict[str, Any]:
    """A fresh job at ``layout`` (its modules hold payloads of their own) loads ``folder`` with ckptkit
    (``how="ckptkit"``) or Megatron's own load (``how="megatron"``, a torch_dist folder): the digest each
    module was handed, and the digests of the payloads it held before."""
    from megatron.core import dist_checkpointing

    from ckptkit.adapters import megatron as mckpt
    from ckptkit.adapters.megatron.model_space import unwrap

    t = mm.setup(layout, seed=999)
    try:
        got: dict[str, Any] = {}
        own = te.install(t.model, "fresh", got)
        if how == "ckptkit":
            mckpt.load(t.model, folder)
        else:
            loaded = dist_checkpointing.load(_model_sd(t), folder)
            for i, chunk in enumerate(t.model):
                unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=False)
        return {"received": got, "own": own}
    finally:
        mm.teardown()


def load_error(layout: mm.Layout, folder: str) -> dict[str, Any]:
    """ckptkit's load of ``folder``: the error it raises, and which modules were handed a payload."""
    from ckptkit.adapters import megatron as mckpt

    t = mm.setup(layout, seed=999)
    try:
        got: dict[str, Any] = {}
        te.install(t.model, "fresh", got)
        try:
            mckpt.load(t.model, folder)
            error = None
        except Exception as exc:  # noqa: BLE001 - the test names the class it expects
            error = f"{type(exc).__name__}: {exc}"
        return {"error": error, "received": got}
    finally:
        mm.teardown()
