"""Transformer Engine ``_extra_state`` payloads of exactly TE's serialised shape, built without TE.

Transformer Engine needs CUDA to install, so these machines cannot run it. What a checkpoint
carries of it is one opaque payload per linear module: TE 2.x's
``TransformerEngineBaseModule.get_extra_state`` for a delayed-scaling (FP8) module returns
``torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)`` with ``state`` =
``{"recipe": DelayedScaling(...), "scale_fwd", "amax_history_fwd", "scale_bwd",
"amax_history_bwd" (CPU fp32 tensors), "extra_fp8_variables": {...}}``. This module builds that
state with classes laid out as TE's ``transformer_engine.common.recipe`` ones (same module
path, names and fields: the pickle names the same globals in the same opcodes), registered in
``sys.modules`` only while a payload is pickled or unpickled, so Megatron's own "is TE
installed" checks never see them. :func:`install` gives Megatron's local linear modules TE's
``get_extra_state`` / ``set_extra_state`` behaviour with such payloads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import pickle
import sys
import types
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

RECIPE = "transformer_engine.common.recipe"
HISTORY = 16  # amax_history_len


class _FormatHelper(NamedTuple):
    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    E2M1 = _FormatHelper(max_fwd=6, max_bwd=6)
    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)


class Recipe:
    _cached_repr: str | None = None


@dataclasses.dataclass(repr=False)
class DelayedScaling(Recipe):
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Any = "max"
    scaling_factor_compute_algo: Any = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None


_CLASSES = {"_FormatHelper": _FormatHelper, "Format": Format, "Recipe": Recipe, "DelayedScaling": DelayedScaling}


@contextlib.contextmanager
def te_recipe_module() -> Iterator[None]:
    """TE's recipe module path resolves to these classes for the duration (and only then)."""
    names = ["transformer_engine", "transformer_engine.common", RECIPE]
    if any(n in sys.modules for n in names):
        raise RuntimeError("a transformer_engine module is already imported; these payloads stand in for it only "
                           "where it is absent")
    module = types.ModuleType(RECIPE)
    for name, cls in _CLASSES.items():
        cls.__module__ = RECIPE
        cls.__qualname__ = name
        setattr(module, name, cls)
    sys.modules.update({"transformer_engine": types.ModuleType("transformer_engine"),
                        "transformer_engine.common": types.ModuleType("transformer_engine.common"), RECIPE: module})
    try:
        yield
    finally:
        for n in names:
            sys.modules.pop(n, None)
        for cls in _CLASSES.values():
            cls.__module__ = __name__


def fp8_state(seed: str) -> dict[str, Any]:
    """A delayed-scaling module's state, its numbers drawn from ``seed``."""
    g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "little"))
    return {
        "recipe": DelayedScaling(margin=0, fp8_format=Format.HYBRID, amax_history_len=HISTORY),
        "scale_fwd": torch.rand(3, generator=g) + 0.5,
        "amax_history_fwd": torch.rand(HISTORY, 3, generator=g),
        "scale_bwd": torch.rand(2, generator=g) + 0.5,
        "amax_history_bwd": torch.rand(HISTORY, 2, generator=g),
        "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": 1, "first_module": False,
                                "autocast_id_fwd": 7, "autocast_id_fwd_stack": [], "seed": seed},
    }


def payload(seed: str) -> torch.Tensor:
    """TE 2.x's serialised form of :func:`fp8_state` (seed)."""
    with te_recipe_module():
        data = pickle.dumps(fp8_state(seed))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode(state: torch.Tensor) -> dict[str, Any] | None:
    """What TE's ``set_extra_state`` unpickles from a payload (None for an empty one)."""
    if state is None or state.numel() == 0:
        return None
    with te_recipe_module():
        return pickle.loads(state.detach().numpy().tobytes())


def digest(state: torch.Tensor | None) -> str | None:
    return None if state is None else hashlib.sha256(state.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


def install(chunks: list[Any], seed: str, received: dict[str, Any]) -> dict[str, str]:
    """Give every module that declares an ``_extra_state`` TE's payload behaviour: ``get_extra_state``
    returns a payload seeded by ``seed``, the module's global key and this rank's TP rank (so TP
    ranks differ, as they may when amaxes are not reduced); ``set_extra_state`` decodes what it is
    handed as TE does and records its digest in ``received`` (by ``chunk:path``). Returns the
    digests of the payloads each module sends, by ``chunk:path``."""
    from megatron.core import parallel_state as ps

    from ckptkit.adapters.megatron.model_space import _expand, unwrap

    sent = {}
    for i, chunk in enumerate(chunks):
        model = unwrap(chunk)
        for path, leaf in list(_expand(model.sharded_state_dict())):
            if not path.endswith("._extra_state"):
                continue
            module = model.get_submodule(path.removesuffix("._extra_state"))
            data = payload(f"{seed}|{leaf.unique_key}|tp{ps.get_tensor_model_parallel_rank()}")
            slot = f"{i}:{path}"
            sent[slot] = digest(data)
            module.get_extra_state = lambda data=data: data

            def set_extra_state(state: Any, slot: str = slot) -> None:
                state_dict = decode(state)
                assert state_dict is None or isinstance(state_dict["recipe"], DelayedScaling)
                received[slot] = digest(state)

            module.set_extra_state = set_extra_state
    return sent


def as_bytes_io(chunks: list[Any]) -> None:
    """Turn every installed module's payload into TE 1.x's form: ``torch.save`` of the state in an
    ``io.BytesIO``."""
    import io

    from ckptkit.adapters.megatron.model_space import _expand, unwrap

    for chunk in chunks:
        model = unwrap(chunk)
        for path, _ in list(_expand(model.sharded_state_dict())):
            if path.endswith("._extra_state"):
                module = model.get_submodule(path.removesuffix("._extra_state"))
                buf = io.BytesIO(module.get_extra_state().numpy().tobytes())
                module.get_extra_state = lambda buf=buf: buf
